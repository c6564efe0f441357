"""Paged-attention kernels on the GPU: bandwidth against a device-to-device copy measured in the
same run, and time against torch SDPA on the same K/V laid out contiguously.

    python3 -m bench.kernels --out-dir DIR [--sweep SECONDS]

Times are medians of CUDA-graph replays (no host gaps); a graph holds one call per input set and
rotates among enough sets (>= 512 MB in all) that the 50 MB L2 cannot serve repeats. Writes one
JSON record per figure (bench/record.py) plus kernels_table.md; --sweep also times tile configs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from functools import partial
from itertools import product
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

import kernels.paged_decode_attention as pda
from bench.record import record
from kernels.decode_reduce import decode_reduce_triton, decode_workspace_size
from kernels.paged_decode_attention import default_config, paged_decode_attention_triton, plan_num_splits
from kernels.paged_prefill_attention import paged_prefill_attention_triton

MODELS = {"llama3-8b": (32, 8, 128), "smollm2": (9, 3, 64)}  # (q heads, kv heads, head_dim)
DECODE = [(m, b, s) for m in MODELS for b, s in ((1, 32768), (64, 4096), (256, 1024))]
PREFILL = [("llama3-8b", 4, 1024, 3072), ("llama3-8b", 1, 4096, 0), ("smollm2", 4, 1024, 3072)]
GOAL_DECODE = {("llama3-8b", 1, 32768), ("llama3-8b", 64, 4096)}
BLOCK, DTYPE, ROTATE_BYTES = 16, torch.bfloat16, 512 << 20
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "cudnn": SDPBackend.CUDNN_ATTENTION}  # fmt: skip


def time_us(fns, reps: int = 30, min_calls: int = 16) -> float:
    """Median microseconds of one call: replays of a graph that runs every fn once or more, at
    least min_calls calls in all, so the replay's own start (~10 us here) is spread thin."""
    fns = fns * -(-min_calls // len(fns))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns * 2:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) * 1e3 / len(fns)


def copy_bandwidth() -> dict[str, float]:
    """GB/s of a 2 GiB device-to-device copy, bytes read plus written: eager copy_ (a kernel), an
    elementwise kernel, and copy_ inside a graph (a memcpy node: the copy engine, slower)."""
    src = torch.randn(1 << 29, device="cuda")
    dst = torch.empty_like(src)
    gbs = lambda us: 2 * src.numel() * 4 / us / 1e3
    found = {"graph_memcpy": gbs(time_us([lambda: dst.copy_(src)], reps=5, min_calls=4))}
    for name, fn in (("copy_", lambda: dst.copy_(src)), ("mul_kernel", lambda: torch.mul(src, 1.0, out=dst))):
        fn()
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(8):  # queued back to back: the first launch's latency is spread over 8
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / 8)
        found[name] = gbs(statistics.median(times))
    tiny = torch.zeros(1, device="cuda")
    bump = partial(tiny.add_, 1.0)
    found["graph_replay_start_us"] = time_us([bump], min_calls=1) - time_us([bump], min_calls=64)
    return found


def same_bytes_copy_us(nbytes: int, rotate: int) -> float:
    """Microseconds of an elementwise copy kernel that reads nbytes / 2 and writes nbytes / 2 (so it moves
    as many bytes as a decode call reads and writes), over `rotate` buffer pairs as the decode sets
    rotate (none is in L2 when its turn comes), timed like the kernels. Context for the ratio to the
    2 GiB copy: a copy this size pays the same launch, ramp-up and tail as the kernel."""
    n = nbytes // 4  # bf16 elements per side
    pairs = [(torch.randn(n, device="cuda", dtype=DTYPE), torch.empty(n, device="cuda", dtype=DTYPE))
             for _ in range(rotate)]  # fmt: skip
    return time_us([partial(torch.mul, a, 1.0, out=b) for a, b in pairs])


