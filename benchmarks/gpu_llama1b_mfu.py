"""MFU of llama-1b training on one GPU, against the bf16 matmul peak measured first on the same GPU.

    python benchmarks/gpu_llama1b_mfu.py                  # one CUDA GPU (H100/H200): about 3-5 minutes
    python benchmarks/gpu_llama1b_mfu.py --micro-batch 8 --seq 2048 --accum 2
    python benchmarks/gpu_llama1b_mfu.py --compile        # each block under torch.compile (compile_blocks)
    python benchmarks/gpu_llama1b_mfu.py --smoke          # a tiny model on CPU: every code path once (tests)

1. Peak: the median TFLOP/s of a large square bf16 matmul (``--peak-n``, 8192 by default), timed with CUDA
   events after a warm-up; the nominal dense peak of the card (989 TFLOP/s for H100/H200 SXM) is printed beside.
2. The model: ``recipes/model/llama-1b.yaml`` built by ``modelpar.model.transformer.build_model`` on one device
   (``kernels=auto``: the Triton kernels on CUDA), fp32 parameters and AdamW state (master weights) with the
   forward and backward under ``torch.autocast(bfloat16)``; this is what a single-device step of the trainer
   computes, in a plain loop (``Trainer`` needs a process group and a token file). If the Triton kernels fail
   on this setup the script says so and reruns with ``kernels=torch`` (SDPA / flash attention).
3. ``--warmup`` untimed steps (Triton compiles here), then ``--steps`` timed ones; each step is ``--accum``
   micro-batches of ``--micro-batch x --seq`` random tokens, forward + backward, grad clipping, fused AdamW.
   With ``--compile`` every block is under ``torch.compile`` (``modelpar.model.compile.compile_blocks``); the
   compile happens in the warm-up steps and its time is reported beside the result.

MFU = model FLOPs per step (``modelpar.model.flops.training_flops_per_token``: 6 N + 12 L h s per token, no
recompute) / median step time / measured peak. Prints a table and writes ``benchmarks/results/
gpu_llama1b_mfu.json`` (``gpu_llama1b_mfu_compiled.json`` with ``--compile``; or ``--out``). Budget: the whole
run stays well under 8 minutes on an H200; the script stops timing early if ``--time-limit`` seconds pass.
``benchmarks/gpu_suite.py`` runs it eager and compiled, beside the kernel benchmarks and the GPU tests.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import yaml

from modelpar.cli.args import positive_float, positive_int
from modelpar.model.compile import compile_blocks
from modelpar.model.config import ModelConfig
from modelpar.model.flops import training_flops_per_token
from modelpar.model.layers.fp8 import FP8_MODES
from modelpar.model.transformer import build_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
NOMINAL_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
SMOKE_MODEL = ModelConfig(vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=176)


def llama_1b() -> ModelConfig:
    cfg = yaml.safe_load((ROOT / "recipes" / "model" / "llama-1b.yaml").read_text())
    fields = {k: v for k, v in cfg.items() if k in ModelConfig.__dataclass_fields__}
    return ModelConfig(**fields)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak_tflops(device: torch.device, n: int, reps: int = 20) -> float:
    """Median TFLOP/s of an ``n x n x n`` bf16 matmul."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e12


def make_step(model, optimizer, tokens: torch.Tensor, device: torch.device):
    """One optimizer step over ``tokens`` [accum, b, s + 1]: returns ``step() -> loss`` (0-d, on the device).

    Per micro-batch a forward under bf16 autocast, the loss and backward; then grad clipping and the optimizer.
    The loss stays on the device: the step itself reads nothing back to the host.
    """
    accum = tokens.shape[0]

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for j in range(accum):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(tokens[j, :, :-1])
            loss = model.loss(logits, tokens[j, :, 1:]) / accum
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return total

    return step


def build_training(config: ModelConfig, args, device: torch.device):
    """The single-device model, fused AdamW (on CUDA) and random tokens [accum, micro_batch, seq + 1]."""
    model = build_model(config, seed=0, device=device, fp8=config.fp8)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda"
    )
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (args.accum, args.micro_batch, args.seq + 1)
    tokens = torch.randint(0, config.vocab_size, shape, device=device, generator=gen)
    return model, optimizer, tokens


