"""Every Triton kernel the engine launches, compiled ahead of time for real GPUs, on a machine without one.

    python -m modelpar_kernels.aot --arch sm_80,sm_90a --out DIR             # every kernel, dtype, config
    python -m modelpar_kernels.aot --arch sm_90a --defaults-only --out DIR   # only the configs launched by default

The launch code itself says what it launches: each op's real launcher (``rms_norm_forward``,
``attention_backward``, ...) is called on meta tensors at the widths of the shipped model presets (head dims,
hidden sizes, tp shards of them) while ``grid.compiling_for`` makes it pick the tiles of the target GPU, and
``JITFunction.run`` is replaced by a recorder. Each recorded launch is bound and specialised as Triton's runtime
would (16-byte alignment, divisibility by 16 of the integer arguments), then compiled with ``triton.compile`` for
the target (sm_80: A100; sm_90a: H100, H200), and ``cuobjdump --dump-resource-usage`` of the cubin gives
registers, stack (spill) bytes and static shared memory. Attention kernels are compiled in every candidate
config that fits the arch's shared memory (``grid.attention_candidates``), the one the launcher picked marked as
the default.

Occupancy per SM is what the registers, shared memory and warps allow: blocks = min(32, 64 // warps,
65536 // (warps * ceil(32 * regs, 256)), shared-memory per SM // (shared + 1 KiB reserved per block)).

Writes ``DIR/aot.json`` and ``DIR/aot.md`` (with the roofline of ``modelpar_kernels.roofline`` beside). Exit
status 1 on a compile error, shared memory above the arch's per-block limit, or spills in a default config.
Triton keeps each compiled kernel in its cache (``TRITON_CACHE_DIR``), keyed by the kernel's source, the target
and the options, so a second run compiles only what changed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from modelpar_kernels.presets import PRESETS

ARCH_NAMES = ("sm_80", "sm_90a")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TP_SIZES = (1, 2, 4, 8)
SEQ = 1024  # rows of the meta tensors: a runtime argument (specialised only on divisibility by 16)


@dataclass(frozen=True)
class Arch:
    """Per-SM limits of one target (CUDA C Programming Guide, compute capabilities table)."""

    name: str
    capability: int
    gpus: str
    sm_count: int
    smem_per_sm: int  # bytes
    smem_per_block: int  # bytes, the opt-in maximum of one block


ARCHS = {
    "sm_80": Arch("sm_80", 80, "A100", 108, 167936, 166912),
    "sm_90a": Arch("sm_90a", 90, "H100, H200", 132, 233472, 232448),
}
REGS_PER_SM = 65536
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32
SMEM_RESERVED_PER_BLOCK = 1024


def occupancy(regs: int, warps: int, shared: int, arch: Arch) -> dict[str, int]:
    """Blocks and warps per SM that ``regs`` registers per thread and ``shared`` bytes per block allow."""
    regs_per_warp = math.ceil(32 * max(regs, 1) / 256) * 256
    limits = {
        "blocks": MAX_BLOCKS_PER_SM,
        "warps": MAX_WARPS_PER_SM // warps,
        "registers": REGS_PER_SM // (warps * regs_per_warp),
        "shared": arch.smem_per_sm // (shared + SMEM_RESERVED_PER_BLOCK) if shared else MAX_BLOCKS_PER_SM,
    }
    blocks = min(limits.values())
    limiter = min(limits, key=lambda k: (limits[k], k != "registers"))
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * warps, "limited_by": limiter}


# -- what the engine launches ---------------------------------------------------------------------------------


@dataclass
class Launch:
    """One recorded kernel launch: the JIT function, its arguments, and what it was launched for."""

    fn: object
    args: tuple
    kwargs: dict
    op: str
    variant: str
    width: str


@contextlib.contextmanager
def _recording(launches: list, op: str, variant: str, width: str):
    """Record every ``kernel[grid](...)`` inside instead of launching it."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, dict(kwargs), op, variant, width))

    JITFunction.run = record
    try:
        yield
    finally:
        JITFunction.run = original


def _meta(*shape, dtype):
    return torch.empty(*shape, dtype=dtype, device="meta")


