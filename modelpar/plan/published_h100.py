"""Published H100 training runs the planner is checked against, and how it predicts each one.

- **Llama 3 405B** (Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv:2407.21783, Table 4): pretraining on up
  to 16,384 H100 SXM 80GB (700 W, NVLink within a server of 8, 400 Gb/s RoCE between GPUs), 16M-token batches,
  tp8 pp16, BF16 TFLOP/s per GPU 430 / 400 at sequence 8192 (dp 64 / 128) and 380 at 131,072 with cp16 (dp 8).
  The rows are restated from the authors' SC'24 slides at https://glennklockwood.com/garden/llama-3.1 (where the
  figures were checked; that page gives no sequence lengths, taken as the paper's 8K and 128K stages). Assumed:
  one sequence per micro-batch, 4 chunks per stage, no recompute, ZeRO-2, sequence parallelism, ring context
  parallelism, and model FLOPs counted as ``modelpar.model.flops`` counts them.
- **torchtitan** (github.com/pytorch/torchtitan, docs/performance.md), on Meta's Grand Teton hosts: 8 H100 per host
  on NVLink, 96 GB of HBM2e at 2.4 TB/s, 400 Gb/s per GPU between hosts, the default 500 W power limit. Table 1:
  Llama 3.1 8B on 8 GPUs, FSDP, local batch 2, selective (op-level) activation checkpointing: 5,762 tokens/s per
  GPU in eager PyTorch, 6,667 with torch.compile (the page's 33% / 39% MFU, which fix the sequence at 8192). The
  Llama 3.1 405B table: 128 H100 of 94 GB, FSDP 16 x TP 8, local batch 2, full checkpointing, 109 tokens/s per
  GPU (29.0% MFU), no other optimisation.
- **Qwen3-235B-A22B** (github.com/yanring/Megatron-MoE-ModelZoo, best_practice/Qwen3/readme.md, Megatron-Core's
  MoE model zoo): 256 H100, BF16, sequence 4096, global batch 2048, micro-batch 1, the plain all-to-all
  dispatcher, TP2 PP32 VPP3 EP8 (expert tensor parallel 1, expert dp 1), recompute of the norms and activation
  functions: 24.2 s per step (200 TFLOP/s per GPU).

How each is predicted: ``predict`` of the published strategy, at the default costs the A100 rows use (efficiency
0.55, not fitted to any of these), on the run's hardware, plus what the run's engine does that modelpar's step for
the same strategy does not (``Engine``), priced at the planner's own rates:

- torchtitan's op-level checkpointing saves every matmul's output except every second one of a block (the order is
  wq, wk, wv, wo, w1, w3, w2: ``wk``, ``wo`` and ``w3`` rerun in backward) and reruns every element-wise op;
- eager PyTorch runs the element-wise ops unfused: ``EAGER_PASSES`` counts the [b, s, h]-sized passes (a bf16
  read or write each, fp32 two) each op of torchtitan's block makes beyond modelpar's fused kernels, counted from
  the ops it runs (not measured), at the HBM bandwidth;
- Grand Teton's 500 W limit slows the tensor cores by ``GRAND_TETON_CLOCK``: the one figure fitted here, on the
  compiled 8B row (``fit_grand_teton_clock``), and then used unchanged for the eager 8B and the 405B rows;
- Megatron's dropless router waits for the busiest experts: ``dropless_excess``, fitted on the same source's
  four long-context rows that give one run with the router forced to balance and one dropless, then used for
  the 4K step row, which was not in the fit. modelpar's own MoE step routes dropless too, and the planner does
  not yet price it there.

Qwen3's EP8 is Megatron's, carved from tp x dp (2 x 4); modelpar carves ep from dp x cp, so the row runs ep4 over
dp4 with the experts replicated over tp2 (each tp rank routes its half of the tokens: the same all-to-all volume).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from modelpar.model.config import ModelConfig, MoEConfig
from modelpar.model.flops import training_flops_per_token
from modelpar.parallel.layout import ParallelLayout
from modelpar.plan.presets import HARDWARE
from modelpar.plan.spec import GIB, CostModel, Hardware, ModelSpec, Prediction, Strategy
from modelpar.plan.step_time import ep_comm_per_layer_s, predict

LLAMA3_VOCAB = 128_256
H100_SOURCE = (
    "Dubey et al. 2024, arXiv:2407.21783 (Table 4); torchtitan docs/performance.md; Megatron-MoE-ModelZoo "
    "best_practice/Qwen3"
)


def llama3_shape(billions: int) -> ModelConfig:
    """Llama 3 / 3.1's published shapes (the paper's Table 3): GQA with 8 K/V heads, vocabulary 128,256."""
    hidden, layers, heads, ffn = {8: (4096, 32, 32, 14336), 70: (8192, 80, 64, 28672), 405: (16384, 126, 128, 53248)}[
        billions
    ]
    return ModelConfig(
        name=f"llama3-{billions}b",
        vocab_size=LLAMA3_VOCAB,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=8,
        ffn_hidden=ffn,
        tie_embeddings=False,
    )


def qwen3_235b_shape() -> ModelConfig:
    """Qwen3-235B-A22B (its config.json): 94 layers of hidden 4096, 64 query heads of 128 over 4 kv heads,
    QK-norm, every MLP 128 SwiGLU experts of width 1536 with 8 routed per token."""
    return ModelConfig(
        name="qwen3-235b-a22b",
        vocab_size=151_936,
        hidden=4096,
        layers=94,
        heads=64,
        kv_heads=4,
        head_dim=128,
        qk_norm=True,
        ffn_hidden=12288,
        max_seq_len=40960,
        tie_embeddings=False,
        moe=MoEConfig(experts=128, top_k=8, ffn_hidden=1536, router="softmax", norm_topk_prob=True),
    )


# Grand Teton's H100 at its 500 W limit: the tensor cores' sustained rate as a fraction of the 989 TFLOP/s an
# H100 SXM reaches at 700 W, fitted on torchtitan's compiled 8B row (``fit_grand_teton_clock``).
GRAND_TETON_CLOCK = 0.79


def grand_teton(clock: float = GRAND_TETON_CLOCK) -> Hardware:
    """torchtitan's benchmark hosts: H100 with 96 GB of HBM2e (2.4 TB/s), 8 on NVLink, 400 Gb/s per GPU."""
    h100 = HARDWARE["h100-80gb"]
    return dataclasses.replace(
        h100, name="h100-96gb-500w", peak_flops=h100.peak_flops * clock, memory_bytes=94 * GIB, memory_bw=2.4e12
    )


