"""GPTQ checkpoints (AutoGPTQ / GPTQModel, what vLLM's `gptq` and transformers load):

    qweight (K/8, N) int32   8 input rows per word: bits 4j.. of qweight[r, n] = q[8r + j, n]
    qzeros  (K/G, N/8) int32 zero points, 8 output columns per word in natural order, stored minus one
                             in the classic format (checkpoint_format "gptq"; "gptq_v2" stores them as they are)
    scales  (K/G, N) fp16
    g_idx   (K,) int32       the group of each input row: k // G, or any order with desc_act (act order)

    w[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]

With act order the rows are sorted by group at load (the kernel then reads x through the permutation).
"""

from __future__ import annotations

import torch

from engine.layers.linear import LinearBase
from engine.layers.quant.awq import group_size
from engine.layers.quant.base import Axis, tensor
from engine.layers.quant.config import QuantConfig
from engine.layers.quant.int4 import Int4Method, sorted_by_group
from engine.layers.quant.packing import NATURAL_ORDER, pack_rows, unpack_cols, unpack_rows
from kernels.int4_dequant import Int4Weight


class GPTQLinearMethod(Int4Method):
    def __init__(self, config: QuantConfig) -> None:
        self.config = config

    def create_weights(self, layer: LinearBase) -> None:
        k, n = layer.input_size, layer.output_size
        if self.config.desc_act and layer.tp_dim == 1 and layer.tp_size > 1:
            raise ValueError(
                "GPTQ act order (desc_act) is not supported on row-parallel layers split across ranks"
            )
        g = group_size(self.config, layer)
        if n % 8 or k % 8:
            raise ValueError(f"GPTQ packs 8 features per int32; this layer has {k} inputs, {n} outputs")
        self.group = g
        self.add_param(layer, "qweight", (k // 8, n), torch.int32, Axis(1), Axis(0, 8))
        self.add_param(layer, "qzeros", (k // g, n // 8), torch.int32, Axis(1, 8), Axis(0, g))
        self.add_param(layer, "scales", (k // g, n), torch.float16, Axis(1), Axis(0, g))
        self.add_param(layer, "g_idx", (k,), torch.int32, None, Axis(0))

    def process_weights(self, layer: LinearBase) -> None:
        zeros = unpack_cols(tensor(layer, "qzeros"), NATURAL_ORDER)  # (K/G, N)
        if self.config.zeros_minus_one:
            zeros = zeros + 1  # 1..16
        g_idx = tensor(layer, "g_idx")
        if layer.tp_dim == 1:  # a row-parallel rank's g_idx counts the groups of every rank
            g_idx = g_idx - layer.tp_rank * (layer.input_size // self.group)
        q, perm = sorted_by_group(unpack_rows(tensor(layer, "qweight")), g_idx, self.group, "GPTQ")
        qweight = tensor(layer, "qweight") if perm is None else pack_rows(q, check=False)
        self.install(layer, Int4Weight(qweight, tensor(layer, "scales"), zeros, self.group, perm))
