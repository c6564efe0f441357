"""KV memory that stretches, on the GPU: fp8 decode attention, the swap space's copies, preemption by mode.

    python3 -m bench.kv_memory --out-dir DIR [--num-prompts 1000] [--gpu-blocks 10240] [--swap-space 16]

1. fp8 vs bf16 decode attention at Llama-3-8B heads, 64 x 4096 (the engine's default tiles), each timed as
   bench.kernels times kernels, with the device-to-device copy bandwidth of the same run:
   `kv_fp8_decode_llama3-8b_b64x4096` (us; baseline the bf16 us, ratio bf16 / fp8; extra: the fraction of
   copy bandwidth at fp8's bytes), and `kv_fp8_decode_tiles_llama3-8b_b64x4096` (the best of 18 fp8 tiles against
   the default one, each with the kernel's own split plan).
2. 1 GiB of Llama-3-8B blocks (scattered ids) swapped out to the pinned CPU pool and back in, on the path the
   engine's swaps take, against a pinned host-to-device copy of 1 GiB in the same run: `kv_swap_roundtrip_1GiB`
   (GB/s, bytes both ways over the time both took; ceiling the H2D GB/s).
3. Offline throughput at N x (1024 / 256), Llama-3-8B dummy weights, with a GPU pool of --gpu-blocks blocks
   (the normal pool is ~59k; a full batch of 256 needs 20480) and --swap-space GiB of swap space, one engine,
   its preemption mode set to recompute, swap, then auto: `kv_preemption_throughput_<mode>` (output tok/s).
About 5 minutes with the defaults on an H200 (part 3 about 4 of them); --num-prompts 500 halves part 3.
`--parts fp8-shapes` (not in the default list) times fp8 against bf16 and against the 2-warp tile at 9 batch x context
shapes, `kv_fp8_decode_shapes_llama3-8b`. `--parts` picks parts; `--device cpu --shape SmolLM2-135M` runs part 3 small, as a smoke test (no records).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.record import record

COMMAND = "python3 -m bench.kv_memory"
HEADS, BATCH, SEQ, BLOCK = (32, 8, 128), 64, 4096, 16  # Llama-3-8B: q heads, kv heads, head_dim
FP8_TILES = [
    {"block_n": n, "num_warps": w, "num_stages": s} for n in (32, 64, 128) for w in (1, 2, 4) for s in (2, 3)
]


def fp8_cache(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 (K, V) cache in fp8 and its [k_scale, v_scale], the scales as calibration sets them."""
    from kernels.kv_quant import quantize

    scale = torch.stack([cache[0].abs().amax(), cache[1].abs().amax()]).float() * 2 / 448
    return torch.stack([quantize(cache[0], scale[0]), quantize(cache[1], scale[1])]), scale


def fp8_decode(copy_gbs: float, out_dir: Path | None) -> list[str]:
    from bench.kernels import paged_set, rel_err, time_us
    from kernels.paged_decode_attention import paged_decode_attention_reference, paged_decode_attention_triton

    s = paged_set(BATCH, SEQ, HEADS, 1)  # bf16 pages: 1 GiB, far past L2
    cache = s["cache"]
    cache8, scale = fp8_cache(cache)
    q, lens, tables = s["q"][:, :, 0], s["lens"], s["tables"]

    def call(kv: torch.Tensor, kv_scale: torch.Tensor | None = None, config: dict | None = None):
        return lambda: paged_decode_attention_triton(
            q, kv, lens, tables, HEADS[2] ** -0.5, max_seq_len=SEQ, kv_scale=kv_scale, config=config
        )

    bf16_us = time_us([call(cache)])
    fp8_us = time_us([call(cache8, scale)])
    tiles = {json.dumps(c): time_us([call(cache8, scale, c)]) for c in FP8_TILES}
    nbytes = cache8.numel()  # K and V, one byte each
    fraction = nbytes / fp8_us / 1e3 / copy_gbs
    sub = slice(0, 8)  # the reference loops in Python: 8 sequences are enough for its error
    ref = paged_decode_attention_reference(
        q[sub].float(), cache8, lens[sub], tables[sub], HEADS[2] ** -0.5, scale
    )
    err = rel_err(call(cache8, scale)()[sub], ref)
    ratio = bf16_us / fp8_us
    best = min(tiles.values())
    record(
        "kv_fp8_decode_tiles_llama3-8b_b64x4096", best, "us", baseline=fp8_us, baseline_name="the default tile (us)",
        ratio=fp8_us / best, out_dir=out_dir, command=COMMAND + " --parts fp8",
        extra={"tiles_us": tiles, "bf16_us": bf16_us},
    )  # fmt: skip
    record(
        "kv_fp8_decode_llama3-8b_b64x4096", fp8_us, "us", baseline=bf16_us, baseline_name="bf16 cache, same kernel (us)",
        ratio=ratio, goal=">= 1.8x faster than bf16, >= 0.8 of copy bandwidth in fp8 bytes", out_dir=out_dir,
        command=COMMAND, extra={"fp8_bytes": nbytes, "fp8_gbs": nbytes / fp8_us / 1e3, "copy_gbs": copy_gbs,
                                "fraction_of_copy_bandwidth": fraction, "rel_err_vs_reference": err,
                                "other_fp8_tiles_us": tiles},
    )  # fmt: skip
    met = ratio >= 1.8 and fraction >= 0.8
    return [f"| fp8 decode 64 x 4096 | {fp8_us:.1f} us | bf16 {bf16_us:.1f} us | {ratio:.2f}x, {fraction:.2f} of copy "
            f"| {'yes' if met else 'NO'} |"]  # fmt: skip


