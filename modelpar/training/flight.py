"""A flight recorder per rank: what it is doing now and its last events, always on disk within a second.

A stuck rank cannot report itself, and the ranks waiting on it only learn that a collective timed out. So
every rank keeps a small ring of events (step, action, start, end) and a background thread writes it to
``<out_dir>/flight/rank-00003.json`` every ``period_s`` (and once more on exit). After a failure the launcher
reads these files and names the rank that stopped making progress and the action it was in. A rank that has
made no progress for ``stall_s`` also dumps torch's recorder of collectives (``parallel.collective_trace``) to
``<out_dir>/flight/torch/rank_<N>``, once per stall, so the report can name the first collective the ranks
of a group disagree on.
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from collections import deque
from pathlib import Path

from modelpar.parallel import collective_trace

TORCH_DIR = "torch"  # under the flight directory: torch's recorder of collectives, one dump per rank


class FlightRecorder:
    """``begin(label)`` / ``end()`` around each action; ``step`` is set by the trainer."""

    def __init__(
        self,
        directory: str | Path,
        rank: int,
        where: str = "",
        capacity: int = 64,
        period_s: float = 1.0,
        stall_s: float | None = None,
    ):
        self.path = Path(directory) / f"rank-{rank:05d}.json"
        self.trace_dir = Path(directory) / TORCH_DIR
        self.stall_s = 2 * period_s if stall_s is None else stall_s
        self._created = time.time()
        self._traced_stall: float | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.where = where  # e.g. "pp 0 tp 1 dp 0": action labels use pipeline ranks
        self.step = 0
        self.current: tuple[str, float, bool] | None = None
        self.waiting: tuple[str, float] | None = None  # a blocking collective inside the current action
        self.events: deque[tuple[int, str, float, float]] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # the thread holds only a weak reference: a recorder nobody uses any more stops writing by itself
        self._thread = threading.Thread(
            target=_dump_periodically, args=(weakref.ref(self), self._stop, period_s), name="flight", daemon=True
        )
        self._thread.start()

    def begin(self, label: str, waiting: bool = False) -> None:
        """Start ``label``; ``waiting``: it waits on other ranks (a receive), rather than computing."""
        self.current = (label, time.time(), waiting)

    def wait(self, label: str) -> None:
        """Blocked in a collective (inside the current action): waiting on the other ranks, not stuck itself."""
        self.waiting = (label, time.time())

    def done_waiting(self) -> None:
        self.waiting = None

    def end(self) -> None:
        if self.current is not None:
            label, start, _ = self.current
            self.events.append((self.step, label, start, time.time()))
            self.current = None

    def snapshot(self) -> dict:
        current, waiting = self.current, self.waiting
        if current is not None and waiting is not None:
            current = (f"{current[0]} ({waiting[0]})", current[1], True)
        return {
            "rank": self.rank,
            "where": self.where,
            "pid": os.getpid(),
            "step": self.step,
            "now": time.time(),
            "current": None if current is None else {"action": current[0], "since": current[1], "waiting": current[2]},
            "last_progress": self.events[-1][3] if self.events else None,
            "events": [{"step": s, "action": a, "start": t0, "end": t1} for s, a, t0, t1 in list(self.events)],
        }

    def stalled_since(self) -> float:
        """When this rank last made progress: the start of what it is in now (the collective it waits in,
        if any), else the end of its last action."""
        current, waiting = self.current, self.waiting
        if current is not None or waiting is not None:
            return max(t[1] for t in (current, waiting) if t is not None)
        return self.events[-1][3] if self.events else self._created

    def dump_trace_if_stalled(self) -> Path | None:
        """Dump torch's recorder of collectives once per stall of ``stall_s`` or more; the path written."""
        since = self.stalled_since()
        if time.time() - since < self.stall_s or since == self._traced_stall:
            return None
        self._traced_stall = since
        return collective_trace.write(self.trace_dir, self.rank)

    def dump(self) -> None:
        with self._lock:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(self.snapshot()))
            os.replace(tmp, self.path)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.dump()


def _dump_periodically(ref: weakref.ref, stop: threading.Event, period_s: float) -> None:
    while not stop.wait(period_s):
        recorder = ref()
        if recorder is None:
            return
        try:
            recorder.dump()
            recorder.dump_trace_if_stalled()
        except OSError:
            return  # the run directory went away: nothing left to report into
        del recorder


def read_flight(directory: str | Path) -> list[dict]:
    """Every rank's last snapshot, in rank order (ranks that never wrote one are absent)."""
    out = []
    for path in sorted(Path(directory).glob("rank-*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return out


def hang_report(snapshots: list[dict], suspects: list[int] | None = None, lagging: list[int] = ()) -> str:
    """One line naming the rank that stopped making progress, then a line per rank.

    ``suspects``: ranks still running after the others gave up (the launcher knows them). Among the
    candidates, a rank computing (not waiting on a receive) for the longest time is the stuck one; ``lagging``
    (ranks that torch's recorder shows behind their group's collectives) go first among those computing, so a
    peer whose last snapshot predates its wait is not named in their place.
    """
    if not snapshots:
        return "no flight records were written"
    now = max(s["now"] for s in snapshots)

    def stalled_since(s: dict) -> float:
        if s["current"] is not None:
            return s["current"]["since"]
        return s["last_progress"] or now

    def waiting(s: dict) -> bool:
        return bool(s["current"] and s["current"].get("waiting"))

    candidates = [s for s in snapshots if suspects and s["rank"] in suspects] or snapshots
    stuck = min(candidates, key=lambda s: (waiting(s), s["rank"] not in lagging, stalled_since(s)))
    current = stuck["current"]["action"] if stuck["current"] else "between actions"
    where = f" ({stuck['where']})" if stuck.get("where") else ""
    lines = [
        f"rank {stuck['rank']}{where} stuck in {current} at step {stuck['step']} "
        f"(no progress for {now - stalled_since(stuck):.0f} s)"
    ]
    for s in snapshots:
        doing = s["current"]["action"] if s["current"] else "idle"
        lines.append(f"  rank {s['rank']:>3}: step {s['step']}, in {doing} for {now - stalled_since(s):.0f} s")
    return "\n".join(lines)


def flight_hang_report(directory: str, alive: list[int]) -> str:
    """For ``launch(..., hang_report=partial(flight_hang_report, directory))``: the flight recorders' account
    of who was stuck where (each line after a newline), or "" when there are no records to read."""
    snapshots = read_flight(directory)
    if not snapshots:
        return ""
    trace_dir = Path(directory) / TORCH_DIR
    traces = collective_trace.read(trace_dir)  # once, for the report's line and its tie-break
    trace = collective_trace.trace_report(trace_dir, len(snapshots), traces)
    report = hang_report(snapshots, suspects=alive or None, lagging=collective_trace.lagging_ranks(traces))
    return "\n" + report + (f"\n{trace}" if trace else "")
