"""Dry-run every large preset at its real world size and write benchmarks/results/dry_run.{md,json}.

python benchmarks/dry_run.py [PRESET ...]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from modelpar.bench.dry_run import GIB, dry_run
from modelpar.training.config import RECIPES, register_schema

PRESETS = [
    "llama-8b-64gpu",
    "llama-8b-128k-64gpu",
    "mixtral-8x7b-64gpu",
    "qwen3-30b-a3b-64gpu",
    "llama-70b-512gpu",
    "llama-405b-16384gpu",
    "llama-405b-128k-16384gpu",
    "deepseek-v3-671b-2048gpu",
    "gemma3-27b-64gpu",
    "olmo2-32b-64gpu",
    "gpt-oss-120b-64gpu",
]
OUT = Path(__file__).parent / "results"


def load(preset: str):
    register_schema()
    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        d = compose(config_name=preset, overrides=["data.path=", "trainer.out_dir=runs/dry"])
    return OmegaConf.to_object(d)


def table(results: dict) -> list[str]:
    lines = [
        "| preset | rank (role) | weights | grads | optimizer | buffers | activations (fp32) meas / plan"
        " | worst comm err | judged collectives (measured / planned MiB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for preset, result in results.items():
        for r in result["ranks"]:
            s, p = r["states"], r["planned_states"]
            exact = all(s[k] == p.get(k) for k in s)
            comm = max(
                (
                    abs(r["traffic"].get(k, 0) - r["planned_traffic"].get(k, 0)) / max(r["traffic"].get(k, 0), 1)
                    for k in r["judged"]
                ),
                default=0.0,
            )
            judged = ", ".join(
                f"{k} {r['traffic'].get(k, 0) / 2**20:.0f}/{r['planned_traffic'].get(k, 0) / 2**20:.0f}"
                for k in r["judged"]
            )
            lines.append(
                f"| {preset} | {r['rank']} ({r['role']}) | {s['weights'] / GIB:.2f} | {s['gradients'] / GIB:.2f} | "
                f"{s['optimizer'] / GIB:.2f} | {s['buffers'] / GIB:.2f} | {r['activations'] / GIB:.2f} / "
                f"{r['planned_activations'] / GIB:.2f} | {comm:.2%}{'' if exact else ' (states differ)'} | {judged} |"
            )
    return lines


def main() -> None:
    presets = sys.argv[1:] or PRESETS
    saved = json.loads((OUT / "dry_run.json").read_text()) if (OUT / "dry_run.json").is_file() and sys.argv[1:] else {}
    results = {k: v for k, v in saved.get("results", {}).items() if k not in presets}  # a partial run keeps the rest
    for preset in presets:
        start = time.perf_counter()
        try:
            result = dry_run(load(preset), preset=preset, print_fn=lambda line: None)
        except ValueError as exc:
            print(f"{preset}: {exc}", flush=True)
            results[preset] = {"summary": {"preset": preset, "not_run": str(exc)}, "ranks": []}
            continue
        result["summary"]["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps(result["summary"]), flush=True)
        results[preset] = result
    results = {k: results[k] for k in PRESETS if k in results} | {k: v for k, v in results.items() if k not in PRESETS}
    summaries = [r["summary"] for r in results.values()]
    OUT.mkdir(exist_ok=True)
    (OUT / "dry_run.json").write_text(json.dumps({"summaries": summaries, "results": results}, indent=1) + "\n")
    head = [
        "| preset | world | ranks | worst memory err | worst comm err | fits (80 GiB, bf16) | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in summaries:
        if "not_run" in s:
            head.append(f"| {s['preset']} | not run: {s['not_run']} | | | | | |")
            continue
        head.append(
            f"| {s['preset']} | {s['world']} | {s['ranks_checked']} | {s['worst_memory_rel_err']:.2%} | "
            f"{s['worst_comm_rel_err']:.2%} | {s['fits']} | {s['seconds']} |"
        )
    text = "# Dry run at the real world size\n\n" + "\n".join(head + [""] + table(results)) + "\n"
    (OUT / "dry_run.md").write_text(text)


if __name__ == "__main__":
    main()
