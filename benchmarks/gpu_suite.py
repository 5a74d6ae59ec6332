"""Everything worth knowing from one GPU, in one command: the CUDA tests, the kernels, llama-1b MFU, host syncs.

    python benchmarks/gpu_suite.py                          # one CUDA GPU (H200): at most 9 minutes
    python benchmarks/gpu_suite.py --smoke --out /tmp/gs    # CPU, tiny shapes: every code path in about a minute

Sections, each in its own process under its own time box (a hang, a crash or a poisoned CUDA context costs that
section only; whatever it measured before is kept), in this order:

1. ``tests``: the CUDA-only tests (``pytest -m gpu``) and the kernel tests, which run on CUDA when there is one
   (``pytest tests/kernels -m "not gpu"``): pass / fail / skip counts and the names of failures, from JUnit XML.
2. ``kernels``: each Triton kernel of ``modelpar_kernels`` (RMSNorm, RoPE, SwiGLU, attention, vocab-parallel
   cross-entropy) beside its torch reference, eager and under ``torch.compile``, in bf16: GB/s for the
   memory-bound ops, TFLOP/s for attention (``benchmarks/kernels.py`` measures; peers such as Liger are left to
   it). Triton and eager first for every op, then the compile baselines while the box has time. Each time is
   set beside its floor on this GPU (``modelpar_kernels.roofline``: bytes / HBM bandwidth or FLOPs / bf16 peak,
   H100 and H200 figures), and every loaded Triton kernel's ``n_regs`` / ``n_spills`` is recorded, to compare
   with the ahead-of-time prediction (``python -m modelpar_kernels.aot``, ``benchmarks/results/kernels_aot.md``).
3. ``mfu``: llama-1b bf16 training MFU on the one GPU (``benchmarks/gpu_llama1b_mfu.py``), eager and with every
   block compiled (``modelpar.model.compile.compile_blocks``), against the matmul peak measured once.
4. ``mfu_fp8``: the same eager llama-1b step with ``model.fp8=off``, ``rowwise`` and ``tensorwise`` (the
   projections' GEMMs through ``torch._scaled_mm``), one after another in one process: MFU against the bf16
   matmul peak, and each FP8 mode's tokens/s over bf16's.
5. ``host_syncs``: one steady bf16 training step of llama-1b (built by ``build_model``: forward, loss, backward,
   clipping, fused AdamW), every host sync counted by ``modelpar.bench.host_syncs.count_host_syncs`` with its
   call site, and CUDA's own sync-debug warnings (``torch.cuda.set_sync_debug_mode("warn")``) counted beside;
   more than one sync fails the section (the engine's rule: at most one per step outside logging).
6. ``moe_layer``: one MoE layer in bf16, the grouped expert GEMM beside per-expert loops (``benchmarks/moe.py``).

Writes ``gpu_suite.json`` and ``gpu_suite.md`` under ``--out`` (``benchmarks/results``; ``gpu_suite_smoke.*``
with ``--smoke``). A failing or timed-out section is recorded there (status, error, the end of its log) and the
suite goes on. Exit status 0 when every section ran and found nothing wrong, 1 otherwise, 2 without CUDA.

``--smoke`` runs the same sections on CPU with tiny shapes: the tests section asks ``-m gpu`` of one test file,
the kernels run fp32 (Triton in its interpreter, compile baselines with the ``aot_eager`` backend), the models
are the MFU script's tiny one (one 16-token micro-batch per step and one timed step for FP8), and blocks compile with
``aot_eager``; each section's process is a fork of the suite's, which imported what they share once, under the
same box and kill; the numbers mean nothing there.

Status, honestly: written and smoke-tested on a CPU-only machine (torch 2.13 CPU); it has not yet run on a GPU.
The GPU time boxes (90 + 125 + 150 + 80 + 50 + 25 s) are estimates from the two scripts' own budgets; if a section times
out on the H200, its partial result says how far it got.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import json
import os
import platform
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TOTAL_BUDGET_S = 520.0  # the promise is 9 minutes; the rest is start-up and writing
GRACE_S = 10.0  # a section's process is told its box less this, so that it can stop and write before the kill
NEEDS_CUDA = "benchmarks/gpu_suite.py needs a CUDA device (none found); run it on a GPU machine, or pass --smoke"


# -- inside a section's process ----------------------------------------------------------------------------

SMOKE_MIN_LEFT_S = 5.0  # --smoke: a piece is skipped for time only with fewer seconds than this left in its box


@dataclass
class Section:
    """What one section's process knows: the mode, its deadline, and where to leave its (partial) result."""

    smoke: bool
    deadline: float  # time.monotonic() by which the section should have returned
    result_path: Path

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.smoke else torch.device("cuda", 0)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def too_late_for(self, gpu_s: float) -> bool:
        """Whether to skip a piece that may take ``gpu_s`` on the GPU: fewer seconds than that are left in the
        box (a smoke piece takes seconds, more on a busy machine: there ``SMOKE_MIN_LEFT_S``)."""
        return self.remaining() < (SMOKE_MIN_LEFT_S if self.smoke else gpu_s)

    def save(self, result: dict, *, complete: bool = False) -> None:
        """Leave ``result`` where the suite reads it, atomically (a kill mid-write keeps the previous one)."""
        tmp = self.result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"complete": complete, "result": result}, default=str))
        tmp.replace(self.result_path)


