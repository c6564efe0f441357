"""KV transfer bandwidth of one 4096-token prompt at Llama-3-8B shape, between two processes.

    python bench/kvtransfer.py --out DIR [--ablate] [--sweep]   # on the GPU: cuda_ipc (+ tcp for reference)
    python bench/kvtransfer.py --cpu --out DIR    # a small dry run of the same code on CPU (tcp, gloo)

Shape: 32 layers x (K, V) x 256 blocks of 16 tokens x 8 kv heads x 128 dims, bf16 = 512 MiB.
This process is the prefill worker; a spawned process is the decode worker, serving receivers over one
pool. Timed, per transfer (one at a time): "delivered", from `sender.send` being called to the decode
process's receiver reporting the request complete (its on_done; one host, one CLOCK_MONOTONIC), and
what `send` itself takes (cuda_ipc returns once the copy is queued: the prefill worker's loop waits
only that long). As the prefill worker does at admission, each request is `prepare`d (cuda_ipc asks
for its grant) GAP_S before the timed `send`; the ablation also times the grant asked in `send`.
Between transfers (GAP_S) the sender either waits for a GPU "forward pass" of that length, as the prefill
engine does before it sends (its step's after_run: the sampled tokens just came back, the thread has
been waiting on the GPU), the default "step" cadence, or sleeps ("idle", --idle-too): a process that
slept pays each host step 2-4x on these hosts, which is not how the engine sends.
cuda_ipc is also timed as the prefill engine sends ("queued" cadence, records *_queued): send() is
called while the step computes, its copy queued behind the step, and the transfer is timed from the
step's end (the blocks ready) to the receiver's report, so send()'s host time overlaps the step.
The ceiling is a device-to-device copy of the same 512 MiB measured here (payload bytes / time).
Block ids: "contiguous" (one run each side), "scattered" (contiguous source, random destination),
"random" (random both sides: gather + scatter, two passes); "one" (a single block) gives the fixed
cost of a transfer. Every case is checked bit-exact.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import record  # noqa: E402
from engine import trace  # noqa: E402
from kvtransfer import connect, create_receiver  # noqa: E402
from kvtransfer.layout import PoolLayout, copy_blocks  # noqa: E402

GPU_SHAPE: dict[str, Any] = dict(layers=32, heads=8, dim=128, block=16, blocks=256, dtype="bfloat16")
CPU_SHAPE: dict[str, Any] = dict(layers=4, heads=2, dim=32, block=16, blocks=64, dtype="bfloat16")


def make_pool(shape: dict, num_blocks: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    dims = (shape["layers"], 2, num_blocks, shape["block"], shape["heads"], shape["dim"])
    return torch.randn(dims, generator=g, device=device, dtype=torch.float32).to(
        getattr(torch, shape["dtype"])
    )


def checksum(blocks: torch.Tensor) -> tuple[int, int]:
    """Two integer sums over the raw bits: equal for equal bytes, different for almost any change."""
    x = blocks.contiguous().view(-1).view(torch.int16).to(torch.int64)
    w = torch.arange(x.numel(), device=x.device, dtype=torch.int64) % 65521 + 1
    return int(x.sum()), int((x * w).sum())


def decode_main(shape: dict, device: str, transports: list[str], conn: Any) -> None:
    """The decode worker: one pool, a receiver per transport; expects, waits and checksums on command."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    pool = make_pool(shape, 4 * shape["blocks"], 7, device)
    done_at: dict[str, float] = {}  # request id -> when the receiver reported it complete (CLOCK_MONOTONIC)

    def on_done(rid: str, error: Any) -> None:
        if error is None:
            done_at[rid] = time.monotonic()
            trace.mark(rid, "kv.on_done")

    receivers = {t: create_receiver(t, pool, on_done=on_done) for t in transports}
    conn.send({t: r.descriptor() for t, r in receivers.items()})
    failures: list[str] = []

    def wait_all(receiver: Any, rids: list[str]) -> None:
        for rid in rids:
            try:
                receiver.wait(rid, timeout=120)
            except Exception as e:  # reported back, never silent
                failures.append(f"{rid}: {e}")

    waiters: list[threading.Thread] = []
    expected: list[str] = []
    while True:
        cmd, *args = conn.recv()
        if cmd == "expect":  # (transport, [(rid, dst), ...])
            transport, jobs = args
            expected = [r for r, _ in jobs]
            for rid, dst in jobs:
                receivers[transport].expect(rid, dst)
            waiters.append(
                threading.Thread(target=wait_all, args=(receivers[transport], [r for r, _ in jobs]))
            )
            waiters[-1].start()
            conn.send("ok")
        elif cmd == "checksum":
            for w in waiters:
                w.join()
            deadline = time.monotonic() + 10  # wait() can return before on_done has run
            while not all(r in done_at or any(f.startswith(r + ":") for f in failures) for r in expected):
                if time.monotonic() > deadline:
                    failures.append("on_done never came for some requests")
                    break
                time.sleep(0.001)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            conn.send((checksum(pool[:, :, args[0]]), list(failures), dict(done_at)))
        else:
            break
    for r in receivers.values():
        r.close()


