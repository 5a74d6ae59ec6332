"""Attention biases: Hugging Face Qwen2 / Qwen2.5 (q, k, v biases) and a biased Llama (o_proj's too) imported
give transformers' loss on every layout and the single-device gradients; export round-trips exactly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from modelpar.model.config import ModelConfig
from modelpar.model.hf import config_from_hf, config_to_hf, export_hf, import_hf
from modelpar.model.hf_files import HFWeights
from modelpar.model.transformer import build_model
from modelpar.parallel.layout import ParallelLayout
from modelpar.testing import run_on_ranks
from tests.model.layouts import IDS, check_against_reference, reference_loss_and_grads, run_layouts, transformers_loss

transformers = pytest.importorskip("transformers")

TOL = 1e-5
# one kv head: replicated over tp=2, so its biases' gradients are partial sums like its weights'
SHAPE = dict(
    vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=1, max_position_embeddings=16, rms_norm_eps=1e-5, rope_theta=500.0, initializer_range=0.2,
)  # fmt: skip


def _save(model, path):
    with torch.no_grad():  # transformers starts biases at zero and norms at one, which would hide a lost one
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(path, max_shard_size="16KB")  # as released checkpoints come: in shards
    assert len(list(path.glob("model-*-of-*.safetensors"))) >= 3
    return path, transformers_loss(model)


@pytest.fixture(scope="module")
def biased(tmp_path_factory):
    """Random Qwen2ForCausalLM (Qwen2.5's shape of config), and LlamaForCausalLM and Qwen3ForCausalLM with
    ``attention_bias`` directories, with transformers' loss on IDS."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    qwen2 = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE, tie_word_embeddings=False)).eval()
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, attention_bias=True)).eval()
    qwen3 = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE, head_dim=12, attention_bias=True)).eval()
    return {
        "qwen2": _save(qwen2, root / "qwen2"),
        "llama": _save(llama, root / "llama"),
        "qwen3": _save(qwen3, root / "qwen3"),
    }


def test_qwen2_config_maps_every_field(biased):
    assert config_from_hf(biased["qwen2"][0]) == ModelConfig(
        vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=1, ffn_hidden=40, max_seq_len=16, rope_theta=500.0,
        norm_eps=1e-5, init_std=0.2, attention_bias=True,
    )  # fmt: skip
    for kind in ("llama", "qwen3"):
        config = config_from_hf(biased[kind][0])
        assert config.attention_bias and config.attention_out_bias, kind


def test_qwen2_sliding_window_layers_come_from_max_window_layers_or_layer_types(biased, tmp_path):
    hf = json.loads((biased["qwen2"][0] / "config.json").read_text())
    for fields, want in [
        ({"use_sliding_window": False, "sliding_window": 4}, (0, [])),
        ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1, "layer_types": None}, (4, [1])),
        ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0, "layer_types": None}, (4, [])),
        ({"use_sliding_window": True, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
         (4, [0])),
    ]:  # fmt: skip
        (tmp_path / "config.json").write_text(json.dumps(hf | fields))
        got = config_from_hf(tmp_path)
        assert (got.sliding_window, got.window_layers) == want, fields


def test_a_windowed_qwen2_exports_its_layer_types_and_loads_in_transformers_with_them(tmp_path):
    config = config_to_hf(ModelConfig(attention_bias=True, sliding_window=3, window_layers=[1]))
    assert config["model_type"] == "qwen2" and config["use_sliding_window"] and config["max_window_layers"] == 1
    hf = transformers.Qwen2Config(**{k: v for k, v in config.items() if k != "architectures"})
    assert hf.layer_types == ["full_attention", "sliding_attention"] and hf.sliding_window == 3


def test_export_refuses_biases_no_family_has(tmp_path):
    for config, named in [
        (ModelConfig(attention_out_bias=True), "model.attention_out_bias without model.attention_bias"),
        (ModelConfig(attention_bias=True, qk_norm=True), "QK-norm"),
        (ModelConfig(attention_bias=True, attention_out_bias=True, sliding_window=4), "Mistral have no attention bias"),
    ]:
        with pytest.raises(ValueError, match=named) as info:
            config_to_hf(config)
        assert "\n" not in str(info.value)


def test_qwen2_attention_dropout_is_refused_in_one_line(biased, tmp_path):
    hf = json.loads((biased["qwen2"][0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(hf | {"attention_dropout": 0.1}))
    with pytest.raises(ValueError, match=r"unsupported Qwen2 variant \(attention_dropout\)"):
        config_from_hf(tmp_path)


@pytest.mark.parametrize(
    "kind, cls", [("qwen2", "Qwen2ForCausalLM"), ("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM")]
)
def test_imported_biased_model_gives_transformers_loss_and_exports_what_transformers_saved(biased, tmp_path, kind, cls):
    path, want = biased[kind]
    model = build_model(config_from_hf(path), seed=0)
    import_hf(path, model)
    with torch.no_grad():
        assert model.loss(model(IDS[:, :-1]), IDS[:, 1:]).item() == pytest.approx(want, rel=TOL)
    export_hf(model, tmp_path)
    with HFWeights(path) as weights:
        original = {key: weights.get_tensor(key) for key in weights.keys()}
    exported = load_file(tmp_path / "model.safetensors")
    assert exported.keys() == original.keys() and "model.layers.1.self_attn.k_proj.bias" in exported
    assert all(torch.equal(exported[k], original[k]) for k in original)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [cls]
    reloaded = getattr(transformers, cls).from_pretrained(tmp_path).eval()
    assert transformers_loss(reloaded) == pytest.approx(want, rel=TOL)


LAYOUTS = [  # (layout, chunk options) on the one 4-rank pool
    (ParallelLayout(tp=2, dp=2), {"sequence_parallel": True}),  # the o_proj bias's gradient partial over tp
    (ParallelLayout(tp=2, cp=2), {}),  # the o_proj bias's gradient whole on each tp rank
    (ParallelLayout(pp=2, dp=2), {}),
    (ParallelLayout(cp=2, dp=2), {}),
]


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_imported_biased_model_gives_transformers_loss_and_single_device_gradients_on_every_layout(biased, kind):
    path, want = biased[kind]
    config = config_from_hf(path)
    per_rank = run_on_ranks(4, run_layouts, [(config, layout, options, path) for layout, options in LAYOUTS])
    ref_loss, ref_grads = reference_loss_and_grads(config, hf_path=path)
    assert ref_loss == pytest.approx(want, rel=TOL)
    assert {"layers.0.self_attn.q_proj.bias", "layers.0.self_attn.v_proj.bias"} <= ref_grads.keys()
    assert ("layers.0.self_attn.o_proj.bias" in ref_grads) == (kind == "llama")
    for i, (layout, options) in enumerate(LAYOUTS):
        check_against_reference([rank[i] for rank in per_rank], ref_loss, ref_grads, TOL, f"{kind} {layout} {options}")