def _benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (the folder is not a package; ``kernels`` would be the op package)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_killable(cmd: list[str], timeout_s: float, log_path: Path) -> int | None:
    """Run ``cmd`` in its own session, output to ``log_path``; its exit status, or None if it was still running
    after ``timeout_s`` and was killed with everything it started (pytest's rank workers, compile workers)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=max(timeout_s, 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


def run_forked(fn: Callable[[], int], timeout_s: float, log_path: Path) -> int | None:
    """``run_killable`` for ``fn`` of this process: run in a fork of it, in a session of its own, output to
    ``log_path``; its exit status, or None if it was killed after ``timeout_s``. CPU only (``--smoke``): a process
    that has started CUDA cannot fork, and one that has not saves each section an interpreter and its imports."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the fork; its exit status is the result
        code = 1
        try:
            os.setsid()
            log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            # Python's own streams too, wherever they wrote before (pytest's capture, in the tests)
            sys.stdout = open(1, "w", buffering=1, closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            code = fn()
        except BaseException:  # noqa: BLE001 - the log says what, the status that it failed
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    pidfd = os.pidfd_open(pid)
    try:
        if not select.select([pidfd], [], [], max(timeout_s, 0.1))[0]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # the fork and all it started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # killed before its setsid
            os.waitpid(pid, 0)
            return None
    finally:
        os.close(pidfd)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def run_tests(s: Section) -> dict:
    """The CUDA-only tests and the kernel tests on CUDA, each a pytest run; counts from its JUnit XML."""
    if s.smoke:
        runs = [("cuda-only (one file)", ["-m", "gpu", "tests/bench/test_host_syncs.py"])]
    else:
        runs = [("cuda-only", ["-m", "gpu", "tests"]), ("kernels on cuda", ["-m", "not gpu", "tests/kernels"])]
    out = {"runs": []}
    for name, selection in runs:
        row = {"name": name, "args": selection}
        out["runs"].append(row)
        if s.too_late_for(SMOKE_MIN_LEFT_S):
            row["error"] = "skipped: no time left in the section's box"
            continue
        with tempfile.TemporaryDirectory() as tmp:
            xml, log = Path(tmp) / "junit.xml", Path(tmp) / "pytest.log"
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *selection]
            started = time.perf_counter()
            returncode = run_killable(cmd, s.remaining(), log)
            row["seconds"] = round(time.perf_counter() - started, 1)
            output = log.read_text(errors="replace").strip()
            row["returncode"] = returncode
            row["summary"] = (output.splitlines() or [""])[-1]
            if returncode is None:
                row["error"] = f"timed out after {row['seconds']:.0f} s"
            elif xml.exists():
                row |= _junit_counts(xml)
            else:
                row["error"] = output[-500:]
        s.save(out)
    for key in ("passed", "failed", "errors", "skipped"):
        out[key] = sum(r.get(key, 0) for r in out["runs"])
    out["ok"] = all("error" not in r and r["returncode"] in (0, 5) for r in out["runs"])  # 5: none collected
    return out


