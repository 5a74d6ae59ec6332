"""Kernels compiled ahead of time for a GPU this machine does not have: sm_90a (H100, H200), bf16.

The compile check really compiles (Triton's compiler and the bundled ptxas; its cache, keyed by the kernel
source, target and options, spares a rerun the unchanged kernels); it covers the default configs of every op at
llama-8b's tp8 shard widths (head dim 128, the shipped presets' widest) and multi-head latent attention's heads
(qk head dim 192, v 128), each attention kernel with and without documents and a sliding window. The full tables,
every config, are ``benchmarks/results/kernels_aot_sm80.md`` (both dtypes), ``kernels_aot_sm90a.md`` (bf16) and
``kernels_aot_sm90a_fp32.md``; the last test here holds them to the launcher's current defaults.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from modelpar_kernels import aot

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {
    "_rms_norm_forward_kernel",
    "_rms_norm_backward_kernel",
    "_rope_kernel",
    "_swiglu_forward_kernel",
    "_swiglu_backward_kernel",
    "_cross_entropy_stats_kernel",
    "_cross_entropy_grad_kernel",
    "_attention_forward_kernel",
    "_attention_backward_delta_kernel",
    "_attention_backward_kv_kernel",
    "_attention_backward_q_kernel",
}


@pytest.fixture(scope="module")
def sm90_defaults(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot")
    cmd = [sys.executable, "-m", "modelpar_kernels.aot", "--arch", "sm_90a", "--dtype", "bf16", "--defaults-only"]
    cmd += ["--preset", "llama-8b", "--tp", "8", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    return done, json.loads((out / "aot.json").read_text()) if (out / "aot.json").exists() else None


def test_every_kernel_compiles_for_sm90a_without_spills_or_shared_memory_overflow(sm90_defaults):
    done, report = sm90_defaults
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert report["problems"] == []
    rows = report["rows"]
    assert {r["kernel"] for r in rows} == KERNELS
    assert all(r["status"] == "compiled" and r["default"] for r in rows)
    assert all(r["spill_bytes"] == 0 and r["regs"] <= 255 and r["blocks_per_sm"] >= 1 for r in rows)
    attention = {r["variant"] for r in rows if r["op"] == "attention"}
    plain = {"causal", "causal, documents", "cp block", "cp block, documents"}
    assert attention == plain | {f"{v}, window" for v in plain}
    latent = [r for r in rows if "BLOCK_DV" in r["config"] and r["widths"][0].startswith("latent")]  # qk 192, v 128
    assert {r["config"]["BLOCK_D"] for r in latent} == {256} and {r["config"]["BLOCK_DV"] for r in latent} == {128}


def test_the_compile_says_how_much_there_is_and_how_far_it_is(sm90_defaults):
    done, report = sm90_defaults
    total = len(report["rows"])
    lines = [line for line in done.stderr.splitlines() if line.startswith("modelpar_kernels.aot: ")]
    assert lines[0].startswith(f"modelpar_kernels.aot: compiling {total} kernel configs for sm_90a x bf16"), lines
    assert "takes hours" in lines[0]
    assert any(line.startswith(f"modelpar_kernels.aot: {total}/{total} compiled") for line in lines), lines


def test_a_default_config_that_spills_fails_the_check():
    row = {"kernel": "k", "arch": "sm_90a", "dtype": "bf16", "variant": "", "config": {}, "status": "compiled"}
    spilling = {**row, "default": True, "regs": 255, "spill_bytes": 80, "shared": 1024}
    assert aot.problems([spilling]) == ["k sm_90a bf16 {}: default config spills 80 bytes per thread (255 registers)"]
    assert aot.problems([{**spilling, "default": False}]) == []  # a candidate may spill; the default may not
    overflow = {**row, "default": False, "regs": 64, "spill_bytes": 0, "shared": 240_000}
    assert aot.problems([overflow]) == [
        "k sm_90a bf16 {}: 240000 bytes of shared memory, above the 232448 of one block"
    ]
    broken = {**row, "status": "error", "error": "CompilationError: at 3:4\nmore", "default": False}
    assert aot.problems([broken]) == ["k sm_90a bf16 {}: does not compile: CompilationError: at 3:4"]


def test_occupancy_follows_registers_shared_memory_and_warps():
    h100 = aot.ARCHS["sm_90a"]
    assert aot.occupancy(255, 8, 99584, h100) == {"blocks_per_sm": 1, "warps_per_sm": 8, "limited_by": "registers"}
    assert aot.occupancy(128, 4, 50432, h100)["blocks_per_sm"] == 4  # 65536 / (4 warps * 32 * 128)
    assert aot.occupancy(24, 8, 0, h100) == {"blocks_per_sm": 8, "warps_per_sm": 64, "limited_by": "warps"}
    assert aot.occupancy(32, 4, 100_000, aot.ARCHS["sm_80"])["limited_by"] == "shared"


@pytest.mark.parametrize("name", sorted(aot.PRESETS))
def test_widths_are_those_of_the_shipped_presets(name):
    recipe = yaml.safe_load((ROOT / "recipes" / "model" / f"{name}.yaml").read_text())
    preset = aot.PRESETS[name]
    assert (preset.hidden, preset.heads, preset.kv_heads, preset.vocab_size) == (
        recipe["hidden"],
        recipe["heads"],
        recipe["kv_heads"],
        recipe["vocab_size"],
    )
    assert preset.ffn_hidden == recipe.get("moe", {}).get("ffn_hidden", recipe["ffn_hidden"])


def _attention_rows(table: str):
    rows = json.loads((ROOT / "benchmarks" / "results" / table).read_text())["rows"]
    for r in rows:
        if r["kernel"] in aot.ATTENTION_KERNELS and r["status"] == "compiled":
            yield r, aot.ATTENTION_KERNELS[r["kernel"]], aot.DTYPES[r["dtype"]], aot.ARCHS[r["arch"]]


# Tiles the sm_80 table of the earlier, unpruned candidate lists compiled above 163 KiB (shared bytes per block)
OVERFLOWED_ON_SM80 = [
    ("forward", 128, 128, dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3), 230_400),
    ("forward", 256, 128, dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=2), 196_608),
    ("backward_kv", 128, 128, dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=2), 180_224),
    ("backward_q", 256, 128, dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=2), 262_144),
]


@pytest.mark.parametrize("kernel, d, dv, tile, shared", OVERFLOWED_ON_SM80)
def test_the_candidates_leave_out_the_fp32_tiles_that_overflowed_sm80(kernel, d, dv, tile, shared):
    import torch
    from modelpar_kernels.grid import attention_candidates, attention_shared_estimate

    assert attention_shared_estimate(kernel, tile, d, dv, torch.float32) >= shared
    assert tile not in attention_candidates(kernel, d, dv, torch.float32, 80)
    assert tile in attention_candidates(kernel, d, dv, torch.bfloat16, 90)  # half the bytes fit an H100


@pytest.mark.parametrize("table", ["kernels_aot_sm80.json", "kernels_aot_sm90a.json", "kernels_aot.json"])
def test_the_shared_memory_bound_holds_on_the_tables_and_keeps_every_default(table):
    from modelpar_kernels.grid import SHARED_MEMORY_PER_BLOCK, attention_candidates, attention_shared_estimate

    assert {a.capability: a.smem_per_block for a in aot.ARCHS.values()} == SHARED_MEMORY_PER_BLOCK
    defaults = 0
    for r, kernel, dtype, arch in _attention_rows(table):
        c = r["config"]
        d, dv = c["BLOCK_D"], c.get("BLOCK_DV", c["BLOCK_D"])
        tile = {k: c[k] for k in aot.TILE_KEYS}
        # an upper bound but for a few percent on small tiles (0.97x at 48 KiB), far below either limit
        assert attention_shared_estimate(kernel, tile, d, dv, dtype) >= 0.95 * r["shared"], r
        assert r["shared"] <= arch.smem_per_block, r
        if r["default"]:
            defaults += 1
            assert tile in attention_candidates(kernel, d, dv, dtype, arch.capability), r
    assert defaults > 0


@pytest.mark.parametrize(
    "table", ["kernels_aot.json", "kernels_aot_sm80.json", "kernels_aot_sm90a.json", "kernels_aot_sm90a_fp32.json"]
)
def test_the_launchers_defaults_are_the_tables_and_spill_in_no_variant(table):
    """The committed tables are current: each attention default the launcher picks today is the tile the table
    marks default, and that tile compiled with no spill and within shared memory in every variant."""
    from modelpar_kernels.grid import attention_defaults

    by_width: dict[tuple, list[dict]] = {}
    for r, kernel, _, arch in _attention_rows(table):
        c = r["config"]
        by_width.setdefault((kernel, r["dtype"], arch.name, c["BLOCK_D"], c.get("BLOCK_DV", c["BLOCK_D"])), []).append(
            r
        )
    checked = 0
    for (kernel, dtype_name, arch_name, d, _), rows in by_width.items():
        head_dim = d if d <= 128 else 192  # the tiles are powers of two: 192 (latent attention) takes 256
        picked = attention_defaults(head_dim, aot.DTYPES[dtype_name], aot.ARCHS[arch_name].capability)[kernel]
        marked = {tuple(r["config"][k] for k in aot.TILE_KEYS) for r in rows if r["default"]}
        assert marked == {tuple(picked[k] for k in aot.TILE_KEYS)}, (kernel, dtype_name, arch_name, d)
        launched = [r for r in rows if all(r["config"][k] == picked[k] for k in aot.TILE_KEYS)]
        variants = {r["variant"] for r in rows}
        assert {r["variant"] for r in launched} == variants
        assert all(r["spill_bytes"] == 0 and r["shared"] <= aot.ARCHS[arch_name].smem_per_block for r in launched)
        checked += len(launched)
    assert checked > 0
