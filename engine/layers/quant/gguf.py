"""GGUF Q4_0, Q4_1 and Q8_0 linear layers, kept quantized (llama.cpp's blocks of 32 input features):

    Q4_0  [d fp16][16 bytes: q_i low nibbles i = 0..15, high nibbles i = 16..31]   w = (q - 8) * d
    Q4_1  [d fp16][m fp16][16 bytes, as Q4_0]                                      w = q * d + m
    Q8_0  [d fp16][32 int8]                                                        w = q * d

Each row of a GGUF tensor is one output feature's blocks, so the checkpoint tensor is (N, K/32 * B) bytes
and shards along N (rows) and K (whole blocks) as a dense weight does. Q4 types are re-laid into the
kernels' int4 layout (Q4_1's m as float offsets); Q8_0 keeps int8 rows and dequantizes for the dense GEMM
(kernels/int8_dequant.py). The products are exact in fp32: the dense weight equals gguf's dequantization. A MoE's
expert stacks of these types, and of Q4_K and Q6_K, stay quantized too (engine/layers/moe.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import LinearBase
from engine.layers.quant.base import Axis, LinearMethod, tensor
from engine.layers.quant.int4 import Int4Method
from kernels import _backend
from kernels.int4_dequant import Int4Weight
from kernels.int8_dequant import Int8Weight, int8_dequant, int8_dequant_reference

BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
# the types a MoE's expert stacks keep: (weights, bytes) a block; the K-quants' super-blocks hold 256 weights
EXPERT_BLOCKS = {**{t: (BLOCK, b) for t, b in BLOCK_BYTES.items()}, "Q4_K": (256, 144), "Q6_K": (256, 210)}


def _blocks(layer: LinearBase, qtype: str) -> torch.Tensor:  # (N, K/32, B) uint8
    raw = tensor(layer, "qweight")
    return raw.view(raw.shape[0], -1, BLOCK_BYTES[qtype])


def _fp16(raw: torch.Tensor) -> torch.Tensor:  # (..., 2) uint8 -> (...) fp16
    return raw.contiguous().view(torch.float16).squeeze(-1)


class GGUFMethod(LinearMethod):
    def __init__(self, qtype: str) -> None:
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"GGUF type {qtype} is dequantized at load, not kept quantized")
        self.qtype = qtype

    def create_weights(self, layer: LinearBase) -> None:
        k, n = layer.input_size, layer.output_size
        if k % BLOCK:
            raise ValueError(f"GGUF blocks hold 32 input features; this layer has {k}")
        b = BLOCK_BYTES[self.qtype]
        self.add_param(layer, "qweight", (n, k // BLOCK * b), torch.uint8, Axis(0), Axis(1, BLOCK, b))


def unpack_q4(blocks: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 blocks (..., N, K/32, B) as the kernels' rows layout, over any leading dims: qweight (..., K/8, N)
    int32, scales (..., K/32, N) fp16, zeros (..., K/32, N): Q4_0's zero point 8 (uint8), Q4_1's offsets m (fp16)."""
    lead = blocks.shape[:-2]
    scales = _fp16(blocks[..., 0:2])  # (..., N, K/32)
    qs = blocks[..., -16:].reshape(*lead, -1, 8, 2)  # byte i: element i (low nibble), element i + 16 (high)
    low = (qs[..., 0] & 0xF) | (qs[..., 1] << 4)  # (..., N, K/32, 8): elements 2b, 2b + 1 of 0..15
    high = (qs[..., 0] >> 4) | (qs[..., 1] & 0xF0)  # the same of 16..31
    words = torch.cat([low, high], dim=-1).contiguous().view(torch.int32).view(*lead, -1)  # (..., N, K/8)
    if qtype == "Q4_1":
        zeros = _fp16(blocks[..., 2:4]).transpose(-1, -2)  # offsets m
    else:
        zeros = torch.full(scales.transpose(-1, -2).shape, 8, dtype=torch.uint8, device=scales.device)
    qweight = words.transpose(-1, -2).contiguous()  # the kernels' rows-packed words
    return qweight, scales.transpose(-1, -2).contiguous(), zeros.contiguous()


