"""Triton kernels vs their torch references on the GPU, over many shapes.

Error metric: ||out - ref|| / ||ref||, ref computed by the reference on fp32 upcasts of the same
inputs. Bounds: fp32 1e-5 (ieee dots), fp16 2e-3, bf16 1e-2 (P and the output round to 8 bits).
Outputs are poisoned with NaN first: any unwritten element fails. The cache write is exact.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import PagedAttention
from engine.attention_metadata import AttentionMetadata
from kernels import _backend
from kernels.decode_reduce import decode_workspace_size
from kernels.kv_cache_write import kv_cache_write_reference, kv_cache_write_triton
from kernels.paged_decode_attention import paged_decode_attention_reference, paged_decode_attention_triton
from kernels.paged_prefill_attention import paged_prefill_attention_reference, paged_prefill_attention_triton
from tests.gpu.paged_inputs import make_paged_kv, query_start_loc

DEV = "cuda"
BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# (num_heads, num_kv_heads, head_dim): Llama-3-8B, SmolLM2, MHA, GQA 3 at 128, MQA-like 8
HEADS = [(32, 8, 128), (9, 3, 64), (4, 4, 64), (12, 4, 128), (8, 1, 128)]


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "unwritten (NaN-poisoned) or NaN output"
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < BOUND[dtype], f"relative error {err:.2e} over {BOUND[dtype]:.0e}"


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def ragged(n: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, hi) for _ in range(n)]


DECODE_BATCHES = {
    "edges": [1, 2, 15, 16, 17, 31, 33, 64, 65],
    "ragged256": ragged(256, 1024, 1),
    "b1x32k": [32768],
}


def run_decode(heads, block_size, seq_lens, dtype, **kwargs):
    num_heads, num_kv_heads, head_dim = heads
    kv_cache, tables, lens = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, DEV)
    query = torch.randn(len(seq_lens), num_heads, head_dim, device=DEV, dtype=dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention_triton(query, kv_cache, lens, tables, scale, out=nan_like(query), **kwargs)
    ref = paged_decode_attention_reference(query.float(), kv_cache.float(), lens, tables, scale)
    check(out, ref, dtype)


@pytest.mark.parametrize("batch", list(DECODE_BATCHES))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_decode_bf16(heads, block_size, batch):
    run_decode(heads, block_size, DECODE_BATCHES[batch], torch.bfloat16)


def test_decode_b64x4096_llama():
    run_decode((32, 8, 128), 16, [4096] * 64, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64)], ids=str)
def test_decode_dtypes(heads, dtype):
    run_decode(heads, 16, DECODE_BATCHES["edges"] + ragged(40, 3000, 2), dtype)


@pytest.mark.parametrize("num_splits", [2, 7, 64, 300])
def test_decode_forced_splits(num_splits):
    run_decode((32, 8, 128), 16, [8191, 5000, 1, 300], torch.bfloat16, num_splits=num_splits)


def test_decode_split_merge_no_stale_partials():
    """The merge, a programmatic dependent launch, reads partials the split kernel wrote while the
    merge was already starting up. The partial region is NaN-poisoned before every call and the
    queries alternate, so a partial read before its store is visible gives NaN or the other
    query's answer; the merge order is fixed, so a correct call reproduces its first answer bit
    for bit. seq_len 0 gives zeros."""
    (num_heads, num_kv_heads, head_dim), splits = (32, 8, 128), 64
    seq_lens = [8191, 1, 0, 5000, 32768]
    kv_cache, tables, lens = make_paged_kv(seq_lens, num_kv_heads, head_dim, 16, torch.bfloat16, DEV)
    queries = [
        torch.randn(len(seq_lens), num_heads, head_dim, device=DEV, dtype=torch.bfloat16) for _ in range(2)
    ]
    workspace = torch.empty(decode_workspace_size(len(seq_lens), num_heads, splits, head_dim), device=DEV)
    scale = head_dim**-0.5
    run = lambda q: paged_decode_attention_triton(
        q, kv_cache, lens, tables, scale, max_seq_len=32768, num_splits=splits, workspace=workspace
    )
    first = [run(q).clone() for q in queries]
    keep = torch.tensor([i for i, n in enumerate(seq_lens) if n > 0], device=DEV)  # SDPA gets no empty rows
    for q, out in zip(queries, first, strict=True):
        assert torch.equal(out[2], torch.zeros_like(out[2])), "seq_len 0 must give zeros"
        ref = paged_decode_attention_reference(
            q[keep].float(), kv_cache.float(), lens[keep], tables[keep], scale
        )
        check(out[keep], ref, torch.bfloat16)
    for i in range(200):
        workspace.fill_(float("nan"))
        assert torch.equal(run(queries[i % 2]), first[i % 2]), f"call {i} differs from the first"


def test_decode_cuda_graph_replay_with_new_lengths():
    """Preallocated out + workspace, fixed splits: one captured graph serves a growing batch."""
    num_heads, num_kv_heads, head_dim, bs = 32, 8, 128, 16
    kv_cache, tables, lens = make_paged_kv([3000, 17, 900], num_kv_heads, head_dim, bs, torch.bfloat16, DEV)
    query = torch.randn(3, num_heads, head_dim, device=DEV, dtype=torch.bfloat16)
    out = nan_like(query)
    workspace = torch.empty(decode_workspace_size(3, num_heads, 16, head_dim), device=DEV)
    kwargs = dict(max_seq_len=3008, num_splits=16, workspace=workspace, out=out)
    run = lambda: paged_decode_attention_triton(query, kv_cache, lens, tables, 0.088, **kwargs)
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(3):
        lens += 1  # each sequence grew by one token, inside pages it already has
        query.normal_()
        graph.replay()
        ref = paged_decode_attention_reference(query.float(), kv_cache.float(), lens, tables, 0.088)
        check(out, ref, torch.bfloat16)


PREFILL_BATCHES = {  # (query_len, cached prefix)
    "ragged_mixed": [(1, 100), (17, 0), (300, 1000), (128, 128), (5, 31), (0, 7), (64, 4000), (129, 15)],
    "spec_verify": [(4, n) for n in ragged(16, 5000, 3)],
}


def run_prefill(heads, block_size, seqs, dtype, **kwargs):
    num_heads, num_kv_heads, head_dim = heads
    q_lens = [q for q, _ in seqs]
    kv_cache, tables, lens = make_paged_kv(
        [q + c for q, c in seqs], num_kv_heads, head_dim, block_size, dtype, DEV
    )
    qsl = query_start_loc(q_lens, DEV)
    query = torch.randn(sum(q_lens), num_heads, head_dim, device=DEV, dtype=dtype)
    scale = head_dim**-0.5
    out = paged_prefill_attention_triton(
        query, kv_cache, qsl, lens, tables, scale, out=nan_like(query), **kwargs
    )
    ref = paged_prefill_attention_reference(query.float(), kv_cache.float(), qsl, lens, tables, scale)
    check(out, ref, dtype)


@pytest.mark.parametrize("batch", list(PREFILL_BATCHES))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_prefill_bf16(heads, block_size, batch):
    run_prefill(heads, block_size, PREFILL_BATCHES[batch], torch.bfloat16)


@pytest.mark.parametrize("seqs", [[(4096, 0)], [(1024, 3072), (512, 1000)]], ids=["fresh4k", "prefix"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_llama_long(seqs, block_size):
    run_prefill((32, 8, 128), block_size, seqs, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64)], ids=str)
def test_prefill_dtypes(heads, dtype):
    run_prefill(heads, 16, PREFILL_BATCHES["ragged_mixed"], dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_kv_cache_write(dtype, slot_dtype):
    num_tokens, num_kv_heads, head_dim, bs, num_blocks = 4096, 8, 128, 16, 400
    kv_cache = torch.randn(2, num_blocks, bs, num_kv_heads, head_dim, device=DEV).to(dtype)
    qkv = torch.randn(num_tokens, 48, head_dim, device=DEV)  # K, V as views into a fused projection
    key, value = qkv[:, 32:40], qkv[:, 40:48]
    slots = torch.randperm(num_blocks * bs, device=DEV)[:num_tokens]
    slots[::7] = -1
    expected = kv_cache.clone()
    kv_cache_write_reference(key, value, expected, slots)
    kv_cache_write_triton(key, value, kv_cache, slots.to(slot_dtype))
    assert torch.equal(kv_cache, expected)


def test_engine_attention_triton_vs_torch(monkeypatch):
    """A 2-chunk prefill, 3 decode steps, then a decode row beside a chunk, through the engine's module,
    each backend."""
    attn = PagedAttention(num_heads=32, num_kv_heads=8, head_dim=128, scale=128**-0.5)
    steps = [([700, 33], [700, 33]), ([300, 1], [1000, 34])] + [
        ([1, 1], [1000 + i, 34 + i]) for i in (1, 2, 3)
    ]
    steps.append(([1, 10], [1004, 47]))  # a leading decode row (the decode kernel), then a chunk
    tables = [list(range(0, 63)), list(range(63, 66))]
    inputs = [
        tuple(torch.randn(sum(q), h, 128, device=DEV, dtype=torch.bfloat16) for h in (32, 8, 8))
        for q, _ in steps
    ]
    outs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setattr(_backend, "FORCED_BACKEND", backend)
        kv_cache = torch.zeros(2, 70, 16, 8, 128, device=DEV, dtype=torch.bfloat16)
        outs[backend] = [
            attn(
                q, k, v, kv_cache, AttentionMetadata.build(q_lens, s_lens, tables, block_size=16, device=DEV)
            )
            for (q, k, v), (q_lens, s_lens) in zip(inputs, steps, strict=True)
        ]
    for got, want in zip(outs["triton"], outs["torch"], strict=True):
        check(got, want, torch.bfloat16)


# ---- mixture of experts (kernels/fused_moe.py) ----------------------------------------------------


def moe_case(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=DEV, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=DEV, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=DEV, generator=gen) / inter**0.5).to(dtype)
    probs = torch.softmax(torch.randn(tokens, experts, device=DEV, generator=gen), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k"),
    [(1, 2048, 768, 128, 8), (2, 2048, 768, 128, 8), (7, 2048, 768, 128, 8), (300, 2048, 768, 128, 8), (1, 1024, 1792, 8, 2),
     (65, 1000, 200, 8, 2), (513, 1024, 1792, 8, 2)],
)  # fmt: skip
def test_fused_moe_matches_reference(tokens, hidden, inter, experts, top_k, dtype):
    from kernels.fused_moe import fused_moe_reference, fused_moe_triton

    x, w13, w2, weights, ids = moe_case(tokens, hidden, inter, experts, top_k, dtype, seed=tokens)
    ref = fused_moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    check(fused_moe_triton(x, w13, w2, weights, ids), ref, dtype)


@pytest.mark.parametrize("tiles", [(128, 128, 64, 8, 3), (64, 256, 64, 8, 3), (128, 64, 32, 4, 4)])
def test_fused_moe_prefill_tiles_match_reference(tiles):
    """The tiles bench.moe --sweep times for prefill's many rows an expert."""
    from kernels.fused_moe import Tiles, fused_moe_reference, fused_moe_triton

    m, n, k, warps, stages = tiles
    x, w13, w2, weights, ids = moe_case(700, 1024, 768, 8, 2, torch.bfloat16, seed=7)
    cfg = Tiles(n, n, warps, block_m=m, block_k=k, stages=stages)
    ref = fused_moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    check(fused_moe_triton(x, w13, w2, weights, ids, cfg), ref, torch.bfloat16)