FP8_SHAPES = [
    (64, 4096),
    (256, 1024),
    (128, 2048),
    (32, 4096),
    (16, 8192),
    (8, 4096),
    (1, 32768),
    (4, 2048),
    (256, 2048),
]


def fp8_shape_times(batch: int, seq: int) -> dict[str, float]:
    """bf16, fp8 with the 16-bit cache's tile and split plan, and fp8 as the kernel plans it, at one shape (us)."""
    from bench.kernels import paged_set, rel_err, time_us
    from kernels.decode_reduce import decode_workspace_size
    from kernels.paged_decode_attention import default_config, paged_decode_attention_triton, plan_num_splits

    s = paged_set(batch, seq, HEADS, 1)
    cache8, scale = fp8_cache(s["cache"])
    q, lens, tables = s["q"][:, :, 0], s["lens"], s["tables"]
    ws = torch.empty(decode_workspace_size(batch, HEADS[0], 512, HEADS[2]), device="cuda")

    def call(kv, kv_scale=None, config=None, splits=None):
        return lambda: paged_decode_attention_triton(
            q, kv, lens, tables, HEADS[2] ** -0.5, max_seq_len=seq, kv_scale=kv_scale, config=config,
            num_splits=splits, workspace=ws,
        )  # fmt: skip

    two_warp_splits = plan_num_splits(batch, HEADS[1], seq, q.device)
    two_warp_tile = default_config(HEADS[2], s["cache"].dtype)  # the 16-bit cache's tile
    two_warp = call(cache8, scale, two_warp_tile, two_warp_splits)
    return {
        "bf16_us": time_us([call(s["cache"])]),
        "fp8_two_warp_us": time_us([two_warp]),
        "fp8_us": time_us([call(cache8, scale)]),
        "rel_err_vs_two_warp": rel_err(call(cache8, scale)(), two_warp()),
    }


def fp8_decode_shapes(out_dir: Path | None) -> list[str]:
    """At each batch x context: bf16, fp8 with the 16-bit cache's tile and split plan, and fp8 as the kernel
    plans it (one-warp programs once they fill the GPU, kernels/paged_decode_attention.py: fp8_one_warp)."""
    shapes: dict[str, dict[str, float]] = {}
    for batch, seq in FP8_SHAPES:
        shapes[f"{batch}x{seq}"] = fp8_shape_times(batch, seq)
        torch.cuda.empty_cache()
    now = statistics.geometric_mean([r["bf16_us"] / r["fp8_us"] for r in shapes.values()])
    before = statistics.geometric_mean([r["bf16_us"] / r["fp8_two_warp_us"] for r in shapes.values()])
    record(
        "kv_fp8_decode_shapes_llama3-8b", now, "x", baseline=before,
        baseline_name="the same with the 16-bit cache's 2-warp tile and split plan (x)", ratio=now / before,
        out_dir=out_dir, command=COMMAND + " --parts fp8-shapes",
        extra={"what": "geometric mean over batch x context of bf16 us / fp8 us, Llama-3-8B heads", "shapes": shapes},
    )  # fmt: skip
    return [f"| fp8 decode over {len(shapes)} shapes, bf16 / fp8 | {now:.2f}x | 2-warp tile {before:.2f}x | "
            f"{now / before:.2f} | - |"]  # fmt: skip


