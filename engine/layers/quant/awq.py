"""AWQ checkpoints, GEMM layout (AutoAWQ's WQLinear_GEMM, what vLLM's `awq` loads):

    qweight (K, N/8) int32   8 output columns per word, in AWQ_ORDER (engine/layers/quant/packing.py)
    qzeros  (K/G, N/8) int32 zero points, packed the same way
    scales  (K/G, N) fp16                      w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]

Re-laid at load into the kernels' rows-packed layout.
"""

from __future__ import annotations

import torch

from engine.layers.linear import LinearBase
from engine.layers.quant.base import Axis, tensor
from engine.layers.quant.config import QuantConfig
from engine.layers.quant.int4 import Int4Method
from engine.layers.quant.packing import AWQ_ORDER, pack_rows, unpack_cols
from kernels.int4_dequant import Int4Weight


class AWQLinearMethod(Int4Method):
    def __init__(self, config: QuantConfig) -> None:
        self.config = config

    def create_weights(self, layer: LinearBase) -> None:
        k, n = layer.input_size, layer.output_size
        g = group_size(self.config, layer)
        if n % 8:
            raise ValueError(f"AWQ packs 8 output features per int32; this layer has {n}")
        self.group = g
        self.add_param(layer, "qweight", (k, n // 8), torch.int32, Axis(1, 8), Axis(0))
        self.add_param(layer, "qzeros", (k // g, n // 8), torch.int32, Axis(1, 8), Axis(0, g))
        self.add_param(layer, "scales", (k // g, n), torch.float16, Axis(1), Axis(0, g))

    def process_weights(self, layer: LinearBase) -> None:
        q = unpack_cols(tensor(layer, "qweight"), AWQ_ORDER)  # (K, N)
        zeros = unpack_cols(tensor(layer, "qzeros"), AWQ_ORDER)  # (K/G, N)
        self.install(layer, Int4Weight(pack_rows(q, check=False), tensor(layer, "scales"), zeros, self.group))


def group_size(config: QuantConfig, layer: LinearBase) -> int:
    """The layer's group size; a row-parallel layer's rank must hold whole groups."""
    k = layer.input_size
    if config.group_size == -1 and layer.tp_dim == 1 and layer.tp_size > 1:
        raise ValueError("group_size -1 (one group per output) cannot be split across tensor-parallel ranks")
    g = config.group_for(k)
    if k % g:
        raise ValueError(f"{k} input features (this rank's) are not whole groups of {g}")
    return g
