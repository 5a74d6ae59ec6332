"""Shared by the model tests: tiny model shapes, a batch, and the single-device reference to compare against."""

from __future__ import annotations

import torch

from modelpar import ParallelLayout
from modelpar.model.config import ModelConfig
from modelpar.model.transformer import ModelChunk

BATCH, SEQ = 2, 8
SEED = 1234

# Odd vocabularies (not divisible by 2 or 4); kv heads sharded (kv % tp == 0) and replicated (kv < tp).
CONFIGS = {
    "mha-untied": ModelConfig(
        vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=4, ffn_hidden=40, max_seq_len=16, init_std=0.2
    ),
    "gqa-kv2-tied": ModelConfig(
        vocab_size=50,
        hidden=32,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn_hidden=24,
        max_seq_len=16,
        init_std=0.2,
        tie_embeddings=True,
    ),
    "gqa-kv1-untied": ModelConfig(
        vocab_size=53, hidden=16, layers=2, heads=4, kv_heads=1, ffn_hidden=20, max_seq_len=16, init_std=0.2
    ),
    "gqa-q8-kv4-tied": ModelConfig(
        vocab_size=77,
        hidden=48,
        layers=2,
        heads=8,
        kv_heads=4,
        ffn_hidden=36,
        max_seq_len=16,
        init_std=0.2,
        tie_embeddings=True,
    ),
    # Qwen3-style: QK-norm and a head width of its own (12, not hidden/heads = 4); one kv head, replicated at tp > 1
    "qknorm-hd12-kv1": ModelConfig(
        vocab_size=53,
        hidden=16,
        layers=2,
        heads=4,
        kv_heads=1,
        head_dim=12,
        qk_norm=True,
        ffn_hidden=20,
        max_seq_len=16,
        init_std=0.2,
    ),
    # a sliding window of 3 on layer 0, full attention on layer 1 (local and global layers)
    "window3-local-global": ModelConfig(
        vocab_size=61,
        hidden=32,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn_hidden=40,
        max_seq_len=16,
        init_std=0.2,
        sliding_window=3,
        window_layers=[0],
    ),
}


def layout_for(tp: int) -> ParallelLayout:
    """Every test runs on the one warm 4-rank pool; ranks 0..tp-1 form the first tp group."""
    return ParallelLayout(tp=tp, dp=4 // tp)


def batch(config: ModelConfig, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, targets: [BATCH, SEQ]; a few targets are -100 (ignored by the loss)."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g)
    targets[0, :3] = -100
    targets[1, -1] = -100
    return ids, targets


def pieces(chunk: ModelChunk, what: str = "grad") -> dict[str, tuple[tuple[slice, ...], bool, torch.Tensor]]:
    """This rank's ``(index, primary, local value or gradient)`` of every logical tensor (picklable)."""
    out = {}
    for name, shard in chunk.logical_shards().items():
        value = shard.grad if what == "grad" else shard.tensor
        out[name] = (shard.index, shard.primary, value.detach().clone())
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """max |got - want| relative to max |scale| (default: ``want``)."""
    scale = want if scale is None else scale
    return ((got - want).abs().max() / scale.abs().max().clamp_min(1e-30)).item()


def check_pieces(per_rank: list[dict], reference: dict[str, torch.Tensor], tol: float) -> float:
    """Every rank's piece of every logical tensor matches the reference; pieces tile each tensor, primaries once.

    Returns the largest relative error seen.
    """
    worst = 0.0
    assert all(set(p) == set(reference) for p in per_rank), "ranks hold different logical tensors than the reference"
    for name, want in reference.items():
        primaries = torch.zeros(want.shape, dtype=torch.int64)
        for rank, rank_pieces in enumerate(per_rank):
            index, primary, got = rank_pieces[name]
            err = rel_err(got, want[index], scale=want)
            assert err <= tol, f"{name} on tp rank {rank}: relative error {err:.3g} > {tol}"
            worst = max(worst, err)
            primaries[index] += int(primary)
        assert bool((primaries == 1).all()), f"{name}: primary pieces do not tile the global tensor exactly once"
    return worst


# The token ids the Hugging Face Llama fixture (tests/model/conftest.py) is evaluated on.
HF_IDS = torch.tensor([[3, 17, 60, 0, 42, 9, 9, 31], [59, 1, 2, 44, 12, 37, 50, 8]])
