"""Int4 weights on the GPU, Llama-3-8B shape: the W4A16 GEMM against the copy bandwidth and the bf16 GEMM,
and the engine's batch-1 decode with dummy int4 weights against the bf16 engine, all in one run.

    python3 -m bench.quant_int4 --out-dir DIR [--sweep]

- GEMM, M = 1, 2, 4, 8, 16: one decoder layer's four GEMMs (qkv 4096x6144, o 4096x4096, gate_up
  4096x28672, down 14336x4096; group 128, integer zeros) in the fragment layout loaded layers take on a GPU
  (kernels/w4a16_mma.py; gate_up without SwiGLU), the rows layout's kernels beside it, timed as CUDA-graph
  replays rotating over six
  layers' weights (654 MB: no layer is in L2 when its turn comes). GB/s = the layer's int4 bytes (K * N / 2;
  scales and zeros add 1/21, reported beside) / its time; ceiling = the device-to-device copy measured
  here (bench/kernels.py). The bf16 GEMMs of the same layers are timed beside them, and the four GEMMs in the
  form a decode step runs them (qkv and gate_up with SwiGLU taking their norm, o and down adding into the
  stream: per_gemm_us_norms_fused).
- GEMM, M = 4096: the layer's four GEMMs in int4 (dequantize + cuBLAS) against bf16 (cuBLAS); ratio = bf16
  time / int4 time. And the crossover: the kernel against dequantize + cuBLAS at M = 32 .. 2048, which sets
  kernels/w4a16_gemm.py's DEQUANT_MIN_M.
- Engine: `LLM("Llama-3-8B", load_format="dummy")` in bf16 and with quantization="awq" (dummy int4
  weights), each in a child process, max_num_seqs 16: batch-1 decode tok/s as bench/latency.py measures it
  (256 tokens after 128, minus a 1-token generate, median of 3 after a warm-up), and the weights' memory
  from the KV-sizing log line; GPTQ with the LM head quantized too (lm_head=true, the config of a
  dummy-weight directory), whose weights are the memory record; and AWQ and bf16 again with every kernel
  launched plainly, none as a programmatic dependent (PDSERVE_PDL=0, kernels/pdl.py), for what PDL gains;
  and AWQ with the layers' norms in kernels of their own (PDSERVE_FUSED_NORMS=0), and with RoPE and the KV-cache
  write in their own kernel rather than the qkv GEMM's epilogue (PDSERVE_FUSED_ROTARY=0), for what each fusion
  gains.
  The GEMMs are timed as the engine launches them (PDL: each lets the next start, which asks for its first
  weights, then waits) and, beside that, launched plainly.
- --sweep: also time the GEMM's tile configs at M = 1, 4 and 16: the swapped kernel's, the CUDA-core
  kernel's (M = 1, 4) and the 16-row dots' (best per M printed).
- --sweep-m1: the one-row kernel's configs GEMM by GEMM (columns a program, K tile, split-K, warps; gate_up
  with its SwiGLU epilogue): quant_w4a16_m1_sweep_llama3-8b (gate_up's best against its 16-column default).
- --limits: what bounds the one-row kernel, GEMM by GEMM: its time against a copy kernel moving the same
  bytes (half read, half written: the same launch, ramp-up and tail), a kernel that only loads the weights
  in the GEMM's own tiles and pipeline, and the GEMM on one weight set over and over (served from L2):
  quant_w4a16_m1_limits_llama3-8b.
- --sweep-mma: the fragment layout's kernel (kernels/w4a16_mma.py) GEMM by GEMM at 1-16 rows over warps, chunks a
  step, the zero fold and paired column blocks, against what its config() picks: quant_w4a16_mma_sweep_llama3-8b.
- --rope: the qkv GEMM (taking its norm) ending in RoPE and the KV-cache write against the GEMM and then
  rotary_kv_write, chained as a decode step chains them, at 1-16 rows and 4, 8 or 16 warps (past 8 rows, where the
  engine keeps them apart, the fused kernel timed anyway): quant_w4a16_qkv_rope_llama3-8b.
- --sweep-regs: the fragment layout's kernel GEMM by GEMM at 1-8 rows, at config()'s pick and at 16 warps, with
  ptxas's register cap free or held to 128-64 a thread (more warps an SM, or spills):
  quant_w4a16_mma_regs_llama3-8b.
- --chunked: 17-384 rows, the layer's GEMMs on fragment-laid weights as dispatched, against the mma.sync kernel in
  one launch, the wgmma kernel, dequantize + cuBLAS and bf16: quant_w4a16_rows_chunked_llama3-8b.
- --batched: the int4 (AWQ) and bf16 engines' decode at batches of 16, 32, 64 and 128, and int4 with the wgmma
  kernel off at 64 and 128: quant_int4_decode_batched_llama3-8b.
- --kernels [--batch B]: one decode step of B sequences (default 1) of the int4 (AWQ) and the bf16 engine, its time
  as served and, with every kernel launched plainly, its GPU time kernel by kernel (torch.profiler over a 65-token
  generation less a 1-token one, per step): quant_int4_decode_b{B}_kernels_llama3-8b.
- --sweep-prefetch: the fragment layout's kernel asking L2 for its words 1-3 steps past the registers' step
  (PDSERVE_W4A16_PREFETCH) against none, the layer at 1-16 rows and the AWQ engine's batch-1 decode at each:
  quant_w4a16_prefetch_sweep_llama3-8b.
Records (bench/record.py): quant_w4a16_gemm_m{1,2,4,8,16}_llama3-8b, quant_w4a16_gemm_m4096_llama3-8b,
quant_int4_decode_b1_llama3-8b, quant_int4_weights_llama3-8b; --rope: quant_w4a16_qkv_rope_llama3-8b. About 6
minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COMMAND = "python3 -m bench.quant_int4"
LAYER = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
GROUP, SETS = 128, 6
SMALL_M, BIG_M, CROSSOVER_M = (1, 2, 4, 8, 16), 4096, (32, 64, 128, 256, 512, 1024, 2048)
GOALS = {"gemm_bw": 0.7, "gemm_4096": 0.8, "decode": 2.5, "weights_gb": 5.5}


def int4_layer(device: str, seed: int, fragments: bool = False) -> dict[str, Any]:
    """One layer's dummy int4 weights in the rows layout, or in the fragment layout loaded layers take on a GPU."""
    import torch

    from kernels.int4_dequant import Int4Weight, to_fragments

    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, (k, n) in LAYER.items():
        qweight = torch.randint(  # K-contiguous, as loaded layers hold it (engine/layers/quant/int4.py)
            -(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device=device, generator=g
        ).t()
        scales = torch.full((k // GROUP, n), 0.007, dtype=torch.float16, device=device)
        zeros = torch.randint(0, 16, (k // GROUP, n), dtype=torch.uint8, device=device, generator=g)
        out[name] = Int4Weight(qweight, scales, zeros, GROUP)
        if fragments:
            out[name] = to_fragments(out[name])
    return out


def layer_bytes(w: dict[str, Any]) -> tuple[int, int]:
    """(int4 bytes, all bytes with scales and zeros) of one layer."""
    packed = sum(t.qweight.numel() * 4 for t in w.values())
    return packed, packed + sum(t.scales.numel() * 2 + t.zeros.numel() for t in w.values())


def fused_gemms_us(m: int, sets: list[dict[str, Any]], **kw: Any) -> dict[str, float]:
    """us per GEMM at m rows in the form a decode step runs it (engine/model.py: forward_fused): qkv and gate_up
    (ending in SwiGLU) taking their norm, o and down adding into the stream; kw: more w4a16_mma keywords."""
    import torch

    from bench.kernels import time_us
    from kernels.w4a16_mma import NextNorm, NormedInput, w4a16_mma

    hidden = LAYER["qkv"][0]
    stream = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    norm = NormedInput(torch.rand(m, hidden // 16, device="cuda") + 1.0, 1e-5)
    nxt = NextNorm(torch.ones(hidden, device="cuda", dtype=torch.bfloat16), torch.empty_like(stream),
                   torch.empty_like(norm.sumsq))  # fmt: skip
    xs = {n: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for n, (k, _) in LAYER.items()}
    forms: dict[str, dict[str, Any]] = {
        "qkv": {"norm": norm}, "o": {"add_to": stream, "next_norm": nxt},
        "gate_up": {"swiglu": True, "norm": norm}, "down": {"add_to": stream, "next_norm": nxt},
    }  # fmt: skip
    return {n: time_us([partial(w4a16_mma, xs[n], w[n], **forms[n], **kw) for w in sets]) for n in LAYER}


def gemm_small_m(copy_gbs: float, out_dir: Path | None) -> list[tuple]:
    import torch
    import torch.nn.functional as F

    from bench.kernels import time_us
    from bench.record import record
    from kernels import _backend
    from kernels.w4a16_gemm import w4a16_gemm, w4a16_swiglu

    sets = [int4_layer("cuda", s, fragments=True) for s in range(SETS)]  # as loaded layers hold them
    by_rows = [int4_layer("cuda", s) for s in range(SETS)]  # the rows layout's CUDA-core and swapped kernels
    dense = [{n: torch.randn(k_n[1], k_n[0], device="cuda", dtype=torch.bfloat16) for n, k_n in LAYER.items()}
             for _ in range(SETS)]  # fmt: skip
    packed, total = layer_bytes(by_rows[0])
    rows = []
    for m in SMALL_M:
        xs = {n: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for n, (k, _) in LAYER.items()}
        int4_us = time_us([partial(w4a16_gemm, xs[n], w[n]) for w in sets for n in LAYER]) * len(LAYER)
        served, _backend.PDL = _backend.PDL, False  # the same GEMMs launched plainly
        plain_us = time_us([partial(w4a16_gemm, xs[n], w[n]) for w in sets for n in LAYER]) * len(LAYER)
        _backend.PDL = served
        rows_us = time_us([partial(w4a16_gemm, xs[n], w[n]) for w in by_rows for n in LAYER]) * len(LAYER)
        bf16_us = time_us([partial(F.linear, xs[n], d[n]) for d in dense for n in LAYER]) * len(LAYER)
        gbs = packed / int4_us / 1e3
        per_shape = {n: time_us([partial(w4a16_gemm, xs[n], w[n]) for w in sets]) for n in LAYER}
        rows_per_shape = {n: time_us([partial(w4a16_gemm, xs[n], w[n]) for w in by_rows]) for n in LAYER}
        swiglu_us = time_us([partial(w4a16_swiglu, xs["gate_up"], w["gate_up"]) for w in sets])
        fused = fused_gemms_us(m, sets)
        record(
            f"quant_w4a16_gemm_m{m}_llama3-8b", gbs, "GB/s", ceiling=copy_gbs, ceiling_name="d2d copy (GB/s)",
            goal=f">= {GOALS['gemm_bw']} of copy bandwidth in int4 bytes", out_dir=out_dir, command=COMMAND,
            extra={"layer_us": int4_us, "int4_bytes": packed, "bytes_with_scales_zeros": total,
                   "gbs_with_scales_zeros": total / int4_us / 1e3, "bf16_layer_us": bf16_us,
                   "speedup_over_bf16": bf16_us / int4_us, "per_gemm_us": per_shape,
                   "rows_layout_layer_us": rows_us, "rows_layout_per_gemm_us": rows_per_shape,
                   "speedup_over_rows_layout": rows_us / int4_us, "layer_us_launched_plainly": plain_us,
                   "gbs_launched_plainly": packed / plain_us / 1e3,
                   "gate_up_with_swiglu_us": swiglu_us, "per_gemm_us_norms_fused": fused,
                   "layer_us_norms_fused": sum(fused.values())},
        )  # fmt: skip
        rows.append((f"M={m}", int4_us, gbs, gbs / copy_gbs, bf16_us / int4_us))
    del sets, by_rows, dense
    torch.cuda.empty_cache()
    return rows


def gemm_big_m(out_dir: Path | None) -> tuple[tuple, dict[int, dict[str, float]]]:
    import torch
    import torch.nn.functional as F

    from bench.kernels import time_us
    from bench.record import record
    from kernels.int4_dequant import int4_dequant_triton
    from kernels.w4a16_gemm import DEQUANT_MIN_M, w4a16_gemm, w4a16_gemm_triton

    w = int4_layer("cuda", 100)
    dense = {n: torch.randn(k_n[1], k_n[0], device="cuda", dtype=torch.bfloat16) for n, k_n in LAYER.items()}
    crossover: dict[int, dict[str, float]] = {}
    for m in CROSSOVER_M:
        xs = {n: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for n, (k, _) in LAYER.items()}
        kernel = time_us([partial(w4a16_gemm_triton, xs[n], w[n]) for n in LAYER], min_calls=8) * len(LAYER)
        dq = time_us([partial(lambda x, t: F.linear(x, int4_dequant_triton(t, x.dtype).t()), xs[n], w[n])
                      for n in LAYER], min_calls=8) * len(LAYER)  # fmt: skip
        crossover[m] = {"kernel_us": kernel, "dequant_cublas_us": dq}
    threshold = next(
        (m for m in CROSSOVER_M if crossover[m]["dequant_cublas_us"] < crossover[m]["kernel_us"]), None
    )
    xs = {n: torch.randn(BIG_M, k, device="cuda", dtype=torch.bfloat16) for n, (k, _) in LAYER.items()}
    frag = int4_layer("cuda", 100, fragments=True)  # as loaded layers hold them: dequantized from fragments
    int4_us = time_us([partial(w4a16_gemm, xs[n], frag[n]) for n in LAYER], min_calls=8) * len(LAYER)
    rows_us = time_us([partial(w4a16_gemm, xs[n], w[n]) for n in LAYER], min_calls=8) * len(LAYER)
    bf16_us = time_us([partial(F.linear, xs[n], dense[n]) for n in LAYER], min_calls=8) * len(LAYER)
    record(
        f"quant_w4a16_gemm_m{BIG_M}_llama3-8b", int4_us, "us", baseline=bf16_us,
        baseline_name="bf16 GEMMs of the layer (us)", ratio=bf16_us / int4_us,
        goal=f"bf16 time / int4 time >= {GOALS['gemm_4096']}", out_dir=out_dir, command=COMMAND,
        extra={"crossover": crossover, "dequant_min_m_in_code": DEQUANT_MIN_M, "rows_layout_us": rows_us,
               "measured_first_m_where_dequant_wins": threshold},
    )  # fmt: skip
    return (f"M={BIG_M}", int4_us, None, None, bf16_us / int4_us), crossover


def sweep() -> None:
    """Tile configs of the kernel at M = 1, 4, 16 over the layer's four shapes (the best is printed)."""
    import torch

    from bench.kernels import time_us
    from kernels.w4a16_gemm import GemmConfig, w4a16_gemm_triton

    sets = [int4_layer("cuda", s) for s in range(SETS)]
    for m in (1, 4, 16):
        xs = {n: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for n, (k, _) in LAYER.items()}
        found = []
        configs = [  # the swapped kernel (the default up to 16 rows)
            GemmConfig(8 if m <= 8 else 16, block_n, split, warps, stages, swap=True)
            for block_n in (64, 128, 256)
            for split in (1, 2, 4, 8, 16)
            for warps, stages in ((4, 2), (4, 3), (8, 2), (8, 3))
        ]
        configs += [  # the CUDA-core kernel (m rows a program) up to 4 rows, the 16-row dots above
            GemmConfig(m, block_n, split, warps, 3, cuda_cores=True)
            if m <= 4
            else GemmConfig(16, block_n, split, warps, 2)
            for block_n in (64, 128, 256)
            for split in (4, 8, 16)
            for warps in (4, 8)
        ]
        for cfg in configs:
            try:
                t = time_us([partial(w4a16_gemm_triton, xs[n], w[n], None, cfg) for w in sets for n in LAYER])
            except Exception as e:  # a config the device cannot run (shared memory, registers)
                print(f"  M={m} {cfg}: {type(e).__name__}", flush=True)
                continue
            found.append((t * len(LAYER), cfg))
        found.sort(key=lambda f: f[0])
        print(f"sweep M={m}: best " + "; ".join(f"{t:.1f} us {c}" for t, c in found[:3]), flush=True)


def sweep_m1(out_dir: Path | None) -> None:
    """The one-row kernel's configs for each GEMM of the layer, [us, GB/s of int4 bytes] each, as a record."""
    import torch

    from bench.kernels import time_us
    from bench.record import record
    from kernels.w4a16_gemm import GemmConfig, w4a16_gemm_triton

    sets = [int4_layer("cuda", s) for s in range(SETS)]
    found: dict[str, dict[str, list[float]]] = {}
    for name, (k, _) in LAYER.items():
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        swiglu = name == "gate_up"
        if swiglu:
            configs = [
                GemmConfig(1, bn, 1, w, 3, block_k=bk) for bn in (16, 32) for bk in (256, 512) for w in (4, 8)
            ]
        else:
            configs = [GemmConfig(1, 16, sp, 4, 3, block_k=bk) for bk in (256, 512) for sp in (1, 2, 4, 8)]
            configs += [GemmConfig(1, 32, sp, 4, 3, block_k=512) for sp in (1, 2)]
            configs += [GemmConfig(1, 16, sp, 8, 3, block_k=512) for sp in (1, 2)]
            configs += [GemmConfig(1, 16, 1, 4, st, block_k=512) for st in (2, 4)]
            # more, smaller programs: 8 columns, 1-2 warps, 1,024-row K tiles
            configs += [
                GemmConfig(1, 8, 1, w, st, block_k=bk)
                for w in (1, 2, 4)
                for st in (3, 4)
                for bk in (512, 1024)
            ]
        nbytes = sets[0][name].qweight.numel() * 4
        found[name] = {}
        for cfg in configs:
            us = time_us([partial(w4a16_gemm_triton, x, w[name], None, cfg, swiglu) for w in sets])
            key = f"block_n={cfg.block_n}, split_k={cfg.split_k}, num_warps={cfg.num_warps}, block_k={cfg.block_k}"
            key += f", num_stages={cfg.num_stages}" if cfg.num_stages != 3 else ""
            found[name][key] = [round(us, 2), round(nbytes / us / 1e3)]
        print(
            f"sweep M=1 {name}: " + "; ".join(f"{k}: {v[0]} us" for k, v in found[name].items()), flush=True
        )
    gate_up = found["gate_up"]
    default = gate_up["block_n=16, split_k=1, num_warps=4, block_k=512"][0]
    best = min(v[0] for v in gate_up.values())
    record(
        "quant_w4a16_m1_sweep_llama3-8b", best, "us", baseline=default,
        baseline_name="gate_up + SwiGLU at one row, 16 columns a program (us)", ratio=default / best,
        out_dir=out_dir, command=COMMAND + " --sweep-m1",
        extra={"what": "one-row W4A16 GEMMs of a Llama-3-8B layer, group 128, six weight sets, graph replay: "
                       "[us, GB/s of int4 bytes] per config", "configs": found},
    )  # fmt: skip


def sweep_mma(out_dir: Path | None) -> None:
    """The fragment layout's kernel, GEMM by GEMM at 1, 4, 8 and 16 rows: warps, chunks a step, the zero fold (F
    folded, X a second MMA's x sums) and two column blocks a program (P), [us] each, against what config() picks:
    quant_w4a16_mma_sweep_llama3-8b."""
    import torch

    from bench.kernels import time_us
    from bench.record import record
    from kernels.w4a16_mma import config, w4a16_mma

    def key(fold: bool, w: int, u: int, pair: bool = False) -> str:
        return f"{'F' if fold else 'X'}W{w}U{u}" + ("P" if pair else "")

    sets = [int4_layer("cuda", s, fragments=True) for s in range(SETS)]
    found: dict[str, dict[str, float]] = {}
    picked, best = 0.0, 0.0
    for m in (1, 4, 8, 16):
        for name, (k, n) in LAYER.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {
                key(fold, w, u, pair): round(
                    time_us(
                        [partial(w4a16_mma, x, ws[name], None, w, u, fold, None, pair=pair) for ws in sets]
                    ),
                    2,
                )
                for fold in (True, False)
                for w in (4, 8)
                for u, pair in ((1, False), (2, False), (1, True))
            }
            w, u, fold, pair = config(m, n, k, x.device)
            row["config"] = row[key(fold, w, 1 if pair else u, pair)]
            found[f"M={m} {name}"] = row
            picked += row["config"] if m == 1 else 0.0
            best += min(v for key, v in row.items() if key != "config") if m == 1 else 0.0
            print(f"sweep mma M={m} {name}: {row}", flush=True)
    record(
        "quant_w4a16_mma_sweep_llama3-8b", picked, "us", baseline=best,
        baseline_name="the best config per GEMM at one row, summed over the layer (us)", ratio=best / picked,
        out_dir=out_dir, command=COMMAND + " --sweep-mma",
        extra={"what": "the fragment layout's W4A16 kernel per Llama-3-8B GEMM (group 128, six weight sets, graph "
                       "replay), us per config: F zeros folded into the A registers, X a second MMA's x sums; W "
                       "warps; U chunks a step, loaded a step ahead; P two adjacent column blocks a program; "
                       "config: what kernels/w4a16_mma.config picks", "configs": found},
    )  # fmt: skip


WGMMA_SWEEP_M = (64, 128, 192, 256)
# (rows of x a program, warpgroups, 64-column tiles a warpgroup, ring stages) the wgmma sweep times
WGMMA_CONFIGS = [(64, 1, 1, 3), (64, 2, 1, 3), (64, 1, 2, 3), (64, 2, 2, 3), (128, 1, 1, 3), (128, 2, 1, 3),
                 (128, 1, 2, 2), (128, 1, 2, 3), (128, 2, 2, 2), (256, 1, 1, 2), (256, 2, 1, 2)]  # fmt: skip


def sweep_wgmma(out_dir: Path | None) -> None:
    """The wgmma kernel GEMM by GEMM at 64-256 rows: every config of WGMMA_CONFIGS at up to three K splits (about one
    and two programs an SM, and the most that keep the tiles to one wave), each checked against the dequantized
    weights' product, us against what config() picks, and config()'s pick with overlap=False (the MMAs' overlap
    across chunks off; the products must be equal): quant_w4a16_wgmma_sweep_llama3-8b (value: the layer at config()'s
    picks over the rows, against the best config per GEMM)."""
    import torch
    import torch.nn.functional as F
    import triton

    from bench.kernels import time_us
    from bench.record import record
    from kernels._backend import num_sms
    from kernels.int4_dequant import int4_dequant
    from kernels.w4a16_wgmma import config, ring_stages, w4a16_wgmma

    sets = [int4_layer("cuda", s, fragments=True) for s in range(SETS)]
    sms = num_sms(torch.device("cuda"))
    found: dict[str, dict[str, float]] = {}
    layers: dict[str, dict[str, float]] = {}
    picked, best = 0.0, 0.0
    for m in WGMMA_SWEEP_M:
        for name, (k, n) in LAYER.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), int4_dequant(sets[0][name], torch.float32))
            row: dict[str, float] = {}
            for bm, wg, mb, stages in WGMMA_CONFIGS:
                if bm > 64 and m <= 64 or bm == 64 and m > 128:
                    continue
                tiles = triton.cdiv(n, 64 * wg * mb) * triton.cdiv(m, bm)
                splits = {
                    max(1, min(k // 128 // 4, s))
                    for s in (round(sms / tiles), round(2 * sms / tiles), sms // tiles)
                }
                for split in sorted(splits):
                    cfg: dict[str, Any] = dict(
                        block_m=bm,
                        warpgroups=wg,
                        column_tiles=mb,
                        split=split,
                        stages=stages,
                    )
                    key = f"BM{bm}WG{wg}T{mb}S{stages}K{split}"
                    if key in row:
                        continue
                    try:
                        out = w4a16_wgmma(x, sets[0][name], **cfg).float()
                        err = ((out - ref).norm() / ref.norm()).item()
                        if err > 2e-2:
                            print(f"  M={m} {name} {key}: WRONG (relative error {err:.3g})", flush=True)
                            row[key] = float("nan")
                            continue
                        fns = [partial(w4a16_wgmma, x, ws[name], **cfg) for ws in sets]
                        row[key] = round(time_us(fns), 2)
                    except Exception as e:  # a config the device cannot run (shared memory, registers)
                        print(f"  M={m} {name} {key}: {type(e).__name__} {str(e)[:200]}", flush=True)
            bm, wg, mb, split = config(m, n, k, 128, x.device)
            stages = ring_stages(bm, triton.cdiv(n, 64 * wg * mb) * triton.cdiv(m, bm) * split, x.device)
            row["config"] = round(time_us([partial(w4a16_wgmma, x, ws[name]) for ws in sets]), 2)
            # the A-B of the MMAs kept in flight across chunks: each waited for before the next chunk's dequant
            if not torch.equal(w4a16_wgmma(x, sets[0][name]), w4a16_wgmma(x, sets[0][name], overlap=False)):
                print(f"  M={m} {name}: the overlapped and waited products differ", flush=True)
            row["overlap_off"] = round(
                time_us([partial(w4a16_wgmma, x, ws[name], overlap=False) for ws in sets]), 2
            )
            row["config_is"] = f"BM{bm}WG{wg}T{mb}S{stages}K{split}"  # type: ignore[assignment]
            found[f"M={m} {name}"] = row
            timed = sorted(
                (v, c)
                for c, v in row.items()
                if isinstance(v, float) and v == v and c not in ("config", "overlap_off")
            )
            picked += row["config"]
            best += timed[0][0]
            layer = layers.setdefault(str(m), {"config": 0.0, "overlap_off": 0.0, "two_an_sm": 0.0})
            layer["config"] = round(layer["config"] + row["config"], 2)
            layer["overlap_off"] = round(layer["overlap_off"] + row["overlap_off"], 2)
            # the plan config() had before one program an SM: two an SM with two stages wherever rows pass 64
            two = max(1, min(k // 128 // 4, round(2 * sms / (triton.cdiv(n, 128) * triton.cdiv(m, bm)))))
            key = f"BM{bm}WG1T2S{3 if bm == 64 else 2}K{two}"
            layer["two_an_sm"] = round(layer["two_an_sm"] + row.get(key, float("nan")), 2)
            print(f"sweep wgmma M={m} {name}: config {row['config']} ({row['config_is']}), overlap off "
                  f"{row['overlap_off']}; best "
                  + ", ".join(f"{key} {v}" for v, key in timed[:4]), flush=True)  # fmt: skip
    record(
        "quant_w4a16_wgmma_sweep_llama3-8b", picked, "us", baseline=best,
        baseline_name="the best config per GEMM, summed over the layer and the rows (us)", ratio=best / picked,
        out_dir=out_dir, command=COMMAND + " --sweep-wgmma",
        extra={"what": "the wgmma W4A16 kernel per Llama-3-8B GEMM at 64 / 128 / 192 / 256 rows (group 128, six "
                       "weight sets, graph replay), us per config: BM rows of x a program, WG warpgroups, T 64-column "
                       "tiles a warpgroup, S ring stages, K splits; config: what kernels/w4a16_wgmma.config picks; "
                       "overlap_off: config()'s pick with each chunk's MMAs waited for before the next chunk's dequant; "
                       "two_an_sm: the layer with two programs an SM and two stages past 64 rows (config()'s plan "
                       "before one program an SM where the tiles fit a wave)",
               "layer_by_rows_us": layers, "configs": found},
    )  # fmt: skip


def _load_only_kernel():
    """A Triton kernel that loads the packed weights in the one-row GEMM's tiles and pipeline (columns a
    program, K tile, stages) and only folds them into one word per column: the GEMM without its arithmetic."""
    import triton
    import triton.language as tl

    @triton.jit
    def load_only(qw_ptr, out_ptr, K, stride_qk, stride_qn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  NUM_STAGES: tl.constexpr):  # fmt: skip
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        R: tl.constexpr = BLOCK_K // 8
        rows = tl.arange(0, R)
        acc = tl.zeros((BLOCK_N, R), dtype=tl.int32)
        for t in tl.range(0, K // BLOCK_K, num_stages=NUM_STAGES):
            acc = acc ^ tl.load(qw_ptr + offs_n[:, None] * stride_qn + (t * R + rows)[None, :] * stride_qk)
        tl.store(out_ptr + offs_n, tl.sum(acc, 1))

    return load_only


def limits_m1(out_dir: Path | None) -> None:
    """The one-row GEMMs against a same-bytes copy, their own loads alone, and their L2-resident time."""
    import torch

    from bench.kernels import same_bytes_copy_us, time_us
    from bench.record import record
    from kernels.w4a16_gemm import (
        GEMV_SWIGLU_BLOCK_N,
        GEMV_SWIGLU_STAGES,
        default_config,
        w4a16_gemm,
        w4a16_swiglu,
    )

    load_only = _load_only_kernel()
    sets = [int4_layer("cuda", s) for s in range(SETS)]
    per: dict[str, dict[str, float]] = {}
    for name, (k, n) in LAYER.items():
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        gemm = w4a16_swiglu if name == "gate_up" else w4a16_gemm
        cfg = default_config(1, n, k, x.device)
        block_n, stages = (
            (GEMV_SWIGLU_BLOCK_N, GEMV_SWIGLU_STAGES) if name == "gate_up" else (cfg.block_n, cfg.num_stages)
        )
        out = torch.empty(n, dtype=torch.int32, device="cuda")
        loads = [
            partial(load_only[(n // block_n,)], w[name].qweight, out, k, *w[name].qweight.stride(), BLOCK_N=block_n,
                    BLOCK_K=cfg.block_k, NUM_STAGES=stages, num_warps=cfg.num_warps, num_stages=stages)
            for w in sets
        ]  # fmt: skip
        per[name] = {
            "kernel_us": time_us([partial(gemm, x, w[name]) for w in sets]),
            "same_bytes_copy_us": same_bytes_copy_us(k * n // 2, SETS),
            "load_only_us": time_us(loads),
            "one_set_from_l2_us": time_us([partial(gemm, x, sets[0][name])]),
        }
        print(f"limits M=1 {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in per[name].items()), flush=True)
    layer = {key: sum(p[key] for p in per.values()) for key in per["qkv"]}
    record(
        "quant_w4a16_m1_limits_llama3-8b", layer["kernel_us"], "us", baseline=layer["same_bytes_copy_us"],
        baseline_name="a copy kernel moving the same bytes, GEMM by GEMM (us)",
        ratio=layer["same_bytes_copy_us"] / layer["kernel_us"], out_dir=out_dir, command=COMMAND + " --limits",
        extra={"what": "one-row W4A16 GEMMs of a Llama-3-8B layer (gate_up with SwiGLU), group 128, graph "
                       "replay over six weight sets; load_only: the same tiles and pipeline, loads only; "
                       "one_set_from_l2: one weight set replayed (it stays in L2)", "layer": layer, "per_gemm": per},
    )  # fmt: skip


def kernels_per_step(generate_ids) -> list[tuple[str, float, float]]:
    """(kernel, us per decode step, launches per step), largest first: the CUDA time of a 65-token generation
    less that of a 1-token one (its prefill), over 64 steps. `generate_ids(n)` generates n tokens."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    def by_kernel(n: int) -> dict[str, list[float]]:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate_ids(n)
        found: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for e in prof.events():
            if e.device_type.name == "CUDA":
                found[e.name][0] += e.device_time_total
                found[e.name][1] += 1
        return found

    steps = 64
    full, one = by_kernel(steps + 1), by_kernel(1)
    rows = [(k, (v[0] - one.get(k, [0.0, 0.0])[0]) / steps, (v[1] - one.get(k, [0.0, 0.0])[1]) / steps)
            for k, v in full.items()]  # fmt: skip
    return sorted((r for r in rows if r[1] > 0.05), key=lambda r: -r[1])


def engine_part(part: str, kernels: bool = False, batch: int = 1) -> dict[str, Any]:
    """One engine's decode and its weights (child process): bf16 ("none"), AWQ ("awq": its LM head dense, as AWQ
    keeps it) or GPTQ with the LM head quantized too ("gptq_head": lm_head=true); `batch` fresh prompts at once
    (tok_s is then each sequence's rate)."""
    import torch

    from bench.latency import decode_tps, prompt
    from engine import LLM, SamplingParams
    from engine.model_config import dummy_config

    model, quantization = "Llama-3-8B", {"none": None, "awq": "awq", "gptq_head": None}[part]
    if part == "gptq_head":  # dummy weights in a directory's shapes and quantization_config
        model = tempfile.mkdtemp()
        quant = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "lm_head": True}
        config = {**dummy_config("Llama-3-8B").to_hf_dict(), "quantization_config": quant}
        Path(model, "config.json").write_text(json.dumps(config))

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, rec: logging.LogRecord) -> None:
            lines.append(rec.getMessage())

    logging.getLogger("engine.model_runner").addHandler(Keep())
    logging.getLogger("engine.model_runner").setLevel(logging.INFO)
    t0 = time.perf_counter()
    llm = LLM(model, load_format="dummy", dtype="bfloat16", quantization=quantization,
              max_num_seqs=max(16, batch), enable_prefix_caching=False, gpu_memory_utilization=0.9)  # fmt: skip
    startup = time.perf_counter() - t0
    model = llm.engine.runner.model
    seeds = iter(range(10**6))

    def generate(n: int) -> float:
        ids = [{"prompt_token_ids": prompt(128256, next(seeds))} for _ in range(batch)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t

    linear = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "_proj." in n)
    if kernels:  # the same `batch` prompts each time
        ids = [{"prompt_token_ids": prompt(128256, i)} for i in range(batch)]

        def generate_ids(n: int) -> None:
            llm.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            torch.cuda.synchronize()

        return {**decode_tps(generate), "kernels_per_step": kernels_per_step(generate_ids)}
    return {
        **decode_tps(generate),
        "startup_s": startup,
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "linear_weight_bytes": linear,
        "kv_log": next((line for line in lines if line.startswith("KV cache")), None),
    }


def child(
    quantization: str, timeout: float, kernels: bool = False, batch: int = 1, **knobs: str
) -> dict[str, Any]:
    """One engine part in a process of its own, with kernel knobs (kernels/_backend.py) set in its environment:
    PDSERVE_PDL="0" launches every kernel plainly, PDSERVE_FUSED_NORMS="0" keeps the norms in kernels of their
    own."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "-m", "bench.quant_int4", "--part", quantization, "--json", f.name]
        cmd += ["--kernels"] if kernels else []
        cmd += ["--batch", str(batch)]
        env = {**os.environ, **knobs}
        proc = subprocess.run(cmd, timeout=timeout, cwd=Path(__file__).resolve().parent.parent, env=env)
        if proc.returncode != 0:
            return {"error": f"engine ({quantization}, {knobs}): exit {proc.returncode}"}
        return json.loads(Path(f.name).read_text())


def engines(out_dir: Path | None) -> list[tuple]:
    from bench.record import record

    bf16, int4, head = child("none", 400), child("awq", 400), child("gptq_head", 400)
    plain, bf16_plain = child("awq", 400, PDSERVE_PDL="0"), child("none", 400, PDSERVE_PDL="0")
    own_norms = child("awq", 400, PDSERVE_FUSED_NORMS="0")
    own_rotary = child("awq", 400, PDSERVE_FUSED_ROTARY="0")
    found = {
        "bf16": bf16,
        "int4": int4,
        "int4_lm_head": head,
        "int4_no_pdl": plain,
        "bf16_no_pdl": bf16_plain,
        "int4_norm_kernels": own_norms,
        "int4_rotary_kernel": own_rotary,
    }
    print(json.dumps(found, indent=1), flush=True)
    if any("error" in part for part in found.values()):
        return [("engine", None, None, None, None)]
    record(
        "quant_int4_decode_b1_llama3-8b", int4["tok_s"], "tok/s", baseline=bf16["tok_s"],
        baseline_name="bf16 engine, same run (tok/s)", goal=f">= {GOALS['decode']}x the bf16 engine",
        out_dir=out_dir, command=COMMAND,
        extra={"int4": int4, "bf16": bf16, "int4_without_pdl": plain, "bf16_without_pdl": bf16_plain,
               "pdl_speedup_int4": int4["tok_s"] / plain["tok_s"],
               "pdl_speedup_bf16": bf16["tok_s"] / bf16_plain["tok_s"],
               "ratio_without_pdl": plain["tok_s"] / bf16_plain["tok_s"],
               "int4_norms_in_kernels_of_their_own": own_norms,
               "fused_norms_speedup": int4["tok_s"] / own_norms["tok_s"],
               "int4_rotary_in_a_kernel_of_its_own": own_rotary,
               "fused_rotary_speedup": int4["tok_s"] / own_rotary["tok_s"]},
    )  # fmt: skip
    gb = head["weight_bytes"] / 1e9
    record(
        "quant_int4_weights_llama3-8b", gb, "GB", baseline=bf16["weight_bytes"] / 1e9,
        baseline_name="bf16 weights (GB)", goal=f"<= {GOALS['weights_gb']} GB", out_dir=out_dir, command=COMMAND,
        extra={"what": "GPTQ int4, group 128, LM head quantized (lm_head=true), embedding bf16",
               "gib": head["weight_bytes"] / 2**30, "kv_sizing_log_line": head["kv_log"],
               "awq_lm_head_dense_gb": int4["weight_bytes"] / 1e9, "awq_kv_sizing_log_line": int4["kv_log"],
               "linear_layers_gb": int4["linear_weight_bytes"] / 1e9,
               "decode_tok_s_lm_head_quantized": head["tok_s"]},
    )  # fmt: skip
    return [("engine b1 decode (tok/s)", int4["tok_s"], bf16["tok_s"], None, int4["tok_s"] / bf16["tok_s"]),
            ("  LM head int4 too", head["tok_s"], bf16["tok_s"], None, head["tok_s"] / bf16["tok_s"]),
            ("  no PDL, both", plain["tok_s"], bf16_plain["tok_s"], None, plain["tok_s"] / bf16_plain["tok_s"]),
            ("  int4 norms in own kernels", own_norms["tok_s"], bf16["tok_s"], None,
             own_norms["tok_s"] / bf16["tok_s"]),
            ("  int4 rotary in own kernel", own_rotary["tok_s"], bf16["tok_s"], None,
             own_rotary["tok_s"] / bf16["tok_s"]),
            ("weights (GB), head int4", gb, bf16["weight_bytes"] / 1e9, None, None),
            ("weights (GB), head bf16", int4["weight_bytes"] / 1e9, bf16["weight_bytes"] / 1e9, None, None)]  # fmt: skip


def rope_epilogue(out_dir: Path | None) -> None:
    """The qkv GEMM (taking its norm) ending in RoPE and the KV-cache write, against the GEMM and then
    rotary_kv_write, as a decode step chains them (PDL, graph replay over six layers' weights), at 1-16 rows:
    quant_w4a16_qkv_rope_llama3-8b (one row). Past ROPE_MAX_ROWS the fused GEMM is timed at its warps as named."""
    import torch

    from bench.kernels import time_us
    from bench.record import record
    from kernels.w4a16_mma import ROPE_WARPS, NormedInput, RopeWrite, w4a16_mma

    sets = [int4_layer("cuda", s, fragments=True) for s in range(SETS)]
    heads, kv_heads, d = 32, 8, 128
    cos_sin = torch.randn(8192, d, device="cuda", dtype=torch.bfloat16)
    cache = torch.zeros(2, 512, 16, kv_heads, d, device="cuda", dtype=torch.bfloat16)
    found: dict[int, dict[str, float]] = {}
    for m in SMALL_M:
        x = torch.randn(m, LAYER["qkv"][0], device="cuda", dtype=torch.bfloat16)
        norm = NormedInput(torch.rand(m, LAYER["qkv"][0] // 16, device="cuda") + 1.0, 1e-5)
        pos = torch.arange(m, device="cuda") + 100
        slots = torch.arange(m, device="cuda") + 1600
        rope = RopeWrite(pos, cos_sin, cache, slots, heads, kv_heads)
        row = {
            "qkv_us": time_us([partial(w4a16_mma, x, w["qkv"], norm=norm) for w in sets]),
            "qkv_then_rotary_us": time_us([partial(_qkv_then_rotary, x, w["qkv"], norm, rope) for w in sets]),
        }
        for warps in (4, 8, 16):  # 16: as many warps as one-block programs have, over half the programs
            try:
                row[f"fused_w{warps}_us"] = time_us(
                    [partial(_rope_launch, x, w["qkv"], norm, rope, warps) for w in sets]
                )
            except Exception as e:  # a config that does not compile is reported, not fatal
                print(f"rope M={m} {warps} warps: {type(e).__name__}: {str(e)[:200]}", flush=True)
                row[f"fused_w{warps}_us"] = float("nan")
        found[m] = row
        print(f"rope M={m}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    one = found[1]
    record(
        "quant_w4a16_qkv_rope_llama3-8b", one[f"fused_w{ROPE_WARPS}_us"], "us", baseline=one["qkv_then_rotary_us"],
        baseline_name="the qkv GEMM, then rotary_kv_write (us)",
        ratio=one["qkv_then_rotary_us"] / one[f"fused_w{ROPE_WARPS}_us"], out_dir=out_dir, command=COMMAND + " --rope",
        extra={"what": "Llama-3-8B's qkv GEMM taking its norm, one row, ending in RoPE and the KV-cache write, "
                       "against the GEMM and then rotary_kv_write, PDL-chained, graph replay over six layers",
               "by_rows": found},
    )  # fmt: skip


REG_CAPS = (None, 128, 96, 80, 64)  # ptxas's registers a thread; None: its own choice


def sweep_regs(out_dir: Path | None) -> None:
    """The fragment layout's kernel GEMM by GEMM (gate_up ending in SwiGLU, as the engine runs it) at 1, 4 and 8 rows:
    config()'s pick and 16 warps a program, each with ptxas's register cap left free or held to 128, 96, 80 or 64 a
    thread, so that more warps share an SM (its loads' latency is what bounds it: docs/kernels.md) or spill. [us]
    each, and each compiled variant's registers and spills: quant_w4a16_mma_regs_llama3-8b (the layer at one row,
    the best cap per GEMM against config()'s pick as it runs)."""
    import torch

    from bench.kernels import time_us
    from bench.record import record
    from kernels.w4a16_mma import _w4a16_mma_kernel, config, swiglu_config, w4a16_mma

    sets = [int4_layer("cuda", s, fragments=True) for s in range(SETS)]
    found: dict[str, dict[str, float | None]] = {}
    as_run, best = 0.0, 0.0
    for m in (1, 4, 8):
        for name, (k, n) in LAYER.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            swiglu = name == "gate_up"
            warps, unroll, fold, pair = swiglu_config(m) if swiglu else config(m, n, k, x.device)
            row: dict[str, float | None] = {}
            for w, u, p in ((warps, unroll, pair), (16, 1, False)):
                for cap in REG_CAPS:
                    label = f"W{w}U{u}{'P' if p else ''}R{cap or 'free'}"
                    launch = partial(w4a16_mma, x, warps=w, unroll=u, fold=fold, pair=p, swiglu=swiglu,
                                     max_registers=cap)  # fmt: skip
                    try:
                        row[label] = round(time_us([partial(launch, w=ws[name]) for ws in sets]), 2)
                    except Exception as e:  # a config that does not compile or launch is reported, not fatal
                        print(f"regs M={m} {name} {label}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                        row[label] = None
            timed = [v for v in row.values() if v is not None]
            found[f"M={m} {name}"] = row
            if m == 1:
                as_run += row[f"W{warps}U{unroll}{'P' if pair else ''}Rfree"] or float("nan")
                best += min(timed)
            print(f"regs M={m} {name}: {row}", flush=True)
    record(
        "quant_w4a16_mma_regs_llama3-8b", best, "us", baseline=as_run,
        baseline_name="config()'s pick per GEMM at one row, registers as ptxas chooses, summed over the layer (us)",
        ratio=as_run / best, out_dir=out_dir, command=COMMAND + " --sweep-regs",
        extra={"what": "the fragment layout's W4A16 kernel per Llama-3-8B GEMM (group 128, six weight sets, graph "
                       "replay; gate_up ending in SwiGLU), us per config: W warps, U chunks a step, P two column "
                       "blocks a program, R ptxas's register cap a thread (free: its own choice); None: it did not "
                       "compile or launch", "configs": found, "variants": _compiled_variants(_w4a16_mma_kernel)},
    )  # fmt: skip


PREFETCH_STEPS = (0, 1, 2, 3)


def sweep_prefetch(out_dir: Path | None) -> None:
    """The fragment layout's kernel asking L2 for its words 1-3 steps past the one it loads into registers
    (PDSERVE_W4A16_PREFETCH), against none: the layer's four GEMMs at 1-16 rows as the records time them and in the
    form a decode step runs them (1-8 rows), each distance twice in turn; then the AWQ engine's batch-1 decode at
    each distance, alternating: quant_w4a16_prefetch_sweep_llama3-8b (the one-row layer at the best distance against
    none)."""
    import torch

    from bench.kernels import time_us
    from bench.record import record
    from kernels.w4a16_mma import _w4a16_mma_kernel, w4a16_mma

    # up to 16 rows w4a16_gemm's pick for fragment-laid weights is w4a16_mma, which takes the distance
    sets = [int4_layer("cuda", s, fragments=True) for s in range(SETS)]
    layers: dict[str, dict[str, list[float]]] = {}
    for m in SMALL_M:
        xs = {n: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for n, (k, _) in LAYER.items()}
        found: dict[str, list[float]] = {}
        for _ in range(2):
            for steps in PREFETCH_STEPS:
                calls = [partial(w4a16_mma, xs[n], w[n], prefetch=steps) for w in sets for n in LAYER]
                found.setdefault(f"layer_pf{steps}", []).append(round(time_us(calls) * len(LAYER), 2))
                if m <= 8:
                    fused = fused_gemms_us(m, sets, prefetch=steps)
                    found.setdefault(f"served_pf{steps}", []).append(round(sum(fused.values()), 2))
                    for n, us in fused.items():
                        found.setdefault(f"{n}_pf{steps}", []).append(round(us, 2))
        layers[f"M={m}"] = found
        print(f"prefetch M={m}: {found}", flush=True)
    torch.cuda.empty_cache()
    engine: dict[str, list[float | None]] = {}
    for steps in (0, 2, 1, 0, 2):
        part = child("awq", 400, PDSERVE_W4A16_PREFETCH=str(steps))
        engine.setdefault(f"pf{steps}", []).append(part.get("tok_s"))
        print(f"prefetch engine pf{steps}: {part.get('tok_s', part)}", flush=True)
    one = layers["M=1"]
    none = min(one["layer_pf0"])
    best = min(min(one[f"layer_pf{s}"]) for s in PREFETCH_STEPS)
    record(
        "quant_w4a16_prefetch_sweep_llama3-8b", best, "us", baseline=none,
        baseline_name="the one-row layer with no words asked into L2 ahead (us)", ratio=none / best,
        out_dir=out_dir, command=COMMAND + " --sweep-prefetch",
        extra={"what": "the fragment layout's W4A16 kernel asking L2 for its words N steps past the registers' step "
                       "(prefetch.global.L2), N = 0-3: the layer's four GEMMs (layer_pfN: as the gemm records time "
                       "them; served_pfN and per GEMM: qkv and gate_up with SwiGLU taking their norm, o and down "
                       "adding into the stream), us, each distance timed twice in turn; engine: the AWQ engine's "
                       "batch-1 decode tok/s (PDSERVE_W4A16_PREFETCH=N), alternating",
               "layers": layers, "engine": engine, "variants": _compiled_variants(_w4a16_mma_kernel)},
    )  # fmt: skip


def _compiled_variants(kernel: Any) -> list[dict[str, Any]]:
    """Each compiled variant of a Triton / Gluon kernel: warps, register cap, registers and spills a thread, and
    the constexprs that tell it apart (what this Triton exposes of them; absent fields are None)."""
    out = []
    for caches in getattr(kernel, "device_caches", {}).values():
        for compiled in caches[0].values():
            meta = compiled.metadata
            try:
                names = kernel.arg_names
                consts = {
                    (names[key[0]] if isinstance(key, tuple) else str(key)): value
                    for key, value in compiled.src.constants.items()
                    if isinstance(value, (bool, int))
                }
                consts = {
                    key: consts[key]
                    for key in ("W", "Q", "U", "BN", "SWIGLU", "PAIR", "FOLD")
                    if key in consts
                }
            except Exception:  # what a Triton version exposes of its variants differs
                consts = {}
            out.append({
                "warps": getattr(meta, "num_warps", None), "maxnreg": getattr(meta, "maxnreg", None),
                "registers": getattr(compiled, "n_regs", None), "spills": getattr(compiled, "n_spills", None),
                **consts,
            })  # fmt: skip
    return out


def _qkv_then_rotary(x: Any, w: Any, norm: Any, rope: Any) -> None:
    """The qkv GEMM taking its norm, then rotary_kv_write on its output: the unfused pair."""
    from kernels.rotary_kv_write import rotary_kv_write
    from kernels.w4a16_mma import w4a16_mma

    m, h, kvh, d = x.shape[0], rope.num_heads, rope.num_kv_heads, rope.head_dim
    q, k, v = w4a16_mma(x, w, norm=norm).split([h * d, kvh * d, kvh * d], dim=-1)
    rotary_kv_write(q.view(m, h, d), k.view(m, kvh, d), v.view(m, kvh, d), rope.positions, rope.cos_sin_cache,
                    rope.kv_cache, rope.slot_mapping)  # fmt: skip


def _rope_launch(x: Any, w: Any, norm: Any, rope: Any, warps: int) -> None:
    """The qkv GEMM ending in RoPE at `warps`, zeros folded up to 8 rows; past ROPE_MAX_ROWS, where w4a16_mma
    refuses it, too (timing only: the engine keeps the two kernels apart there)."""
    from kernels import w4a16_mma as mma

    saved = mma.ROPE_MAX_ROWS
    mma.ROPE_MAX_ROWS = max(saved, x.shape[0])
    try:
        mma.w4a16_mma(x, w, norm=norm, rope=rope, warps=warps, fold=x.shape[0] <= 8)
    finally:
        mma.ROPE_MAX_ROWS = saved


CHUNKED_M = (17, 32, 33, 48, 64, 128, 256, 384)


def rows_chunked(out_dir: Path | None) -> None:
    """17-384 rows (decode batches past a program's 16, small prefills): a Llama-3-8B layer's GEMMs on fragment-laid
    weights (gate_up ending in SwiGLU) as the engine runs them (kernels/w4a16_gemm.py's dispatch), against the
    mma.sync kernel in one launch (kernels/w4a16_mma.py: a column block's 16-row programs side by side), the wgmma
    kernel (kernels/w4a16_wgmma.py, then SiLU-and-mul), dequantize + cuBLAS (then SiLU-and-mul) and bf16, over six
    weight sets: quant_w4a16_rows_chunked_llama3-8b (value: the layer as dispatched at 64 rows, against bf16), which
    sets the rows each kernel takes (w4a16_mma.MAX_ROWS, w4a16_wgmma.MIN_ROWS and MAX_ROWS)."""
    import torch
    import torch.nn.functional as F

    import kernels.w4a16_gemm as gemm
    import kernels.w4a16_mma as mma
    import kernels.w4a16_wgmma as wgmma
    from bench.kernels import time_us
    from bench.record import record
    from kernels import _backend
    from kernels.int4_dequant import int4_dequant
    from kernels.silu_and_mul import silu_and_mul

    sets = [int4_layer("cuda", s, fragments=True) for s in range(SETS)]
    dense = [{n: torch.randn(k_n[1], k_n[0], device="cuda", dtype=torch.bfloat16) for n, k_n in LAYER.items()}
             for _ in range(SETS)]  # fmt: skip

    def dispatched(x: torch.Tensor, w: Any, name: str) -> torch.Tensor:
        return gemm.w4a16_swiglu(x, w) if name == "gate_up" else gemm.w4a16_gemm(x, w)

    def mma_one_launch(x: torch.Tensor, w: Any, name: str) -> torch.Tensor:
        return mma.w4a16_mma(x, w, swiglu=name == "gate_up")

    def on_wgmma(x: torch.Tensor, w: Any, name: str) -> torch.Tensor:
        out = wgmma.w4a16_wgmma(x, w)
        return silu_and_mul(out) if name == "gate_up" else out

    def bf16(x: torch.Tensor, d: torch.Tensor, name: str) -> torch.Tensor:
        out = F.linear(x, d)
        return silu_and_mul(out) if name == "gate_up" else out

    def dequantized(x: torch.Tensor, w: Any, name: str) -> torch.Tensor:
        return bf16(x, int4_dequant(w, x.dtype), name)

    def layer_us(f: Any, xs: dict[str, Any], weights: list[Any], **kw: Any) -> float:
        return time_us([partial(f, xs[n], w[n], n) for w in weights for n in LAYER], **kw) * len(LAYER)

    found: dict[int, dict[str, float]] = {}
    saved = mma.MAX_ROWS, wgmma.MIN_ROWS, wgmma.MAX_ROWS
    for m in CHUNKED_M:
        xs = {n: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for n, (k, _) in LAYER.items()}
        row = {"dispatched_us": layer_us(dispatched, xs, sets)}
        mma.MAX_ROWS, wgmma.MIN_ROWS, wgmma.MAX_ROWS = max(CHUNKED_M), 1, max(CHUNKED_M)
        try:
            if m <= 128:
                row["mma_one_launch_us"] = layer_us(mma_one_launch, xs, sets)
            row["wgmma_us"] = layer_us(on_wgmma, xs, sets)
        finally:
            mma.MAX_ROWS, wgmma.MIN_ROWS, wgmma.MAX_ROWS = saved
        row["dequant_cublas_us"] = layer_us(dequantized, xs, sets, min_calls=8)
        row["bf16_us"] = layer_us(bf16, xs, dense)
        found[m] = row
        print(f"rows {m}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    at = found[64]
    record(
        "quant_w4a16_rows_chunked_llama3-8b", at["dispatched_us"], "us", baseline=at["bf16_us"],
        baseline_name="bf16 cuBLAS at 64 rows, same run (us)", ratio=at["bf16_us"] / at["dispatched_us"],
        out_dir=out_dir, command=COMMAND + " --chunked",
        extra={"what": "a Llama-3-8B layer's four GEMMs (gate_up ending in SwiGLU; group 128, six weight sets, graph "
                       "replay) at 17-384 rows, layer us: as dispatched, the mma.sync kernel in one launch (16 rows a "
                       "program), the wgmma kernel, dequantize + cuBLAS, and bf16 cuBLAS; ratio = bf16 / dispatched",
               "by_rows": found, "rows_in_code": {"mma_max": saved[0], "wgmma_min": saved[1], "wgmma_max": saved[2]},
               "wgmma_dispatched": _backend.WGMMA},
    )  # fmt: skip


DECODE_BATCHES = (16, 32, 64, 128)
WGMMA_OFF_BATCHES = (64, 128)  # int4 again with PDSERVE_WGMMA=0: the wgmma kernel's A-B where it runs


def decode_batched(out_dir: Path | None) -> None:
    """The int4 (AWQ) and bf16 engines' decode at batches of 16-128 fresh prompts (128 tokens each), each engine in
    a process of its own, and int4 with the wgmma kernel off at 64 and 128: quant_int4_decode_batched_llama3-8b
    (value: tokens a second at batch 32)."""
    from bench.record import record

    found = {
        b: {"int4": child("awq", 400, batch=b), "bf16": child("none", 400, batch=b),
            **({"int4_wgmma_off": child("awq", 400, batch=b, PDSERVE_WGMMA="0")} if b in WGMMA_OFF_BATCHES else {})}
        for b in DECODE_BATCHES
    }  # fmt: skip
    for b, parts in found.items():
        if any("error" in part for part in parts.values()):
            print(b, parts, flush=True)
            return
        for part in parts.values():
            part["batch_tok_s"] = part["tok_s"] * b
        print(
            f"batch {b}, tok/s: " + ", ".join(f"{k} {v['batch_tok_s']:.0f}" for k, v in parts.items()),
            flush=True,
        )
    at = found[32]
    record(
        "quant_int4_decode_batched_llama3-8b", at["int4"]["batch_tok_s"], "tok/s",
        baseline=at["bf16"]["batch_tok_s"], baseline_name="bf16 engine at batch 32, same run (tok/s)",
        ratio=at["int4"]["batch_tok_s"] / at["bf16"]["batch_tok_s"], out_dir=out_dir,
        command=COMMAND + " --batched",
        extra={"what": "decode tokens a second of all sequences at batches 16 / 32 / 64 / 128 (AWQ int4, LM head "
                       "bf16; graphs on), int4 and bf16, and int4 with PDSERVE_WGMMA=0 at 64 and 128",
               "by_batch": {b: {k: v["batch_tok_s"] for k, v in parts.items()} for b, parts in found.items()},
               "ratio_by_batch": {b: p["int4"]["batch_tok_s"] / p["bf16"]["batch_tok_s"] for b, p in found.items()}},
    )  # fmt: skip


def decode_kernels(out_dir: Path | None, batch: int = 1) -> None:
    """Where a decode step's GPU time goes at `batch` sequences, int4 (AWQ) against bf16, as a record: the step as
    served (PDL on), and each kernel's own time with every kernel launched plainly (under PDL a kernel's time would
    count its wait for the one before)."""
    from bench.record import record

    found = {
        (q, pdl): child(q, 400, True, batch, **({} if pdl else {"PDSERVE_PDL": "0"}))
        for q in ("awq", "none")
        for pdl in (True, False)
    }
    if any("error" in part for part in found.values()):
        print([part.get("error") for part in found.values()], flush=True)
        return
    step = {q: 1e6 / found[q, True]["tok_s"] for q in ("awq", "none")}
    total = {q: sum(us for _, us, _ in found[q, False]["kernels_per_step"]) for q in ("awq", "none")}
    for q in ("awq", "none"):
        print(f"{q}: {found[q, True]['tok_s']:.1f} tok/s ({step[q]:.1f} us a step); launched plainly "
              f"{found[q, False]['tok_s']:.1f} tok/s, kernels {total[q]:.1f} us a step", flush=True)  # fmt: skip
        for kernel, us, n in found[q, False]["kernels_per_step"][:10]:
            print(f"  {us:8.1f} us {n:6.1f}x  {kernel[:100]}", flush=True)
    record(
        f"quant_int4_decode_b{batch}_kernels_llama3-8b", step["awq"], "us", baseline=step["none"],
        baseline_name="bf16 engine's decode step, same run (us)", ratio=step["none"] / step["awq"],
        out_dir=out_dir, command=COMMAND + " --kernels" + (f" --batch {batch}" if batch > 1 else ""),
        extra={"what": f"one batch-{batch} decode step (128-token prompts, graphs on): us a step as served, and "
                       "CUDA time kernel by kernel with every kernel launched plainly: [name, us a step, launches a step]",
               "int4_tok_s": found["awq", True]["tok_s"], "bf16_tok_s": found["none", True]["tok_s"],
               "int4_kernels_us_launched_plainly": total["awq"], "bf16_kernels_us_launched_plainly": total["none"],
               "int4": found["awq", False]["kernels_per_step"][:12],
               "bf16": found["none", False]["kernels_per_step"][:12]},
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--sweep", action="store_true", help="also time the GEMM's tile configs at M = 1, 4, 16")
    p.add_argument("--sweep-m1", action="store_true", help="also the one-row kernel's configs, GEMM by GEMM")
    p.add_argument(
        "--limits", action="store_true", help="only what bounds the one-row kernel (--limits record)"
    )
    p.add_argument(
        "--kernels", action="store_true", help="only a decode step's GPU time by kernel, int4 and bf16"
    )
    p.add_argument(
        "--sweep-mma", action="store_true", help="only the fragment layout kernel's configs, GEMM by GEMM"
    )
    p.add_argument(
        "--rope", action="store_true", help="only the qkv GEMM ending in RoPE against it and rotary_kv_write"
    )
    p.add_argument(
        "--sweep-regs",
        action="store_true",
        help="only the fragment layout kernel at capped registers a thread",
    )
    p.add_argument(
        "--chunked",
        action="store_true",
        help="only 17-384 rows: the mma.sync and wgmma kernels against dequantize + cuBLAS and bf16",
    )
    p.add_argument(
        "--sweep-wgmma", action="store_true", help="only the wgmma kernel's configs at 64-256 rows"
    )
    p.add_argument(
        "--batched", action="store_true", help="only the int4 and bf16 engines' decode at batches of 16-128"
    )
    p.add_argument(
        "--sweep-prefetch",
        action="store_true",
        help="only the fragment layout kernel asking L2 for its words 0-3 steps ahead, and the engine at each",
    )
    p.add_argument("--part", choices=["none", "awq", "gptq_head"], help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=1, help="with --kernels: the decode batch (default 1)")
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.part:
        args.json.write_text(json.dumps(engine_part(args.part, args.kernels, args.batch), indent=1))
        return
    modes: dict[str, Callable[[Path | None], None]] = {
        "kernels": partial(decode_kernels, batch=args.batch),
        "sweep_mma": sweep_mma,
        "sweep_wgmma": sweep_wgmma,
        "rope": rope_epilogue,
        "sweep_regs": sweep_regs,
        "chunked": rows_chunked,
        "batched": decode_batched,
        "sweep_prefetch": sweep_prefetch,
    }
    for flag, run in modes.items():  # the modes that time something else than the GEMMs' records
        if getattr(args, flag):
            run(args.out_dir)
            return

    import torch

    from bench.kernels import copy_bandwidth

    copies = copy_bandwidth()
    copy_gbs = max(copies["copy_"], copies["mul_kernel"])
    torch.cuda.empty_cache()
    print(f"d2d copy {copy_gbs:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    if args.limits:
        limits_m1(args.out_dir)
        return
    rows = gemm_small_m(copy_gbs, args.out_dir)
    big, crossover = gemm_big_m(args.out_dir)
    rows.append(big)
    if args.sweep:
        sweep()
    if args.sweep_m1:
        sweep_m1(args.out_dir)
    torch.cuda.empty_cache()
    eng = engines(args.out_dir)
    print(
        "\ncrossover (layer us): "
        + ", ".join(
            f"M={m} kernel {c['kernel_us']:.0f} / dequant+cuBLAS {c['dequant_cublas_us']:.0f}"
            for m, c in crossover.items()
        )
    )
    print(f"\n{'GEMM (one layer)':24s} {'int4 us':>9s} {'GB/s':>8s} {'of copy':>8s} {'vs bf16':>8s}")
    for name, us, gbs, frac, speed in rows:
        print(f"{name:24s} {us:9.1f} {gbs or 0:8.0f} {frac or 0:8.2f} {speed:8.2f}x")
    print(f"\n{'engine':24s} {'int4':>9s} {'bf16':>9s} {'ratio':>8s}")
    for name, a, b, _, ratio in eng:
        print(f"{name:24s} {a or 0:9.2f} {b or 0:9.2f} {ratio or 0:8.2f}")


if __name__ == "__main__":
    main()