def paged_set(batch: int, seq_len: int, heads: tuple[int, int, int], q_len: int, layout: str = "NHD"):
    """Contiguous q/K/V for SDPA and the same K/V scattered into shuffled pages. layout: how a page
    lies in memory, "NHD" (block_size, num_kv_heads, head_dim) or "HND" (num_kv_heads, block_size,
    head_dim); the cache is always handed over as the (2, blocks, block_size, kv heads, head_dim) view."""
    num_heads, num_kv, dim = heads
    k = torch.randn(batch, num_kv, seq_len, dim, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    q = torch.randn(batch, num_heads, q_len, dim, device="cuda", dtype=DTYPE)
    per_seq = seq_len // BLOCK
    tables = torch.randperm(batch * per_seq, device="cuda").view(batch, per_seq).int()
    if layout == "HND":
        cache = torch.empty(2, batch * per_seq, num_kv, BLOCK, dim, device="cuda", dtype=DTYPE).transpose(
            2, 3
        )
    else:
        cache = torch.empty(2, batch * per_seq, BLOCK, num_kv, dim, device="cuda", dtype=DTYPE)
    for i, t in enumerate((k, v)):
        cache[i][tables.flatten().long()] = t.transpose(1, 2).reshape(batch * per_seq, BLOCK, num_kv, dim)
    lens = torch.full((batch,), seq_len, device="cuda", dtype=torch.int32)
    return {"q": q, "k": k, "v": v, "cache": cache, "tables": tables, "lens": lens}


def sdpa_fn(s, causal_prefix: int | None):
    q, k, v = s["q"], s["k"], s["v"]
    if causal_prefix is None:
        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    if causal_prefix == 0:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    bias = causal_lower_right(q.shape[2], k.shape[2])
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)


def time_sdpa(sets, causal_prefix: int | None) -> tuple[float, str, dict]:
    """The fastest SDPA backend that runs this shape (GQA native, K/V not expanded)."""
    found: dict[str, float | str] = {}
    for name, backend in SDPA_BACKENDS.items():
        try:
            with sdpa_kernel([backend]):
                found[name] = time_us([sdpa_fn(s, causal_prefix) for s in sets])
        except Exception as exc:  # a backend that cannot take this shape
            found[name] = f"n/a: {type(exc).__name__}: {str(exc)[:80]}"
    timed = {n: t for n, t in found.items() if isinstance(t, float)}
    best = min(timed, key=lambda n: timed[n])
    return timed[best], best, found


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def decode_fns(sets, config=None, num_splits=None):
    """One decode call per set; all share one workspace (as the engine's CUDA graphs do), so no call
    allocates inside the timed graph."""
    batch, num_heads, _, dim = sets[0]["q"].shape
    num_kv, seq_len = sets[0]["k"].shape[1], sets[0]["k"].shape[2]
    splits = num_splits or plan_num_splits(batch, num_kv, seq_len, torch.device("cuda"))
    ws = torch.empty(decode_workspace_size(batch, num_heads, splits, dim), device="cuda")
    return [
        lambda s=s: paged_decode_attention_triton(
            s["q"][:, :, 0],
            s["cache"],
            s["lens"],
            s["tables"],
            s["q"].shape[-1] ** -0.5,
            max_seq_len=s["k"].shape[2],
            config=config,
            num_splits=num_splits,
            workspace=ws,
        )  # fmt: skip
        for s in sets
    ]


def prefill_fns(sets, prefix: int, config=None):
    def call(s):
        batch, num_heads, q_len, dim = s["q"].shape
        q = s["q"].transpose(1, 2).reshape(batch * q_len, num_heads, dim)
        qsl = torch.arange(0, batch * q_len + 1, q_len, device="cuda", dtype=torch.int32)
        return lambda: paged_prefill_attention_triton(
            q, s["cache"], qsl, s["lens"], s["tables"], dim**-0.5, max_query_len=q_len, config=config
        )

    return [call(s) for s in sets]


