"""Int4 on the GPU: the W4A16 GEMM (split-K, tiled, dequantize + cuBLAS) and the dequantize kernels against
their torch references over many shapes and dtypes, split-K replayed from a CUDA graph, and the engine
serving AWQ, GPTQ and GGUF checkpoints (CUDA graphs on) against transformers on the dequantized weights
(fp32, as tests/gpu/test_engine_gpu.py). The benchmark is `python3 -m bench.quant_int4`."""

from __future__ import annotations

import pytest
import torch

import kernels._backend as backend
from engine import LLM, SamplingParams
from engine.quantize import QuantizeConfig, quantize
from kernels.fused_add_rmsnorm import norm_input, rms_norm
from kernels.int4_dequant import Int4Weight, int4_dequant_reference, int4_dequant_triton, to_fragments
from kernels.int8_dequant import Int8Weight, int8_dequant_reference, int8_dequant_triton
from kernels.kv_quant import FP8_DTYPE
from kernels.rotary_kv_write import rotary_kv_write
from kernels.silu_and_mul import silu_and_mul, silu_and_mul_reference
from kernels.w4a16_gemm import DEQUANT_MIN_M, _locks, w4a16_gemm, w4a16_gemm_reference, w4a16_swiglu
from kernels.w4a16_mma import (
    MAX_ROWS,
    PROGRAM_ROWS,
    ROPE_WARPS,
    NextNorm,
    NormedInput,
    RopeWrite,
    w4a16_mma,
    w4a16_mma_reference,
)
from kernels.w4a16_wgmma import MAX_ROWS as WGMMA_MAX_ROWS
from kernels.w4a16_wgmma import MIN_ROWS as WGMMA_MIN_ROWS
from kernels.w4a16_wgmma import w4a16_wgmma
from tests.hf_reference import hf_greedy, hf_logits, tiny_random_model_dir
from tests.quant_checkpoints import dequantized_copy, write_gguf

ERR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # relative to the output's norm


