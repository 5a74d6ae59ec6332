"""Optimizer side of a step: every data-parallel variant equals single-process AdamW on the global batch.

The model is a two-layer MLP written as named tensors (``unused`` never enters the loss, so it never has a
gradient); the reference is plain torch: full batch, ``torch.optim.AdamW``, ``clip_grad_norm_``.
"""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from modelpar.optim import (
    GradientSynchronizer,
    ParamInfo,
    ZeroOneAdamW,
    build_adamw,
    build_optimizer,
    clip_grad_norm,
    default_decay,
    load_optimizer_state_tensors,
    lr_at,
    optimizer_state_tensors,
    set_lr,
)
from modelpar.parallel.collectives import record_comm
from modelpar.parallel.layout import ParallelLayout
from modelpar.testing import current_groups, run_on_ranks

SHAPES = {"fc1.weight": (12, 8), "fc1.bias": (12,), "unused": (5,), "fc2.weight": (3, 12), "fc2.bias": (3,)}
GLOBAL_BATCH = 8
MICRO_BATCHES = 2
HYPER = dict(lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SCHEDULE = dict(warmup=2, total=8, min_lr=3e-3)
MAX_NORM = 2.0  # the reference norms are 3.0, 1.8, 2.7: steps 0 and 2 clip, step 1 does not
# reverse order: [fc2.bias, fc2.weight] [unused, fc1.bias] [fc1.weight]; the middle one never fills up
BUCKET_BYTES = 64


def _init_params() -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.nn.Parameter(torch.randn(shape, generator=g) * 0.5) for name, shape in SHAPES.items()}


def _loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x: [b, 8], y: [b, 3] -> mean squared error."""
    hidden = torch.tanh(x @ params["fc1.weight"].T + params["fc1.bias"])
    return F.mse_loss(hidden @ params["fc2.weight"].T + params["fc2.bias"], y)


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def _with_info(params: dict[str, torch.nn.Parameter]) -> list[tuple[torch.Tensor, ParamInfo]]:
    return [(p, ParamInfo(name, default_decay(name, p), norm_share=1.0)) for name, p in params.items()]


def _backward_micro_batches(params, x, y, final_backward=contextlib.nullcontext) -> None:
    """Loss scaled by 1/m per micro-batch; only the last backward runs inside ``final_backward()``."""
    pairs = list(zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES), strict=True))
    for i, (xm, ym) in enumerate(pairs):
        with final_backward() if i == len(pairs) - 1 else contextlib.nullcontext():
            (_loss(params, xm, ym) / MICRO_BATCHES).backward()


def _reference(steps: int) -> dict:
    """Single process, whole global batch, torch's own AdamW and clip_grad_norm_."""
    params = _init_params()
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": HYPER["weight_decay"]},
            {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=HYPER["lr"],
        betas=HYPER["betas"],
        eps=HYPER["eps"],
    )
    norms, first_grads = [], None
    for step in range(steps):
        _backward_micro_batches(params, *_global_batch(step))
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
        with_grad = [p for p in params.values() if p.grad is not None]
        norms.append(torch.nn.utils.clip_grad_norm_(with_grad, MAX_NORM).item())
        set_lr(opt, lr_at(step, HYPER["lr"], **SCHEDULE))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"params": {n: p.detach().clone() for n, p in params.items()}, "grads": first_grads, "norms": norms}


class _DataParallelStep:
    """One rank's side of training, as the trainer drives it: its dp slice of each global batch, one optimizer."""

    def __init__(self, params: dict[str, torch.nn.Parameter], zero: bool):
        self.params, self.groups = params, current_groups()
        self.opt = build_optimizer(_with_info(params), self.groups, zero=int(zero), bucket_bytes=BUCKET_BYTES, **HYPER)

    def backward(self, step: int) -> None:
        dp, rank = self.groups.layout.dp, self.groups.dp_rank
        x, y = (t.chunk(dp)[rank] for t in _global_batch(step))
        _backward_micro_batches(self.params, x, y, final_backward=self.opt.final_backward)

    def update(self, step: int) -> None:
        set_lr(self.opt, lr_at(step, HYPER["lr"], **SCHEDULE))
        self.opt.step()
        self.opt.zero_grad()

    def train_step(self, step: int) -> float:
        self.backward(step)
        self.opt.reduce_gradients()
        norm = float(self.opt.clip_grad_norm(MAX_NORM))
        self.update(step)
        return norm


