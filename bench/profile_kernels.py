"""The kernels whose figures miss their goals, launched eagerly a few times each, for Nsight Compute to read
their hardware counters (what bounds them: DRAM, issue slots, or stalls). Not a benchmark: no timing, no
records; bench/quant_int4.py and bench/kv_memory.py time the same calls.

    ncu --clock-control none -k regex:'^_' --section SpeedOfLight --section SchedulerStats \\
        --section WarpStateStats --section Occupancy --csv --page details --log-file ncu.csv \\
        python3 -m bench.profile_kernels w4a16_m1 fp8_decode

(`bash bench/run_on_device.sh` with STEPS=profile does this for every case.)

Cases:
- w4a16_m1 / w4a16_m16: a Llama-3-8B layer's four W4A16 GEMMs (group 128), one row or 16 rows, in the
  fragment layout loaded layers take on a GPU (kernels/w4a16_mma.py), default configs; plus gate_up with
  SwiGLU at one row. w4a16_rows_m1 / _m16: the same in the rows layout (the CUDA-core kernel at one row, the
  swapped kernel at 16).
- gemv_bf16: the same layer's four one-row bf16 GEMVs (kernels/gemv.py).
- fp8_decode / bf16_decode: paged decode attention, Llama-3-8B heads, 64 sequences of 4096 tokens.
Each call is launched LAUNCHES + 1 times (the first compiles), each launch on its own weights or cache, so
none finds its data in L2; ncu flushes the caches between its own replays of a kernel as well.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LAUNCHES = 2


def w4a16(m: int, fragments: bool = True) -> list[Callable[[], object]]:
    import torch

    from bench.quant_int4 import LAYER, int4_layer
    from kernels.w4a16_gemm import w4a16_gemm, w4a16_swiglu

    layers = [int4_layer("cuda", seed, fragments) for seed in range(LAUNCHES + 1)]
    calls: list[Callable[[], object]] = []
    for name, (k, _) in LAYER.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        calls += [partial(w4a16_gemm, x, layer[name]) for layer in layers]
    if m == 1:
        x = torch.randn(1, LAYER["gate_up"][0], device="cuda", dtype=torch.bfloat16)
        calls += [partial(w4a16_swiglu, x, layer["gate_up"]) for layer in layers]
    return calls


def gemv_bf16() -> list[Callable[[], object]]:
    import torch

    from bench.quant_int4 import LAYER
    from kernels.gemv import gemv_triton

    calls: list[Callable[[], object]] = []
    for k, n in LAYER.values():
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(LAUNCHES + 1)]
        calls += [partial(gemv_triton, x, w) for w in weights]
    return calls


def decode(fp8: bool) -> list[Callable[[], object]]:

    from bench.kernels import paged_set
    from bench.kv_memory import BATCH, HEADS, SEQ, fp8_cache
    from kernels.paged_decode_attention import paged_decode_attention_triton

    calls: list[Callable[[], object]] = []
    for _ in range(LAUNCHES + 1):
        s = paged_set(BATCH, SEQ, HEADS, 1)
        cache, scale = fp8_cache(s["cache"]) if fp8 else (s["cache"], None)
        q, lens, tables = s["q"][:, :, 0], s["lens"], s["tables"]
        calls.append(
            partial(paged_decode_attention_triton, q, cache, lens, tables, HEADS[2] ** -0.5, max_seq_len=SEQ,
                    kv_scale=scale)
        )  # fmt: skip
    return calls


CASES: dict[str, Callable[[], list[Callable[[], object]]]] = {
    "w4a16_m1": lambda: w4a16(1),
    "w4a16_m16": lambda: w4a16(16),
    "w4a16_rows_m1": lambda: w4a16(1, fragments=False),
    "w4a16_rows_m16": lambda: w4a16(16, fragments=False),
    "gemv_bf16": gemv_bf16,
    "fp8_decode": lambda: decode(True),
    "bf16_decode": lambda: decode(False),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("cases", nargs="*", help=f"any of {', '.join(CASES)} (default: all)")
    args = parser.parse_args()
    unknown = set(args.cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; choose from {list(CASES)}")
    import torch

    for case in args.cases or CASES:
        calls = CASES[case]()
        for call in calls:
            call()
        torch.cuda.synchronize()
        print(f"{case}: {len(calls)} launches", flush=True)


if __name__ == "__main__":
    main()
