"""Resuming on what is left: with ``trainer.elastic=true`` a job runs on the world now available, not only on
the one its recipe names, and resumes its checkpoint there.

The world available is, under torchrun or SLURM, the ``WORLD_SIZE`` of the job they started; for a locally
spawned job, ``trainer.world`` (0: the recipe's layout's world) less the ranks declared lost so far. A rank is
lost when it is gone for good (a machine that does not come back); locally the fault ``lose@RANK:STEP``
stands for that event: the rank dies and leaves a marker in ``<run>/flight/lost/``, and every later restart
of the job (``trainer.max_restarts``) counts one rank fewer.

The layout is re-chosen from the recipe's: tp, pp, cp (and vpp, the schedule) are kept, and dp becomes
``world / (tp x pp x cp)`` for the largest world up to the one available that this allows with a dp dividing
``data.global_batch`` (a rank left over sits idle, and the line says so); ep is kept where it still divides
dp x cp, else the largest split that does. ``data.global_batch`` and the sampler's position in the global
order are kept (the order does not depend on dp, ``modelpar.data.sampler``), the micro-batches are re-derived
so that each keeps its ``global_batch / (dp x m)`` sequences where that divides, and the checkpoint is
resharded on load (``modelpar.checkpoint.reshard``). Losses then continue as the uninterrupted run's would,
to rounding.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from modelpar.parallel.layout import LayoutError
from modelpar.pipeline import PartitionError, ScheduleError
from modelpar.training.config import RecipeError, TrainConfig
from modelpar.training.preflight import check_recipe

LOST_DIR = "lost"  # under <run>/flight: one marker per rank declared lost (the fault's name, e.g. "lose@3:2")


def lost_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "flight" / LOST_DIR


def lost_ranks(out_dir: str | Path) -> int:
    """How many ranks this run has lost so far (markers written by the ``lose`` fault)."""
    root = lost_dir(out_dir)
    return len(list(root.iterdir())) if root.is_dir() else 0


def available_world(cfg: TrainConfig, lost: int = 0) -> int:
    """The ranks a local job may spawn now: ``trainer.world`` (0: the layout's) less the ``lost`` ones.

    Without ``trainer.elastic`` the job runs only on its layout's world: a different world (a ``trainer.world``
    or a lost rank) is refused in one line naming the fix."""
    layout_world = cfg.parallel.layout().world_size
    world = (cfg.trainer.world or layout_world) - lost
    if not cfg.trainer.elastic and world != layout_world:
        why = f"{lost} rank(s) of the job are lost" if lost else f"trainer.world={cfg.trainer.world}"
        raise RecipeError(
            f"{why}, leaving {world} ranks, but layout {cfg.parallel.layout()} needs {layout_world}; set "
            f"trainer.elastic=true to continue on {world} ranks, or give the layout {world} ranks"
        )
    if world < 1:
        raise RecipeError(f"no rank is left ({lost} lost of {cfg.trainer.world or layout_world}); nothing can resume")
    return world


def _micro_batch_choices(cfg: TrainConfig, dp: int) -> list[int]:
    """Micro-batch counts for ``dp`` replicas, best first: the one keeping each micro-batch's sequences."""
    p, batch = cfg.parallel, cfg.data.global_batch
    size = batch // (p.dp * p.microbatches) or 1  # sequences per micro-batch in the recipe's layout
    per_replica = batch // dp
    counts = [m for m in range(1, per_replica + 1) if per_replica % m == 0]
    return sorted(counts, key=lambda m: (abs(per_replica // m - size), -m))


def elastic_config(cfg: TrainConfig, world: int) -> tuple[TrainConfig, str]:
    """The recipe re-laid out for ``world`` ranks (see the module's docstring) and one line saying what changed
    ("" when nothing did). Raises ``RecipeError`` in one line when no layout keeps tp x pp x cp on ``world``."""
    p = cfg.parallel
    if world == p.layout().world_size:
        return cfg, ""
    inner = p.tp * p.pp * p.cp
    problems = []
    for used in range(world, 0, -1):
        if used % inner or cfg.data.global_batch % (used // inner):
            continue
        dp = used // inner
        splits = cfg.model.expert_splits(dp * p.cp) if cfg.model.moe.enabled else [1]
        ep = p.ep if p.ep in splits else max(s for s in splits if s <= p.ep)
        for m in _micro_batch_choices(cfg, dp):
            new = replace(cfg, parallel=replace(p, dp=dp, ep=ep, microbatches=m))
            try:
                check_recipe(new)
            except (RecipeError, LayoutError, ScheduleError, PartitionError, ValueError) as exc:
                problems.append(str(exc))
                continue
            idle = f", using {used} of them ({world - used} idle)" if used < world else ""
            note = (
                f"elastic: {world} ranks available{idle}; layout {p.layout()} -> {new.parallel.layout()}, "
                f"micro-batches {p.microbatches} -> {m}, global batch {cfg.data.global_batch} kept"
            )
            return new, note
    reason = f" ({problems[0]})" if problems else ""
    raise RecipeError(
        f"trainer.elastic: no layout keeps tp={p.tp} x pp={p.pp} x cp={p.cp} ({inner} ranks a replica) on the "
        f"{world} ranks available with a dp dividing data.global_batch={cfg.data.global_batch}{reason}; "
        f"give the recipe a tp x pp x cp that divides {world}"
    )


__all__ = ["available_world", "elastic_config", "lost_dir", "lost_ranks"]
