"""benchmarks/gpu_suite.py: one command, one JSON and one markdown; --smoke runs every section on CPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_suite.py"
SECTIONS = {"tests", "kernels", "mfu", "mfu_fp8", "host_syncs", "moe_layer"}


def load_suite(monkeypatch):
    """The script as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_suite", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_without_cuda_it_exits_2_with_one_line():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "benchmarks/gpu_suite.py needs a CUDA device (none found); run it on a GPU machine, or pass --smoke"
    ]


@pytest.mark.slow
def test_smoke_run_records_every_section_in_one_json_and_one_markdown(tmp_path):
    # the sections' smoke boxes add up to 310 s; each is killed at the end of its own, so the whole run ends by
    # then plus the processes' start-up: a busy machine makes the run slow, never endless
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)], capture_output=True, text=True, timeout=480
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "gpu_suite_smoke.json").read_text())
    sections = report["sections"]
    assert set(sections) == SECTIONS
    assert {name: s["status"] for name, s in sections.items()} == dict.fromkeys(SECTIONS, "ok")
    assert sections["tests"]["result"]["runs"][0]["skipped"] >= 1  # the CUDA-only tests, skipped on CPU
    kernels = {(r["op"], r["impl"]) for r in sections["kernels"]["result"]["rows"]}
    for op in ("rms_norm", "rope", "swiglu", "attention", "cross_entropy"):
        assert {(op, "triton"), (op, "eager"), (op, "compile")} <= kernels, op
    mfu = sections["mfu"]["result"]
    assert mfu["eager"]["mfu_vs_measured_peak"] > 0 and mfu["compiled"]["compiled_blocks"]
    fp8 = sections["mfu_fp8"]["result"]
    assert {fp8[m]["config"]["fp8"] for m in ("off", "rowwise", "tensorwise")} == {"off", "rowwise", "tensorwise"}
    assert fp8["rowwise_speedup"] > 0 and fp8["tensorwise_speedup"] > 0
    assert sections["host_syncs"]["result"]["host_syncs"] >= 0
    assert {r["tokens"] for r in sections["moe_layer"]["result"]["rows"]} == {64}
    markdown = (tmp_path / "gpu_suite_smoke.md").read_text()
    assert all(f"## {name}" in markdown for name in SECTIONS)


def test_a_section_past_its_box_is_killed_and_recorded_as_timed_out(tmp_path, monkeypatch):
    suite = load_suite(monkeypatch)  # a fresh interpreter, as on the GPU: killed while it starts
    record = suite.run_section("mfu", suite.SECTIONS["mfu"], smoke=True, box_s=0.5, workdir=tmp_path, fork=False)
    assert record["status"] == "timeout"
    assert record["error"] == "timed out after 0 s; the result holds what it had measured"
    assert "log_tail" in record and record["result"] == {}


def test_a_forked_section_past_its_box_is_killed_and_keeps_what_it_had_measured(tmp_path, monkeypatch):
    suite = load_suite(monkeypatch)

    def stuck(s):
        s.save({"measured": 1})
        print("measured one", flush=True)
        time.sleep(60)

    monkeypatch.setitem(suite.SECTIONS, "mfu", suite.Plan(stuck, 1, 1, "stuck after one measurement"))
    started = time.monotonic()
    record = suite.run_section("mfu", suite.SECTIONS["mfu"], smoke=True, box_s=1.0, workdir=tmp_path)
    assert time.monotonic() - started < 30
    assert record["status"] == "timeout" and record["result"] == {"measured": 1}
    assert "measured one" in record["log_tail"]


def test_a_sections_own_process_runs_it_from_the_command_line_and_leaves_its_complete_result(tmp_path, monkeypatch):
    """What the GPU run starts in a fresh interpreter for each section (the smoke run forks instead)."""
    suite = load_suite(monkeypatch)
    result = tmp_path / "moe_layer.json"
    argv = ["--section", "moe_layer", "--smoke", "--budget", "60", "--result", str(result)]
    assert suite.main(argv) == 0
    saved = json.loads(result.read_text())
    assert saved["complete"] and saved["result"]["ok"] and len(saved["result"]["rows"]) >= 1


def test_each_kernel_time_is_set_beside_its_floor_on_the_gpu_it_ran_on(monkeypatch):
    suite = load_suite(monkeypatch)
    kb = suite._benchmark("kernels")
    op = kb.Op("swiglu", "[n, f]", lambda: (), {}, bytes_fwd=3_350_000_000, bytes_fwd_bwd=6_700_000_000)
    row = kb.Row("swiglu", "[n, f]", "fwd", "triton", ms=2.0)
    assert suite._floor(op, row, "NVIDIA H100 80GB HBM3") == {"floor_ms": 1.0, "measured_over_floor": 2.0}
    h200 = suite._floor(op, row, "NVIDIA H200")
    assert h200["floor_ms"] == pytest.approx(3.35e9 / 4.8e12 * 1e3)
    assert suite._floor(op, row, "cpu") == {"floor_ms": None, "measured_over_floor": None}


def test_loaded_kernels_are_listed_with_their_registers_and_spills(monkeypatch):
    suite = load_suite(monkeypatch)
    from modelpar_kernels import grid

    loaded = suite.loaded_kernels()
    if grid.interpreting():  # nothing is compiled under the interpreter
        assert loaded == []
    else:
        assert all({"kernel", "n_regs", "n_spills"} <= set(k) for k in loaded)