def _junit_counts(path: Path) -> dict:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(x.get(k, 0)) for x in suites) for k in ("tests", "failures", "errors", "skipped")}
    failing = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in root.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {
        "passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
        "failed": total["failures"],
        "errors": total["errors"],
        "skipped": total["skipped"],
        "failing": failing[:30],
    }


def run_kernels(s: Section) -> dict:
    """Triton beside torch eager for every op, then torch.compile of the reference while time is left."""
    kb = _benchmark("kernels")
    device = str(s.device)
    dtype = torch.float32 if s.smoke else torch.bfloat16  # the interpreter has no bf16 arithmetic
    torch.manual_seed(0)
    copy_gb_s = kb.copy_bandwidth(device, s.smoke)
    setting = kb.Setting(device, dtype, s.smoke, compile_baselines=False, liger=None, flash_attn=None)
    out = {"environment": kb.environment(device, copy_gb_s, dtype), "rows": [], "skipped": []}
    if s.smoke:
        out["note"] = "--smoke: fp32 on CPU, Triton in its interpreter, compile baselines with backend aot_eager"
    compiled = dataclasses.replace(
        setting, compile_baselines=True, compile_backend="aot_eager" if s.smoke else "inductor"
    )
    for label, each in (("triton, eager", setting), ("compile", compiled)):
        for name, build in kb.OP_BUILDERS.items():
            if s.too_late_for(30):  # a compile of one op's forward and backward may take 30 s
                out["skipped"].append(f"{name} ({label}): no time left in the section's box")
                continue
            for op in build(each):
                if each is compiled:
                    op.impls = {impl: op.impls[impl] for impl in ("eager", "compile")}
                rows = kb.measure(op, copy_gb_s, device, s.smoke)
                for r in rows:
                    r.extra |= _floor(op, r, out["environment"]["device"])
                out["rows"] += [kb._json_row(r) for r in rows if each is setting or r.impl == "compile"]
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
            s.save(out)
    order = {impl: i for i, impl in enumerate(("triton", "eager", "compile"))}
    first_seen = {}
    for r in out["rows"]:
        first_seen.setdefault((r["op"], r["shape"]), len(first_seen))
    out["rows"].sort(key=lambda r: (first_seen[r["op"], r["shape"]], r["pass"], order.get(r["impl"], 9)))
    out["loaded_kernels"] = loaded_kernels()
    out["ok"] = not out["skipped"] and not [r for r in out["rows"] if r["error"]]
    return out


def _floor(op, row, device_name: str) -> dict:
    """The row's floor on this GPU (roofline of the op's least bytes and FLOPs) and measured / floor."""
    from modelpar_kernels.roofline import floor_s, hardware_for

    hardware = hardware_for(device_name)
    nbytes, flops = (op.bytes_fwd, op.flops_fwd) if row.pass_ == "fwd" else (op.bytes_fwd_bwd, op.flops_fwd_bwd)
    if hardware is None or not (nbytes or flops):
        return {"floor_ms": None, "measured_over_floor": None}
    floor_ms = floor_s(nbytes, flops, hardware) * 1e3
    return {"floor_ms": floor_ms, "measured_over_floor": row.ms / floor_ms if row.ms else None}


def loaded_kernels() -> list[dict]:
    """Every compiled Triton kernel of ``modelpar_kernels`` this process loaded, with the registers and spills
    Triton reports for it (``n_spills``: local memory bytes / 4); none when the kernels ran in the interpreter."""
    from triton.runtime.jit import JITFunction

    found = []
    for module_name, module in sorted(sys.modules.items()):
        if not module_name.startswith("modelpar_kernels.") or module is None:
            continue
        for name, fn in sorted(vars(module).items()):
            if not isinstance(fn, JITFunction):
                continue
            for caches in fn.device_caches.values():
                for kernel in caches[0].values():
                    constants = getattr(kernel.src, "constants", {})
                    found.append(
                        {
                            "kernel": name,
                            "constexprs": {fn.arg_names[k[0]]: str(v) for k, v in constants.items() if len(k) == 1},
                            "num_warps": kernel.metadata.num_warps,
                            "num_stages": kernel.metadata.num_stages,
                            "shared": kernel.metadata.shared,
                            "n_regs": getattr(kernel, "n_regs", None),
                            "n_spills": getattr(kernel, "n_spills", None),
                        }
                    )
    return found


