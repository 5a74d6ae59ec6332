"""Continued pretraining of the released-style families, end to end through the console scripts: a random
Llama-3.1 (llama3 RoPE scaling), DeepSeek-V3 (its released YaRN block) and Qwen2.5 (attention biases, YaRN), each
saved by transformers in at least three shards, trained a few steps by modelpar-train with
``trainer.init_from=<the directory>`` at tp2 x pp2, exported by ``modelpar-ckpt export-hf`` in shards, and loaded
by transformers, whose loss equals modelpar-eval's on the same windows."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from modelpar.cli.ckpt import main as ckpt_main
from modelpar.model.hf_files import HFWeights
from tests import warm_cli

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

TOL = 1e-5
SEQ = 16
VOCAB = 96
WINDOWS = 2  # evaluated
STEPS = 2
RUN = [  # the default recipe's layout (tp2 x pp2, 1F1B), a small batch
    "data.seq_len=16", "data.global_batch=4", "parallel.microbatches=2", "trainer.progress=false",
    "trainer.sample_tokens=0", "trainer.log_every=1", "trainer.timeout_s=90", f"trainer.steps={STEPS}",
    f"trainer.ckpt_every={STEPS}",
]  # fmt: skip
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False,
)  # fmt: skip
# head dim 8 at theta 500 with an original length of 16 (8 for V3): the scaling changes every model's loss
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # fmt: skip
QWEN_YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 16}
V3_YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
           "mscale_all_dim": 1.0, "original_max_position_embeddings": 8}  # fmt: skip
V3_SHAPE = dict(
    moe_intermediate_size=16, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
    n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, kv_lora_rank=12, q_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rope_interleave=True,
)  # fmt: skip
FAMILIES = {  # name: (model class, config class, fields)
    "llama3.1": ("LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=2, rope_parameters=LLAMA3)),
    "deepseek-v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(V3_SHAPE, rope_parameters=V3_YARN)),
    "qwen2.5": ("Qwen2ForCausalLM", "Qwen2Config", dict(num_key_value_heads=2, rope_parameters=QWEN_YARN)),
}


def _shards(path) -> int:
    return len(list(path.glob("model-*-of-*.safetensors")))


def _loss(model, windows: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).double(), windows[:, 1:].flatten()).item()


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """The three HF directories (>= 3 shards each), the training tokens (one window repeated, so every batch is
    that window), the evaluation tokens and windows, and each source model's loss on the training window."""
    root = tmp_path_factory.mktemp("released")
    rng = np.random.default_rng(0)
    window = rng.integers(0, VOCAB, size=SEQ)
    np.save(root / "train.npy", np.tile(window, 64).astype(np.uint16))
    train_window = torch.from_numpy(np.tile(window, 2)[: SEQ + 1].astype(np.int64))[None]
    eval_tokens = rng.integers(0, VOCAB, size=SEQ * WINDOWS + 1).astype(np.uint16)
    np.save(root / "eval.npy", eval_tokens)
    ids = torch.from_numpy(eval_tokens.astype(np.int64))
    eval_windows = torch.stack([ids[i * SEQ : i * SEQ + SEQ + 1] for i in range(WINDOWS)])
    start = {}
    for name, (model_cls, config_cls, fields) in FAMILIES.items():
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **fields)).eval()
        with torch.no_grad():  # norms away from one, biases away from zero: a lost one shows
            for param_name, param in model.named_parameters():
                if param_name.endswith("norm.weight"):
                    param.normal_(1.0, 0.2)
                elif param_name.endswith("proj.bias"):
                    param.normal_(0.0, 0.5)
        model.save_pretrained(root / name, max_shard_size="16KB")
        assert _shards(root / name) >= 3, name
        start[name] = (_loss(model, train_window), _loss(model, eval_windows))
    return root, eval_windows, start


def _cli(module: str, *args: str) -> subprocess.CompletedProcess:
    return warm_cli.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_continued_from_the_hf_directory_at_tp2_pp2_exports_in_shards_with_modelpar_evals_loss(
    released, tmp_path, name
):
    root, eval_windows, (start_loss, start_eval) = *released[:2], released[2][name]
    run = tmp_path / "run"
    proc = _cli(
        "modelpar.cli.train", *RUN, f"hydra.run.dir={run}", f"trainer.init_from={root / name}",
        f"data.path={root / 'train.npy'}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"from the Hugging Face directory {root / name}" in proc.stdout, proc.stdout[-2000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = {row["step"]: row["loss"] for row in rows}
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    assert abs(losses[1] - start_loss) <= TOL * start_loss, (losses, start_loss)  # step 1 ran transformers' model

    hf_dir = tmp_path / "hf"
    assert ckpt_main(["export-hf", str(run / "checkpoints"), str(hf_dir), "--max-shard-size", "24KB"]) == 0
    assert _shards(hf_dir) >= 2
    with HFWeights(root / name) as read, HFWeights(hf_dir) as written:
        assert sorted(written.keys()) == sorted(read.keys())  # every tensor transformers saved, no other
    exported = getattr(transformers, FAMILIES[name][0]).from_pretrained(hf_dir).eval()
    source = FAMILIES[name][2]["rope_parameters"]
    assert {k: exported.config.rope_parameters[k] for k in source} == source  # the scaling travelled
    want = _loss(exported, eval_windows)
    assert abs(want - start_eval) > 10 * TOL * start_eval  # it trained: these are not the source's weights

    proc = _cli(
        "modelpar.cli.eval", f"eval.checkpoint={run / 'checkpoints'}", f"data.path={root / 'eval.npy'}",
        f"eval.windows={WINDOWS}", "data.seq_len=16", "parallel=single",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])["eval_loss"]
    assert abs(got - want) <= TOL * want, (got, want)
