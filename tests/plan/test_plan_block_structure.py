"""The planner's saved activations of the block structures (``model.block``: sandwich and post norms, the
``1 + weight`` scale, GeGLU, a soft-cap and sinks, whose attention keeps fp32 [b, h, s, s] scores) against what
one block's forward keeps, measured as ``benchmarks/activation_memory.py`` measures it (the bench's
``SavedTensorMeter`` on one process); and the planner preferring layouts that do not keep the scores."""

from __future__ import annotations

import pytest
import torch

from modelpar.bench.meters import SavedTensorMeter
from modelpar.model.config import ModelConfig
from modelpar.model.moe_config import MoEConfig
from modelpar.model.structure import BlockStructure
from modelpar.model.transformer import build_chunk
from modelpar.parallel.layout import ParallelLayout
from modelpar.plan import HARDWARE, Strategy
from modelpar.plan.activations import block_bytes
from modelpar.plan.spec import ModelSpec

BASE = dict(vocab_size=64, hidden=64, layers=1, heads=4, kv_heads=2, ffn_hidden=96, kernels="torch")
GEMMA = dict(
    qk_norm=True,
    block=BlockStructure(norm="sandwich", norm_offset=1.0, activation="geglu", embedding_scale=True, query_scale=24.0),
)  # fmt: skip
STRUCTURES = {
    "post-norm-projection-qk": dict(qk_norm=True, block=BlockStructure(norm="post", qk_norm_scope="projection")),
    "sandwich-offset": dict(block=BlockStructure(norm="sandwich", norm_offset=1.0)),
    "geglu": dict(block=BlockStructure(activation="geglu")),
    "gemma3": GEMMA,
    "gemma2-softcap": dict(block=BlockStructure(norm="sandwich", attention_softcap=50.0, final_softcap=30.0)),
    "sinks-window": dict(sliding_window=16, block=BlockStructure(attention_sinks=True)),
    "gpt-oss-moe": dict(
        attention_bias=True,
        attention_out_bias=True,
        block=BlockStructure(attention_sinks=True),
        moe=MoEConfig(experts=4, top_k=2, ffn_hidden=32, bias=True, activation="clamped_swiglu"),
    ),  # fmt: skip
}
# full recompute and a selective half keep the input only, whatever the structure
RECOMPUTE = [("none", ()), ("selective", ("elementwise",))]


def _measured(config: ModelConfig, recompute: str, modules: tuple, layer: int, b: int = 2, s: int = 32) -> int:
    """Bytes one block's forward keeps for backward (what the bench's meter counts)."""
    chunk = build_chunk(
        config, None, [layer], first=False, last=False, seed=0, recompute=recompute, recompute_modules=modules
    )
    x = torch.randn(b, s, config.hidden, requires_grad=True)
    meter = SavedTensorMeter(exclude=list(chunk.parameters()))
    with meter:
        y = chunk(x)
    kept = meter.live
    y.sum().backward()
    return kept


@pytest.mark.parametrize("name", STRUCTURES)
def test_planned_block_bytes_equal_measured_for_every_structure_and_recompute(name):
    config = ModelConfig(**(BASE | STRUCTURES[name]))
    rows = []
    for layer in range(config.layers):
        for recompute, modules in RECOMPUTE:
            measured = _measured(config, recompute, modules, layer)
            strategy = Strategy(ParallelLayout(), 2, 1, recompute, recompute_modules=modules or ("elementwise",))
            planned = block_bytes(ModelSpec(config), strategy, 32, HARDWARE["cpu"], layer)
            rows.append((layer, recompute, modules, measured, planned))
    bad = [r for r in rows if abs(r[4] / r[3] - 1) > 0.01]
    assert not bad, bad


def test_plain_matmul_attention_flops_equal_the_counted_ones():
    """The score and value matmuls of the sinks' plain-matmul path, counted by torch's FLOP counter over one
    block's forward and backward: every key of the sequence, the window notwithstanding."""
    from torch.utils.flop_counter import FlopCounterMode

    from modelpar.plan.unfused import plain_attention_flops

    config = ModelConfig(**(BASE | STRUCTURES["sinks-window"]))
    b, s = 2, 32
    chunk = build_chunk(config, None, [0], first=False, last=False, seed=0)
    x = torch.randn(b, s, config.hidden, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        chunk(x).sum().backward()
    projections = 6.0 * b * s * config.block_params()
    planned = plain_attention_flops(ModelSpec(config), Strategy(ParallelLayout(), b, 1), s)
    assert counter.get_total_flops() == projections + planned
    assert planned == 3 * 4 * b * s * config.heads * config.head_size * s  # all 32 keys, not the window's 16


def test_the_planner_prices_the_scores_and_prefers_layouts_that_do_not_keep_them():
    """GPT-OSS's sinks at 8k tokens: on one cp rank (and under the all-to-all) each layer keeps fp32 [b, h, s, s]
    probabilities, which the ring does not, and computes them in fp32 matmuls; where the same model without
    sinks is planned data parallel, the search's answer with them is the ring or the all-gather."""
    from modelpar.plan import SearchSpace, plan, predict

    shape = dict(vocab_size=32000, hidden=2048, layers=16, heads=32, kv_heads=8, ffn_hidden=8192, kernels="triton")
    sinks = ModelSpec(ModelConfig(**shape, block=BlockStructure(attention_sinks=True)))
    plain = ModelSpec(ModelConfig(**shape))
    h100, seq = HARDWARE["h100-80gb"], 8192
    one_rank = Strategy(ParallelLayout(dp=8), 1, 8)
    gap = (
        predict(one_rank, sinks, h100, seq_len=seq).memory.activations
        - predict(one_rank, plain, h100, seq_len=seq).memory.activations
    )
    probabilities = 4.0 * seq * 32 * (seq + 1)  # per layer, one micro-batch in flight
    assert gap > 16 * probabilities
    ring = Strategy(ParallelLayout(dp=4, cp=2), 1, 8, cp_comm="ring")
    a2a = Strategy(ParallelLayout(dp=4, cp=2), 1, 8, cp_comm="alltoall")
    assert (
        predict(ring, sinks, h100, seq_len=seq).memory.activations
        < 2 * predict(ring, plain, h100, seq_len=seq).memory.activations
    )
    assert predict(a2a, sinks, h100, seq_len=seq).memory.activations > 16 * probabilities / 2
    assert predict(one_rank, sinks, h100, seq_len=seq).compute_s > predict(one_rank, plain, h100, seq_len=seq).compute_s
    space = SearchSpace(tp=1, pp=1)  # dp x cp over 8 GPUs, every recompute, ZeRO and micro-batching
    (best, *_), (without, *_) = (
        plan(m, h100, gpus=8, seq_len=seq, global_batch=8, space=space) for m in (sinks, plain)
    )
    assert without.strategy.layout.cp == 1, without.strategy  # nothing to save: data parallel
    s = best.strategy
    assert s.layout.cp > 1 and s.cp_comm in ("ring", "allgather"), s  # the scores neither kept nor all computed
    assert best.prediction.total_s > without.prediction.total_s
