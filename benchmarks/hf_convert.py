"""Streaming Hugging Face conversion: wall time, peak resident memory and throughput of ``modelpar-ckpt
import-hf`` and ``export-hf`` beside a plain ``cp`` of the same files, measured in one run.

    python benchmarks/hf_convert.py                    # Llama-3.2-1B- and Llama-3.1-8B-shaped (~50 GB of disk)
    python benchmarks/hf_convert.py --models 1b        # the 1B-shaped one only

For each model a random bf16 checkpoint of the released model's shapes is written as a sharded HF directory
(safetensors straight from one tensor at a time: no model is built), then, one after another:

- ``cp``: ``cp -r`` of the directory (the copy is deleted at once); ``cp + sync``: the same, then ``sync`` of
  the copied files, as durable as the converters' files (both fsync what they write);
- import: ``modelpar-ckpt import-hf`` (default dtype: the files' bf16) into a checkpoint;
- export: ``modelpar-ckpt export-hf`` of that checkpoint (default 5GB shards; export verifies every SHA-256
  of the checkpoint first, as it always does);
- bit for bit: every tensor of the exported shards compared with the input's.

Each command runs as a child process; its peak resident memory is ``/usr/bin/time -v``'s maximum resident
set size. GB/s is the weight bytes over the wall time. Everything written is deleted at the end. Writes
``benchmarks/results/hf_convert.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from modelpar.model.hf_files import HFWeights, write_hf_weights

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = {  # the released models' shapes (config.json of meta-llama/Llama-3.2-1B and Llama-3.1-8B)
    "1b": dict(
        name="Llama-3.2-1B-shaped", vocab=128256, hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, tied=True,
        shard="2GB",
    ),
    "8b": dict(
        name="Llama-3.1-8B-shaped", vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, tied=False,
        shard="5GB",
    ),
}  # fmt: skip
CKPT = [sys.executable, "-m", "modelpar.cli.ckpt"]


def hf_config(m: dict) -> dict:
    head = m["hidden"] // m["heads"]
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m["vocab"],
        "hidden_size": m["hidden"], "num_hidden_layers": m["layers"], "num_attention_heads": m["heads"],
        "num_key_value_heads": m["kv_heads"], "head_dim": head, "intermediate_size": m["ffn"],
        "max_position_embeddings": 8192, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "rms_norm_eps": 1e-5, "tie_word_embeddings": m["tied"], "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "dtype": "bfloat16",
    }  # fmt: skip


def shapes(m: dict) -> dict[str, tuple[int, ...]]:
    h, kv, f = m["hidden"], m["kv_heads"] * (m["hidden"] // m["heads"]), m["ffn"]
    out = {"model.embed_tokens.weight": (m["vocab"], h)}
    for i in range(m["layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f),
        }  # fmt: skip
    out["model.norm.weight"] = (h,)
    if not m["tied"]:
        out["lm_head.weight"] = (m["vocab"], h)
    return out


def random_bf16(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bf16 bits with the exponent's top bit clear: finite values of magnitude below 2."""
    bits = torch.empty(shape, dtype=torch.int16)
    bits.random_(generator=torch.Generator().manual_seed(seed))
    return bits.bitwise_and_(0xBFFF - 0x10000).view(torch.bfloat16)


def write_model(m: dict, path: Path) -> int:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hf_config(m), indent=2) + "\n")
    entries = {key: (torch.bfloat16, shape) for key, shape in shapes(m).items()}
    seeds = {key: k for k, key in enumerate(entries)}
    write_hf_weights(path, entries, lambda key: random_bf16(entries[key][1], seeds[key]), m["shard"])
    return weight_bytes(path)


def weight_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.suffix == ".safetensors")


def timed(cmd: list[str]) -> dict:
    """Run ``cmd`` under ``/usr/bin/time -v``: wall seconds and peak resident memory (GB)."""
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")
    kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    return {"wall_s": round(wall, 2), "peak_rss_gb": round(kb * 1024 / 1e9, 3)}


def bit_exact(a: Path, b: Path) -> bool:
    with HFWeights(a) as x, HFWeights(b) as y:
        if sorted(x.keys()) != sorted(y.keys()):
            return False
        for key in x.keys():
            if not torch.equal(x.get_tensor(key).view(torch.int16), y.get_tensor(key).view(torch.int16)):
                return False
    return True


def bench(key: str, work: Path) -> dict:
    m = MODELS[key]
    hf, ckpt, out = work / "hf", work / "ckpt", work / "out"
    start = time.perf_counter()
    size = write_model(m, hf)
    generated = time.perf_counter() - start
    shards = len(list(hf.glob("*.safetensors")))
    print(f"{m['name']}: {size / 1e9:.2f} GB in {shards} shards, written in {generated:.0f} s", flush=True)
    rows = {"cp": timed(["cp", "-r", str(hf), str(work / "copy")])}
    shutil.rmtree(work / "copy")
    copy_synced = f"cp -r {hf} {work / 'copy'} && sync {work / 'copy'}/*"  # as durable as the converters' files
    rows["cp + sync"] = timed(["sh", "-c", copy_synced])
    shutil.rmtree(work / "copy")
    rows["import-hf"] = timed([*CKPT, "import-hf", str(hf), str(ckpt)])
    rows["export-hf"] = timed([*CKPT, "export-hf", str(ckpt), str(out)])
    for row in rows.values():
        row["gb_per_s"] = round(size / 1e9 / row["wall_s"], 3)
    for name in ("cp + sync", "import-hf", "export-hf"):
        rows[name]["of_cp"] = round(rows[name]["gb_per_s"] / rows["cp"]["gb_per_s"], 3)
    exact = bit_exact(hf, out)
    result = {
        "model": m["name"], "bytes": size, "shards_in": len(list(hf.glob("*.safetensors"))),
        "shards_out": len(list(out.glob("*.safetensors"))), "bit_exact": exact, **rows,
    }  # fmt: skip
    print(json.dumps(result), flush=True)
    for path in (hf, ckpt, out):
        shutil.rmtree(path)
    return result


def table(results: list[dict]) -> str:
    lines = [
        "Streaming HF conversion on this machine (2 cores, 24 GiB), random bf16 weights, default dtype; one run",
        "",
        "| model | GB | shards in/out | step | wall | peak RSS | GB/s | x cp | bit for bit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for step in ("cp", "cp + sync", "import-hf", "export-hf"):
            row = r[step]
            lines.append(
                f"| {r['model']} | {r['bytes'] / 1e9:.2f} | {r['shards_in']}/{r['shards_out']} | {step} | "
                f"{row['wall_s']:.1f} s | {row['peak_rss_gb']:.2f} GB | {row['gb_per_s']:.3f} | "
                f"{row.get('of_cp', 1.0):.2f} | {'yes' if r['bit_exact'] else 'NO'} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="1b,8b", help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for key in args.models.split(","):
            work = Path(tmp) / key
            work.mkdir()
            results.append(bench(key, work))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hf_convert.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "hf_convert.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
