"""Tensor-parallel layers: each holds this rank's shard of its weights and names the logical tensors."""

from modelpar.model.layers.attention import DocumentIds, ParallelAttention
from modelpar.model.layers.embedding import VocabParallelEmbedding, padded_vocab_size, vocab_range
from modelpar.model.layers.latent_attention import LatentAttention
from modelpar.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from modelpar.model.layers.loss import IGNORE_INDEX, VocabParallelCrossEntropy, vocab_parallel_loss
from modelpar.model.layers.mlp import ParallelSwiGLU
from modelpar.model.layers.norm import RMSNorm
from modelpar.model.layers.shard import ColumnPart, ShardInfo

__all__ = [
    "IGNORE_INDEX",
    "ColumnParallelLinear",
    "ColumnPart",
    "DocumentIds",
    "LatentAttention",
    "ParallelAttention",
    "ParallelSwiGLU",
    "RMSNorm",
    "RowParallelLinear",
    "ShardInfo",
    "VocabParallelEmbedding",
    "padded_vocab_size",
    "vocab_range",
    "VocabParallelCrossEntropy",
    "vocab_parallel_loss",
]
