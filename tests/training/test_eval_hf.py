"""A Hugging Face model evaluates as a new user runs it: import-hf, then modelpar-eval with no model overrides."""

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

SEQ = 128  # the default recipe's data.seq_len
WINDOWS = 6  # the default recipe's 4 micro-batches do not divide it


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A random LlamaForCausalLM (a shape unlike the default recipe's), imported; tokens; transformers' loss."""
    root = tmp_path_factory.mktemp("hf")
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500.0,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(root / "llama")
    tokens = np.random.default_rng(0).integers(0, 300, size=SEQ * WINDOWS + 1, dtype=np.uint16)
    np.save(root / "tokens.npy", tokens)
    assert ckpt_main(["import-hf", str(root / "llama"), str(root / "ckpt")]) == 0
    ids = torch.from_numpy(tokens.astype(np.int64))
    windows = torch.stack([ids[i * SEQ : i * SEQ + SEQ + 1] for i in range(WINDOWS)])
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 300).double(), windows[:, 1:].reshape(-1)).item()
    first_two = torch.nn.functional.cross_entropy(
        logits[:2].reshape(-1, 300).double(), windows[:2, 1:].reshape(-1)
    ).item()
    return root, loss, first_two


def eval_cli(*overrides):
    return warm_cli.run(
        [sys.executable, "-m", "modelpar.cli.eval", *overrides], capture_output=True, text=True, timeout=240
    )


def assert_eval_loss(proc, want: float) -> None:
    """modelpar-eval exited 0 and its last line's loss is ``want`` within 1e-5."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])["eval_loss"]
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def assert_imported_eval_gives_transformers_loss(model, path) -> None:
    """``model`` (a transformers CausalLM over a 300-token vocabulary) saved, imported with modelpar-ckpt and
    evaluated on one device over two windows with no model overrides: the loss is transformers'."""
    model.save_pretrained(path / "hf")
    tokens = np.random.default_rng(0).integers(0, 300, size=SEQ * 2 + 1, dtype=np.uint16)
    np.save(path / "tokens.npy", tokens)
    assert ckpt_main(["import-hf", str(path / "hf"), str(path / "ckpt")]) == 0
    ids = torch.from_numpy(tokens.astype(np.int64))
    windows = torch.stack([ids[i * SEQ : i * SEQ + SEQ + 1] for i in range(2)])
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 300).double(), windows[:, 1:].reshape(-1)).item()
    proc = eval_cli(
        f"eval.checkpoint={path / 'ckpt'}", f"data.path={path / 'tokens.npy'}", "eval.windows=2", "parallel=single"
    )
    assert_eval_loss(proc, want)


def test_eval_of_an_imported_model_needs_no_model_overrides_and_gives_transformers_loss(imported):
    root, want, _ = imported
    proc = eval_cli(f"eval.checkpoint={root / 'ckpt'}", f"data.path={root / 'tokens.npy'}", f"eval.windows={WINDOWS}")
    assert_eval_loss(proc, want)
    assert "parallel.microbatches=3" in proc.stdout  # chosen to divide the 6 windows, and said


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_the_kernel_backend_is_not_part_of_the_model(imported, kernels):
    root, _, want = imported  # two windows: the Triton kernels run under the (slow) interpreter on CPU
    proc = eval_cli(
        f"eval.checkpoint={root / 'ckpt'}", f"data.path={root / 'tokens.npy'}", "eval.windows=2",
        f"model.kernels={kernels}", "parallel=single", "parallel.microbatches=2",
    )  # fmt: skip
    assert_eval_loss(proc, want)


def test_a_real_conflict_names_the_field_and_both_values(imported):
    root, _, _ = imported
    proc = eval_cli(f"eval.checkpoint={root / 'ckpt'}", f"data.path={root / 'tokens.npy'}", "model.hidden=64")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "hidden=48" in lines[0] and "model.hidden=64" in lines[0], lines[0]


# -- each window split over cp ranks ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.cp=2"],
        ["parallel.cp=2", "parallel.tp=2", "parallel.cp_comm=allgather"],
        # Ulysses: heads exchanged by all-to-all (4 heads, 2 kv heads: two heads and one kv head a rank)
        ["parallel.cp=2", "parallel.cp_comm=alltoall"],
    ],
)
def test_eval_at_cp_gives_transformers_loss(imported, layout):
    root, want, _ = imported
    proc = eval_cli(
        f"eval.checkpoint={root / 'ckpt'}", f"data.path={root / 'tokens.npy'}", f"eval.windows={WINDOWS}",
        "parallel=single", "parallel.microbatches=2", *layout,
    )  # fmt: skip
    assert_eval_loss(proc, want)


def test_eval_under_hybrid_cp_gives_transformers_loss(imported):
    """All-to-all inside pairs of cp ranks (4 heads, 2 kv heads: one kv head each), a ring across the pairs; two
    windows, one micro-batch each, to keep four ranks cheap."""
    root, _, want = imported
    proc = eval_cli(
        f"eval.checkpoint={root / 'ckpt'}", f"data.path={root / 'tokens.npy'}", "eval.windows=2",
        "parallel=single", "parallel.microbatches=2", "parallel.cp=4", "parallel.cp_comm=hybrid", "parallel.cp_a2a=2",
    )  # fmt: skip
    assert_eval_loss(proc, want)


def test_an_imported_mixtral_evaluates_with_no_model_overrides(tmp_path):
    config = transformers.MixtralConfig(
        vocab_size=300, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        rms_norm_eps=1e-5,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    assert_imported_eval_gives_transformers_loss(model, tmp_path)


def test_an_imported_deepseek_v3_evaluates_with_no_model_overrides(tmp_path):
    """Latent attention, sigmoid group-limited routing with a balancing bias, a shared expert and a dense first
    layer, all from the checkpoint: the recipe's dense GQA model is not what runs."""
    config = transformers.DeepseekV3Config(
        vocab_size=300, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, kv_lora_rank=12, q_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=64, rms_norm_eps=1e-5,
        initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.3, -0.2, 0.1, -0.4]))
    assert_imported_eval_gives_transformers_loss(model, tmp_path)


@pytest.mark.parametrize("family", ["qwen2.5-yarn", "deepseek-v3-yarn"])
def test_an_imported_scaled_or_biased_model_evaluates_with_no_model_overrides(tmp_path, family):
    """RoPE scaling (YaRN: trained length 32, evaluated at 128; DeepSeek-V3's with its softmax mscale) and q/k/v
    biases come from the checkpoint's index: the recipe's unscaled, unbiased model is not what runs."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=300, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.2,
    )  # fmt: skip
    yarn = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 32}
    if family == "qwen2.5-yarn":
        model = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**common, num_key_value_heads=2, rope_parameters=yarn)
        )
    else:
        v3_yarn = yarn | {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
        model = transformers.DeepseekV3ForCausalLM(
            transformers.DeepseekV3Config(
                **common,
                num_key_value_heads=4,
                n_shared_experts=1,
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                n_group=2,
                topk_group=1,
                first_k_dense_replace=1,
                kv_lora_rank=12,
                q_lora_rank=16,
                qk_nope_head_dim=8,
                qk_rope_head_dim=4,
                v_head_dim=6,
                rope_parameters=v3_yarn,
            )
        )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.bias"):
                param.normal_(0.0, 0.5)
    assert_imported_eval_gives_transformers_loss(model.eval(), tmp_path)
