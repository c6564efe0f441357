"""Where a cuda_ipc transfer's time goes beyond the copy itself: host stamps along send() and the
receiver, and the launch-to-landing latency of the graphed copy in one process, by variant.

    python bench/kv_probe.py [--reps 30] [--out FILE]     # on the GPU

In one process (no receiver): a landing cell in pinned host memory; after a GPU "step" the host
launches the copy and spins until the cell shows its number. Reported per variant: host time of the
launch call, and launch call -> cell seen (medians, us). Then across two processes, the real sender and
receiver with every stage mark (engine.trace.mark) recorded in memory with time.monotonic (one clock
for both processes), as offsets from send() being called.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench.kvtransfer import GPU_SHAPE, block_ids, gpu_us_behind_spin, make_pool, pause  # noqa: E402
from engine import trace  # noqa: E402
from kernels.kv_block_copy import (
    GraphedBlockCopy,  # noqa: E402
    kv_block_copy_triton,  # noqa: E402
)
from kvtransfer import connect, create_receiver  # noqa: E402


@triton.jit
def _store_cell(src_ptr, cell_ptr):
    tl.store(cell_ptr, tl.load(src_ptr))


def custom_graph(pool: torch.Tensor, local: torch.Tensor, cell: torch.Tensor, b: int, mode: str) -> Any:
    """A graph for bucket b: mode "kernel_cell" = ids up, copy, a one-thread kernel stores seq into the
    host cell; "zero_copy" = the copy kernel reads the ids from pinned host memory, then the cell is
    written by a kernel too (no memcpy node at all)."""
    import numpy as np

    pinned = torch.zeros(4 + 2 * b, dtype=torch.int32, pin_memory=True)
    ids = pinned if mode == "zero_copy" else torch.zeros(4 + 2 * b, dtype=torch.int32, device=pool.device)

    def launch() -> None:
        kv_block_copy_triton(pool, ids[1 : 1 + b], local, ids[1 + b : 1 + 2 * b], count=ids[:1])
        _store_cell[(1,)](ids[2 + 2 * b :].view(torch.int64), cell)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch()
        g = torch.cuda.CUDAGraph()
        g.capture_begin(capture_error_mode="thread_local")
        if mode != "zero_copy":
            ids.copy_(pinned, non_blocking=True)
        launch()
        g.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    host = pinned.numpy()

    def call(src: list[int], dst: list[int], seq: int) -> None:
        n = len(src)
        host[0] = n
        host[1 : 1 + n] = src
        host[1 + b : 1 + b + n] = dst
        host.view(np.int64)[1 + b] = seq
        g.replay()

    return call


def med(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6


def in_process(pool: torch.Tensor, reps: int, out: list[str]) -> None:
    n = pool.shape[2] // 2
    local = torch.empty((*pool.shape[:2], 4 * n, *pool.shape[3:]), dtype=pool.dtype, device=pool.device)
    cell = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    view = cell.numpy()
    seqs = iter(range(1, 1 << 30))
    landed = GraphedBlockCopy(pool, local, landing=cell)
    dev_seq = torch.zeros(1, dtype=torch.int64, device=pool.device)

    def eager_cell(seq: int) -> None:
        dev_seq.fill_(seq)
        cell.copy_(dev_seq, non_blocking=True)

    def probe(name: str, launch: Any) -> None:
        host, seen = [], []
        for _ in range(reps + 3):
            pause("step", pool.device)
            seq = next(seqs)
            t0 = time.perf_counter()
            launch(seq)
            t1 = time.perf_counter()
            while view[0] < seq:
                pass
            t2 = time.perf_counter()
            host.append(t1 - t0)
            seen.append(t2 - t0)
        out.append(
            f"{name:<48} launch call {med(host[3:]):7.1f} us   cell seen after {med(seen[3:]):7.1f} us"
        )

    for case in ("one", "contiguous"):
        src, dst = block_ids(case, n, random.Random(case))
        probe(f"graph: ids up + copy + cell down, {case}", lambda s, a=src, b=dst: landed(a, b, s))
    probe("graph: ids up + no copy (n=0) + cell down", lambda s: landed([], [], s))
    for mode in ("kernel_cell", "zero_copy"):
        try:
            call = custom_graph(pool, local, cell, 256, mode)
        except Exception as e:  # noqa: BLE001
            out.append(f"{mode}: {type(e).__name__}: {e}")
            continue
        for case in ("one", "contiguous"):
            src, dst = block_ids(case, n, random.Random(case))
            probe(f"graph {mode}, {case}", lambda s, a=src, b=dst, c=call: c(a, b, s))
            if case == "contiguous":
                ok = torch.equal(local[:, :, dst], pool[:, :, src])
                out.append(f"graph {mode}: copy exact {ok}")
                local.zero_()
    probe("eager: fill + cell down (two launches)", eager_cell)
    # the GPU time of the graph alone, queued behind a spin
    src, dst = block_ids("contiguous", n, random.Random("contiguous"))
    gpu_us = gpu_us_behind_spin(lambda: landed(src, dst, next(seqs)), reps)
    out.append(f"graph GPU time, contiguous, queued behind a spin: {gpu_us:.1f} us")


class Stamps:
    def __init__(self) -> None:
        self.rows: list[tuple[float, str, str]] = []

    def mark(self, rid: str, stage: str) -> None:
        self.rows.append((time.monotonic(), rid, stage))


def decode_main(shape: dict, conn: Any) -> None:
    torch.cuda.set_device("cuda:0")
    stamps = Stamps()
    trace.mark = stamps.mark  # type: ignore[assignment]
    pool = make_pool(shape, 4 * shape["blocks"], 7, "cuda:0")

    def on_done(rid: str, error: Any) -> None:
        stamps.mark(rid, "kv.on_done")

    receiver = create_receiver("cuda_ipc", pool, on_done=on_done)
    conn.send(receiver.descriptor())
    while True:
        cmd, *args = conn.recv()
        if cmd == "expect":
            for rid, dst in args[0]:
                receiver.expect(rid, dst)
            conn.send("ok")
        elif cmd == "stamps":
            time.sleep(0.05)
            conn.send(stamps.rows)
            stamps.rows = []
        else:
            break
    receiver.close()


def across_processes(pool: torch.Tensor, reps: int, out: list[str]) -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=decode_main, args=(GPU_SHAPE, child), daemon=True)
    proc.start()
    descriptor = parent.recv()
    stamps = Stamps()
    plain_mark = trace.mark
    trace.mark = stamps.mark  # type: ignore[assignment]
    n = pool.shape[2] // 2
    try:
        with connect(descriptor, pool) as sender:
            for case in ("one", "contiguous"):
                src, dst = block_ids(case, n, random.Random(case))
                rids = [f"{case}-{i}" for i in range(reps + 3)]
                parent.send(("expect", [(r, dst) for r in rids]))
                assert parent.recv() == "ok"
                graphed = getattr(sender, "_graphed", None)
                current = [""]  # the request being sent, for the replay stamps
                for rid in rids:
                    sender.prepare(rid, dst)
                    pause("step", pool.device)
                    if graphed is not None:
                        for entry in graphed._graphs.values():  # stamp the replay call too
                            g = entry[0]
                            if "replay" not in g.__dict__:
                                plain = g.replay

                                def stamped(plain: Any = plain, current: list[str] = current) -> None:
                                    stamps.mark(current[0], "graph.replay_enter")
                                    plain()
                                    stamps.mark(current[0], "graph.replay_exit")

                                g.replay = stamped  # type: ignore[method-assign]
                    current[0] = rid
                    stamps.mark(rid, "bench.call")
                    sender.send(rid, src, dst)
                    stamps.mark(rid, "bench.returned")
                parent.send(("stamps",))
                rows = stamps.rows + parent.recv()
                stamps.rows = []
                by_stage: dict[str, list[float]] = {}
                for rid in rids[3:]:
                    mine = {s: t for t, r, s in rows if r == rid}
                    t0 = mine.get("bench.call")
                    if t0 is None:
                        continue
                    for s, t in mine.items():
                        by_stage.setdefault(s, []).append(t - t0)
                out.append(f"two processes, {case}: median us after send() was called (n={reps})")
                for s, ts in sorted(by_stage.items(), key=lambda kv: statistics.median(kv[1])):
                    out.append(f"    {med(ts):8.1f}  {s}")
    finally:
        trace.mark = plain_mark  # type: ignore[assignment]
        parent.send(("stop",))
        proc.join(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.cuda.set_device("cuda:0")
    pool = make_pool(GPU_SHAPE, 2 * GPU_SHAPE["blocks"], 3, "cuda:0")
    out: list[str] = []
    in_process(pool, args.reps, out)
    across_processes(pool, args.reps, out)
    text = "\n".join(out) + "\n"
    print(text, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
