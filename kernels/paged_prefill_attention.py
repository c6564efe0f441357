"""Paged "extend" attention: a chunk of new query tokens per sequence attends causally to the
sequence's cached prefix pages plus itself. Serves prefill, chunked prefill, prefix-cache hits
and speculative verification (see engine/attention_metadata.py for the layout).

One program owns BLOCK_M query rows of one (sequence, query head), FlashAttention-style. Its
rows sit at positions ctx_len + q_start + r (ctx_len = seq_len - q_len), so:

    keys:  0 ........ full_end ........ ctx_len + q_start ....... causal_end
           |-- every row sees these --|---- causal mask (kv_pos <= q_pos) ----|
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import _backend
from kernels.kv_quant import as_read, fp16_dots, load_scales, scale_args
from kernels.online_softmax import LOG2E, online_softmax_tile


@triton.jit(do_not_specialize=["stride_bt_seq"])  # the tables' width changes with the step's batch
def _paged_prefill_kernel(
    # pointers
    out_ptr,
    query_ptr,
    kv_cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    kv_scale_ptr,  # FP8: [k_scale, v_scale]
    # sizes
    qk_scale,
    # strides
    stride_o_tok,
    stride_o_head,
    stride_q_tok,
    stride_q_head,
    stride_c_kv,
    stride_c_block,
    stride_c_off,
    stride_c_head,
    stride_bt_seq,
    # meta
    QUERY_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    FP16_DOTS: tl.constexpr,
):
    q_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # longest causal ranges first
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    q_start = q_tile * BLOCK_M
    if q_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    rows = q_start + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    io_mask = (rows < q_len)[:, None] & (dims < HEAD_DIM)[None, :]
    tok = (q_begin + rows).to(tl.int64)
    q = tl.load(query_ptr + tok[:, None] * stride_q_tok + head * stride_q_head + dims[None, :], mask=io_mask)
    # (BLOCK_M, BLOCK_D)
    if FP16_DOTS:  # the tiles convert to q's dtype (kernels/kv_quant.py: fp16_dots)
        q = q.to(tl.float16)
    q_pos = ctx_len + rows

    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    kv_base = kv_cache_ptr + (head // QUERY_GROUP) * stride_c_head
    k_scale, v_scale = load_scales(kv_scale_ptr, FP8)
    qk_scale = qk_scale * k_scale  # fp8: K's scale on the scores, V's on the output (kernels/kv_quant.py)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    full_end = (ctx_len + q_start) // BLOCK_N * BLOCK_N
    causal_end = tl.minimum(ctx_len + q_start + BLOCK_M, seq_len)
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = online_softmax_tile(
            acc, m_i, l_i, q, qk_scale, q_pos, n0, seq_len, table, kv_base, dims,
            stride_c_kv, stride_c_block, stride_c_off,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, False, True, DOT_PRECISION,
        )  # fmt: skip
    for n0 in range(full_end, causal_end, BLOCK_N):
        acc, m_i, l_i = online_softmax_tile(
            acc, m_i, l_i, q, qk_scale, q_pos, n0, seq_len, table, kv_base, dims,
            stride_c_kv, stride_c_block, stride_c_off,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, True, True, DOT_PRECISION,
        )  # fmt: skip

    if FP8:
        acc = acc * v_scale
    out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + tok[:, None] * stride_o_tok + head * stride_o_head + dims[None, :], out, mask=io_mask)


# query lengths that between them reach every tile pick_config picks (the engine's start-up warms each)
TILE_QUERY_LENS = (16, 32, 64, 128)


def pick_config(max_query_len: int, head_dim: int, dtype: torch.dtype) -> dict:
    if dtype == torch.float32:  # 4-byte tiles: smaller, so they fit in shared memory
        return {"block_m": 64 if max_query_len > 32 else 32, "block_n": 32, "num_warps": 4, "num_stages": 2}
    if max_query_len >= 128 and head_dim > 64:  # the best of the H200 sweep (docs/kernels.md)
        return {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3}
    if max_query_len >= 64:
        return {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}
    block_m = max(16, triton.next_power_of_2(max_query_len))
    return {"block_m": block_m, "block_n": 64, "num_warps": 4, "num_stages": 3}


def paged_prefill_attention_triton(
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    query_start_loc: torch.Tensor,  # (num_seqs + 1,) int32
    seq_lens: torch.Tensor,  # (num_seqs,) int32
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    scale: float,
    max_query_len: int | None = None,
    *,
    config: dict | None = None,
    out: torch.Tensor | None = None,  # preallocated output, e.g. a CUDA graph's buffer
    kv_scale: torch.Tensor | None = None,  # (2,) fp32 [k_scale, v_scale]: an fp8 cache's, else unused
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.shape[4] == head_dim
    num_kv_heads = kv_cache.shape[3]
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads over {num_kv_heads} kv heads"
    assert query_start_loc.shape == (num_seqs + 1,), f"query_start_loc {tuple(query_start_loc.shape)}"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
    assert query.stride(2) == 1 and kv_cache.stride(4) == 1 and block_tables.stride(1) == 1
    assert query.dtype in (torch.float16, torch.bfloat16, torch.float32), f"query dtype {query.dtype}"
    scale_ptr, fp8 = scale_args(kv_cache, kv_scale)
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.dtype == query.dtype and out.stride(2) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    cfg = {**pick_config(max_query_len, head_dim, query.dtype), **(config or {})}
    grid = (triton.cdiv(max_query_len, cfg["block_m"]), num_seqs, num_heads)
    _paged_prefill_kernel[grid](
        out, query, kv_cache, query_start_loc, seq_lens, block_tables, scale_ptr,
        scale * LOG2E,
        out.stride(0), out.stride(1), query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        QUERY_GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        FP8=fp8,
        FP16_DOTS=fp16_dots(fp8, query.dtype),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def gather_kv(
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    block_table: torch.Tensor,  # (max_blocks,) int32
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return one sequence's contiguous K and V, each (seq_len, num_kv_heads, head_dim)."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    ids = block_table[:num_blocks].long()
    cache = kv_cache.view(torch.uint8) if kv_cache.element_size() == 1 else kv_cache  # fp8: index the bytes
    k = cache[0, ids].flatten(0, 1)[:seq_len].view(kv_cache.dtype)
    v = cache[1, ids].flatten(0, 1)[:seq_len].view(kv_cache.dtype)
    return k, v


def paged_prefill_attention_reference(
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    query_start_loc: torch.Tensor,  # (num_seqs + 1,) int32
    seq_lens: torch.Tensor,  # (num_seqs,) int32
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    scale: float,
    kv_scale: torch.Tensor | None = None,  # (2,) fp32 [k_scale, v_scale]: an fp8 cache's, else unused
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    k_scale, v_scale = (kv_scale[0], kv_scale[1]) if kv_scale is not None else (None, None)
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q = query[starts[i] : starts[i + 1]]  # (q_len, num_heads, head_dim)
        q_len = q.shape[0]
        if q_len == 0:
            continue
        k, v = gather_kv(kv_cache, block_tables[i], seq_len)  # fp8: dequantized, then attended
        k = as_read(k, kv_cache, k_scale, q.dtype).repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = as_read(v, kv_cache, v_scale, q.dtype).repeat_interleave(num_heads // num_kv_heads, dim=1)
        # query row r sits at position seq_len - q_len + r and sees keys 0..that position
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # (q_len, seq_len)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
        )
        out[starts[i] : starts[i + 1]] = o.transpose(0, 1)
    return out


def paged_prefill_attention(
    query, kv_cache, query_start_loc, seq_lens, block_tables, scale, max_query_len=None, kv_scale=None
):
    """kv_scale: an fp8 cache's (2,) [k_scale, v_scale]."""
    if _backend.use_triton(query):
        return paged_prefill_attention_triton(
            query, kv_cache, query_start_loc, seq_lens, block_tables, scale, max_query_len, kv_scale=kv_scale
        )
    return paged_prefill_attention_reference(
        query, kv_cache, query_start_loc, seq_lens, block_tables, scale, kv_scale
    )
