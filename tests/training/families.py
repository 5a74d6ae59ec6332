"""The model families the engine trains, each as a tiny model, and one way to train any of them on one device:
what the golden loss curves and the independent-trainer tests share."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from modelpar.model.config import MLAConfig, ModelConfig, MoEConfig
from modelpar.model.rope import RopeScaling
from modelpar.model.structure import BlockStructure
from modelpar.training.config import DataConfig, OptimConfig, ParallelConfig, TrainConfig, TrainerConfig

VOCAB = 64
_BASE = ModelConfig(
    name="family-test", vocab_size=VOCAB, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=48, max_seq_len=16,
    rope_theta=500.0, init_std=0.1,
)  # fmt: skip
_MIXTURE = MoEConfig(experts=4, top_k=2, ffn_hidden=24)
# Gemma's sandwich of (1 + weight) norms, GeGLU, scaled embedding and query_pre_attn_scalar; one local layer
# (a window shorter than the sequence) and one global
_GEMMA = BlockStructure(norm="sandwich", norm_offset=1.0, activation="geglu", embedding_scale=True, query_scale=10.0)

# family -> tiny model; each exercises what makes the family what it is
FAMILIES: dict[str, ModelConfig] = {
    "llama": _BASE,
    "mistral": replace(_BASE, sliding_window=5),  # shorter than the sequence: the window masks keys
    "mixtral": replace(_BASE, moe=_MIXTURE),
    "qwen3": replace(_BASE, qk_norm=True, head_dim=12, tie_embeddings=True),
    "qwen3_moe": replace(_BASE, qk_norm=True, head_dim=12, moe=replace(_MIXTURE, layers=[1], norm_topk_prob=False)),
    "deepseek_v3": replace(
        _BASE, kv_heads=4,
        mla=MLAConfig(kv_lora_rank=12, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
        moe=MoEConfig(
            experts=4, top_k=2, ffn_hidden=16, shared_experts=1, router="sigmoid", n_group=2, topk_group=1,
            routed_scaling_factor=2.5, first_k_dense_replace=1, bias_update_rate=0.05,
        ),
        mtp_depth=1,
    ),
    "qwen2": replace(_BASE, attention_bias=True),
    "olmo2": replace(_BASE, qk_norm=True, block=BlockStructure(norm="post", qk_norm_scope="projection")),
    "gemma3": replace(
        _BASE, head_dim=12, qk_norm=True, tie_embeddings=True, sliding_window=5, window_layers=[0],
        block=replace(_GEMMA, local_rope_theta=20.0),
    ),
    # caps low enough that this tiny model's scores and logits reach them
    "gemma2": replace(
        _BASE, head_dim=12, tie_embeddings=True, sliding_window=5, window_layers=[0],
        block=replace(_GEMMA, attention_softcap=1.0, final_softcap=1.5),
    ),
    "gpt_oss": replace(
        _BASE, head_dim=8, attention_bias=True, attention_out_bias=True, sliding_window=5, window_layers=[0],
        rope_scaling=RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=4, truncate=False),
        moe=MoEConfig(
            experts=4, top_k=2, ffn_hidden=16, bias=True, activation="clamped_swiglu", swiglu_limit=0.5
        ),  # a clamp low enough that the gates and ups reach it
        block=BlockStructure(attention_sinks=True),
    ),
}  # fmt: skip


def token_file(directory: Path) -> str:
    """A fixed random token file (the same on every machine: numpy's PCG64 stream is specified)."""
    path = directory / "family-tokens.npy"
    if not path.exists():
        np.save(path, np.random.default_rng(1234).integers(0, VOCAB, size=6000, dtype=np.uint16))
    return str(path)


def family_config(model: ModelConfig, out_dir: Path, steps: int, optim: OptimConfig | None = None) -> TrainConfig:
    """One device, two micro-batches of two sequences of 16 tokens."""
    return TrainConfig(
        model=model,
        parallel=ParallelConfig(microbatches=2),
        optim=optim or OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=3, grad_clip=1.0),
        data=DataConfig(seq_len=16, global_batch=4, seed=7),
        trainer=TrainerConfig(steps=steps, out_dir=str(out_dir), progress=False, timeout_s=120.0, ckpt_every=0),
    )


def train_families(configs: dict[str, TrainConfig], data_path: str, export_to: str | None = None) -> dict:
    """On one rank: train each config; per family its losses, and with ``export_to`` also the batches it trained
    on and its initial weights written as a transformers directory ``export_to/<family>``."""
    import torch

    from modelpar.model.hf import export_hf
    from modelpar.training.trainer import Trainer

    out = {}
    for family, cfg in configs.items():
        torch.manual_seed(cfg.trainer.seed)
        trainer = Trainer(cfg, data_path, None)
        batches = []
        if export_to is not None:
            export_hf(trainer.model.chunks[0], Path(export_to) / family)
            object.__setattr__(trainer.train_one, "tokens", _Recorder(trainer.train_one.tokens, batches))
        losses = [trainer.train_step().loss for _ in range(cfg.trainer.steps)]
        out[family] = {"losses": losses, "batches": batches}
    return out


class _Recorder:
    """The step's token source, keeping each batch it hands out."""

    def __init__(self, tokens, batches: list):
        self.tokens, self.batches = tokens, batches

    def batch(self, indices):
        self.batches.append(self.tokens.batch(indices))
        return self.batches[-1]

    def __getattr__(self, name):
        return getattr(self.tokens, name)
