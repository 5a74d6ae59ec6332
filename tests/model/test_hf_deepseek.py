"""Hugging Face DeepSeek-V3 interop (latent attention with interleaved RoPE, sigmoid group-limited routing with its
balancing bias, shared experts, dense first layers): imported weights give transformers' loss on every layout and
the single-device gradients; export round-trips exactly and reloads in transformers with the same loss."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from modelpar.model.config import MLAConfig, ModelConfig, MoEConfig
from modelpar.model.hf import config_from_hf, config_to_hf, export_hf, import_hf, save_hf
from modelpar.model.hf_files import HFWeights
from modelpar.model.layers.latent_attention import halves_from_interleaved, interleaved_from_halves
from modelpar.model.transformer import build_model
from modelpar.parallel.layout import ParallelLayout
from modelpar.testing import run_on_ranks
from tests.model.layouts import IDS, check_against_reference, reference_loss_and_grads, run_layouts, transformers_loss

transformers = pytest.importorskip("transformers")

TOL = 1e-5
SHAPE = dict(
    vocab_size=61, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
    n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, kv_lora_rank=12, q_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=16, rms_norm_eps=1e-5,
    rope_theta=500.0, initializer_range=0.2, rope_interleave=True,
)  # fmt: skip
MLA = MLAConfig(kv_lora_rank=12, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
MOE = MoEConfig(
    experts=4, top_k=2, ffn_hidden=16, shared_experts=1, router="sigmoid", n_group=2, topk_group=1,
    routed_scaling_factor=2.5, first_k_dense_replace=1,
)  # fmt: skip


def _save(root, name, **fields):
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**(SHAPE | fields))).eval()
    with torch.no_grad():  # norms away from one, and a balancing bias that changes which experts are chosen
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
        for layer in model.model.layers[SHAPE["first_k_dense_replace"] :]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.3, -0.2, 0.1, -0.4]))
    path = root / name
    model.save_pretrained(path, max_shard_size="16KB")  # as released checkpoints come: in shards
    assert len(list(path.glob("model-*-of-*.safetensors"))) >= 3
    return path, transformers_loss(model)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    """Random DeepseekV3ForCausalLM directories with transformers' loss on IDS: V3's shape (interleaved RoPE, q
    through its latent) and a V2-Lite-like one (q_proj directly, rotate-half RoPE)."""
    root = tmp_path_factory.mktemp("hf")
    return {
        "v3": _save(root, "v3"),
        "lite": _save(root, "lite", q_lora_rank=None, rope_interleave=False),
    }


def test_deepseek_v3_config_maps_every_field(v3):
    want = ModelConfig(
        vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=4, ffn_hidden=40, max_seq_len=16, rope_theta=500.0,
        norm_eps=1e-5, init_std=0.2, mla=MLA, moe=MOE,
    )  # fmt: skip
    assert config_from_hf(v3["v3"][0]) == want  # num_nextn_predict_layers=1 in the file: no MTP (mtp_depth=0)
    assert config_from_hf(v3["lite"][0]) == replace(want, mla=replace(MLA, q_lora_rank=0))


def test_unsupported_deepseek_v3_variants_are_refused_in_one_line_naming_the_field(v3, tmp_path):
    hf = json.loads((v3["v3"][0] / "config.json").read_text())
    for fields, named in [
        ({"attention_bias": True}, "attention_bias"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2 != num_attention_heads=4"),
        ({"scoring_func": "softmax"}, "scoring_func=softmax"),
        ({"topk_method": "greedy"}, "topk_method=greedy"),
        ({"hidden_act": "gelu"}, "hidden_act=gelu"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps(hf | fields))
        with pytest.raises(ValueError, match=r"unsupported DeepSeek-V3 variant \(") as info:
            config_from_hf(tmp_path)
        assert named in str(info.value) and "\n" not in str(info.value), (fields, str(info.value))


@pytest.mark.parametrize("kind", ["v3", "lite"])
def test_imported_v3_gives_transformers_loss_and_exports_what_transformers_saved(v3, tmp_path, kind):
    path, want = v3[kind]
    model = build_model(config_from_hf(path), seed=0)
    import_hf(path, model)
    with torch.no_grad():
        assert abs(model.loss(model(IDS[:, :-1]), IDS[:, 1:]).item() - want) <= TOL * want
    assert torch.count_nonzero(model.logical_shards()["layers.1.mlp.gate.e_score_correction_bias"].tensor) == 4
    export_hf(model, tmp_path)
    with HFWeights(path) as weights:
        original = {key: weights.get_tensor(key) for key in weights.keys()}
    exported = load_file(tmp_path / "model.safetensors")
    assert exported.keys() == original.keys()
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == "deepseek_v3" and hf["rope_interleave"] and hf["num_nextn_predict_layers"] == 0
    if kind == "v3":  # written as read: the interleaved rows permuted back
        assert all(torch.equal(exported[k], original[k]) for k in original)
    else:  # rotate-half read, interleaved written: only the RoPE rows move
        q, kv = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
        assert torch.equal(exported[q], interleaved_from_halves(original[q], 4, 12))
        assert torch.equal(exported[kv], interleaved_from_halves(original[kv], 4, 16))
        assert not torch.equal(exported[q], original[q])
    reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path).eval()
    assert transformers_loss(reloaded) == pytest.approx(want, rel=TOL)


def test_the_rope_row_permutation_and_its_inverse():
    weight = torch.arange(2 * 6, dtype=torch.float32)[:, None]  # two heads of nope 2 + rope 4
    halves = halves_from_interleaved(weight, 4, 6)
    assert halves[:6, 0].tolist() == [0, 1, 2, 4, 3, 5]  # rope rows: evens, then odds
    assert torch.equal(interleaved_from_halves(halves, 4, 6), weight)


def test_experts_fused_as_transformers_holds_them_and_mtp_modules_in_deepseeks_layout(v3, tmp_path):
    path, want = v3["v3"]
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state  # [E, 2f, h]
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    model = build_model(config_from_hf(tmp_path), seed=1)
    import_hf(tmp_path, model)
    with torch.no_grad():
        assert abs(model.loss(model(IDS[:, :-1]), IDS[:, 1:]).item() - want) <= TOL * want
    # an MTP module exports as DeepSeek's layer <layers + k> (transformers ignores it) and imports back when asked
    mtp = build_model(replace(config_from_hf(path), mtp_depth=1), seed=2)
    save_hf(tmp_path / "mtp", mtp.config, mtp.full_state())
    written = load_file(tmp_path / "mtp" / "model.safetensors")
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.shared_head.norm.weight"} <= written.keys()
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in written
    back, state = build_model(mtp.config, seed=3), mtp.full_state()
    import_hf(tmp_path / "mtp", back)
    assert back.full_state().keys() == state.keys()
    assert all(torch.equal(t, state[k]) for k, t in back.full_state().items())
    plain = build_model(config_from_hf(tmp_path / "mtp"), seed=4)  # mtp_depth=0: the modules are not read
    import_hf(tmp_path / "mtp", plain)
    with torch.no_grad():
        main = plain.loss(plain(IDS[:, :-1]), IDS[:, 1:]).item()
    reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "mtp").eval()
    assert transformers_loss(reloaded) == pytest.approx(main, rel=TOL)


def test_export_refuses_what_deepseek_v3_cannot_express():
    base = ModelConfig(layers=3, mla=MLA)
    for moe, named in [
        (replace(MOE, router="softmax"), "model.moe.router=softmax"),
        (replace(MOE, first_k_dense_replace=0, layers=[0, 2]), "MoE layers [0, 2]"),
        (replace(MOE, n_group=4, topk_group=2), "model.moe.n_group=4 with groups of one expert"),
    ]:
        with pytest.raises(ValueError, match=r"DeepSeek-V3 cannot express this model \(") as info:
            config_to_hf(replace(base, moe=moe))
        assert named in str(info.value), str(info.value)
    dense = config_to_hf(base)  # dense latent attention: V3 with every layer below first_k_dense_replace
    assert dense["first_k_dense_replace"] == 3 and dense["model_type"] == "deepseek_v3"
    with pytest.raises(ValueError, match=r"model.mtp_depth=1: only DeepSeek-V3"):
        config_to_hf(ModelConfig(mtp_depth=1))


LAYOUTS = [  # (layout, chunk options) on the one 4-rank pool
    (ParallelLayout(tp=2, dp=2), {"sequence_parallel": True}),
    (ParallelLayout(pp=2, dp=2), {}),
    (ParallelLayout(cp=2, dp=2), {}),
    (ParallelLayout(dp=4, ep=2), {}),  # dp2 x ep2 in each pair of replicas
    (ParallelLayout(tp=2, dp=2, ep=2), {}),
]


def test_imported_v3_gives_transformers_loss_and_the_single_device_gradients_on_every_layout(v3):
    """One pool call runs every layout: each rank imports its slices, runs its share of the batch, reduces the
    gradients as a step does; the loss is transformers', every gradient piece the single-device model's."""
    path, want = v3["v3"]
    config = config_from_hf(path)
    per_rank = run_on_ranks(4, run_layouts, [(config, layout, options, path) for layout, options in LAYOUTS])
    ref_loss, ref_grads = reference_loss_and_grads(config, hf_path=path)
    assert ref_loss == pytest.approx(want, rel=TOL)
    for i, (layout, options) in enumerate(LAYOUTS):
        check_against_reference([rank[i] for rank in per_rank], ref_loss, ref_grads, TOL, f"v3 {layout} {options}")
