"""A toy language model cut into pipeline chunks: embedding, Linear+tanh residual blocks, head, cross-entropy.

Built whole from a seed on every rank (so every layout starts from the same weights); a rank then keeps
the chunks ``Partition`` assigns it. Parameter names are global (``block3.proj.weight``), so gradients
from any rank can be set beside the single-device model's.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from modelpar.pipeline.partition import Partition


@dataclass(frozen=True)
class ToyConfig:
    vocab: int = 11
    hidden: int = 8
    layers: int = 8
    batch: int = 3  # per micro-batch
    seq: int = 5
    seed: int = 0


class Block(nn.Module):
    """``x + tanh(x W^T + b)``; x: [b, s, h]."""

    def __init__(self, hidden: int):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x))


def build_layers(cfg: ToyConfig) -> OrderedDict[str, nn.Module]:
    """Every layer of the model in order, under its global name."""
    torch.manual_seed(cfg.seed)
    layers: OrderedDict[str, nn.Module] = OrderedDict(embed=nn.Embedding(cfg.vocab, cfg.hidden))
    for i in range(cfg.layers):
        layers[f"block{i}"] = Block(cfg.hidden)
    layers["head"] = nn.Linear(cfg.hidden, cfg.vocab)
    return layers


def chunk_modules(cfg: ToyConfig, partition: Partition, rank: int) -> list[nn.Sequential]:
    """The local chunks of ``rank``: model chunk c holds its blocks, plus the embedding (first) or head (last)."""
    layers = build_layers(cfg)
    chunks = []
    for c in partition.chunks_of(rank):
        names = (["embed"] if partition.has_embedding(c) else []) + [f"block{i}" for i in partition.layers(c)]
        names += ["head"] if partition.has_head(c) else []
        chunks.append(nn.Sequential(OrderedDict((n, layers[n]) for n in names)))
    return chunks


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; logits: [b, s, vocab], targets: [b, s]."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(cfg: ToyConfig, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and next-token targets, both [m, b, s] int64."""
    gen = torch.Generator().manual_seed(cfg.seed + 1000 + m)
    tokens = torch.randint(0, cfg.vocab, (m, cfg.batch, cfg.seq + 1), generator=gen)
    return tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()


def named_grads(chunks: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Gradients under global parameter names (``block3.proj.weight``)."""
    return {name: p.grad.detach().clone() for chunk in chunks for name, p in chunk.named_parameters()}


def count_accumulations(chunks: list[nn.Module]) -> Counter[str]:
    """A counter of gradient accumulations per parameter name, kept up to date by post-accumulate-grad hooks."""
    counts: Counter[str] = Counter()
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            p.register_post_accumulate_grad_hook(lambda _, name=name: counts.update([name]))
    return counts


def reference(cfg: ToyConfig, m: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the single-device model on the whole batch (all micro-batches at once)."""
    layers = build_layers(cfg)
    model = nn.Sequential(layers)
    tokens, targets = batch(cfg, m)
    loss = loss_fn(model(tokens.flatten(0, 1)), targets.flatten(0, 1))
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}
