"""The fp8 (e4m3) KV cache's kernels under Triton's interpreter, each against its torch reference's fp8 path
(quantize on write; dequantize, then attend on read), over many shapes and scales: the cache writes store
the same bytes, decode (split and unsplit) and prefill attention agree within fp32 tolerance. The
references themselves equal attention over the dequantized cache."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything here imports triton

import pytest
import torch

from engine.layers import RotaryEmbedding
from kernels.kv_cache_write import kv_cache_write_reference, kv_cache_write_triton
from kernels.kv_quant import FP8_DTYPE, FP8_MAX, dequantize, fp16_dots, quantize
from kernels.paged_decode_attention import (
    fp8_pairs,
    paged_decode_attention_reference,
    paged_decode_attention_triton,
)
from kernels.paged_prefill_attention import paged_prefill_attention_reference, paged_prefill_attention_triton
from kernels.rotary_kv_write import rotary_kv_write_reference, rotary_kv_write_triton
from tests.gpu.paged_inputs import every_fp8_pair, make_paged_kv, query_start_loc

# fp32 throughout; 10x the plain kernels' tolerance (tests/test_kernels.py): the kernels fold k_scale into
# the softmax scale where the references scale K first, and the scores here run to ~100, where that
# rounding difference moves a probability by ~1e-4. A missing or misplaced scale is off by 5% and more.
TOL = {"rtol": 1e-3, "atol": 1e-4}
# (num_heads, num_kv_heads, head_dim, block_size): GQA 1, 3, 4, 8; head_dim 64 and 128
HEADS = [(4, 4, 64, 16), (6, 2, 64, 32), (8, 2, 64, 16), (4, 1, 128, 32), (8, 1, 64, 8)]
SCALES = [(1.0, 1.0), (0.05, 0.2), (3.0, 0.5)]  # (k_scale, v_scale)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def fp8_paged(seq_lens, num_kv_heads, head_dim, block_size, k_scale, v_scale):
    """A shuffled paged cache quantized with the scales (values spread over fp8's range), its (2,) scales."""
    kv, tables, lens = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size)
    scale = torch.tensor([k_scale, v_scale])
    kv = kv * 4 * scale.view(2, 1, 1, 1, 1)  # |x| / scale up to ~20: normals and subnormals
    cache = torch.stack([quantize(kv[0], scale[0]), quantize(kv[1], scale[1])])
    return cache, tables, lens, scale


def dequantized(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.stack([dequantize(cache[i], scale[i], torch.float32) for i in range(2)])


def test_quantize_rounds_to_nearest_and_saturates():
    x = torch.tensor([0.0, 1.0, -1.0, 1.0625, 1.1875, 448.0, 500.0, -1e6, 2**-9, 2**-10])
    q = quantize(x, torch.tensor(1.0)).float()
    # ties to even; 2**-9 is the smallest subnormal, half of it a tie with 0
    assert q.tolist() == [0.0, 1.0, -1.0, 1.0, 1.25, 448.0, 448.0, -448.0, 2**-9, 0.0]
    y = torch.randn(10000) * 50
    err = (dequantize(quantize(y, torch.tensor(0.5)), torch.tensor(0.5), torch.float32) - y).abs()
    assert (err <= y.abs() * 2**-4 + 2**-10).all()  # e4m3: 3 mantissa bits, half an ulp of error
    assert quantize(y, torch.tensor(0.5)).dtype == FP8_DTYPE and FP8_MAX == 448.0


@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(1, 64, 16), (3, 64, 32), (2, 128, 16)])
@pytest.mark.parametrize("k_scale,v_scale", SCALES)
def test_kv_cache_write_stores_the_references_bytes(num_kv_heads, head_dim, block_size, k_scale, v_scale):
    kv = torch.randn(7, 2, num_kv_heads, head_dim) * 30
    key, value = kv[:, 0], kv[:, 1]  # strided views, as the model's projection gives them
    slots = torch.tensor([0, 5, -1, block_size + 3, 6 * block_size - 1, 2 * block_size, -1])
    scale = torch.tensor([k_scale, v_scale])
    cache = quantize(torch.randn(2, 6, block_size, num_kv_heads, head_dim), torch.tensor(1.0))
    expected = cache.clone()
    kv_cache_write_reference(key, value, expected, slots, scale)
    kv_cache_write_triton(key, value, cache, slots, scale)
    assert torch.equal(bits(cache), bits(expected))
    written = expected[0].flatten(0, 1)[slots[slots >= 0]]  # what the reference stored: key / k_scale
    assert torch.equal(bits(written), bits(quantize(key[slots >= 0], scale[0])))