def run_mfu(s: Section) -> dict:
    """llama-1b (the tiny model with --smoke) eager, then with compiled blocks, against one measured peak."""
    mfu = _benchmark("gpu_llama1b_mfu")
    if s.smoke:
        common = ["--smoke"]
        compiled = ["--compile", "--compile-backend", "aot_eager"]
    else:
        common = ["--warmup", "3", "--steps", "10", "--time-limit", "20"]
        compiled = ["--compile"]
    out = _measure_variants(s, mfu, {"eager": common, "compiled": [*common, *compiled]}, min_left_s=30)
    if "error" not in out["eager"] and "error" not in out["compiled"]:
        out["compiled_speedup"] = out["compiled"]["tokens_per_s"] / out["eager"]["tokens_per_s"]
    out["ok"] = all("error" not in out[v] for v in ("eager", "compiled"))
    return out


def run_mfu_fp8(s: Section) -> dict:
    """llama-1b eager with its projections' GEMMs in FP8 (rowwise, tensorwise) beside bf16, in one process."""
    from modelpar.model.layers.fp8 import FP8_MODES

    mfu = _benchmark("gpu_llama1b_mfu")
    # --smoke: one 16-token micro-batch, one timed step (CPU's tensorwise torch._scaled_mm is a slow reference)
    smoke = ["--smoke", "--seq", "16", "--micro-batch", "1", "--accum", "1", "--steps", "1"]
    common = smoke if s.smoke else ["--warmup", "3", "--steps", "8", "--time-limit", "15"]
    out = _measure_variants(s, mfu, {m: [*common, "--fp8", m] for m in FP8_MODES}, min_left_s=20)
    for mode in FP8_MODES[1:]:
        if "error" not in out["off"] and "error" not in out[mode]:
            out[f"{mode}_speedup"] = out[mode]["tokens_per_s"] / out["off"]["tokens_per_s"]
    out["ok"] = all("error" not in out[m] for m in FP8_MODES)
    return out


def _measure_variants(s: Section, mfu, variants: dict[str, list[str]], min_left_s: float) -> dict:
    """``mfu.measure`` of each variant's flags in turn, against the matmul peak measured once; a failing variant
    is recorded and the next still runs; what is done is saved after each."""
    out: dict = {}
    peak = None
    for variant, flags in variants.items():
        if s.too_late_for(min_left_s):
            out[variant] = {"error": "skipped: no time left in the section's box"}
            continue
        try:
            out[variant] = mfu.measure(mfu.parse_args(flags), peak=peak)
            peak = out[variant]["matmul_peak_tflops"]
        except Exception as exc:  # noqa: BLE001 - recorded; the other variants still run
            out[variant] = {"error": _error(exc), "traceback": traceback.format_exc()[-2000:]}
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        s.save(out)
    return out


