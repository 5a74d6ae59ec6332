"""Zero-0's gradients live in their all-reduce buckets: averaged in place, never copied back, and shown to a
``before_launch`` reader as this rank's own gradients before the all-reduce overwrites them."""

import torch

from modelpar.optim import GradientSynchronizer
from modelpar.parallel.layout import ParallelLayout
from modelpar.testing import current_groups, run_on_ranks

SHAPES = {"w1": (6, 4), "b1": (6,), "only_rank1": (5,), "never": (3,), "w2": (2, 6)}
BUCKET_BYTES = 64  # reverse order: [w2, never] [only_rank1, b1] [w1]


def _params() -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.nn.Parameter(torch.randn(shape, generator=g)) for name, shape in SHAPES.items()}


def _loss(p: dict[str, torch.Tensor], rank: int, micro_batch: int) -> torch.Tensor:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + micro_batch))
    out = (torch.tanh(x @ p["w1"].T + p["b1"]) @ p["w2"].T).square().mean()
    return out + (p["only_rank1"].square().sum() if rank == 1 else 0.0)


def _sync_two_micro_batches() -> dict:
    rank = current_groups().dp_rank
    params = _params()
    sync = GradientSynchronizer(params.values(), current_groups().dp_group, bucket_bytes=BUCKET_BYTES)
    shown: dict[int, torch.Tensor] = {}
    sync.before_launch = lambda b, grads: shown.__setitem__(b, grads.clone())
    names = {id(p): n for n, p in params.items()}
    sync.expect_micro_batches(2)
    for k in range(2):
        (_loss(params, rank, k) / 2).backward()
    sync.wait()
    flats = [b.flat for b in sync.buckets]
    return {
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in params.items()},
        "in_a_bucket": {
            n: any(p.grad.untyped_storage().data_ptr() == f.untyped_storage().data_ptr() for f in flats)
            for n, p in params.items()
            if p.grad is not None
        },
        "shown": {b: shown[b] for b in sorted(shown)},
        "bucket_params": [[names[id(p)] for p in b.params] for b in sync.buckets],
    }


def _local_grads(rank: int) -> dict[str, torch.Tensor | None]:
    params = _params()
    for k in range(2):
        (_loss(params, rank, k) / 2).backward()
    return {n: p.grad for n, p in params.items()}


def test_gradients_are_averaged_in_their_buckets_and_shown_locally_before():
    results = run_on_ranks(2, _sync_two_micro_batches, layout=ParallelLayout(dp=2), timeout_s=60)
    local = [_local_grads(r) for r in range(2)]
    for rank, out in enumerate(results):
        assert out["grads"]["never"] is None  # no replica gave it one: as at dp=1
        for name in ("w1", "b1", "w2", "only_rank1"):
            mine, other = local[rank][name], local[1 - rank][name]
            expected = ((mine if mine is not None else 0) + (other if other is not None else 0)) / 2
            torch.testing.assert_close(out["grads"][name], expected, rtol=1e-6, atol=1e-7)
            assert out["in_a_bucket"][name], name  # the average lives in the bucket, not in a copy
        for b, names in enumerate(out["bucket_params"]):  # what before_launch saw: this rank's own gradients
            pieces = [local[rank][n] if local[rank][n] is not None else torch.zeros(SHAPES[n]) for n in names]
            flat = torch.cat([g.reshape(-1) for g in pieces])
            torch.testing.assert_close(out["shown"][b], flat, rtol=1e-6, atol=1e-7)
    assert torch.equal(results[0]["grads"]["only_rank1"], results[1]["grads"]["only_rank1"])