def test_values_that_round_to_zero_keep_their_sign():
    """-1e-4 is stored as fp8's -0 (byte 0x80), as torch's cast stores it, not as +0."""
    row = torch.tensor([-1e-4, 1e-4, -3e-4, 0.0, -0.0, 1.0, -1.0, -(2**-11)]).view(1, 1, 8)
    cache = torch.zeros(2, 1, 16, 1, 8, dtype=FP8_DTYPE)
    expected = cache.clone()
    scale = torch.tensor([1.0, 0.5])
    kv_cache_write_reference(row, -row, expected, torch.tensor([3]), scale)
    kv_cache_write_triton(row, -row, cache, torch.tensor([3]), scale)
    assert torch.equal(bits(cache), bits(expected))
    assert bits(cache[0, 0, 3, 0]).tolist()[:5] == [0x80, 0x00, 0x80, 0x00, 0x80]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 64), (6, 2, 64), (8, 2, 128), (8, 1, 64)])
@pytest.mark.parametrize("k_scale,v_scale", SCALES[1:])
def test_rotary_kv_write_quantizes_as_the_reference(num_heads, num_kv_heads, head_dim, k_scale, v_scale):
    n, blocks, bs = 9, 12, 16
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim) * 20
    q, k, v = (
        t.view(n, -1, head_dim) for t in qkv.split([num_heads * head_dim, *[num_kv_heads * head_dim] * 2], -1)
    )
    cos_sin = RotaryEmbedding(head_dim, 10000.0, 512).cos_sin_cache(torch.float32, torch.device("cpu"))
    positions, slots = torch.randint(0, 512, (n,)), torch.randperm(blocks * bs)[:n]
    slots[::4] = -1
    scale = torch.tensor([k_scale, v_scale])
    got = torch.zeros(2, blocks, bs, num_kv_heads, head_dim, dtype=FP8_DTYPE)
    want = got.clone()
    q_ref = rotary_kv_write_reference(q.clone(), k, v, positions, cos_sin, want, slots, kv_scale=scale)
    q_got = rotary_kv_write_triton(q.clone(), k, v, positions, cos_sin, got, slots, kv_scale=scale)
    torch.testing.assert_close(q_got, q_ref, **TOL)  # q is never quantized
    assert torch.equal(bits(got), bits(want))


DECODE_LENS = [1, 15, 16, 17, 47, 100, 0]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", HEADS)
@pytest.mark.parametrize("k_scale,v_scale", SCALES)
def test_decode_reads_fp8(num_heads, num_kv_heads, head_dim, block_size, k_scale, v_scale):
    cache, tables, lens, scale = fp8_paged(DECODE_LENS, num_kv_heads, head_dim, block_size, k_scale, v_scale)
    assert fp8_pairs(cache)  # read as 16-bit words
    query = torch.randn(len(DECODE_LENS), num_heads, head_dim)
    ref = paged_decode_attention_reference(query, cache, lens, tables, head_dim**-0.5, scale)
    out = paged_decode_attention_triton(
        query, cache, lens, tables, head_dim**-0.5, kv_scale=scale, out=torch.full_like(query, float("nan"))
    )
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("num_splits,block_n", [(3, 16), (5, 32)])
def test_split_decode_reads_fp8(num_splits, block_n):
    lens_list = [320, 0, 5, 150, 77]
    cache, tables, lens, scale = fp8_paged(lens_list, 2, 64, 16, 0.05, 0.2)
    query = torch.randn(len(lens_list), 6, 64)
    ref = paged_decode_attention_reference(query, cache, lens, tables, 0.125, scale)
    out = paged_decode_attention_triton(
        query, cache, lens, tables, 0.125, max_seq_len=320, num_splits=num_splits, config={"block_n": block_n},
        kv_scale=scale, out=torch.full_like(query, float("nan")),
    )  # fmt: skip
    torch.testing.assert_close(out, ref, **TOL)