def time_gpu(fn: Any, reps: int) -> float:
    """Median seconds of fn() by CUDA events, after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def block_ids(case: str, n: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """(src in a pool of 2n blocks, dst in a pool of 4n blocks)."""
    if case == "one":  # one block: the fixed cost of a transfer (control round trips, sync)
        return [0], [2 * n]
    if case == "contiguous":
        return list(range(n)), list(range(2 * n, 3 * n))
    if case == "scattered":
        return list(range(n)), rng.sample(range(4 * n), n)
    return rng.sample(range(2 * n), n), rng.sample(range(4 * n), n)


GAP_S = 0.005  # between transfers, so each is timed alone


def gpu_us_behind_spin(fn, reps: int) -> float:
    """Median GPU microseconds of fn's work: a ~1 ms spin is queued first, so fn's work is queued before
    the start event is reached (a call that waits for the previous one would otherwise time the host's
    turnaround too). The first 3 of reps + 3 are warm-up."""
    times = []
    for _ in range(reps + 3):
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[3:])


def pause(cadence: str, device: torch.device) -> None:
    """GAP_S between transfers: a GPU kernel of that length waited for ("step"), or a sleep ("idle")."""
    if cadence == "step" and device.type == "cuda":
        cycles = int(GAP_S * torch.cuda.get_device_properties(device).clock_rate * 1e3)
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize(device)
    else:
        time.sleep(GAP_S)


def run_case(
    transport: str,
    case: str,
    sender: Any,
    pool: torch.Tensor,
    conn: Any,
    reps: int,
    prepare: bool = True,
    cadence: str = "step",
) -> dict:
    n = pool.shape[2] // 2
    src, dst = block_ids(case, n, random.Random(f"{transport}/{case}"))
    rids = [f"{transport}-{case}-{i}" for i in range(reps + 1)]
    conn.send(("expect", transport, [(rid, dst) for rid in rids]))
    assert conn.recv() == "ok"
    sender.send(rids[0], src, dst)  # warm-up: index tensors, staging buffers, sockets
    times: list[float] = []
    started: dict[str, float] = {}
    late = 0
    for rid in rids[1:]:
        if prepare:  # at admission, before the forward pass (prefill_worker/core.py)
            sender.prepare(rid, dst)
        if cadence == "queued":
            late += queued_send(sender, rid, src, dst, pool.device, started, times)
            continue
        pause(cadence, pool.device)
        started[rid] = time.monotonic()
        t0 = time.perf_counter()
        sender.send(rid, src, dst)
        times.append(time.perf_counter() - t0)
    time.sleep(GAP_S)
    conn.send(("checksum", dst))
    remote_sum, failures, done_at = conn.recv()
    exact = remote_sum == checksum(pool[:, :, src]) and not failures
    delivered = [done_at[r] - t for r, t in started.items() if r in done_at]
    nbytes = len(src) * pool[:, :, 0].numel() * pool.element_size()
    mapped = getattr(sender, "_remote", None)  # cuda_ipc: the copy alone, into the mapped decode pool
    copy_gbps = None
    if isinstance(mapped, torch.Tensor):
        copy_gbps = nbytes / time_gpu(lambda: copy_blocks(pool, src, mapped, dst), reps) / 1e9
    sec = statistics.median(delivered) if len(delivered) == len(started) else float("nan")
    return dict(
        transport=transport,
        case=case,
        seconds=sec,
        gbps=nbytes / sec / 1e9,
        send_seconds=statistics.median(times),
        exact=exact,
        nbytes=nbytes,
        reps=reps,
        failures=failures[:3],
        copy_gbps=copy_gbps,
        cadence=cadence,
        late=late,
    )


def queued_send(
    sender: Any, rid: str, src: list[int], dst: list[int], device: torch.device, started: dict, times: list
) -> int:
    """The prefill engine's path (prefill_worker/core.py, _during): a GAP_S GPU step is queued, send() is
    called while it computes (its copy queued behind it), and the transfer is timed from the step's end,
    when the blocks are ready. The host polls an event recorded after the step; the start is the last
    poll that still saw it pending (at or before the true end: never flatters the figure). A send()
    that returned only after the step ended (late, counted) is timed from the send() call instead."""
    cycles = int(GAP_S * torch.cuda.get_device_properties(device).clock_rate * 1e3)
    torch.cuda.synchronize(device)
    torch.cuda._sleep(cycles)
    step_end = torch.cuda.Event()
    step_end.record()
    called = time.monotonic()
    t0 = time.perf_counter()
    sender.send(rid, src, dst)
    times.append(time.perf_counter() - t0)
    pending = time.monotonic()
    if step_end.query():
        started[rid] = called
        return 1
    while not step_end.query():
        pending = time.monotonic()
    started[rid] = pending
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cpu", action="store_true", help="dry run on CPU with a small shape")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tcp-reps", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="time block-copy kernel configs (same process)")
    ap.add_argument(
        "--ablate",
        action="store_true",
        help="cuda_ipc also with the copy launched eagerly: the kernel, then torch's copies, for every id pattern",
    )
    ap.add_argument(
        "--profile-send",
        type=Path,
        default=None,
        help="cuda_ipc: also time the contiguous case with send() under cProfile; its stats go to this file",
    )
    args = ap.parse_args()
    device = "cpu" if args.cpu else "cuda:0"
    shape = CPU_SHAPE if args.cpu else GPU_SHAPE
    # decode device -> transports served there (NCCL cannot pair two processes on one GPU)
    plan = {"cpu": ["tcp", "nccl"]} if args.cpu else {"cuda:0": ["cuda_ipc", "tcp"]}
    if not args.cpu and torch.cuda.device_count() >= 2:
        plan["cuda:1"] = ["nccl"]
    n = shape["blocks"]
    pool = make_pool(shape, 2 * n, 3, device)
    nbytes = n * pool[:, :, 0].numel() * pool.element_size()
    ceilings, in_process = measure_ceilings(pool, n, args.reps) if not args.cpu else ({}, {})
    breakdown: dict[str, float] = {}
    if not args.cpu:
        breakdown = copy_breakdown(pool, n, args.reps)
        print(
            f"block-copy kernel alone {breakdown['kernel_only_us']:.1f} us "
            f"({nbytes / breakdown['kernel_only_us'] / 1e3:.0f} GB/s, "
            f"{nbytes / breakdown['kernel_only_us'] / 1e3 / ceilings['d2d']:.0%} of d2d); "
            f"copy_blocks host time {breakdown['copy_blocks_host_us']:.1f} us (id upload "
            f"{breakdown['upload_ids_host_us']:.1f}, kernel launch {breakdown['kernel_launch_host_us']:.1f}); "
            f"graphed copy host time {breakdown['graphed_copy_host_us']:.1f} us, "
            f"GPU {breakdown['graphed_copy_gpu_us']:.1f} us; host probe (us): "
            + ", ".join(f"{k} {v:.1f}" for k, v in breakdown.items() if "after_step" in k or "_hot" in k),
            flush=True,
        )
    if args.sweep and not args.cpu:
        sweep_kernel(pool, n, args.reps, ceilings["d2d"], args.out)

    ctx = mp.get_context("spawn")
    results: list[dict] = []
    ablations: list[dict] = []
    for decode_device, transports in plan.items():
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=decode_main, args=(shape, decode_device, transports, child), daemon=True)
        proc.start()
        descriptors = parent.recv()
        for transport in transports:
            with connect(descriptors[transport], pool) as sender:
                reps = args.tcp_reps if transport == "tcp" else args.reps
                for case in ("one", "contiguous", "scattered", "random"):
                    results.append(run_case(transport, case, sender, pool, parent, reps))
                if transport == "cuda_ipc":  # the engine's path: queued while the step computes
                    for case in ("one", "contiguous", "scattered", "random"):
                        results.append(
                            run_case(transport, case, sender, pool, parent, reps, cadence="queued")
                        )
                if transport == "cuda_ipc" and args.profile_send:
                    profile_send(sender, pool, parent, args.reps, args.profile_send)
            if transport == "cuda_ipc" and args.ablate:
                ablations.extend(ablate(descriptors[transport], pool, parent, args.reps))
        parent.send(("stop",))
        proc.join(30)
    for r in ablations:
        print(
            f"ablation {r['variant']:<22} {r['case']:<11} delivered {r['seconds'] * 1e3:9.3f} ms  exact {r['exact']}"
        )
    report(results, ceilings, in_process, nbytes, args.out, shape, ablations, breakdown)


def profile_send(sender: Any, pool: torch.Tensor, conn: Any, reps: int, path: Path) -> None:
    """Where send()'s host time goes: the contiguous case once more, each send() under cProfile (which
    slows every Python call a little: read the shares, not the totals)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    plain = sender.send

    def profiled(*args: Any) -> None:
        prof.enable()
        try:
            plain(*args)
        finally:
            prof.disable()

    sender.send = profiled
    try:
        row = run_case("cuda_ipc", "contiguous", sender, pool, conn, reps)
    finally:
        sender.send = plain
    # The graph replay alone, after a step, by destination (the mapped decode pool or a local one) and
    # landing cell (this connection's, in the shared page this process registered; a cudaHostAlloc'd one;
    # none). The numbers landed go past every DONE on this connection, which sends none after this.
    from kernels.kv_block_copy import GraphedBlockCopy

    out = io.StringIO()
    if getattr(sender, "_graphed", None) is not None:
        src, dst = block_ids("contiguous", pool.shape[2] // 2, random.Random("cuda_ipc/contiguous"))
        local = torch.empty_like(sender._remote)
        pinned = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        variants = {
            "mapped pool, shared registered cell (the sender's)": sender._graphed,
            "mapped pool, cudaHostAlloc cell": GraphedBlockCopy(pool, sender._remote, landing=pinned),
            "mapped pool, no cell": GraphedBlockCopy(pool, sender._remote),
            "local pool, shared registered cell": GraphedBlockCopy(pool, local, landing=sender._landing),
            "local pool, cudaHostAlloc cell": GraphedBlockCopy(pool, local, landing=pinned),
            "local pool, no cell": GraphedBlockCopy(pool, local),
        }
        seqs = itertools.count(sender._seq + 1)
        for _round in range(2):  # every variant in turn, twice: these hosts drift
            for name, copier in variants.items():
                times = []
                for _ in range(reps + 1):
                    pause("step", pool.device)
                    seq = next(seqs) if copier.landing is not None else None
                    t0 = time.perf_counter()
                    copier(src, dst, seq)
                    times.append((time.perf_counter() - t0) * 1e6)
                torch.cuda.synchronize()
                out.write(
                    f"graph replay after a step, {name}: median {statistics.median(times[1:]):.1f} us\n"
                )
        del local
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"send() under cProfile, cuda_ipc contiguous, {reps} sends: delivered {row['seconds'] * 1e3:.3f} ms, "
        f"send() {row['send_seconds'] * 1e3:.3f} ms (medians)\n" + out.getvalue()
    )
    print(out.getvalue()[:3000], flush=True)


