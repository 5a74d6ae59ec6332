"""Streaming prepare against the tokenizer's own ``encode_batch``, on the same documents and the same cores.

    python benchmarks/prepare.py                          # a 1 GB jsonl and parquet corpus, 2 workers
    python benchmarks/prepare.py --mb 200 --workers 2     # a few minutes on 2 cores

The corpus is Python's standard library, one source file per document, repeated to ``--mb`` megabytes and
written as jsonl and as parquet. A byte-level BPE (``--vocab`` ids, with an end-of-text token) is trained on a
sample of it. Then, side by side in this one run:

    encode_batch   the tokenizer's ``encode_batch`` on one copy of the documents held in memory, in batches of
                   the same size the prepare uses, on all its threads (the ceiling: no reading, no writing)
    encode_batch_fast  the same without character offsets: the call the prepare's workers make
    prepare        ``modelpar-data prepare`` of each corpus file with ``--workers`` processes, in a child process
                   whose memory (proportional set size, summed over it and its workers) is sampled throughout

Prints a table (MB/s of text, tokens/s, CPU seconds per MB, peak memory, prepare / encode_batch) and writes
``benchmarks/results/prepare.{json,md}``. The baselines run before and after the prepares and are averaged;
on a machine shared with other jobs the wall-clock ratios move with their load (recorded in the results),
while CPU seconds per MB (the prepare's child processes included) do not.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from modelpar.cli.args import positive_int
from modelpar.data import stdlib_sources, train_bpe
from modelpar.data.prepare_shards import DEFAULT_BATCH_BYTES
from modelpar.data.shards import read_manifest

RESULTS = Path(__file__).resolve().parent / "results"
EOS = "<|endoftext|>"


def stdlib_documents() -> list[str]:
    texts = []
    for path in stdlib_sources():
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return [t for t in texts if t.strip()]


def write_corpus(docs: list[str], folder: Path, megabytes: int) -> tuple[Path, Path, int]:
    """The documents repeated to ``megabytes`` MB of text, as ``corpus.jsonl`` and ``corpus.parquet``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    target, written = megabytes << 20, 0
    jsonl, parquet = folder / "corpus.jsonl", folder / "corpus.parquet"
    schema = pa.schema([("text", pa.string())])
    with jsonl.open("w", encoding="utf-8") as f, pq.ParquetWriter(parquet, schema) as writer:
        rows: list[str] = []
        while written < target:
            for doc in docs:
                f.write(json.dumps({"text": doc}) + "\n")
                rows.append(doc)
                written += len(doc.encode())
                if len(rows) == 2048:
                    writer.write_table(pa.table({"text": rows}, schema=schema))
                    rows = []
                if written >= target:
                    break
        if rows:
            writer.write_table(pa.table({"text": rows}, schema=schema))
    return jsonl, parquet, written


