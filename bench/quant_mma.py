"""A W4A16 GEMM for 1 to 8 rows on the tensor cores (mma.sync m16n8k16), the weights re-laid in the MMA's own
fragment order, written in Gluon (Triton's explicit-layout dialect), timed against the product's kernels
(kernels/w4a16_gemm.py) on a Llama-3-8B layer. A candidate for the small-batch path, not used by the engine:

    python3 -m bench.quant_mma --out-dir DIR            (H200: about 40 s)

- Layout: output columns in blocks of 16, K in chunks of Q * 64; per (column block, 64-row quad, lane, word) one
  int32 whose nibble r + 4h is the A fragment's register r, half h (relayout()). A lane's four words of a quad
  are one 16-byte load; inside a chunk the K order is permuted so that lane t's x values (B fragments) are one
  contiguous run: t * Q * 16 + kb * 4 + r1 * 2 + h.
- Per word: three shifts and four LOP3 (inline PTX: nibbles r and r + 4 under bf16 128.0's exponent) give the
  four A registers of one m16n8k16; x rows are the MMA's 8 columns. A second MMA against ones sums x per
  group, so the scale, zero and magic 128 go on once per group: s * sum (128 + q) x - s (128 + z) sum x.
- Each program owns 16 columns; its W warps split K (the MMA layout's leading dimension), U chunks a step are
  loaded one step ahead, and the warps' partial sums meet in one reduction at the end.
About 2.8 SASS instructions a weight per lane at M = 1 (the CUDA-core kernel: ~5.1), yet the layer's GEMMs
take about as long at one row: the time goes elsewhere than the arithmetic (record quant_w4a16_mma_llama3-8b).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path
from typing import Any

import triton.experimental.gluon as gluon
import triton.experimental.gluon.language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COMMAND = "python3 -m bench.quant_mma"
# (warps, Q, U) per config; the product kernel's layer at M = 1 takes ~58 us
CONFIGS = ((2, 2, 2), (4, 2, 1), (4, 2, 2), (8, 2, 1), (8, 2, 2), (16, 2, 1))


def slices(parent, rank):
    out = []
    for d in range(rank):
        lay = parent
        for e in reversed(range(rank)):
            if e != d:
                lay = gl.SliceLayout(e, lay)
        out.append(lay)
    return out


@gluon.jit
def _index(n: gl.constexpr, d: gl.constexpr, r: gl.constexpr, layout: gl.constexpr):
    a = gl.arange(0, n, layout=layout)
    for e in gl.static_range(r):
        if e != d:
            a = gl.expand_dims(a, e)
    return a


@gluon.jit
def _load_chunk(
    qm_ptr,
    x_ptr,
    c,
    ch,
    n_chunks,
    M,
    K,
    stride_xw,
    P0: gl.constexpr,
    P1: gl.constexpr,
    P2: gl.constexpr,
    P3: gl.constexpr,
    P4: gl.constexpr,
    B0: gl.constexpr,
    B1: gl.constexpr,
    B2: gl.constexpr,
    B3: gl.constexpr,
    W: gl.constexpr,
    Q: gl.constexpr,
):
    iw = _index(W, 0, 5, P0)
    iq = _index(Q, 1, 5, P1)
    iv = _index(4, 2, 5, P2)
    ig = _index(8, 3, 5, P3)
    it = _index(4, 4, 5, P4)
    chw = ch + iw  # (W,1,1,1,1): this warp's chunk
    qd = chw * Q + iq
    offs = ((c * (K // 64) + qd) * 32 + ig * 4 + it) * 4 + iv
    P = gl.load(qm_ptr + offs, mask=chw < n_chunks, other=0)
    # x in the chunk's k order: lane t's fragments hold x[t*BK/4 + kb*4 + r1*2 + h], one contiguous run
    bw = _index(W, 0, 4, B0)
    bkr = _index(Q * 8, 1, 4, B1)  # (kb, r1)
    bt = _index(4, 2, 4, B2)
    bn = _index(8, 3, 4, B3)
    chb = ch + bw
    x32 = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    offs = bn * stride_xw + chb * (Q * 32) + bt * (Q * 8) + bkr
    B = gl.load(x32 + offs, mask=(bn < M) & (chb < n_chunks), other=0)  # (W, kb r1, t, n) bf16 pairs
    return P, B


@gluon.jit
def _contrib(
    P,
    B,
    ch,
    s_ptr,
    z_ptr,
    cols,
    sw,
    n_chunks,
    N,
    ones,
    GROUP: gl.constexpr,
    ZERO_IS_OFFSET: gl.constexpr,
    W: gl.constexpr,
    Q: gl.constexpr,
    MMA: gl.constexpr,
):
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    BK: gl.constexpr = Q * 64
    J = gl.join(gl.join(P, P >> 8), gl.join(P >> 4, P >> 12))  # (..., r1, r0): nibble r at bits 0..3
    J = gl.join(J, J)  # (..., h): one word, read as its two 16-bit halves
    A = gl.inline_asm_elementwise(
        "lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;",
        "=r,r,r",
        [J],
        dtype=gl.bfloat16,
        is_pure=True,
        pack=2,
    )  # 128 + nibble r (low half), 128 + nibble r + 4 (high half), as bf16
    A = gl.permute(A, (0, 6, 3, 1, 2, 5, 4, 7))
    A = gl.reshape(A, (W, 16, BK))
    A = gl.convert_layout(A, A_L, assert_trivial=True)
    Bj = gl.join(B, B)
    Bj = gl.reshape(Bj, (W, Q * 4, 2, 4, 8, 2))
    Bx = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [Bj], dtype=gl.bfloat16, is_pure=True, pack=2)
    Bx = gl.reshape(gl.permute(Bx, (0, 1, 2, 3, 5, 4)), (W, BK, 8))
    Bc = gl.convert_layout(Bx, B_L, assert_trivial=True)
    zero = gl.zeros([W, 16, 8], gl.float32, MMA)
    acc = mma_v2(A, Bc, zero)
    xs = mma_v2(ones, Bc, zero)
    grp = ((ch + sw) * BK) // GROUP
    smask = ((ch + sw) < n_chunks) & (cols < N)
    s = gl.load(s_ptr + grp * N + cols, mask=smask, other=0.0).to(gl.float32)
    z = gl.load(z_ptr + grp * N + cols, mask=smask, other=0).to(gl.float32)
    if ZERO_IS_OFFSET:
        corr = 128.0 * s - z
    else:
        corr = (128.0 + z) * s
    return acc * gl.expand_dims(s, 2) - gl.expand_dims(corr, 2) * xs


@gluon.jit
def w4a16_mma_kernel(
    x_ptr,
    qm_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xw,
    stride_om,
    GROUP: gl.constexpr,
    ZERO_IS_OFFSET: gl.constexpr,
    W: gl.constexpr,
    Q: gl.constexpr,
    U: gl.constexpr,
    MMA: gl.constexpr,
    P0: gl.constexpr,
    P1: gl.constexpr,
    P2: gl.constexpr,
    P3: gl.constexpr,
    P4: gl.constexpr,
    B0: gl.constexpr,
    B1: gl.constexpr,
    B2: gl.constexpr,
    B3: gl.constexpr,
    S0: gl.constexpr,
    S1: gl.constexpr,
    O0: gl.constexpr,
    O1: gl.constexpr,
):
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    BK: gl.constexpr = Q * 64
    c = gl.program_id(0)
    n_chunks = K // BK
    ones = gl.full([W, 16, BK], 1.0, gl.bfloat16, A_L)
    total = gl.zeros([W, 16, 8], gl.float32, MMA)
    sw = _index(W, 0, 2, S0)
    sr = _index(16, 1, 2, S1)
    cols = c * 16 + sr
    Pa, Ba = _load_chunk(
        qm_ptr, x_ptr, c, 0, n_chunks, M, K, stride_xw, P0, P1, P2, P3, P4, B0, B1, B2, B3, W, Q
    )
    if U == 1:
        for ch in range(0, n_chunks, W):
            P = Pa
            B = Ba
            Pa, Ba = _load_chunk(
                qm_ptr, x_ptr, c, ch + W, n_chunks, M, K, stride_xw, P0, P1, P2, P3, P4, B0, B1, B2, B3, W, Q
            )
            total += _contrib(
                P, B, ch, s_ptr, z_ptr, cols, sw, n_chunks, N, ones, GROUP, ZERO_IS_OFFSET, W, Q, MMA
            )
    else:
        Pb, Bb = _load_chunk(
            qm_ptr, x_ptr, c, W, n_chunks, M, K, stride_xw, P0, P1, P2, P3, P4, B0, B1, B2, B3, W, Q
        )
        for ch in range(0, n_chunks, 2 * W):
            P = Pa
            B = Ba
            P2_ = Pb
            B2_ = Bb
            Pa, Ba = _load_chunk(
                qm_ptr,
                x_ptr,
                c,
                ch + 2 * W,
                n_chunks,
                M,
                K,
                stride_xw,
                P0,
                P1,
                P2,
                P3,
                P4,
                B0,
                B1,
                B2,
                B3,
                W,
                Q,
            )
            Pb, Bb = _load_chunk(
                qm_ptr,
                x_ptr,
                c,
                ch + 3 * W,
                n_chunks,
                M,
                K,
                stride_xw,
                P0,
                P1,
                P2,
                P3,
                P4,
                B0,
                B1,
                B2,
                B3,
                W,
                Q,
            )
            total += _contrib(
                P, B, ch, s_ptr, z_ptr, cols, sw, n_chunks, N, ones, GROUP, ZERO_IS_OFFSET, W, Q, MMA
            )
            total += _contrib(
                P2_, B2_, ch + W, s_ptr, z_ptr, cols, sw, n_chunks, N, ones, GROUP, ZERO_IS_OFFSET, W, Q, MMA
            )
    out = gl.sum(total, axis=0)  # (16, 8)
    orow = _index(16, 0, 2, O0)
    on = _index(8, 1, 2, O1)
    ocol = c * 16 + orow
    gl.store(out_ptr + on * stride_om + ocol, out.to(out_ptr.dtype.element_ty), mask=(on < M) & (ocol < N))


def relayout(q: Any, Q: int) -> Any:
    """(N, K) values 0..15 -> (ceil(N / 16), K / 64, 32, 4) int32 in the A fragments' order, K in chunks of
    Q * 64 within which lane t's k are t * Q * 16 + kb * 4 + r1 * 2 + h (kb = q * 4 + v)."""
    import torch

    n, k = q.shape
    nc = -(-n // 16)
    qp = torch.zeros(nc * 16, k, dtype=torch.int64, device=q.device)
    qp[:n] = q.to(torch.int64)
    t = qp.view(nc, 2, 8, k // (Q * 64), 4, Q, 4, 2, 2)  # (c, r0, g, ch, t, q, v, r1, h)
    t = t.permute(0, 3, 5, 2, 4, 6, 8, 7, 1)  # (c, ch, q, g, t, v, h, r1, r0)
    t = t.reshape(nc, k // 64, 32, 4, 8)  # nibble h * 4 + r1 * 2 + r0
    words = (t << (torch.arange(8, device=q.device) * 4)).sum(-1)
    return torch.where(words < 2**31, words, words - 2**32).to(torch.int32)


def fragment_gemm_reference(x: Any, qm: Any, scales: Any, zeros: Any, n: int, group: int, Q: int) -> Any:
    """What the kernel computes, read back from the re-laid words, in torch (fp64): the layout's CPU check."""
    import torch

    nc, k = qm.shape[0], qm.shape[1] * 64
    words = qm.to(torch.int64) & 0xFFFFFFFF
    nib = (words.unsqueeze(-1) >> (torch.arange(8) * 4)) & 0xF  # (c, qd, lane, v, nibble)
    nib = nib.reshape(nc, k // (Q * 64), Q, 8, 4, 4, 2, 2, 2)  # (c, ch, q, g, t, v, h, r1, r0)
    q = nib.permute(0, 8, 3, 1, 4, 2, 5, 7, 6).reshape(nc * 16, k)[:n]  # (c r0 g, ch t q v r1 h)
    g = torch.arange(k) // group
    s, z = scales.double()[g].t(), zeros.double()[g].t()
    w = q.double() * s + z if zeros.dtype == torch.float16 else (q.double() - z) * s
    return x.double() @ w.t()


def layouts(W: int, Q: int) -> dict[str, Any]:
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    p_l = gl.BlockedLayout(
        size_per_thread=[1, Q, 4, 1, 1],
        threads_per_warp=[1, 1, 1, 8, 4],
        warps_per_cta=[W, 1, 1, 1, 1],
        order=[2, 1, 4, 3, 0],
    )
    b_l = gl.BlockedLayout(
        size_per_thread=[1, Q * 8, 1, 1],
        threads_per_warp=[1, 1, 4, 8],
        warps_per_cta=[W, 1, 1, 1],
        order=[1, 2, 3, 0],
    )
    s_l = gl.SliceLayout(2, mma)
    o_l = gl.SliceLayout(0, mma)
    d = dict(MMA=mma)
    for name, lay, r in (("P", p_l, 5), ("B", b_l, 4), ("S", s_l, 2), ("O", o_l, 2)):
        for i, sl in enumerate(slices(lay, r)):
            d[f"{name}{i}"] = sl
    return d


def gemm(x: Any, w: Any, qm: Any, W: int, Q: int, U: int, out: Any = None) -> Any:
    """x (M <= 8, K) bf16 against an Int4Weight `w` whose words are re-laid as `qm`."""
    import torch
    import triton

    m, k = x.shape
    n = w.out_features
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    w4a16_mma_kernel[(triton.cdiv(n, 16),)](
        x, qm, w.scales, w.zeros, out, m, n, k, x.stride(0) // 2, out.stride(0), GROUP=w.group_size,
        ZERO_IS_OFFSET=w.zero_is_offset, W=W, Q=Q, U=U, num_warps=W, **layouts(W, Q),
    )  # fmt: skip
    return out


def main() -> None:
    import torch

    from bench.kernels import time_us
    from bench.quant_int4 import LAYER, SETS, int4_layer
    from bench.record import record
    from kernels.int4_dequant import Int4Weight, int4_dequant_reference, unpack_rows
    from kernels.w4a16_gemm import w4a16_gemm

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    worst = 0.0  # against dequantize-then-matmul: odd sizes, groups 64 and 128, zero points and offsets
    for n, k, group in ((100, 576, 64), (49, 1536, 128), (6144, 4096, 128)):
        qweight = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda").t()
        scales = (torch.rand(k // group, n, device="cuda") * 0.02 + 0.001).half()
        for offsets in (False, True):
            zeros = (
                (torch.randn(k // group, n, device="cuda") * 0.05).half()
                if offsets
                else torch.randint(0, 16, (k // group, n), dtype=torch.uint8, device="cuda")
            )
            w = Int4Weight(qweight, scales, zeros, group)
            dense = int4_dequant_reference(w, torch.float32)
            for Q in (1, 2):
                if group % (Q * 64):
                    continue
                qm = relayout(unpack_rows(w.qweight).t(), Q)
                for m in (1, 3, 8):
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    ref = x.float() @ dense.t()
                    for W, U in ((4, 2), (8, 1)):
                        err = (gemm(x, w, qm, W, Q, U).float() - ref).abs().max() / ref.abs().max()
                        worst = max(worst, err.item())
    assert worst < 1e-2, f"the fragment-order kernel is off by {worst:.2e} of the largest output"
    sets = [int4_layer("cuda", s) for s in range(SETS)]
    qms = [{name: relayout(unpack_rows(w[name].qweight).t(), 2) for name in LAYER} for w in sets]
    found: dict[str, dict[str, float]] = {}
    for m in (1, 4):
        for name, (k, n) in LAYER.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"product": time_us([partial(w4a16_gemm, x, w[name]) for w in sets])}
            for W, Q, U in CONFIGS:
                outs = [torch.empty(m, n, dtype=x.dtype, device="cuda") for _ in sets]
                fns = [partial(gemm, x, sets[i][name], qms[i][name], W, Q, U, outs[i]) for i in range(SETS)]
                row[f"W{W}Q{Q}U{U}"] = time_us(fns)
            found[f"M={m} {name}"] = {key: round(us, 2) for key, us in row.items()}
            print(f"M={m} {name}: {found[f'M={m} {name}']}", flush=True)
    best = {m: sum(min(v for key, v in found[f"M={m} {name}"].items() if key != "product") for name in LAYER)
            for m in (1, 4)}  # fmt: skip
    product = {m: sum(found[f"M={m} {name}"]["product"] for name in LAYER) for m in (1, 4)}
    record(
        "quant_w4a16_mma_llama3-8b", best[1], "us", baseline=product[1],
        baseline_name="the product's W4A16 GEMMs of the layer at M = 1 (us)", ratio=product[1] / best[1],
        out_dir=args.out_dir, command=COMMAND,
        extra={"what": "a Llama-3-8B layer's four W4A16 GEMMs (gate_up without SwiGLU), group 128, six weight "
                       "sets, graph replay, best config per GEMM: the fragment-order mma.sync kernel against "
                       "kernels/w4a16_gemm.py", "layer_us_m4": best[4], "product_layer_us_m4": product[4],
               "ratio_m4": product[4] / best[4], "max_rel_err": worst, "per_gemm_us": found},
    )  # fmt: skip


if __name__ == "__main__":
    main()
