"""Hugging Face GPT-OSS interop: sinks, q/k/v/o biases, sliding and full layers, YaRN, a mixture of experts with
router and expert biases, a clamped gated activation and fused interleaved gate_up experts give transformers'
loss and the single-device gradients on every layout (experts over ep with their biases); export round-trips."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from modelpar.model.config import ModelConfig, MoEConfig
from modelpar.model.hf import config_from_hf, config_to_hf
from modelpar.model.rope import RopeScaling
from modelpar.model.structure import BlockStructure
from modelpar.parallel.layout import ParallelLayout
from modelpar.testing import run_on_ranks
from tests.model.layouts import IDS, check_against_reference, check_import_export, reference_loss_and_grads, run_layouts

transformers = pytest.importorskip("transformers")

TOL = 1e-5
ROPE = {
    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4, "beta_fast": 32.0, "beta_slow": 1.0,
    "rope_theta": 150000.0, "truncate": False,
}  # fmt: skip
SHAPE = dict(
    vocab_size=61, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
    sliding_window=3, initializer_range=0.2, rope_parameters=ROPE, layer_types=["sliding_attention", "full_attention"],
    swiglu_limit=0.5,  # low enough that this tiny model's gates and ups reach the clamp
)  # fmt: skip


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A random GptOssForCausalLM directory (biases and sinks away from zero, norms from one) and its loss."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**SHAPE)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "bias")):
                param.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
        logits = model(IDS[:, :-1]).logits
    path = tmp_path_factory.mktemp("hf") / "gpt_oss"
    model.save_pretrained(path)
    return path, F.cross_entropy(logits.flatten(0, 1), IDS[:, 1:].flatten()).item()


def test_gpt_oss_config_maps_every_field(gpt_oss):
    moe = MoEConfig(experts=4, top_k=2, ffn_hidden=16, bias=True, activation="clamped_swiglu", swiglu_limit=0.5)
    rope = RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=4, beta_fast=32.0, beta_slow=1.0,
                       truncate=False)  # fmt: skip
    assert config_from_hf(gpt_oss[0]) == ModelConfig(
        vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=16, max_seq_len=16,
        rope_theta=150000.0, rope_scaling=rope, norm_eps=1e-5, init_std=0.2, sliding_window=3, window_layers=[0],
        attention_bias=True, attention_out_bias=True, moe=moe, block=BlockStructure(attention_sinks=True),
    )  # fmt: skip


def test_imported_gpt_oss_gives_transformers_loss_and_exports_what_transformers_saved(gpt_oss, tmp_path):
    path, want = gpt_oss
    check_import_export(path, want, tmp_path, "gpt_oss", transformers.GptOssForCausalLM, TOL)


def test_modelpar_ckpt_streams_gpt_oss_in_and_out_with_its_fused_experts(gpt_oss, tmp_path):
    """import-hf (one expert's gate or up columns read at a time) and export-hf (each layer's experts fused
    again) round-trip the bytes, and the imported checkpoint gives transformers' loss."""
    from modelpar.cli.ckpt import main as ckpt_main
    from modelpar.cli.generate import load_single_device_model

    path, want = gpt_oss
    assert ckpt_main(["import-hf", str(path), str(tmp_path / "ckpt")]) == 0
    model = load_single_device_model(tmp_path / "ckpt" / "step-00000000")
    with torch.no_grad():
        assert model.loss(model(IDS[:, :-1]), IDS[:, 1:]).item() == pytest.approx(want, rel=TOL)
    assert ckpt_main(["export-hf", str(tmp_path / "ckpt" / "step-00000000"), str(tmp_path / "hf")]) == 0
    original, exported = load_file(path / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


@pytest.mark.parametrize(
    "field, value",
    [("quantization_config", {"quant_method": "fp8"}), ("attention_dropout", 0.1)],  # mxfp4 is read
)
def test_unsupported_gpt_oss_variant_is_refused_in_one_line_naming_the_field(gpt_oss, tmp_path, field, value):
    hf = json.loads((gpt_oss[0] / "config.json").read_text()) | {field: value}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=rf"unsupported GPT-OSS variant \({field}\)") as info:
        config_from_hf(tmp_path)
    assert "\n" not in str(info.value)


def test_export_refuses_what_gpt_oss_cannot_express(gpt_oss):
    config = config_from_hf(gpt_oss[0])
    for fields, named in [
        (dict(moe=MoEConfig(experts=4, bias=False, activation="clamped_swiglu")), "moe.bias=false"),
        (dict(attention_out_bias=False), "attention_bias differs from attention_out_bias"),
    ]:
        with pytest.raises(ValueError, match=rf"GPT-OSS cannot express this model \({named}\)"):
            config_to_hf(ModelConfig(**config.__dict__ | fields))


LAYOUTS = [  # (layout, chunk options) on the one 4-rank pool
    (ParallelLayout(tp=2, dp=2), {}),
    (ParallelLayout(tp=2, dp=2), {"sequence_parallel": True, "recompute": "selective"}),
    (ParallelLayout(pp=2, dp=2), {"recompute": "full"}),
    (ParallelLayout(cp=2, dp=2), {}),
    (ParallelLayout(cp=2, dp=2), {"cp_comm": "allgather"}),
    (ParallelLayout(cp=4), {"cp_comm": "hybrid", "cp_a2a": 2}),  # heads over pairs, a ring across the pairs
    (ParallelLayout(dp=4, ep=2), {}),  # dp2 x ep2 in each pair of replicas
    (ParallelLayout(tp=2, dp=2, ep=2), {"sequence_parallel": True}),
]


def test_imported_gpt_oss_gives_transformers_loss_and_the_single_device_gradients_on_every_layout(gpt_oss):
    """The sinks sharded with their heads and merged into the cp online softmax; the experts' biases travel
    with their experts over ep; every gradient piece the single-device model's."""
    path, want = gpt_oss
    config = config_from_hf(path)
    per_rank = run_on_ranks(4, run_layouts, [(config, layout, options, path) for layout, options in LAYOUTS])
    ref_loss, ref_grads = reference_loss_and_grads(config, hf_path=path)
    assert ref_loss == pytest.approx(want, rel=TOL)
    assert any(name.endswith("experts.3.w2.bias") for name in ref_grads)
    for i, (layout, options) in enumerate(LAYOUTS):
        check_against_reference([rank[i] for rank in per_rank], ref_loss, ref_grads, TOL, f"{layout} {options}")