def unpack_q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks (..., N, K/256, 144: d, dmin fp16, 12 bytes of 6-bit scales and mins, 128 of nibbles) as the
    rows layout in groups of 32: qweight (..., K/8, N) int32, scales d * sc and offsets -dmin * m, (..., K/32, N)
    fp32 (exact products, so q * s + z is llama.cpp's d * sc * q - dmin * m)."""
    lead, supers = blocks.shape[:-3], blocks.shape[-2]
    d, dmin = _fp16(blocks[..., 0:2]).float(), _fp16(blocks[..., 2:4]).float()  # (..., N, K/256)
    # bytes 0-3: sub-blocks 0-3's scales (6 bits) and 4-7's scales' top 2 bits; 4-7: the same of the mins; 8-11:
    # sub-blocks 4-7's scales' low 4 bits and mins' low 4 bits
    low, mid, high = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    sc = torch.cat([low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)], dim=-1)  # (..., N, K/256, 8)
    mins = torch.cat([mid & 0x3F, (high >> 4) | ((mid >> 2) & 0x30)], dim=-1)
    scales = (d[..., None] * sc.float()).flatten(-2)  # (..., N, K/32)
    offsets = -(dmin[..., None] * mins.float()).flatten(-2)
    # byte b of chunk c holds weights 64c + b (low nibble) and 64c + 32 + b (high)
    qs = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 32)
    q = torch.stack([qs & 0xF, qs >> 4], dim=-2).reshape(*lead, blocks.shape[-3], -1)  # (..., N, K) 0..15
    assert q.shape[-1] == supers * 256
    return _rows_layout(q), scales.transpose(-1, -2).contiguous(), offsets.transpose(-1, -2).contiguous()


def unpack_q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K super-blocks (..., N, K/256, 210: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d
    fp16) as int8 rows q - 32 (..., N, K) and scales d * sc (..., N, K/16) fp32 (exact products, as llama.cpp's)."""
    lead = blocks.shape[:-1]
    ql = blocks[..., 0:128].reshape(*lead, 2, 64)  # weights 128a + 64s + b: nibble s of byte 64a + b
    qh = blocks[..., 128:192].reshape(*lead, 2, 32)  # weights 128a + 32s + b: bits 2s..2s+1 of byte 32a + b
    low = torch.stack([ql & 0xF, ql >> 4], dim=-2).reshape(*lead, 256)
    high = torch.stack([(qh >> (2 * s)) & 0x3 for s in range(4)], dim=-2).reshape(*lead, 256)
    q = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).flatten(-2)  # (..., N, K)
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float()  # (..., N, K/256, 16)
    scales = (_fp16(blocks[..., 208:210]).float()[..., None] * sc).flatten(-2)  # (..., N, K/16)
    return q, scales


def _rows_layout(q: torch.Tensor) -> torch.Tensor:
    """Values 0..15 (..., N, K) as the kernels' rows-packed words (..., K/8, N): row 8r + j in bits 4j.. of word r."""
    pairs = q.to(torch.uint8).reshape(*q.shape[:-1], -1, 4, 2)  # (..., N, K/8, 4, 2): rows 8r + 2b + h
    words = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous().view(torch.int32).squeeze(-1)  # (..., N, K/8)
    return words.transpose(-1, -2).contiguous()


def unpack_q8(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks (..., N, K/32, 34) as int8 rows (..., N, K) and their scales (..., N, K/32) fp16."""
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(*blocks.shape[:-2], -1)
    return q, _fp16(blocks[..., 0:2]).contiguous()


class GGUFInt4Method(GGUFMethod, Int4Method):
    """Q4_0 / Q4_1: the int4 kernel."""

    def process_weights(self, layer: LinearBase) -> None:
        qweight, scales, zeros = unpack_q4(_blocks(layer, self.qtype), self.qtype)
        self.install(layer, Int4Weight(qweight, scales, zeros, BLOCK))


class GGUFInt8Method(GGUFMethod):
    """Q8_0: int8 rows, dequantized for the dense GEMM."""

    weight: Int8Weight | None = None

    def process_weights(self, layer: LinearBase) -> None:
        q, scales = unpack_q8(_blocks(layer, self.qtype))
        del layer.qweight
        layer.register_parameter("qweight", nn.Parameter(q, requires_grad=False))
        layer.register_parameter("scales", nn.Parameter(scales, requires_grad=False))
        self.weight = Int8Weight(tensor(layer, "qweight"), tensor(layer, "scales"), BLOCK)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = self.weight
        assert w is not None, "process_weights has not run"
        if x.device.type == "cpu" and not _backend.use_triton(x):
            return F.linear(x, self.cpu_dense(lambda dtype: int8_dequant_reference(w, dtype), x.dtype), bias)
        return F.linear(x, int8_dequant(w, x.dtype), bias)
