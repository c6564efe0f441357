"""The batch-1 GEMV against cuBLAS at the models' layer shapes, with a sweep of its tiles, and the
sort-free top-k/top-p cutoff against the sort, on the GPU.

    python3 -m bench.decode_ops --out-dir DIR [--sweep]

GEMV: median CUDA-graph replay (bench/kernels.py: time_us) over enough copies of each weight that none is
in L2 when its turn comes, as in a decode step; GB/s counts the weight bytes read, against the copy
bandwidth (read + written) of the same run. `--sweep` times every tile in SWEEP and reports the best.
Cutoff: the sampler's top-p 0.95 at temperature 0.8 over the Llama-3 vocabulary, rows 1..256.
gate_up ending in SwiGLU: the fused GEMV against the GEMV then the SiLU-and-mul kernel, per layer.
Writes decode_ops.json into the out dir, records `kernels_gemv_<model>` (the step's GEMVs together, the
SwiGLU comparison beside) and `sampler_top_p_cutoff_b<rows>`.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.kernels import copy_bandwidth, time_us
from bench.record import record
from kernels.gemv import gemv_config, gemv_triton
from kernels.silu_and_mul import silu_and_mul_triton
from kernels.top_p_cutoff import top_k_top_p_cutoff_reference, top_k_top_p_cutoff_triton

MODELS = {  # name: (layers, [(N, K) per layer], LM head (N, K))
    "llama3-8b": (32, [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)], (128256, 4096)),
    "smollm2": (30, [(960, 576), (576, 576), (3072, 576), (576, 1536)], (49152, 576)),
}
SWEEP = [(bn, bk, w) for bn in (1, 2, 4, 8) for bk in (256, 512, 1024) for w in (4, 8) if bn * bk <= 4096]
DT = torch.bfloat16


def weights(n: int, k: int) -> list[torch.Tensor]:
    copies = max(2, -(-(160 << 20) // (n * k * 2)))  # together well past the 50 MB L2
    return [torch.randn(n, k, device="cuda", dtype=DT) for _ in range(copies)]


def time_shape(n: int, k: int, sweep: bool) -> dict:
    x = torch.randn(1, k, device="cuda", dtype=DT)
    ws = weights(n, k)
    cublas = time_us([partial(F.linear, x, w) for w in ws])
    times = {
        cfg: time_us([partial(gemv_triton, x, w, None, cfg) for w in ws]) for cfg in (SWEEP if sweep else [])
    }
    default = gemv_config(n, k)  # None: the engine keeps cuBLAS at this shape
    if default is not None and default not in times:
        times[default] = time_us([partial(gemv_triton, x, w, None, default) for w in ws])
    best = min(times, key=times.__getitem__, default=None)
    out: dict[str, Any] = {"n": n, "k": k, "bytes": n * k * 2, "cublas_us": cublas}
    out["best"], out["best_us"] = (list(best), times[best]) if best else ("cublas", cublas)
    out["default"] = list(default) if default else "cublas"
    out["default_us"] = times[default] if default else cublas
    out["sweep"] = {str(c): t for c, t in sorted(times.items(), key=lambda kv: kv[1])[:8]}
    del ws
    torch.cuda.empty_cache()
    return out


def _gemv_then_silu_and_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_triton(gemv_triton(x, w))


def time_swiglu(n: int, k: int) -> dict:
    """gate_up (n = 2 x intermediate rows) at one row: fused with SwiGLU, against the two kernels."""
    x = torch.randn(1, k, device="cuda", dtype=DT)
    ws = weights(n, k)
    fused = time_us([partial(gemv_triton, x, w, None, None, True) for w in ws])
    unfused = time_us([partial(_gemv_then_silu_and_mul, x, w) for w in ws])
    del ws
    torch.cuda.empty_cache()
    return {"n": n, "k": k, "fused_us": fused, "gemv_then_silu_and_mul_us": unfused}


def step_total(layers: int, per: list[dict], key: str) -> float:
    """A decode step's sum: each layer's linears, then the LM head."""
    return layers * sum(s[key] for s in per[:-1]) + per[-1][key]


def time_cutoff(rows: int, vocab: int = 128_256) -> dict:
    scaled = torch.randn(rows, vocab, device="cuda") * 2.5 / 0.8
    top_k = torch.full((rows, 1), float(vocab), device="cuda")
    top_p = torch.full((rows, 1), 0.95, device="cuda")
    kernel = time_us([partial(top_k_top_p_cutoff_triton, scaled, top_k, top_p)], min_calls=4)
    sort = time_us([partial(top_k_top_p_cutoff_reference, scaled, top_k, top_p)], min_calls=4)
    return {"rows": rows, "kernel_us": kernel, "sort_us": sort}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=None, help="records go here (default bench/results)")
    parser.add_argument("--sweep", action="store_true", help="time every tile in SWEEP")
    args = parser.parse_args()
    copy = copy_bandwidth()["copy_"]
    found: dict = {"copy_gbs": copy, "models": {}, "cutoff": []}
    for model, (layers, shapes, head) in MODELS.items():
        per = [time_shape(n, k, args.sweep) for n, k in [*shapes, head]]
        found["models"][model] = per
        for s in per:
            print(f"{model} {s['n']}x{s['k']}: cublas {s['cublas_us']:.1f} us, gemv {s['default_us']:.1f} us "
                  f"default {s['default']}, best {s['best_us']:.1f} us {s['best']} "
                  f"({s['bytes'] / s['best_us'] / 1e3:.0f} GB/s)", flush=True)  # fmt: skip
        gemv, cublas, nbytes = (step_total(layers, per, key) for key in ("default_us", "cublas_us", "bytes"))
        swiglu = time_swiglu(*shapes[2])
        print(f"{model} gate_up + SwiGLU: fused {swiglu['fused_us']:.1f} us, GEMV then SiLU-and-mul "
              f"{swiglu['gemv_then_silu_and_mul_us']:.1f} us", flush=True)  # fmt: skip
        record(f"kernels_gemv_{model}", gemv, "us", baseline=cublas, baseline_name="cuBLAS F.linear, same shapes",
               ratio=cublas / gemv, ceiling=nbytes / copy / 1e3, ceiling_name="weight bytes at copy bandwidth",
               extra={"gbs": nbytes / gemv / 1e3, "of_copy": nbytes / gemv / 1e3 / copy, "shapes": per,
                      "gate_up_swiglu": swiglu},
               out_dir=args.out_dir)  # fmt: skip
        print(f"{model}: a step's GEMVs {gemv:.0f} us vs cuBLAS {cublas:.0f} us; "
              f"{nbytes / gemv / 1e3 / copy:.3f} of copy ({copy:.0f} GB/s)", flush=True)  # fmt: skip
    for rows in (1, 8, 64, 256):
        c = time_cutoff(rows)
        found["cutoff"].append(c)
        record(f"sampler_top_p_cutoff_b{rows}", c["kernel_us"], "us", baseline=c["sort_us"],
               baseline_name="sort-based cutoff, same run", ratio=c["sort_us"] / c["kernel_us"],
               extra=c, out_dir=args.out_dir)  # fmt: skip
        print(
            f"top-p cutoff, {rows} rows x 128256: kernel {c['kernel_us']:.0f} us, sort {c['sort_us']:.0f} us"
        )
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "decode_ops.json").write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
