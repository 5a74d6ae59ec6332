"""Hugging Face Gemma 3 (text) and Gemma 2 interop: sandwich norms scaled by 1 + weight, GeGLU, the scaled
embedding, per-head QK-norm, query_pre_attn_scalar, local (sliding, own RoPE base) and global layers, tied
embeddings, the final-logit soft-cap and (Gemma 2) the attention soft-cap give transformers' loss and the
single-device gradients on every layout; export loads back in transformers."""

from __future__ import annotations

import json

import pytest
import torch

from modelpar.model.config import ModelConfig
from modelpar.model.hf import config_from_hf, config_to_hf
from modelpar.model.structure import BlockStructure
from modelpar.parallel.layout import ParallelLayout
from modelpar.testing import run_on_ranks
from tests.model.layouts import (
    check_against_reference,
    check_import_export,
    reference_loss_and_grads,
    run_layouts,
    transformers_loss,
)

transformers = pytest.importorskip("transformers")

TOL = 1e-5
SHAPE = dict(
    vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=12, max_position_embeddings=16, rms_norm_eps=1e-5, initializer_range=0.2,
    query_pre_attn_scalar=10, sliding_window=3, layer_types=["sliding_attention", "full_attention"],
    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 500.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 20.0}},
)  # fmt: skip
VARIANTS = {"gemma3": {}, "gemma3_capped": {"final_logit_softcapping": 1.5, "tie_word_embeddings": False}}
# Gemma 2: no QK-norm, one RoPE base; caps small enough that the scores and logits of this tiny model reach them
GEMMA2 = {k: v for k, v in SHAPE.items() if k != "rope_parameters"} | dict(
    rope_parameters={"rope_type": "default", "rope_theta": 500.0}, attn_logit_softcapping=1.0,
    final_logit_softcapping=1.5,
)  # fmt: skip


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Random Gemma3ForCausalLM directories (tied; untied with a final-logit soft-cap) and a Gemma2ForCausalLM's
    (both caps), with transformers' loss."""
    root, models = tmp_path_factory.mktemp("hf"), {}
    builds = {name: lambda extra=extra: _gemma3(extra) for name, extra in VARIANTS.items()}
    builds["gemma2"] = lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**GEMMA2))
    for name, build in builds.items():
        torch.manual_seed(0)
        model = build().eval()
        with torch.no_grad():  # (1 + w) norms start at w = 0: move them, so that a missing or misplaced one shows
            for param_name, param in model.named_parameters():
                if param_name.endswith("norm.weight"):
                    param.normal_(0.0, 0.3)
        model.save_pretrained(root / name)
        models[name] = root / name, transformers_loss(model)
    return models


def _gemma3(extra):
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**SHAPE, **extra))


def test_gemma3_config_maps_every_field(gemma):
    common = dict(
        vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=40, max_seq_len=16, rope_theta=500.0,
        norm_eps=1e-5, head_dim=12, qk_norm=True, init_std=0.2, sliding_window=3, window_layers=[0],
    )  # fmt: skip
    block = dict(norm="sandwich", norm_offset=1.0, activation="geglu", embedding_scale=True, query_scale=10.0)
    assert config_from_hf(gemma["gemma3"][0]) == ModelConfig(
        **common, tie_embeddings=True, block=BlockStructure(**block, local_rope_theta=20.0)
    )
    capped = BlockStructure(**block, local_rope_theta=20.0, final_softcap=1.5)
    assert config_from_hf(gemma["gemma3_capped"][0]) == ModelConfig(**common, block=capped)
    gemma2 = BlockStructure(**block, attention_softcap=1.0, final_softcap=1.5)
    assert config_from_hf(gemma["gemma2"][0]) == ModelConfig(
        **common | {"qk_norm": False}, tie_embeddings=True, block=gemma2
    )


@pytest.mark.parametrize("kind", [*VARIANTS, "gemma2"])
def test_imported_gemma_gives_transformers_loss_and_exports_what_transformers_saved(gemma, tmp_path, kind):
    path, want = gemma[kind]
    cls = transformers.Gemma2ForCausalLM if kind == "gemma2" else transformers.Gemma3ForCausalLM
    check_import_export(path, want, tmp_path, "gemma2" if kind == "gemma2" else "gemma3_text", cls, TOL)