def ablate(descriptor: dict, pool: torch.Tensor, conn: Any, reps: int) -> list[dict]:
    """The cuda_ipc send with its copy launched eagerly (copy_blocks: the block-copy kernel for every id
    pattern, then torch's copies for every pattern), with the sender idle between transfers, and with its
    grant asked in send(), against the default (graph replay, grant asked ahead, "step" cadence)."""
    import kvtransfer.layout as lay

    chooser = lay.uses_kernel
    out = []
    try:
        for kernel in (True, False):
            lay.uses_kernel = lambda *args, k=kernel: k  # type: ignore[assignment]
            with connect(descriptor, pool) as sender:
                sender._graphed = None  # type: ignore[attr-defined]  # copy_blocks, as before graphs
                for case in ("one", "contiguous", "scattered", "random"):
                    variant = "eager kernel" if kernel else "eager torch"
                    out.append({**run_case("cuda_ipc", case, sender, pool, conn, reps), "variant": variant})
    finally:
        lay.uses_kernel = chooser
    with connect(descriptor, pool) as sender:  # the sender sleeping between transfers, not waiting on a step
        for case in ("one", "contiguous", "scattered", "random"):
            row = run_case("cuda_ipc", case, sender, pool, conn, reps, cadence="idle")
            out.append({**row, "variant": "sender idle between"})
    with connect(descriptor, pool) as sender:  # the grant asked in send(): its round trip on the path
        for case in ("one", "contiguous", "scattered", "random"):
            row = run_case("cuda_ipc", case, sender, pool, conn, reps, prepare=False)
            out.append({**row, "variant": "grant in send"})
    with connect(descriptor, pool) as sender:  # the default once more: A-B-A, as these hosts drift
        for case in ("one", "contiguous", "scattered", "random"):
            out.append({**run_case("cuda_ipc", case, sender, pool, conn, reps), "variant": "graphed again"})
    return out


