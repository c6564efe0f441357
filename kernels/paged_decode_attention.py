"""Paged decode attention: one query token per sequence over its paged K/V.

One program owns (kv head, sequence, split): it loads the group of query heads that share the
kv head as one (BLOCK_H, head_dim) tile, so each K/V row is read from memory once for all of
them, and walks its key range BLOCK_N rows (several pages) at a time with an online softmax.
The grid is head-major, so a sequence's kv heads start side by side and between them read its
pages whole. Long contexts at small batch split the key range across programs (flash-decoding);
the partial states then merge in kernels/decode_reduce.py's separate launch, which on CUDA is a
programmatic dependent launch: its start-up overlaps this kernel's tail. An fp8 cache is read as fp8 (half
the bytes), as 16-bit words of two dims each, and converted in registers (kernels/online_softmax.py:
online_softmax_tile_fp8; k_scale folded into the softmax scale, v_scale applied to the output).
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
)
from kernels.kv_quant import FP8_DTYPE, as_read, fp16_dots, load_scales, scale_args
from kernels.online_softmax import LOG2E, online_softmax_tile, online_softmax_tile_fp8
from kernels.paged_prefill_attention import gather_kv
from kernels.pdl import pdl, pdl_entry, pdl_launch

MIN_PARTITION = 256  # keys per split at least: below that the reduce costs more than it saves
FP32_CONFIG = {"block_n": 32, "num_warps": 4, "num_stages": 2}  # 4-byte tiles: half the rows fit
# config["merge_warps"] / ["merge_block_d"] unless given: the merge launch runs one program per
# (sequence, query head, 32 head_dim elements) with 2 warps. Its work is tiny (64 splits x 128 dims per
# head at 1 x 32k); what it costs is its latency after the split kernel (docs/kernels.md).
MERGE_WARPS, MERGE_BLOCK_D = 2, 32


# programs per SM the split plan aims at: a 16-bit cache's 2-warp programs hold 4 an SM (registers); an fp8
# cache's 1-warp programs hold about 10, and 8 an SM is one full wave (see plan_num_splits)
PROGRAMS_PER_SM, FP8_PROGRAMS_PER_SM = 4, 8


def default_config(head_dim: int, dtype: torch.dtype, one_warp: bool = False) -> dict:
    """64 keys per iteration, double-buffered, 2 warps: the best of the H200 sweeps (docs/kernels.md).
    one_warp (fp8_one_warp): an fp8 launch that fills the GPU runs its programs with one warp each."""
    if dtype == torch.float32:
        return FP32_CONFIG
    return {"block_n": 64, "num_warps": 1 if one_warp else 2, "num_stages": 2}


# the block tables' width and the workspace's split strides change with the step's batch: one variant for all
# (kernels/_backend.py: compiled_variants)
@triton.jit(
    do_not_specialize=[
        "stride_p_seq", "stride_p_head", "stride_ml_kind", "stride_ml_seq", "stride_ml_head", "stride_bt_seq"
    ]
)  # fmt: skip
def _paged_decode_kernel(
    # pointers
    out_ptr,
    part_ptr,
    ml_ptr,
    query_ptr,
    kv_cache_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    kv_scale_ptr,  # FP8: [k_scale, v_scale]
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
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent (kernels/pdl.py)
    FP8: tl.constexpr,
    FP16_DOTS: tl.constexpr,
    PAIRS: tl.constexpr,  # an fp8 cache read as 16-bit words (fp8_pairs)
    CUDA: tl.constexpr,
):
    pdl_entry(PDL)
    kv_head = tl.program_id(0)  # grid (kv head, sequence, split): a sequence's kv heads start side by side
    seq = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * QUERY_GROUP + rows
    row_ok = rows < QUERY_GROUP
    dim_ok = dims < HEAD_DIM
    out_mask = row_ok[:, None] & dim_ok[None, :]
    out_rows = out_ptr + seq.to(tl.int64) * stride_o_seq + heads * stride_o_head  # (BLOCK_H,)
    q_rows = query_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head  # (BLOCK_H, 1)
    # q before seq_len: the two loads' latencies overlap instead of adding up
    if PAIRS:  # q's even and odd dims, against the words' low and high bytes (online_softmax_tile_fp8)
        pairs = tl.arange(0, BLOCK_D // 2)
        pair_mask = row_ok[:, None] & (pairs * 2 < HEAD_DIM)[None, :]
        q_even = tl.load(q_rows + pairs[None, :] * 2, mask=pair_mask, other=0.0)
        q_odd = tl.load(q_rows + pairs[None, :] * 2 + 1, mask=pair_mask, other=0.0)
        if FP16_DOTS:  # the tiles convert to q's dtype (kernels/kv_quant.py: fp16_dots)
            q_even, q_odd = q_even.to(tl.float16), q_odd.to(tl.float16)
    else:
        q = tl.load(q_rows + dims[None, :], mask=out_mask, other=0.0)  # (BLOCK_H, BLOCK_D)
        if FP16_DOTS:
            q = q.to(tl.float16)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition_size
    if SPLIT:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if start >= seq_len:  # an unused split: the merge never reads it
            return
    end = tl.minimum(start + partition_size, seq_len)

    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    kv_base = kv_cache_ptr + kv_head * stride_c_head
    k_scale, v_scale = load_scales(kv_scale_ptr, FP8)
    qk_scale = qk_scale * k_scale  # fp8 K tiles enter the dot as stored: their scale goes on the scores
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    if PAIRS:  # read as 16-bit words, two dims each
        words = kv_base.to(tl.pointer_type(tl.int16))
        acc_even = tl.zeros((BLOCK_H, BLOCK_D // 2), tl.float32)
        acc_odd = tl.zeros((BLOCK_H, BLOCK_D // 2), tl.float32)
        for n0 in range(start, full_end, BLOCK_N):
            acc_even, acc_odd, m_i, l_i = online_softmax_tile_fp8(
                acc_even, acc_odd, m_i, l_i, q_even, q_odd, qk_scale, n0, end, table, words, pairs,
                stride_c_kv // 2, stride_c_block // 2, stride_c_off // 2,
                HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, CUDA,
            )  # fmt: skip
        for n0 in range(full_end, end, BLOCK_N):  # the ragged tail: at most one tile
            acc_even, acc_odd, m_i, l_i = online_softmax_tile_fp8(
                acc_even, acc_odd, m_i, l_i, q_even, q_odd, qk_scale, n0, end, table, words, pairs,
                stride_c_kv // 2, stride_c_block // 2, stride_c_off // 2,
                HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, CUDA,
            )  # fmt: skip
        acc = tl.reshape(tl.join(acc_even, acc_odd), (BLOCK_H, BLOCK_D))  # back in dim order
    else:
        acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
        for n0 in range(start, full_end, BLOCK_N):
            acc, m_i, l_i = online_softmax_tile(
                acc, m_i, l_i, q, qk_scale, 0, n0, end, table, kv_base, dims,
                stride_c_kv, stride_c_block, stride_c_off,
                HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, False, False, DOT_PRECISION,
            )  # fmt: skip
        for n0 in range(full_end, end, BLOCK_N):  # the ragged tail: at most one tile
            acc, m_i, l_i = online_softmax_tile(
                acc, m_i, l_i, q, qk_scale, 0, n0, end, table, kv_base, dims,
                stride_c_kv, stride_c_block, stride_c_off,
                HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, True, False, DOT_PRECISION,
            )  # fmt: skip
    if FP8:
        acc = acc * v_scale  # likewise V's, once, on the output
    if SPLIT:  # the unnormalised partial state, see kernels/decode_reduce.py
        part_rows = (
            part_ptr + seq.to(tl.int64) * stride_p_seq + heads * stride_p_head + split * stride_p_split
        )
        tl.store(part_rows[:, None] + dims[None, :], acc, mask=out_mask)
        ml_rows = ml_ptr + seq.to(tl.int64) * stride_ml_seq + heads * stride_ml_head + split
        tl.store(ml_rows, m_i, mask=row_ok)
        tl.store(ml_rows + stride_ml_kind, l_i, mask=row_ok)
    else:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # seq_len 0 writes zeros, not NaN
        out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_rows[:, None] + dims[None, :], out, mask=out_mask)


def fp8_pairs(kv_cache: torch.Tensor) -> bool:
    """Whether the decode reads an fp8 cache as 16-bit words (online_softmax_tile_fp8): when every row and head
    starts on a word and each half of a head is a dot's depth (16 dims and more). Other fp8 caches are read
    byte by byte."""
    head_dim = kv_cache.shape[4]
    even = kv_cache.storage_offset() % 2 == 0 and all(stride % 2 == 0 for stride in kv_cache.stride()[:4])
    return (
        kv_cache.dtype == FP8_DTYPE and even and head_dim % 2 == 0 and triton.next_power_of_2(head_dim) >= 32
    )


def split_target(device: torch.device, fp8: bool = False) -> int:
    """The programs a decode launch aims at: enough to fill the GPU with the default tile's programs."""
    return (FP8_PROGRAMS_PER_SM if fp8 else PROGRAMS_PER_SM) * _backend.num_sms(device)


