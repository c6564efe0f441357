"""Paged decode attention: one query token per sequence over its paged K/V.

One program owns (sequence, kv head, split): it loads the group of query heads that share the
kv head as one (BLOCK_H, head_dim) tile, so each K/V row is read from memory once for all of
them, and walks its key range BLOCK_N rows (several pages) at a time with an online softmax.
Long contexts at small batch split the key range across programs (flash-decoding); the
partial states then merge in kernels/decode_reduce.py's separate launch. config={"fused_merge":
True} merges them inside the same launch instead: each split program stores its partial, takes
a ticket from a per-(sequence, kv head) counter, and the one that draws the last ticket merges
all of them (split-K "last block reduces"); measured slower on the H200 at 1 x 32k, so off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import _backend
from kernels.decode_reduce import (
    carve_workspace,
    decode_reduce_triton,
    decode_workspace_size,
    workspace_counters,
)
from kernels.paged_prefill_attention import gather_kv

LOG2E = 1.4426950408889634
MIN_PARTITION = 256  # keys per split at least: below that the reduce costs more than it saves
FP32_CONFIG = {"block_n": 32, "num_warps": 4, "num_stages": 2}  # 4-byte tiles: half the rows fit
# config["fused_merge"] unless given. Off: on the H200 the fused merge was slower (Llama-3-8B heads,
# 1 x 32k: 42.4 us against 39.6 with the merge as a second launch, same run; docs/kernels.md).
FUSED_MERGE = False
# config["pdl"] unless given: the split merge as a programmatic dependent launch. On (CUDA only; Triton
# needs launch_pdl): on the H200 it saved 0.3 us at Llama-3-8B 1 x 32k and 0.7 us at SmolLM2 1 x 32k
# (39.3 vs 39.6, 14.7 vs 15.4 us, same run).
PDL = True
# config["head_major"] unless given: launch order. True: grid (kv head, sequence, split), so a
# sequence's kv heads start side by side and between them read its pages whole; False: grid (sequence,
# kv head, split), programs that start together read one kv head of different sequences (256-byte rows
# 2 KiB apart in each page at Llama-3-8B). On the H200, head-major was faster at every batched shape
# (same run, A-B-A-B: Llama-3-8B 64 x 4096 244.8 vs 246.8 us, 256 x 1024 247.4 vs 252.5, SmolLM2
# 256 x 1024 52.5 vs 53.3).
HEAD_MAJOR = True
MERGE_ELEMS_PER_THREAD = 128  # fp32 partial elements per thread per fused-merge step (registers)
# config["merge_warps"] / ["merge_block_d"] unless given: the separate merge launch runs one program per
# (sequence, query head, 32 head_dim elements) with 2 warps, not per (sequence, query head) with 4. Its work
# is tiny (64 splits x 128 dims per head at 1 x 32k); what it costs is its latency after the split kernel
# (the split kernel alone: 37.0-37.5 us at Llama-3-8B 1 x 32k, with the merge 39.4-40.2). On the H200,
# same runs, A-B: 39.3-39.4 us against 40.2-40.3 with (4 warps, all 128 dims); SmolLM2 1 x 32k 14.4
# against 14.5.
MERGE_WARPS, MERGE_BLOCK_D = 2, 32


def default_config(head_dim: int, dtype: torch.dtype) -> dict:
    """64 keys per iteration, 2 warps, double-buffered: the best of the H200 sweeps (docs/kernels.md)."""
    if dtype == torch.float32:
        return FP32_CONFIG
    return {"block_n": 64, "num_warps": 2, "num_stages": 2}


@triton.jit
def _decode_tile(
    acc, m_i, l_i, q, qk_scale, n0, end, table, kv_base, dims,
    stride_c_kv, stride_c_block, stride_c_off,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over keys n0 .. n0 + BLOCK_N (MASKED: some are >= end)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        block_id = tl.load(table + pos // BLOCK_SIZE, mask=pos < end, other=0).to(tl.int64)
    else:
        block_id = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
    row_off = block_id * stride_c_block + (pos % BLOCK_SIZE) * stride_c_off  # (BLOCK_N,)
    k_ptrs = kv_base + row_off[:, None] + dims[None, :]  # (BLOCK_N, BLOCK_D)
    if MASKED or BLOCK_D != HEAD_DIM:
        kv_mask = (pos < end)[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(k_ptrs + stride_c_kv, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(k_ptrs + stride_c_kv)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)  # (BLOCK_H, BLOCK_N)
    if MASKED:
        s = tl.where((pos < end)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # scores in log2 units from here on
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])  # one FMA per score
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _merge_splits(
    out_ptr, part_ptr, ml_ptr, seq, kv_head, num_valid,
    stride_o_seq, stride_o_head, stride_p_seq, stride_p_head, stride_p_split,
    stride_ml_kind, stride_ml_seq, stride_ml_head,
    QUERY_GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    MERGE_S: tl.constexpr,
):  # fmt: skip
    """The fused merge: _decode_reduce_kernel's arithmetic for the group's QUERY_GROUP heads at once,
    MERGE_S splits per step as one (MERGE_S, GROUP_P2, BLOCK_D) tile."""
    rows = tl.arange(0, GROUP_P2)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * QUERY_GROUP + rows
    row_ok = rows < QUERY_GROUP
    dim_ok = dims < HEAD_DIM
    part_base = part_ptr + seq.to(tl.int64) * stride_p_seq + heads * stride_p_head  # (GROUP_P2,)
    ml_base = ml_ptr + seq.to(tl.int64) * stride_ml_seq + heads * stride_ml_head
    # padded rows start at max 0, not -inf: their weights stay 0 and nothing turns NaN
    m_run = tl.where(row_ok, float("-inf"), 0.0)
    l_run = tl.zeros((GROUP_P2,), tl.float32)
    acc = tl.zeros((GROUP_P2, BLOCK_D), tl.float32)
    # .cg: the partials were written by other programs (other SMs) during this launch; read them
    # from L2, the point of coherence, never from this SM's L1. The acq_rel ticket already orders
    # them, so this is belt and braces, and free: each value is read once, L1 would not help.
    for s0 in range(0, num_valid, MERGE_S):
        splits = s0 + tl.arange(0, MERGE_S)
        ok = (splits < num_valid)[:, None] & row_ok[None, :]  # (MERGE_S, GROUP_P2)
        ml_rows = ml_base[None, :] + splits[:, None]
        m = tl.load(ml_rows, mask=ok, other=float("-inf"), cache_modifier=".cg")
        l_part = tl.load(ml_rows + stride_ml_kind, mask=ok, other=0.0, cache_modifier=".cg")
        part_rows = part_base[None, :, None] + splits[:, None, None] * stride_p_split + dims[None, None, :]
        part = tl.load(
            part_rows, mask=ok[:, :, None] & dim_ok[None, None, :], other=0.0, cache_modifier=".cg"
        )  # (MERGE_S, GROUP_P2, BLOCK_D)
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        alpha = tl.exp2(m_run - m_new)
        w = tl.exp2(m - m_new[None, :])  # (MERGE_S, GROUP_P2), 0 for unused splits
        l_run = l_run * alpha + tl.sum(w * l_part, axis=0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * part, axis=0)
        m_run = m_new
    l_run = tl.where(l_run == 0.0, 1.0, l_run)
    out = out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head + dims[None, :]
    tl.store(out, (acc / l_run[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _paged_decode_kernel(
    # pointers
    out_ptr,
    part_ptr,
    ml_ptr,
    counters_ptr,
    query_ptr,
    kv_cache_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    # sizes
    qk_scale,
    partition_size,
    # strides
    stride_o_seq,
    stride_o_head,
    stride_p_seq,
    stride_p_head,
    stride_p_split,
    stride_ml_kind,
    stride_ml_seq,
    stride_ml_head,
    stride_q_seq,
    stride_q_head,
    stride_c_kv,
    stride_c_block,
    stride_c_off,
    stride_c_head,
    stride_bt_seq,
    # meta
    QUERY_GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    GROUP_P2: tl.constexpr,
    MERGE_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,
):
    if LAUNCH_DEPENDENTS:  # programmatic dependent launch: the merge kernel may start up now (it waits)
        tl.extra.cuda.gdc_launch_dependents()
    if HEAD_MAJOR:  # grid (kv head, sequence, split): a sequence's kv heads start side by side
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
        num_kv_heads = tl.num_programs(0)
    else:  # grid (sequence, kv head, split)
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * QUERY_GROUP + rows
    row_ok = rows < QUERY_GROUP
    dim_ok = dims < HEAD_DIM
    out_mask = row_ok[:, None] & dim_ok[None, :]
    out_rows = out_ptr + seq.to(tl.int64) * stride_o_seq + heads * stride_o_head  # (BLOCK_H,)
    # q before seq_len: the two loads' latencies overlap instead of adding up
    q_ptrs = query_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptrs, mask=out_mask, other=0.0)  # (BLOCK_H, BLOCK_D)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition_size
    if SPLIT:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if start >= seq_len:  # an unused split: it takes no ticket and the merge never reads it
            if FUSED_MERGE:  # noqa: SIM102 (seq_len 0: no split is valid, none merges)
                if split == 0:  # so split 0 writes the zeros itself
                    zeros = tl.zeros((BLOCK_H, BLOCK_D), out_ptr.dtype.element_ty)
                    tl.store(out_rows[:, None] + dims[None, :], zeros, mask=out_mask)
            return
    end = tl.minimum(start + partition_size, seq_len)

    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    kv_base = kv_cache_ptr + kv_head * stride_c_head
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = _decode_tile(
            acc, m_i, l_i, q, qk_scale, n0, end, table, kv_base, dims,
            stride_c_kv, stride_c_block, stride_c_off,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION,
        )  # fmt: skip
    for n0 in range(full_end, end, BLOCK_N):  # the ragged tail: at most one tile
        acc, m_i, l_i = _decode_tile(
            acc, m_i, l_i, q, qk_scale, n0, end, table, kv_base, dims,
            stride_c_kv, stride_c_block, stride_c_off,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION,
        )  # fmt: skip

    if SPLIT:  # the unnormalised partial state, see kernels/decode_reduce.py
        part_rows = (
            part_ptr + seq.to(tl.int64) * stride_p_seq + heads * stride_p_head + split * stride_p_split
        )
        tl.store(part_rows[:, None] + dims[None, :], acc, mask=out_mask)
        ml_rows = ml_ptr + seq.to(tl.int64) * stride_ml_seq + heads * stride_ml_head + split
        tl.store(ml_rows, m_i, mask=row_ok)
        tl.store(ml_rows + stride_ml_kind, l_i, mask=row_ok)
        if FUSED_MERGE:  # the last split of this (sequence, kv head) to finish merges them all
            # Publishing the partials: the scalar atomic below runs in one thread, so first every
            # thread's stores must be ordered before it (a CTA barrier, as CUTLASS's semaphore
            # does before its release); the gpu-scope release of the atomic is cumulative and
            # makes them visible to whichever program acquires the last ticket. Its acquire half
            # orders this program's reads of the other partials after their writers' releases
            # (Triton broadcasts the returned ticket to all threads through a CTA barrier).
            tl.debug_barrier()
            counter = counters_ptr + seq * num_kv_heads + kv_head
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            num_valid = tl.cdiv(seq_len, partition_size)  # what the reduce reads; unused splits took none
            if ticket == num_valid - 1:
                tl.store(counter, 0)  # every ticket is taken: zero again for the next call / replay
                _merge_splits(
                    out_ptr, part_ptr, ml_ptr, seq, kv_head, num_valid,
                    stride_o_seq, stride_o_head, stride_p_seq, stride_p_head, stride_p_split,
                    stride_ml_kind, stride_ml_seq, stride_ml_head,
                    QUERY_GROUP, GROUP_P2, HEAD_DIM, BLOCK_D, MERGE_S,
                )  # fmt: skip
    else:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # seq_len 0 writes zeros, not NaN
        out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_rows[:, None] + dims[None, :], out, mask=out_mask)


def plan_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Split the key range only when (sequence, kv head) programs cannot fill the GPU."""
    programs = num_seqs * num_kv_heads
    target = 4 * _backend.num_sms(device)
    if programs * 2 > target or max_seq_len <= 2 * MIN_PARTITION:
        return 1
    return max(1, min(triton.cdiv(target, programs), triton.cdiv(max_seq_len, MIN_PARTITION)))