def measure_ceilings(pool: torch.Tensor, n: int, reps: int) -> tuple[dict, dict]:
    """Device-to-device copy of n blocks (and to GPU 1, when there is one); same-process copy_blocks."""
    nbytes = n * pool[:, :, 0].numel() * pool.element_size()
    a, b = pool[:, :, :n].contiguous(), torch.empty_like(pool[:, :, :n])
    ceilings = {"d2d": nbytes / time_gpu(lambda: b.copy_(a), reps) / 1e9}
    if torch.cuda.device_count() >= 2:
        c = torch.empty_like(a, device="cuda:1")
        ceilings["p2p"] = nbytes / time_gpu(lambda: c.copy_(a), reps) / 1e9
        del c
    local = torch.empty((*pool.shape[:2], 4 * n, *pool.shape[3:]), dtype=pool.dtype, device=pool.device)
    in_process = {}
    # "": the block-copy kernel (copy_blocks' CUDA path); "_torch": torch's slice/index copies in 16-byte words
    for suffix, kernel in (("", True), ("_torch", False)):
        for case in ("contiguous", "scattered", "random"):
            src, dst = block_ids(case, n, random.Random(case))
            fn = lambda src=src, dst=dst, k=kernel: copy_blocks(pool, src, local, dst, kernel=k)  # noqa: E731
            in_process[case + suffix] = nbytes / time_gpu(fn, reps) / 1e9
    return ceilings, in_process


