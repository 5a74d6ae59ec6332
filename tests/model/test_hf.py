"""Hugging Face Llama interop: imported weights give transformers' logits at any tp; export round-trips exactly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from modelpar.model.config import ModelConfig
from modelpar.model.hf import config_from_hf, export_hf, import_hf
from modelpar.model.transformer import build_model
from modelpar.testing import current_groups, run_on_ranks
from tests.model.reference import HF_IDS, layout_for, rel_err

transformers = pytest.importorskip("transformers")

TOL = 1e-5
IDS = HF_IDS


def test_config_from_hf_maps_every_field(hf_model):
    path, _ = hf_model
    tied = json.loads((path / "config.json").read_text())["tie_word_embeddings"]
    assert config_from_hf(path) == ModelConfig(
        vocab_size=61,
        hidden=32,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn_hidden=40,
        max_seq_len=16,
        rope_theta=500.0,
        norm_eps=1e-5,
        tie_embeddings=tied,
        init_std=0.2,
    )


def test_unsupported_llama_variant_is_refused(hf_model, tmp_path):
    path, _ = hf_model
    config = json.loads((path / "config.json").read_text())
    config["mlp_bias"] = True
    config["hidden_act"] = "gelu"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported Llama variant \(mlp_bias, hidden_act\)"):
        config_from_hf(tmp_path)


def test_imported_model_matches_transformers_on_one_device(hf_model):
    path, want = hf_model
    model = build_model(config_from_hf(path), seed=0)
    import_hf(path, model)
    assert rel_err(model(IDS).detach(), want) <= TOL


def _import_and_export(path, out):
    model = build_model(config_from_hf(path), current_groups(), seed=0)
    import_hf(path, model)
    if current_groups().dp_rank == 0:
        export_hf(model, out)
    return model(IDS).detach()


def test_imported_model_matches_transformers_at_tp2_and_exports_the_same_tensors(hf_model, tmp_path):
    path, want = hf_model
    results = run_on_ranks(4, _import_and_export, path, tmp_path, layout=layout_for(2))[:2]
    logits = torch.cat(results, dim=-1)[..., :61]
    assert rel_err(logits, want) <= TOL
    original, exported = load_file(path / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


def test_exported_directory_loads_in_transformers_with_the_same_logits(hf_model, tmp_path):
    path, want = hf_model
    model = build_model(config_from_hf(path), seed=0)
    import_hf(path, model)
    export_hf(model, tmp_path)
    original, exported = load_file(path / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.rope_parameters["rope_theta"] == 500.0
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, want)
