"""Would TMA page loads close the decode kernel's last 1-2% to cuDNN? A probe, not the engine's kernel.

    python3 -m bench.tma_probe --out-dir DIR

At Llama-3-8B 64 x 4096 the decode kernel moves its bytes as fast as an elementwise copy of the same
bytes (1.02x) and still runs ~1.4% behind cuDNN on contiguous K/V; cuDNN's Hopper kernels load with
the tensor memory accelerator (TMA), ours with per-thread pointer loads. Here one descriptor covers
the whole (2, blocks, block_size, kv heads, head_dim) cache as a 2-D (2 * blocks * block_size,
kv heads * head_dim) table, and each page of one kv head is one (block_size, head_dim) box load. The
probe's kernel walks PAGES pages per iteration (each page its own dot and softmax update), once with
TMA box loads and once with pointer loads of the same tiles, beside the engine's kernel, A-B in one
process, on the batched shapes (no split, so no merge). Outputs are checked against the engine's.
"""

from __future__ import annotations

import argparse
import json
import math
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bench.kernels import MODELS, ROTATE_BYTES, copy_bandwidth, decode_fns, paged_set, time_sdpa, time_us
from bench.record import record

LOG2E = 1.4426950408889634


@triton.jit
def _page_step(acc, m_i, l_i, q, k, v, qk_scale):
    s = tl.dot(q, tl.trans(k))  # (BLOCK_H, BLOCK_SIZE)
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _load_page(cache_ptr, desc, blk, v_rows, col, offs, dims, stride_row, BLOCK_SIZE: tl.constexpr,
               USE_TMA: tl.constexpr):  # fmt: skip
    if USE_TMA:
        k = desc.load([blk * BLOCK_SIZE, col])
        v = desc.load([v_rows + blk * BLOCK_SIZE, col])
    else:
        ptrs = cache_ptr + (blk * BLOCK_SIZE + offs)[:, None].to(tl.int64) * stride_row + col + dims[None, :]
        k = tl.load(ptrs)
        v = tl.load(ptrs + v_rows.to(tl.int64) * stride_row)
    return k, v


