"""ZeRO-2 and ZeRO-3 on FSDP2: what each rank holds, and what the recipe check refuses.

Parity with the single-device model (losses and gradients, resume, resharding) is in
tests/training/test_layouts.py with the other layouts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from modelpar.testing import run_on_ranks
from modelpar.training.config import RecipeError, validate
from tests.helpers import make_config


def _state_bytes(cfg, data_path: str) -> dict[str, int]:
    """Model-state bytes on this rank at the optimizer step (gradients reduced, not yet dropped)."""
    from modelpar.bench.meters import model_state_bytes
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, None)
    params = [p for p, _ in trainer.model.params]
    seen = {}
    inner = trainer.optimizer.optimizer
    handle = inner.register_step_pre_hook(lambda *_: seen.update(model_state_bytes(params, inner)))
    trainer.train_step()
    trainer.train_step()  # the moments exist from the first step on
    handle.remove()
    return seen


def _zero(tmp_path, zero: int):
    cfg = make_config(tmp_path, dp=4, microbatches=1)
    return replace(cfg, optim=replace(cfg.optim, zero=zero))


def test_zero3_holds_a_quarter_of_the_model_state_at_dp4(token_path, tmp_path):
    plain = run_on_ranks(4, _state_bytes, _zero(tmp_path / "z0", 0), token_path)
    sharded = run_on_ranks(4, _state_bytes, _zero(tmp_path / "z3", 3), token_path)
    for z0, z3 in zip(plain, sharded, strict=True):
        total0, total3 = sum(z0.values()), sum(z3.values())
        assert total3 <= 0.30 * total0, (z0, z3)  # ideal 0.25; dim-0 shards of small tensors round up
        assert z3["gradients"] + z3["optimizer"] <= 0.30 * (z0["gradients"] + z0["optimizer"])
        assert z3["weights"] <= 0.30 * z0["weights"]


def test_zero2_shards_gradients_and_optimizer_state(token_path, tmp_path):
    plain = run_on_ranks(4, _state_bytes, _zero(tmp_path / "z0", 0), token_path)
    sharded = run_on_ranks(4, _state_bytes, _zero(tmp_path / "z2", 2), token_path)
    for z0, z2 in zip(plain, sharded, strict=True):
        assert z2["gradients"] + z2["optimizer"] <= 0.30 * (z0["gradients"] + z0["optimizer"]), (z0, z2)


def test_hybrid_sharding_holds_half_at_dp4_in_pairs(token_path, tmp_path):
    plain = run_on_ranks(4, _state_bytes, _zero(tmp_path / "z0", 0), token_path)
    cfg = _zero(tmp_path / "h", 3)
    hybrid = run_on_ranks(4, _state_bytes, replace(cfg, optim=replace(cfg.optim, zero_group=2)), token_path)
    for z0, h in zip(plain, hybrid, strict=True):
        assert 0.45 * sum(z0.values()) <= sum(h.values()) <= 0.55 * sum(z0.values()), (z0, h)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"trainer.sdc_check_every": 10}, "trainer.sdc_check_every is not supported"),
        ({"model.compile": True}, "model.compile=true is untested"),
        (
            {"optim.zero_group": 3},
            r"optim.zero_group=3 needs optim.zero=2 or 3 and a divisor of dp x cp = 2 \(\[1, 2\]\)",
        ),
    ],
)
def test_what_fsdp2_is_not_combined_with_is_refused_in_one_line(tmp_path, change, message):
    cfg = make_config(tmp_path, dp=2)
    cfg = replace(cfg, optim=replace(cfg.optim, zero=3))
    for key, value in change.items():
        group, name = key.split(".")
        cfg = replace(cfg, **{group: replace(getattr(cfg, group), **{name: value})})
    with pytest.raises(RecipeError, match=message) as refused:
        validate(cfg)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize(
    "change",
    [
        {"parallel.schedule": "zb-h1", "parallel.pp": 2, "parallel.microbatches": 2},  # the split backward
        {"parallel.schedule": "zb-h1", "parallel.pp": 2, "parallel.recompute": "full"},
        {"parallel.tp": 4},  # kv_heads=2 < tp: the replicated k/v rows summed over tp on the dp shards
    ],
    ids=["zb-h1", "zb-h1-recompute", "kv-heads-below-tp"],
)
def test_zb_h1_and_kv_heads_below_tp_pass_validation_under_fsdp2(tmp_path, zero, change):
    cfg = make_config(tmp_path, dp=2)
    cfg = replace(cfg, optim=replace(cfg.optim, zero=zero))
    for key, value in change.items():
        group, name = key.split(".")
        cfg = replace(cfg, **{group: replace(getattr(cfg, group), **{name: value})})
    validate(cfg)  # parity with the single device: tests/training/test_layouts.py


def _weight_pass_hooks(cfg, data_path: str) -> list[bool]:
    """After a ZB-H1 step: are the weights sharded at rest? Then the W hooks: gathered, and sharded again."""
    from torch.distributed.tensor import DTensor

    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, None)
    trainer.train_step()
    chunk, opt = trainer.model.chunks[0], trainer.optimizer

    def sharded() -> bool:
        return all(isinstance(p, DTensor) for p in chunk.parameters())

    seen = [sharded(), all(p.grad is None or isinstance(p.grad, DTensor) for p in chunk.parameters())]
    opt.expect_micro_batches(cfg.parallel.microbatches)
    opt.before_weight_backward(0, 0)  # a W whose weights a forward freed: gathered again
    seen.append(not any(isinstance(p, DTensor) for p in chunk.parameters()))
    opt.after_weight_backward(0, cfg.parallel.microbatches - 1)  # the chunk's last W: reduced, freed
    return [*seen, sharded()]


def test_zb_h1_leaves_zero3_weights_sharded_and_w_gathers_them(token_path, tmp_path):
    cfg = make_config(tmp_path, dp=2, pp=2, schedule="zb-h1", microbatches=2)
    cfg = replace(cfg, optim=replace(cfg.optim, zero=3))
    for seen in run_on_ranks(4, _weight_pass_hooks, cfg, token_path):
        assert seen == [True] * 4, seen


def _bf16_losses(cfg, data_path: str) -> tuple[list[float], set[str]]:
    """Losses over the run, and the dtypes the first block's weights have while it computes."""
    from modelpar.model.transformer import Block
    from modelpar.training.trainer import Trainer

    trainer = Trainer(cfg, data_path, None)
    seen: set[str] = set()
    block = next(m for m in trainer.model.chunks[0].modules() if isinstance(m, Block))
    block.register_forward_pre_hook(lambda mod, args: seen.update(str(p.dtype) for p in mod.parameters()))
    losses = [trainer.train_step().loss for _ in range(cfg.trainer.steps)]
    return losses, seen


