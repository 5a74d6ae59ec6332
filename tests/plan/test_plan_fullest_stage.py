"""The planner's peak memory is its fullest pipeline stage, wherever that stage is: not always the first or the
last (a FLOP-balanced split gives the embedding's stage fewer layers; DeepSeek-V3's first layers are dense)."""

import dataclasses

import pytest

from modelpar.parallel.layout import ParallelLayout
from modelpar.plan import HARDWARE, Strategy, load_model, peak_memory, stage_memory
from modelpar.plan.memory import candidate_stages, fullest_stage

H100_BF16 = dataclasses.replace(HARDWARE["h100-80gb"], dtype="bf16")


def _every_stage(model, strategy, seq_len) -> list[float]:
    return [stage_memory(model, strategy, seq_len, H100_BF16, st).total for st in range(strategy.layout.pp)]


@pytest.mark.parametrize(
    "name, layout, m, schedule, recompute",
    [
        ("deepseek-v3-671b", dict(pp=16, dp=128, ep=64), 120, "1f1b", "selective"),  # its 2,048-GPU recipe
        ("deepseek-v3-671b", dict(pp=16, dp=128, ep=64), 120, "gpipe", "full"),
        ("deepseek-v3-671b", dict(pp=8, dp=256, ep=64, vpp=2), 64, "interleaved", "selective"),
        ("llama-405b", dict(tp=8, pp=16, dp=128), 16, "1f1b", "none"),  # its 16,384-GPU recipe
        ("llama-405b", dict(tp=8, pp=8, dp=256, vpp=2), 16, "zbv", "none"),
        ("llama-8b", dict(tp=2, pp=4, dp=8), 8, "zb-h1", "none"),
    ],
)
def test_peak_memory_is_the_fullest_of_every_stage(name, layout, m, schedule, recompute):
    model = load_model(name)
    modules = ("attention",) if recompute == "selective" else ("elementwise",)
    strategy = Strategy(ParallelLayout(**layout), 1, m, recompute, 1, recompute_modules=modules, pipeline=schedule)
    every = _every_stage(model, strategy, 4096)
    assert peak_memory(model, strategy, 4096, H100_BF16).total == max(every)
    assert fullest_stage(model, strategy, 4096, H100_BF16) == every.index(max(every))
    assert set(candidate_stages(model, strategy, 4096)) <= set(range(strategy.layout.pp))


def test_a_middle_stage_can_be_the_fullest():
    """DeepSeek-V3's recipe as it shipped (1F1B, attention rerun): stage 2 holds 1.5x what stage 0 does."""
    model = load_model("deepseek-v3-671b")
    strategy = Strategy(
        ParallelLayout(pp=16, dp=128, ep=64), 1, 120, "selective", 1, recompute_modules=("attention",), pipeline="1f1b"
    )
    every = _every_stage(model, strategy, 4096)
    assert every.index(max(every)) not in (0, 15) and max(every) > 1.4 * every[0]