def random_int4(k, n, group, offsets=False, perm=False, seed=0) -> Int4Weight:
    """Odd seeds lay qweight K-contiguous, as loaded layers hold it; even seeds as checkpoints pack it."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda", generator=g)
    if seed % 2:
        qweight = qweight.t().contiguous().t()
    scales = (torch.rand(k // group, n, device="cuda", generator=g) * 0.02 + 0.001).half()
    if offsets:
        zeros = (torch.randn(k // group, n, device="cuda", generator=g) * 0.05).half()
    else:
        zeros = torch.randint(0, 17, (k // group, n), dtype=torch.uint8, device="cuda", generator=g)
    p = torch.randperm(k, device="cuda", generator=g).int() if perm else None
    return Int4Weight(qweight, scales, zeros, group, p)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


SHAPES = [(4096, 4096, 128), (4096, 1001, 64), (1536, 200, 32), (14336, 4096, 128), (576, 72, 32)]
ROWS = [1, 2, 3, 8, 16, 17, 33, 64, 200, 511, DEQUANT_MIN_M, 1000]


CASES = [(*shape, dtype) for shape in SHAPES for dtype in (torch.bfloat16, torch.float16)]
CASES.append((*SHAPES[2], torch.float32))  # fp32: ieee dots; one shape is enough


LAYOUT_CASES = [(*case, "rows") for case in CASES] + [
    (*case, "fragments") for case in CASES if case[2] % 64 == 0
]  # the tensor-core kernel's layout holds groups of a multiple of 64 rows


@pytest.mark.parametrize("k,n,group,dtype,layout", LAYOUT_CASES)
def test_w4a16_gemm_matches_reference(k, n, group, dtype, layout):
    for i, m in enumerate(ROWS + ([4096] if k * n <= 1536 * 200 else [])):
        w = random_int4(k, n, group, offsets=i % 3 == 1, perm=i % 4 == 2, seed=i)
        if layout == "fragments":
            w = to_fragments(w)
        x = torch.randn(m, k, device="cuda").to(dtype)
        bias = torch.randn(n, device="cuda").to(dtype) if i % 2 else None
        out = w4a16_gemm(x, w, bias)
        ref = w4a16_gemm_reference(x.float(), w, None if bias is None else bias.float())
        assert out.dtype == dtype and rel_err(out, ref) < ERR[dtype], (m, k, n, group)


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("warps,unroll", [(4, 1), (4, 2), (8, 1), (8, 2)])
def test_every_tensor_core_config_matches_reference(warps, unroll, pdl):
    """config() picks per shape; every setting it may pick is exact, including K ranges that leave a program's
    warps partly idle (17 and 112 chunks)."""
    for i, (k, n, group) in enumerate([(4096, 1001, 128), (1088, 200, 64), (14336, 4096, 128)]):
        w = to_fragments(random_int4(k, n, group, offsets=i == 1, seed=i))
        for m in (1, 5, 16):
            for fold in (True, False):
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                out = w4a16_mma(x, w, None, warps, unroll, fold, pdl, pair=False)
                ref = w4a16_gemm_reference(x.float(), w)
                assert rel_err(out, ref) < ERR[torch.bfloat16], (m, k, n, fold)


@pytest.mark.parametrize(
    "k,n,group,dtype",
    [(4096, 6144, 128, torch.bfloat16), (4096, 1040, 64, torch.float16), (14336, 4096, 128, torch.bfloat16),
     (1024, 272, 128, torch.float16)],
)  # fmt: skip
def test_wgmma_kernel_matches_reference_over_its_configs(k, n, group, dtype, monkeypatch):
    """The wgmma kernel at its fewest and most rows and between, with act order and a bias, at config()'s pick and
    at settings it may pick elsewhere (two warpgroups, two 64-column tiles a warpgroup, 64, 128 or 256 rows a program,
    K split 1-3 ways, a shallower or deeper ring, each MMA waited for before the next chunk's dequant):
    each is the dequantized weights' product. Column counts that leave the last program's blocks partly empty
    (1040, 272) read zeros there."""
    configs = [
        {},
        {"block_m": 64, "warpgroups": 2, "split": 1},
        {"block_m": 128, "warpgroups": 1, "split": 3, "stages": 4},
        {"block_m": 128, "warpgroups": 2, "column_tiles": 2, "split": 2, "stages": 2},
        {"block_m": 256, "warpgroups": 1, "column_tiles": 1, "split": 1, "stages": 2},
        {"overlap": False},
        {"block_m": 64, "column_tiles": 1, "split": 2, "overlap": False},
    ]
    for i, m in enumerate((WGMMA_MIN_ROWS, 64, 100, 200, WGMMA_MAX_ROWS)):
        w = to_fragments(random_int4(k, n, group, perm=i % 2 == 1, seed=i))
        x = torch.randn(m, k, device="cuda").to(dtype)
        bias = torch.randn(n, device="cuda").to(dtype) if i % 2 else None
        ref = w4a16_gemm_reference(x.float(), w, None if bias is None else bias.float())
        for cfg in configs:
            out = w4a16_wgmma(x, w, bias, **cfg)
            assert out.dtype == dtype and rel_err(out, ref) < ERR[dtype], (m, k, n, cfg)
        assert torch.equal(
            w4a16_gemm(x, w, bias), w4a16_wgmma(x, w, bias)
        )  # the dispatch takes it at these rows


def test_wgmma_kernel_takes_x_already_in_its_k_order():
    """ordered=True: x written in the layout's K order (as the norms and SiLU-and-mul write it) gives the gathered
    call's output bit for bit, at config()'s picks and a split; act-order weights are refused."""
    from kernels.int4_dequant import layout_order

    for m, (k, n) in ((40, (4096, 6144)), (200, (14336, 4096))):
        w = to_fragments(random_int4(k, n, 128, seed=m))
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        xo = x[:, layout_order(k, w.chunk, x.device)].contiguous()
        for cfg in ({}, {"split": 2}):
            assert torch.equal(
                w4a16_wgmma(xo, w, None, ordered=True, **cfg), w4a16_wgmma(x, w, None, **cfg)
            ), m
    w = to_fragments(random_int4(4096, 256, 128, perm=True, seed=1))
    with pytest.raises(ValueError, match="act order"):
        w4a16_wgmma(torch.zeros(40, 4096, device="cuda", dtype=torch.bfloat16), w, ordered=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"block_m": 128, "warpgroups": 2, "column_tiles": 2, "split": 2},
        {"column_tiles": 1, "overlap": False},
    ],
)
def test_wgmma_kernel_reads_each_weight_as_the_dense_layer_holds_it(dtype, cfg):
    """The scale rides in the dequantized A operand, rounded once: against one-hot rows of x each output is one
    weight, and it equals the dense weight in x's dtype bit for bit (fp16 scales that bf16 cannot hold, act order)."""
    k, n = 2048, 1040
    w = to_fragments(random_int4(k, n, 128, perm=True, seed=3))
    picks = torch.randperm(k, device="cuda")[:200]
    x = torch.zeros(200, k, device="cuda", dtype=dtype)
    x[torch.arange(200, device="cuda"), picks] = 1
    want = w4a16_gemm_reference(torch.eye(k, device="cuda"), w).to(dtype)[picks]
    assert torch.equal(w4a16_wgmma(x, w, None, **cfg), want)


def test_wgmma_kernel_never_overwrites_an_operand_in_flight(tmp_path):
    """A warpgroup MMA reads its A operand from registers while it runs: in the machine code of every variant compiled
    here (config()'s picks and others, bf16 and fp16, groups of 64 and 128, with a bias and split-K), no instruction
    writes a register that an MMA still in flight reads (bench/sass.py: wgmma_operand_hazards)."""
    import kernels.w4a16_wgmma as wgmma
    from bench.sass import sass_of, wgmma_operand_hazards

    configs = [
        {},
        {"split": 1},
        {"block_m": 256, "column_tiles": 1, "split": 1, "stages": 2},
        {"overlap": False},
    ]
    for dtype in (torch.bfloat16, torch.float16):
        for i, (k, n, group) in enumerate([(4096, 6144, 128), (1088, 200, 64)]):
            w = to_fragments(random_int4(k, n, group, seed=i))
            bias = torch.randn(n, device="cuda").to(dtype) if i else None
            for m in (WGMMA_MIN_ROWS, 100, WGMMA_MAX_ROWS):
                x = torch.randn(m, k, device="cuda").to(dtype)
                for cfg in configs:
                    w4a16_wgmma(x, w, bias, **cfg)
    compiled = [
        kern for cache in wgmma._w4a16_wgmma_kernel.device_caches.values() for kern in cache[0].values()
    ]
    assert len(compiled) >= 8
    for kern in compiled:
        sass, _ = sass_of(kern.asm["cubin"], tmp_path)
        assert "HGMMA" in sass
        assert wgmma_operand_hazards(sass) == []


def test_wgmma_kernel_refuses_what_it_does_not_take():
    """Rows outside its range, offsets for zeros and the rows layout get a clear error, not a wrong product."""
    w = random_int4(1024, 256, 128)
    f = to_fragments(w)
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    for xx, ww in (
        (x[: WGMMA_MIN_ROWS - 1], f),
        (x, w),
        (x, to_fragments(random_int4(1024, 256, 128, offsets=True))),
    ):
        with pytest.raises(ValueError, match="w4a16_wgmma takes"):
            w4a16_wgmma(xx, ww)


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_words_asked_into_l2_ahead_leave_the_product_unchanged(prefetch):
    """Asking L2 for the words steps ahead (prefetch) changes no output bit, in every K loop the kernel has (one
    and two chunks a step, two blocks a program, SwiGLU), including K ranges shorter than the distance."""
    shapes = [(4096, 28672, 128), (14336, 4096, 128), (1088, 224, 64), (4096, 6144, 128)]  # (K, N, group)
    for i, (k, n, group) in enumerate(shapes):
        w = to_fragments(random_int4(k, n, group, offsets=i == 2, seed=i))
        for m in (1, 8, 16):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            for kw in ({}, {"warps": 8, "unroll": 2}, {"warps": 4, "unroll": 1}, {"swiglu": True}):
                ahead, plain = w4a16_mma(x, w, prefetch=prefetch, **kw), w4a16_mma(x, w, prefetch=0, **kw)
                assert torch.equal(ahead, plain), (m, k, n, kw)


@pytest.mark.parametrize("warps", [4, 8])
def test_paired_column_blocks_match_reference(warps):
    """A program taking two adjacent column blocks (pair) is exact at 1-16 rows, folded or not, with offsets,
    and refuses an odd count of blocks."""
    for i, (k, n, group) in enumerate([(4096, 1024, 128), (1088, 224, 64), (14336, 4096, 128)]):
        w = to_fragments(random_int4(k, n, group, offsets=i == 1, seed=i))
        for m in (1, 5, 16):
            for fold in (True, False):
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                out = w4a16_mma(x, w, None, warps, 1, fold, True, pair=True)
                assert rel_err(out, w4a16_gemm_reference(x.float(), w)) < ERR[torch.bfloat16], (m, k, n, fold)
    odd = to_fragments(random_int4(1024, 208, 64, offsets=False, seed=3))
    with pytest.raises(ValueError, match="even count"):
        w4a16_mma(torch.randn(1, 1024, device="cuda").to(torch.bfloat16), odd, pair=True)


SWIGLU_SHAPES = [(4096, 28672, 128), (576, 3072, 32), (1024, 224, 64), (1024, 200, 64)]  # (K, N, group)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "layout,m,k,n,group",
    [("rows", 1, *s) for s in SWIGLU_SHAPES]
    + [
        ("fragments", m, *s) for m in (1, 8, 16, 40) for s in SWIGLU_SHAPES if s[2] % 64 == 0
    ],  # groups of 64 rows or more
)
def test_w4a16_swiglu_equals_the_gemm_then_silu_and_mul(layout, m, k, n, group, dtype):
    """gate_up's GEMM ending in SwiGLU (Llama-3-8B's, SmolLM2's, odd ones; in the fragment layout 200 columns fall
    back to the two kernels): the two unfused kernels' output, and the dequantized reference."""
    for seed in (1, 2):
        w = random_int4(k, n, group, offsets=seed == 2, seed=seed)
        if layout == "fragments":
            w = to_fragments(w)
        x = torch.randn(m, k, device="cuda").to(dtype)
        bias = torch.randn(n, device="cuda").to(dtype) if seed == 2 else None
        out = w4a16_swiglu(x, w, bias)
        # the unfused kernels agree to a rounding of gate or up in x's dtype (silu's slope can scale it up to ~4x):
        # two compiled variants of one kernel may contract multiply-adds apart, so not bit for bit
        eps = torch.finfo(dtype).eps
        unfused = silu_and_mul(w4a16_gemm(x, w, bias))
        assert out.shape == (m, n // 2)
        torch.testing.assert_close(
            out, unfused, rtol=8 * eps, atol=8 * eps * 1e-2 * unfused.abs().max().item()
        )
        ref = silu_and_mul_reference(
            w4a16_gemm_reference(x.float(), w, None if bias is None else bias.float())
        )
        assert rel_err(out, ref) < ERR[dtype], (k, n, seed)


FUSED_SHAPES = [(4096, 6144, 128), (4096, 4096, 128), (14336, 4096, 128), (576, 192, 64), (1088, 224, 64)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,n,group", FUSED_SHAPES)
def test_norm_and_residual_add_ride_in_the_gemm(k, n, group, dtype):
    """A GEMM taking its x as norm weight * stream (NormedInput) matches its reference, and RMSNorm's kernel then
    the GEMM to x's extra rounding; a GEMM adding into the stream (add_to) leaves the stream the separate add
    would, the next norm's weight times it, rounded once, and its sums of squares. At 1-16 rows, with offsets
    and a bias, in the configs config() picks (two blocks a program at 16 rows)."""
    eps = torch.finfo(dtype).eps
    for i, m in enumerate((1, 5, 8, 16)):
        w = to_fragments(random_int4(k, n, group, offsets=i == 1, seed=i))
        bias = torch.randn(n, device="cuda").to(dtype) if i == 2 else None
        h = torch.randn(m, k, device="cuda").to(dtype)
        g = (1 + 0.2 * torch.randn(k, device="cuda")).to(dtype)
        norm = NormedInput(norm_input(h, g)[1], 1e-5)
        x = (g.float() * h.float()).to(dtype)
        out = w4a16_mma(x, w, bias, norm=norm)
        assert rel_err(out, w4a16_mma_reference(x, w, bias, norm=norm)) < ERR[dtype], (m, k, n)
        assert rel_err(out, w4a16_mma(rms_norm(h, g, 1e-5), w, bias).float()) < ERR[dtype], (m, k, n)

        stream = torch.randn(m, n, device="cuda").to(dtype)
        xa = torch.randn(m, k, device="cuda").to(dtype)
        gn = (1 + 0.2 * torch.randn(n, device="cuda")).to(dtype)
        nxt = NextNorm(
            gn, torch.empty(m, n, device="cuda", dtype=dtype), torch.empty(m, n // 16, device="cuda")
        )
        added = stream.clone()
        assert w4a16_mma(xa, w, bias, add_to=added, next_norm=nxt) is added
        separate = (w4a16_mma(xa, w, bias).float() + stream.float()).to(dtype)
        torch.testing.assert_close(added, separate, rtol=eps, atol=eps * separate.abs().max().item())
        assert torch.equal(nxt.normed, (gn.float() * added.float()).to(dtype))
        torch.testing.assert_close(nxt.sumsq, norm_input(added, gn)[1], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("k,n,group", [(4096, 28672, 128), (576, 3072, 64)])
def test_swiglu_gemm_takes_its_norm(m, k, n, group):
    w = to_fragments(random_int4(k, n, group, seed=m))
    h = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    g = (1 + 0.2 * torch.randn(k, device="cuda")).to(torch.bfloat16)
    norm = NormedInput(norm_input(h, g)[1], 1e-6)
    x = (g.float() * h.float()).to(torch.bfloat16)
    out = w4a16_mma(x, w, None, swiglu=True, norm=norm)
    ref = silu_and_mul_reference(w4a16_mma_reference(x, w, None, norm=norm))
    assert out.shape == (m, n // 2) and rel_err(out, ref) < ERR[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,k", [(32, 8, 128, 4096), (4, 2, 64, 576), (2, 1, 32, 64)])
def test_rope_and_kv_write_ride_in_the_qkv_gemm(heads, kv_heads, head_dim, k, dtype):
    """The qkv GEMM ending in RoPE and the KV-cache write (RopeWrite) leaves exactly what the same GEMM and then
    rotary_kv_write leave: the query columns rotated, the key and value columns as computed, the cache's rows;
    a row with a negative slot writes nothing. 1-8 rows, taking its norm, with and without a bias; and within
    a rounding of the torch reference."""
    n = (heads + 2 * kv_heads) * head_dim
    for i, m in enumerate((1, 3, 5, 8)):
        w = to_fragments(random_int4(k, n, 64, seed=i))
        bias = torch.randn(n, device="cuda").to(dtype) if i % 2 else None
        h = torch.randn(m, k, device="cuda").to(dtype)
        g = (1 + 0.2 * torch.randn(k, device="cuda")).to(dtype)
        norm = NormedInput(norm_input(h, g)[1], 1e-5)
        x = (g.float() * h.float()).to(dtype)
        cos_sin = torch.randn(300, head_dim, device="cuda").to(dtype)
        positions = torch.randint(0, 300, (m,), device="cuda")
        slots = torch.randperm(64, device="cuda")[:m]
        if m > 1:
            slots[1] = -1
        cache = torch.randn(2, 4, 16, kv_heads, head_dim, device="cuda").to(dtype)
        before = cache.clone()
        fused = w4a16_mma(
            x, w, bias, norm=norm, rope=RopeWrite(positions, cos_sin, cache, slots, heads, kv_heads)
        )
        plain = w4a16_mma(x, w, bias, norm=norm, warps=ROPE_WARPS, unroll=1, fold=True, pair=False)
        split = plain.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, key, v = (t.view(m, -1, head_dim) for t in split)
        separate = before.clone()
        rotary_kv_write(q, key, v, positions, cos_sin, separate, slots)
        assert torch.equal(fused, plain), (m, n)
        assert torch.equal(cache, separate), (m, n)
        if m > 1:  # the skipped row's slot is untouched; every other row's is written
            assert not torch.equal(cache, before)
        ref_cache = before.clone()
        ref = w4a16_mma_reference(x, w, bias, norm=norm, rope=RopeWrite(positions, cos_sin, ref_cache, slots,
                                                                         heads, kv_heads))  # fmt: skip
        assert rel_err(fused, ref) < ERR[dtype] and rel_err(cache, ref_cache.float()) < ERR[dtype], (m, n)


@pytest.mark.parametrize("k,n,group", [(4096, 6144, 128), (14336, 4096, 128), (1088, 224, 64)])
def test_rows_past_a_program_run_in_one_launch(k, n, group):
    """Past PROGRAM_ROWS rows a column block's programs take 16 rows each, side by side in one launch: bit for bit
    the kernel 16 rows a launch, plain, with a norm, adding into the stream and ending in SwiGLU; a last program
    of fewer rows (40 = 16 + 16 + 8) matches the reference; past MAX_ROWS the kernel refuses."""
    m = 3 * PROGRAM_ROWS
    w = to_fragments(random_int4(k, n, group, offsets=n == 224, seed=k))
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    parts = [slice(i, i + PROGRAM_ROWS) for i in range(0, m, PROGRAM_ROWS)]
    assert torch.equal(w4a16_mma(x, w, bias), torch.cat([w4a16_mma(x[p], w, bias) for p in parts]))
    h = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    g = (1 + 0.2 * torch.randn(k, device="cuda")).to(torch.bfloat16)
    sumsq = norm_input(h, g)[1]
    xn = (g.float() * h.float()).to(torch.bfloat16)
    normed = w4a16_mma(xn, w, norm=NormedInput(sumsq, 1e-5))
    each = [w4a16_mma(xn[p], w, norm=NormedInput(sumsq[p].contiguous(), 1e-5)) for p in parts]
    assert torch.equal(normed, torch.cat(each))
    assert torch.equal(
        w4a16_mma(xn, w, swiglu=True), torch.cat([w4a16_mma(xn[p], w, swiglu=True) for p in parts])
    )
    stream = torch.randn(m, n, device="cuda").to(torch.bfloat16)
    gn = (1 + 0.2 * torch.randn(n, device="cuda")).to(torch.bfloat16)

    def next_norm() -> NextNorm:
        return NextNorm(
            gn, torch.empty(m, n, device="cuda", dtype=torch.bfloat16), torch.empty(m, n // 16, device="cuda")
        )

    whole, one = stream.clone(), next_norm()
    w4a16_mma(x, w, bias, add_to=whole, next_norm=one)
    apart, each_norm = stream.clone(), next_norm()
    for p in parts:
        w4a16_mma(
            x[p], w, bias, add_to=apart[p], next_norm=NextNorm(gn, each_norm.normed[p], each_norm.sumsq[p])
        )
    assert torch.equal(whole, apart) and torch.equal(one.normed, each_norm.normed)
    assert torch.equal(one.sumsq, each_norm.sumsq)
    x40 = x[:40]
    assert (
        rel_err(w4a16_mma(x40, w, bias), w4a16_gemm_reference(x40.float(), w, bias.float()))
        < ERR[torch.bfloat16]
    )
    ref = w4a16_mma_reference(xn[:40], w, None, norm=NormedInput(sumsq[:40].contiguous(), 1e-5))
    assert (
        rel_err(w4a16_mma(xn[:40], w, norm=NormedInput(sumsq[:40].contiguous(), 1e-5)), ref)
        < ERR[torch.bfloat16]
    )
    with pytest.raises(ValueError, match=f"1..{MAX_ROWS} rows"):
        w4a16_mma(torch.randn(MAX_ROWS + 1, k, device="cuda").to(torch.bfloat16), w)


def test_fused_gemm_refuses_what_does_not_fit():
    w = to_fragments(random_int4(1024, 256, 64, seed=1))
    x = torch.randn(2, 1024, device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match="sumsq"):
        w4a16_mma(x, w, norm=NormedInput(torch.zeros(2, 32, device="cuda"), 1e-6))
    with pytest.raises(ValueError, match="go together"):
        w4a16_mma(x, w, add_to=torch.zeros(2, 256, device="cuda", dtype=torch.bfloat16))
    wrong = NextNorm(torch.ones(256, device="cuda"), torch.empty(2, 256, device="cuda"), torch.empty(2, 16))
    with pytest.raises(ValueError, match="next norm's weight"):
        w4a16_mma(x, w, add_to=torch.zeros(2, 256, device="cuda", dtype=torch.bfloat16), next_norm=wrong)
    with pytest.raises(ValueError, match="out: .* expected"):
        w4a16_mma(x, w, out=torch.empty(2, 128, device="cuda", dtype=torch.bfloat16))
    into = torch.full((4, 256), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert w4a16_mma(x, w, out=into[1:3]).data_ptr() == into[1:3].data_ptr()  # rows of a larger output
    assert into[[0, 3]].isnan().all() and torch.equal(into[1:3], w4a16_mma(x, w))
    pos, slots = (
        torch.zeros(2, dtype=torch.long, device="cuda"),
        torch.zeros(2, dtype=torch.long, device="cuda"),
    )
    cos_sin = torch.zeros(16, 64, device="cuda", dtype=torch.bfloat16)
    fp8 = torch.zeros(2, 2, 16, 2, 64, device="cuda").to(FP8_DTYPE)
    with pytest.raises(
        ValueError, match="16-bit cache"
    ):  # 2 heads and 2 kv heads of 64 dims fill 256 columns
        w4a16_mma(x, w, rope=RopeWrite(pos, cos_sin, fp8, slots, 2, 1))
    cache = torch.zeros(2, 2, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="filling the 256 columns"):
        w4a16_mma(x, w, rope=RopeWrite(pos, cos_sin, cache, slots, 4, 2))
    with pytest.raises(ValueError, match="qkv GEMM alone"):
        w4a16_mma(x, w, swiglu=True, rope=RopeWrite(pos, cos_sin, cache, slots, 2, 1))
    nine = torch.zeros(9, dtype=torch.long, device="cuda")
    with pytest.raises(ValueError, match="1..8 rows"):
        w4a16_mma(x.repeat(5, 1)[:9], w, rope=RopeWrite(nine, cos_sin, cache, nine, 2, 1))


def test_dequantize_kernels_are_exact():
    for offsets, perm, seed in ((False, False, 0), (True, True, 1)):
        w = random_int4(4096, 1001, 64, offsets, perm, seed)
        assert torch.equal(int4_dequant_triton(w, torch.float32).t(), int4_dequant_reference(w))
        f = to_fragments(w)
        assert torch.equal(int4_dequant_triton(f, torch.float32).t(), int4_dequant_reference(w))
        assert torch.equal(int4_dequant_triton(f, torch.bfloat16), int4_dequant_triton(w, torch.bfloat16))
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randint(-128, 128, (1001, 4096), dtype=torch.int8, device="cuda", generator=g)
    w8 = Int8Weight(q, torch.rand(1001, 128, device="cuda", generator=g).half(), 32)
    assert torch.equal(int8_dequant_triton(w8, torch.float32), int8_dequant_reference(w8))


@pytest.mark.parametrize(
    "m,layout", [(1, "rows"), (4, "rows"), (16, "rows"), (1, "fragments"), (4, "fragments"), (16, "fragments"),
                 (64, "fragments"), (200, "fragments")],
)  # fmt: skip
def test_small_m_kernels_replay_from_a_cuda_graph(m, layout, monkeypatch):
    """Split-K's counters and the wgmma kernel's descriptors and K-order gather (64 and 200 rows, on Hopper)
    replay from a graph with new x each time."""
    monkeypatch.setattr(backend, "WGMMA", True)
    w = random_int4(14336, 4096, 128, seed=m)
    if layout == "fragments":
        w = to_fragments(w)
    x = torch.randn(m, 14336, device="cuda", dtype=torch.bfloat16)
    w4a16_gemm(x, w)  # warm-up: compiles, makes the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4a16_gemm(x, w)
    for step in range(5):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, w4a16_gemm_reference(x.float(), w)) < ERR[torch.bfloat16], step
        assert int(_locks(x.device).abs().sum()) == 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_random_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_v304(tmp_path_factory):
    # the vocabulary a multiple of 8, as GPTQ packs a quantized LM head's rows (the tokenizer has 300)
    return tiny_random_model_dir(tmp_path_factory.mktemp("tiny"), vocab_size=304)


PROMPTS = [[5, 6, 7, 8, 9], [20, 30, 40], [100, 3, 250, 17, 9, 64, 2], list(range(3, 120, 3))]


# nats: where a bf16 engine may part from transformers' fp32 greedy path, the gap between the reference's own choice
# and the engine's under the reference (bf16's roundings of the activations move logits by about this much)
BF16_TIE = 0.05


def assert_greedy_as_reference(got: list[list[int]], want: list[list[int]], dense_dir) -> None:
    """A bf16 engine's greedy tokens against transformers' fp32 ones on the same weights: each prompt's are equal,
    or part only where the reference itself ranks the engine's token within BF16_TIE nats of its own (after that
    the two follow different paths, and the rest is not compared)."""
    for prompt, g, w in zip(PROMPTS, got, want, strict=True):
        if g == w:
            continue
        i = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        assert i < min(len(g), len(w)), (prompt, g, w)
        lp = torch.log_softmax(hf_logits(dense_dir, prompt + w[:i])[-1], -1)
        gap = (lp[w[i]] - lp[g[i]]).item()
        assert gap < BF16_TIE, (prompt, i, g[i], w[i], gap)


def served(path, dtype="float32", **kwargs) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype=dtype, max_model_len=256, gpu_memory_utilization=0.05, **kwargs)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=12)
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def awq_group64(tmp_path, arch="llama", **model_kw):
    """(checkpoint, its dequantized copy, transformers' greedy output on that copy): AWQ at group 64 of a tiny random
    model, which loaded layers hold in the fragment layout on the GPU."""
    model = tiny_random_model_dir(tmp_path, arch, **model_kw)
    ckpt = quantize(QuantizeConfig(str(model), str(tmp_path / "awq"), method="awq", group_size=64,
                                   max_tokens=512))  # fmt: skip
    dense = dequantized_copy(ckpt, tmp_path / "dense")
    return ckpt, dense, hf_greedy(dense, PROMPTS, [12] * len(PROMPTS))


@pytest.mark.parametrize(
    "method,extra",
    [
        ("awq", {}),
        ("gptq", {"desc_act": True}),
        ("rtn", {"sym": True}),
        ("gptq", {"lm_head": True}),
        ("awq", {"group_size": 64}),
        ("gptq", {"desc_act": True, "group_size": 64}),
    ],
    ids=["awq", "gptq_act", "rtn_sym", "gptq_lm_head", "awq_fragments", "gptq_act_fragments"],
)
def test_engine_serves_quantized_checkpoints_as_transformers_on_their_dequantized_weights(
    tiny, tiny_v304, tmp_path, method, extra
):
    model = tiny_v304 if extra.get("lm_head") else tiny
    extra = {"group_size": 32, **extra}  # 64: the layers take the fragment layout (fp32: its dequantizer)
    ckpt = quantize(QuantizeConfig(str(model), str(tmp_path / method), method=method, max_tokens=512,
                                   **extra))  # fmt: skip
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:  # an int4 LM head: the GEMM serves it too
        assert ("lm_head.qweight" in set(f.keys())) == bool(extra.get("lm_head"))
    want = hf_greedy(dequantized_copy(ckpt, tmp_path / "dense"), PROMPTS, [12] * len(PROMPTS))
    assert served(ckpt) == want  # CUDA graphs for the decode steps: the split-K kernel replayed
    assert served(ckpt, enforce_eager=True, max_num_batched_tokens=32) == want  # chunked prefill, eager


def test_engine_serves_gguf_q4_q8_as_transformers(tiny, tmp_path, monkeypatch):
    from engine.bundled import gguf_model_dir

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    write_gguf(tiny, tmp_path / "tiny.gguf")
    want = hf_greedy(gguf_model_dir(tmp_path / "tiny.gguf"), PROMPTS, [12] * len(PROMPTS))
    assert served(tmp_path / "tiny.gguf") == want


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_norms_in_the_int4_gemms_serve_as_transformers(tmp_path, monkeypatch, arch):
    """bf16 over int4 in the fragment layout (group 64), the wgmma kernel off (PDSERVE_WGMMA=0): at 1-64 rows each
    decoder layer's norms ride in its GEMMs (engine/model.py: forward_fused, checked to run, in CUDA graphs and in the
    prompts' 55-row prefill), and greedy output, with the norms there and in kernels of their own, is transformers' on
    the dequantized weights (fp32) up to bf16's near-ties."""
    from engine.model import LlamaModel

    ckpt, dense, want = awq_group64(tmp_path, arch)
    monkeypatch.setattr(backend, "WGMMA", False)  # else on Hopper it takes the 55 rows, with the norms apart
    calls: list[int] = []  # each fused forward's rows
    real = LlamaModel.forward_fused
    monkeypatch.setattr(
        LlamaModel, "forward_fused", lambda self, *a: calls.append(a[0].shape[0]) or real(self, *a)
    )
    fused = served(ckpt, dtype="bfloat16")
    assert calls, "the norms did not ride in the GEMMs"
    assert sum(map(len, PROMPTS)) in calls, calls  # the prefill of all four prompts, 55 rows
    monkeypatch.setattr(backend, "FUSED_NORMS", False)
    before = len(calls)
    unfused = served(ckpt, dtype="bfloat16")
    assert len(calls) == before
    assert_greedy_as_reference(fused, want, dense)
    assert_greedy_as_reference(unfused, want, dense)


def test_wgmma_kernel_serves_as_transformers(tmp_path, monkeypatch):
    """bf16 over int4 in the fragment layout (group 64), on Hopper: the prompts' 55-row prefill runs on
    the wgmma kernel, with the layers' norms in kernels of their own (not forward_fused), which write x in the
    kernel's K order for qkv, gate_up and down (o's x it gathers), and greedy output is transformers' on the
    dequantized weights (fp32) up to bf16's near-ties."""
    import kernels.w4a16_wgmma as wgmma
    from engine.model import LlamaModel

    ckpt, dense, want = awq_group64(tmp_path)
    calls: list[tuple[int, bool]] = []
    real = wgmma.w4a16_wgmma
    monkeypatch.setattr(
        wgmma,
        "w4a16_wgmma",
        lambda x, *a, **kw: calls.append((x.shape[0], kw.get("ordered", False))) or real(x, *a, **kw),
    )
    fused: list[int] = []
    real_fused = LlamaModel.forward_fused
    monkeypatch.setattr(
        LlamaModel, "forward_fused", lambda self, *a: fused.append(a[0].shape[0]) or real_fused(self, *a)
    )
    monkeypatch.setattr(backend, "WGMMA", True)
    got = served(ckpt, dtype="bfloat16")
    prefill = [ordered for rows, ordered in calls if rows == sum(map(len, PROMPTS))]
    assert sum(map(len, PROMPTS)) not in fused, fused
    assert prefill.count(True) == 3 * prefill.count(False) > 0, (
        calls
    )  # a layer: qkv, gate_up, down; o gathers
    assert_greedy_as_reference(got, want, dense)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rope_in_the_int4_qkv_gemm_serves_as_transformers(tmp_path, monkeypatch, arch):
    """Heads of 32 dims: at 1-8 rows the qkv GEMM also ends in RoPE and the KV-cache write (checked to run, in
    CUDA graphs), and greedy output, with it and with rotary_kv_write in its own kernel (PDSERVE_FUSED_ROTARY=0), is
    transformers' on the dequantized weights (fp32) up to bf16's near-ties."""
    import kernels.w4a16_mma as mma

    ckpt, dense, want = awq_group64(tmp_path, arch, num_attention_heads=2, num_key_value_heads=1)
    ropes: list[int] = []
    real = mma.w4a16_mma
    monkeypatch.setattr(
        mma, "w4a16_mma", lambda *a, **kw: ropes.append(kw.get("rope") is not None) or real(*a, **kw)
    )
    fused = served(ckpt, dtype="bfloat16")
    assert any(ropes), "the qkv GEMM did not end in RoPE"
    monkeypatch.setattr(backend, "FUSED_ROTARY", False)
    ropes.clear()
    unfused = served(ckpt, dtype="bfloat16")
    assert ropes and not any(ropes)
    assert_greedy_as_reference(fused, want, dense)
    assert_greedy_as_reference(unfused, want, dense)


def test_triton_and_torch_paths_agree_on_a_quantized_model(tiny, tmp_path, monkeypatch):
    ckpt = quantize(
        QuantizeConfig(str(tiny), str(tmp_path / "awq"), method="awq", group_size=32, max_tokens=512)
    )
    llm = LLM(str(ckpt), device="cuda", dtype="float32", max_model_len=256, gpu_memory_utilization=0.05,
              enforce_eager=True)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12)
    monkeypatch.setattr(backend, "FORCED_BACKEND", "triton")
    a = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    monkeypatch.setattr(backend, "FORCED_BACKEND", "torch")
    b = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    assert a == b


def test_dummy_int4_llama3_8b_fits_and_decodes():
    llm = LLM("Llama-3-8B", load_format="dummy", dtype="bfloat16", quantization="awq", max_num_seqs=4,
              max_model_len=1024, gpu_memory_utilization=0.3)  # fmt: skip
    weights = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    layouts = {m.quant_method.weight.layout for m in llm.engine.runner.model.modules()
               if getattr(getattr(m, "quant_method", None), "weight", None) is not None}  # fmt: skip
    assert layouts == {"fragments"}  # group 128 on a GPU: the tensor-core kernel serves every int4 linear
    assert (
        weights <= 5.8e9
    )  # int4 linears (3.65 GB with scales and zeros) + bf16 embedding and LM head (2.1 GB)
    out = llm.generate(
        {"prompt_token_ids": list(range(100, 164))}, SamplingParams(max_tokens=8, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize(
    ("arch", "fmt"), [("mixtral", "awq"), ("qwen3_moe", "gptq"), ("mixtral", "gptq_act")]
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int4_moe_serves_as_transformers(tmp_path, arch, fmt, dtype):
    """An AWQ / GPTQ MoE checkpoint (int4 experts through kernels/fused_moe.py, int4 attention) in CUDA graphs:
    greedy output is transformers' on the dequantized weights (fp32), up to bf16's near-ties in bf16. gptq_act: made
    by `pdserve quantize --method gptq --desc-act` (act order)."""
    from tests.quant_checkpoints import write_int4_moe

    sizes = {} if arch == "mixtral" else {"moe_intermediate_size": 64}
    model_dir = tiny_random_model_dir(tmp_path, arch, **sizes)
    if fmt == "gptq_act":
        config = QuantizeConfig(str(model_dir), str(tmp_path / "int4"), method="gptq", group_size=32,
                                desc_act=True, max_tokens=256)  # fmt: skip
        ckpt = quantize(config)
    else:
        ckpt = write_int4_moe(model_dir, tmp_path / "int4", fmt)
    dense = dequantized_copy(ckpt, tmp_path / "dense")
    want = hf_greedy(dense, PROMPTS, [12] * len(PROMPTS))
    got = served(ckpt, dtype=dtype)
    if dtype == "float32":
        assert got == want
    else:
        assert_greedy_as_reference(got, want, dense)