def swap_roundtrip(out_dir: Path | None) -> list[str]:
    from engine.block_manager import BlockManager
    from engine.swap import IN, OUT, SwapSpace

    n = 512  # Llama-3-8B bf16 blocks of 16 tokens: 2 MiB each, 1 GiB in all
    gpu = torch.randn(32, 2, 2 * n, BLOCK, HEADS[1], HEADS[2], device="cuda", dtype=torch.bfloat16)
    swap = SwapSpace([gpu], n, BlockManager(2 * n, BLOCK))
    g = torch.Generator().manual_seed(0)
    gpu_ids = torch.randperm(2 * n, generator=g)[:n].tolist()
    cpu_ids = torch.randperm(n, generator=g).tolist()
    before = gpu[:, :, gpu_ids].clone()
    swap.round_trip(gpu_ids, cpu_ids)  # warm: the kernel compiles, pages are touched
    seconds = statistics.median(swap.round_trip(gpu_ids, cpu_ids) for _ in range(5))
    exact = torch.equal(gpu[:, :, gpu_ids].view(torch.int16), before.view(torch.int16))
    nbytes = n * swap.block_nbytes
    one_way = {}
    for direction, src, dst in ((OUT, gpu_ids, cpu_ids), (IN, cpu_ids, gpu_ids)):
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            swap._copy(direction, src, dst, [])
            swap.synchronize()
            times.append(time.perf_counter() - t0)
        one_way[direction] = nbytes / statistics.median(times) / 1e9
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d, d2h = pinned_gbs(dev, host), pinned_gbs(host, dev)
    staged = staged_round_trip_gbs(gpu, gpu_ids, dev, host)
    value = 2 * nbytes / seconds / 1e9
    record(
        "kv_swap_roundtrip_1GiB", value, "GB/s", ceiling=h2d, ceiling_name="pinned host-to-device copy_ of 1 GiB (GB/s)",
        goal=">= 0.7 of pinned H2D", out_dir=out_dir, command=COMMAND,
        extra={"round_trip_s": seconds, "bytes_each_way": nbytes, "blocks": n, "out_gbs": one_way[OUT],
               "in_gbs": one_way[IN], "pinned_d2h_gbs": d2h, "bytes_exact": exact,
               "gather_dma_scatter_round_trip_gbs": staged},
    )  # fmt: skip
    return [f"| swap out + in, 1 GiB | {value:.1f} GB/s | pinned H2D {h2d:.1f} GB/s | {value / h2d:.2f} "
            f"| {'yes' if value >= 0.7 * h2d and exact else 'NO'} |"]  # fmt: skip


def staged_round_trip_gbs(gpu: torch.Tensor, ids: list[int], dev: torch.Tensor, host: torch.Tensor) -> float:
    """The other design, for comparison: gather the blocks into a contiguous device buffer, one DMA copy to
    pinned memory and one back, scatter; GB/s of both ways over the time both took."""
    rows = gpu.view(gpu.shape[0] * 2, gpu.shape[2], -1).view(torch.int64)  # (layers * 2, blocks, words)
    index = torch.tensor(ids, device="cuda")
    stage = dev.view(torch.int64).view(rows.shape[0], len(ids), -1)

    def trip() -> None:
        torch.index_select(rows, 1, index, out=stage)
        host.copy_(dev, non_blocking=True)
        dev.copy_(host, non_blocking=True)
        rows.index_copy_(1, index, stage)

    trip()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        trip()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * host.numel() / statistics.median(times) / 1e9


def pinned_gbs(dst: torch.Tensor, src: torch.Tensor) -> float:
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return src.numel() / statistics.median(times[1:]) / 1e9