@triton.jit
def _probe_decode_kernel(
    out_ptr, q_ptr, cache_ptr, desc, seq_lens_ptr, bt_ptr, qk_scale, v_rows,
    stride_o_seq, stride_o_head, stride_q_seq, stride_q_head, stride_row, stride_bt_seq,
    QUERY_GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PAGES: tl.constexpr, USE_TMA: tl.constexpr,
):  # fmt: skip
    """Grid (kv head, sequence); every sequence a whole number of PAGES-page tiles (the probe's shapes)."""
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    rows = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    offs = tl.arange(0, BLOCK_SIZE)
    heads = kv_head * QUERY_GROUP + rows
    row_ok = rows < QUERY_GROUP
    q_ptrs = q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    num_pages = tl.load(seq_lens_ptr + seq) // BLOCK_SIZE
    table = bt_ptr + seq.to(tl.int64) * stride_bt_seq
    col = kv_head * HEAD_DIM
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, HEAD_DIM), tl.float32)
    for p in range(0, num_pages, PAGES):
        for j in tl.static_range(PAGES):
            blk = tl.load(table + p + j)
            k, v = _load_page(cache_ptr, desc, blk, v_rows, col, offs, dims, stride_row, BLOCK_SIZE, USE_TMA)
            acc, m_i, l_i = _page_step(acc, m_i, l_i, q, k, v, qk_scale)
    out = out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head + dims[None, :]
    tl.store(out, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def probe_decode(
    q, cache, lens, tables, scale, *, pages: int, use_tma: bool, num_warps: int, num_stages: int
):
    """q (seqs, heads, dim); cache (2, blocks, block_size, kv heads, dim), contiguous."""
    num_seqs, num_heads, dim = q.shape
    _, num_blocks, block_size, num_kv, _ = cache.shape
    assert cache.is_contiguous()  # and every length a multiple of block_size * pages: the caller's shapes
    table2d = cache.view(2 * num_blocks * block_size, num_kv * dim)
    desc = TensorDescriptor.from_tensor(table2d, [block_size, dim])
    out = torch.empty_like(q)
    group = num_heads // num_kv
    _probe_decode_kernel[(num_kv, num_seqs)](
        out, q, table2d, desc, lens, tables, scale * LOG2E, num_blocks * block_size,
        out.stride(0), out.stride(1), q.stride(0), q.stride(1), table2d.stride(0), tables.stride(0),
        QUERY_GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim,
        BLOCK_SIZE=block_size, PAGES=pages, USE_TMA=use_tma, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def probe_fns(sets, scale, v):
    """One probe call per input set, variant v = (pages, TMA, warps, stages)."""
    return [lambda s=s: probe_decode(s["q"][:, :, 0], s["cache"], s["lens"], s["tables"], scale,
                                     pages=v[0], use_tma=v[1], num_warps=v[2], num_stages=v[3])
            for s in sets]  # fmt: skip


VARIANTS = [  # (pages per iteration, TMA, warps, stages)
    (1, True, 4, 4), (2, True, 4, 3), (4, True, 4, 2), (4, True, 2, 3), (4, True, 4, 3),
    (1, False, 4, 4), (4, False, 4, 2), (4, False, 2, 3),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=2, help="A-B rounds per shape")
    args = parser.parse_args()
    # device-side TMA descriptors need a scratch allocator; host descriptors (used here) do not, but
    # some Triton versions ask for one anyway
    if hasattr(triton, "set_allocator"):
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    copy = copy_bandwidth()["copy_"]
    print(f"copy ceiling {copy:.0f} GB/s", flush=True)
    rows = []
    for model, batch, seq_len in (("llama3-8b", 64, 4096), ("smollm2", 64, 4096)):
        heads = MODELS[model]
        per_set = 2 * batch * seq_len * heads[1] * heads[2] * 2 + 2 * batch * heads[0] * heads[2] * 2
        torch.manual_seed(0)
        sets = [paged_set(batch, seq_len, heads, 1) for _ in range(math.ceil(ROTATE_BYTES / per_set))]
        scale = heads[2] ** -0.5
        ref = decode_fns(sets[:1])[0]().float()
        fns = partial(probe_fns, sets, scale)

        times: dict[str, list[float]] = {"engine": []}
        errs: dict[str, float | str] = {}
        ok = []
        for v in VARIANTS:
            name = f"{'tma' if v[1] else 'ptr'} pages={v[0]} warps={v[2]} stages={v[3]}"
            try:
                out = fns(v)[0]().float()
                errs[name] = ((out - ref).norm() / ref.norm()).item()
                times[name] = []
                ok.append((name, v))
            except Exception as exc:  # a variant that does not compile here: say why, go on
                errs[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        for _ in range(args.rounds):
            times["engine"].append(time_us(decode_fns(sets)))
            for name, v in ok:
                times[name].append(time_us(fns(v)))
        sdpa_t, sdpa_name, _ = time_sdpa(sets, None)
        for name, ts in times.items():
            t = min(ts)
            rows.append((f"{model} {batch}x{seq_len}", name, ts, per_set / t / 1e3 / copy, t / sdpa_t,
                         errs.get(name, 0.0)))  # fmt: skip
            record(f"kernels_tma_probe_{model}_b{batch}x{seq_len}_{name.replace(' ', '_').replace('=', '')}",
                   t, "us", baseline=sdpa_t, baseline_name=f"SDPA {sdpa_name} (us), same run",
                   extra={"times_us": ts, "rel_err_vs_engine": errs.get(name, 0.0), "copy_gbs": copy,
                          "ratio_to_copy": per_set / t / 1e3 / copy},
                   out_dir=args.out_dir)  # fmt: skip
        print(json.dumps({"shape": [model, batch, seq_len], "times": times, "errs": errs,
                          "sdpa": [sdpa_name, sdpa_t]}), flush=True)  # fmt: skip
        del sets
    print(
        "\n| shape | kernel | times us (A-B rounds) | of copy | vs SDPA | rel err |\n| --- | --- | --- | ---: | ---: | --- |"
    )
    for shape, name, ts, ratio, vs, err in rows:
        e = f"{err:.1e}" if isinstance(err, float) else err
        print(f"| {shape} | {name} | {' / '.join(f'{t:.1f}' for t in ts)} | {ratio:.3f} | {vs:.3f} | {e} |")


if __name__ == "__main__":
    main()
