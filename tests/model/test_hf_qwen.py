"""Hugging Face Qwen3 and Qwen3-MoE interop (QK-norm, head_dim of its own, MoE in some layers): imported
weights give transformers' loss on every layout and the single-device gradients; export round-trips exactly."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from modelpar.model.config import ModelConfig, MoEConfig
from modelpar.model.hf import config_from_hf, config_to_hf, import_hf
from modelpar.model.transformer import build_model
from modelpar.parallel.layout import ParallelLayout
from modelpar.testing import run_on_ranks
from tests.model.layouts import IDS, check_against_reference, check_import_export, reference_loss_and_grads, run_layouts

transformers = pytest.importorskip("transformers")

TOL = 1e-5
SHAPE = dict(
    vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=12, max_position_embeddings=16, rms_norm_eps=1e-5, rope_theta=500.0,
    initializer_range=0.2,
)  # fmt: skip
# layer 1 only is a mixture of experts ((i + 1) % 2 == 0); the top-k weights are not renormalised
MOE = dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, norm_topk_prob=False)


def _save(model, root, name):
    with torch.no_grad():  # norm weights away from one, so that a missing or misplaced norm shows
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
    path = root / name
    model.save_pretrained(path)
    with torch.no_grad():
        logits = model(IDS[:, :-1]).logits
    return path, F.cross_entropy(logits.flatten(0, 1), IDS[:, 1:].flatten()).item()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """Random Qwen3ForCausalLM and Qwen3MoeForCausalLM directories, with transformers' loss on IDS."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    dense = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE)).eval()
    moe = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**SHAPE, **MOE)).eval()
    return {"qwen3": _save(dense, root, "qwen3"), "qwen3_moe": _save(moe, root, "qwen3_moe")}


def test_qwen3_configs_map_every_field(qwen):
    common = dict(
        vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=40, max_seq_len=16, rope_theta=500.0,
        norm_eps=1e-5, head_dim=12, qk_norm=True, init_std=0.2,
    )  # fmt: skip
    assert config_from_hf(qwen["qwen3"][0]) == ModelConfig(**common)
    moe = MoEConfig(experts=4, top_k=2, ffn_hidden=24, layers=[1], norm_topk_prob=False)
    assert config_from_hf(qwen["qwen3_moe"][0]) == ModelConfig(**common, moe=moe)


def test_mlp_only_layers_and_the_sparse_step_give_the_moe_layers(qwen, tmp_path):
    hf = json.loads((qwen["qwen3_moe"][0] / "config.json").read_text())
    for fields, want in [
        ({"decoder_sparse_step": 1, "mlp_only_layers": []}, MoEConfig(experts=4, ffn_hidden=24, norm_topk_prob=False)),
        ({"decoder_sparse_step": 1, "mlp_only_layers": [1]}, MoEConfig(experts=4, ffn_hidden=24, layers=[0])),
        ({"decoder_sparse_step": 1, "mlp_only_layers": [0, 1]}, MoEConfig()),  # no MoE layer: dense
    ]:
        (tmp_path / "config.json").write_text(json.dumps(hf | fields))
        got = config_from_hf(tmp_path).moe
        assert (got.experts, got.ffn_hidden, got.layers) == (want.experts, want.ffn_hidden, want.layers), fields


@pytest.mark.parametrize(
    "field, value",
    [
        ("attention_dropout", 0.1),
        ("use_sliding_window", True),
        ("layer_types", ["full_attention", "sliding_attention"]),
        ("shared_expert_intermediate_size", 16),
    ],
)
def test_unsupported_qwen3_variant_is_refused_in_one_line_naming_the_field(qwen, tmp_path, field, value):
    hf = json.loads((qwen["qwen3_moe"][0] / "config.json").read_text()) | {field: value}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=rf"unsupported Qwen3-MoE variant \({field}\)") as info:
        config_from_hf(tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_imported_qwen3_gives_transformers_loss_and_exports_what_transformers_saved(qwen, tmp_path, kind):
    path, want = qwen[kind]
    cls = transformers.Qwen3MoeForCausalLM if kind == "qwen3_moe" else transformers.Qwen3ForCausalLM
    check_import_export(path, want, tmp_path, kind, cls, TOL)


def test_experts_fused_as_transformers_holds_them_in_memory_are_read_too(qwen, tmp_path):
    path, want = qwen["qwen3_moe"]
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state  # [E, 2f, h]
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    model = build_model(config_from_hf(tmp_path), seed=1)
    import_hf(tmp_path, model)
    with torch.no_grad():
        assert abs(model.loss(model(IDS[:, :-1]), IDS[:, 1:]).item() - want) <= TOL * want


def test_export_refuses_what_qwen3_moe_cannot_express():
    for moe, named in [
        (MoEConfig(experts=4, router="sigmoid"), "router=sigmoid"),
        (MoEConfig(experts=4, shared_experts=1), "shared experts"),
    ]:
        with pytest.raises(ValueError, match=rf"Qwen3-MoE cannot express this model \({named}\)"):
            config_to_hf(ModelConfig(layers=2, qk_norm=True, moe=moe))
    with pytest.raises(ValueError, match=r"Mixtral cannot express this model \(norm_topk_prob=false\)"):
        config_to_hf(ModelConfig(layers=2, moe=MoEConfig(experts=4, norm_topk_prob=False)))


LAYOUTS = [  # (model, layout, chunk options) on the one 4-rank pool
    ("qwen3", ParallelLayout(tp=2, dp=2), {}),
    ("qwen3", ParallelLayout(tp=2, dp=2), {"sequence_parallel": True, "recompute": "selective"}),
    ("qwen3", ParallelLayout(pp=2, dp=2), {"recompute": "full"}),
    ("qwen3", ParallelLayout(cp=2, dp=2), {}),
    ("qwen3_moe", ParallelLayout(tp=2, dp=2), {}),
    ("qwen3_moe", ParallelLayout(pp=2, dp=2), {}),
    ("qwen3_moe", ParallelLayout(cp=2, dp=2), {"cp_comm": "allgather"}),
    ("qwen3_moe", ParallelLayout(dp=4, ep=2), {}),  # dp2 x ep2 in each pair of replicas
    ("qwen3_moe", ParallelLayout(tp=2, dp=2, ep=2), {"sequence_parallel": True}),
]


def test_imported_qwen3_gives_transformers_loss_and_the_single_device_gradients_on_every_layout(qwen):
    """One pool call runs every layout: each rank imports its slices, runs its share of the batch, reduces the
    gradients as a step does; the loss is transformers', every gradient piece the single-device model's."""
    cases = [(config_from_hf(qwen[kind][0]), layout, options, qwen[kind][0]) for kind, layout, options in LAYOUTS]
    per_rank = run_on_ranks(4, run_layouts, cases)
    references = {
        kind: reference_loss_and_grads(config_from_hf(path), hf_path=path) for kind, (path, _) in qwen.items()
    }
    for i, (kind, layout, options) in enumerate(LAYOUTS):
        ref_loss, ref_grads = references[kind]
        assert ref_loss == pytest.approx(qwen[kind][1], rel=TOL)
        label = f"{kind} {layout} {options}"
        check_against_reference([rank[i] for rank in per_rank], ref_loss, ref_grads, TOL, label)
