"""The planner with latent attention (model.mla): saved activations against what the trainer holds (as
tests/plan/test_plan_memory.py measures them) and the cp exchange's width, the latent's."""

from __future__ import annotations

from modelpar.bench.layout_spec import parse_case
from modelpar.bench.summary import memory_vs_prediction
from modelpar.model.config import MLAConfig, ModelConfig
from modelpar.plan.spec import ModelSpec
from modelpar.plan.step_time import cp_exchange_width
from modelpar.testing import run_on_ranks
from modelpar.training.config import validate
from tests.helpers import tiny_bench_config

MLA = [
    "model.kv_heads=4",
    "model.mla.kv_lora_rank=32",
    "model.mla.q_lora_rank=24",
    "model.mla.qk_nope_head_dim=16",
    "model.mla.qk_rope_head_dim=8",
    "model.mla.v_head_dim=12",
]


def _measure(cases, data_path):
    from modelpar.bench.harness import OurSteps, _measure_memory_and_comm
    from modelpar.training.trainer import Trainer

    out = []
    for case in cases:
        trainer = Trainer(case, data_path, None)
        steps = OurSteps(trainer)
        steps()  # AdamW's moments exist from the warm-up step
        out.append({"pp_rank": trainer.groups.pp_rank, **_measure_memory_and_comm(trainer, steps, trainer.device)})
    return out


def test_predicted_activations_of_latent_attention_are_within_10_percent(tmp_path):
    base = tiny_bench_config(tmp_path, "data.seq_len=64", *MLA)
    cases = [parse_case(spec, base) for spec in ("single", "single-sel")]
    for cfg in cases:
        validate(cfg)
    (measured,) = run_on_ranks(1, _measure, cases, base.data.path)
    for cfg, result in zip(cases, measured, strict=True):
        (stage,) = memory_vs_prediction(cfg, [result])
        assert abs(stage["states_ratio"] - 1) <= 0.1 and abs(stage["activations_ratio"] - 1) <= 0.1, stage


def test_the_cp_exchange_carries_the_latent_not_the_heads():
    v3 = ModelConfig(
        hidden=7168, heads=128, kv_heads=128,
        mla=MLAConfig(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    )  # fmt: skip
    gqa = ModelConfig(hidden=4096, heads=32, kv_heads=8)
    for tp in (1, 8):
        assert cp_exchange_width(ModelSpec(v3), tp) == 512 + 64
    assert cp_exchange_width(ModelSpec(gqa), 1) == 2 * 8 * 128
