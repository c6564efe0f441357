"""Quantized linear layers against dequantize-then-matmul: AWQ, GPTQ (with and without act order) and GGUF
Q4_0 / Q4_1 / Q8_0 layers on the torch path over many shapes; the W4A16 GEMM (split-K and tiled) and the
dequantize kernels under Triton's interpreter; merged and tensor-parallel loading.

The reference weights come from tests/quant_formats.py (AutoAWQ's and AutoGPTQ's packing, written here)
and from the gguf package, never from engine code. Interpreter runs: fp32 and fp16 (its bf16 casts are not
the GPU's; tests/gpu covers bf16).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything here imports triton

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from triton.runtime.interpreter import InterpretedFunction

from engine.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    deferred_weights,
)
from engine.layers.quant import AWQLinearMethod, GGUFInt4Method, GGUFInt8Method, GPTQLinearMethod, QuantConfig
from engine.layers.quant.int4 import Int4Method
from kernels import _backend
from kernels.int4_dequant import Int4Weight, int4_dequant_reference, int4_dequant_triton
from kernels.int8_dequant import Int8Weight, int8_dequant_reference, int8_dequant_triton
from kernels.silu_and_mul import silu_and_mul_reference, silu_and_mul_triton
from kernels.w4a16_gemm import (
    GEMV_SWIGLU_BLOCK_N,
    GemmConfig,
    _w4a16_kernel,
    default_config,
    w4a16_gemm,
    w4a16_gemm_reference,
    w4a16_gemm_triton,
    w4a16_swiglu,
)
from tests.quant_formats import awq_dense, awq_tensors, gptq_dense, gptq_tensors, random_grid

assert isinstance(_w4a16_kernel, InterpretedFunction), "run the CPU kernel tests under TRITON_INTERPRET=1"


def make(cls: type[LinearBase], method, *args, **kwargs) -> LinearBase:
    with deferred_weights():
        layer = cls(*args, **kwargs)
    method.create_weights(layer)
    layer.quant_method = method
    return layer


def load(layer: LinearBase, tensors: dict[str, torch.Tensor], shard_id: object = None) -> None:
    params = dict(layer.named_parameters())
    for name, t in tensors.items():
        params[name].weight_loader(params[name], t, shard_id)


def checkpoint(
    fmt: str, k: int, n: int, group: int, seed: int = 0
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A random checkpoint layer in `fmt` and its dense (N, K) weight from the independent references."""
    rng = np.random.default_rng(seed)
    if fmt in ("Q4_0", "Q4_1", "Q8_0"):
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize, quantize

        qtype = GGMLQuantizationType[fmt]
        raw = quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype)
        return {"qweight": torch.from_numpy(raw)}, torch.from_numpy(dequantize(raw, qtype).reshape(n, k))
    if fmt == "awq":
        t = awq_tensors(*random_grid(k, n, group, rng))
        return t, awq_dense(t, group)
    q, zeros, scales = random_grid(k, n, group, rng, zero_low=1)
    g_idx = np.arange(k) // group
    if fmt == "gptq_act":
        g_idx = g_idx[rng.permutation(k)]
    t = gptq_tensors(q, zeros, scales, g_idx)
    return t, gptq_dense(t)


def method_for(fmt: str, group: int):
    if fmt == "awq":
        return AWQLinearMethod(QuantConfig("awq", group_size=group))
    if fmt in ("gptq", "gptq_act"):
        return GPTQLinearMethod(QuantConfig("gptq", group_size=group, desc_act=fmt == "gptq_act"))
    return GGUFInt8Method(fmt) if fmt == "Q8_0" else GGUFInt4Method(fmt)


# (K, N, group): odd output sizes for GGUF (any N), multiples of 8 for AWQ / GPTQ (their packing's)
SHAPES = {
    "awq": [(128, 72, 32), (256, 200, 64), (384, 136, 128)],
    "gptq": [(128, 72, 32), (256, 200, 64), (384, 136, 128)],
    "gptq_act": [(128, 72, 32), (256, 200, 128)],
    "Q4_0": [(64, 47, 32), (256, 101, 32)],
    "Q4_1": [(64, 47, 32), (256, 101, 32)],
    "Q8_0": [(64, 47, 32), (256, 101, 32)],
}
CASES = [(fmt, *shape) for fmt, shapes in SHAPES.items() for shape in shapes]