def copy_breakdown(pool: torch.Tensor, n: int, reps: int) -> dict[str, float]:
    """Where copy_blocks' time goes (random ids, same process): the kernel alone (ids already on the GPU,
    10 launches back to back per timing), and the host time of one copy_blocks call (ids list -> launch
    queued, no sync), in microseconds."""
    from kernels.kv_block_copy import kv_block_copy_triton

    local = torch.empty((*pool.shape[:2], 4 * n, *pool.shape[3:]), dtype=pool.dtype, device=pool.device)
    src, dst = block_ids("random", n, random.Random("breakdown"))
    ids = torch.tensor([src, dst], dtype=torch.int32, device=pool.device)

    def ten() -> None:
        for _ in range(10):
            kv_block_copy_triton(pool, ids[0], local, ids[1])

    kernel_us = time_gpu(ten, reps) / 10 * 1e6
    from kernels.kv_block_copy import GraphedBlockCopy, upload_ids

    graphed = GraphedBlockCopy(pool, local)
    graphed(src, dst)  # captures its bucket's graph
    landed = GraphedBlockCopy(pool, local, landing=torch.zeros(1, dtype=torch.int64, pin_memory=True))
    seqs = itertools.count(1)
    landed(src, dst, next(seqs))

    def graphed_gpu_us() -> float:
        return gpu_us_behind_spin(lambda: graphed(src, dst), reps)

    def host_us(fn: Any) -> float:
        host = []
        for _ in range(reps + 3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        return statistics.median(host[3:]) * 1e6

    def after_step_us(fn: Any) -> float:
        """fn's host time right after waiting for a GPU step, as the engine sends (the "step" cadence)."""
        host = []
        for _ in range(reps + 3):
            pause("step", pool.device)
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        return statistics.median(host[3:]) * 1e6

    layout = PoolLayout.of(pool)

    def checks() -> None:  # send()'s pure-Python preamble on 256 ids
        a, b = list(map(int, src)), list(map(int, dst))
        layout.check_ids(a, "source")
        assert tuple(b) == tuple(dst) and len(a) == len(b)

    busy = lambda: sum(range(20_000))  # noqa: E731  (a fixed amount of interpreter work)
    return {
        # the host itself: the same pure-Python work hot and right after a GPU wait
        "python_busy_hot_us": host_us(busy),
        "python_busy_after_step_us": after_step_us(busy),
        "send_checks_hot_us": host_us(checks),
        "send_checks_after_step_us": after_step_us(checks),
        "graphed_copy_with_landing_after_step_us": after_step_us(lambda: landed(src, dst, next(seqs))),
        "kernel_only_us": kernel_us,
        "copy_blocks_host_us": host_us(lambda: copy_blocks(pool, src, local, dst, kernel=True)),
        "upload_ids_host_us": host_us(lambda: upload_ids(src, dst, pool.device)),
        "kernel_launch_host_us": host_us(lambda: kv_block_copy_triton(pool, ids[0], local, ids[1])),
        # cuda_ipc's copy on one GPU: ids into a pinned buffer, one graph replay (upload + kernel)
        "graphed_copy_host_us": host_us(lambda: graphed(src, dst)),
        # the same with its landing cell (page-locked host memory) written after the kernel, in the graph
        "graphed_copy_with_landing_host_us": host_us(lambda: landed(src, dst, next(seqs))),
        "graphed_copy_gpu_us": graphed_gpu_us(),
    }


def sweep_kernel(pool: torch.Tensor, n: int, reps: int, d2d: float, out: Path | None) -> None:
    """Same-process block copies (random ids) with kernels/kv_block_copy.py configs around the default;
    printed, and written to kvtransfer_copy_sweep.json; the winner becomes DEFAULT_CONFIG by hand."""
    import json
    from itertools import product

    from kernels.kv_block_copy import kv_block_copy_triton

    nbytes = n * pool[:, :, 0].numel() * pool.element_size()
    local = torch.empty((*pool.shape[:2], 4 * n, *pool.shape[3:]), dtype=pool.dtype, device=pool.device)
    src, dst = block_ids("random", n, random.Random("sweep"))
    ids = torch.tensor([src, dst], dtype=torch.int32, device=pool.device)
    found = []
    for chunk, rows, warps in product((1024, 2048, 4096, 8192), (1, 4, 16), (4, 8, 16)):
        cfg = {"chunk": chunk, "rows_per_program": rows, "num_warps": warps}
        try:
            sec = time_gpu(lambda cfg=cfg: kv_block_copy_triton(pool, ids[0], local, ids[1], cfg), reps)
            gbps: float | str = nbytes / sec / 1e9
        except Exception as e:  # e.g. too many registers
            gbps = f"failed: {type(e).__name__}"
        found.append({**cfg, "gbps": gbps, "of_d2d": gbps / d2d if isinstance(gbps, float) else None})
        print("block-copy sweep", json.dumps(found[-1]), flush=True)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "kvtransfer_copy_sweep.json").write_text(json.dumps(found, indent=1) + "\n")