# Eager PyTorch's element-wise passes beyond fused kernels, per op, (forward, backward), in [b, s, width]
# bf16-sized reads and writes (fp32 counts two): RMSNorm as torch's composite (cast up, square, mean, scale,
# weight, cast down: 20 forward, ~40 backward, against a fused kernel's 3 and 6); SwiGLU's silu and product over
# the MLP width (5 and 9 against 3 and 5); RoPE through complex numbers on q and k (cast, complex product, cast
# back: 10 and 10 against 2 and 2); attention's layout copies (the output's transpose, 2 and 2 over q's width,
# and GQA's repeat of k and v up to q's heads, 2 + 2 kv/q each way over q's width), which a fused kernel skips.
EAGER_PASSES = {"norm": (17, 34), "swiglu": (2, 4), "rope": (8, 8), "transpose": (2, 2)}


@dataclass(frozen=True)
class Engine:
    """What a published run's engine does beyond modelpar's step for the same strategy."""

    name: str
    rerun_matmuls: tuple[str, ...] = ()  # projections op-level checkpointing reruns in backward
    eager: bool = False  # element-wise ops unfused (EAGER_PASSES)
    ep_in_node: bool = False  # its rank order keeps each expert-parallel group in one node (NVLink)
    dropless: bool = False  # routes without a capacity: the step waits for the busiest experts (``dropless_excess``)