def fp8_one_warp(programs: int, device: torch.device) -> bool:
    """Whether an fp8 launch of `programs` programs runs them with one warp each: when they are at least
    PROGRAMS_PER_SM an SM. An fp8 tile is half a 16-bit one's bytes, so more, smaller programs keep enough
    loads in flight: at Llama-3-8B heads (H200) 1 warp takes 150-160 us where 2 take 178-183, at 64 x 4096,
    128 x 2048 and 256 x 1024 alike. Fewer programs are latency-bound, and two warps each do better there
    (12.1 against 16.2 us at 4 x 2048)."""
    return programs >= split_target(device)


def _splits(programs: int, max_seq_len: int, target: int, round_up: bool) -> int:
    if programs * 2 > target or max_seq_len <= 2 * MIN_PARTITION:
        return 1
    wanted = triton.cdiv(target, programs) if round_up else target // programs
    return max(1, min(wanted, triton.cdiv(max_seq_len, MIN_PARTITION)))


def plan_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device, fp8: bool = False
) -> int:
    """Split the key range only when (sequence, kv head) programs cannot fill the GPU. An fp8 cache aims at
    twice the programs, rounding down so they fit one wave (at 64 x 4096, 2 splits take 159-162 us; 3, whose
    programs spill into a second wave that runs a few of them, 193), when that many run one warp each
    (fp8_one_warp); else it plans as a 16-bit cache does."""
    programs = num_seqs * num_kv_heads
    if fp8:
        splits = _splits(programs, max_seq_len, split_target(device, fp8=True), round_up=False)
        if fp8_one_warp(programs * splits, device):
            return splits
    return _splits(programs, max_seq_len, split_target(device), round_up=True)