def _train_data_parallel(zero: bool, steps: int) -> dict:
    params = _init_params()
    trainer = _DataParallelStep(params, zero)
    norms, first_grads = [], None
    for step in range(steps):
        trainer.backward(step)
        trainer.opt.reduce_gradients()
        if first_grads is None and not zero:
            first_grads = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
        norms.append(float(trainer.opt.clip_grad_norm(MAX_NORM)))
        trainer.update(step)
    return {"params": {n: p.detach().clone() for n, p in params.items()}, "grads": first_grads, "norms": norms}


def _assert_rel_close(actual: dict, expected: dict, rel: float = 1e-6) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        error = (actual[name] - expected[name]).norm() / expected[name].norm()
        assert error <= rel, f"{name}: relative error {error:.2e}"


# -- data-parallel gradient sync ---------------------------------------------------------------------------


def test_bucketed_sync_at_dp2_equals_single_process_adamw():
    expected = _reference(steps=3)
    for result in run_on_ranks(2, _train_data_parallel, False, 3, layout=ParallelLayout(dp=2), timeout_s=60):
        _assert_rel_close(result["grads"], expected["grads"])
        assert "unused" not in result["grads"]
        _assert_rel_close(result["params"], expected["params"])
        assert result["norms"] == pytest.approx(expected["norms"], rel=1e-6)


def _count_all_reduces_per_phase() -> dict:
    params = _init_params()
    sync = GradientSynchronizer(params.values(), current_groups().dp_group, bucket_bytes=BUCKET_BYTES)
    x, y = _global_batch(0)
    counts = {}
    with record_comm() as log:
        (_loss(params, x[:4], y[:4]) / 2).backward()
        counts["after_first_micro_batch"] = log.count("all_reduce")
        with sync.final_backward():
            (_loss(params, x[4:], y[4:]) / 2).backward()
        counts["after_final_backward"] = log.count("all_reduce")
        sync.wait()
        counts["after_wait"] = log.count("all_reduce")
    return counts


def test_buckets_reduce_during_the_final_backward_only_and_wait_sends_the_rest():
    for counts in run_on_ranks(2, _count_all_reduces_per_phase, layout=ParallelLayout(dp=2), timeout_s=60):
        # bucket 0 fills during backward; bucket 1 holds `unused` (no grad), so it and bucket 2 go in wait()
        assert counts == {"after_first_micro_batch": 0, "after_final_backward": 1, "after_wait": 3}


def _count_all_reduces_with_expected_micro_batches() -> list[int]:
    params = _init_params()
    sync = GradientSynchronizer(params.values(), current_groups().dp_group, bucket_bytes=BUCKET_BYTES)
    sync.expect_micro_batches(MICRO_BATCHES)
    x, y = _global_batch(0)
    counts = []
    with record_comm() as log:
        for xm, ym in zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES), strict=True):
            (_loss(params, xm, ym) / MICRO_BATCHES).backward()
            counts.append(log.count("all_reduce"))
        sync.wait()
        counts.append(log.count("all_reduce"))
    return counts


def test_expected_micro_batch_count_sends_each_gradient_after_its_last_accumulation():
    results = run_on_ranks(2, _count_all_reduces_with_expected_micro_batches, layout=ParallelLayout(dp=2))
    assert results == [[0, 1, 3]] * 2


