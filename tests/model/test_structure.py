"""The block's structure as data (``model.block``): every field changes the function the model computes, a
Llama block's identity is what it was, bad values are refused in one line, and a block using every option at
once (with document masking under cp) gives the single-device loss and gradients at tp2 + sp, pp2 and cp2."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from modelpar.model.config import MLAConfig, ModelConfig, ModelConfigError, MoEConfig
from modelpar.model.structure import BlockStructure
from modelpar.model.transformer import build_model
from modelpar.parallel.layout import ParallelLayout
from modelpar.testing import run_on_ranks
from tests.model.layouts import IDS, check_against_reference, reference_loss_and_grads, run_layouts

TOL = 1e-5
BASE = dict(
    vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=40, max_seq_len=16, head_dim=12,
    qk_norm=True, init_std=0.2, sliding_window=3, window_layers=[0],
)  # fmt: skip
EVERYTHING = BlockStructure(
    norm="sandwich", norm_offset=1.0, activation="geglu", embedding_scale=True, query_scale=10.0,
    attention_softcap=1.0, final_softcap=1.5, local_rope_theta=20.0,
)  # fmt: skip
CHANGES = [  # one field each, away from Llama's block
    dict(norm="post"),
    dict(norm="sandwich"),
    dict(norm_offset=1.0),
    dict(activation="geglu"),
    dict(embedding_scale=True),
    dict(query_scale=10.0),
    dict(attention_softcap=0.5),
    dict(final_softcap=1.0),
    dict(attention_sinks=True),
    dict(qk_norm_scope="projection"),
    dict(local_rope_theta=20.0),
]


def _loss(config: ModelConfig) -> float:
    model = build_model(config, seed=3)
    with torch.no_grad():
        for name, shard in model.logical_shards().items():  # the same norm weights whatever the scale form
            if name.endswith("norm.weight"):
                shard.tensor.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
        return model.loss(model(IDS[:, :-1]), IDS[:, 1:]).item()


@pytest.mark.parametrize("change", CHANGES, ids=[next(iter(c)) for c in CHANGES])
def test_each_field_changes_what_the_block_computes(change):
    llama = ModelConfig(**BASE)
    assert _loss(replace(llama, block=BlockStructure(**change))) != pytest.approx(_loss(llama), rel=1e-4)


def test_a_llama_block_keeps_its_identity_and_other_blocks_record_theirs():
    assert "block" not in ModelConfig(**BASE).identity()
    olmo = ModelConfig(**BASE, block=BlockStructure(norm="post", qk_norm_scope="projection"))
    assert olmo.identity()["block"] == {"norm": "post", "qk_norm_scope": "projection"}
    assert ModelConfig(**BASE, block={"norm": "post", "qk_norm_scope": "projection"}) == olmo  # read back from JSON


def test_norms_scaled_by_one_plus_weight_start_at_zero_and_are_named_by_placement():
    model = build_model(ModelConfig(**BASE, block=EVERYTHING), seed=0)
    norms = {name: s.tensor for name, s in model.logical_shards().items() if name.endswith("norm.weight")}
    assert all(torch.equal(t, torch.zeros_like(t)) for t in norms.values())
    layer = {name.removeprefix("layers.0.") for name in norms if name.startswith("layers.0.")}
    assert layer == {
        "input_layernorm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
        "post_feedforward_layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    }  # fmt: skip


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(block=BlockStructure(norm="middle")), "model.block.norm='middle'"),
        (dict(block=BlockStructure(norm_offset=0.5)), "model.block.norm_offset=0.5"),
        (dict(block=BlockStructure(final_softcap=-1.0)), "model.block.final_softcap=-1.0"),
        (dict(block=BlockStructure(activation="geglu"), moe=MoEConfig(experts=4)), "model.block.activation=geglu"),
        (dict(block=BlockStructure(qk_norm_scope="projection"), qk_norm=False), "qk_norm_scope=projection needs"),
        (dict(block=BlockStructure(local_rope_theta=5.0), sliding_window=0, window_layers=[]), "local_rope_theta"),
        (dict(block=BlockStructure(norm="post"), fp8="rowwise"), "model.fp8=rowwise is proven on the Llama block"),
    ],
)
def test_a_block_that_cannot_be_built_is_refused_in_one_line_naming_the_field(fields, named):
    with pytest.raises(ModelConfigError, match=named) as info:
        ModelConfig(**BASE | fields).check()
    assert "\n" not in str(info.value)


def test_latent_attention_refuses_a_non_llama_block():
    mla = MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    config = ModelConfig(hidden=32, heads=4, kv_heads=4, mla=mla, block=BlockStructure(norm="post"))
    with pytest.raises(ModelConfigError, match=r"model.mla \(latent attention\) .* model.block.norm"):
        config.check()


LAYOUTS = [  # (config, layout, chunk options) on the one 4-rank pool
    ("everything", ParallelLayout(tp=2, dp=2), {"sequence_parallel": True, "recompute": "selective"}),
    ("everything", ParallelLayout(pp=2, dp=2), {}),
    ("everything", ParallelLayout(cp=2, dp=2), {"recompute": "full"}),
    ("post", ParallelLayout(tp=2, dp=2), {"sequence_parallel": True}),
    ("post", ParallelLayout(cp=2, dp=2), {"cp_comm": "alltoall"}),
    ("sinks", ParallelLayout(tp=2, dp=2), {"sequence_parallel": True}),
    ("sinks", ParallelLayout(pp=2, dp=2), {"recompute": "full"}),
    ("sinks", ParallelLayout(cp=2, dp=2), {}),
    ("sinks", ParallelLayout(cp=2, dp=2), {"cp_comm": "allgather", "recompute": "selective"}),
    ("sinks", ParallelLayout(cp=2, dp=2), {"cp_comm": "alltoall"}),
]
CONFIGS = {
    "everything": ModelConfig(**BASE, block=EVERYTHING),
    # GPT-OSS's attention: sinks, q/k/v/o biases, local and global layers, no QK-norm
    "sinks": ModelConfig(
        **BASE | {"qk_norm": False},
        attention_bias=True,
        attention_out_bias=True,
        block=BlockStructure(attention_sinks=True),
    ),
    "post": ModelConfig(
        **BASE | {"tie_embeddings": True}, block=BlockStructure(norm="post", qk_norm_scope="projection")
    ),
}


def test_every_option_at_once_gives_the_single_device_loss_and_gradients_on_every_layout():
    cases = [(CONFIGS[kind], layout, options, None) for kind, layout, options in LAYOUTS]
    per_rank = run_on_ranks(4, run_layouts, cases)
    references = {kind: reference_loss_and_grads(config) for kind, config in CONFIGS.items()}
    for i, (kind, layout, options) in enumerate(LAYOUTS):
        ref_loss, ref_grads = references[kind]
        check_against_reference([rank[i] for rank in per_rank], ref_loss, ref_grads, TOL, f"{kind} {layout} {options}")