def bench_decode(model, batch, seq_len, copy_gbs, out_dir):
    heads = MODELS[model]
    per_set = 2 * batch * seq_len * heads[1] * heads[2] * 2 + 2 * batch * heads[0] * heads[2] * 2
    sets = [paged_set(batch, seq_len, heads, 1) for _ in range(math.ceil(ROTATE_BYTES / per_set))]
    t = time_us(decode_fns(sets))
    splits = plan_num_splits(batch, heads[1], seq_len, torch.device("cuda"))
    print(f"decode {model} {batch}x{seq_len}: {splits} splits, {t:.1f} us")
    sdpa_t, sdpa_name, sdpa_all = time_sdpa(sets, None)
    err = rel_err(decode_fns(sets[:1])[0](), sdpa_fn(sets[0], None)().squeeze(2))
    gbs = per_set / t / 1e3
    same_copy_t = same_bytes_copy_us(per_set, len(sets))
    print(
        f"decode {model} {batch}x{seq_len}: a copy moving the same {per_set / 1e6:.0f} MB (read + written) "
        f"takes {same_copy_t:.1f} us: the kernel is at {same_copy_t / t:.2f} of it"
    )
    goal = (model, batch, seq_len) in GOAL_DECODE
    met = gbs >= 0.8 * copy_gbs and t <= sdpa_t
    rec = record(
        f"kernels_decode_{model}_b{batch}x{seq_len}", gbs, "GB/s", ceiling=copy_gbs, ceiling_name="d2d copy",
        baseline=sdpa_t, baseline_name=f"SDPA {sdpa_name} (us)", goal=">=0.8 copy bw and <= SDPA time" if goal else None,
        extra={"time_us": t, "sdpa_us": sdpa_t, "sdpa_all": sdpa_all, "rel_err_vs_sdpa": err, "input_sets": len(sets),
               "goal_met": met if goal else None, "bytes": per_set, "num_splits": splits,
               "same_bytes_copy_us": same_copy_t, "ratio_to_same_bytes_copy": same_copy_t / t}, out_dir=out_dir,
    )  # fmt: skip
    return ("decode", f"{model} {batch} x {seq_len}", t, gbs, gbs / copy_gbs, sdpa_t, sdpa_name, t / sdpa_t,
            ("yes" if met else "NO") if goal else "-", err, rec)  # fmt: skip


def bench_prefill(model, batch, q_len, prefix, copy_gbs, out_dir):
    heads = MODELS[model]
    sets = [paged_set(batch, q_len + prefix, heads, q_len)]
    t = time_us(prefill_fns(sets, prefix))
    sdpa_t, sdpa_name, sdpa_all = time_sdpa(sets, prefix)
    ours = prefill_fns(sets, prefix)[0]().view(batch, q_len, heads[0], heads[2]).transpose(1, 2)
    err = rel_err(ours, sdpa_fn(sets[0], prefix)())
    flops = batch * heads[0] * 4 * heads[2] * (q_len * prefix + q_len * (q_len + 1) / 2)
    met = t <= 1.5 * sdpa_t
    rec = record(
        f"kernels_prefill_{model}_b{batch}x{q_len}_prefix{prefix}", t, "us", baseline=sdpa_t,
        baseline_name=f"SDPA {sdpa_name} (us)", ratio=t / sdpa_t, goal="<= 1.5x SDPA time",
        extra={"tflops": flops / t / 1e6, "sdpa_all": sdpa_all, "rel_err_vs_sdpa": err, "goal_met": met},
        out_dir=out_dir,
    )  # fmt: skip
    return ("prefill", f"{model} {batch} x ({prefix} cached + {q_len} new)", t, None, None, sdpa_t, sdpa_name,
            t / sdpa_t, "yes" if met else "NO", err, rec)  # fmt: skip


