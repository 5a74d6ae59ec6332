"""Training data beyond one file: shard directories, weighted blends, their sampler, resuming, bad blends."""

import json
from dataclasses import replace

import numpy as np
import pytest

from modelpar.data import (
    Blend,
    BlendSampler,
    DataError,
    TokenFile,
    open_blend,
    open_dataset,
    prepare_shards,
    train_bpe,
)
from modelpar.data.blend import quotas
from modelpar.testing import run_on_ranks
from modelpar.training.config import BlendEntry, RecipeError, validate
from tests import warm_cli
from tests.helpers import make_config, train_and_collect


def one_line(error, match, fn, *args, **kwargs) -> str:
    with pytest.raises(error, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def epoch_of(sampler_args, dp: int) -> np.ndarray:
    """Every window of one epoch, in global order, gathered from ``dp`` ranks' slices."""
    samplers = [BlendSampler(*sampler_args[:3], dp_rank=r, dp_size=dp, seed=sampler_args[3]) for r in range(dp)]
    steps = samplers[0].steps_per_epoch
    return np.concatenate([np.concatenate([s.next_batch() for s in samplers]) for _ in range(steps)])


# --- the blend sampler -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("weights", [(0.7, 0.3), (0.5, 0.2, 0.3), (1.0, 0.0, 3.0)])
def test_realised_weights_over_an_epoch_are_within_one_percent(weights):
    sizes = [900, 250, 2100][: len(weights)]
    sampler = BlendSampler(sizes, weights, global_batch=24, dp_size=2, seed=3)
    seen = np.concatenate([epoch_of((sizes, weights, 24, 3), dp=2)])
    assert len(seen) == sampler.steps_per_epoch * 24
    realised = np.bincount(sampler.dataset_of(seen), minlength=len(sizes)) / len(seen)
    asked = np.asarray(weights) / sum(weights)
    assert np.abs(realised - asked).max() < 0.01, (realised, asked)


def test_quotas_sum_to_the_epoch_and_follow_the_weights():
    assert quotas([0.7, 0.3], 10) == [7, 3]
    assert quotas([1, 1, 1], 10) == [4, 3, 3]
    assert sum(quotas([0.123, 4.5, 2.2], 997)) == 997


def test_a_dataset_is_walked_in_passes_each_a_permutation():
    sizes, weights = [40, 200], [0.6, 0.4]  # dataset 0 upsampled: 144 picks per epoch from 40 windows
    sampler = BlendSampler(sizes, weights, global_batch=8)
    stream = np.concatenate([sampler._picks(0, epoch, seed=0) for epoch in range(3)])
    for lap in range(len(stream) // 40):
        assert sorted(stream[lap * 40 : (lap + 1) * 40]) == list(range(40))
    big = np.concatenate([sampler._picks(1, epoch, seed=0) for epoch in range(3)]) - 40  # downsampled: 96 per epoch
    assert len(set(big[:200].tolist())) == 200  # no window repeats before the whole dataset was seen


def test_blend_order_is_seeded_and_dp_slices_concatenate_to_the_dp1_batch():
    args = ([300, 500], [0.5, 0.5], 12)
    one = epoch_of((*args, 5), dp=1)
    assert np.array_equal(one, epoch_of((*args, 5), dp=3))
    assert np.array_equal(one, epoch_of((*args, 5), dp=1))
    assert not np.array_equal(one, epoch_of((*args, 6), dp=1))


@pytest.mark.parametrize("stop_after", [3, 66, 67, 70])  # 66 steps per epoch: stop inside and at its edge
def test_blend_resumes_mid_epoch_with_the_same_order(stop_after):
    args = ([300, 500], [0.3, 0.7], 12)
    straight = BlendSampler(*args, seed=2)
    expected = [straight.next_batch() for _ in range(stop_after + 10)]
    first = BlendSampler(*args, seed=2)
    for _ in range(stop_after):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    resumed = BlendSampler(*args, seed=2)
    resumed.load_state_dict(state)
    for want in expected[stop_after:]:
        assert np.array_equal(resumed.next_batch(), want)
    other = BlendSampler([300, 500], [0.5, 0.5], 12, seed=2)
    one_line(DataError, "resume with the same data.blend", other.load_state_dict, state)


# --- windows of shard directories and blends -------------------------------------------------------------------


def corpus(tmp_path, name, n_docs, seed, **kwargs):
    rng = np.random.default_rng(seed)
    path = tmp_path / f"{name}.jsonl"
    with path.open("w") as f:
        for _ in range(n_docs):
            words = rng.choice(["tea", "stone", "river", "map", "lamp"], size=rng.integers(3, 40))
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
    return prepare_shards([path], tmp_path / name, shard_tokens=3000, **kwargs).manifest


def test_a_shard_directory_reads_as_its_shards_one_after_another(tmp_path):
    manifest = corpus(tmp_path, "web", 400, seed=0, val_fraction=0.1)
    windows = open_dataset(tmp_path / "web", vocab_size=256, seq_len=31)
    files = [TokenFile.open(tmp_path / "web" / s["file"], 256, 31) for s in manifest["shards"] if s["tokens"] > 31]
    assert windows.num_windows == sum(f.num_windows for f in files) and len(files) > 2
    order = np.random.default_rng(0).permutation(windows.num_windows)[:50]
    inputs, targets = windows.batch(order)
    flat = [(f, i) for f in files for i in range(f.num_windows)]
    for row, index in enumerate(order):
        file, local = flat[index]
        want_inputs, want_targets = file.window(local)
        assert np.array_equal(inputs[row], want_inputs) and np.array_equal(targets[row], want_targets)


def test_blend_of_different_tokenizers_or_bad_weights_is_one_line(tmp_path):
    corpus(tmp_path, "bytes", 50, seed=0)
    tok = train_bpe(["tea stone river map lamp " * 50], 300)
    tok.backend.add_special_tokens(["<|endoftext|>"])
    tok.save(tmp_path / "tokenizer.json")
    corpus(tmp_path, "bpe", 50, seed=1, tokenizer=tmp_path / "tokenizer.json")
    blend = Blend.of([(tmp_path / "bytes", 0.5), (tmp_path / "bpe", 0.5)])
    message = one_line(DataError, "data.blend mixes tokenizers", open_blend, blend, 512, 16)
    assert "same tokenizer" in message
    one_line(DataError, r"blend\[1\].weight=-0.3 must be a finite number >= 0", Blend.of, [("a", 1.0), ("b", -0.3)])
    one_line(DataError, "weights sum to 0", Blend.of, [("a", 0.0), ("b", 0.0)])


@pytest.mark.parametrize(
    "blend, path, match",
    [
        ([BlendEntry("a", 0.7), BlendEntry("b", -0.3)], "", r"data.blend\[1\].weight=-0.3 must be a finite number"),
        ([BlendEntry("a", 0.0), BlendEntry("b", 0.0)], "", "data.blend weights sum to 0"),
        ([BlendEntry("", 1.0)], "", r"data.blend\[0\].path is empty"),
        ([BlendEntry("a", 1.0)], "x.npy", "data.path='x.npy' and data.blend are both set"),
    ],
)
def test_recipe_blend_errors_are_one_line(tmp_path, blend, path, match):
    cfg = make_config(tmp_path)
    cfg = replace(cfg, data=replace(cfg.data, blend=blend, path=path))
    one_line(RecipeError, match, validate, cfg)


def test_blend_is_written_in_a_recipe_override(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from modelpar.training.config import RECIPES, register_schema

    register_schema()
    override = f"data.blend=[{{path: {tmp_path}/a, weight: 0.7}}, {{path: {tmp_path}/b, weight: 0.3}}]"
    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        overrides = ["data=blend", override, f"trainer.out_dir={tmp_path}"]
        cfg = OmegaConf.to_object(compose(config_name="train", overrides=overrides))
    assert cfg.data.blend == [BlendEntry(f"{tmp_path}/a", 0.7), BlendEntry(f"{tmp_path}/b", 0.3)]
    assert cfg.data.path == "" and cfg.data.seq_len == 1024


# --- training on a blend ---------------------------------------------------------------------------------------


def test_a_blend_trains_and_resumes_bit_exact_and_refuses_changed_data(tmp_path):
    corpus(tmp_path, "web", 300, seed=0, val_fraction=0.1)
    code = tmp_path / "code.npy"
    np.save(code, np.random.default_rng(1).integers(0, 256, size=3000, dtype=np.uint16))
    cfg = make_config(tmp_path / "run", pp=2)
    cfg = replace(
        cfg,
        model=replace(cfg.model, vocab_size=256),
        data=replace(cfg.data, blend=[BlendEntry(str(tmp_path / "web"), 0.7), BlendEntry(str(code), 0.3)]),
        trainer=replace(cfg.trainer, steps=4),
    )
    validate(cfg)
    from modelpar.training.preflight import resolve_data

    blend, val = resolve_data(cfg)
    assert isinstance(blend, Blend) and val == str(tmp_path / "web" / "val")
    (straight, _), _ = run_on_ranks(2, train_and_collect, cfg, blend, None, (2,))
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000002"
    (resumed, _), _ = run_on_ranks(2, train_and_collect, cfg, blend, str(ckpt))
    assert resumed == straight[2:]  # the same windows in the same order: bit for bit the same losses

    np.save(code, np.random.default_rng(2).integers(0, 256, size=3000, dtype=np.uint16))
    from modelpar.testing import RankError

    with pytest.raises(RankError, match="is not the data .* was trained on"):
        run_on_ranks(2, train_and_collect, cfg, blend, str(ckpt))


def test_preflight_takes_a_shard_directory_and_its_held_out_split(tmp_path):
    from modelpar.training.preflight import preflight

    corpus(tmp_path, "web", 200, seed=4, val_fraction=0.1)
    cfg = make_config(tmp_path / "run")
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=256), data=replace(cfg.data, path=str(tmp_path / "web")))
    assert preflight(cfg) == (str(tmp_path / "web"), str(tmp_path / "web" / "val"), None)
    small = replace(cfg, model=replace(cfg.model, vocab_size=200))
    one_line(DataError, "tokenised with a 256-id vocabulary but vocab_size is 200", preflight, small)


def test_train_and_eval_commands_take_a_blend(tmp_path):
    import sys

    from tests.helpers import TINY

    corpus(tmp_path, "web", 300, seed=0, val_fraction=0.1)
    code = tmp_path / "code.npy"
    np.save(code, np.random.default_rng(1).integers(0, 256, size=3000, dtype=np.uint16))
    blend = f"data.blend=[{{path: {tmp_path / 'web'}, weight: 0.7}}, {{path: {code}, weight: 0.3}}]"
    model = [f"model.{k}={getattr(TINY, k)}" for k in ("hidden", "layers", "heads", "kv_heads", "ffn_hidden")]
    common = [blend, *model, "model.vocab_size=256", "data.seq_len=16", "data.global_batch=8", "parallel=single"]
    run = tmp_path / "run"
    train = warm_cli.run(
        [sys.executable, "-m", "modelpar.cli.train", *common, "trainer.steps=2", "trainer.progress=false",
         f"trainer.out_dir={run}", f"hydra.run.dir={run}", "trainer.sample_tokens=8"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr
    assert "--- continuation ---" in train.stdout
    evaluated = warm_cli.run(
        [sys.executable, "-m", "modelpar.cli.eval", *common, f"eval.checkpoint={run / 'checkpoints'}",
         "eval.windows=4", f"hydra.run.dir={tmp_path / 'eval'}"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr
    result = json.loads(evaluated.stdout.strip().splitlines()[-1])
    losses = result["eval_loss_by_dataset"]
    assert list(losses) == [str(tmp_path / "web" / "val"), str(code)]  # each dataset's held-out split
    assert result["eval_loss"] == pytest.approx(0.7 * losses[str(tmp_path / "web" / "val")] + 0.3 * losses[str(code)])