def run_host_syncs(s: Section) -> dict:
    """Host syncs of one steady bf16 training step of the single-device model, with their call sites."""
    from modelpar.bench.host_syncs import count_host_syncs

    mfu = _benchmark("gpu_llama1b_mfu")
    args = mfu.parse_args(["--smoke"] if s.smoke else ["--micro-batch", "2", "--seq", "1024", "--accum", "2"])
    device, config, name = mfu.model_and_device(args)
    cuda = device.type == "cuda"
    fallback = None
    try:
        step = _warm_step(mfu, config, args, device)
    except Exception as exc:  # noqa: BLE001 - as the MFU script does: say so, then the torch kernels
        fallback = _error(exc)
        config = dataclasses.replace(config, kernels="torch")
        step = _warm_step(mfu, config, args, device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with count_host_syncs(include_cpu=not cuda, cuda_sync_debug="warn") as syncs:
            step()
        if cuda:
            torch.cuda.synchronize(device)
    cuda_warnings = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    return {
        "model": name,
        "kernels": config.kernels,
        "kernels_fallback_reason": fallback,
        "step": f"{args.accum} x {args.micro_batch} x {args.seq} tokens, bf16 autocast, clip, "
        + ("fused AdamW" if cuda else "AdamW"),
        "counted": "calls on device tensors" if cuda else "every call (on CPU nothing waits; see include_cpu)",
        "host_syncs": syncs.count,
        "sites": dict(syncs.by_site()),
        "report": syncs.report(),
        "cuda_sync_debug_warnings": len(cuda_warnings) if cuda else None,
        "cuda_sync_debug_first": cuda_warnings[:5],
        "limit": "at most one host sync per step outside logging (checked on CUDA only)",
        "ok": syncs.count <= 1 if cuda else True,
    }


def run_moe_layer(s: Section) -> dict:
    """``benchmarks/moe.py``'s layer part: grouped GEMM, sorted loop and masked loop of one MoE layer."""
    moe = _benchmark("moe")
    shapes = [dict(shape, tokens=64) for shape in moe.SHAPES] if s.smoke else moe.GPU_SHAPES
    rows = moe.bench_layer(shapes, 1 if s.smoke else 10, str(s.device))  # asserts the three paths agree
    return {"rows": rows, "ok": len(rows) == len(shapes)}


def _moe_md(result: dict) -> list[str]:
    return _benchmark("moe").render(result["rows"], None).splitlines()[2:]


def _warm_step(mfu, config, args, device: torch.device) -> Callable[[], torch.Tensor]:
    """The MFU script's step, run once (optimizer state, Triton compiles): the next call is a steady step."""
    model, optimizer, tokens = mfu.build_training(config, args, device)
    step = mfu.make_step(model, optimizer, tokens, device)
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return step


@dataclass(frozen=True)
class Plan:
    run: Callable[[Section], dict]
    budget_s: float  # on the GPU
    smoke_budget_s: float
    what: str


SECTIONS: dict[str, Plan] = {
    "tests": Plan(run_tests, 90, 40, "CUDA-only tests and kernel tests on CUDA (pytest)"),
    "kernels": Plan(run_kernels, 125, 60, "Triton kernels vs torch eager and torch.compile, bf16"),
    "mfu": Plan(run_mfu, 150, 90, "llama-1b bf16 MFU, eager and compiled blocks"),
    "mfu_fp8": Plan(run_mfu_fp8, 80, 60, "llama-1b MFU with FP8 projections (rowwise, tensorwise) beside bf16"),
    "host_syncs": Plan(run_host_syncs, 50, 40, "host syncs of one steady bf16 training step"),
    "moe_layer": Plan(run_moe_layer, 25, 20, "one MoE layer: grouped GEMM vs per-expert loops, bf16"),
}


def section_main(name: str, smoke: bool, budget_s: float, result_path: Path) -> int:
    s = Section(smoke, time.monotonic() + budget_s, result_path)
    try:
        result = SECTIONS[name].run(s)
    except Exception as exc:  # noqa: BLE001 - the suite records it and goes on
        s.save({"error": _error(exc), "traceback": traceback.format_exc()[-3000:]})
        traceback.print_exc()
        return 1
    s.save(result, complete=True)
    return 0


# -- the suite ---------------------------------------------------------------------------------------------


def run_section(name: str, plan: Plan, smoke: bool, box_s: float, workdir: Path, fork: bool | None = None) -> dict:
    """Run one section in its own process, which aims to end ``GRACE_S`` before its box and is killed at the end
    of it; the section's record for the JSON. The process is a fresh interpreter, or with ``fork`` (default:
    ``smoke``) a fork of this one."""
    result_path, log_path = workdir / f"{name}.json", workdir / f"{name}.log"
    budget = max(box_s - GRACE_S, 1.0)
    fork = smoke if fork is None else fork
    started = time.perf_counter()
    if fork:
        returncode = run_forked(lambda: section_main(name, smoke, budget, result_path), box_s, log_path)
    else:
        cmd = [sys.executable, __file__, "--section", name, "--budget", str(budget), "--result", str(result_path)]
        cmd += ["--smoke"] if smoke else []
        returncode = run_killable(cmd, box_s, log_path)
    status = "timeout" if returncode is None else None
    record = {"what": plan.what, "budget_s": round(box_s), "seconds": round(time.perf_counter() - started, 1)}
    saved = json.loads(result_path.read_text()) if result_path.exists() else {"complete": False, "result": {}}
    result = saved["result"]
    log_tail = log_path.read_text(errors="replace")[-2000:]
    if status == "timeout":
        record["error"] = f"timed out after {box_s:.0f} s; the result holds what it had measured"
    elif returncode != 0 or not saved["complete"]:
        status = "error"
        record["error"] = result.pop("error", None) or f"exit status {returncode}"
    else:
        status = "ok" if result.get("ok") else "failed"
    record = {"status": status, **record, "result": result}
    if status != "ok":
        record["log_tail"] = log_tail
    return record


def environment(smoke: bool) -> dict:
    import triton

    git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "commit": git.stdout.strip() or None,
        "smoke": smoke,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# GPU suite" + (" (smoke: CPU, tiny shapes; the numbers mean nothing)" if env["smoke"] else ""),
        "",
        f"{env['device']}, CUDA {env['cuda']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}; "
        f"{report['seconds']:.0f} s in all.",
        "",
        "| section | status | s | box s | what |",
        "|---|---|---|---|---|",
    ]
    for name, sec in report["sections"].items():
        lines.append(f"| {name} | {sec['status']} | {sec['seconds']:.0f} | {sec['budget_s']} | {sec['what']} |")
    for name, sec in report["sections"].items():
        lines += ["", f"## {name}", ""]
        if sec.get("error"):
            lines += [f"**{sec['status']}**: {sec['error']}", ""]
        with contextlib.suppress(KeyError, TypeError, ValueError):  # a partial result shows what it can
            lines += FORMATTERS[name](sec["result"])
    return "\n".join(lines) + "\n"