def _sync_without_data_parallelism() -> tuple[int, bool]:
    params = _init_params()
    sync = GradientSynchronizer(params.values(), current_groups().dp_group, bucket_bytes=BUCKET_BYTES)
    _backward_micro_batches(params, *_global_batch(0), final_backward=sync.final_backward)
    before = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
    with record_comm() as log:
        sync.wait()
    return log.count(), all(torch.equal(params[n].grad, g) for n, g in before.items())


def test_sync_is_a_no_op_at_dp1():
    results = run_on_ranks(2, _sync_without_data_parallelism, layout=ParallelLayout(tp=2), timeout_s=60)
    assert results == [(0, True)] * 2


def _accumulate_twice_while_armed() -> str:
    params = _init_params()
    sync = GradientSynchronizer(params.values(), current_groups().dp_group, bucket_bytes=BUCKET_BYTES)
    x, y = _global_batch(0)
    sync.arm()
    _loss(params, x, y).backward()
    try:
        _loss(params, x, y).backward()
    except RuntimeError as error:
        return str(error)
    finally:
        sync.wait()
    return ""


def test_second_gradient_into_an_armed_parameter_is_an_error():
    for message in run_on_ranks(2, _accumulate_twice_while_armed, layout=ParallelLayout(dp=2), timeout_s=60):
        assert "accumulated a gradient after its final one" in message


def _build_with_rank_dependent_order(zero: bool) -> str:
    params = list(_with_info(_init_params()))
    if current_groups().dp_rank == 1:
        params.reverse()
    try:
        if zero:
            ZeroOneAdamW(params, current_groups().dp_group, **HYPER)
        else:
            GradientSynchronizer([p for p, _ in params], current_groups().dp_group)
    except ValueError as error:
        return str(error)
    return ""


@pytest.mark.parametrize("zero", [False, True], ids=["sync", "zero1"])
def test_parameter_order_differing_across_dp_ranks_is_refused(zero):
    layout = ParallelLayout(dp=2)
    for message in run_on_ranks(2, _build_with_rank_dependent_order, zero, layout=layout, timeout_s=60):
        assert "parameter lists differ across data-parallel ranks" in message


# -- ZeRO-1 ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dp", [2, 4])
def test_zero1_equals_single_process_adamw(dp):
    expected = _reference(steps=3)
    for result in run_on_ranks(dp, _train_data_parallel, True, 3, layout=ParallelLayout(dp=dp), timeout_s=60):
        _assert_rel_close(result["params"], expected["params"])
        assert result["norms"] == pytest.approx(expected["norms"], rel=1e-6)


def _zero1_moment_elements() -> tuple[int, int]:
    params = _init_params()
    trainer = _DataParallelStep(params, zero=True)
    trainer.train_step(0)
    zero1 = trainer.opt.optimizer
    moments = sum(state["exp_avg"].numel() for state in zero1.shard_optimizer.state.values())
    return moments, zero1.shard_numel


def test_zero1_keeps_adam_moments_for_its_shard_only():
    with_grad = sum(math.prod(shape) for name, shape in SHAPES.items() if name != "unused")
    results = run_on_ranks(4, _zero1_moment_elements, layout=ParallelLayout(dp=4), timeout_s=60)
    assert all(moments <= shard for moments, shard in results)
    assert sum(moments for moments, _ in results) == with_grad


# -- global gradient norm ----------------------------------------------------------------------------------
#
# Layout tp=2 x pp=2. Stage 0 holds W (rows sharded over tp, share 1) and the embedding E (vocab-sharded);
# stage 1 holds r (replicated over tp, share 1/2) and E's tied copy (share 0). Full tensors are the reference.


def _full_grads() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"W": torch.randn(6, 5, generator=g), "r": torch.randn(7, generator=g), "E": torch.randn(4, 3, generator=g)}


