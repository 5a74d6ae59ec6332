"""Hugging Face Mixtral interop: imported weights give transformers' loss; export round-trips exactly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from modelpar import ParallelLayout
from modelpar.model.config import ModelConfig, MoEConfig
from modelpar.model.hf import config_from_hf, config_to_hf, export_hf, import_hf
from modelpar.model.transformer import build_chunk, build_model
from modelpar.testing import current_groups, run_on_ranks
from tests.model.reference import rel_err

transformers = pytest.importorskip("transformers")

TOL = 1e-5
IDS = torch.tensor([[3, 17, 60, 0, 42, 9, 9, 31], [59, 1, 2, 44, 12, 37, 50, 8]])
# transformers shifts the labels inside; ours are given already shifted, the last one ignored
TARGETS = torch.cat([IDS[:, 1:], torch.full((2, 1), -100)], dim=1)


@pytest.fixture(scope="module")
def hf_mixtral(tmp_path_factory):
    """A random MixtralForCausalLM saved to a directory, with its logits and loss on IDS."""
    config = transformers.MixtralConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=16,
        rms_norm_eps=1e-5,
        rope_theta=500.0,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
    path = tmp_path_factory.mktemp("hf") / "mixtral"
    model.save_pretrained(path)
    with torch.no_grad():
        out = model(IDS, labels=IDS)
    return path, out.logits, out.loss


def test_mixtral_config_maps_to_a_moe_model(hf_mixtral):
    path, _, _ = hf_mixtral
    config = config_from_hf(path)
    assert config.moe == MoEConfig(experts=4, top_k=2, ffn_hidden=24)
    assert (config.hidden, config.layers, config.kv_heads, config.rope_theta) == (32, 2, 2, 500.0)


def test_imported_mixtral_gives_transformers_logits_and_loss(hf_mixtral):
    path, logits, loss = hf_mixtral
    model = build_model(config_from_hf(path), seed=0)
    import_hf(path, model)
    ours = model(IDS)
    assert rel_err(ours.detach(), logits) <= TOL
    assert abs(float(model.loss(ours, TARGETS).detach()) - float(loss)) <= TOL


def test_exported_mixtral_loads_in_transformers_with_the_same_logits(hf_mixtral, tmp_path):
    path, logits, _ = hf_mixtral
    model = build_model(config_from_hf(path), seed=0)
    import_hf(path, model)
    export_hf(model, tmp_path)
    original, exported = load_file(path / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)
    reloaded = transformers.MixtralForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, logits)


def test_a_mixtral_sliding_window_is_read_as_every_layers_window(hf_mixtral, tmp_path):
    path, _, _ = hf_mixtral
    config = json.loads((path / "config.json").read_text()) | {"sliding_window": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = config_from_hf(tmp_path)
    assert (ours.sliding_window, ours.window_layers) == (4, [])
    assert config_to_hf(ours)["sliding_window"] == 4


@pytest.mark.parametrize("option, value", [("router_jitter_noise", 0.1)])
def test_unsupported_mixtral_variant_is_refused_in_one_line(hf_mixtral, tmp_path, option, value):
    path, _, _ = hf_mixtral
    config = json.loads((path / "config.json").read_text()) | {option: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"unsupported Mixtral variant \({option}\)") as info:
        config_from_hf(tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "moe, named",
    [
        (MoEConfig(experts=4, router="sigmoid"), "router=sigmoid"),
        (MoEConfig(experts=4, shared_experts=1), "shared experts"),
        (MoEConfig(experts=4, every=2), "MoE in only some layers"),
    ],
)
def test_export_refuses_what_mixtral_cannot_express(moe, named):
    with pytest.raises(ValueError, match=f"Mixtral cannot express this model \\({named}\\)"):
        config_to_hf(ModelConfig(layers=2, moe=moe))


def _loss_of_imported(path, out):
    """Every rank imports its slices (its tp shard, its ep experts, its pp stage) and computes the loss of the
    whole batch (each dp replica on the same tokens, so the experts see both replicas' rows); with pp=1 the
    model is exported back from every rank of the ep group."""
    import torch.distributed as dist

    groups = current_groups()
    config = config_from_hf(path)
    if groups.layout.pp == 1:
        model = build_model(config, groups, seed=0)
        import_hf(path, model)
        loss = model.loss(model(IDS), TARGETS)
        export_hf(model, out)
        return float(loss.detach())
    stage = groups.pp_rank
    chunk = build_chunk(config, groups, [stage], first=stage == 0, last=stage == 1, seed=0)
    import_hf(path, chunk)
    with torch.no_grad():
        if stage == 0:
            dist.send(chunk(IDS).contiguous(), groups.pp_ranks[1])
            return None
        x = torch.empty(*IDS.shape, config.hidden)
        dist.recv(x, groups.pp_ranks[0])
        return float(chunk.loss(chunk(x), TARGETS))


@pytest.mark.parametrize(
    "layout",
    [ParallelLayout(dp=2, ep=2), ParallelLayout(tp=2, dp=2, ep=2), ParallelLayout(pp=2, dp=2, ep=2)],
    ids=str,
)
def test_mixtral_imported_under_expert_parallelism_gives_transformers_loss(hf_mixtral, tmp_path, layout):
    path, _, want = hf_mixtral
    losses = [x for x in run_on_ranks(layout.world_size, _loss_of_imported, path, tmp_path, layout=layout) if x]
    assert len(losses) == layout.world_size // layout.pp
    assert all(abs(loss - float(want)) <= TOL for loss in losses)
    if layout.pp == 1:  # gathered over tp and ep: the same tensors transformers saved
        original, exported = load_file(path / "model.safetensors"), load_file(tmp_path / "model.safetensors")
        assert exported.keys() == original.keys()
        assert all(torch.equal(exported[k], original[k]) for k in original)