def _tests_md(result: dict) -> list[str]:
    lines = ["| run | passed | failed | errors | skipped | s | note |", "|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        counts = " | ".join(str(r.get(k, "")) for k in ("passed", "failed", "errors", "skipped"))
        lines.append(
            f"| {r['name']} (`{' '.join(r['args'])}`) | {counts} | {r.get('seconds', '')} | {r.get('error', '')} |"
        )
    failing = [f for r in result["runs"] for f in r.get("failing", [])]
    return lines + ([""] + [f"- failing: `{f}`" for f in failing] if failing else [])


def _kernels_md(result: dict) -> list[str]:
    kb = _benchmark("kernels")
    rows = [kb.Row(**{("pass_" if k == "pass" else k): v for k, v in r.items()}) for r in result["rows"]]
    env = result["environment"]
    lines = [
        f"{env['dtype']}; device-to-device copy {env['copy_gb_s']:.0f} GB/s; median of `triton.testing.do_bench`. "
        + result.get("note", ""),
        "",
        kb.markdown_table(rows),
    ]
    floors = [r for r in result["rows"] if (r.get("extra") or {}).get("measured_over_floor")]
    if floors:
        lines += [
            "",
            "| op | shape | pass | impl | ms | floor ms | measured / floor |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['op']} | {r['shape']} | {r['pass']} | {r['impl']} | {r['ms']:.3g} | {r['extra']['floor_ms']:.3g} "
            f"| {r['extra']['measured_over_floor']:.2f} |"
            for r in floors
        ]
    loaded = result.get("loaded_kernels", [])
    lines += ["", f"Loaded Triton kernels: {len(loaded)}" + ("" if loaded else " (interpreter: nothing compiled)")]
    if loaded:
        lines += ["", "| kernel | warps | stages | shared B | n_regs | n_spills |", "|---|---|---|---|---|---|"]
        lines += [
            f"| {k['kernel']} | {k['num_warps']} | {k['num_stages']} | {k['shared']} | {k['n_regs']} "
            f"| {k['n_spills']} |"
            for k in loaded
        ]
    return lines + [f"- skipped: {s}" for s in result.get("skipped", [])]


def _variant_table(result: dict, headings: dict[str, str]) -> list[str]:
    """The MFU script's summary rows of each variant measured (``headings``: variant -> column heading) side by
    side, then a line per variant that failed."""
    mfu = _benchmark("gpu_llama1b_mfu")
    variants = [v for v in headings if v in result]
    tables = {v: dict(mfu.summary_rows(result[v])) if "error" not in result[v] else {} for v in variants}
    labels = next((list(t) for t in tables.values() if t), [])
    lines = ["| | " + " | ".join(headings[v] for v in variants) + " |", "|---" * (len(variants) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(tables[v].get(label, "") for v in variants) + " |" for label in labels]
    return lines + [f"- {headings[v]}: {result[v]['error']}" for v in variants if "error" in result[v]]


def _mfu_md(result: dict) -> list[str]:
    lines = _variant_table(result, {"eager": "eager", "compiled": "compiled"})
    if "compiled_speedup" in result:
        lines.append(f"\nCompiled blocks: {result['compiled_speedup']:.2f}x the eager tokens/s.")
    return lines


def _mfu_fp8_md(result: dict) -> list[str]:
    from modelpar.model.layers.fp8 import FP8_MODES

    lines = _variant_table(result, {m: f"fp8={m}" for m in FP8_MODES})
    speedups = [m for m in FP8_MODES if f"{m}_speedup" in result]
    return lines + [f"\nfp8={m}: {result[f'{m}_speedup']:.2f}x bf16's tokens/s." for m in speedups]


def _host_syncs_md(result: dict) -> list[str]:
    lines = [
        f"{result['model']} ({result['kernels']} kernels), {result['step']}; counted: {result['counted']}.",
        "",
        "```",
        result["report"],
        "```",
    ]
    if result["cuda_sync_debug_warnings"] is not None:
        lines.append(f"\nCUDA sync-debug warnings in the step: {result['cuda_sync_debug_warnings']}")
        lines += [f"- `{w}`" for w in result["cuda_sync_debug_first"]]
    return lines


FORMATTERS: dict[str, Callable[[dict], list[str]]] = {
    "tests": _tests_md,
    "kernels": _kernels_md,
    "mfu": _mfu_md,
    "mfu_fp8": _mfu_fp8_md,
    "host_syncs": _host_syncs_md,
    "moe_layer": _moe_md,
}


def _preload_for_forks() -> None:
    """The modules every ``--smoke`` section imports, loaded before the first fork (the kernels first: they
    decide, before triton loads, that it interprets on a CPU-only build)."""
    for module in ("modelpar_kernels", "modelpar.bench.host_syncs", "modelpar.model.transformer"):
        importlib.import_module(module)
    for name in ("kernels", "gpu_llama1b_mfu", "moe"):
        _benchmark(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default benchmarks/results)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: every code path, about a minute")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(SECTIONS)}")
    parser.add_argument("--section", choices=list(SECTIONS), help=argparse.SUPPRESS)  # a section's own process
    parser.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.section:
        return section_main(args.section, args.smoke, args.budget, args.result)
    only = [name for name in args.only.split(",") if name] or list(SECTIONS)
    unknown = [name for name in only if name not in SECTIONS]
    if unknown:
        parser.error(f"--only {','.join(unknown)}: not a section; choose from {', '.join(SECTIONS)}")
    if not torch.cuda.is_available() and not args.smoke:
        print(NEEDS_CUDA, file=sys.stderr)
        return 2

    if args.smoke:  # the sections are forks of this process: what each would import, loaded once
        _preload_for_forks()
    started = time.monotonic()
    report = {"environment": environment(args.smoke), "sections": {}}
    with tempfile.TemporaryDirectory(prefix="gpu-suite-") as tmp:
        for name in only:
            plan = SECTIONS[name]
            box = min(
                plan.smoke_budget_s if args.smoke else plan.budget_s, TOTAL_BUDGET_S - (time.monotonic() - started)
            )
            if box < 10:
                report["sections"][name] = {
                    "status": "skipped",
                    "what": plan.what,
                    "budget_s": 0,
                    "seconds": 0.0,
                    "error": "the suite's 8 minutes are spent",
                    "result": {},
                }
                continue
            print(f"[{name}] {plan.what} (box {box:.0f} s) ...", flush=True)
            record = report["sections"][name] = run_section(name, plan, args.smoke, box, Path(tmp))
            print(f"[{name}] {record['status']} in {record['seconds']:.0f} s {record.get('error') or ''}", flush=True)
    report["seconds"] = round(time.monotonic() - started, 1)
    stem = "gpu_suite_smoke" if args.smoke else "gpu_suite"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(report))
    print(f"wrote {args.out / stem}.json and .md ({report['seconds']:.0f} s)")
    return 0 if all(sec["status"] == "ok" for sec in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
