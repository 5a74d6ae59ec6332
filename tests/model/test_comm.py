"""Conjugate tp/sp region ops (values and gradients), and the exact communication of a transformer layer."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from modelpar.backends import gloo_cpu
from modelpar.model.transformer import build_model
from modelpar.optim.finalize import reduce_tensor_parallel_grads
from modelpar.parallel import collectives, regions
from modelpar.parallel.collectives import record_comm
from modelpar.parallel.regions import TensorParallelGroup
from modelpar.testing import current_groups, run_on_ranks
from tests.model.reference import BATCH, CONFIGS, SEED, SEQ, batch, layout_for

SHAPE = (2, 8, 3)  # [b, s, h]; s divisible by tp


def _full(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


# per op: (this rank's input from X, the gradient fed to its output from G) -> expected output and input gradient
REGIONS = {
    "copy_to_tp_region": dict(
        x=lambda X, r, t: X, g=lambda G, r, t: G * (r + 1),
        out=lambda X, r, t: X, grad=lambda G, r, t: G * sum(q + 1 for q in range(t)),
        fwd=[], bwd=["all_reduce"],
    ),
    "reduce_from_tp_region": dict(
        x=lambda X, r, t: X * (r + 1), g=lambda G, r, t: G,
        out=lambda X, r, t: X * sum(q + 1 for q in range(t)), grad=lambda G, r, t: G,
        fwd=["all_reduce"], bwd=[],
    ),
    "gather_from_sequence_region": dict(
        x=lambda X, r, t: X.chunk(t, 1)[r], g=lambda G, r, t: G * (r + 1),
        out=lambda X, r, t: X, grad=lambda G, r, t: (G * sum(q + 1 for q in range(t))).chunk(t, 1)[r],
        fwd=["all_gather"], bwd=["reduce_scatter"],
    ),
    "reduce_scatter_to_sequence_region": dict(
        x=lambda X, r, t: X * (r + 1), g=lambda G, r, t: G.chunk(t, 1)[r],
        out=lambda X, r, t: (X * sum(q + 1 for q in range(t))).chunk(t, 1)[r], grad=lambda G, r, t: G,
        fwd=["reduce_scatter"], bwd=["all_gather"],
    ),
    "scatter_to_sequence_region": dict(
        x=lambda X, r, t: X, g=lambda G, r, t: G.chunk(t, 1)[r],
        out=lambda X, r, t: X.chunk(t, 1)[r], grad=lambda G, r, t: G,
        fwd=[], bwd=["all_gather"],
    ),
}  # fmt: skip


def _run_region(op_name):
    tp = TensorParallelGroup.of(current_groups())
    spec = REGIONS[op_name]
    x = spec["x"](_full(0), tp.rank, tp.size).clone().requires_grad_()
    with record_comm() as fwd:
        out = getattr(regions, op_name)(x, tp)
    with record_comm() as bwd:
        out.backward(spec["g"](_full(1), tp.rank, tp.size))
    return out.detach(), x.grad, [e.kind for e in fwd.events], [e.kind for e in bwd.events]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("op_name", list(REGIONS))
def test_region_op_forward_and_backward_are_conjugate_collectives(op_name, tp):
    spec = REGIONS[op_name]
    X, G = _full(0), _full(1)
    for rank, (out, grad, fwd, bwd) in enumerate(run_on_ranks(4, _run_region, op_name, layout=layout_for(tp))[:tp]):
        torch.testing.assert_close(out, spec["out"](X, rank, tp), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, spec["grad"](G, rank, tp), rtol=1e-6, atol=1e-6)
        assert (fwd, bwd) == (spec["fwd"], spec["bwd"])


def test_region_ops_are_free_identities_on_a_single_device():
    x = torch.randn(SHAPE, requires_grad=True)
    with record_comm() as log:
        for op_name in REGIONS:
            assert getattr(regions, op_name)(x, TensorParallelGroup()) is x
    assert log.events == []


def _model_comm(config, sp, recompute="none", keep_shard=True):
    groups = current_groups()
    model = build_model(config, groups, seed=SEED, sequence_parallel=sp, recompute=recompute, sp_keep_shard=keep_shard)
    ids, targets = batch(config)
    with record_comm() as forward:
        logits = model(ids)
    with record_comm() as loss_log:
        loss = model.loss(logits, targets)
    with record_comm() as backward:
        loss.backward()
    with record_comm() as grad_sync:
        reduce_tensor_parallel_grads(model)
    return [log.events for log in (forward, loss_log, backward, grad_sync)]


def _count(events):
    return Counter((e.tag, e.kind, e.elements) for e in events)


@pytest.mark.parametrize("sp", [False, True, "gathered"], ids=["nosp", "sp", "sp-gathered"])
@pytest.mark.parametrize("tp", [2, 4])
def test_each_layer_communicates_exactly_two_allreduces_or_their_sequence_parallel_equivalent(tp, sp):
    """Under sequence parallelism each column-parallel linear (qkv, gate|up, the head) all-gathers its input's
    shard again in backward (``sp_keep_shard``, the default); keeping the gathered input instead (``gathered``)
    it does not."""
    config = CONFIGS["mha-untied"]
    L, bsh, n = config.layers, BATCH * SEQ * config.hidden, BATCH * SEQ
    keep = sp is True
    forward, loss, backward, grad_sync = run_on_ranks(
        4, _model_comm, config, bool(sp), "none", keep, layout=layout_for(tp)
    )[0]
    if sp:
        want_forward = {
            ("embedding", "reduce_scatter", bsh): 1,
            ("layer", "all_gather", bsh): 2 * L,
            ("layer", "reduce_scatter", bsh): 2 * L,
            ("head", "all_gather", bsh): 1,
        }
        want_backward = {
            ("layer", "reduce_scatter", bsh): 2 * L,
            ("layer", "all_gather", bsh): (4 if keep else 2) * L,
            ("head", "reduce_scatter", bsh): 1,
            ("embedding", "all_gather", bsh): 1,
        }
        if keep:
            want_backward[("head", "all_gather", bsh)] = 1
        norms = (2 * L + 1) * config.hidden
        assert _count(grad_sync) == {("grad_sync", "all_reduce", norms): 1}
    else:
        want_forward = {("embedding", "all_reduce", bsh): 1, ("layer", "all_reduce", bsh): 2 * L}
        want_backward = {("layer", "all_reduce", bsh): 2 * L, ("head", "all_reduce", bsh): 1}
        assert grad_sync == []
    assert _count(forward) == want_forward
    assert _count(backward) == want_backward
    assert _count(loss) == {("loss", "all_reduce", n): 1, ("loss", "all_reduce", 2 * n): 1}
    assert {e.group_size for e in forward + loss + backward + grad_sync} == {tp}


def test_replicated_kv_heads_add_one_gradient_allreduce_and_nothing_per_layer():
    config = CONFIGS["gqa-kv1-untied"]
    forward, _, backward, grad_sync = run_on_ranks(4, _model_comm, config, False, layout=layout_for(4))[0]
    bsh = BATCH * SEQ * config.hidden
    assert _count(forward)[("layer", "all_reduce", bsh)] == 2 * config.layers
    assert _count(backward)[("layer", "all_reduce", bsh)] == 2 * config.layers
    kv = 2 * config.layers * config.kv_heads * config.head_size * config.hidden  # k and v of every layer, in full
    assert _count(grad_sync) == {("grad_sync", "all_reduce", kv): 1}


def test_single_device_model_records_no_communication():
    config = CONFIGS["mha-untied"]
    model = build_model(config, seed=SEED)
    ids, targets = batch(config)
    with record_comm() as log:
        model.loss(model(ids), targets).backward()
        reduce_tensor_parallel_grads(model)
    assert log.events == []


# -- collective algorithms: gloo's native ring vs the recursive-doubling exchange ------------------------------


def _collectives(algorithm: str, layout_tp: int):
    """Every comm collective over this rank's tp group under ``algorithm``; values chosen so sums are exact."""
    previous = gloo_cpu.collective_algorithm()
    gloo_cpu.set_collective_algorithm(algorithm)
    try:
        tp = TensorParallelGroup.of(current_groups())
        r, t = tp.rank, tp.size
        base = torch.arange(24, dtype=torch.float32).view(4, 6)
        used = gloo_cpu.uses_exchange(tp.group, base.numel() * 4)
        out = {"exchange": used}
        out["sum"] = collectives.all_reduce(base * (r + 1), tp.group)
        out["avg"] = collectives.all_reduce(base * (r + 1), tp.group, op=torch.distributed.ReduceOp.AVG)
        out["max"] = collectives.all_reduce(base - r, tp.group, op=torch.distributed.ReduceOp.MAX)
        out["min"] = collectives.all_reduce(base - r, tp.group, op=torch.distributed.ReduceOp.MIN)
        out["gather"] = collectives.all_gather(base[:1] + 100 * r, tp.group, dim=0)
        out["scatter"] = collectives.reduce_scatter(base[:, :t] * (r + 1) + 10 * r, tp.group, dim=1)  # distinct blocks
        # handles in flight together, waited in order: the pattern of gradient buckets
        tensors = [base * (r + 1) + k for k in range(3)]
        works = [collectives.all_reduce_async(x, tp.group) for x in tensors]
        for w in works:
            w.wait()
        out["async"] = tensors
        # random values: every rank must hold the same bits after an all-reduce
        noise = torch.randn(1000, generator=torch.Generator().manual_seed(r))
        out["noise"] = collectives.all_reduce(noise, tp.group)
        # above gloo_cpu.HALVES_MIN_BYTES (two ranks exchange halves), an odd count: halves of unequal length
        large = torch.randn(gloo_cpu.HALVES_MIN_BYTES // 4 + 3, generator=torch.Generator().manual_seed(r))
        collectives.all_reduce_async(large, tp.group).wait()
        out["large"] = large
        mean = torch.randn(large.numel(), generator=torch.Generator().manual_seed(r))
        collectives.all_reduce_async(mean, tp.group, op=torch.distributed.ReduceOp.AVG).wait()
        out["large_avg"] = mean
        return out
    finally:
        gloo_cpu.set_collective_algorithm(previous)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("algorithm", ["native", "exchange", "auto"])
def test_collective_algorithms_compute_the_same_collectives(algorithm, tp):
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    results = run_on_ranks(4, _collectives, algorithm, tp, layout=layout_for(tp))[:tp]
    total = sum(q + 1 for q in range(tp))
    for rank, out in enumerate(results):
        assert out["exchange"] == (algorithm != "native")  # auto: gloo and 96 bytes -> exchange
        torch.testing.assert_close(out["sum"], base * total, rtol=0, atol=0)
        torch.testing.assert_close(out["avg"], base * total / tp, rtol=0, atol=0)
        torch.testing.assert_close(out["max"], base, rtol=0, atol=0)
        torch.testing.assert_close(out["min"], base - (tp - 1), rtol=0, atol=0)
        torch.testing.assert_close(out["gather"], torch.cat([base[:1] + 100 * q for q in range(tp)]), rtol=0, atol=0)
        full = base[:, :tp] * total + 10 * sum(range(tp))
        torch.testing.assert_close(out["scatter"], full.chunk(tp, 1)[rank], rtol=0, atol=0)
        for k, x in enumerate(out["async"]):
            torch.testing.assert_close(x, base * total + k * tp, rtol=0, atol=0)
        assert torch.equal(out["noise"], results[0]["noise"]), "ranks disagree on an all-reduce's bits"
        assert torch.equal(out["large"], results[0]["large"]), "ranks disagree on a large all-reduce's bits"
        assert torch.equal(out["large_avg"], results[0]["large_avg"]), "ranks disagree on a large mean's bits"
        assert torch.equal(out["large_avg"], out["large"] / tp)  # the mean: the sum's bits divided by tp
    expected = sum(torch.randn(1000, generator=torch.Generator().manual_seed(q)) for q in range(tp))
    torch.testing.assert_close(results[0]["noise"], expected, rtol=1e-6, atol=1e-6)
    n = gloo_cpu.HALVES_MIN_BYTES // 4 + 3
    expected = sum(torch.randn(n, generator=torch.Generator().manual_seed(q)) for q in range(tp))
    torch.testing.assert_close(results[0]["large"], expected, rtol=1e-6, atol=1e-6)


def test_unknown_collective_algorithm_is_refused():
    with pytest.raises(ValueError, match="not one of"):
        gloo_cpu.set_collective_algorithm("tree")


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_full_recompute_reruns_each_layers_forward_collectives_inside_backward(sp):
    config = CONFIGS["mha-untied"]
    L, bsh = config.layers, BATCH * SEQ * config.hidden
    # a rerun block gathers its inputs again anyway, so its column-parallel linears keep the gathered input
    # whatever sp_keep_shard says: compared with a plain run keeping it too, full recompute (sp_keep_shard on)
    # adds the reruns and, under SP, the head's gather of its kept shard (the head is never rerun)
    plain, full = (
        run_on_ranks(4, _model_comm, config, sp, rc, rc == "full", layout=layout_for(2))[0] for rc in ("none", "full")
    )
    assert _count(full[0]) == _count(plain[0])  # forward: the same
    # backward reruns each block's forward up to the last tensor its backward needs (torch's checkpoint stops
    # there): every collective of the block but the MLP's output reduction, the block's last op
    rerun = (
        {("layer", "all_gather", bsh): 2 * L, ("layer", "reduce_scatter", bsh): L, ("head", "all_gather", bsh): 1}
        if sp
        else {("layer", "all_reduce", bsh): L}
    )
    assert _count(full[2]) == _count(plain[2]) + Counter(rerun)
