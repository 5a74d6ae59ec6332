"""Whether a run ended with its final state saved, and if not, which saved state is the newest.

A save that fails (a full disk, a folder made unwritable) is reported and training goes on
(``trainer.save_error=continue``), since a later save may succeed. When the last one requested, at the final step,
fails too, the run's work since its newest checkpoint exists nowhere but in memory that is about to be freed: the
job must not end as a success.
"""

from __future__ import annotations

from pathlib import Path

from modelpar.checkpoint.store import latest_checkpoint
from modelpar.training.config import TrainConfig


def step_of(ckpt: Path) -> int:
    return int(ckpt.name.removeprefix("step-"))


def unsaved_final_state(cfg: TrainConfig) -> str | None:
    """One line if the run asked for checkpoints but its final step's was not written, else None."""
    t = cfg.trainer
    if not t.ckpt_every:
        return None  # no checkpoint was asked for
    root = Path(t.out_dir) / "checkpoints"
    newest = latest_checkpoint(root)
    if newest is not None and step_of(newest) >= t.steps:
        return None
    held = f"the newest saved state is {newest} (step {step_of(newest)})" if newest else "no state of it was saved"
    return (
        f"the save of the final step {t.steps} failed (see the lines above); {held}; free space or fix {root}'s "
        "permissions and rerun the same command to train from there (trainer.resume=auto)"
    )
