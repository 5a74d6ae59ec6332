"""Gantt charts of a pipeline timeline (simulated or measured): text for terminals, PNG through matplotlib."""

from __future__ import annotations

import math

from modelpar.pipeline.simulate import TimedAction, Timeline

_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}


def _label(timed: TimedAction) -> str:
    a = timed.action
    return f"{a.kind.value}{a.micro_batch}" + (f"c{a.chunk}" if a.chunk else "")


def render_text(timeline: Timeline, *, width: int = 120, title: str = "") -> str:
    """One row per rank: each compute action is a block starting with its label (``F3``, ``B0c1``), padded
    with dots to its length; blanks are idle time. ``width`` is the number of columns for the whole span.

    For unit costs a column stands for a fixed fraction of a time unit, so blocks line up across ranks.
    """
    t0, span = timeline.start, timeline.span
    scale = width / span if span > 0 else 1.0
    lines = [title] if title else []
    for rank, row in enumerate(timeline.rows):
        cells = [" "] * max(1, math.ceil(span * scale))
        for timed in row:
            if not timed.action.kind.is_compute:
                continue
            first = round((timed.start - t0) * scale)
            last = max(first + 1, round((timed.end - t0) * scale))
            text = _label(timed)
            for i in range(first, min(last, len(cells))):
                cells[i] = text[i - first] if i - first < len(text) else "."
        lines.append(f"rank {rank:>2} |{''.join(cells).rstrip()}")
    lines.append(f"span {span:.4g}, bubble {timeline.bubble_fraction:.1%}")
    return "\n".join(lines)


def render_png(timeline: Timeline, path: str, *, title: str = "") -> None:
    """Draw ``timeline`` as horizontal bars per rank (F blue, B orange, W green) into the PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt

    t0 = timeline.start
    ranks = len(timeline.rows)
    fig, ax = plt.subplots(figsize=(12, 0.6 * ranks + 1.2))
    for rank, row in enumerate(timeline.rows):
        for timed in row:
            kind = timed.action.kind.value
            if kind not in _COLOURS:
                continue
            ax.broken_barh(
                [(timed.start - t0, timed.duration)], (rank - 0.4, 0.8), facecolors=_COLOURS[kind], edgecolor="white"
            )
            ax.text(timed.start - t0 + timed.duration / 2, rank, _label(timed), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(title or f"bubble {timeline.bubble_fraction:.1%}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
