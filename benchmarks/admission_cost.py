"""What admission costs at start-up: the challenge-response every rank runs before its process group exists.

    python benchmarks/admission_cost.py               # worlds 2, 8, 32, 64; 5 rounds each
    python benchmarks/admission_cost.py --worlds 2 16 --rounds 9

Three figures, medians over rounds:

- ``code_version``: hashing the installed modelpar and its recipes, once per process;
- the protocol alone (``modelpar.parallel.admission.admit``) over a real TCP store on loopback, one client
  connection per rank, ranks as threads of one process (so on 2 cores the ranks' CPU work is serialised: an
  upper bound on what separate processes would see), with a job secret and without one (code and recipe only,
  what torchrun/SLURM jobs without a secret run);
- a whole local start (``modelpar.parallel.launch.launch`` of an empty function on 2 spawned ranks: spawn,
  rendezvous, admission, gloo's connections), with a secret against without admission.

Each rank reads every other rank's nonce and response (about 200 bytes each), so the store serves
2 x world^2 small values in all: the cost grows with the square of the world.

Writes ``benchmarks/results/admission_cost.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch.distributed as dist

from modelpar.parallel.admission import AdmissionSpec, admit, code_version
from modelpar.parallel.launch import launch

RESULTS = Path(__file__).resolve().parent / "results"
TIMEOUT = datetime.timedelta(seconds=120)


def protocol_s(world: int, spec: AdmissionSpec) -> float:
    """Seconds from the first rank's start to the last rank's admission, ranks as threads."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    clients = [dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT) for _ in range(world)]
    done: list[float] = []
    start = time.perf_counter()

    def rank_main(rank: int) -> None:
        admit(clients[rank], rank, world, spec, TIMEOUT)
        done.append(time.perf_counter())

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(done) == world
    return max(done) - start


def _nothing() -> None:
    pass


def start_s(spec: AdmissionSpec | None) -> float:
    began = time.perf_counter()
    launch(2, _nothing, timeout_s=60, admission=spec)
    return time.perf_counter() - began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 8, 32, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--results", default=str(RESULTS / "admission_cost"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "job.key"
        key.write_text(secrets.token_hex(32))
        key.chmod(0o600)
        with_secret, without = AdmissionSpec(str(key), recipe="r"), AdmissionSpec("", recipe="r")
        hashing = statistics.median(_timed(code_version.__wrapped__) for _ in range(args.rounds))
        rows = []
        for world in args.worlds:
            secret_ms = statistics.median(protocol_s(world, with_secret) for _ in range(args.rounds)) * 1e3
            plain_ms = statistics.median(protocol_s(world, without) for _ in range(args.rounds)) * 1e3
            rows.append({"world": world, "with_secret_ms": secret_ms, "code_check_only_ms": plain_ms})
            print(f"world {world:4d}: admission {secret_ms:8.1f} ms with a secret, {plain_ms:8.1f} ms without")
        starts = {"admitted_s": [], "plain_s": []}
        for _ in range(args.rounds):  # alternate, so load from other jobs hits both alike
            starts["admitted_s"].append(start_s(with_secret))
            starts["plain_s"].append(start_s(None))
    launch_row = {k: statistics.median(v) for k, v in starts.items()}
    print(f"code_version: {hashing * 1e3:.1f} ms once per process")
    print(f"2-rank local start: {launch_row['admitted_s']:.3f} s admitted, {launch_row['plain_s']:.3f} s plain")
    result = {
        "cpu_count": os.cpu_count(),
        "rounds": args.rounds,
        "code_version_ms": hashing * 1e3,
        "protocol": rows,
        "local_start_2_ranks": launch_row,
        "local_start_rounds": starts,
    }
    lines = [
        "# Admission's start-up cost",
        "",
        f"{os.cpu_count()} CPU cores, loopback TCP store, medians of {args.rounds} rounds "
        "(`python benchmarks/admission_cost.py`).",
        "",
        "| ranks | admission with a secret (ms) | code/recipe check only (ms) |",
        "| ---: | ---: | ---: |",
        *(f"| {r['world']} | {r['with_secret_ms']:.1f} | {r['code_check_only_ms']:.1f} |" for r in rows),
        "",
        f"Hashing the installed modelpar and its recipes (`code_version`, once per process): {hashing * 1e3:.1f} ms.",
        "",
        f"A whole 2-rank local start (spawn, rendezvous, gloo): {launch_row['admitted_s']:.3f} s admitted against "
        f"{launch_row['plain_s']:.3f} s without admission.",
    ]
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results + ".json").write_text(json.dumps(result, indent=1) + "\n")
    Path(args.results + ".md").write_text("\n".join(lines) + "\n")


def _timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


if __name__ == "__main__":
    main()
