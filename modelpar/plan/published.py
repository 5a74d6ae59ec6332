"""Published large-scale training runs the planner is checked against, and how it predicts each one.

Source: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
(SC21, arXiv:2104.04473), on NVIDIA Selene: DGX A100 nodes (8 x A100 80GB with NVLink, 8 x 200 Gb/s HDR
InfiniBand per node). GPT models, vocabulary 51,200, sequence 2048.

- ``TABLE_1``: the weak-scaling table (1.7B to 1T parameters). Columns: billions of parameters, heads,
  hidden, layers, tensor- and pipeline-parallel size, GPUs, global batch, achieved TFLOP/s per GPU (the
  paper's Eq. 3 FLOPs, which count full activation recomputation, over the measured iteration time).
  Every row's TFLOP/s x GPUs equals the table's aggregate PFLOP/s up to the rounding of the per-GPU figure
  (1T: 163 x 3072 = 501, printed 502), and every parameter count is the paper's Eq. 2 for its shape, to the
  table's one decimal. Not in the table: each run's micro-batch size and interleaving depth; the planner
  picks both itself.
- ``GPT3_175B``: the paper's end-to-end estimate for GPT-3 (96 layers, hidden 12288, 96 heads): 140 TFLOP/s
  per GPU on 1024 A100s at batch 1536, so 300B tokens take 34 days (its Eq. 4: 8 T P / (n X)). The paper does
  not give that run's tp/pp split, so the planner chooses the whole layout there.

Megatron-LM of 2021 all-reduced the data-parallel gradients after the last micro-batch's backward, without
overlap, and had neither ZeRO nor sequence parallelism: ``MEGATRON_2021`` and ``megatron_2021_space`` say so
to the planner. Its efficiency knob is the planner's default, not fitted to these rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelpar.model.config import ModelConfig
from modelpar.parallel.layout import ParallelLayout
from modelpar.plan import HARDWARE, CostModel, ModelSpec, SearchSpace, Strategy, plan
from modelpar.plan.spec import Prediction
from modelpar.plan.step_time import predict

SEQ_LEN = 2048
VOCAB = 51_200
SOURCE = "Narayanan et al. 2021, arXiv:2104.04473"
MEGATRON_2021 = CostModel(dp_overlap=0.0)


@dataclass(frozen=True)
class PublishedRun:
    """One published GPT training run on A100 80GB; ``tp``/``pp`` None where the source does not give them."""

    name: str
    billions: float
    heads: int
    hidden: int
    layers: int
    tp: int | None
    pp: int | None
    gpus: int
    global_batch: int
    tflops_per_gpu: float  # the source's figure (Eq. 3 FLOPs: full recomputation counted)
    where: str  # where in the source

    @property
    def model(self) -> ModelSpec:
        """The GPT block as a ModelConfig: a 4h GeLU MLP has the matmul FLOPs of a SwiGLU of width 8h/3."""
        shape = ModelConfig(
            name=f"gpt-{self.billions}b",
            vocab_size=VOCAB,
            hidden=self.hidden,
            layers=self.layers,
            heads=self.heads,
            kv_heads=self.heads,
            ffn_hidden=8 * round(self.hidden / 3),
            tie_embeddings=True,
        )
        return ModelSpec(shape, block="gpt")

    def paper_flops(self) -> float:
        """The paper's Eq. 3: FLOPs per iteration with full activation recomputation."""
        b, s, h, n_layers = self.global_batch, SEQ_LEN, self.hidden, self.layers
        return 96 * b * s * n_layers * h**2 * (1 + s / (6 * h) + VOCAB / (16 * n_layers * h))


_TABLE_1_ROWS = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
TABLE_1 = [PublishedRun(f"{row[0]}B", *row, where="Table 1") for row in _TABLE_1_ROWS]
GPT3_175B = PublishedRun("GPT-3 175B", 175.0, 96, 12288, 96, None, None, 1024, 1536, 140, where="sec. 5.1, Eq. 4")


def megatron_2021_space(run: PublishedRun) -> SearchSpace:
    """The run's layout where the source gives it; full recompute (which Eq. 3 counts), no ZeRO, no SP, and
    Megatron-LM's schedules of the time (1F1B, interleaved)."""
    dp = run.gpus // (run.tp * run.pp) if run.tp and run.pp else None
    return SearchSpace(
        tp=run.tp,
        pp=run.pp,
        dp=dp,
        max_vpp=8,
        recompute=("full",),
        zero=(0,),
        sp=(False,),
        schedules=("1f1b", "interleaved"),
    )


def predicted_tflops(run: PublishedRun) -> tuple[float, Strategy]:
    """Per-GPU TFLOP/s (Eq. 3 over the predicted step) of the planner's best strategy within
    ``megatron_2021_space``, on the planner's A100 80GB preset; and that strategy."""
    best = plan(
        run.model,
        HARDWARE["a100-80gb"],
        gpus=run.gpus,
        global_batch=run.global_batch,
        seq_len=SEQ_LEN,
        costs=MEGATRON_2021,
        space=megatron_2021_space(run),
    )[0]
    return run.paper_flops() / best.prediction.total_s / run.gpus / 1e12, best.strategy


