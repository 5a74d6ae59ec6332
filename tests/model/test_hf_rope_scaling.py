"""Scaled RoPE end to end: random Hugging Face models with the RoPE blocks released models ship (Llama 3.1's
llama3, DeepSeek-V3's YaRN with mscale, Qwen2.5's long-context YaRN), with an original length short enough that
the scaling changes the loss, imported with no overrides give transformers' loss on one device, tp2, pp2 and cp2
and the single-device gradients, and the same through the Triton kernels; export writes the scaling back and
reloads in transformers with the same loss. transformers saves each model in at least three shards."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from modelpar.model.hf import config_from_hf, export_hf, import_hf
from modelpar.model.hf_files import HFWeights
from modelpar.model.rope import RopeScaling
from modelpar.model.transformer import build_model
from modelpar.parallel.layout import ParallelLayout
from modelpar.testing import run_on_ranks
from tests.model.layouts import IDS, check_against_reference, reference_loss_and_grads, run_layouts, transformers_loss
from tests.model.reference import rel_err

transformers = pytest.importorskip("transformers")

TOL = 1e-5
SHARD = "16KB"  # each model in at least three shards, as released checkpoints come
COMMON = dict(
    vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.2,
)  # fmt: skip
# head dim 8 at theta 500: wavelengths 6.3, 30, 140 and 660 positions, so an original length of 16 keeps the
# first frequency, blends the second and divides the others (llama3), and YaRN's ramp spans them too
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # fmt: skip
QWEN_YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 16}
# DeepSeek-V3's released block, its original length shortened from 4096 to 8
V3_YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
           "mscale_all_dim": 1.0, "original_max_position_embeddings": 8}  # fmt: skip
V3_SHAPE = dict(
    moe_intermediate_size=16, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
    n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, kv_lora_rank=12, q_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rope_interleave=True,
)  # fmt: skip
FAMILIES = {  # name: (model class, config class, fields)
    "llama3.1": ("LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=2, rope_parameters=LLAMA3)),
    "qwen2.5-yarn": ("Qwen2ForCausalLM", "Qwen2Config", dict(num_key_value_heads=2, rope_parameters=QWEN_YARN)),
    "deepseek-v3-yarn": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(V3_SHAPE, rope_parameters=V3_YARN)),
}


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    """name -> (directory, transformers' loss, transformers' loss of the same weights without the scaling)."""
    root, out = tmp_path_factory.mktemp("hf"), {}
    for name, (model_cls, config_cls, fields) in FAMILIES.items():
        torch.manual_seed(0)
        config = getattr(transformers, config_cls)(**COMMON, **fields)
        model = getattr(transformers, model_cls)(config).eval()
        with torch.no_grad():  # norms away from one, biases away from zero: a lost one shows
            for param_name, param in model.named_parameters():
                if param_name.endswith("norm.weight"):
                    param.normal_(1.0, 0.2)
                elif param_name.endswith("proj.bias"):
                    param.normal_(0.0, 0.5)
        model.save_pretrained(root / name, max_shard_size=SHARD)
        assert len(list((root / name).glob("model-*-of-*.safetensors"))) >= 3, name
        plain_fields = dict(fields, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
        plain = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **plain_fields)).eval()
        plain.load_state_dict(model.state_dict())
        out[name] = (root / name, transformers_loss(model), transformers_loss(plain))
    return out


def test_each_family_reads_its_scaling_and_the_scaling_changes_the_loss(scaled):
    want = {
        "llama3.1": RopeScaling("llama3", 8.0, 16, low_freq_factor=1.0, high_freq_factor=4.0),
        "qwen2.5-yarn": RopeScaling("yarn", 4.0, 16),
        "deepseek-v3-yarn": RopeScaling("yarn", 40.0, 8, mscale=1.0, mscale_all_dim=1.0),
    }
    for name, (path, loss, unscaled) in scaled.items():
        assert config_from_hf(path).rope_scaling == want[name], name
        assert abs(loss - unscaled) > 100 * TOL * loss, f"{name}: the scaling does not change the loss"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_imported_scaled_model_gives_transformers_loss_and_exports_its_scaling(scaled, tmp_path, name):
    path, want, _ = scaled[name]
    model = build_model(config_from_hf(path), seed=0)
    import_hf(path, model)
    with torch.no_grad():
        assert model.loss(model(IDS[:, :-1]), IDS[:, 1:]).item() == pytest.approx(want, rel=TOL)
    export_hf(model, tmp_path)
    with HFWeights(path) as weights:
        original = {key: weights.get_tensor(key) for key in weights.keys()}
    exported = load_file(tmp_path / "model.safetensors")
    assert exported.keys() == original.keys() and all(torch.equal(exported[k], original[k]) for k in original)
    written = json.loads((tmp_path / "config.json").read_text())["rope_parameters"]
    source = FAMILIES[name][2]["rope_parameters"]
    assert {k: written[k] for k in source} == source
    cls = getattr(transformers, FAMILIES[name][0])
    assert transformers_loss(cls.from_pretrained(tmp_path).eval()) == pytest.approx(want, rel=TOL)


LAYOUTS = [  # (layout, chunk options) on the one 4-rank pool
    (ParallelLayout(tp=2, dp=2), {"sequence_parallel": True}),
    (ParallelLayout(pp=2, dp=2), {}),
    (ParallelLayout(cp=2, dp=2), {}),  # each rank's two chunks rotated at their own positions
    (ParallelLayout(tp=2, cp=2), {"cp_comm": "allgather"}),
]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_imported_scaled_model_gives_transformers_loss_and_single_device_gradients_on_every_layout(scaled, name):
    path, want, _ = scaled[name]
    config = config_from_hf(path)
    per_rank = run_on_ranks(4, run_layouts, [(config, layout, options, path) for layout, options in LAYOUTS])
    ref_loss, ref_grads = reference_loss_and_grads(config, hf_path=path)
    assert ref_loss == pytest.approx(want, rel=TOL)
    for i, (layout, options) in enumerate(LAYOUTS):
        check_against_reference([rank[i] for rank in per_rank], ref_loss, ref_grads, TOL, f"{name} {layout} {options}")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_triton_kernels_rotate_with_the_scaled_tables(scaled, name):
    """The Triton rotation (and attention) under the interpreter on CPU give the torch path's loss and gradients."""
    path = scaled[name][0]
    runs = []
    for kernels in ("torch", "triton"):
        model = build_model(replace(config_from_hf(path), kernels=kernels), seed=0)
        import_hf(path, model)
        loss = model.loss(model(IDS[:2, :-1]), IDS[:2, 1:])
        loss.backward()
        runs.append((loss.item(), {n: s.grad.clone() for n, s in model.logical_shards().items() if s.grad is not None}))
    (torch_loss, torch_grads), (triton_loss, triton_grads) = runs
    assert triton_loss == pytest.approx(torch_loss, rel=1e-5)
    for param, grad in torch_grads.items():
        assert rel_err(triton_grads[param], grad) <= 1e-4, param
