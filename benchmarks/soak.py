"""Soak: a 4-rank job runs thousands of steps while faults strike at intervals, and the job restarts itself
(``trainer.max_restarts``) from the newest verified checkpoint, saved asynchronously (``trainer.ckpt_async``);
each rank's resident memory and open files are sampled over time, and the final weights are compared with an
uninterrupted run's (asynchronous saves too), bit for bit.

    python benchmarks/soak.py                           # tp2 x pp2, 2000 steps, a fault every ~300 steps
    python benchmarks/soak.py --steps 400 --every 100   # a quick one

The faults are those that change no result (the math of every step is the same with or without them): a
rank SIGKILLed, a rank that hangs (``trainer.timeout_s`` names it, the job is restarted), a rank killed
while a checkpoint is written, a save that fails with ENOSPC (training goes on), a straggling rank. The job
is launched once: each death is followed by one ``restart i of N ... after: cause`` line of its own launcher,
and each fault strikes once per job. Growth is each rank's resident memory (and open files) at the end of a
run segment (one attempt's ranks) against the same rank early in it, after warm-up; the table names the
worst. Writes ``benchmarks/results/soak.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SMALL = [  # the default recipe's model, shrunk: 4 ranks on a laptop's cores
    "model.hidden=32", "model.layers=4", "model.ffn_hidden=64", "data.seq_len=32", "data.global_batch=8",
    "data.corpus_max_bytes=200000", "trainer.progress=false", "trainer.sample_tokens=0", "trainer.log_every=50",
    "parallel=tp2-pp2", "trainer.keep_last=3",
]  # fmt: skip
# (kind, rank, argument): each strikes once, at the next interval; cycled through
FAULTS = [("kill", 2, ""), ("save_error", 1, ""), ("sleep", 3, ""), ("save_crash", 0, ""), ("delay", 1, ":0.002")]


def _descendants(pid: int) -> list[int]:
    """Child processes of ``pid``, recursively (the launcher's ranks), oldest first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in sorted(children.get(todo.pop(), [])):
            out.append(child)
            todo.append(child)
    return out


def _sample(pid: int) -> tuple[float, int] | None:
    """(resident MiB, open files) of ``pid``, or None once it is gone."""
    try:
        rss = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS"))
        return int(rss.split()[1]) / 1024, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


class Sampler(threading.Thread):
    """Every ``period`` s: each rank's (time, MiB, open files); ranks are the launcher's children that run a
    training step's worth of memory (the multiprocessing helpers are skipped by size)."""

    def __init__(self, pid: int, period: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.period = pid, period
        self.series: dict[int, list[tuple[float, float, int]]] = {}
        self.done = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while not self.done.is_set():
            for child in _descendants(self.pid):
                got = _sample(child)
                if got is not None:
                    self.series.setdefault(child, []).append((time.monotonic() - start, *got))
            self.done.wait(self.period)


def launch(
    run_dir: Path, steps: int, ckpt_every: int, faults: str, timeout_s: float, restarts: int
) -> tuple[int, Sampler, list[tuple[float, str]]]:
    """One job (``restarts``: its ``trainer.max_restarts``); its exit code, samples and timed output lines."""
    env = dict(os.environ, MODELPAR_FAULTS=faults, PYTHONUNBUFFERED="1")  # lines timed as they are printed
    args = [
        sys.executable, "-m", "modelpar.cli.train", *SMALL, f"hydra.run.dir={run_dir}", f"trainer.steps={steps}",
        f"trainer.ckpt_every={ckpt_every}", "trainer.resume=auto", f"trainer.timeout_s={timeout_s}",
        "trainer.ckpt_async=true", f"trainer.max_restarts={restarts}", "trainer.restart_backoff_s=1",
    ]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    sampler = Sampler(proc.pid)
    sampler.start()
    lines = [(time.monotonic() - start, line.rstrip()) for line in proc.stdout]
    proc.wait()
    sampler.done.set()
    sampler.join()
    return proc.returncode, sampler, lines


def growth(series: list[tuple[float, float, int]]) -> tuple[float, float, float] | None:
    """(start MiB, end MiB, open-files growth) of one rank over a segment: the median of samples 25-40% of
    the way in (after warm-up) against the median of the last 15%."""
    if len(series) < 20:
        return None
    n = len(series)
    early, late = series[n // 4 : n * 2 // 5], series[n * 17 // 20 :]
    rss0, rss1 = statistics.median(s[1] for s in early), statistics.median(s[1] for s in late)
    fd0, fd1 = statistics.median(s[2] for s in early), statistics.median(s[2] for s in late)
    return rss0, rss1, fd1 / fd0 - 1


def final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    from modelpar.checkpoint.store import Piece, load_pieces, read_index, step_dir

    ckpt = step_dir(run_dir / "checkpoints", step)
    index = read_index(ckpt)
    wanted = [Piece.whole(name, tuple(t["global_shape"])) for name, t in index["tensors"].items()]
    return {p.name: t for p, t in load_pieces(ckpt, index, wanted).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=300, help="steps between faults")
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--timeout-s", type=float, default=10.0, help="trainer.timeout_s: how soon a hang is named")
    ap.add_argument("--out", default="/tmp/modelpar-soak")
    ap.add_argument("--results", default=str(RESULTS / "soak"))
    args = ap.parse_args()
    out = Path(args.out)
    if out.exists():
        import shutil

        shutil.rmtree(out)

    began = time.time()
    code, straight_sampler, log = launch(out / "straight", args.steps, args.ckpt_every, "", args.timeout_s, 0)
    if code != 0:
        sys.exit("soak: the uninterrupted run failed:\n" + "\n".join(line for _, line in log[-40:]))
    straight_s = time.time() - began

    # the fault schedule, fixed up front: fault i strikes at step (i + 1) * every, kinds cycled
    strikes = range(args.every, args.steps, args.every)
    schedule = [f"{k}@{r}:{s}{a}" for s, (k, r, a) in zip(strikes, FAULTS * len(strikes), strict=False)]
    deaths = sum(f.split("@")[0] in ("kill", "sleep", "save_crash") for f in schedule)
    t0 = time.time()
    code, sampler, log = launch(
        out / "faulted", args.steps, args.ckpt_every, ",".join(schedule), args.timeout_s, deaths
    )
    faulted_s = time.time() - t0
    if code != 0:
        sys.exit("soak: the faulted job did not finish:\n" + "\n".join(line for _, line in log[-40:]))
    restarts = [(t, line.split(" after: ", 1)[1]) for t, line in log if " after: " in line and "restart " in line]
    survived = [(t, line.strip()) for t, line in log if "training goes on" in line]
    # a segment is one attempt: from the previous restart line (or the start) to the next
    bounds = [0.0, *(t for t, _ in restarts), float("inf")]
    segments = []
    for i in range(len(bounds) - 1):
        lo, hi = bounds[i], bounds[i + 1]
        segment = {
            "ended_by": restarts[i][1] if i < len(restarts) else "finished",
            "seconds": round((hi if hi != float("inf") else faulted_s) - lo, 1),
            "survived": [line for t, line in survived if lo <= t < hi][:3],
            "growth": {},
        }
        for pid, series in sorted(sampler.series.items()):
            # a rank of this attempt (not a small helper process): sampled first within the segment
            if not series or not lo <= series[0][0] < hi or max(x[1] for x in series) <= 100:
                continue
            g = growth(series)
            if g is not None:
                segment["growth"][f"pid {pid}"] = {
                    "rss_start_mib": round(g[0], 1), "rss_end_mib": round(g[1], 1),
                    "rss_growth": round(g[1] / g[0] - 1, 4), "open_files_growth": round(g[2], 4),
                }  # fmt: skip
        segments.append(segment)

    a, b = final_weights(out / "straight", args.steps), final_weights(out / "faulted", args.steps)
    equal = a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    worst_rss = max((g["rss_growth"] for s in segments for g in s["growth"].values()), default=None)
    worst_fd = max((g["open_files_growth"] for s in segments for g in s["growth"].values()), default=None)
    result = {
        "steps": args.steps, "layout": "tp2 x pp2 (4 ranks)", "faults": schedule, "segments": segments,
        "restarts": len(restarts), "max_restarts": deaths, "ckpt_async": True,
        "uninterrupted_seconds": round(straight_s, 1), "faulted_seconds": round(faulted_s, 1),
        "final_weights_equal": equal, "worst_rss_growth": worst_rss, "worst_open_files_growth": worst_fd,
        "machine": f"{os.cpu_count()} cores", "torch": torch.__version__,
    }  # fmt: skip
    lines = [
        f"# Soak: {args.steps} steps, tp2 x pp2, a fault every {args.every} steps, one job restarting itself",
        "",
        f"`trainer.max_restarts={deaths}`, `trainer.ckpt_async=true` (both runs), checkpoints every "
        f"{args.ckpt_every} steps, `trainer.timeout_s={args.timeout_s:g}`. Faults: {', '.join(schedule)}.",
        "",
        "| segment | ended by (its restart line) | seconds | worst RSS growth | worst open-files growth | survived |",
        "|---|---|---|---|---|---|",
    ]
    for i, s in enumerate(segments):
        rss = fds = "too short"
        if s["growth"]:
            rss, fds = (f"{max(g[k] for g in s['growth'].values()):+.1%}" for k in ("rss_growth", "open_files_growth"))
        told = "; ".join(s["survived"]) or "-"
        lines.append(f"| {i} | {s['ended_by']} | {s['seconds']} | {rss} | {fds} | {told} |")
    lines += [
        "",
        f"{len(restarts)} restarts, none by hand; the job finished in {faulted_s:.0f} s. Final weights equal the "
        f"uninterrupted run's ({args.steps} steps, {straight_s:.0f} s): **{equal}**. Worst resident-memory growth "
        f"within a segment: {worst_rss:+.1%}; open files: {worst_fd:+.1%}.",
    ]
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results + ".json").write_text(json.dumps(result, indent=1) + "\n")
    Path(args.results + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not equal:
        sys.exit("soak: the final weights differ from the uninterrupted run's")


if __name__ == "__main__":
    main()
