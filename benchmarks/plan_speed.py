"""How fast ``modelpar.plan.plan`` searches: seconds and strategies predicted per second for a few searches.

    python benchmarks/plan_speed.py                              # this tree's planner
    python benchmarks/plan_speed.py --before /tmp/old-tree       # and an older tree's, case by case, same load
    python benchmarks/plan_speed.py --cases dense8 moe64         # some of the searches only

Each search runs in a fresh process (no cache carried from one to the next): the number of strategies it
predicts (calls of ``predict`` from the search, offload and per-micro-batch-reduce trials included), its
seconds, and a digest of its whole ranked answer (every entry's strategy and prediction, repr'd), so that two
trees' answers can be compared exactly. With ``--before`` (a directory holding another version's ``modelpar``
package, e.g. ``git archive <commit> | tar -x -C DIR``) each search runs there first, then here, under the
same machine load; the load average is recorded at the start and the end. Seconds are wall time on a shared
machine: compare the two columns of one run, not runs of different days.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

CASES = {
    "dense8": "llama-8b, 8 H100, batch 16, seq 4096",
    "ctx32k8": "llama-8b (flash), 8 H100, batch 8, seq 32768 (offload and per-micro-batch reduce tried)",
    "moe64": "mixtral-8x7b, 64 H100, batch 256, seq 4096, ep 8, cp 1, 1F1B",
    "moe16": "qwen3-30b-a3b, 16 H100, batch 64, seq 4096, free search",
    "cpu4": "bench-tiny, 4 CPU ranks, batch 16, seq 128",
    "ctx128k": "llama-8b (flash), 64 H100, batch 32, seq 131072 (tests/plan/test_plan_context.py)",
    "dense1024": "llama-70b, 1024 H100, batch 1024, seq 8192",
}


def _search(name: str):
    """The search ``name`` as a call (the model and hardware loaded, nothing searched yet)."""
    from functools import partial

    from modelpar.plan import HARDWARE, ModelSpec, SearchSpace, load_model
    from modelpar.plan import plan as planner

    def plan(*args, **kwargs):
        return partial(planner, *args, **kwargs)

    h100, llama = HARDWARE["h100-80gb"], load_model("llama-8b")
    flash = ModelSpec(llama.shape, flash_attention=True)
    if name == "dense8":
        return plan(llama, h100, gpus=8, global_batch=16, seq_len=4096)
    if name == "ctx32k8":
        return plan(flash, h100, gpus=8, global_batch=8, seq_len=32768)
    if name == "moe64":
        space = SearchSpace(ep=8, cp=1, max_vpp=1, schedules=("1f1b",))
        return plan(load_model("mixtral-8x7b"), h100, gpus=64, global_batch=256, seq_len=4096, space=space)
    if name == "moe16":
        return plan(load_model("qwen3-30b-a3b"), h100, gpus=16, global_batch=64, seq_len=4096)
    if name == "cpu4":
        return plan(load_model("bench-tiny"), HARDWARE["cpu"], gpus=4, global_batch=16, seq_len=128)
    if name == "ctx128k":
        return plan(flash, h100, gpus=64, global_batch=32, seq_len=131072)
    if name == "dense1024":
        return plan(load_model("llama-70b"), h100, gpus=1024, global_batch=1024, seq_len=8192)
    raise SystemExit(f"unknown case {name!r}; choose from {', '.join(CASES)}")


def worker(name: str) -> None:
    """One search in this process: print {strategies, seconds, entries, digest} as JSON."""
    import modelpar.plan.search as search

    predicted = 0
    predict = search.predict

    def counting(*args, **kwargs):
        nonlocal predicted
        predicted += 1
        return predict(*args, **kwargs)

    search.predict = counting
    call = _search(name)
    start = time.perf_counter()
    planned = call()
    seconds = time.perf_counter() - start
    digest = hashlib.sha256(repr([(e.strategy, e.prediction) for e in planned]).encode()).hexdigest()[:16]
    print(json.dumps({"strategies": predicted, "seconds": seconds, "entries": len(planned), "digest": digest}))


def run_in(tree: Path, name: str) -> dict:
    """``worker(name)`` with ``tree``'s modelpar first on the path."""
    code = f"import runpy, sys; sys.path.insert(0, {str(tree)!r}); "
    code += f"runpy.run_path({str(Path(__file__).resolve())!r})['worker']({name!r})"
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="a directory holding an older modelpar package to time too")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    load_start = os.getloadavg()
    rows = []
    for name in args.cases:
        row = {"case": name, "what": CASES[name]}
        if args.before:
            row["before"] = run_in(args.before.resolve(), name)
        row["after"] = run_in(ROOT, name)
        rows.append(row)
        print(_line(row), flush=True)
    load_end = os.getloadavg()
    meta = {"host": platform.node(), "cpus": os.cpu_count(), "load_start": load_start, "load_end": load_end}
    meta["python"] = platform.python_version()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "plan_speed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (RESULTS / "plan_speed.md").write_text(_markdown(rows, meta, bool(args.before)))
    print(f"load average (1, 5, 15 min): start {_load(load_start)}, end {_load(load_end)}")


def _load(load: tuple) -> str:
    return " ".join(f"{x:.1f}" for x in load)


def _line(row: dict) -> str:
    after = row["after"]
    text = f"{row['case']:8} {after['strategies']:7d} strategies {after['seconds']:7.1f} s"
    text += f" {after['strategies'] / after['seconds']:8.0f}/s"
    if "before" in row:
        before = row["before"]
        same = "same" if before["digest"] == after["digest"] else "DIFFERENT"
        text += f" | before {before['seconds']:7.1f} s {before['strategies']:7d} strategies"
        text += f" x{before['seconds'] / after['seconds']:.2f}, answers {same}"
    return text


def _markdown(rows: list[dict], meta: dict, before: bool) -> str:
    lines = [
        "# Planner search speed",
        "",
        "`python benchmarks/plan_speed.py" + (" --before <older tree>`" if before else "`"),
        f"on {meta['host']} ({meta['cpus']} CPUs, shared), Python {meta['python']}; load average (1, 5, 15 min) "
        f"{_load(meta['load_start'])} at the start, {_load(meta['load_end'])} at the end.",
        "",
    ]
    head = "| search | what | strategies | seconds | strategies/s |"
    rule = "|---|---|---:|---:|---:|"
    if before:
        head += " seconds before | speed-up | same ranked answer |"
        rule += "---:|---:|---|"
    lines += [head, rule]
    for row in rows:
        after = row["after"]
        line = f"| {row['case']} | {row['what']} | {after['strategies']} | {after['seconds']:.1f} |"
        line += f" {after['strategies'] / after['seconds']:.0f} |"
        if before:
            b = row["before"]
            same = "yes" if b["digest"] == after["digest"] and b["entries"] == after["entries"] else "NO"
            line += f" {b['seconds']:.1f} | {b['seconds'] / after['seconds']:.2f}x | {same} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
