"""``modelpar-plan``: rank the ``tp x cp x pp x dp`` layouts of a model on a cluster by predicted throughput, among
those that fit in memory, and print the ``modelpar-train`` overrides that run the best (``modelpar.plan``).

    modelpar-plan --model llama-8b --gpus 64 --global-batch 512 --seq-len 4096
    modelpar-plan --model tiny --gpus 4 --global-batch 16 --seq-len 64 --hardware cpu --json plan.json
    modelpar-plan --model llama-8b --gpus 64 --global-batch 32 --seq-len 131072 --flash-attention   # long context

A bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shlex
import sys
from collections.abc import Iterator, Sequence

from modelpar.model.activations import RECOMPUTE
from modelpar.pipeline.schedule import SCHEDULES
from modelpar.plan import (
    GIB,
    HARDWARE,
    SELECTIVE_CHOICES,
    CostModel,
    Hardware,
    ModelSpec,
    PlanError,
    PlannedLayout,
    SearchSpace,
    Strategy,
    explain,
    load_hardware,
    load_model,
    model_presets,
    plan,
)
from modelpar.plan.published_memory import published_note

# the recompute modes modelpar-train runs, all modelled for our block (modelpar/plan/activations.py): selective
# with each of the planner's parallel.recompute_modules choices
TRAINER_RECOMPUTE = RECOMPUTE
SHORT_MODULES = {"attention": "attn", "mlp": "mlp", "elementwise": "elem"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="modelpar-plan",
        description="Rank tp x cp x pp x dp layouts of a model by predicted throughput among those that fit in memory.",
    )
    ap.add_argument("--model", default="llama-8b", help=f"preset in recipes/model ({', '.join(model_presets())})")
    for flag in ("vocab-size", "hidden", "layers", "heads", "kv-heads", "ffn-hidden"):
        ap.add_argument(f"--{flag}", type=int, help="override the preset's shape")
    ap.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument(
        "--flash-attention", action="store_true", help="attention stores no s x s scores (drops the 5as/h term)"
    )
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument(
        "--global-batch",
        type=int,
        required=True,
        help="sequences per optimizer step (Llama 3 pretrained with about 4M tokens a step: 512 at --seq-len 8192)",
    )
    ap.add_argument("--seq-len", type=int, required=True, help="tokens per sequence (data.seq_len), e.g. 4096 or 8192")
    ap.add_argument("--hardware", default="h100-80gb", help=f"preset ({', '.join(sorted(HARDWARE))})")
    ap.add_argument("--memory-gib", type=float, help="memory per device")
    ap.add_argument("--peak-tflops", type=float, help="dense peak per device in the training dtype")
    ap.add_argument("--intra-node-gbs", type=float, help="GB/s per device inside a node")
    ap.add_argument("--inter-node-gbs", type=float, help="GB/s per device between nodes")
    ap.add_argument("--gpus-per-node", type=int)
    ap.add_argument("--latency-us", type=float, help="per message")
    ap.add_argument("--dtype", choices=("bf16", "fp32"))
    ap.add_argument("--efficiency", type=float, default=CostModel.efficiency, help="achievable fraction of peak")
    ap.add_argument("--dp-overlap", type=float, default=CostModel.dp_overlap, help="hidden fraction of DP comm")
    ap.add_argument("--tp", type=int, help="pin tensor parallelism")
    ap.add_argument("--pp", type=int, help="pin pipeline parallelism")
    ap.add_argument("--dp", type=int, help="pin data parallelism")
    ap.add_argument("--cp", type=int, help="pin context parallelism (each sequence split over cp ranks)")
    ap.add_argument("--ep", type=int, help="pin expert parallelism (mixture-of-experts models; from dp x cp)")
    ap.add_argument(
        "--cp-comm", default=",".join(SearchSpace.cp_comm), help="comma-separated K/V exchanges to try under cp"
    )
    ap.add_argument(
        "--schedules",
        default=",".join(SearchSpace.schedules),
        help=f"comma-separated pipeline schedules to try with pp > 1 ({', '.join(SCHEDULES)})",
    )
    ap.add_argument("--max-vpp", type=int, default=SearchSpace.max_vpp)
    ap.add_argument(
        "--max-v-pp", type=int, default=SearchSpace.max_v_pp, help="deepest pipeline zbv/dualpipev are searched at"
    )
    ap.add_argument("--max-micro-batch-size", type=int, default=SearchSpace.max_micro_batch_size)
    ap.add_argument(
        "--recompute",
        default=",".join(TRAINER_RECOMPUTE),
        help="comma-separated modes to try: none, selective (each --recompute-modules choice), full",
    )
    ap.add_argument(
        "--recompute-modules",
        default=";".join(",".join(c) for c in SELECTIVE_CHOICES),
        help="selective recompute's choices of parallel.recompute_modules, ';'-separated, each a ','-list of "
        "attention, mlp, elementwise",
    )
    ap.add_argument(
        "--offload",
        default="auto",
        choices=("auto", "off"),
        help="auto: try parallel.offload_activations where a layout does not fit without it; off: never",
    )
    ap.add_argument("--top", type=int, default=10, help="rows to print")
    ap.add_argument("--json", type=pathlib.Path, help="write every fitting layout here")
    return ap


# flag -> (Hardware field, unit of the flag in the field's units)
HARDWARE_FLAGS = {
    "memory_gib": ("memory_bytes", GIB),
    "peak_tflops": ("peak_flops", 1e12),
    "intra_node_gbs": ("intra_node_bw", 1e9),
    "inter_node_gbs": ("inter_node_bw", 1e9),
    "gpus_per_node": ("gpus_per_node", 1),
    "latency_us": ("latency_s", 1e-6),
}


def hardware_from_args(args: argparse.Namespace) -> Hardware:
    """The ``--hardware`` preset with any of ``HARDWARE_FLAGS`` and ``--dtype`` overriding it."""
    overrides = {"dtype": args.dtype} if args.dtype else {}
    for flag, (field, unit) in HARDWARE_FLAGS.items():
        value = getattr(args, flag)
        if value is None:
            continue
        if value <= 0 and not (flag == "latency_us" and value == 0):
            raise PlanError(f"--{flag.replace('_', '-')}={value} must be positive")
        overrides[field] = value * unit
    return dataclasses.replace(load_hardware(args.hardware), **overrides)


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    spec = load_model(args.model)
    shape_overrides = {
        "vocab_size": args.vocab_size,
        "hidden": args.hidden,
        "layers": args.layers,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "ffn_hidden": args.ffn_hidden,
    }
    for key, value in shape_overrides.items():
        if value is not None and value < 1:
            raise PlanError(f"--{key.replace('_', '-')}={value} must be >= 1")
    shape = dataclasses.replace(spec.shape, **{k: v for k, v in shape_overrides.items() if v is not None})
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise PlanError(f"hidden={shape.hidden}, heads={shape.heads}, kv_heads={shape.kv_heads} must divide evenly")
    if shape != spec.shape:
        shape = dataclasses.replace(shape, name=f"{spec.name} (custom shape)")
    if args.tie_embeddings is not None:
        shape = dataclasses.replace(shape, tie_embeddings=args.tie_embeddings)
    return ModelSpec(shape, args.flash_attention)


def trainer_overrides(strategy: Strategy, seq_len: int, model: ModelSpec | None = None) -> list[str] | None:
    """The ``modelpar-train`` overrides that run ``strategy`` (model and hardware aside), or None where the trainer
    cannot. For a mixture of experts with an aux loss (``model``) under a schedule that
    runs backwards before the last forward, the aux loss is taken per global micro-batch."""
    if strategy.recompute not in TRAINER_RECOMPUTE:
        return None
    layout = strategy.layout
    out = [f"parallel.tp={layout.tp}", f"parallel.pp={layout.pp}", f"parallel.dp={layout.dp}"]
    if layout.cp > 1:
        out += [f"parallel.cp={layout.cp}", f"parallel.cp_comm={strategy.cp_comm}"]
    if layout.ep > 1:
        out.append(f"parallel.ep={layout.ep}")
    moe = model.shape.moe if model is not None else None
    if moe is not None and moe.enabled and moe.aux_loss_coef and strategy.micro_batches > 1:
        out.append("model.moe.aux_loss_scope=micro_batch")  # backwards before the last forward: see aux_loss_scope
    if layout.pp > 1 and strategy.schedule_name != "1f1b":
        out.append(f"parallel.schedule={strategy.schedule_name}")
    if layout.vpp > 1:
        out.append(f"parallel.vpp={layout.vpp}")
    out.append(f"parallel.microbatches={strategy.micro_batches}")
    out += ["parallel.sp=true"] * strategy.sp
    out += [f"parallel.recompute={strategy.recompute}"] * (strategy.recompute != "none")
    if strategy.recompute == "selective":
        out.append(f"parallel.recompute_modules=[{','.join(strategy.recompute_modules)}]")
    out += ["parallel.offload_activations=true"] * strategy.offload
    out += [f"optim.zero={strategy.zero}"] * strategy.zero1
    out += ["optim.reduce_every_micro_batch=true"] * strategy.reduce_every_micro_batch
    return [*out, f"data.global_batch={strategy.global_batch}", f"data.seq_len={seq_len}"]


def launch_line(gpus: int, per_node: int, overrides: list[str]) -> str:
    """The run on its GPUs: torchrun on each node (``$HEAD``: the first node's address), the GPU trainer recipe
    and a token file to name (``modelpar-data prepare``)."""
    nodes = max(1, -(-gpus // per_node))
    torchrun = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={min(gpus, per_node)}"]
    if nodes > 1:
        torchrun.append("--rdzv-endpoint=$HEAD:29500")
    run = ["-m", "modelpar.cli.train", "trainer=gpu", "data=npy", "data.path=YOUR_TOKENS.npy", *overrides]
    return " ".join(torchrun) + " " + shlex.join(run) + "  # on every node; YOUR_TOKENS.npy: modelpar-data prepare"


def model_overrides(args: argparse.Namespace) -> list[str]:
    """``model=<preset>`` and the shape flags given, as ``modelpar-train`` overrides."""
    out = [f"model={args.model}"]
    for key in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden"):
        if getattr(args, key) is not None:
            out.append(f"model.{key}={getattr(args, key)}")
    if args.tie_embeddings is not None:
        out.append(f"model.tie_embeddings={str(args.tie_embeddings).lower()}")
    return out


def format_table(planned: Sequence[PlannedLayout], top: int) -> Iterator[str]:
    header = (
        f"{'#':>3} {'layout':<28} {'mbs':>3} {'m':>4} {'recompute':<13} {'zero':<4} {'sp':<3} {'cp comm':<9} "
        f"{'mem GiB':>7} {'step s':>8} {'tokens/s':>10} {'MFU':>5} {'bubble':>6} {'comm':>5}"
    )
    yield header
    yield "-" * len(header)
    for i, entry in enumerate(planned[:top], 1):
        s, p = entry.strategy, entry.prediction
        comm = p.tp_comm_s + p.pp_comm_s + p.dp_comm_s + p.cp_comm_s + p.ep_comm_s
        yield (
            f"{i:>3} {layout_cell(s):<28} {s.micro_batch_size:>3} {s.micro_batches:>4} {recompute_cell(s):<13} "
            f"{s.zero:<4} {'yes' if s.sp else 'no':<3} "
            f"{s.cp_comm if s.layout.cp > 1 else '-':<9} {p.memory.total / GIB:>7.1f} "
            f"{p.total_s:>8.3f} {p.tokens_per_s:>10.4g} {p.mfu:>5.1%} {p.bubble_s / p.total_s:>6.1%} "
            f"{comm / p.total_s:>5.1%}"
        )


def layout_cell(s: Strategy) -> str:
    """The layout, and ``:schedule`` where it is not the one the layout implies (1F1B; interleaved with vpp > 1):
    ``tp1-pp4-dp2-vpp2:zbv``."""
    implied = "interleaved" if s.layout.vpp > 1 else "1f1b"
    return str(s.layout) + (f":{s.schedule_name}" if s.layout.pp > 1 and s.schedule_name != implied else "")


def recompute_cell(s: Strategy) -> str:
    """``none``, ``full``, ``sel:attn+elem`` ..., and ``+off`` with activation offload."""
    cell = s.recompute
    if s.recompute == "selective":
        cell = "sel:" + "+".join(SHORT_MODULES.get(m, m) for m in s.recompute_modules)
    return cell + "+off" * s.offload


def parse_modules(text: str) -> tuple[tuple[str, ...], ...]:
    """``attention;mlp,elementwise`` -> (("attention",), ("mlp", "elementwise"))."""
    return tuple(tuple(m.strip() for m in c.split(",") if m.strip()) for c in text.split(";") if c.strip())


def search_progress(layouts: list) -> Iterator:
    """A progress bar on stderr over the layouts searched, cleared when the search ends."""
    from tqdm import tqdm  # only on a terminal: tqdm starts a monitor thread on import

    return iter(tqdm(layouts, desc="modelpar-plan: searching", unit="layout", file=sys.stderr, leave=False))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        model = model_from_args(args)
        hardware = hardware_from_args(args)
        if args.ep is not None and (args.ep < 1 or (args.ep > 1 and not model.shape.moe.enabled)):
            raise PlanError(f"--ep={args.ep} needs a mixture-of-experts model and ep >= 1; drop --ep for {model.name}")
        space = SearchSpace(
            tp=args.tp,
            pp=args.pp,
            dp=args.dp,
            cp=args.cp,
            ep=args.ep,
            cp_comm=tuple(c.strip() for c in args.cp_comm.split(",") if c.strip()),
            schedules=tuple(c.strip() for c in args.schedules.split(",") if c.strip()),
            max_vpp=args.max_vpp,
            max_v_pp=args.max_v_pp,
            max_micro_batch_size=args.max_micro_batch_size,
            recompute=tuple(r.strip() for r in args.recompute.split(",") if r.strip()),
            recompute_modules=parse_modules(args.recompute_modules),
            offload=(False,) if args.offload == "off" else (False, True),
        )
        costs = CostModel(efficiency=args.efficiency, dp_overlap=args.dp_overlap)
        if not 0 < costs.efficiency <= 1 or not 0 <= costs.dp_overlap <= 1:
            raise PlanError("--efficiency must be in (0, 1] and --dp-overlap in [0, 1]")
        planned = plan(
            model,
            hardware,
            gpus=args.gpus,
            global_batch=args.global_batch,
            seq_len=args.seq_len,
            costs=costs,
            space=space,
            progress=search_progress if sys.stderr.isatty() else None,  # piped: the output stays as it is
        )
    except PlanError as exc:
        print(f"modelpar-plan: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{model.name} on {args.gpus} x {hardware.name} ({hardware.memory_bytes / GIB:.0f} GiB, "
        f"{hardware.peak_flops / 1e12:.4g} TFLOP/s {hardware.dtype}), batch {args.global_batch} x {args.seq_len}, "
        f"efficiency {costs.efficiency}: {len(planned)} layouts fit"
    )
    for line in format_table(planned, args.top):
        print(line)
    best = trainer_overrides(planned[0].strategy, args.seq_len, model)
    print("run #1: " + shlex.join(["modelpar-train", *model_overrides(args), *best]))  # pasted into a shell as is
    if args.hardware != "cpu":
        print("launch #1: " + launch_line(args.gpus, hardware.gpus_per_node, [*model_overrides(args), *best]))
    for line in explain(planned[0], model, hardware, seq_len=args.seq_len, costs=costs, space=space):
        print(line)
    note = published_note(model, args.gpus, args.seq_len, planned[0].strategy.layout, hardware)
    if note:
        print(note)
    if args.json:
        record = {
            "model": {**dataclasses.asdict(model.shape), "flash_attention": model.flash_attention},
            "hardware": dataclasses.asdict(hardware),
            "costs": dataclasses.asdict(costs),
            "gpus": args.gpus,
            "global_batch": args.global_batch,
            "seq_len": args.seq_len,
            "layouts": [
                entry.as_dict() | {"trainer_overrides": trainer_overrides(entry.strategy, args.seq_len, model)}
                for entry in planned
            ],
        }
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