MODELPAR_LIKE = Engine("fused kernels")
TORCHTITAN_EAGER = Engine("torchtitan eager, op-level SAC", rerun_matmuls=("wk", "wo", "w3"), eager=True)
TORCHTITAN_COMPILED = Engine("torchtitan compiled, op-level SAC", rerun_matmuls=("wk", "wo", "w3"))
TORCHTITAN_FULL_AC = Engine("torchtitan eager, full AC", eager=True)
MEGATRON_MOE = Engine("Megatron-Core, EP group in a node, dropless", ep_in_node=True, dropless=True)


# Dropless routing's load imbalance. The same source's long-context table (Qwen3-235B-A22B, 256 H100, BF16, TP4,
# PP8 VPP4 EP8, CP so that each rank holds 16K tokens, GBS 256, DeepEP) gives TFLOP/s per GPU with the router
# forced to balance and dropless: (sequence, forced, dropless).
QWEN3_FORCED_VS_DROPLESS = [(16384, 295, 237), (32768, 335, 277), (65536, 368, 320), (131072, 389, 357)]


def routed_share(shape: ModelConfig, seq_len: int) -> float:
    """The routed experts' share of a step's model FLOPs."""
    experts = 6.0 * shape.layers * shape.moe.top_k * 3 * shape.hidden * shape.moe.ffn_hidden
    return experts / training_flops_per_token(shape, seq_len)


@functools.cache
def _dropless_excess_fit() -> tuple[float, float]:
    """(a, b) of ``dropless_excess``: least squares over ``QWEN3_FORCED_VS_DROPLESS``."""
    shape = qwen3_235b_shape()
    xs = [math.log2(s / 4096) for s, _, _ in QWEN3_FORCED_VS_DROPLESS]
    ys = [(forced / dropless - 1) / routed_share(shape, s) for s, forced, dropless in QWEN3_FORCED_VS_DROPLESS]
    x0, y0 = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - x0) * (y - y0) for x, y in zip(xs, ys, strict=True)) / sum((x - x0) ** 2 for x in xs)
    return y0 - b * x0, b


def dropless_excess(seq_len: int) -> float:
    """How much longer the routed experts take under dropless routing than balanced, as a fraction: ``a + b *
    log2(seq / 4096)``, each long-context row giving (forced / dropless - 1) / ``routed_share``. Within one
    sequence (one micro-batch) tokens of one document pick alike, so the excess grows with the sequence: the rows
    give 0.81 at 16K to 1.41 at 128K; the fit gives 0.43 at 4K, an extrapolation two doublings below them."""
    a, b = _dropless_excess_fit()
    return a + b * math.log2(seq_len / 4096)


def projection_params(shape: ModelConfig, name: str) -> int:
    h, q, kv = shape.hidden, shape.heads * shape.head_size, shape.kv_heads * shape.head_size
    return {
        "wq": h * q,
        "wk": h * kv,
        "wv": h * kv,
        "wo": q * h,
        "w1": h * shape.ffn_hidden,
        "w3": h * shape.ffn_hidden,
        "w2": shape.ffn_hidden * h,
    }[name]


def eager_passes(shape: ModelConfig, recompute: str) -> float:
    """[b, s, h] passes per layer eager PyTorch adds to a fused block; forwards counted again where checkpointing
    reruns them (op-level SAC reruns every element-wise op, full reruns everything)."""
    h = shape.hidden
    q = shape.heads * shape.head_size
    kv = shape.kv_heads * shape.head_size
    widths = {"norm": 2.0, "swiglu": shape.ffn_hidden / h, "rope": (q + kv) / h, "transpose": q / h * 2 + 2 * kv / h}
    reruns = 0 if recompute == "none" else 1
    return sum(w * (EAGER_PASSES[k][0] * (1 + reruns) + EAGER_PASSES[k][1]) for k, w in widths.items())


