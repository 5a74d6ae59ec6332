"""The planner's counts for DeepSeek-V3's shape (fine-grained experts, dense first layers, MTP) and for the
MTP modules on the last stage, exact against a built model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from modelpar.model.config import MLAConfig, ModelConfig, MoEConfig
from modelpar.model.flops import training_flops_per_token
from modelpar.model.transformer import build_chunk
from modelpar.parallel.layout import ParallelLayout
from modelpar.plan import Strategy
from modelpar.plan.chunks import strategy_partition
from modelpar.plan.spec import ModelSpec
from modelpar.plan.states import stage_units

# DeepSeek-V3 (the report's Table and config.json): 61 layers, 3 dense of 18432, 58 of 256 routed experts of
# 2048 (top-8, 8 groups, top-4 groups) and one shared, one MTP module; multi-head latent attention.
V3 = ModelConfig(
    vocab_size=129280,
    hidden=7168,
    layers=61,
    heads=128,
    kv_heads=128,
    ffn_hidden=18432,
    max_seq_len=4096,
    mtp_depth=1,
    mla=MLAConfig(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    moe=MoEConfig(
        experts=256,
        top_k=8,
        ffn_hidden=2048,
        shared_experts=1,
        router="sigmoid",
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        first_k_dense_replace=3,
    ),
)
# MLA's matmul weights per layer (q_lora_rank 1536, kv_lora_rank 512, 128 heads, qk 128 + 64, v 128)
MLA_ATTENTION = 7168 * 1536 + 1536 * 128 * 192 + 7168 * (512 + 64) + 512 * 128 * (128 + 128) + 128 * 128 * 7168


def test_deepseek_v3_totals_and_active_parameters_match_the_report():
    V3.check()
    assert V3.attention_params() == MLA_ATTENTION
    routed = 58 * (256 * 3 * 7168 * 2048 + 7168 * 256)
    dense_and_shared = 3 * 3 * 7168 * 18432 + 58 * 3 * 7168 * 2048
    embedding = 2 * 129280 * 7168
    total = 61 * V3.attention_params() + routed + dense_and_shared + embedding
    assert V3.total_params(mtp=False) == total
    # the report: 671B total (without the 14B of the MTP module), 37B activated per token
    assert V3.total_params(mtp=False) == pytest.approx(671e9, rel=0.005)
    # the MTP module's block (all 256 experts) and projection: 11.6B; the report's 14B also counts the released
    # checkpoint's own copies of the embedding and head (1.85B), which are shared here
    assert V3.total_params() - V3.total_params(mtp=False) == pytest.approx(11.6e9, rel=0.01)
    active = V3.matmul_params() - V3.mtp_params()  # head included, embedding lookup not
    assert active + 129280 * 7168 == pytest.approx(37e9, rel=0.02)
    # model FLOPs per token at 4K: 6 N + 12 L h s, MTP's block and head pass included
    flops = training_flops_per_token(V3, 4096)
    # MLA's scores at qk 192 and values at 128 per head: 12 L (heads (192 + 128) / 2) s
    attention = 12 * 62 * 128 * (192 + 128) / 2 * 4096
    assert flops == pytest.approx(6 * (V3.matmul_params() + 129280 * 7168) + attention, rel=1e-12)


def test_planner_states_of_the_mtp_stage_equal_the_built_chunks_parameters():
    config = ModelConfig(
        vocab_size=61,
        hidden=32,
        layers=4,
        heads=4,
        kv_heads=2,
        ffn_hidden=48,
        mtp_depth=2,
        moe=MoEConfig(experts=4, top_k=2, ffn_hidden=24, shared_experts=1, first_k_dense_replace=1),
    )
    model = ModelSpec(config)
    strategy = Strategy(ParallelLayout(pp=2), 1, 2, "none", 0, False)
    partition = strategy_partition(model, strategy, 16)
    for stage in range(2):
        (c,) = partition.chunks_of(stage)
        chunk = build_chunk(
            config,
            None,
            partition.layers(c),
            first=partition.has_embedding(c),
            last=partition.has_head(c),
            split_blocks=partition.split_blocks(c),
            seed=0,
        )
        built = sum(p.numel() for p in chunk.parameters())
        planned = sum(
            rows * cols * count
            for _, tensors, count in stage_units(model, strategy, 16, stage)
            for rows, cols in tensors
        )
        assert planned == built, f"stage {stage}"


def test_shipped_deepseek_v3_preset_is_the_reports_shape_and_its_2048_gpu_recipe_validates():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from modelpar.plan.presets import load_model
    from modelpar.training.config import register_schema, validate
    from tests.helpers import RECIPES

    assert load_model("deepseek-v3-671b").shape.identity() == replace(V3, norm_eps=1e-6).identity()
    register_schema()
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="deepseek-v3-671b-2048gpu", overrides=["trainer.out_dir=x"]))
    validate(cfg)
    p = cfg.parallel
    assert (p.tp, p.pp, p.dp, p.ep, cfg.optim.zero, p.dp * p.pp * p.tp) == (1, 16, 128, 64, 1, 2048)
    assert p.microbatches * p.dp == cfg.data.global_batch == 15360 and cfg.data.seq_len == 4096