def preemption_throughput(args: argparse.Namespace) -> list[str]:
    from bench.throughput import StepTimers, prompts
    from engine import LLM, SamplingParams

    in_len, out_len = args.input_len, args.output_len
    llm = LLM(
        args.shape, load_format="dummy", dtype="bfloat16", device=args.device, enable_prefix_caching=False,
        max_num_seqs=256, max_model_len=in_len + out_len + 16, num_gpu_blocks_override=args.gpu_blocks,
        swap_space=args.swap_space, preemption_mode="auto",
    )  # fmt: skip
    engine = llm.engine
    preemption, swap = engine.scheduler.preemption, engine.scheduler.preemption.swap
    assert swap is not None
    vocab = engine.model_config.vocab_size
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts(8, in_len, vocab, 99)], SamplingParams(max_tokens=8)
    )
    batch = [{"prompt_token_ids": p} for p in prompts(args.num_prompts, in_len, vocab, args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    timers, runs = StepTimers(engine), {}
    for mode in ("recompute", "swap", "auto"):
        preemption.mode = mode
        counts, stats = dict(preemption.counts), asdict(swap.stats)
        timers.reset()
        sync()
        t0 = time.perf_counter()
        outs = llm.generate(batch, params)
        sync()
        wall = time.perf_counter() - t0
        swap.synchronize()
        assert sum(len(o.outputs[0].token_ids) for o in outs) == args.num_prompts * out_len
        runs[mode] = {
            "output_tok_s": args.num_prompts * out_len / wall, "wall_s": wall,
            "preemptions": {m: preemption.counts[m] - counts[m] for m in counts},
            "swap": {k: v - stats[k] for k, v in asdict(swap.stats).items()}, **timers.summary(),
        }  # fmt: skip
        print(json.dumps({mode: runs[mode]}), flush=True)
    costs = asdict(preemption.costs) if preemption.costs else None
    rows = []
    for mode, other in (("recompute", "swap"), ("swap", "recompute"), ("auto", "best of swap and recompute")):
        tps = runs[mode]["output_tok_s"]
        base = max(runs["swap"]["output_tok_s"], runs["recompute"]["output_tok_s"]) if mode == "auto" else (
            runs[other]["output_tok_s"])  # fmt: skip
        if args.shape == "Llama-3-8B" and args.device is None:
            record(
                f"kv_preemption_throughput_{mode}", tps, "output tok/s", baseline=base, baseline_name=f"{other} (same run)",
                goal=">= the better of swap and recompute" if mode == "auto" else None, out_dir=args.out_dir,
                command=COMMAND, extra={"run": runs[mode], "workload": f"{args.num_prompts} x {in_len}/{out_len}",
                                        "gpu_blocks": args.gpu_blocks, "swap_space_gib": args.swap_space,
                                        "auto_costs": costs},
            )  # fmt: skip
        met = "yes" if tps >= base else "NO"
        rows.append(f"| preemption {mode}, {args.num_prompts} x {in_len}/{out_len} | {tps:.0f} tok/s | {other} "
                    f"{base:.0f} | {tps / base:.2f} | {met if mode == 'auto' else '-'} |")  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument(
        "--parts",
        nargs="+",
        default=["fp8", "swap", "preemption"],
        choices=["fp8", "fp8-shapes", "swap", "preemption"],
    )
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument(
        "--gpu-blocks", type=int, default=10240, help="the deliberately small GPU pool (blocks of 16)"
    )
    p.add_argument("--swap-space", type=float, default=16.0, help="GiB")
    p.add_argument("--shape", default="Llama-3-8B")
    p.add_argument("--device", default=None, help="cpu: part 3 only, as a smoke test")
    args = p.parse_args()
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rows, t0 = [], time.perf_counter()
    if args.device is None:
        from bench.kernels import copy_bandwidth

        copies = copy_bandwidth()
        copy_gbs = max(copies["copy_"], copies["mul_kernel"])
        print(f"d2d copy {copy_gbs:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    for part in args.parts:
        try:
            if part == "fp8" and args.device is None:
                rows += fp8_decode(copy_gbs, args.out_dir)
            elif part == "fp8-shapes" and args.device is None:
                rows += fp8_decode_shapes(args.out_dir)
            elif part == "swap" and args.device is None:
                rows += swap_roundtrip(args.out_dir)
            elif part == "preemption":
                rows += preemption_throughput(args)
        except Exception as exc:  # one part's failure leaves the others' records
            rows.append(f"| {part} | failed: {type(exc).__name__}: {str(exc)[:200]} | | | |")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(f"{part} done at {time.perf_counter() - t0:.0f} s", flush=True)
    print("\n| figure | value | baseline / ceiling | ratio | goal met? |\n| --- | ---: | --- | ---: | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