@dataclass(frozen=True)
class H100Run:
    """One published run on H100s: its layout as published plus ``assumed``'s choices, and the figure the source
    gives: model TFLOP/s per GPU (``tflops_per_gpu``), tokens/s per GPU (``tokens_per_gpu``) or seconds per step
    (``step_s``)."""

    name: str
    billions: int
    gpus: int
    tp: int
    cp: int
    pp: int
    vpp: int
    seq_len: int
    global_batch: int  # sequences
    micro_batch_size: int
    recompute: str
    zero: int
    where: str
    assumed: str
    tflops_per_gpu: float = 0.0
    tokens_per_gpu: float = 0.0
    step_s: float = 0.0
    recompute_modules: tuple[str, ...] = ("elementwise",)
    ep: int = 1
    engine: Engine = MODELPAR_LIKE
    platform: str = "h100-80gb"  # or grand-teton
    shape: ModelConfig | None = None  # None: llama3_shape(billions)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.cp * self.pp)

    @property
    def model(self) -> ModelSpec:
        return ModelSpec(self.shape or llama3_shape(self.billions), flash_attention=True)

    @property
    def hardware(self) -> Hardware:
        return grand_teton() if self.platform == "grand-teton" else HARDWARE[self.platform]

    @property
    def strategy(self) -> Strategy:
        layout = ParallelLayout(tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp, vpp=self.vpp, ep=self.ep)
        return Strategy(
            layout,
            self.micro_batch_size,
            self.global_batch // (self.dp * self.micro_batch_size),
            recompute=self.recompute,
            recompute_modules=self.recompute_modules,
            zero=self.zero,
            sp=self.tp > 1,
        )

    @property
    def figure(self) -> str:
        return "TFLOP/s/GPU" if self.tflops_per_gpu else "tokens/s/GPU" if self.tokens_per_gpu else "s/step"

    @property
    def published(self) -> float:
        return self.tflops_per_gpu or self.tokens_per_gpu or self.step_s


_LLAMA3_ASSUMED = "b1, vpp4, no recompute, ZeRO-2, SP, ring cp; model-FLOP convention"


def _llama3_405b(name: str, gpus: int, cp: int, seq_len: int, tflops: float) -> H100Run:
    return H100Run(
        name, 405, gpus, 8, cp, 16, 4, seq_len, 16 * 2**20 // seq_len, 1, "none", 2, "Table 4", _LLAMA3_ASSUMED, tflops
    )


LLAMA3_405B = [
    _llama3_405b("Llama 3 405B, 8K GPUs", 8192, 1, 8192, 430),
    _llama3_405b("Llama 3 405B, 16K GPUs", 16384, 1, 8192, 400),
    _llama3_405b("Llama 3 405B, 16K GPUs, 128K context", 16384, 16, 131072, 380),
]
_TITAN_8B = "seq 8192 (the page's MFU), FSDP = ZeRO-3; Grand Teton at 500 W"
TORCHTITAN_8B_COMPILED = H100Run(
    "Llama 3.1 8B, torchtitan FSDP + compile",
    8,
    8,
    1,
    1,
    1,
    1,
    8192,
    16,
    2,
    "selective",
    3,
    "torchtitan Table 1",
    _TITAN_8B + " (the clock's fit)",
    tokens_per_gpu=6667,
    engine=TORCHTITAN_COMPILED,
    platform="grand-teton",
)
TORCHTITAN_8B = dataclasses.replace(
    TORCHTITAN_8B_COMPILED,
    name="Llama 3.1 8B, torchtitan FSDP",
    assumed=_TITAN_8B,
    tokens_per_gpu=5762,
    engine=TORCHTITAN_EAGER,
)
TORCHTITAN_405B = H100Run(
    "Llama 3.1 405B, torchtitan FSDP x TP",
    405,
    128,
    8,
    1,
    1,
    1,
    8192,
    32,
    2,
    "full",
    3,
    "torchtitan 405B table",
    "seq 8192, FSDP = ZeRO-3, SP; Grand Teton at 500 W",
    tokens_per_gpu=109,
    engine=TORCHTITAN_FULL_AC,
    platform="grand-teton",
)
QWEN3_235B = H100Run(
    "Qwen3-235B-A22B, Megatron-Core (MoE)",
    235,
    256,
    2,
    1,
    32,
    3,
    4096,
    2048,
    1,
    "selective",
    0,
    "ModelZoo Qwen3, A2A row",
    "ep4 over dp4 for Megatron's ep8 over tp x dp; H100 SXM 700 W",
    step_s=24.2,
    ep=4,
    engine=MEGATRON_MOE,
    shape=qwen3_235b_shape(),
)
H100_RUNS = [*LLAMA3_405B, TORCHTITAN_8B_COMPILED, TORCHTITAN_8B, TORCHTITAN_405B, QWEN3_235B]