def sweep(log, seconds: float) -> list[dict]:
    """Time tile configs near the defaults until the deadline; winners become defaults by hand."""
    deadline, found = time.monotonic() + seconds, []

    def run(op, shape, fns_for, configs):
        for cfg, splits in configs:
            if time.monotonic() > deadline:
                return
            try:
                t = time_us(fns_for(cfg, splits), reps=10)
            except Exception as exc:  # e.g. out of shared memory
                t = f"failed: {type(exc).__name__}"
            found.append({"op": op, "shape": shape, "config": cfg, "splits": splits, "us": t})
            log(json.dumps(found[-1]))

    base = default_config(128, DTYPE)
    merges = [{**base, "merge_warps": w, "merge_block_d": d} for w, d in ((4, None), (2, None), (1, 32), (2, 32),
                                                                            (1, 64), (2, 64), (4, 32))]  # fmt: skip
    plan = [  # the merge launch's warps and head_dim slice per program, A-B as the hosts drift; below, the
        # split kernel timed without its merge (docs/kernels.md lists the other sweeps and their records)
        ("llama3-8b", 1, 32768, merges * 2, (None,)),
        ("smollm2", 1, 32768, merges, (None,)),
    ]
    for model, batch, seq_len, cfgs, splits in plan:
        heads = MODELS[model]
        per_set = 2 * batch * seq_len * heads[1] * heads[2] * 2
        sets = [paged_set(batch, seq_len, heads, 1) for _ in range(math.ceil(ROTATE_BYTES / per_set))]
        run(
            f"decode {model}",
            [batch, seq_len],
            lambda c, n, sets=sets: decode_fns(sets, c, n),
            product(cfgs, splits),
        )
        if batch == 1:  # where the time goes: the split kernel without its merge, and the merge on its own
            merge = pda.decode_reduce_triton
            pda.decode_reduce_triton = lambda out, *a, **k: out  # the output is left unmerged
            try:
                t_split = [time_us(decode_fns(sets), reps=10) for _ in range(2)]
            finally:
                pda.decode_reduce_triton = merge
            log(json.dumps({"op": f"decode {model} split kernel alone (merge skipped)", "shape": [batch, seq_len],
                            "us": t_split}))  # fmt: skip
            out = torch.empty_like(sets[0]["q"][:, :, 0])
            acc, ml = (
                torch.randn(1, heads[0], 64, heads[2], device="cuda"),
                torch.rand(2, 1, heads[0], 64, device="cuda"),
            )
            for c in merges:
                w, d = c["merge_warps"], c["merge_block_d"]
                fn = partial(
                    decode_reduce_triton, out, acc, ml, sets[0]["lens"], seq_len // 64, num_warps=w, block_d=d
                )
                t = time_us([fn])
                log(
                    json.dumps(
                        {"op": f"decode_reduce {model}", "splits": 64, "num_warps": w, "block_d": d, "us": t}
                    )
                )
        del sets
    for model, q_len, prefix, batch in (("llama3-8b", 4096, 0, 1), ("llama3-8b", 1024, 3072, 4)):
        sets = [paged_set(batch, q_len + prefix, MODELS[model], q_len)]
        cfgs = [
            {"block_m": m, "block_n": n, "num_warps": w, "num_stages": s}
            for m, n, w, s in [
                (64, 64, 4, 3),
                (128, 128, 8, 3),
                (128, 64, 8, 3),
                (128, 128, 8, 4),
                (64, 128, 4, 3),
            ]
        ]
        run(f"prefill {model}", [batch, q_len, prefix], lambda c, n, p=prefix, sets=sets: prefill_fns(sets, p, c),
            product(cfgs, (None,)))  # fmt: skip
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=None, help="records go here (default bench/results)")
    parser.add_argument("--sweep", type=float, default=0, help="seconds to spend timing tile configs")
    args = parser.parse_args()
    out_dir = args.out_dir
    log_path = (out_dir or Path(".")) / "kernels_log.txt"
    log_path.parent.mkdir(parents=True, exist_ok=True)

    def log(line: str) -> None:
        print(line, flush=True)
        with log_path.open("a") as f:
            f.write(line + "\n")

    copies = copy_bandwidth()
    copy_gbs = max(copies["copy_"], copies["mul_kernel"])  # the stricter of the two kernel copies
    record("kernels_copy_bandwidth", copy_gbs, "GB/s", goal="ceiling for the decode ratios", extra=copies,
           out_dir=out_dir)  # fmt: skip
    log(f"d2d copy: {copy_gbs:.0f} GB/s (read + write) on {torch.cuda.get_device_name()}; all: {copies}")
    rows = []
    for model, batch, seq_len in DECODE:
        rows.append(bench_decode(model, batch, seq_len, copy_gbs, out_dir))
        log(str(rows[-1][:-1]))
        torch.cuda.empty_cache()
    for model, batch, q_len, prefix in PREFILL:
        rows.append(bench_prefill(model, batch, q_len, prefix, copy_gbs, out_dir))
        log(str(rows[-1][:-1]))
        torch.cuda.empty_cache()
    table = ["| kernel | shape | time us | GB/s | ratio to copy bw | SDPA time us (backend) | vs SDPA | goal met? |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for op, shape, t, gbs, ratio, sdpa_t, sdpa_name, vs, met, _err, _rec in rows:
        bw = f"{gbs:.0f} | {ratio:.2f}" if gbs else "- | -"
        table.append(f"| {op} | {shape} | {t:.1f} | {bw} | {sdpa_t:.1f} ({sdpa_name}) | {vs:.2f}x | {met} |")
    (out_dir or Path(".")).joinpath("kernels_table.md").write_text("\n".join(table) + "\n")
    log("\n".join(table))
    if args.sweep:
        found = sweep(log, args.sweep)
        (out_dir or Path(".")).joinpath("kernels_sweep.json").write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