@pytest.mark.parametrize(
    "reduce_dtype, layout",
    [("fp32", {}), ("bf16", {}), ("fp32", dict(pp=2, schedule="zb-h1"))],  # zb-h1: W's bf16 grads accumulated
    ids=["fp32", "bf16", "fp32-zb-h1"],
)
def test_zero3_bf16_gathers_bf16_weights_and_tracks_the_replicated_run(token_path, tmp_path, reduce_dtype, layout):
    base = make_config(tmp_path / "z0", dp=2, **layout)
    base = replace(base, trainer=replace(base.trainer, dtype="bf16"))
    sharded = replace(base, optim=replace(base.optim, zero=3, reduce_dtype=reduce_dtype))
    sharded = replace(sharded, trainer=replace(sharded.trainer, out_dir=str(tmp_path / "z3")))
    world = 2 * base.parallel.pp
    (ref, ref_seen), *_ = run_on_ranks(world, _bf16_losses, base, token_path)
    (got, seen), *_ = run_on_ranks(world, _bf16_losses, sharded, token_path)
    assert ref_seen == {"torch.float32"} and seen == {"torch.bfloat16"}  # fp32 masters, bf16 gathered copies
    for a, b in zip(ref, got, strict=True):
        assert abs(a - b) <= 2e-2 * abs(a), (ref, got)  # bf16 rounding of weights and reductions
