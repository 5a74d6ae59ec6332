"""Tensor-parallel layers: each holds this rank's shard of its weights and names the logical tensors."""

from modelpar.layers.attention import ParallelAttention
from modelpar.layers.embedding import VocabParallelEmbedding, padded_vocab_size, vocab_range
from modelpar.layers.linear import ColumnParallelLinear, RowParallelLinear
from modelpar.layers.loss import IGNORE_INDEX, vocab_parallel_loss
from modelpar.layers.mlp import ParallelSwiGLU
from modelpar.layers.norm import RMSNorm
from modelpar.layers.shard import ColumnPart, ShardInfo

__all__ = [
    "IGNORE_INDEX",
    "ColumnParallelLinear",
    "ColumnPart",
    "ParallelAttention",
    "ParallelSwiGLU",
    "RMSNorm",
    "RowParallelLinear",
    "ShardInfo",
    "VocabParallelEmbedding",
    "padded_vocab_size",
    "vocab_range",
    "vocab_parallel_loss",
]