def train_steps(config: ModelConfig, args, device: torch.device) -> dict:
    """Build the model (blocks compiled with ``--compile``), run warm-up and timed steps; per-step seconds and
    losses."""
    built = time.perf_counter()
    model, optimizer, tokens = build_training(config, args, device)
    build_s = time.perf_counter() - built
    compilation = compile_blocks(model, report=print, backend=args.compile_backend) if args.compile else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = make_step(model, optimizer, tokens, device)

    for _ in range(args.warmup):
        step()
    _sync(device)
    times, losses = [], []
    started = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        if time.perf_counter() - started > args.time_limit:
            break
    peak_mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        "build_s": build_s,
        "compile_s": compilation.compile_s if compilation else None,
        "step_s": times,
        "losses": losses,
        "peak_memory_bytes": peak_mem,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny model on CPU, 2 steps: exercise every path (flags given still apply)"
    )
    parser.add_argument("--compile", action="store_true", help="each block under torch.compile (compile_blocks)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend for --compile")
    parser.add_argument("--fp8", choices=FP8_MODES, default="off", help="model.fp8: the projections' GEMMs in FP8")
    parser.add_argument("--micro-batch", type=positive_int, default=4)
    parser.add_argument("--seq", type=positive_int, default=2048)
    parser.add_argument("--accum", type=positive_int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--warmup", type=positive_int, default=3)
    parser.add_argument("--steps", type=positive_int, default=15)
    parser.add_argument("--peak-n", type=positive_int, default=8192)
    parser.add_argument("--time-limit", type=positive_float, default=240.0, help="stop timing steps after this many s")
    parser.add_argument("--out", type=Path, default=None)
    if parser.parse_args(argv).smoke:  # the smoke's sizes are the defaults; a flag given still sets its own
        parser.set_defaults(micro_batch=2, seq=32, accum=2, warmup=1, steps=2, peak_n=256)
    return parser.parse_args(argv)


def model_and_device(args) -> tuple[torch.device, ModelConfig, str]:
    """The tiny model on CPU for ``--smoke``, else llama-1b on the first CUDA GPU; max_seq_len fits ``--seq``."""
    if args.smoke:
        device, config, name = torch.device("cpu"), SMOKE_MODEL, "smoke"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_llama1b_mfu.py needs a CUDA GPU; use --smoke on CPU")
        device, config, name = torch.device("cuda", 0), llama_1b(), "llama-1b"
    return device, replace(config, max_seq_len=max(config.max_seq_len, args.seq), fp8=args.fp8), name


def measure(args, peak: float | None = None) -> dict:
    """Measure the matmul peak (unless given) and the training steps; the result as written to the JSON."""
    device, config, name = model_and_device(args)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    nominal = next((v for k, v in NOMINAL_TFLOPS.items() if k in gpu), None)
    if peak is None:
        peak = matmul_peak_tflops(device, args.peak_n)
        print(f"{gpu}: bf16 matmul {args.peak_n}^3 measured {peak:.1f} TFLOP/s (nominal {nominal or '?'})", flush=True)
    kernels, fallback = config.kernels, None
    try:
        run = train_steps(config, args, device)
    except Exception as exc:  # noqa: BLE001 - reported, then the torch kernels are tried
        fallback = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        print(f"kernels={kernels} failed ({fallback}); rerunning with kernels=torch", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        config, kernels = replace(config, kernels="torch"), "torch"
        run = train_steps(config, args, device)
    shape = config
    tokens = args.accum * args.micro_batch * args.seq
    flops = training_flops_per_token(shape, args.seq) * tokens
    step_s = statistics.median(run["step_s"])
    achieved = flops / step_s / 1e12
    return {
        "model": name,
        "config": asdict(config),
        "matmul_params": shape.matmul_params(),
        "device": gpu,
        "torch": torch.__version__,
        "kernels": kernels,
        "kernels_fallback_reason": fallback,
        "compiled_blocks": args.compile,
        "compile_backend": args.compile_backend if args.compile else None,
        "compile_s": run["compile_s"],
        "precision": "fp32 params + AdamW state, bf16 autocast forward/backward"
        + (f", {config.fp8} FP8 projections" if config.fp8 != "off" else ""),
        "micro_batch": args.micro_batch,
        "seq_len": args.seq,
        "accum": args.accum,
        "tokens_per_step": tokens,
        "model_flops_per_step": flops,
        "matmul_peak_tflops": peak,
        "nominal_peak_tflops": nominal,
        "step_s_median": step_s,
        "step_s": run["step_s"],
        "tokens_per_s": tokens / step_s,
        "achieved_tflops": achieved,
        "mfu_vs_measured_peak": achieved / peak,
        "mfu_vs_nominal_peak": achieved / nominal if nominal else None,
        "peak_memory_gib": run["peak_memory_bytes"] / 2**30 if run["peak_memory_bytes"] else None,
        "losses": run["losses"],
        "build_s": run["build_s"],
    }


def summary_rows(result: dict) -> list[tuple[str, str]]:
    """(label, value) lines of one result, for the terminal and the GPU suite's markdown."""
    peak, nominal, step_s = result["matmul_peak_tflops"], result["nominal_peak_tflops"], result["step_s_median"]
    achieved, fallback = result["achieved_tflops"], result["kernels_fallback_reason"]
    compiled = ""
    if result["compiled_blocks"]:
        compiled = f", blocks compiled ({result['compile_backend']}) in {result['compile_s']:.1f} s"
    tokens = result["tokens_per_step"]
    return [
        ("model", f"{result['model']} ({result['matmul_params'] / 1e9:.2f} B matmul params)"),
        ("kernels", result["kernels"] + (f" (fallback: {fallback})" if fallback else "") + compiled),
        ("batch", f"{result['accum']} x {result['micro_batch']} x {result['seq_len']} = {tokens} tokens"),
        ("step (median)", f"{step_s * 1e3:.1f} ms over {len(result['step_s'])} steps"),
        ("tokens/s", f"{tokens / step_s:,.0f}"),
        ("achieved", f"{achieved:.1f} TFLOP/s"),
        ("matmul peak", f"{peak:.1f} TFLOP/s measured" + (f", {nominal:.0f} nominal" if nominal else "")),
        ("MFU", f"{achieved / peak:.1%} of measured" + (f", {achieved / nominal:.1%} of nominal" if nominal else "")),
        ("peak memory", f"{result['peak_memory_gib']:.1f} GiB" if result["peak_memory_gib"] else "-"),
        ("loss", f"{result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}"),
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = measure(args)
    rows = summary_rows(result)
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    stem = "gpu_llama1b_mfu" + ("_compiled" if args.compile else "") + ("_smoke" if args.smoke else "")
    out = args.out or RESULTS / f"{stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
