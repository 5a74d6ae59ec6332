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
from modelpar.plan import HARDWARE, CostModel, ModelSpec, SearchSpace, Strategy, plan

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
