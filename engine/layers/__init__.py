"""Model building blocks; each parameter loads itself through its `weight_loader`."""

from engine.layers.embedding import ParallelLMHead, QuantizedLMHead, VocabParallelEmbedding
from engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
)
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "QuantizedLMHead",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "default_weight_loader",
]