PREFILL_SEQS = [(1, 0), (5, 0), (7, 13), (20, 33), (3, 64), (0, 10)]  # (query_len, cached prefix)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", HEADS)
@pytest.mark.parametrize("k_scale,v_scale", SCALES[1:])
def test_prefill_reads_fp8(num_heads, num_kv_heads, head_dim, block_size, k_scale, v_scale):
    q_lens = [q for q, _ in PREFILL_SEQS]
    seq_lens = [q + c for q, c in PREFILL_SEQS]
    cache, tables, lens, scale = fp8_paged(seq_lens, num_kv_heads, head_dim, block_size, k_scale, v_scale)
    qsl = query_start_loc(q_lens)
    query = torch.randn(sum(q_lens), num_heads, head_dim)
    ref = paged_prefill_attention_reference(query, cache, qsl, lens, tables, head_dim**-0.5, scale)
    out = paged_prefill_attention_triton(
        query, cache, qsl, lens, tables, head_dim**-0.5, config={"block_m": 16, "block_n": 16},
        kv_scale=scale, out=torch.full_like(query, float("nan")),
    )  # fmt: skip
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", HEADS[1:3])
def test_bf16_queries_read_fp8_through_fp16_dots(num_heads, num_kv_heads, head_dim, block_size):
    """Under bf16 queries the kernels convert fp8 tiles to fp16 and run the dots in fp16 (fp16_dots): the
    outputs match the fp32 reference to the bf16 output's rounding, decode and prefill alike."""
    assert fp16_dots(True, torch.bfloat16) and not fp16_dots(True, torch.float32)
    q_lens = [q for q, _ in PREFILL_SEQS]
    seq_lens = [q + c for q, c in PREFILL_SEQS]
    cache, tables, lens, scale = fp8_paged(seq_lens, num_kv_heads, head_dim, block_size, 0.05, 0.2)
    tol = {"rtol": 1e-2, "atol": 1e-2}  # bf16 outputs: 2^-8 relative
    query = torch.randn(len(seq_lens), num_heads, head_dim).bfloat16()
    ref = paged_decode_attention_reference(query.float(), cache, lens, tables, head_dim**-0.5, scale)
    out = paged_decode_attention_triton(query, cache, lens, tables, head_dim**-0.5, kv_scale=scale)
    torch.testing.assert_close(out.float(), ref, **tol)
    qsl = query_start_loc(q_lens)
    query = torch.randn(sum(q_lens), num_heads, head_dim).bfloat16()
    ref = paged_prefill_attention_reference(query.float(), cache, qsl, lens, tables, head_dim**-0.5, scale)
    out = paged_prefill_attention_triton(
        query, cache, qsl, lens, tables, head_dim**-0.5, config={"block_m": 16, "block_n": 16}, kv_scale=scale
    )
    torch.testing.assert_close(out.float(), ref, **tol)


def test_references_dequantize_then_attend():
    """On an fp8 cache the references give exactly what they give on the dequantized fp32 cache."""
    cache, tables, lens, scale = fp8_paged([9, 40], 2, 64, 16, 0.05, 0.2)
    plain = dequantized(cache, scale)
    query = torch.randn(2, 4, 64)
    assert torch.equal(
        paged_decode_attention_reference(query, cache, lens, tables, 0.125, scale),
        paged_decode_attention_reference(query, plain, lens, tables, 0.125),
    )
    qsl = query_start_loc([3, 5])
    q = torch.randn(8, 4, 64)
    assert torch.equal(
        paged_prefill_attention_reference(q, cache, qsl, lens, tables, 0.125, scale),
        paged_prefill_attention_reference(q, plain, qsl, lens, tables, 0.125),
    )


def test_an_fp8_cache_without_scales_is_refused():
    cache, tables, lens, _ = fp8_paged([9], 2, 64, 16, 1.0, 1.0)
    with pytest.raises(AssertionError, match="kv_scale"):
        paged_decode_attention_triton(torch.randn(1, 4, 64), cache, lens, tables, 0.125)


def test_fp8_words_convert_as_torch_converts_their_bytes():
    """The decode reads an fp8 cache as 16-bit words; every word's two bytes come out as torch's fp8 -> fp16
    cast gives them (NaN bytes, 0x7F and 0xFF, aside: the cache never stores them)."""
    want, got = every_fp8_pair("cpu")
    finite = ~want.isnan()
    assert finite.sum() == 65536 * 2 - 2 * 2 * 256  # each byte position holds a NaN in 2 of its 256 values
    torch.testing.assert_close(got[finite], want[finite], rtol=0, atol=0)
    assert (got[finite].view(torch.int16) == want[finite].view(torch.int16)).all()  # -0.0 too


@pytest.mark.parametrize("head_dim", [16, 24])
def test_decode_reads_small_fp8_heads(head_dim):
    """16 dims: each half of a head is under a dot's depth (16), so the cache is read byte by byte, not as
    16-bit words. 24 dims: as words, the head padded to 32 (masked dims)."""
    cache, tables, lens, scale = fp8_paged(DECODE_LENS, 2, head_dim, 16, 0.05, 0.2)
    assert fp8_pairs(cache) == (head_dim == 24)
    query = torch.randn(len(DECODE_LENS), 4, head_dim)
    ref = paged_decode_attention_reference(query, cache, lens, tables, head_dim**-0.5, scale)
    out = paged_decode_attention_triton(query, cache, lens, tables, head_dim**-0.5, kv_scale=scale)
    torch.testing.assert_close(out, ref, **TOL)