def test_fused_moe_replays_in_a_cuda_graph():
    """Captured once, replayed on other tokens choosing other experts: the alignment runs on the GPU."""
    from kernels.fused_moe import fused_moe_reference, fused_moe_triton

    x, w13, w2, weights, ids = moe_case(8, 512, 256, 16, 4, torch.bfloat16, seed=0)
    fused_moe_triton(x, w13, w2, weights, ids)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(x, w13, w2, weights, ids)
    for seed in (1, 2):
        nx, _, _, nweights, nids = moe_case(8, 512, 256, 16, 4, torch.bfloat16, seed=seed)
        x.copy_(nx), weights.copy_(nweights), ids.copy_(nids)
        graph.replay()
        check(out, fused_moe_reference(x.float(), w13.float(), w2.float(), weights, ids), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "group", "act_order"),
    [(1, 128, False), (8, 128, False), (9, 64, False), (300, 128, False), (1, 32, False), (2, 128, True),
     (300, 128, True)],
)  # fmt: skip
def test_fused_moe_int4_matches_reference(tokens, group, act_order, dtype):
    """Int4 experts (AWQ / GPTQ, rows layout), Qwen3-30B-A3B's shape: up to 8 tokens (64 pairs) the GEMVs of
    kernels/fused_moe_gemv.py, then the grouped kernels, dequantizing in registers; GPTQ act order reads x and the
    activations through each expert's permutation, or down's folded into gate_up's columns."""
    from kernels.fused_moe import Int4Experts, down_order_folded, fused_moe_reference, fused_moe_triton
    from kernels.int4_dequant import pack_rows

    hidden, inter, experts, top_k = 2048, 768, 128, 8
    x, _, _, weights, ids = moe_case(tokens, 64, 32, experts, top_k, dtype, seed=tokens)
    x = torch.randn(tokens, hidden, device=DEV, dtype=dtype)
    gen = torch.Generator(device=DEV).manual_seed(group)

    def stack(n: int, k: int) -> Int4Experts:
        q = torch.randint(0, 16, (experts, k, n), device=DEV, generator=gen, dtype=torch.uint8)
        scales = (torch.rand(experts, k // group, n, device=DEV, generator=gen) * 0.01 + 0.002).half()
        zeros = torch.randint(0, 16, (experts, k // group, n), device=DEV, generator=gen, dtype=torch.uint8)
        perm = None
        if act_order:
            perm = torch.stack([torch.randperm(k, device=DEV, generator=gen) for _ in range(experts)]).int()
        return Int4Experts(torch.stack([pack_rows(q[e]) for e in range(experts)]), scales, zeros, group, perm)

    w13, w2 = stack(2 * inter, hidden), stack(hidden, inter)
    ref = fused_moe_reference(x.float(), w13, w2, weights, ids)
    check(fused_moe_triton(x, w13, w2, weights, ids), ref, dtype)
    if act_order:  # down's order folded into gate_up's columns, as a model's layers load them
        check(fused_moe_triton(x, *down_order_folded(w13, w2), weights, ids), ref, dtype)


@pytest.mark.parametrize("kquant", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 9, 300])
def test_fused_moe_gguf_experts_match_reference(tokens, dtype, kquant):
    """GGUF experts kept quantized, Qwen3-30B-A3B's shape: gate/up Q4_1 (float offsets), down Q8_0 (int8 rows); or
    as Q4_K and Q6_K load (fp32 scales and offsets, int8 groups of 16)."""
    from kernels.fused_moe import Int4Experts, Int8Experts, fused_moe_reference, fused_moe_triton
    from kernels.int4_dequant import pack_rows

    hidden, inter, experts, top_k = 2048, 768, 128, 8
    _, _, _, weights, ids = moe_case(tokens, 64, 32, experts, top_k, dtype, seed=tokens)
    x = torch.randn(tokens, hidden, device=DEV, dtype=dtype)
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    q = torch.randint(0, 16, (experts, hidden, 2 * inter), device=DEV, generator=gen, dtype=torch.uint8)
    scales = (torch.rand(experts, hidden // 32, 2 * inter, device=DEV, generator=gen) * 0.01 + 0.002).half()
    offsets = (torch.rand(experts, hidden // 32, 2 * inter, device=DEV, generator=gen) * -0.08).half()
    if kquant:
        scales, offsets = scales.float(), offsets.float()
    w13 = Int4Experts(torch.stack([pack_rows(q[e]) for e in range(experts)]), scales, offsets, 32)
    group = 16 if kquant else 32
    q8 = torch.randint(-127, 128, (experts, hidden, inter), device=DEV, generator=gen, dtype=torch.int8)
    s8 = torch.rand(experts, hidden, inter // group, device=DEV, generator=gen) * 0.0004 + 0.0001
    w2 = Int8Experts(q8, s8 if kquant else s8.half(), group)
    ref = fused_moe_reference(x.float(), w13, w2, weights, ids)
    check(fused_moe_triton(x, w13, w2, weights, ids), ref, dtype)


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "renormalize", "round_to"),
    [(1, 128, 8, True, torch.bfloat16), (300, 128, 8, False, torch.bfloat16), (7, 60, 4, False, torch.float16),
     (64, 8, 2, True, None)],
)  # fmt: skip
def test_route_kernel_matches_reference(tokens, experts, top_k, renormalize, round_to):
    """The router's softmax, top k, renormalising and rounding in one kernel; from bf16 logits, which tie often, a
    top k whose order among equal probabilities is the kernel's own (the lowest expert first)."""
    from kernels.moe_route import route_reference, route_triton

    logits = torch.randn(tokens, experts, device=DEV) * 3  # fp32: no ties
    want_w, want_ids = route_reference(logits, top_k, renormalize, round_to)
    got_w, got_ids = route_triton(logits, top_k, renormalize, round_to)
    assert torch.equal(got_ids, want_ids)
    ulp = {None: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[round_to]  # one fp32 ulp may round apart
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=ulp)
    tied = logits.to(torch.bfloat16)
    got_w, got_ids = route_triton(tied, top_k, renormalize, round_to)
    torch.testing.assert_close(
        got_w, route_reference(tied, top_k, renormalize, round_to)[0], atol=1e-6, rtol=ulp
    )
    probs = torch.softmax(tied.float(), dim=-1)
    assert torch.equal(probs.gather(1, got_ids.long()), torch.topk(probs, top_k, dim=-1).values)
    assert all(len(set(row)) == top_k for row in got_ids.tolist())
