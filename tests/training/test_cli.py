"""The command-line tools: bad input is one clear line before any rank starts; conversions round-trip."""

import json
import sys

import numpy as np
import pytest
import torch

from modelpar.cli.ckpt import main as ckpt_main
from modelpar.cli.generate import load_single_device_model
from modelpar.testing import run_on_ranks
from tests import warm_cli
from tests.helpers import TINY, make_config, train_and_collect


def train_cli(*overrides, cwd=None):
    return warm_cli.run(
        [sys.executable, "-m", "modelpar.cli.train", *overrides],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0
    return lines[-1] if lines else ""


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, TINY.vocab_size, size=4000, dtype=np.uint16))
    return path


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["parallel.tp=3"], "tp=3 does not divide heads=4; try tp in [1, 2, 4]"),
        (["parallel.microbatches=3"], "parallel.microbatches=3 does not divide the 16 sequences per dp replica"),
        (["parallel.schedule=pipedream"], "parallel.schedule='pipedream' is unknown; choose one of"),
        (["parallel.collectives=tree"], "parallel.collectives='tree' is unknown; choose one of auto, native, exchange"),
        (["parallel.recompute=some"], "parallel.recompute='some' must be one of none, selective, full"),
        (["trainer.cpu_affinity=numa"], "trainer.cpu_affinity='numa' must be one of auto, off"),
        (["trainer.gloo_threads=low"], "trainer.gloo_threads='low' must be one of idle, normal"),
        (
            ["parallel.partition=explicit", "parallel.stage_layers=[2.25,1.75]"],
            "parallel.stage_layers=[2.25, 1.75] must list pp*vpp=2 whole or half (e.g. 4.5) counts",
        ),
        (["data.seq_len=4096"], "data.seq_len=4096 exceeds model.max_seq_len=256"),
        (["optim.lr=-1"], "optim.lr=-1.0 must be >= 0"),
        (["trainer.log_every=0"], "trainer.log_every=0 must be >= 1"),
        (["data.path=/nonexistent/tokens.npy"], "/nonexistent/tokens.npy"),
        (["trainer.resume=/nonexistent/ckpt"], "/nonexistent/ckpt is not a checkpoint directory"),
    ],
)
def test_bad_recipe_is_one_line_before_any_rank_starts(overrides, needle, tmp_path):
    proc = train_cli(*overrides, f"hydra.run.dir={tmp_path}")
    line = error_line(proc)
    assert proc.returncode == 2, proc.stderr
    assert line.startswith("modelpar-train: error: ") and needle in line, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "override, needle",
    [
        ("model.hiden=3", "model.hiden is not a recipe key; did you mean model.hidden?"),
        ("trainer.steps=many", "trainer.steps"),
    ],
)
def test_unknown_key_and_wrong_type_are_rejected_by_the_schema(override, needle, tmp_path):
    proc = train_cli(override, f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_token_file_with_ids_beyond_vocab_is_named(tmp_path):
    bad = tmp_path / "bad.npy"
    np.save(bad, np.full(5000, 300, dtype=np.uint16))
    proc = train_cli(f"data.path={bad}", f"hydra.run.dir={tmp_path / 'run'}")
    line = error_line(proc)
    assert "300" in line and "vocab" in line and str(bad) in line, line


@pytest.fixture(scope="module")
def checkpoint(tokens, tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    run_on_ranks(4, train_and_collect, make_config(root, tp=2, pp=2), str(tokens), None, (3,))
    return root / "checkpoints" / "step-00000003"


def test_truncated_checkpoint_is_one_line(checkpoint, tmp_path, capsys):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    shard = copy / "model-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert ckpt_main(["verify", str(copy)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model-00003.safetensors" in err and "truncated" in err


def test_export_hf_loads_in_transformers_with_equal_logits_and_reimports_exactly(checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_dir, back = tmp_path / "hf", tmp_path / "back"
    assert ckpt_main(["export-hf", str(checkpoint), str(hf_dir)]) == 0
    ours = load_single_device_model(checkpoint)
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, TINY.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours(ids)[..., : TINY.vocab_size]
        got = hf(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert ckpt_main(["import-hf", str(hf_dir), str(back)]) == 0
    again = load_single_device_model(back / "step-00000000")
    for name, tensor in ours.full_state().items():
        assert torch.equal(again.full_state()[name], tensor), name


def test_reshard_writes_a_loadable_checkpoint_of_the_new_layout(checkpoint, tmp_path):
    dst = tmp_path / "tp4"
    assert ckpt_main(["reshard", str(checkpoint), str(dst), "--tp", "4"]) == 0
    assert ckpt_main(["verify", str(dst)]) == 0
    a, b = load_single_device_model(checkpoint), load_single_device_model(dst / "step-00000003")
    assert all(torch.equal(t, b.full_state()[n]) for n, t in a.full_state().items())
    assert len(list(dst.glob("step-*/model-*.safetensors"))) == 4
    # the Adam moments travel too, as logical tensors equal to the source's
    from modelpar.checkpoint.store import Piece, load_pieces, read_index

    src_index, dst_index = read_index(checkpoint), read_index(dst / "step-00000003")
    assert dst_index["optimizer_step"] == src_index["optimizer_step"] == 3
    moments = src_index["optimizer_tensors"]
    assert set(dst_index["optimizer_tensors"]) == set(moments) and len(moments) > 0
    for name, entry in moments.items():
        shape = tuple(entry["global_shape"])
        whole = Piece(name, shape, tuple((0, n) for n in shape))
        src = load_pieces(checkpoint, src_index, [whole], table="optimizer_tensors")[whole]
        got = load_pieces(dst / "step-00000003", dst_index, [whole], table="optimizer_tensors")[whole]
        assert torch.equal(src, got), name
    assert ckpt_main(["reshard", str(checkpoint), str(dst), "--tp", "2"]) == 2  # never overwrites


TINY_OVERRIDES = [
    f"model.{k}={getattr(TINY, k)}" for k in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden")
] + [f"model.max_seq_len={TINY.max_seq_len}", "data.seq_len=16"]


@pytest.mark.parametrize("parallel", ["single", "tp2-pp2"])
def test_eval_under_any_layout_equals_the_single_device_loss(checkpoint, tokens, parallel):
    from modelpar.data import TokenFile

    windows = 8
    proc = warm_cli.run(
        [sys.executable, "-m", "modelpar.cli.eval", f"eval.checkpoint={checkpoint}", f"eval.windows={windows}",
         f"data.path={tokens}", f"parallel={parallel}", "parallel.microbatches=2", *TINY_OVERRIDES],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    model = load_single_device_model(checkpoint)
    inputs, targets = TokenFile.open(tokens, TINY.vocab_size, 16).batch(range(windows))
    with torch.no_grad():
        logits = model(inputs)[..., : TINY.vocab_size]
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, TINY.vocab_size), targets.reshape(-1))
    assert result["eval_loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert result["windows"] == windows and result["tokens"] == windows * 16


def test_multirun_sweeps_layouts_with_equal_losses(tmp_path):
    proc = warm_cli.run(
        [sys.executable, "-m", "modelpar.cli.train", "-m", "parallel=single,tp2", "trainer.steps=2",
         "trainer.progress=false", "trainer.sample_tokens=0", "model.layers=2", "data.corpus_max_bytes=200000",
         f"hydra.sweep.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = [[json.loads(line)["loss"] for line in (tmp_path / job / "metrics.jsonl").read_text().splitlines()]
            for job in ("0", "1")]  # fmt: skip
    assert len(runs[0]) == 2
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-5)
