"""Each Triton kernel against its torch reference on small shapes, under Triton's interpreter.

fp32 throughout; tolerance rtol 1e-4, atol 1e-5 for attention (the interpreter computes in fp32
with a different summation order; the observed error is ~1e-6), exact equality for the cache
write (a copy). Outputs are poisoned with NaN before each run, so an unwritten element fails.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything here imports triton

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from engine.attention import PagedAttention
from engine.attention_metadata import AttentionMetadata
from kernels import _backend
from kernels.decode_reduce import decode_reduce_reference, decode_reduce_triton, decode_workspace_size
from kernels.kv_cache_write import kv_cache_write_reference, kv_cache_write_triton
from kernels.paged_decode_attention import (
    _paged_decode_kernel,
    paged_decode_attention_reference,
    paged_decode_attention_triton,
)
from kernels.paged_prefill_attention import paged_prefill_attention_reference, paged_prefill_attention_triton
from tests.gpu.paged_inputs import make_paged_kv, query_start_loc

# tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton (on machines without CUDA);
# without it the kernels cannot run on CPU tensors, and that must fail, not skip.
INTERPRETED = isinstance(_paged_decode_kernel, InterpretedFunction)
assert INTERPRETED, "triton was imported without TRITON_INTERPRET=1: run the CPU kernel tests under it"
TOL = {"rtol": 1e-4, "atol": 1e-5}
# (num_heads, num_kv_heads, head_dim, block_size): GQA ratios 1, 3, 4; head_dim 64 and 128
HEADS = [(4, 4, 64, 16), (6, 2, 64, 32), (8, 2, 64, 16), (4, 1, 128, 32)]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(1, 64, 16), (3, 64, 32), (2, 128, 16)])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_kv_cache_write(num_kv_heads, head_dim, block_size, slot_dtype):
    kv_cache = torch.randn(2, 6, block_size, num_kv_heads, head_dim)
    # K and V as strided views of one fused projection output, like the model produces them
    kv = torch.randn(7, 2, num_kv_heads, head_dim)
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.tensor([0, 5, -1, block_size + 3, 6 * block_size - 1, 2 * block_size, -1], dtype=slot_dtype)
    expected = kv_cache.clone()
    kv_cache_write_reference(key, value, expected, slots.long())
    kv_cache_write_triton(key, value, kv_cache, slots)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", HEADS)
def test_decode_ragged(num_heads, num_kv_heads, head_dim, block_size):
    seq_lens = [1, 15, 16, 17, 47, 100]
    kv_cache, tables, lens = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size)
    query = torch.randn(len(seq_lens), num_heads, head_dim)
    ref = paged_decode_attention_reference(query, kv_cache, lens, tables, head_dim**-0.5)
    out = paged_decode_attention_triton(query, kv_cache, lens, tables, head_dim**-0.5, out=poisoned(query))
    torch.testing.assert_close(out, ref, **TOL)


def split_workspace(num_seqs, num_heads, num_splits, head_dim):
    """NaN-poisoned partial states: an unwritten split that is read fails."""
    return torch.full((decode_workspace_size(num_seqs, num_heads, num_splits, head_dim),), float("nan"))


@pytest.mark.parametrize("num_splits,block_n", [(None, 64), (3, 16), (5, 32)])
def test_decode_split_kv(num_splits, block_n):
    seq_lens = [700, 1, 130, 333]  # splits past a short sequence's end are skipped, never read
    kv_cache, tables, lens = make_paged_kv(seq_lens, 2, 64, 16)
    query = torch.randn(len(seq_lens), 6, 64)
    ref = paged_decode_attention_reference(query, kv_cache, lens, tables, 0.125)
    workspace = split_workspace(len(seq_lens), 6, 16, 64)
    out = paged_decode_attention_triton(
        query, kv_cache, lens, tables, 0.125, max_seq_len=700, num_splits=num_splits,
        config={"block_n": block_n}, workspace=workspace, out=poisoned(query),
    )  # fmt: skip
    torch.testing.assert_close(out, ref, **TOL)
    assert not workspace.isnan().all(), "expected the split path (num_sms is 8 under the interpreter)"


# (num_heads, num_kv_heads, head_dim, block_size, num_splits): GQA 1/3/4 at head_dim 64, 2..5 splits
SPLIT_CASES = [(*HEADS[0], 2), (*HEADS[1], 3), (*HEADS[2], 4), (*HEADS[1], 5)]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,num_splits", SPLIT_CASES)
def test_decode_split_merge(num_heads, num_kv_heads, head_dim, block_size, num_splits):
    """Lengths: empty, shorter than one partition (the other splits unused, never read), partial and
    all splits (max_seq_len 320 in 32-key tiles gives exactly num_splits partitions). A second call
    on the same workspace gives the same answer."""
    seq_lens = [320, 0, 5, 150]
    kv_cache, tables, lens = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size)
    num_seqs = len(seq_lens)
    query = torch.randn(num_seqs, num_heads, head_dim)
    ref = paged_decode_attention_reference(query, kv_cache, lens, tables, head_dim**-0.5)
    workspace = split_workspace(num_seqs, num_heads, num_splits, head_dim)

    def run():
        return paged_decode_attention_triton(
            query, kv_cache, lens, tables, head_dim**-0.5, max_seq_len=320, num_splits=num_splits,
            config={"block_n": 32}, workspace=workspace, out=poisoned(query),
        )  # fmt: skip

    out = run()
    torch.testing.assert_close(out, ref, **TOL)
    assert torch.equal(out[1], torch.zeros_like(out[1])), "seq_len 0 must give zeros"
    assert workspace[: num_seqs * num_heads * num_splits * head_dim].isnan().any(), "expected unused splits"
    assert torch.equal(run(), out), "the same workspace again must give the same answer"


def test_decode_split_own_workspace():
    """Without a workspace the launcher allocates one."""
    kv_cache, tables, lens = make_paged_kv([0, 300, 70], 2, 64, 16)
    query = torch.randn(3, 8, 64)
    ref = paged_decode_attention_reference(query, kv_cache, lens, tables, 0.125)
    out = paged_decode_attention_triton(
        query, kv_cache, lens, tables, 0.125, max_seq_len=300, num_splits=3, out=poisoned(query)
    )
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("block_d", [None, 16])  # all of head_dim per program, or a slice of it each
def test_decode_reduce_matches_reference(block_d):
    acc, ml = torch.randn(3, 2, 4, 64), torch.rand(2, 3, 2, 4) + 0.5
    seq_lens = torch.tensor([1, 100, 0], dtype=torch.int32)
    ref = decode_reduce_reference(acc, ml, seq_lens, 32, torch.float32)
    out = decode_reduce_triton(poisoned(ref), acc, ml, seq_lens, 32, block_d=block_d)
    torch.testing.assert_close(out, ref, **TOL)


def test_decode_empty_sequence_writes_zeros():
    kv_cache, tables, lens = make_paged_kv([0, 5], 1, 64, 16)
    out = paged_decode_attention_triton(torch.randn(2, 2, 64), kv_cache, lens, tables, 0.125, out=poisoned(
        torch.empty(2, 2, 64)))  # fmt: skip
    assert torch.equal(out[0], torch.zeros(2, 64)) and not out[1].isnan().any()


# (query_len, cached prefix length): decode rows, a fresh prompt, chunks over prefixes that end
# mid-block and on a block boundary, a spec-verify-sized chunk, and an empty row
PREFILL_SEQS = [(1, 0), (5, 0), (7, 13), (20, 33), (3, 64), (4, 47), (0, 10)]


# every head shape with small tiles; the launcher's own tile choice on the head_dim-64 shapes
# (one head_dim-128 case is enough for the interpreter's time)
PREFILL_CASES = [(*h, {"block_m": 16, "block_n": 16}) for h in HEADS] + [
    (*h, None) for h in HEADS if h[2] == 64
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,config", PREFILL_CASES)
def test_prefill_over_cached_prefix(num_heads, num_kv_heads, head_dim, block_size, config):
    q_lens = [q for q, _ in PREFILL_SEQS]
    seq_lens = [q + c for q, c in PREFILL_SEQS]
    kv_cache, tables, lens = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size)
    qsl = query_start_loc(q_lens)
    query = torch.randn(sum(q_lens), num_heads, head_dim)
    ref = paged_prefill_attention_reference(query, kv_cache, qsl, lens, tables, head_dim**-0.5)
    out = paged_prefill_attention_triton(
        query, kv_cache, qsl, lens, tables, head_dim**-0.5, config=config, out=poisoned(query)
    )
    torch.testing.assert_close(out, ref, **TOL)


def test_engine_attention_triton_equals_torch(monkeypatch):
    """Prefill a prompt in two chunks, then decode two steps; both backends give the same rows."""
    attn = PagedAttention(num_heads=6, num_kv_heads=2, head_dim=64, scale=0.125)
    steps = [([20], [20]), ([9], [29]), ([1], [30]), ([1], [31])]  # (query_lens, seq_lens)
    table = [[3, 0]]
    inputs = [
        (torch.randn(q[0], 6, 64), torch.randn(q[0], 2, 64), torch.randn(q[0], 2, 64)) for q, _ in steps
    ]
    outs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setattr(_backend, "FORCED_BACKEND", backend)
        kv_cache = torch.zeros(2, 4, 16, 2, 64)
        outs[backend] = [
            attn(q, k, v, kv_cache, AttentionMetadata.build(q_lens, s_lens, table, block_size=16))
            for (q, k, v), (q_lens, s_lens) in zip(inputs, steps, strict=True)
        ]
    for got, want in zip(outs["triton"], outs["torch"], strict=True):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_engine_attention_mixed_step_reads_decode_rows_with_the_decode_kernel(monkeypatch, backend):
    """Two decode rows, then two prompt chunks over cached prefixes: the decode kernel takes the two
    leading rows, the prefill kernel the two chunks, and every row equals its sequence attended alone."""
    from engine import attention

    monkeypatch.setattr(_backend, "FORCED_BACKEND", backend)
    calls: list[tuple[str, int]] = []
    decode, prefill = attention.paged_decode_attention, attention.paged_prefill_attention

    def spy_decode(q, *args, **kwargs):
        calls.append(("decode", q.shape[0]))
        return decode(q, *args, **kwargs)

    layouts = []

    def spy_prefill(q, kv_cache, qsl, *args, **kwargs):
        calls.append(("prefill", qsl.shape[0] - 1))
        layouts.append((qsl, *args[:2]))
        return prefill(q, kv_cache, qsl, *args, **kwargs)

    monkeypatch.setattr(attention, "paged_decode_attention", spy_decode)
    monkeypatch.setattr(attention, "paged_prefill_attention", spy_prefill)
    attn = PagedAttention(num_heads=6, num_kv_heads=2, head_dim=64, scale=0.125)
    q_lens, s_lens = [1, 1, 9, 20], [30, 17, 29, 20]
    tables = [[0, 1], [2, 3], [4, 5], [6, 7]]
    prefix = torch.randn(2, 8, 16, 2, 64)  # every sequence's cached keys and values
    q, k, v = (torch.randn(sum(q_lens), h, 64) for h in (6, 2, 2))
    meta = AttentionMetadata.build(q_lens, s_lens, tables, block_size=16)
    assert meta.num_decode_seqs == 2
    cache = prefix.clone()
    got = attn(q, k, v, cache, meta)  # (num_tokens, num_heads * head_dim); writes k and v into cache
    assert calls == [("prefill", 2), ("decode", 2)]
    ((qsl, lens, chunk_tables),) = layouts
    assert qsl.tolist() == [2, 11, 31] and lens.tolist() == [29, 20] and chunk_tables.tolist() == tables[2:]
    # tensors of their own, not slices 8 bytes into the step's: Triton compiles again for unaligned pointers
    assert all(t.data_ptr() % 16 == 0 for t in (qsl, lens, chunk_tables))
    starts = [0, 1, 2, 11, 31]
    for i in range(4):
        rows = slice(starts[i], starts[i + 1])
        want = paged_prefill_attention_reference(
            q[rows], cache, torch.tensor([0, q_lens[i]], dtype=torch.int32),
            torch.tensor([s_lens[i]], dtype=torch.int32), torch.tensor([tables[i]], dtype=torch.int32), 0.125,
        )  # fmt: skip
        torch.testing.assert_close(got[rows], want.flatten(1), **TOL)
