"""The results of ``modelpar-bench`` on disk: rows merged into ``bench.json``, the table (markdown and text),
the throughput plot and, per pipeline layout, the measured timeline of one step."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict
from pathlib import Path

import torch

from modelpar.bench.config import BenchRecipe
from modelpar.bench.summary import add_ideal
from modelpar.pipeline.gantt import render_png

COLUMNS = (
    "layout",
    "ranks",
    "ours tok/s",
    "peer",
    "peer tok/s",
    "ratio",
    "TFLOP/s/rank",
    "MFU",
    "CPU share",
    "bubble meas/sim/replay",
    "of ideal",
    "act. MiB per stage",
    "comm MiB/step",
    "loss rel. diff",
)


def table_rows(rows: dict[str, dict]) -> list[list[str]]:
    out = []
    for row in rows.values():
        ours, peer = row["ours"], row["peer"]
        mib = [f"{b / 2**20:.1f}" for b in row["activation_peak_bytes_per_stage"]]
        comm = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in row["comm_bytes_per_step"].items()) or "-"
        out.append(
            [
                row["layout"],
                str(row["world_size"]),
                f"{ours['tokens_per_s']:,.0f}",
                row["peer_name"] or "-",
                f"{peer['tokens_per_s']:,.0f}" if peer else "-",
                _ratio_cell(row),
                f"{ours['tflops_per_rank']:.4f}",
                f"{ours['mfu']:.1%}" if ours["mfu"] is not None else "-",
                f"{ours['cpu_share']:.2f}" + (f" / {peer['cpu_share']:.2f}" if peer else ""),
                f"{row['bubble_measured']:.1%} / {row['bubble_simulated']:.1%} / {row['bubble_replayed']:.1%}",
                f"{row['fraction_of_ideal']:.2f}" if "fraction_of_ideal" in row else "-",
                " / ".join(mib),
                comm,
                f"{row['first_loss_rel_diff']:.1e}" if peer else "-",
            ]
        )
    return out


def _ratio_cell(row: dict) -> str:
    if not row["ratio"]:
        return "-"
    rounds = row.get("ratio_per_round") or []
    spread = f" ({min(rounds):.2f}-{max(rounds):.2f})" if len(rounds) > 1 else ""
    return f"{row['ratio']:.2f}x{spread}"


MEMORY_COLUMNS = (
    "layout",
    "stage",
    "states MiB meas.",
    "w / g / opt / buf / gath. meas.",
    "states MiB pred.",
    "pred/meas",
    "act. MiB meas.",
    "act. MiB pred.",
    "pred/meas",
    "host MiB meas. / pred.",
)


def memory_rows(rows: dict[str, dict]) -> list[list[str]]:
    """One line per (layout, pipeline stage): measured and predicted states and saved activations (MiB)."""

    def mib(b: float) -> str:
        return f"{b / 2**20:.2f}"

    def ratio(x: float | None) -> str:
        return f"{x:.3f}" if x is not None else "-"

    out = []
    for row in rows.values():
        for st in row.get("memory_per_stage", []):
            meas, pred = st["measured"], st["predicted"]
            kinds = " / ".join(mib(meas[k]) for k in ("weights", "gradients", "optimizer", "buffers", "gathered"))
            out.append(
                [
                    row["layout"],
                    str(st["stage"]),
                    mib(meas["states"]),
                    kinds,
                    mib(pred["states"]),
                    ratio(st["states_ratio"]),
                    mib(meas["activations"]),
                    mib(pred["activations"]),
                    ratio(st["activations_ratio"]),
                    f"{mib(meas['host'])} / {mib(pred['host'])}" if meas["host"] or pred["host"] else "-",
                ]
            )
    return out


def markdown_table(rows: dict[str, dict]) -> str:
    return _markdown(COLUMNS, table_rows(rows))


def memory_markdown_table(rows: dict[str, dict]) -> str:
    return _markdown(MEMORY_COLUMNS, memory_rows(rows))


def _markdown(columns, body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def text_table(rows: dict[str, dict]) -> str:
    out = _text(COLUMNS, table_rows(rows))
    memory = memory_rows(rows)
    return out + ("\n\n" + _text(MEMORY_COLUMNS, memory) if memory else "")


def _text(columns, body: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in body)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in body]
    return "\n".join(lines)


def plot_throughput(rows: dict[str, dict], path: Path) -> None:
    import matplotlib  # heavy, and only the launching process draws: imported when a plot is made

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    ours = [rows[n]["ours"]["tokens_per_s"] for n in names]
    peer = [rows[n]["peer"]["tokens_per_s"] if rows[n]["peer"] else 0.0 for n in names]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(names)), 4))
    ax.bar([i - 0.2 for i in x], ours, width=0.4, label="modelpar")
    ax.bar([i + 0.2 for i in x], peer, width=0.4, label="PyTorch peer")
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("tokens/s")
    ax.set_title("throughput per layout (median step)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


MEMORY_NOTE = (
    "states: weights, gradients, optimizer state (AdamW moments; ZeRO-1's fp32 master shard) and gradient buffers "
    "(zero-0's all-reduce buckets) measured at the optimizer step (`modelpar.bench.meters.trainer_state_bytes`), "
    "plus FSDP2's gathered weights and unsharded gradients at their peak during the step (ZeRO-2/3, sampled at "
    "every saved-tensor pack and unpack); act.: peak bytes of tensors kept for backward on the device (on CPU the "
    "saved-tensor meter, with what offload leaves behind and what selective checkpointing caches; the tensors a "
    "recomputed block rebuilds in its backward are not in it); host: what offload holds in host memory at its "
    "peak; pred.: `modelpar-plan`'s memory model (`modelpar/plan/activations.py`) for the same recipe, "
    "`modelpar.bench.recipe_memory.recipe_memory`; pred/meas: their ratio."
)


def write_results(cfg: BenchRecipe, new_rows: list[dict]) -> tuple[dict[str, dict], list[Path]]:
    """Merge ``new_rows`` into ``<results_dir>/<name>.json`` and rewrite the table, plots and timelines.

    Returns all rows and the paths written."""
    out_dir = Path(cfg.bench.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{cfg.bench.name}.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    rows = report.get("rows", {})
    written: list[Path] = []
    for row in new_rows:
        timeline = row.pop("_timeline")
        if row["pp"] > 1:
            png = out_dir / f"{cfg.bench.name}_timeline_{row['layout']}.png"
            title = f"{row['layout']}: one measured step, bubble {row['bubble_measured']:.1%}"
            render_png(timeline, str(png), title=title)
            written.append(png)
            row["timeline_png"] = png.name
        rows[row["layout"]] = row
    add_ideal(rows)
    report = {
        "model": asdict(cfg.model),
        "data": {"seq_len": cfg.data.seq_len, "global_batch": cfg.data.global_batch},
        "trainer": {
            "device": cfg.trainer.device,
            "dtype": cfg.trainer.dtype,
            "threads_per_rank": 1,
            "cpu_affinity": cfg.trainer.cpu_affinity,
            "gloo_threads": cfg.trainer.gloo_threads,
        },
        "bench": {k: v for k, v in asdict(cfg.bench).items() if k not in ("sweep", "results_dir", "name")},
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_1min": os.getloadavg()[0],
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
        "flops": "modelpar.model.flops.training_flops_per_token: 6 N + 12 L h s per token (model FLOPs)",
        "rows": rows,
    }
    path.write_text(json.dumps(report, indent=1) + "\n")
    (out_dir / f"{cfg.bench.name}.md").write_text(
        f"# modelpar-bench: {cfg.model.name}, batch {cfg.data.global_batch} x {cfg.data.seq_len}\n\n"
        f"{markdown_table(rows)}\n\n"
        "ratio: our tokens/s over the peer's, interleaved run by run (in brackets the lowest and highest ratio "
        "of single rounds, ours and the peer's steps back to back); CPU share: process CPU seconds over wall "
        "seconds per rank, ours / peer (1.0 = a whole core; other jobs share the 2 cores); bubble: idle compute "
        "over ranks x span, measured from the runtime's records / simulated with the measured mean F/B/W / "
        "replayed with every action's measured duration (so stage imbalance included); of ideal: tokens/s over "
        "single-rank tokens/s x ranks x m/(m+p-1); act.: peak bytes of saved activations per pipeline stage; "
        "comm: bytes per step summed over ranks. Setting for both engines: CPU ranks bound to cores "
        f"(trainer.cpu_affinity={cfg.trainer.cpu_affinity}); gloo socket threads trainer.gloo_threads="
        f"{cfg.trainer.gloo_threads} (idle: our tensor-parallel group's, and all of the peer's, where tp > 1).\n"
        f"\n## Memory, measured and predicted (per rank, the fullest of each pipeline stage)\n\n"
        f"{memory_markdown_table(rows)}\n\n{MEMORY_NOTE}\n"
    )
    plot_throughput(rows, out_dir / f"{cfg.bench.name}_throughput.png")
    md = out_dir / f"{cfg.bench.name}.md"
    return rows, [path, md, *written, out_dir / f"{cfg.bench.name}_throughput.png"]
