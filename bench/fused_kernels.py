"""The fused per-layer kernels on the GPU: time against the unfused torch ops they replace and
against an elementwise copy moving the same bytes, at Llama-3-8B shapes.

    python3 -m bench.fused_kernels --out-dir DIR

Medians of CUDA-graph replays (bench/kernels.py: time_us). Inputs are not rotated: at decode sizes
they stay in L2 between calls, as in the step, where the GEMM before each kernel has just written
them. Writes one JSON record per (kernel, token count) (bench/record.py) and fused_kernels_table.md.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.kernels import time_us
from bench.record import record
from engine.layers.rotary import RotaryEmbedding
from kernels.fused_add_rmsnorm import fused_add_rmsnorm_triton
from kernels.kv_cache_write import kv_cache_write_triton
from kernels.rotary_kv_write import rotary_kv_write_triton
from kernels.silu_and_mul import silu_and_mul_triton

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4096, 14336, 32, 8, 128, 16  # Llama-3-8B
TOKENS = [1, 8, 64, 256, 4096]
DT = torch.bfloat16
ELEM = 2


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=DT)


def unfused_norm(x, residual, weight, eps=1e-5):
    residual = x + residual
    x32 = residual.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(DT), residual


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def unfused_rope(q, k, v, cos, sin, kv_cache, slots):
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    kv_cache_write_triton(k, v, kv_cache, slots)
    return q


def norm_case(n: int):
    x, residual, weight = rand(n, HIDDEN), rand(n, HIDDEN), rand(HIDDEN)
    fused = partial(fused_add_rmsnorm_triton, x, residual, weight, 1e-5)
    return fused, partial(unfused_norm, x, residual, weight), 5 * n * HIDDEN * ELEM  # 2 reads, 2 writes, w


def rope_case(n: int):
    qkv = rand(n, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q, k, v = (t.view(n, -1, HEAD_DIM) for t in qkv.split([HEADS * HEAD_DIM, *[KV_HEADS * HEAD_DIM] * 2], -1))
    cache = RotaryEmbedding(HEAD_DIM, 500000.0, 8192).cos_sin_cache(DT, q.device)
    positions = torch.randint(0, 8192, (n,), device="cuda")
    num_blocks = -(-n // BLOCK)
    kv_cache = torch.zeros(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=DT)
    slots = torch.arange(n, device="cuda")
    cos, sin = (torch.cat((t, t), dim=-1).unsqueeze(1) for t in cache[positions].chunk(2, dim=-1))
    fused = partial(rotary_kv_write_triton, q, k, v, positions, cache, kv_cache, slots)
    unfused = partial(unfused_rope, q, k, v, cos, sin, kv_cache, slots)
    moved = (2 * (HEADS + 2 * KV_HEADS) + 1) * n * HEAD_DIM * ELEM  # q, k, v in and out; a cos/sin row
    return fused, unfused, moved


def silu_case(n: int):
    x = rand(n, 2 * INTER)
    gate, up = x.chunk(2, dim=-1)
    return partial(silu_and_mul_triton, x), lambda: F.silu(gate) * up, 3 * n * INTER * ELEM


CASES = {"fused_add_rmsnorm": norm_case, "rotary_kv_write": rope_case, "silu_and_mul": silu_case}


def same_bytes_copy_us(nbytes: int) -> float:
    src = torch.randn(max(nbytes // (2 * ELEM), 1), device="cuda", dtype=DT)
    dst = torch.empty_like(src)
    return time_us([partial(torch.mul, src, 1.0, out=dst)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=None, help="records go here (default bench/results)")
    args = parser.parse_args()
    table = ["| kernel | tokens | fused us | unfused us | speedup | GB/s | same-bytes copy us | ratio to copy |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for name, make in CASES.items():
        for n in TOKENS:
            fused, unfused, moved = make(n)
            t_fused, t_unfused, t_copy = time_us([fused]), time_us([unfused]), same_bytes_copy_us(moved)
            record(f"fused_{name}_{n}tok", t_fused, "us", baseline=t_unfused, baseline_name="unfused torch ops",
                   ratio=t_copy / t_fused, goal="time of a same-bytes copy",
                   extra={"unfused_us": t_unfused, "copy_us": t_copy, "bytes": moved}, out_dir=args.out_dir)  # fmt: skip
            row = (f"| {name} | {n} | {t_fused:.2f} | {t_unfused:.2f} | {t_unfused / t_fused:.1f}x | "
                   f"{moved / t_fused / 1e3:.0f} | {t_copy:.2f} | {t_copy / t_fused:.2f} |")  # fmt: skip
            print(row, flush=True)
            table.append(row)
            torch.cuda.empty_cache()
    (args.out_dir or Path(".")).joinpath("fused_kernels_table.md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