@pytest.mark.parametrize(
    "field, value",
    [
        ("hidden_activation", "gelu"),
        ("attn_logit_softcapping", 50.0),  # transformers' Gemma 3 reads it and applies no cap
        ("use_bidirectional_attention", True),
        ("attention_bias", True),
    ],
)
def test_unsupported_gemma3_variant_is_refused_in_one_line_naming_the_field(gemma, tmp_path, field, value):
    hf = json.loads((gemma["gemma3"][0] / "config.json").read_text()) | {field: value}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=rf"unsupported Gemma 3 variant \({field}\)") as info:
        config_from_hf(tmp_path)
    assert "\n" not in str(info.value)


def test_export_refuses_what_gemma3_cannot_express():
    sandwich = dict(norm="sandwich", norm_offset=1.0, activation="geglu", embedding_scale=True)
    for block, named in [
        (BlockStructure(**sandwich, attention_softcap=30.0), "block.attention_softcap"),
        (BlockStructure(**{**sandwich, "activation": "swiglu"}), "block.activation"),
        (BlockStructure(norm="sandwich"), "block.norm_offset"),
    ]:
        with pytest.raises(ValueError, match=rf"Gemma 3 cannot express this model \({named}"):
            config_to_hf(ModelConfig(qk_norm=True, block=block))


LAYOUTS = [  # (model, layout, chunk options) on the one 4-rank pool
    ("gemma3", ParallelLayout(tp=2, dp=2), {}),
    ("gemma3", ParallelLayout(tp=2, dp=2), {"sequence_parallel": True, "recompute": "selective"}),
    ("gemma3", ParallelLayout(pp=2, dp=2), {"recompute": "full"}),
    ("gemma3", ParallelLayout(pp=2, dp=2), {"stage_layers": [0.5, 1.5]}),  # block 0's sandwiched halves apart
    ("gemma3", ParallelLayout(cp=2, dp=2), {}),
    ("gemma3", ParallelLayout(cp=2, dp=2), {"cp_comm": "allgather"}),
    ("gemma3_capped", ParallelLayout(tp=2, dp=2), {"sequence_parallel": True}),
    ("gemma3_capped", ParallelLayout(pp=2, dp=2), {}),
    ("gemma3_capped", ParallelLayout(cp=2, dp=2), {}),
    # the attention soft-cap inside each block of the online softmax: ring, all-gather, all-to-all; tp and pp
    ("gemma2", ParallelLayout(cp=2, dp=2), {}),
    ("gemma2", ParallelLayout(cp=2, dp=2), {"cp_comm": "allgather", "recompute": "selective"}),
    ("gemma2", ParallelLayout(cp=2, dp=2), {"cp_comm": "alltoall"}),
    ("gemma2", ParallelLayout(tp=2, dp=2), {"sequence_parallel": True}),
    ("gemma2", ParallelLayout(pp=2, dp=2), {"recompute": "full"}),
]


def test_imported_gemma3_gives_transformers_loss_and_the_single_device_gradients_on_every_layout(gemma):
    """One pool call runs every layout (tied embeddings across pp stages, the local RoPE base at each cp rank's
    positions, the final soft-cap on each vocabulary shard): transformers' loss, the single-device gradients."""
    cases = [(config_from_hf(gemma[kind][0]), layout, options, gemma[kind][0]) for kind, layout, options in LAYOUTS]
    per_rank = run_on_ranks(4, run_layouts, cases)
    references = {
        kind: reference_loss_and_grads(config_from_hf(path), hf_path=path) for kind, (path, _) in gemma.items()
    }
    for i, (kind, layout, options) in enumerate(LAYOUTS):
        ref_loss, ref_grads = references[kind]
        assert ref_loss == pytest.approx(gemma[kind][1], rel=TOL)
        label = f"{kind} {layout} {options}"
        check_against_reference([rank[i] for rank in per_rank], ref_loss, ref_grads, TOL, label)
