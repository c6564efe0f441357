"""FP8 (e4m3) KV cache: what the cache-write kernels store and the attention kernels read.

A layer's K and V each have one fp32 scale (`kv_scale`, a (2,) tensor on the cache's device: [k_scale,
v_scale]). Writing, x is stored as fp8(clamp(x / scale, -448, 448)), rounded to nearest even; reading, x is
fp8 * scale. The attention kernels never materialise the dequantized rows: K tiles are converted to the
query's dtype as they load and k_scale is folded into the softmax scale (one multiply per program), and
V's scale multiplies the output once, at the end.

The torch helpers below are the references' path (dequantize, then attend); the @triton.jit ones are
shared by the kernels, as kernels/online_softmax.py's step is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


def is_fp8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == FP8_DTYPE


def check_scale(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> None:
    """An fp8 cache needs its layer's (2,) fp32 scales on its device; another cache ignores them."""
    if is_fp8(kv_cache):
        assert kv_scale is not None, "an fp8 KV cache needs kv_scale ([k_scale, v_scale])"
        assert kv_scale.shape == (2,) and kv_scale.dtype == torch.float32, f"kv_scale {kv_scale.shape}"
        assert kv_scale.device == kv_cache.device, "kv_scale on another device than the cache"


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (any float dtype) -> fp8 e4m3 of x / scale, saturated at +-448."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)


def as_stored(x: torch.Tensor, kv_cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x as the cache stores it: quantized for an fp8 cache, else cast to the cache's dtype."""
    if is_fp8(kv_cache):
        assert scale is not None
        return quantize(x, scale)
    return x.to(kv_cache.dtype)


def as_read(
    x: torch.Tensor, kv_cache: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Cache rows as attention reads them, in `dtype`: dequantized for an fp8 cache."""
    if is_fp8(kv_cache):
        assert scale is not None
        return dequantize(x, scale, dtype)
    return x.to(dtype)


def scale_args(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """The kernels' (scale pointer, FP8 flag): without fp8 the pointer is any tensor and never read."""
    check_scale(kv_cache, kv_scale)
    fp8 = is_fp8(kv_cache)
    return (kv_scale if fp8 and kv_scale is not None else kv_cache), fp8


def fp16_dots(fp8: bool, query_dtype: torch.dtype) -> bool:
    """Whether an attention kernel runs its dots in fp16: for an fp8 cache under bf16 queries. An e4m3 tile
    converts to fp16 in one instruction per two values and to bf16 in several (through fp16 and fp32), which
    left the fp8 decode no faster than bf16's; every e4m3 value is exact in fp16, and fp16's mantissa is
    wider than bf16's for q and the probabilities (queries past fp16's 65504 do not occur)."""
    return fp8 and query_dtype == torch.bfloat16


@triton.jit
def round_to_fp8(x):
    """fp32 x (|x| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32: adding and
    subtracting 2^(e + 20) (e: x's exponent, at least -6 where e4m3 turns subnormal) rounds away all but 3
    mantissa bits in fp32's own round-to-nearest-even. The cast to fp8 after it is exact, wherever it runs
    (Triton's interpreter truncates a mantissa carry when it casts fp32 to fp8 itself). A value that rounds
    to zero keeps its sign, as torch's cast does (-c + c would give +0)."""
    e = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    c = ((e + 147) << 23).to(tl.float32, bitcast=True)  # 2^(e + 20)
    c = tl.where(x < 0, -c, c)
    r = (x + c) - c
    return tl.where(r == 0.0, x * 0.0, r)


@triton.jit
def store_quantized(dst, x, mask, scale, FP8: tl.constexpr):
    """Store fp32 rows x at dst in the cache's element type: divided by scale, saturated and rounded for fp8."""
    if FP8:  # IEEE division, as torch's: Triton's plain `/` may lower to an approximate one
        x = round_to_fp8(tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0))
    tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def load_scales(kv_scale_ptr, FP8: tl.constexpr):
    """(k_scale, v_scale) of the layer: 1.0 each without fp8."""
    k_scale = 1.0
    v_scale = 1.0
    if FP8:
        k_scale = tl.load(kv_scale_ptr)
        v_scale = tl.load(kv_scale_ptr + 1)
    return k_scale, v_scale


@triton.jit
def fp8_pairs_as_fp16(words, CUDA: tl.constexpr):
    """int16 words, each two e4m3 bytes (dims 2c and 2c + 1 of a row), as two fp16 tensors: the low bytes'
    values and the high bytes' (every e4m3 value is exact in fp16). Read this way an fp8 tile reaches the dots'
    registers by ldmatrix, as a 16-bit one does, where a tile of bytes takes one shared-memory load and
    several moves per byte. CUDA: with two words to a 32-bit register, one PRMT gathers their low (or high)
    bytes and one cvt converts the pair. The interpreter, which has no inline assembly: bit operations put each
    byte's sign on fp16's sign bit and its other 7 bits (4 of exponent, 3 of mantissa) at the top of fp16's
    exponent-and-mantissa field under a zero top exponent bit; e4m3's bias is 7 and fp16's 15, so that is
    the value times 2^-8, subnormals included, and the 2^8 goes back on exactly."""
    if CUDA:
        lo = tl.inline_asm_elementwise(
            "{ .reg .b32 a; .reg .b16 l, h; prmt.b32 a, $1, 0, 0x20; mov.b32 {l, h}, a; "
            "cvt.rn.f16x2.e4m3x2 $0, l; }",
            "=r,r", [words], dtype=tl.float16, is_pure=True, pack=2,
        )  # fmt: skip
        hi = tl.inline_asm_elementwise(
            "{ .reg .b32 a; .reg .b16 l, h; prmt.b32 a, $1, 0, 0x31; mov.b32 {l, h}, a; "
            "cvt.rn.f16x2.e4m3x2 $0, l; }",
            "=r,r", [words], dtype=tl.float16, is_pure=True, pack=2,
        )  # fmt: skip
        return lo, hi
    w = words.to(tl.uint16, bitcast=True)
    lo = ((w << 8) & 0x8000) | ((w << 7) & 0x3F80)
    hi = (w & 0x8000) | ((w >> 1) & 0x3F80)
    return lo.to(tl.float16, bitcast=True) * 256.0, hi.to(tl.float16, bitcast=True) * 256.0