def engine_extra_s(run: H100Run, hardware: Hardware, costs: CostModel, prediction: Prediction) -> float:
    """Seconds per step the run's engine adds on the busiest rank: rerun projections at the planner's matmul rate,
    eager element-wise passes at the HBM bandwidth, the all-to-alls where its rank order puts them."""
    shape, s = run.model.shape, run.strategy
    layers = shape.layers / run.pp
    tokens = s.micro_batch_size * run.seq_len / run.cp * s.micro_batches
    rerun = sum(projection_params(shape, name) for name in run.engine.rerun_matmuls)
    seconds = 2.0 * tokens * rerun / run.tp * layers / (hardware.peak_flops * costs.efficiency)
    if run.engine.ep_in_node and prediction.ep_comm_s:  # NVLink instead of the span of modelpar's rank order
        nvlink = dataclasses.replace(hardware, inter_node_bw=hardware.intra_node_bw)
        ratio = ep_comm_per_layer_s(run.model, s, nvlink, run.seq_len) / ep_comm_per_layer_s(
            run.model, s, hardware, run.seq_len
        )
        seconds -= (1 - ratio) * prediction.ep_comm_s
    if run.engine.eager:
        nbytes = tokens * shape.hidden * hardware.weight_bytes / run.tp  # SP: norms split too
        seconds += layers * eager_passes(shape, run.recompute) * nbytes / hardware.memory_bw
    return seconds


def predicted_h100(run: H100Run, hardware: Hardware | None = None) -> tuple[Prediction, float]:
    """The planner's prediction of ``run``'s strategy on its hardware, default costs (not fitted), and the step
    with the run's engine's own extra work (``engine_extra_s``)."""
    hardware = hardware or run.hardware
    costs = CostModel()
    p = predict(run.strategy, run.model, hardware, seq_len=run.seq_len, costs=costs)
    step_s = p.total_s + engine_extra_s(run, hardware, costs, p)
    if run.engine.dropless:  # as the forced / dropless rows relate: the step by 1 + excess x routed share
        step_s *= 1 + dropless_excess(run.seq_len) * routed_share(run.model.shape, run.seq_len)
    return p, step_s


def h100_residual(run: H100Run, hardware: Hardware | None = None) -> tuple[float, float]:
    """(predicted, residual) of the figure the source gives."""
    p, step_s = predicted_h100(run, hardware)
    if run.tflops_per_gpu:
        predicted = p.model_flops_per_step / step_s / run.gpus / 1e12
    elif run.tokens_per_gpu:
        predicted = run.global_batch * run.seq_len / step_s / run.gpus
    else:
        predicted = step_s
    return predicted, predicted / run.published - 1


def fit_grand_teton_clock(run: H100Run = TORCHTITAN_8B_COMPILED) -> float:
    """The clock fraction at which ``run`` is predicted exactly (bisection; the prediction rises with it)."""
    lo, hi = 0.3, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if h100_residual(run, grand_teton(mid))[1] < 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