def engine_launches(dtype: torch.dtype, arch: Arch, presets=tuple(PRESETS), tp_sizes=TP_SIZES) -> list[Launch]:
    """Every launch of every op's forward and backward at the presets' widths (tp shards included)."""
    from modelpar_kernels import grid
    from modelpar_kernels.cross_entropy import cross_entropy_forward_in_place
    from modelpar_kernels.rmsnorm import rms_norm_backward, rms_norm_forward
    from modelpar_kernels.rope import rope_rotate
    from modelpar_kernels.swiglu import swiglu_backward, swiglu_forward

    launches: list[Launch] = []
    f32 = torch.float32
    with grid.compiling_for(grid.GpuTarget(arch.capability, arch.sm_count)):
        for name in presets:
            p = PRESETS[name]
            with _recording(launches, "rms_norm", "", f"{name} h{p.hidden}"):
                x, w = _meta(SEQ, p.hidden, dtype=dtype), _meta(p.hidden, dtype=dtype)
                _, x2, rstd = rms_norm_forward(x, w, 1e-5)
                rms_norm_backward(x, x2, w, rstd)
            for tp in tp_sizes:
                shard = f"{name} tp{tp}"
                d = p.head_dim
                cos, sin = _meta(SEQ, d // 2, dtype=f32), _meta(SEQ, d // 2, dtype=f32)
                for heads, which in ((p.heads // tp, "q"), (max(p.kv_heads // tp, 1), "k")):
                    with _recording(launches, "rope", "", f"{shard} {which} {heads}x{d}"):
                        x = _meta(1, SEQ, heads, d, dtype=dtype)
                        rope_rotate(x, cos, sin)
                        rope_rotate(x, cos, sin, backward=True)
                with _recording(launches, "swiglu", "", f"{shard} f{p.ffn_hidden // tp}"):
                    g = _meta(SEQ, p.ffn_hidden // tp, dtype=dtype)
                    swiglu_forward(g, g)
                    swiglu_backward(g, g, g)
                local_vocab = -(-p.vocab_size // tp)
                with _recording(launches, "cross_entropy", "", f"{shard} v{local_vocab}"):
                    logits, targets = _meta(SEQ, local_vocab, dtype=dtype), _meta(SEQ, dtype=torch.int64)
                    cross_entropy_forward_in_place(logits, targets, 0, p.vocab_size, None, -100, lambda t, *_, **__: t)
                hq, hkv = p.heads // tp, max(p.kv_heads // tp, 1)
                _attention_launches(launches, dtype, f"{shard} hq{hq} hkv{hkv} d{d}", hq, hkv, d, d)
        for tp in tp_sizes:  # multi-head latent attention's heads after decompression: qk 192, v 128
            hq, (d, dv) = LATENT_HEADS // tp, LATENT_HEAD_DIMS
            _attention_launches(launches, dtype, f"latent tp{tp} hq{hq} d{d}/{dv}", hq, hq, d, dv)
    return launches


LATENT_HEADS, LATENT_HEAD_DIMS = 128, (192, 128)  # DeepSeek-V3's attention heads and their qk / v head dims
# (causal, documents, window): the diagonal and the cp block of earlier keys, each with and without documents
# and a sliding window (its offset: a block W/2 back, so the window's edge crosses it)
ATTENTION_VARIANTS = [(c, docs, w) for w in (False, True) for c in (True, False) for docs in (False, True)]
WINDOW = 4096


def attention_variant(causal: bool, docs: bool, window: bool) -> str:
    return ", ".join(["causal" if causal else "cp block"] + ["documents"] * docs + ["window"] * window)


def _attention_launches(launches, dtype, width, hq, hkv, d, dv) -> None:
    from modelpar_kernels.attention import attention_backward, attention_forward

    for causal, docs, window in ATTENTION_VARIANTS:
        with _recording(launches, "attention", attention_variant(causal, docs, window), width):
            q, k, v = (_meta(1, SEQ, h, e, dtype=dtype) for h, e in ((hq, d), (hkv, d), (hkv, dv)))
            ids = _meta(1, SEQ, dtype=torch.int32) if docs else None
            w, offset = (WINDOW, 0 if causal else WINDOW // 2) if window else (0, 0)
            out, lse = attention_forward(q, k, v, causal, ids, ids, w, offset)
            attention_backward(out, q, k, v, out, lse, causal, ids, ids, w, offset)


ATTENTION_KERNELS = {
    "_attention_forward_kernel": "forward",
    "_attention_backward_kv_kernel": "backward_kv",
    "_attention_backward_q_kernel": "backward_q",
}
TILE_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


# -- compiling ------------------------------------------------------------------------------------------------


@dataclass
class Job:
    """One compile: a kernel, its bound arguments, one config, for one arch; ``widths``: every preset width
    that launches exactly this (same specialisation)."""

    kernel: str
    op: str
    variant: str
    arch: str
    dtype: str
    config: dict
    default: bool
    widths: list
    launch: Launch


def _specialise(fn, args, kwargs, capability: int):
    """(signature, constexprs, attrs, options) as Triton's runtime would bind this launch for ``capability``."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", capability, 32))
    kwargs = dict(kwargs)
    kwargs.setdefault("debug", fn.debug or knobs.runtime.debug)
    kwargs.setdefault("instrumentation_mode", knobs.compilation.instrumentation_mode)
    kwargs.setdefault("fpsan_homomorphic_casts", knobs.compilation.fpsan_homomorphic_casts)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs, attrs, options


def _config(launch: Launch) -> dict:
    from triton.runtime.jit import JITFunction

    constexprs = {
        name: value
        for name, value in launch.kwargs.items()
        if name not in ("num_warps", "num_stages") and not isinstance(value, JITFunction)
    }
    constexprs = {k: v for k, v in constexprs.items() if k.isupper()}
    return {
        **constexprs,
        "num_warps": launch.kwargs.get("num_warps", 4),
        "num_stages": launch.kwargs.get("num_stages", 3),
    }


def plan_jobs(arch_names, dtype_names, defaults_only: bool, presets=tuple(PRESETS), tp_sizes=TP_SIZES) -> list[Job]:
    """Every distinct compile, attention kernels expanded to each candidate config."""
    from modelpar_kernels.grid import attention_candidates

    jobs: dict[tuple, Job] = {}
    for arch_name in arch_names:
        arch = ARCHS[arch_name]
        for dtype_name in dtype_names:
            for launch in engine_launches(DTYPES[dtype_name], arch, presets, tp_sizes):
                name = launch.fn.__name__
                picked = _config(launch)
                configs = [picked]
                if name in ATTENTION_KERNELS and not defaults_only:
                    candidates = attention_candidates(ATTENTION_KERNELS[name], picked["BLOCK_D"],
                                                      picked.get("BLOCK_DV", picked["BLOCK_D"]),
                                                      DTYPES[dtype_name], arch.capability)  # fmt: skip
                    configs += [c for c in candidates if c.items() - picked.items()]
                for config in configs:
                    default = config is picked
                    if not default:
                        launch = Launch(launch.fn, launch.args, {**launch.kwargs, **config}, launch.op,
                                        launch.variant, launch.width)  # fmt: skip
                    signature, constexprs, attrs, options = _specialise(
                        launch.fn, launch.args, launch.kwargs, arch.capability
                    )
                    key = (arch_name, name, str(signature), str(sorted(constexprs.items())), str(attrs), str(options))
                    if key in jobs:
                        jobs[key].widths.append(launch.width)
                        jobs[key].default |= default
                        continue
                    cfg = {k: v for k, v in _config(launch).items() if k in TILE_KEYS or k.startswith("BLOCK")}
                    jobs[key] = Job(name, launch.op, launch.variant, arch_name, dtype_name, cfg, default,
                                    [launch.width], launch)  # fmt: skip
    return list(jobs.values())


_JOBS: list[Job] = []  # what forked workers compile, by index


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL of the one function in ``cubin`` (``cuobjdump --dump-resource-usage``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    return {
        key.lower(): int(re.search(rf"\b{key}:(\d+)", line).group(1)) for key in ("REG", "STACK", "SHARED", "LOCAL")
    }


def compile_job(index: int) -> dict:
    """Compile ``_JOBS[index]`` and read its resources; the compiler's error if it fails."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    job = _JOBS[index]
    arch = ARCHS[job.arch]
    row = {name: getattr(job, name) for name in ("kernel", "op", "variant", "arch", "dtype", "config", "default")}
    row["widths"] = job.widths
    started = time.perf_counter()
    try:
        launch = job.launch
        signature, constexprs, attrs, options = _specialise(launch.fn, launch.args, launch.kwargs, arch.capability)
        kernel = triton.compile(
            ASTSource(launch.fn, signature, constexprs, attrs),
            target=GPUTarget("cuda", arch.capability, 32),
            options=options.__dict__,
        )
        usage = resource_usage(kernel.asm["cubin"])
    except Exception as exc:  # noqa: BLE001 - the compiler's error is the result
        row |= {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:2000]}
    else:
        warps = kernel.metadata.num_warps
        shared = usage["shared"] + kernel.metadata.shared
        row |= {
            "status": "compiled",
            "regs": usage["reg"],
            "spill_bytes": usage["stack"] + usage["local"],
            "predicted_n_spills": (usage["stack"] + usage["local"]) // 4,  # Triton's n_spills: local bytes / 4
            "static_shared": usage["shared"],
            "dynamic_shared": kernel.metadata.shared,
            "shared": shared,
            **occupancy(usage["reg"], warps, shared, arch),
        }
    row["seconds"] = round(time.perf_counter() - started, 2)
    return row


def problems(rows: list[dict]) -> list[str]:
    """What makes the check fail: compile errors, shared memory over the limit, spills in default configs."""
    found = []
    for r in rows:
        what = f"{r['kernel']} {r['arch']} {r['dtype']} {r['variant'] or ''} {r['config']}".replace("  ", " ")
        if r["status"] != "compiled":
            found.append(f"{what}: does not compile: {r['error'].splitlines()[0]}")
            continue
        limit = ARCHS[r["arch"]].smem_per_block
        if r["shared"] > limit:
            found.append(f"{what}: {r['shared']} bytes of shared memory, above the {limit} of one block")
        if r["default"] and r["spill_bytes"]:
            found.append(f"{what}: default config spills {r['spill_bytes']} bytes per thread ({r['regs']} registers)")
    return found


# -- reporting ------------------------------------------------------------------------------------------------


def _config_text(config: dict) -> str:
    tiles = " ".join(f"{k.removeprefix('BLOCK_')}{v}" for k, v in config.items() if k.startswith("BLOCK"))
    return f"{tiles} w{config['num_warps']} s{config['num_stages']}".strip()


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# Kernels compiled ahead of time",
        "",
        f"triton {env['triton']}, ptxas {env['ptxas']}; {len(report['rows'])} compiles in {report['seconds']:.0f} s "
        f"({env['command']}). Shared = static (cuobjdump) + dynamic (Triton's request), bytes per block; "
        "occupancy per SM from 64K registers, 64 warps, 32 blocks and the arch's shared memory "
        "(sm_80: 164 KiB per SM, 163 KiB per block; sm_90a: 228 KiB, 227 KiB; 1 KiB reserved per block). "
        "`*` marks the config the launcher picks by default.",
        "",
        f"Result: **{'ok' if not report['problems'] else 'FAILED'}**" + "".join(f"\n- {p}" for p in report["problems"]),
        "",
        "| kernel | variant | arch | dtype | config | status | regs | spill B | shared B | blocks/SM | warps/SM "
        "| limited by | widths |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        config = ("*" if r["default"] else "") + _config_text(r["config"])
        widths = "; ".join(r["widths"][:3]) + (f"; +{len(r['widths']) - 3}" if len(r["widths"]) > 3 else "")
        if r["status"] == "compiled":
            cells = [r["regs"], r["spill_bytes"], f"{r['static_shared']}+{r['dynamic_shared']}", r["blocks_per_sm"],
                     r["warps_per_sm"], r["limited_by"]]  # fmt: skip
        else:
            cells = [r["error"].splitlines()[0][:120], "", "", "", "", ""]
        lines.append(
            "| "
            + " | ".join(
                str(c)
                for c in [
                    r["kernel"].strip("_"),
                    r["variant"],
                    r["arch"],
                    r["dtype"],
                    config,
                    r["status"],
                    *cells,
                    widths,
                ]
            )  # fmt: skip
            + " |"
        )
    if report.get("roofline"):
        from modelpar_kernels.roofline import markdown_table

        lines += ["", markdown_table(report["roofline"])]
    return "\n".join(lines) + "\n"


def _sort_key(row: dict):
    order = ["rms_norm", "rope", "swiglu", "cross_entropy", "attention"]
    return (order.index(row["op"]), row["kernel"], row["variant"], row["arch"], row["dtype"], not row["default"])


def _say(line: str) -> None:
    print(f"modelpar_kernels.aot: {line}", file=sys.stderr, flush=True)


def run(arch_names, dtype_names, defaults_only: bool, jobs: int, command: str, presets, tp_sizes) -> dict:
    import triton
    from modelpar_kernels.roofline import roofline_rows

    started = time.perf_counter()
    _JOBS[:] = plan_jobs(arch_names, dtype_names, defaults_only, presets, tp_sizes)
    total = len(_JOBS)
    _say(
        f"compiling {total} kernel configs for {','.join(arch_names)} x {','.join(dtype_names)} in {jobs} "
        "process(es); a compile takes seconds to a minute, so every config of every arch takes hours on two cores "
        "(--defaults-only: the launchers' configs, minutes); aot.json and aot.md are written at the end"
    )
    rows = []
    with contextlib.ExitStack() as stack:
        if jobs > 1:
            pool = stack.enter_context(multiprocessing.get_context("fork").Pool(jobs))
            done = pool.imap_unordered(compile_job, range(total), chunksize=1)
        else:
            done = map(compile_job, range(total))
        for row in done:
            rows.append(row)
            if len(rows) == total or len(rows) % max(1, total // 20) == 0:  # about every 5%
                _say(f"{len(rows)}/{total} compiled ({time.perf_counter() - started:.0f} s)")
    rows.sort(key=_sort_key)
    ptxas = os.path.join(os.path.dirname(_cuobjdump()), "ptxas")
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    return {
        "environment": {
            "triton": triton.__version__,
            "ptxas": (re.findall(r"V\d+\.\d+\.\d+", version) or ["?"])[-1],
            "command": command,
            "archs": {name: asdict(ARCHS[name]) for name in arch_names},
        },
        "rows": rows,
        "problems": problems(rows),
        "roofline": roofline_rows(),
        "seconds": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default=",".join(ARCH_NAMES), help=f"comma-separated, of {', '.join(ARCH_NAMES)}")
    parser.add_argument("--dtype", default="bf16,fp32", help="comma-separated, of bf16, fp32")
    parser.add_argument("--defaults-only", action="store_true", help="only the configs the launchers pick")
    parser.add_argument("--preset", default=",".join(PRESETS), help="comma-separated model presets (widths)")
    parser.add_argument("--tp", default=",".join(map(str, TP_SIZES)), help="comma-separated tp sizes")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compiles in parallel")
    parser.add_argument("--out", type=Path, required=True, help="folder for aot.json and aot.md")
    args = parser.parse_args(argv)
    archs, dtypes = [a for a in args.arch.split(",") if a], [d for d in args.dtype.split(",") if d]
    presets, tp_sizes = [p for p in args.preset.split(",") if p], [int(t) for t in args.tp.split(",") if t]
    bad = [a for a in archs if a not in ARCHS] + [d for d in dtypes if d not in DTYPES]
    bad += [p for p in presets if p not in PRESETS]
    if bad:
        parser.error(
            f"{', '.join(bad)}: choose --arch from {', '.join(ARCHS)}, --dtype from {', '.join(DTYPES)}, "
            f"--preset from {', '.join(PRESETS)}"
        )
    from modelpar_kernels import grid

    if grid.interpreting():  # triton was imported for the interpreter; compiling needs a fresh process
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        argv = sys.argv[1:] if argv is None else argv
        return subprocess.run([sys.executable, "-m", "modelpar_kernels.aot", *argv], env=env).returncode
    command = "python -m modelpar_kernels.aot " + " ".join(sys.argv[1:] if argv is None else argv)
    report = run(archs, dtypes, args.defaults_only, args.jobs, command, presets, tp_sizes)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "aot.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "aot.md").write_text(markdown(report))
    errors = sum(r["status"] != "compiled" for r in report["rows"])
    print(
        f"{len(report['rows'])} kernels compiled for {','.join(archs)} x {','.join(dtypes)} "
        f"in {report['seconds']:.0f} s ({errors} errors); wrote {args.out / 'aot.json'} and aot.md"
    )
    for p in report["problems"]:
        print(f"problem: {p}")
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
