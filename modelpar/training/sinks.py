"""Where step metrics go: one ``MetricsSink`` interface, with jsonl, console, tqdm, TensorBoard and W&B sinks.

The loop hands every step's ``StepMetrics`` to each sink on the logging rank; nothing in the step knows them.
"""

from __future__ import annotations

import json
import netrc
import os
import secrets
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

from modelpar.training.config import TrainConfig
from modelpar.training.step import StepMetrics


class MetricsSink(Protocol):
    def write(self, m: StepMetrics) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per step, appended: a resumed run continues the same file from its checkpoint's step,
    dropping the lines of the steps after it that it is about to train again (each step is in the file once)."""

    def __init__(self, path: Path, start_step: int = 0):
        if path.exists():
            kept = [line for line in path.read_text().splitlines(keepends=True) if _step_of(line) <= start_step]
            partial = path.with_name(path.name + ".partial")
            partial.write_text("".join(kept))
            partial.replace(path)
        self.file = open(path, "a")

    def write(self, m: StepMetrics) -> None:
        self.file.write(json.dumps(asdict(m)) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _step_of(line: str) -> float:
    """A metrics line's step; a line cut short by a crash counts as after any step (it is dropped)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def postfix(m: StepMetrics) -> dict[str, str]:
    """The few numbers shown per step: loss, learning rate, tokens/s, MFU."""
    out = {"loss": f"{m.loss:.4f}", "lr": f"{m.lr:.2e}", "tok/s": f"{m.tokens_per_s:,.0f}"}
    if m.mfu is not None:
        out["mfu"] = f"{100 * m.mfu:.1f}%"
    return out


def line(m: StepMetrics) -> str:
    return f"step {m.step:6d} " + " ".join(f"{k} {v}" for k, v in postfix(m).items())


class ConsoleSink:
    """A line every ``log_every`` steps and at the last step."""

    def __init__(self, log_every: int, steps: int):
        self.log_every, self.steps = log_every, steps

    def write(self, m: StepMetrics) -> None:
        if m.step % self.log_every == 0 or m.step == self.steps:
            print(line(m), flush=True)

    def close(self) -> None:
        pass


class ProgressSink:
    """A tqdm progress bar with the step's numbers beside it."""

    def __init__(self, total: int, initial: int):
        from tqdm import tqdm  # tqdm starts a monitor thread on import; only the logging rank needs it

        self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

    def write(self, m: StepMetrics) -> None:
        self.bar.set_postfix(postfix(m), refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class TensorBoardSink:
    """Scalars under ``train/`` in ``<out_dir>/tensorboard``."""

    KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu")

    def __init__(self, out_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter  # an optional package
        except ImportError as exc:
            raise RuntimeError(
                "trainer.tensorboard=true needs the tensorboard package: pip install tensorboard"
            ) from exc
        self.writer = SummaryWriter(str(out_dir / "tensorboard"))

    def write(self, m: StepMetrics) -> None:
        for key in self.KEYS:
            if getattr(m, key) is not None:
                self.writer.add_scalar(f"train/{key}", getattr(m, key), m.step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Scalars under ``train/`` in a Weights & Biases run whose config is the recipe and the layout.

    ``WANDB_MODE`` is the user's if set; otherwise the run is online only with credentials (``WANDB_API_KEY`` or
    ``wandb login``) and kept offline in ``<out_dir>/wandb`` without them (``wandb sync`` uploads it later).
    The run id lives in ``<out_dir>/wandb/run-id``, so a resumed training run continues the same W&B run.
    """

    KEYS = (*TensorBoardSink.KEYS, "step_time_s", "skipped_total")

    def __init__(self, cfg: TrainConfig, out_dir: Path):
        try:
            import wandb  # an optional package: the [wandb] extra
        except ImportError as exc:
            raise RuntimeError("trainer.wandb=true needs the wandb package: pip install 'modelpar[wandb]'") from exc
        folder = out_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "run-id"
        if not id_file.is_file():
            id_file.write_text(secrets.token_hex(4))
        layout = cfg.parallel.layout()
        config = asdict(cfg) | {"layout": {"name": str(layout), "world_size": layout.world_size, **asdict(layout)}}
        self.run = wandb.init(
            project=cfg.trainer.wandb_project,
            dir=str(out_dir),
            id=id_file.read_text().strip(),
            resume="allow",
            config=config,
            mode=os.environ.get("WANDB_MODE") or ("online" if _wandb_credentials() else "offline"),
            settings=wandb.Settings(console="off", silent=True),
        )

    def write(self, m: StepMetrics) -> None:
        values = {f"train/{key}": getattr(m, key) for key in self.KEYS if getattr(m, key) is not None}
        self.run.log(values, step=m.step)

    def close(self) -> None:
        self.run.finish()


def _wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def open_sinks(cfg: TrainConfig, out_dir: Path, start_step: int) -> list[MetricsSink]:
    """The sinks a recipe asks for, on the logging rank."""
    t = cfg.trainer
    sinks: list[MetricsSink] = [JsonlSink(out_dir / "metrics.jsonl", start_step)]
    # the bar redraws in place on a terminal; into a file or pipe it would write a line per refresh
    bar = t.progress and sys.stderr.isatty()
    sinks.append(ProgressSink(t.steps, start_step) if bar else ConsoleSink(t.log_every, t.steps))
    if t.tensorboard:
        sinks.append(TensorBoardSink(out_dir))
    if t.wandb:
        sinks.append(WandbSink(cfg, out_dir))
    return sinks
