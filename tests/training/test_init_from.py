"""Continued pretraining (``trainer.init_from``): a fresh run at tp2 x pp2 starts from a sharded Hugging Face
directory's or an imported checkpoint's weights, with the model they describe and no model overrides; a rerun
resumes from the run's own checkpoint."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from modelpar.cli.ckpt import main as ckpt_main
from tests import warm_cli

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SEQ = 16
VOCAB = 96
RUN = [  # the default recipe's layout (tp2 x pp2, 1F1B), a small batch
    "data.seq_len=16", "data.global_batch=4", "parallel.microbatches=2", "trainer.progress=false",
    "trainer.sample_tokens=0", "trainer.log_every=1", "trainer.timeout_s=90",
]  # fmt: skip


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A random LlamaForCausalLM in >= 3 shards; tokens repeating one window, so every batch is that window;
    transformers' loss on it."""
    root = tmp_path_factory.mktemp("init")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=500.0,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(root / "llama", max_shard_size="20KB")
    assert len(list((root / "llama").glob("model-*-of-*.safetensors"))) >= 3
    window = np.random.default_rng(0).integers(0, VOCAB, size=SEQ)
    np.save(root / "tokens.npy", np.tile(window, 64).astype(np.uint16))
    ids = torch.from_numpy(np.tile(window, 2)[: SEQ + 1].astype(np.int64))
    with torch.no_grad():
        logits = model(ids[None, :-1]).logits[0]
    return root, torch.nn.functional.cross_entropy(logits.double(), ids[1:]).item()


def train_cli(run_dir, *overrides):
    return warm_cli.run(
        [sys.executable, "-m", "modelpar.cli.train", *RUN, f"hydra.run.dir={run_dir}", *overrides],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows]
    assert len(steps) == len(set(steps)), steps  # no step written twice
    return {row["step"]: row["loss"] for row in rows}


def test_init_from_a_sharded_hf_directory_trains_and_a_rerun_resumes_from_the_runs_checkpoint(source, tmp_path):
    root, want = source
    run = tmp_path / "run"
    args = [f"trainer.init_from={root / 'llama'}", f"data.path={root / 'tokens.npy'}", "trainer.ckpt_every=2"]
    proc = train_cli(run, *args, "trainer.steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"weights of llama from the Hugging Face directory {root / 'llama'}" in proc.stdout, proc.stdout
    first = losses(run)
    assert abs(first[1] - want) <= 1e-5 * want, (first, want)  # step 1 ran transformers' model
    assert first[2] < first[1]  # and it trains
    again = train_cli(run, *args, "trainer.steps=3")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from {run / 'checkpoints' / 'step-00000002'}" in again.stdout, again.stdout
    assert sorted(losses(run)) == [1, 2, 3] and losses(run)[2] == first[2]


def test_init_from_an_imported_checkpoint_root_follows_latest(source, tmp_path):
    root, want = source
    assert ckpt_main(["import-hf", str(root / "llama"), str(tmp_path / "imported"), "--dtype", "fp32"]) == 0
    run = tmp_path / "run"
    proc = train_cli(
        run, f"trainer.init_from={tmp_path / 'imported'}", f"data.path={root / 'tokens.npy'}", "trainer.steps=1"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"weights of llama from the checkpoint {tmp_path / 'imported' / 'step-00000000'}" in proc.stdout
    assert abs(losses(run)[1] - want) <= 1e-5 * want


@pytest.mark.parametrize(
    "override, needle",
    [
        ("model.hidden=64", "holds a model with hidden=32, but this run sets model.hidden=64; drop model.hidden"),
        ("trainer.resume=/some/ckpt", "both name weights to start from; keep one"),
    ],
)
def test_a_disagreeing_recipe_is_one_line_before_any_rank_starts(source, tmp_path, override, needle):
    root, _ = source
    proc = train_cli(tmp_path, f"trainer.init_from={root / 'llama'}", f"data.path={root / 'tokens.npy'}", override)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and lines and needle in lines[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_resume_from_a_checkpoints_root_follows_latest(tmp_path):
    from modelpar.model.config import ModelConfig
    from modelpar.training.config import TrainConfig, TrainerConfig
    from modelpar.training.preflight import resolve_resume
    from tests.helpers import save_whole_model_checkpoint

    step = save_whole_model_checkpoint(
        tmp_path / "ckpts", ModelConfig(vocab_size=32, hidden=16, layers=1, heads=2, kv_heads=2)
    )
    cfg = TrainConfig(trainer=TrainerConfig(resume=str(tmp_path / "ckpts"), out_dir=str(tmp_path / "run")))
    assert resolve_resume(cfg) == str(step)