# -- H100 runs -------------------------------------------------------------------------------------------------
#
# Dubey et al. 2024, "The Llama 3 Herd of Models" (arXiv:2407.21783), Table 4: Llama 3 405B pretraining on up
# to 16,384 H100 SXM 80GB (700 W, NVLink within a server of 8, 400 Gb/s RoCE between GPUs), 16M-token batches,
# tp8 pp16, BF16 TFLOP/s per GPU 430 / 400 at sequence 8192 (dp 64 / 128) and 380 at 131,072 with cp16 (dp 8).
# The same three rows (GPUs, tp, cp, pp, tokens per batch, TFLOP/s per GPU) are restated from the authors' SC'24
# slides at https://glennklockwood.com/garden/llama-3.1 (where the figures here were checked; that page does not
# give the sequence lengths, taken as the paper's 8K pretraining and 128K long-context stages, the only ones it has).
# Not stated there, so assumed (and listed per run in ``assumed``): the micro-batch (1 sequence), the
# interleaving depth (4 chunks per stage: 126 layers = 16 stages of 8 with one fewer on the first and last),
# no activation recompute, data parallelism sharding gradients and optimizer state but not the weights (ZeRO-2),
# sequence parallelism, ring context parallelism; and that the paper's TFLOP/s count model FLOPs as
# ``modelpar.model.flops`` does (attention's score and value matmuls over the whole sequence).
#
# torchtitan's docs/performance.md (github.com/pytorch/torchtitan), Table 1: Llama 3.1 8B on 8 H100 (96 GB HBM2e,
# 2.4 TB/s, 500 W power limit), FSDP 8, local batch 2, global 16, selective activation checkpointing, 5,762
# tokens/s per GPU without torch.compile. Sequence length not in the table (torchtitan's default, 8192, assumed).

LLAMA3_VOCAB = 128_256
H100_SOURCE = "Dubey et al. 2024, arXiv:2407.21783 (Table 4); torchtitan docs/performance.md (Table 1)"


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


@dataclass(frozen=True)
class H100Run:
    """One published Llama run on H100s, its layout as published plus ``assumed``'s choices, and the figure the
    source gives: model TFLOP/s per GPU (``tflops_per_gpu``) or tokens/s per GPU (``tokens_per_gpu``)."""

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
    recompute_modules: tuple[str, ...] = ("elementwise",)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.cp * self.pp)

    @property
    def model(self) -> ModelSpec:
        return ModelSpec(llama3_shape(self.billions), flash_attention=True)

    @property
    def strategy(self) -> Strategy:
        layout = ParallelLayout(tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp, vpp=self.vpp)
        return Strategy(
            layout,
            self.micro_batch_size,
            self.global_batch // (self.dp * self.micro_batch_size),
            recompute=self.recompute,
            recompute_modules=self.recompute_modules,
            zero=self.zero,
            sp=self.tp > 1,
        )


_LLAMA3_ASSUMED = "b1, vpp4, no recompute, ZeRO-2, SP, ring cp; model-FLOP convention"
LLAMA3_405B = [
    H100Run("Llama 3 405B, 8K GPUs", 405, 8192, 8, 1, 16, 4, 8192, 2048, 1, "none", 2, "Table 4", _LLAMA3_ASSUMED, 430),
    H100Run(
        "Llama 3 405B, 16K GPUs", 405, 16384, 8, 1, 16, 4, 8192, 2048, 1, "none", 2, "Table 4", _LLAMA3_ASSUMED, 400
    ),
    H100Run(
        "Llama 3 405B, 16K GPUs, 128K context",
        405,
        16384,
        8,
        16,
        16,
        4,
        131072,
        128,
        1,
        "none",
        2,
        "Table 4",
        _LLAMA3_ASSUMED,
        380,
    ),
]
TORCHTITAN_8B = H100Run(
    "Llama 3.1 8B, torchtitan FSDP",
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
    "seq 8192, selective = the cheap element-wise ops, ZeRO-3 (FSDP2); H100 80GB preset for a 500 W H100 96GB",
    tokens_per_gpu=5762,
)
H100_RUNS = [*LLAMA3_405B, TORCHTITAN_8B]


def predicted_h100(run: H100Run) -> Prediction:
    """The planner's prediction of ``run``'s strategy on its H100 80GB preset, default costs (not fitted)."""
    return predict(run.strategy, run.model, HARDWARE["h100-80gb"], seq_len=run.seq_len)


def h100_residual(run: H100Run) -> tuple[float, float]:
    """(predicted, residual) of the figure the source gives: model TFLOP/s or tokens/s per GPU."""
    p = predicted_h100(run)
    if run.tflops_per_gpu:
        predicted = p.model_flops_per_step / p.total_s / run.gpus / 1e12
        return predicted, predicted / run.tflops_per_gpu - 1
    predicted = p.tokens_per_s / run.gpus
    return predicted, predicted / run.tokens_per_gpu - 1
