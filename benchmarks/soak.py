"""Soak: a 4-rank job runs thousands of steps while faults strike at intervals and ``resume=auto`` restarts
it; each rank's resident memory and open files are sampled over time, and the final weights are compared
with an uninterrupted run's, bit for bit.

    python benchmarks/soak.py                           # tp2 x pp2, 2000 steps, a fault every ~300 steps
    python benchmarks/soak.py --steps 400 --every 100   # a quick one

The faults are those that change no result (the math of every step is the same with or without them): a
rank SIGKILLed, a rank that hangs (``trainer.timeout_s`` names it, the job is restarted), a rank killed
while writing a checkpoint, a save that fails with ENOSPC (training goes on), a straggling rank. After every
death the job is launched again with ``trainer.resume=auto``. Growth is each rank's resident memory (and
open files) at the end of a run segment against the same rank early in it, after warm-up; the table names
the worst. Writes ``benchmarks/results/soak.{json,md}``.
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


def launch(run_dir: Path, steps: int, ckpt_every: int, faults: str, timeout_s: float) -> tuple[int, Sampler, str]:
    env = dict(os.environ, MODELPAR_FAULTS=faults)
    args = [
        sys.executable, "-m", "modelpar.cli.train", *SMALL, f"hydra.run.dir={run_dir}", f"trainer.steps={steps}",
        f"trainer.ckpt_every={ckpt_every}", "trainer.resume=auto", f"trainer.timeout_s={timeout_s}",
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    sampler = Sampler(proc.pid)
    sampler.start()
    out, _ = proc.communicate()
    sampler.done.set()
    sampler.join()
    return proc.returncode, sampler, out


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
    code, straight_sampler, log = launch(out / "straight", args.steps, args.ckpt_every, "", args.timeout_s)
    if code != 0:
        sys.exit(f"soak: the uninterrupted run failed:\n{log[-3000:]}")
    straight_s = time.time() - began

    # the fault schedule, fixed up front: fault i strikes at step (i + 1) * every, kinds cycled
    strikes = range(args.every, args.steps, args.every)
    schedule = [f"{k}@{r}:{s}{a}" for s, (k, r, a) in zip(strikes, FAULTS * len(strikes), strict=False)]
    pending, segments = list(schedule), []
    while True:
        t0 = time.time()
        code, sampler, log = launch(out / "faulted", args.steps, args.ckpt_every, ",".join(pending), args.timeout_s)
        named = [line.strip() for line in log.splitlines() if "rank" in line and ("died" in line or "stuck" in line)]
        segment = {"faults": list(pending), "exit": code, "seconds": round(time.time() - t0, 1), "named": named[:2]}
        segment["survived"] = [line.strip() for line in log.splitlines() if "training goes on" in line][:3]
        segment["growth"] = {}
        for pid, series in sorted(sampler.series.items()):
            g = growth(series)
            if g is not None and max(x[1] for x in series) > 100:  # a rank (not a small helper process)
                segment["growth"][f"pid {pid}"] = {
                    "rss_start_mib": round(g[0], 1), "rss_end_mib": round(g[1], 1),
                    "rss_growth": round(g[1] / g[0] - 1, 4), "open_files_growth": round(g[2], 4),
                }  # fmt: skip
        segments.append(segment)
        if code == 0:
            break
        # the job died: the earliest pending fault that kills struck; it and every one before it are spent
        killer = next((i for i, f in enumerate(pending) if f.split("@")[0] in ("kill", "sleep", "save_crash")), None)
        if killer is None or len(segments) > len(schedule) + 2:
            sys.exit(f"soak: the job died with no fault left to explain it:\n{log[-3000:]}")
        segment["struck"] = pending[killer]
        pending = pending[killer + 1 :]

    a, b = final_weights(out / "straight", args.steps), final_weights(out / "faulted", args.steps)
    equal = a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    worst_rss = max((g["rss_growth"] for s in segments for g in s["growth"].values()), default=None)
    worst_fd = max((g["open_files_growth"] for s in segments for g in s["growth"].values()), default=None)
    result = {
        "steps": args.steps, "layout": "tp2 x pp2 (4 ranks)", "faults": schedule, "segments": segments,
        "restarts": len(segments) - 1,
        "uninterrupted_seconds": round(straight_s, 1), "final_weights_equal": equal,
        "worst_rss_growth": worst_rss, "worst_open_files_growth": worst_fd,
        "machine": f"{os.cpu_count()} cores", "torch": torch.__version__,
    }  # fmt: skip
    lines = [
        f"# Soak: {args.steps} steps, tp2 x pp2, a fault every {args.every} steps, resume=auto after each death",
        "",
        "| segment | fault that ended it | exit | seconds | worst RSS growth | worst open-files growth | named |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, s in enumerate(segments):
        rss = fds = "too short"
        if s["growth"]:
            rss, fds = (f"{max(g[k] for g in s['growth'].values()):+.1%}" for k in ("rss_growth", "open_files_growth"))
        told = "; ".join(s["named"] + s["survived"]) or "-"
        lines.append(f"| {i} | {s.get('struck', '-')} | {s['exit']} | {s['seconds']} | {rss} | {fds} | {told} |")
    lines += [
        "",
        f"Final weights equal the uninterrupted run's ({args.steps} steps, {straight_s:.0f} s): **{equal}**. "
        f"Worst resident-memory growth within a segment: {worst_rss:+.1%}; open files: {worst_fd:+.1%}. "
        f"Faults: {', '.join(schedule)}.",
    ]
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results + ".json").write_text(json.dumps(result, indent=1) + "\n")
    Path(args.results + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not equal:
        sys.exit("soak: the final weights differ from the uninterrupted run's")


if __name__ == "__main__":
    main()