def paged_decode_attention_triton(
    query: torch.Tensor,  # (num_seqs, num_heads, head_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    seq_lens: torch.Tensor,  # (num_seqs,) int32
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    scale: float,
    max_seq_len: int | None = None,
    *,
    num_splits: int | None = None,
    workspace: torch.Tensor | None = None,  # flat fp32, >= decode_workspace_size(...) elements
    config: dict | None = None,
    out: torch.Tensor | None = None,  # preallocated output, e.g. a CUDA graph's buffer
    kv_scale: torch.Tensor | None = None,  # (2,) fp32 [k_scale, v_scale]: an fp8 cache's, else unused
) -> torch.Tensor:  # (num_seqs, num_heads, head_dim)
    """config: tile keys (block_n, num_warps, num_stages) and the merge launch's "merge_warps" and
    "merge_block_d" (head_dim elements per program; default MERGE_WARPS and MERGE_BLOCK_D).

    workspace (only used when the key range is split): allocate it once, at least
    decode_workspace_size(num_seqs, num_heads, num_splits, head_dim) elements, taking the largest
    num_seqs and num_splits of the calls that share it. Left out, it is allocated per call."""
    num_seqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.shape[4] == head_dim
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads over {num_kv_heads} kv heads"
    assert seq_lens.shape == (num_seqs,) and block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
    assert query.stride(2) == 1 and kv_cache.stride(4) == 1 and block_tables.stride(1) == 1
    assert query.dtype in (torch.float16, torch.bfloat16, torch.float32), f"query dtype {query.dtype}"
    scale_ptr, fp8 = scale_args(kv_cache, kv_scale)
    block_n = (config or {}).get("block_n", default_config(head_dim, query.dtype)["block_n"])
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.dtype == query.dtype and out.stride(2) == 1
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    if num_splits is None:
        num_splits = plan_num_splits(num_seqs, num_kv_heads, max_seq_len, query.device, fp8)
    partition = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n
    num_splits = triton.cdiv(max(max_seq_len, 1), partition)
    one_warp = fp8 and fp8_one_warp(num_seqs * num_kv_heads * num_splits, query.device)
    cfg = {**default_config(head_dim, query.dtype, one_warp), **(config or {})}
    split = num_splits > 1
    on = pdl(query)
    if split:
        size = decode_workspace_size(num_seqs, num_heads, num_splits, head_dim)
        if workspace is None:
            workspace = torch.empty(size, device=query.device)
        part, ml = carve_workspace(workspace, num_seqs, num_heads, num_splits, head_dim)
        ws_strides = (*part.stride()[:3], *ml.stride()[:3])
    else:  # the pointers are unused: the kernel writes the normalised output directly
        part, ml, ws_strides = out, out, (0, 0, 0, 0, 0, 0)
    _paged_decode_kernel[(num_kv_heads, num_seqs, num_splits)](
        out, part, ml, query, kv_cache, seq_lens, block_tables, scale_ptr,
        scale * LOG2E, partition,
        out.stride(0), out.stride(1), *ws_strides,
        query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        QUERY_GROUP=num_heads // num_kv_heads,
        BLOCK_H=max(16, triton.next_power_of_2(num_heads // num_kv_heads)),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_N=cfg["block_n"],
        SPLIT=split,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        PDL=on,
        FP8=fp8,
        FP16_DOTS=fp16_dots(fp8, query.dtype),
        PAIRS=fp8_pairs(kv_cache),
        CUDA=query.is_cuda,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **pdl_launch(on),
    )  # fmt: skip
    if split:
        decode_reduce_triton(
            out,
            part,
            ml,
            seq_lens,
            partition,
            pdl=on,
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
    kv_scale: torch.Tensor | None = None,  # (2,) fp32 [k_scale, v_scale]: an fp8 cache's, else unused
) -> torch.Tensor:  # (num_seqs, num_heads, head_dim)
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    k_scale, v_scale = (kv_scale[0], kv_scale[1]) if kv_scale is not None else (None, None)
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens.tolist()):
        k, v = gather_kv(kv_cache, block_tables[i], seq_len)  # fp8: dequantized, then attended
        k = as_read(k, kv_cache, k_scale, query.dtype).repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = as_read(v, kv_cache, v_scale, query.dtype).repeat_interleave(num_heads // num_kv_heads, dim=1)
        o = F.scaled_dot_product_attention(
            query[i].unsqueeze(1), k.transpose(0, 1), v.transpose(0, 1), scale=scale
        )  # (num_heads, 1, head_dim)
        out[i] = o.squeeze(1)
    return out


def paged_decode_attention(
    query, kv_cache, seq_lens, block_tables, scale, max_seq_len=None, *, num_splits=None, workspace=None,
    kv_scale=None,
):  # fmt: skip
    """num_splits / workspace (Triton only, see paged_decode_attention_triton): fixed for CUDA graphs.
    kv_scale: an fp8 cache's (2,) [k_scale, v_scale]."""
    if _backend.use_triton(query):
        return paged_decode_attention_triton(
            query, kv_cache, seq_lens, block_tables, scale, max_seq_len,
            num_splits=num_splits, workspace=workspace, kv_scale=kv_scale,
        )  # fmt: skip
    return paged_decode_attention_reference(query, kv_cache, seq_lens, block_tables, scale, kv_scale)