def paged_decode_attention_triton(
    query: torch.Tensor,  # (num_seqs, num_heads, head_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    seq_lens: torch.Tensor,  # (num_seqs,) int32
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    scale: float,
    max_seq_len: int | None = None,
    *,
    num_splits: int | None = None,
    workspace: torch.Tensor | None = None,  # flat fp32, zero-initialised, >= decode_workspace_size(...)
    config: dict | None = None,
    out: torch.Tensor | None = None,  # preallocated output, e.g. a CUDA graph's buffer
) -> torch.Tensor:  # (num_seqs, num_heads, head_dim)
    """config: tile keys (block_n, num_warps, num_stages), "fused_merge" (default False: split
    partials merge in a separate decode_reduce launch; True: inside this launch), optionally
    "merge_splits" (a power of 2: splits per step of the fused merge), "merge_warps" and
    "merge_block_d" (the separate merge launch's warps and head_dim elements per program, default
    MERGE_WARPS and MERGE_BLOCK_D) and "pdl" (CUDA 12.3+, Hopper: the separate merge launch is a
    programmatic dependent launch, so its start-up overlaps the split kernel's tail; it waits for
    the split kernel's writes before reading them).

    workspace (only used when the key range is split): allocate it once with torch.zeros, at
    least decode_workspace_size(num_seqs, num_heads, num_splits, head_dim, num_kv_heads)
    elements, taking the largest num_seqs and num_splits of the calls that share it; its last
    num_seqs * num_kv_heads elements are int32 ticket counters, which every fused call leaves at
    zero again (kernels/decode_reduce.py). Left out, it is allocated per call (zeroed when fused).
    "head_major" (default HEAD_MAJOR) orders the grid (kv head, sequence, split) instead of
    (sequence, kv head, split); the output is the same bit for bit."""
    num_seqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.shape[4] == head_dim
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads over {num_kv_heads} kv heads"
    assert seq_lens.shape == (num_seqs,) and block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
    assert query.stride(2) == 1 and kv_cache.stride(4) == 1 and block_tables.stride(1) == 1
    assert query.dtype in (torch.float16, torch.bfloat16, torch.float32), f"query dtype {query.dtype}"
    cfg = {**default_config(head_dim, query.dtype), **(config or {})}
    fused = bool(cfg.get("fused_merge", FUSED_MERGE))
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.dtype == query.dtype and out.stride(2) == 1
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    if num_splits is None:
        num_splits = plan_num_splits(num_seqs, num_kv_heads, max_seq_len, query.device)
    partition = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), cfg["block_n"]) * cfg["block_n"]
    num_splits = triton.cdiv(max(max_seq_len, 1), partition)
    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    block_d = triton.next_power_of_2(head_dim)
    split = num_splits > 1
    fused = fused and split
    pdl = bool(cfg.get("pdl", PDL)) and split and not fused and query.is_cuda
    merge_s = 1
    if split:
        size = decode_workspace_size(num_seqs, num_heads, num_splits, head_dim, num_kv_heads)
        if workspace is None:  # the counters must start at zero; the two-kernel path has none
            workspace = (torch.zeros if fused else torch.empty)(size, device=query.device)
        if fused:
            assert workspace.numel() >= size, "workspace too small: see decode_workspace_size"
        part, ml = carve_workspace(workspace, num_seqs, num_heads, num_splits, head_dim)
        counters = workspace_counters(workspace, num_seqs, num_kv_heads) if fused else workspace
        ws_strides = (*part.stride()[:3], *ml.stride()[:3])
        budget = MERGE_ELEMS_PER_THREAD * 32 * cfg["num_warps"]
        merge_s = cfg.get("merge_splits") or max(1, budget // (group_p2 * block_d))
        merge_s = min(merge_s, triton.next_power_of_2(num_splits))
        assert merge_s & (merge_s - 1) == 0, f"merge_splits must be a power of 2, got {merge_s}"
    else:  # the pointers are unused: the kernel writes the normalised output directly
        part, ml, counters, ws_strides = out, out, out, (0, 0, 0, 0, 0, 0)
    head_major = bool(cfg.get("head_major", HEAD_MAJOR))
    grid = (num_kv_heads, num_seqs, num_splits) if head_major else (num_seqs, num_kv_heads, num_splits)
    _paged_decode_kernel[grid](
        out, part, ml, counters, query, kv_cache, seq_lens, block_tables,
        scale * LOG2E, partition,
        out.stride(0), out.stride(1), *ws_strides,
        query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        QUERY_GROUP=group,
        BLOCK_H=max(16, group_p2),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=cfg["block_n"],
        SPLIT=split,
        FUSED_MERGE=fused,
        GROUP_P2=group_p2,
        MERGE_S=merge_s,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        LAUNCH_DEPENDENTS=pdl,
        HEAD_MAJOR=head_major,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip
    if split and not fused:
        decode_reduce_triton(
            out,
            part,
            ml,
            seq_lens,
            partition,
            pdl=pdl,
            num_warps=cfg.get("merge_warps", MERGE_WARPS),
            block_d=cfg.get("merge_block_d", MERGE_BLOCK_D),
        )
    return out


def paged_decode_attention_reference(
    query: torch.Tensor,  # (num_seqs, num_heads, head_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    seq_lens: torch.Tensor,  # (num_seqs,) int32
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    scale: float,
) -> torch.Tensor:  # (num_seqs, num_heads, head_dim)
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens.tolist()):
        k, v = gather_kv(kv_cache, block_tables[i], seq_len)
        k = k.to(query.dtype).repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.to(query.dtype).repeat_interleave(num_heads // num_kv_heads, dim=1)
        o = F.scaled_dot_product_attention(
            query[i].unsqueeze(1), k.transpose(0, 1), v.transpose(0, 1), scale=scale
        )  # (num_heads, 1, head_dim)
        out[i] = o.squeeze(1)
    return out


def paged_decode_attention(
    query, kv_cache, seq_lens, block_tables, scale, max_seq_len=None, *, num_splits=None, workspace=None
):
    """num_splits / workspace (Triton only, see paged_decode_attention_triton): fixed for CUDA graphs."""
    if _backend.use_triton(query):
        return paged_decode_attention_triton(
            query,
            kv_cache,
            seq_lens,
            block_tables,
            scale,
            max_seq_len,
            num_splits=num_splits,
            workspace=workspace,
        )
    return paged_decode_attention_reference(query, kv_cache, seq_lens, block_tables, scale)