CEILING_NAMES = {
    "d2d": "device-to-device copy of the same bytes on one GPU, same run (payload bytes / time)",
    "p2p": "GPU0 -> GPU1 copy of the same bytes, same run (payload bytes / time)",
}


def ceiling_of(transport: str, ceilings: dict) -> str | None:
    key = "p2p" if transport == "nccl" else "d2d"
    return key if key in ceilings else None


def report(
    results: list[dict],
    ceilings: dict,
    in_process: dict,
    nbytes: int,
    out: Path | None,
    shape: dict,
    ablations: list[dict],
    breakdown: dict[str, float],
) -> None:
    cpu = not ceilings
    print(f"\npayload {nbytes / 2**20:.0f} MiB per transfer; ceilings (GB/s): {ceilings}")
    if in_process:
        d2d = ceilings["d2d"]
        print(
            "same-process copy_blocks (kernel; _torch: torch copies), GB/s (of d2d): "
            + ", ".join(f"{k} {v:.0f} ({v / d2d:.0%})" for k, v in in_process.items())
        )
    print(
        f"{'transport':<10} {'cadence':<7} {'block ids':<11} {'delivered ms':>12} {'GB/s':>8} {'of ceil':>8}  "
        "send() ms  exact  copy-only GB/s"
    )
    for r in results:
        key = ceiling_of(r["transport"], ceilings)
        ratio = r["gbps"] / ceilings[key] if key else float("nan")
        print(
            f"{r['transport']:<10} {r['cadence']:<7} {r['case']:<11} {r['seconds'] * 1e3:12.3f} {r['gbps']:8.1f} "
            f"{ratio:8.1%}  {r['send_seconds'] * 1e3:9.3f}  {r['exact']!s:5}  "
            f"{r['copy_gbps'] or float('nan'):14.0f}" + (f"  {r['failures']}" if r["failures"] else "")
        )
    if out is None:
        return
    fixed = {(r["transport"], r["cadence"]): r["seconds"] for r in results if r["case"] == "one"}
    for r in results:
        if r["case"] == "one" or (r["transport"] == "tcp" and r["case"] != "contiguous"):
            continue  # at most 8 files come back from the device: tcp is for reference only
        key = ceiling_of(r["transport"], ceilings)
        extra: dict[str, Any] = dict(
            shape,
            tokens=shape["blocks"] * shape["block"],
            nbytes=r["nbytes"],
            seconds=r["seconds"],
            send_seconds=r["send_seconds"],
            block_ids=r["case"],
            exact=r["exact"],
            reps=r["reps"],
            ceilings_gbps=ceilings,
            same_process_block_copy_kernel_gbps=in_process.get(r["case"]),
            same_process_torch_copy_gbps=in_process.get(r["case"] + "_torch"),
            copy_only_into_mapped_pool_gbps=r["copy_gbps"],
            copy_breakdown_random_ids=breakdown or None,
            one_block_delivered_seconds=fixed.get((r["transport"], r["cadence"])),
            cadence=r["cadence"],
            late_sends=r["late"],
            tcp_all_cases_gbps={x["case"]: x["gbps"] for x in results if x["transport"] == "tcp"},
            ablation_delivered_seconds={
                a["variant"]: a["seconds"] for a in ablations if a["case"] == r["case"]
            }
            if r["transport"] == "cuda_ipc"
            else None,
        )
        extra["timed"] = (
            "delivered: send() called -> the decode process's receiver reported the request complete "
            "(on_done; one CLOCK_MONOTONIC), one transfer at a time, each after a 5 ms GPU step the "
            "sender waited for ('sender idle between' in the ablation: a sleep), median"
            if r["cadence"] != "queued"
            else "delivered: the 5 ms GPU step ended (the blocks are ready; send() was called while it ran, "
            "as the prefill engine does, and its copy queued behind it) -> the decode process's receiver "
            "reported the request complete (on_done; one CLOCK_MONOTONIC); the step's end is the last host "
            "poll of an event after it that still saw it pending; one transfer at a time, median"
        )
        suffix = "_queued" if r["cadence"] == "queued" else ""
        record(
            f"kvtransfer_{r['transport']}_{r['case']}{suffix}" + ("_cpu" if cpu else ""),
            r["gbps"],
            "GB/s",
            ceiling=ceilings[key] if key else None,
            ceiling_name=CEILING_NAMES[key] if key else None,
            goal=">= 70% of device-to-device copy" if r["transport"] == "cuda_ipc" else None,
            extra=extra,
            out_dir=out,
            command="python bench/kvtransfer.py" + (" --cpu" if cpu else ""),
        )


if __name__ == "__main__":
    main()