@pytest.mark.parametrize("fmt,k,n,group", CASES)
def test_layer_equals_dequantize_then_matmul(fmt, k, n, group):
    tensors, dense = checkpoint(fmt, k, n, group)
    layer = make(ColumnParallelLinear, method_for(fmt, group), k, n, bias=True)
    load(layer, tensors)
    layer.bias.data.normal_()
    layer.quant_method.process_weights(layer)
    for m in (1, 5, 33, 4096 if k == 128 else 300):  # batch 1 .. 4096 (the big one on a small weight)
        x = torch.randn(m, k)
        torch.testing.assert_close(layer(x), F.linear(x, dense, layer.bias), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["awq", "Q4_1", "Q8_0", "dense"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gate_up_swiglu_equals_silu_and_mul_of_the_layer(fmt, backend, monkeypatch):
    """gate_up_proj(x, swiglu=True), what LlamaMLP calls: silu(gate) * up of the layer's output on either path,
    for one row (fused on the Triton path) and several."""
    monkeypatch.setattr(_backend, "FORCED_BACKEND", backend)
    k, n, group = 256, 64, 32
    if fmt == "dense":
        layer = MergedColumnParallelLinear(k, [n, n])
        layer.weight.data = torch.randn(2 * n, k, dtype=torch.float16) / k**0.5
    else:
        layer = make(MergedColumnParallelLinear, method_for(fmt, group), k, [n, n])
        for part in (0, 1):
            load(layer, checkpoint(fmt, k, n, group, seed=part)[0], part)
        layer.quant_method.process_weights(layer)
    dtype = torch.float16 if fmt == "dense" else torch.float32
    for m in (1, 3):
        x = torch.randn(m, k, dtype=dtype)
        torch.testing.assert_close(
            layer(x, swiglu=True), silu_and_mul_reference(layer(x)), rtol=2e-3, atol=2e-3
        )


@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq_act"])
def test_int4_layout_dequantizes_to_the_checkpoint(fmt):
    tensors, dense = checkpoint(fmt, 256, 64, 64, seed=3)
    layer = make(ColumnParallelLinear, method_for(fmt, 64), 256, 64)
    load(layer, tensors)
    layer.quant_method.process_weights(layer)
    w = layer.quant_method.weight
    assert (w.perm is not None) == (fmt == "gptq_act")
    assert torch.equal(int4_dequant_reference(w), dense)
    assert torch.equal(int4_dequant_triton(w, torch.float32).t(), dense)  # the kernel, interpreted


# ---- the W4A16 kernel under the interpreter ------------------------------------------------------


def random_int4(
    k: int, n: int, group: int, offsets: bool = False, perm: bool = False, seed: int = 0
) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, generator=g)
    scales = (torch.rand(k // group, n, generator=g) * 0.02 + 0.001).half()
    if offsets:
        zeros = (torch.randn(k // group, n, generator=g) * 0.05).half()
    else:
        zeros = torch.randint(0, 17, (k // group, n), dtype=torch.uint8, generator=g)
    return Int4Weight(qweight, scales, zeros, group, torch.randperm(k, generator=g).int() if perm else None)


KERNEL_CASES = [  # (M, K, N, group, offsets, perm, bias, config)
    (1, 256, 72, 32, False, False, False, None),  # one row: the CUDA-core kernel
    (1, 1024, 64, 128, True, True, True, GemmConfig(1, 32, 4)),  # one row, split-K
    (3, 256, 64, 64, False, False, True, GemmConfig(1, 64, 2)),  # one-row tiles over several rows
    (1, 576, 40, 32, True, True, True, None),  # one row, K not a multiple of the tile (SmolLM2's hidden size)
    (2, 640, 72, 64, False, False, False, GemmConfig(1, 64, 4)),  # one-row tiles: 5 K tiles in 4 splits
    (3, 1024, 40, 128, True, True, True, GemmConfig(2, 32, 4, cuda_cores=True)),  # CUDA cores, 2-row tiles
    (4, 576, 72, 32, False, False, True, GemmConfig(4, 64, 2, cuda_cores=True)),  # 4 rows, K 4.5 tiles
    (1, 2048, 24, 128, False, True, True, GemmConfig(1, 16, 2, block_k=512)),  # long K tiles, 4 groups each
    (2, 1280, 40, 64, True, False, False, GemmConfig(2, 8, 1, block_k=1024, cuda_cores=True)),  # uneven
    (3, 384, 130, 128, True, False, True, None),
    (16, 512, 64, 64, False, True, False, None),
    (17, 256, 100, 128, False, False, True, None),
    (40, 128, 136, 32, True, True, False, None),
    (2, 1024, 40, 32, False, False, True, GemmConfig(16, 32, 4)),  # split-K: 8 K tiles in 4 splits
    (5, 640, 72, 128, True, False, False, GemmConfig(16, 64, 3)),  # uneven: 5 K tiles, 2 + 2 + 1
    (70, 256, 72, 64, False, True, True, GemmConfig(64, 32, 2)),  # split-K over several row tiles
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k,n,group,offsets,perm,bias,config", KERNEL_CASES)
def test_w4a16_kernel_matches_reference(m, k, n, group, offsets, perm, bias, config, dtype):
    w = random_int4(k, n, group, offsets, perm)
    x = torch.randn(m, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    out = w4a16_gemm_triton(x, w, b, config)
    ref = w4a16_gemm_reference(x.float(), w, None if b is None else b.float())
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-3, "atol": 5e-3}
    torch.testing.assert_close(out.float(), ref, **tol)


SWIGLU_CASES = [  # (K, N = 2 x outputs, group, offsets, perm, bias, config)
    (256, 144, 32, False, False, False, None),  # the one-row default
    (576, 80, 32, True, True, True, None),  # K not a multiple of the tile, 40 outputs: a partial program
    (1024, 48, 128, False, True, True, GemmConfig(1, 4, 1, block_k=256)),  # two outputs a program
    (2048, 64, 128, True, False, False, GemmConfig(1, 16, 1, num_warps=2, block_k=512)),  # 4 groups a tile
    (
        512,
        144,
        64,
        True,
        False,
        True,
        GemmConfig(1, GEMV_SWIGLU_BLOCK_N, 1),
    ),  # w4a16_swiglu's; 72 = 4.5 programs
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k,n,group,offsets,perm,bias,config", SWIGLU_CASES)
def test_w4a16_swiglu_equals_the_gemm_then_silu_and_mul(k, n, group, offsets, perm, bias, config, dtype):
    """gate_up's one-row GEMM with SwiGLU as its epilogue: the unfused kernels' output bit for bit (same tile),
    and the dequantized reference."""
    w = random_int4(k, n, group, offsets, perm)
    x = torch.randn(1, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    out = w4a16_gemm_triton(x, w, b, config, swiglu=True)
    assert out.shape == (1, n // 2) and out.dtype == dtype
    assert torch.equal(out, silu_and_mul_triton(w4a16_gemm_triton(x, w, b, config)))
    ref = silu_and_mul_reference(w4a16_gemm_reference(x.float(), w, None if b is None else b.float()))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-3, "atol": 5e-3}
    torch.testing.assert_close(out.float(), ref, **tol)


def test_w4a16_swiglu_fuses_one_row_and_runs_more_rows_unfused(monkeypatch):
    monkeypatch.setattr(_backend, "FORCED_BACKEND", "triton")
    w = random_int4(256, 64, 64)
    for m in (1, 3):
        x = torch.randn(m, 256)
        unfused = silu_and_mul_triton(w4a16_gemm_triton(x, w))
        assert torch.equal(w4a16_swiglu(x, w), unfused)
    calls = []
    monkeypatch.setattr("kernels.w4a16_gemm.w4a16_gemm_triton", lambda *a, **kw: calls.append(kw) or a[0])
    w4a16_swiglu(torch.randn(1, 256), w)
    w4a16_swiglu(torch.randn(3, 256), w)
    assert calls[0]["swiglu"] and calls[0]["config"].block_n == GEMV_SWIGLU_BLOCK_N and calls[1] == {}


SWAP_CASES = [  # (M, K, N, group, offsets, perm, bias, config): 16-bit x, groups a multiple of 128
    (2, 256, 72, 128, False, False, False, None),  # the default for 2..16 rows
    (3, 1024, 64, 128, True, True, True, GemmConfig(8, 32, 4, swap=True)),  # split-K, act order, offsets
    (5, 640, 136, 128, False, False, True, GemmConfig(8, 64, 3, swap=True)),  # uneven: 5 K tiles, 2 + 2 + 1
    (12, 512, 100, 256, False, True, False, None),  # 16-row tiles, a group of two K tiles
    (16, 384, 64, 128, True, False, False, GemmConfig(16, 64, 1, swap=True)),
]


@pytest.mark.parametrize("k_contiguous", [False, True])
@pytest.mark.parametrize("m,k,n,group,offsets,perm,bias,config", SWAP_CASES)
def test_swapped_kernel_matches_reference(m, k, n, group, offsets, perm, bias, config, k_contiguous):
    """The swapped kernel (x^T against the weights, nibble pairs as 16-bit magic + q) under the interpreter in
    fp16 (the interpreter's bf16 dots do not take bit-cast operands; tests/gpu runs bf16), on the packed
    layout as checkpoints give it and K-contiguous as loaded layers hold it."""
    w = random_int4(k, n, group, offsets, perm)
    if k_contiguous:
        w = dataclasses.replace(w, qweight=w.qweight.t().contiguous().t())
    x = torch.randn(m, k).half()
    b = torch.randn(n).half() if bias else None
    assert config is not None or default_config(m, n, k, x.device, group, x.dtype).swap
    out = w4a16_gemm_triton(x, w, b, config)
    ref = w4a16_gemm_reference(x.float(), w, None if b is None else b.float())
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=5e-3)


def test_loaded_int4_layers_hold_qweight_k_contiguous():
    class Installed(Int4Method):  # the formats' loading ends in install(); nothing else is needed here
        def create_weights(self, *args, **kwargs):
            raise NotImplementedError

        def process_weights(self, *args, **kwargs):
            raise NotImplementedError

    layer = torch.nn.Module()
    method = Installed()
    method.install(layer, random_int4(256, 64, 128))  # type: ignore[arg-type]
    assert method.weight is not None and method.weight.qweight.stride() == (1, 32)
    assert torch.equal(method.weight.qweight, random_int4(256, 64, 128).qweight)


@pytest.mark.parametrize(
    "k,n,group,offsets,perm",
    [(256, 40, 128, False, False), (256, 17, 64, True, False), (576, 100, 64, False, True), (512, 64, 256, True, True)],
)  # fmt: skip
def test_fragment_layout_dequantizes_as_the_rows_layout(k, n, group, offsets, perm):
    """The tensor-core kernel's layout (kernels/w4a16_mma.py): laid and read back it is the rows layout, and its
    dequantizing kernel (interpreted) writes the rows layout's dense weight bit for bit."""
    from kernels.int4_dequant import fragments_to_rows, to_fragments

    w = random_int4(k, n, group, offsets, perm, seed=k + n)
    f = to_fragments(w)
    assert f.layout == "fragments" and f.chunk == (128 if group % 128 == 0 else 64)
    assert f.qweight.shape == (-(-n // 16), k // 64, 32, 4)
    assert (f.in_features, f.out_features) == (k, n)
    assert torch.equal(fragments_to_rows(f).qweight, w.qweight)
    dense = int4_dequant_reference(w)
    assert torch.equal(int4_dequant_reference(f), dense)
    assert torch.equal(int4_dequant_triton(f, torch.float32).t(), dense)
    x = torch.randn(3, k)  # off the GPU, or in fp32, the GEMM dequantizes the fragments
    torch.testing.assert_close(w4a16_gemm(x, f), w4a16_gemm_reference(x, w), rtol=1e-5, atol=1e-5)


def test_fragment_layout_reads_the_mma_fragments_k_order():
    """One weight, one row: where a nibble of word (block, quad, lane, v) lands, spelled out from the MMA's
    A fragment (register r = r0 + 2 r1, half h: row 8 r0 + lane // 4, k 8 r1 + 2 (lane % 4) + h of its 16-row
    k-block) and the chunk's x order (lane t's x rows t * C/4 + kb * 4 + 2 r1 + h)."""
    from kernels.int4_dequant import to_fragments

    k, n, group = 256, 16, 128
    for col, row, want in ((0, 0, (0, 0, 0, 0, 0)), (9, 37, None), (15, 255, None)):
        q = torch.zeros(k // 8, n, dtype=torch.int32)
        q[row // 8, col] = 5 << (4 * (row % 8))
        w = Int4Weight(
            q, torch.ones(k // group, n).half(), torch.zeros(k // group, n, dtype=torch.uint8), group
        )
        f = to_fragments(w).qweight
        hits = f.nonzero().tolist()
        assert len(hits) == 1
        c, qd, lane, v = hits[0]
        word = int(f[c, qd, lane, v]) & 0xFFFFFFFF
        nib = (word.bit_length() - 1) // 4
        assert word == 5 << (4 * nib)
        r, h = nib % 4, nib // 4
        r0, r1, g, t = r % 2, r // 2, lane // 4, lane % 4
        chunk, quads = 128, 2
        ch, quad = qd // quads, qd % quads
        assert 16 * c + 8 * r0 + g == col
        assert ch * chunk + t * (chunk // 4) + (quad * 4 + v) * 4 + 2 * r1 + h == row
        if want is not None:
            assert (c, qd, lane, v, nib) == want


@pytest.mark.parametrize("group", [64, 128])
def test_wgmma_kernel_gathers_x_into_the_a_operands_k_order(group):
    """kernels/w4a16_wgmma.py hands a warp's dequantized words to wgmma as its A operand in register order
    (row 8 r0 + g, position ((q * 4 + v) * 2 + r1) * 4 + t) * 2 + h of the chunk, for nibble 4 h + 2 r1 + r0 of word
    v of lane 4 g + t in quad q) and gathers x by chunk_order: every position holds the weight of the column of x
    that chunk_order names there, for all of a layer's columns."""
    from kernels.int4_dequant import to_fragments, unpack_rows
    from kernels.w4a16_wgmma import chunk_order

    k, n = 512, 48
    w = random_int4(k, n, group)
    f = to_fragments(w)
    blocks, quads = f.qweight.shape[0], f.chunk // 64
    nib = (f.qweight.unsqueeze(-1) >> torch.arange(0, 32, 4, dtype=torch.int32)) & 0xF
    nib = nib.view(blocks, k // f.chunk, quads, 8, 4, 4, 2, 2, 2)  # (c, ch, q, g, t, v, h, r1, r0)
    a = nib.permute(0, 8, 3, 1, 2, 5, 7, 4, 6).reshape(blocks * 16, k)  # (c r0 g, ch q v r1 t h)
    order = chunk_order(k, f.chunk, torch.device("cpu"))
    assert sorted(order.tolist()) == list(range(k))
    assert torch.equal(a[:n], unpack_rows(w.qweight).t()[:, order].to(a.dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wgmma_gathers_x_as_index_select_does(dtype):
    """kernels/w4a16_wgmma.gather_columns (the kernel's x in the layout's K order, interpreted here): x.index_select(1,
    order) exactly, for chunk orders with and without GPTQ's act-order permutation composed in, K past one block of
    positions and not a multiple of it, and x whose rows are not contiguous."""
    from kernels.w4a16_wgmma import chunk_order, gather_columns

    g = torch.Generator().manual_seed(0)
    for m, k, chunk in ((3, 1152, 128), (2, 192, 64), (1, 128, 128)):
        order = chunk_order(k, chunk, torch.device("cpu"))
        for idx in (order, torch.randperm(k, generator=g)[order]):
            for x in (torch.randn(m, k, generator=g).to(dtype), torch.randn(k, m, generator=g).to(dtype).t()):
                got = gather_columns(x, idx)
                assert got.is_contiguous() and torch.equal(got, x.index_select(1, idx)), (m, k, chunk)


def test_wgmma_x_order_composes_act_order_once_a_weight():
    """kernels/w4a16_wgmma.x_order: the chunk order alone without act order; with it, position p reads column
    perm[chunk_order[p]], composed on the first call and the same tensor on every later one."""
    from kernels.int4_dequant import to_fragments
    from kernels.w4a16_wgmma import _PERM_ORDERS, chunk_order, x_order

    for perm in (False, True):
        w = to_fragments(random_int4(256, 48, 128, perm=perm, seed=3))
        order = chunk_order(256, w.chunk, torch.device("cpu"))
        first = x_order(w)
        want = order if w.perm is None else w.perm.long()[order]
        assert torch.equal(first.long(), want) and x_order(w) is first, perm
        assert (w.perm is not None) == (id(w.perm) in _PERM_ORDERS), perm
    held = len(_PERM_ORDERS)
    del w, first
    assert len(_PERM_ORDERS) == held - 1  # the composed order goes with its weight


def test_wgmma_config_keeps_three_stage_programs_to_one_wave(monkeypatch):
    """kernels/w4a16_wgmma.config and ring_stages: at 128 rows a program, three stages take over half an SM's shared
    memory, so a three-stage plan must fit one program an SM (a second wave ran 12% slower), and others take two
    stages, 256-row programs too; every split keeps at least 4 chunks; 64 rows a program up to 64 rows of x."""
    import kernels.w4a16_wgmma as wgmma

    sms = 132
    monkeypatch.setattr(wgmma, "num_sms", lambda device: sms)
    picks = {}
    for m in range(wgmma.MIN_ROWS, wgmma.MAX_ROWS + 1):
        for name, (k, n) in {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
                             "down": (14336, 4096), "odd": (1024, 272)}.items():  # fmt: skip
            bm, wg, mb, split = wgmma.config(m, n, k, 128, torch.device("cuda"))
            programs = -(-n // (64 * wg * mb)) * -(-m // bm) * split
            stages = wgmma.ring_stages(bm, programs, torch.device("cuda"))
            assert bm == (64 if m <= 64 else 128), (m, name)
            assert split == 1 or k // 128 // split >= 4, (m, name, split)
            if bm == 128:
                assert programs <= sms if stages == 3 else stages == 2, (m, name, programs, stages)
            picks[m, name] = (split, stages)
    assert picks[192, "qkv"] == (1, 3) and picks[128, "o"] == (4, 3) and picks[128, "gate_up"] == (1, 2)
    assert wgmma.ring_stages(256, 8, torch.device("cuda")) == 2  # a shape picked by hand: its own stages


def test_fragment_layout_refuses_what_it_cannot_hold():
    from kernels.int4_dequant import fragment_chunk, to_fragments

    w = random_int4(256, 40, 32)
    assert fragment_chunk(w) == 0
    with pytest.raises(ValueError, match="multiple of 64"):
        to_fragments(w)
    f = to_fragments(random_int4(256, 40, 64))
    with pytest.raises(ValueError, match="fragment-laid qweight"):
        Int4Weight(f.qweight[:, :2], f.scales, f.zeros, 64, layout="fragments", chunk=64)
    with pytest.raises(ValueError, match="fragment-laid qweight"):
        Int4Weight(f.qweight, f.scales, f.zeros, 64, layout="fragments", chunk=128)
    with pytest.raises(ValueError, match="unknown int4 layout"):
        Int4Weight(f.qweight, f.scales, f.zeros, 64, layout="tiles", chunk=64)


@pytest.mark.parametrize("gemm,steps", [("down", 2), ("gate_up", 2), ("down", 0)])
def test_words_asked_ahead_compile_for_hopper_inside_the_k_loop(gemm, steps):
    """The tensor-core kernel asking L2 for its words steps ahead (PDSERVE_W4A16_PREFETCH) compiles for sm_90 with
    nothing spilled, in both K loops (down: two chunks a step; gate_up with SwiGLU: a chunk of each block a step), its
    prefetches inside the loop; none without it. No GPU: bench/sass.py compiles it (tests/gpu holds the outputs
    bit for bit to the kernel's without them)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.sass", "--gemm", gemm, "--rows", "1", "--kw", f"prefetch={steps}"],
        env=env, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    usage = next(line for line in done.stdout.splitlines() if "REG:" in line)
    assert "LOCAL:0 " in usage and "STACK:0 " in usage, usage
    loop = done.stdout.split("K loop:", 1)[1]
    assert (loop.count("CCTL.E.PF2") > 0) == (steps > 0), done.stdout


def test_prefetch_knob_takes_whole_steps(monkeypatch):
    for good, steps in (("", 0), ("0", 0), ("3", 3)):
        monkeypatch.setenv("PDSERVE_W4A16_PREFETCH", good)
        assert _backend._read_steps("PDSERVE_W4A16_PREFETCH") == steps
    for bad in ("-1", "two", "9", "1.5"):
        monkeypatch.setenv("PDSERVE_W4A16_PREFETCH", bad)
        with pytest.raises(ValueError, match="PDSERVE_W4A16_PREFETCH must be a whole number"):
            _backend._read_steps("PDSERVE_W4A16_PREFETCH")


def test_split_k_counters_are_reset_for_the_next_call():
    from kernels.w4a16_gemm import _locks

    w = random_int4(1024, 64, 128)
    x = torch.randn(4, 1024)
    first = w4a16_gemm_triton(x, w, config=GemmConfig(16, 64, 8))
    assert int(_locks(x.device).abs().sum()) == 0
    again = w4a16_gemm_triton(x, w, config=GemmConfig(16, 64, 8))
    assert torch.equal(first, again)  # the splits are summed in order: deterministic
    torch.testing.assert_close(first, w4a16_gemm_reference(x, w), rtol=1e-5, atol=1e-5)


def test_int8_dequant_kernel_is_exact():
    g = torch.Generator().manual_seed(0)
    w = Int8Weight(
        torch.randint(-128, 128, (37, 96), dtype=torch.int8, generator=g),
        torch.rand(37, 3, generator=g).half(),
        32,
    )
    assert torch.equal(int8_dequant_triton(w, torch.float32), int8_dequant_reference(w))


# ---- merged layers and tensor parallelism --------------------------------------------------------


def test_qkv_parts_load_into_their_rows():
    k, heads, kv_heads, head = 128, 4, 2, 16
    parts = {s: checkpoint("awq", k, size * head, 32, seed=i) for i, (s, size) in
             enumerate((("q", heads), ("k", kv_heads), ("v", kv_heads)))}  # fmt: skip
    layer = make(QKVParallelLinear, method_for("awq", 32), k, head, heads, kv_heads)
    for shard, (tensors, _) in parts.items():
        load(layer, tensors, shard)
    layer.quant_method.process_weights(layer)
    dense = torch.cat([parts[s][1] for s in "qkv"])
    x = torch.randn(3, k)
    torch.testing.assert_close(layer(x), F.linear(x, dense), rtol=0, atol=0)


def test_merged_gptq_parts_must_share_their_act_order():
    gate, _ = checkpoint("gptq_act", 128, 64, 32, seed=1)
    up, _ = checkpoint("gptq_act", 128, 64, 32, seed=2)
    layer = make(MergedColumnParallelLinear, method_for("gptq_act", 32), 128, [64, 64])
    load(layer, gate, 0)
    with pytest.raises(ValueError, match="differs between the parts of a merged layer"):
        load(layer, {"g_idx": up["g_idx"]}, 1)


@pytest.mark.parametrize("fmt", ["awq", "gptq", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_tensor_parallel_ranks_hold_their_slices(fmt, cls):
    k, n, group = 256, 128, 32
    tensors, dense = checkpoint(fmt, k, n, group, seed=4)
    for rank in range(2):
        layer = make(cls, method_for(fmt, group), k, n, tp_rank=rank, tp_size=2)
        load(layer, tensors)
        layer.quant_method.process_weights(layer)
        w = layer.quant_method.weight
        got = int8_dequant_reference(w) if isinstance(w, Int8Weight) else int4_dequant_reference(w)
        expected = dense.chunk(2, dim=0 if cls is ColumnParallelLinear else 1)[rank]
        assert torch.equal(got, expected)


def test_a_packed_tensor_of_the_wrong_shape_is_refused():
    tensors, _ = checkpoint("awq", 128, 64, 32)
    layer = make(ColumnParallelLinear, method_for("awq", 32), 128, 64)
    params = dict(layer.named_parameters())
    with pytest.raises(
        ValueError, match=r"shape mismatch: checkpoint has \(128, 4\), model expects \(128, 8\)"
    ):
        params["qweight"].weight_loader(params["qweight"], tensors["qweight"][:, :4])