def _clip_on_tp_pp(max_norm: float, poison: float | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    groups = current_groups()
    tp = groups.tp_rank
    full = _full_grads()
    if groups.is_first_stage:
        local = {"W": (full["W"].chunk(2)[tp], 1.0), "E": (full["E"].chunk(2)[tp], 1.0)}
    else:
        local = {"r": (full["r"], 0.5), "E": (full["E"].chunk(2)[tp], 0.0)}
    with_info = []
    for name, (grad, share) in local.items():
        p = torch.zeros_like(grad, requires_grad=True)
        p.grad = grad.clone()
        with_info.append((p, ParamInfo(name, decay=False, norm_share=share)))
    if poison is not None and groups.rank == 3:
        with_info[0][0].grad[0] = poison
    norm = float(clip_grad_norm(with_info, max_norm, groups))
    return norm, {info.name: p.grad for p, info in with_info}


def test_norm_counts_replicated_sharded_and_tied_params_once_and_clips_every_shard():
    full = {name: torch.zeros_like(g, requires_grad=True) for name, g in _full_grads().items()}
    for name, grad in _full_grads().items():
        full[name].grad = grad
    expected_norm = torch.nn.utils.clip_grad_norm_(list(full.values()), max_norm=1.0).item()
    results = run_on_ranks(4, _clip_on_tp_pp, 1.0, layout=ParallelLayout(tp=2, pp=2), timeout_s=60)
    for rank, (norm, grads) in enumerate(results):
        assert norm == pytest.approx(expected_norm, rel=1e-6)
        tp = rank % 2
        for name, grad in grads.items():
            clipped = full[name].grad if name == "r" else full[name].grad.chunk(2)[tp]
            torch.testing.assert_close(grad, clipped, rtol=1e-6, atol=0)


@pytest.mark.parametrize("poison", [math.inf, math.nan])
def test_non_finite_gradient_gives_a_non_finite_norm_and_leaves_grads_unscaled(poison):
    results = run_on_ranks(4, _clip_on_tp_pp, 1.0, poison, layout=ParallelLayout(tp=2, pp=2), timeout_s=60)
    for rank, (norm, grads) in enumerate(results):
        assert not math.isfinite(norm)
        if poison == math.inf:
            assert norm == math.inf
        if rank == 0:
            torch.testing.assert_close(grads["W"], _full_grads()["W"].chunk(2)[0], rtol=0, atol=0)


# -- LR schedule -------------------------------------------------------------------------------------------


def test_lr_warms_up_linearly_then_decays_by_cosine_to_min_lr():
    def lr(step):
        return lr_at(step, base_lr=1.0, warmup=4, total=12, min_lr=0.1)

    assert lr(0) == pytest.approx(0.25)  # first update: base / warmup
    assert lr(3) == pytest.approx(1.0)  # end of warm-up
    assert lr(7) == pytest.approx(0.55)  # half-way through the cosine: (base + min) / 2
    assert lr(11) == pytest.approx(0.1)  # last step of the schedule
    assert lr(50) == pytest.approx(0.1)
    decay = [lr(s) for s in range(3, 12)]
    assert decay == sorted(decay, reverse=True)


def test_set_lr_reaches_decay_and_no_decay_groups():
    opt = build_adamw(_with_info(_init_params()), **HYPER)
    set_lr(opt, 0.123)
    assert [group["lr"] for group in opt.param_groups] == [0.123, 0.123]
    assert [group["weight_decay"] for group in opt.param_groups] == [HYPER["weight_decay"], 0.0]


def test_default_decay_skips_1d_params():
    params = _init_params()
    assert {name for name, p in params.items() if default_decay(name, p)} == {"fc1.weight", "fc2.weight"}


# -- optimizer state round trip ----------------------------------------------------------------------------


def _train_and_save(zero: bool, steps: int) -> tuple[bytes, bytes]:
    """Model weights and this rank's optimizer state after ``steps`` steps, as safetensors bytes."""
    params = _init_params()
    trainer = _DataParallelStep(params, zero)
    for step in range(steps):
        trainer.train_step(step)
    weights = {n: p.detach() for n, p in params.items()}
    return save_safetensors(weights), save_safetensors(trainer.opt.state_tensors())


def _resume(zero: bool, weights: bytes, states: list[bytes], start: int, stop: int) -> dict[str, torch.Tensor]:
    """Load the weights and the union of ``states``, then run steps ``start..stop-1``."""
    loaded = load_safetensors(weights)
    params = {n: torch.nn.Parameter(loaded[n]) for n in SHAPES}  # model order, not the file's
    trainer = _DataParallelStep(params, zero)
    trainer.opt.load_state_tensors({k: v for state in states for k, v in load_safetensors(state).items()})
    for step in range(start, stop):
        trainer.train_step(step)
    return {n: p.detach().clone() for n, p in params.items()}


def _resume_matches_uninterrupted(zero: bool) -> bool:
    uninterrupted = _train_data_parallel(zero, 4)["params"]
    weights, state = _train_and_save(zero, 2)
    resumed = _resume(zero, weights, [state], 2, 4)
    return all(torch.equal(resumed[n], uninterrupted[n]) for n in SHAPES)


@pytest.mark.parametrize("zero", [False, True], ids=["adamw", "zero1"])
def test_state_round_trip_continues_bit_identically(zero):
    assert run_on_ranks(2, _resume_matches_uninterrupted, zero, layout=ParallelLayout(dp=2), timeout_s=60) == [True] * 2


@pytest.mark.parametrize(
    ("saved_zero", "saved_dp", "loaded_zero", "loaded_dp"),
    [(True, 2, True, 4), (True, 4, False, 2), (False, 2, True, 4)],
    ids=["zero1-dp2-to-zero1-dp4", "zero1-dp4-to-adamw-dp2", "adamw-dp2-to-zero1-dp4"],
)
def test_state_reloads_across_dp_sizes_and_zero(saved_zero, saved_dp, loaded_zero, loaded_dp):
    saved = run_on_ranks(saved_dp, _train_and_save, saved_zero, 2, layout=ParallelLayout(dp=saved_dp), timeout_s=60)
    weights, states = saved[0][0], [state for _, state in saved]
    layout = ParallelLayout(dp=loaded_dp)
    expected = _reference(steps=4)["params"]
    for resumed in run_on_ranks(loaded_dp, _resume, loaded_zero, weights, states, 2, 4, layout=layout, timeout_s=60):
        _assert_rel_close(resumed, expected)


def _load_one_of_two_zero1_shards() -> str:
    weights, state = _train_and_save(True, 1)
    params = {n: torch.nn.Parameter(t) for n, t in load_safetensors(weights).items()}
    single = build_adamw(_with_info(params), **HYPER)
    try:
        load_optimizer_state_tensors(single, load_safetensors(state))
    except ValueError as error:
        return str(error)
    return ""


def test_partial_zero1_state_is_refused():
    for message in run_on_ranks(2, _load_one_of_two_zero1_shards, layout=ParallelLayout(dp=2), timeout_s=60):
        assert "load the state files of every data-parallel rank" in message


def test_state_saved_for_another_shape_is_refused():
    params = _init_params()
    opt = build_adamw(_with_info(params), **HYPER)
    _backward_micro_batches(params, *_global_batch(0))
    opt.step()
    state = optimizer_state_tensors(opt)
    state["exp_avg/fc1.bias"] = torch.zeros(13)
    with pytest.raises(ValueError, match=r"'exp_avg/fc1.bias' holds 13 elements"):
        load_optimizer_state_tensors(build_adamw(_with_info(_init_params()), **HYPER), state)


def test_plain_adamw_state_is_keyed_by_param_name():
    params = _init_params()
    opt = build_adamw(_with_info(params), **HYPER)
    _backward_micro_batches(params, *_global_batch(0))
    opt.step()
    keys = set(optimizer_state_tensors(opt))
    stepped = [n for n in SHAPES if n != "unused"]
    assert keys == {f"{kind}/{n}" for kind in ("exp_avg", "exp_avg_sq", "step") for n in stepped}