def encode_batch_rate(tokenizer_file: Path, docs: list[str], method: str) -> dict:
    """Text MB/s and tokens/s of ``method`` (encode_batch or encode_batch_fast) on ``docs`` in batches of the
    prepare's size, on all the tokenizer's threads."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    batches, batch, size = [], [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= DEFAULT_BATCH_BYTES:
            batches.append(batch)
            batch, size = [], 0
    batches.append(batch)
    start, cpu = time.perf_counter(), time.process_time()
    encode = getattr(tok, method)
    tokens = sum(len(e.ids) for b in batches for e in encode(b, add_special_tokens=False))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    mb = sum(len(d.encode()) for d in docs) / 2**20
    return {"mb_per_s": mb / elapsed, "tokens_per_s": tokens / elapsed, "seconds": elapsed, "mb": mb,
            "cpu_s_per_mb": cpu / mb}  # fmt: skip


def peak_memory(proc: psutil.Process, stop: threading.Event, out: dict) -> None:
    """Sample the proportional set size of ``proc`` and its children until ``stop``; keep the peak (bytes)."""
    while not stop.is_set():
        total = 0
        try:
            family = [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in family:
            try:
                total += p.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        out["peak"] = max(out.get("peak", 0), total)
        stop.wait(0.25)


def run_prepare(source: Path, out: Path, tokenizer: Path, workers: int, text_mb: float) -> dict:
    command = [
        sys.executable,
        "-c",
        "from modelpar.cli.data import main; raise SystemExit(main())",
        "prepare",
        str(source),
        "--output",
        str(out),
        "--tokenizer",
        str(tokenizer),
        "--workers",
        str(workers),
        "--no-progress",
    ]
    start = time.perf_counter()
    cpu = _children_cpu()
    child = subprocess.Popen(command, stdout=subprocess.PIPE)
    memory: dict = {}
    stop = threading.Event()
    sampler = threading.Thread(target=peak_memory, args=(psutil.Process(child.pid), stop, memory), daemon=True)
    sampler.start()
    child.communicate()
    elapsed = time.perf_counter() - start
    cpu = _children_cpu() - cpu  # the prepare and its workers (reaped by it), startup included
    stop.set()
    sampler.join()
    if child.returncode:
        raise SystemExit(f"prepare of {source} failed with status {child.returncode}")
    tokens = read_manifest(out)["tokens"]
    return {
        "mb_per_s": text_mb / elapsed,
        "tokens_per_s": tokens / elapsed,
        "seconds": elapsed,
        "tokens": tokens,
        "peak_pss_mb": memory.get("peak", 0) / 2**20,
        "cpu_s_per_mb": cpu / text_mb,
        "file_mb": source.stat().st_size / 2**20,
    }


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def mean_of(a: dict, b: dict) -> dict:
    """Two measurements of the same baseline (before and after the prepares): their means, and both."""
    out = {k: (a[k] + b[k]) / 2 for k in ("mb_per_s", "tokens_per_s", "seconds", "cpu_s_per_mb")}
    return out | {"mb": a["mb"], "runs_mb_per_s": [a["mb_per_s"], b["mb_per_s"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=positive_int, default=1024, help="megabytes of text per corpus file")
    parser.add_argument("--workers", type=positive_int, default=2)
    parser.add_argument("--vocab", type=positive_int, default=8192)
    parser.add_argument("--formats", nargs="+", default=["jsonl", "parquet"], choices=["jsonl", "parquet"])
    parser.add_argument("--name", default="prepare", help="results file name")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]  # other work on the machine skews both sides; it is recorded beside them
    docs = stdlib_documents()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        tmp = Path(tmp)
        print(f"corpus: {len(docs)} stdlib files repeated to {args.mb} MB as jsonl and parquet ...", flush=True)
        jsonl, parquet, text_bytes = write_corpus(docs, tmp, args.mb)
        sample, size = [], 0
        for doc in docs:
            sample.append(doc)
            size += len(doc)
            if size > 4 << 20:
                break
        tok = train_bpe(sample, args.vocab)
        tok.backend.add_special_tokens([EOS])
        tok.save(tmp / "tokenizer.json")
        # each baseline runs before and after the prepares, so a change in the machine's load shows in both
        methods = ("encode_batch", "encode_batch_fast")
        before = {m: encode_batch_rate(tmp / "tokenizer.json", docs, m) for m in methods}
        print(f"encode_batch: {before['encode_batch']['mb_per_s']:.2f} MB/s", flush=True)
        rows = {}
        for name, source in (("jsonl", jsonl), ("parquet", parquet)):
            if name in args.formats:
                rows[f"prepare {name}"] = run_prepare(
                    source, tmp / f"out-{name}", tmp / "tokenizer.json", args.workers, text_bytes / 2**20
                )
                print(f"prepare {name}: {rows[f'prepare {name}']['mb_per_s']:.2f} MB/s", flush=True)
        after = {m: encode_batch_rate(tmp / "tokenizer.json", docs, m) for m in methods}
    baseline, fast = (mean_of(before[m], after[m]) for m in methods)
    rows = {"encode_batch": baseline, "encode_batch_fast": fast, **rows}
    for row in rows.values():
        row["vs_encode_batch"] = row["mb_per_s"] / baseline["mb_per_s"]
        row["vs_encode_batch_fast"] = row["mb_per_s"] / fast["mb_per_s"]
        # work per MB, which other jobs on the machine do not change: encode_batch's CPU seconds / this row's
        row["cpu_vs_encode_batch"] = baseline["cpu_s_per_mb"] / row["cpu_s_per_mb"]
    header = (
        "| run | MB/s | tokens/s | seconds | CPU s per MB | peak memory (PSS) | vs encode_batch | "
        "vs encode_batch_fast | CPU efficiency vs encode_batch |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {name} | {r['mb_per_s']:.2f} | {r['tokens_per_s']:,.0f} | {r['seconds']:.1f} | {r['cpu_s_per_mb']:.2f} | "
        + (f"{r['peak_pss_mb']:.0f} MB" if "peak_pss_mb" in r else "-")
        + f" | {r['vs_encode_batch']:.2f}x | {r['vs_encode_batch_fast']:.2f}x | {r['cpu_vs_encode_batch']:.2f}x |"
        for name, r in rows.items()
    ]
    settings = {
        "mb": args.mb,
        "workers": args.workers,
        "vocab": args.vocab,
        "cpus": os.cpu_count(),
        "text_bytes": text_bytes,
        "documents": len(docs),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
    }
    table = header + "\n".join(lines)
    print(f"\n{args.mb} MB of text per corpus, {args.workers} workers, {os.cpu_count()} CPUs\n\n{table}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=2) + "\n")
    (RESULTS / f"{args.name}.md").write_text(
        f"# modelpar-data prepare vs encode_batch\n\n{json.dumps(settings)}\n\n{table}\n"
    )


if __name__ == "__main__":
    main()
