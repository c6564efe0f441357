"""kvtransfer on the GPU: cuda_ipc (and tcp between CUDA pools) between two processes on one GPU;
nccl between two GPUs when the machine has them."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import threading
import time
from typing import Any

import pytest
import torch

from kvtransfer import KVTransferError, connect, create_receiver

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LAYERS, BLOCK, HEADS, DIM = 4, 16, 8, 128  # 256 KiB per block in bf16
DECODE_BLOCKS, PREFILL_BLOCKS = 160, 96
SPAWN = mp.get_context("spawn")


def make_pool(num_blocks: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(LAYERS, 2, num_blocks, BLOCK, HEADS, DIM, generator=g)
    return pool.to(torch.bfloat16).to(device)


def use(device: str) -> None:
    if device.startswith("cuda"):  # the helpers also run on CPU, to check them without a GPU
        torch.cuda.set_device(device)


def prefill_main(
    descriptor: dict,
    seed: int,
    device: str,
    jobs: list,
    q: Any,
    prepare: bool = False,
    inference: bool = False,
) -> None:
    use(device)
    pool = make_pool(PREFILL_BLOCKS, seed, device)
    with torch.inference_mode(inference):  # inference: connected inside a forward pass's inference mode
        sender = connect(descriptor, pool)
    with sender:

        def run(mine: list) -> None:
            if prepare:  # every grant asked for ahead, as the prefill worker does at admission
                for rid, _, dst in mine:
                    sender.prepare(rid, dst)
            for rid, src, dst in mine:
                try:
                    sender.send(rid, src, dst)
                    q.put((rid, None))
                except KVTransferError as e:
                    q.put((rid, str(e)))

        workers = [threading.Thread(target=run, args=(jobs[i::2],)) for i in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()


def dying_prefill_main(descriptor: dict, q: Any, when: str) -> None:
    """Die holding request "doomed"'s grant ("granted": before copying) or with its copy queued behind
    a long kernel and its DONE out ("queued")."""
    sender: Any = connect(descriptor, make_pool(PREFILL_BLOCKS, 0, "cuda:0"))
    sender.prepare("doomed", [1, 2])
    deadline = time.monotonic() + 60
    while sender._grants["doomed"].state.value != "granted":
        assert time.monotonic() < deadline, "no grant came"
        time.sleep(0.001)
    if when == "queued":
        sender.send("warm", [2], [5])  # the copy's graph is captured: the next send only queues work
        torch.cuda.synchronize()
        torch.cuda._sleep(3_000_000_000)  # ~2 s of GPU time before the copy can run
        sender.send("doomed", [0, 1], [1, 2])
    q.put("started")
    q.close()
    q.join_thread()
    os._exit(1)


def revoked_prefill_main(descriptor: dict, q: Any, go: Any) -> None:
    """Hold request "revoked"'s grant until the test has cancelled it, then try to send it."""
    use("cuda:0")
    with connect(descriptor, make_pool(PREFILL_BLOCKS, 0, "cuda:0")) as sender:
        sender.prepare("revoked", [3, 4])
        q.put("prepared")
        go.get(timeout=60)
        try:
            sender.send("revoked", [0, 1], [3, 4])
            q.put(None)
        except KVTransferError as e:
            q.put(str(e))


def reusing_prefill_main(descriptor: dict, q: Any) -> None:
    """Send blocks whose forward pass still runs, then rewrite them on the same stream as soon as
    send() returns: the receiver must get them as they were when the forward pass ended."""
    use("cuda:0")
    pool = make_pool(PREFILL_BLOCKS, 5, "cuda:0")
    with connect(descriptor, pool) as sender:
        torch.cuda._sleep(100_000_000)  # the "forward pass": tens of ms, still running when send returns
        pool[:, :, :40] += 1  # ...which writes the blocks last
        sender.send("reuse", list(range(40)), list(range(100, 140)))
        pool.zero_()  # the next step's forward pass: must not start before the copy has read them
        torch.cuda.synchronize()
    q.put("sent")


def plan_jobs() -> list:
    """Block lists contiguous, scattered on either side, random and small, into disjoint destination blocks."""
    rng = random.Random(3)
    fixed = set(range(100, 116)) | set(range(140, 148))
    free = [b for b in rng.sample(range(DECODE_BLOCKS), DECODE_BLOCKS) if b not in fixed]
    jobs = [
        ("contiguous", list(range(0, 16)), list(range(100, 116))),
        ("scattered-dst", list(range(16, 28)), [free.pop() for _ in range(12)]),
        ("scattered-src", rng.sample(range(PREFILL_BLOCKS), 8), list(range(140, 148))),
        ("random", rng.sample(range(PREFILL_BLOCKS), 40), [free.pop() for _ in range(40)]),
    ]
    jobs += [
        (f"small-{i}", rng.sample(range(PREFILL_BLOCKS), 3), [free.pop() for _ in range(3)]) for i in range(6)
    ]
    return jobs


def collect(q: Any, n: int, proc: Any, timeout: float = 120.0) -> dict:
    out: dict[str, str | None] = {}
    deadline = time.monotonic() + timeout
    while len(out) < n:
        try:
            rid, err = q.get(timeout=1.0)
            out[rid] = err
        except queue.Empty:
            assert proc.is_alive(), f"the prefill process died (exit {proc.exitcode}); outcomes {out}"
            assert time.monotonic() < deadline, f"timed out; outcomes so far {out}"
    return out


def check_transfers(
    transport: str, decode_device: str, prefill_device: str, prepare: bool = False, inference: bool = False
) -> None:
    use(decode_device)
    pool = make_pool(DECODE_BLOCKS, 100, decode_device)
    before = pool.clone()
    jobs = plan_jobs()
    q = SPAWN.Queue()
    with create_receiver(transport, pool) as receiver:
        for rid, _, dst in jobs:
            receiver.expect(rid, dst)
        args = (receiver.descriptor(), 5, prefill_device, jobs, q, prepare, inference)
        proc = SPAWN.Process(target=prefill_main, args=args)
        proc.start()
        outcomes = collect(q, len(jobs), proc)
        for rid, _, _ in jobs:
            receiver.wait(rid, timeout=5)  # send() returned: the copy is at least queued
        proc.join(30)
    assert all(err is None for err in outcomes.values()), outcomes
    source = make_pool(PREFILL_BLOCKS, 5, decode_device)
    written = torch.zeros(DECODE_BLOCKS, dtype=torch.bool)
    for rid, src, dst in jobs:
        assert torch.equal(pool[:, :, dst], source[:, :, src]), rid
        written[dst] = True
    assert torch.equal(pool[:, :, ~written.to(decode_device)], before[:, :, ~written.to(decode_device)])


@pytest.mark.parametrize("prepare", [False, True], ids=["grant-in-send", "grant-ahead"])
def test_cuda_ipc_two_processes_one_gpu_exact(prepare: bool) -> None:
    check_transfers("cuda_ipc", "cuda:0", "cuda:0", prepare)


def test_cuda_ipc_sender_connected_in_inference_mode_sends_outside_it() -> None:
    """The prefill worker may connect while a forward pass runs under torch.inference_mode (a grant taken
    mid-step) and sends after it: the sender's own tensors, updated in place on every send, must not be
    inference tensors (the copy fails if they are)."""
    check_transfers("cuda_ipc", "cuda:0", "cuda:0", prepare=True, inference=True)


def test_tcp_between_cuda_pools_exact() -> None:
    check_transfers("tcp", "cuda:0", "cuda:0")


@pytest.mark.parametrize("when", ["granted", "queued"])
def test_cuda_ipc_sender_dies_mid_transfer(when: str) -> None:
    """A sender that dies holding a grant fails the request at once. One that dies with its copy queued
    behind a long kernel (its DONE out) either fails it, or, when the driver ran the queued work before
    tearing the process down, reports it complete with exactly the sender's blocks: never complete with
    anything else."""
    pool = make_pool(DECODE_BLOCKS, 100, "cuda:0")
    before = pool.clone()
    q = SPAWN.Queue()
    with create_receiver("cuda_ipc", pool) as receiver:
        receiver.expect("doomed", [1, 2])
        receiver.expect("warm", [5])
        proc = SPAWN.Process(target=dying_prefill_main, args=(receiver.descriptor(), q, when))
        proc.start()
        assert q.get(timeout=120) == "started"
        t0 = time.monotonic()
        try:
            receiver.wait("doomed", timeout=20)
            outcome = "complete"
        except KVTransferError as e:
            outcome = f"failed: {e}"
        print(f"sender died ({when}): after {time.monotonic() - t0:.2f} s the request is {outcome}")
        assert time.monotonic() - t0 < 5
        proc.join(30)
    torch.cuda.synchronize()
    if when == "granted":
        assert outcome.startswith("failed") and "doomed" in outcome
    if outcome == "complete":
        assert torch.equal(pool[:, :, [1, 2]], make_pool(PREFILL_BLOCKS, 0, "cuda:0")[:, :, [0, 1]])
    else:
        assert torch.equal(pool[:, :, [1, 2]], before[:, :, [1, 2]])


@pytest.mark.parametrize("wait", [True, False], ids=["waiting", "not-waiting"])
def test_cuda_ipc_cancel_revokes_a_grant_held_by_another_process(wait: bool) -> None:
    """cancel() returns once the sender has handed the grant back; cancel(wait=False), as the decode
    worker calls it, returns False at once and the request comes out of drained() after that."""
    pool = make_pool(DECODE_BLOCKS, 100, "cuda:0")
    before = pool.clone()
    q, go = SPAWN.Queue(), SPAWN.Queue()
    with create_receiver("cuda_ipc", pool) as receiver:
        receiver.expect("revoked", [3, 4])
        proc = SPAWN.Process(target=revoked_prefill_main, args=(receiver.descriptor(), q, go))
        proc.start()
        assert q.get(timeout=120) == "prepared"
        deadline = time.monotonic() + 30
        while receiver._entries["revoked"].state.name != "IN_FLIGHT":  # the grant went out
            assert time.monotonic() < deadline
            time.sleep(0.001)
        t0 = time.monotonic()
        if wait:
            assert receiver.cancel("revoked")  # returns once the sender has handed the grant back
            assert time.monotonic() - t0 < 2
        else:
            assert receiver.cancel("revoked", wait=False) is False
            while not receiver.has_drained():
                assert time.monotonic() - t0 < 2, "the revoked grant never drained"
                time.sleep(0.001)
            assert receiver.drained() == ["revoked"]
        go.put("send now")
        outcome = q.get(timeout=60)
        proc.join(30)
    assert outcome is not None and "cancelled" in outcome, outcome
    torch.cuda.synchronize()
    assert torch.equal(pool, before)


def test_cuda_ipc_copy_follows_the_forward_and_precedes_the_rewrite() -> None:
    pool = make_pool(DECODE_BLOCKS, 100, "cuda:0")
    q = SPAWN.Queue()
    with create_receiver("cuda_ipc", pool) as receiver:
        receiver.expect("reuse", list(range(100, 140)))
        proc = SPAWN.Process(target=reusing_prefill_main, args=(receiver.descriptor(), q))
        proc.start()
        assert q.get(timeout=120) == "sent"
        receiver.wait("reuse", timeout=20)
        proc.join(30)
    expected = make_pool(PREFILL_BLOCKS, 5, "cuda:0")[:, :, :40] + 1
    assert torch.equal(pool[:, :, 100:140], expected)


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs 2 GPUs: NCCL cannot pair two processes on one GPU ('Duplicate GPU detected')",
)
def test_nccl_two_gpus_exact() -> None:
    check_transfers("nccl", "cuda:0", "cuda:1")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (as test_nccl_two_gpus_exact)")
def test_nccl_two_gpus_exact_in_layer_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every transfer in layer chunks (kvtransfer.nccl.layer_chunks: 4 layers -> 4 sends, each waiting for
    its own gather on the sender and feeding its own scatter on the receiver)."""
    monkeypatch.setenv("PDSERVE_KV_CHUNK_MIN_BYTES", "0")  # both processes read it (spawned after this)
    check_transfers("nccl", "cuda:0", "cuda:1")


def test_copy_blocks_back_to_back_reuses_id_buffers_safely() -> None:
    """copy_blocks uploads its ids through one pinned buffer per stream (kernels.kv_block_copy.IdUploader):
    many calls queued without a sync in between, each with other ids and sizes, must each copy their own."""
    from kvtransfer.layout import copy_blocks

    src = make_pool(PREFILL_BLOCKS, 1, "cuda")
    dst = torch.zeros_like(make_pool(DECODE_BLOCKS, 2, "cuda"))
    rng = random.Random(0)
    expected = torch.zeros_like(dst)
    free = list(range(DECODE_BLOCKS))
    rng.shuffle(free)
    for n in (1, 7, 40, 3, 64, 2, 31):  # 148 destination blocks, none written twice
        s = rng.sample(range(PREFILL_BLOCKS), n)
        d, free = free[:n], free[n:]
        copy_blocks(src, s, dst, d)
        expected[:, :, d] = src[:, :, s]
    torch.cuda.synchronize()
    assert torch.equal(dst, expected)


def test_graphed_block_copy_back_to_back_across_buckets_equals_indexing() -> None:
    """kernels.kv_block_copy.GraphedBlockCopy (cuda_ipc's copy on one GPU): one graph per bucket of pair
    counts, ids read at replay time from a pinned buffer per bucket. Calls queued without a sync, sizes
    crossing buckets and reusing them (so a bucket's buffer is rewritten while earlier replays may still be
    queued), each copy only its own blocks; a source rewritten on the stream after a call does not leak
    into that call's copy (the replay reads the source in stream order)."""
    from kernels.kv_block_copy import GraphedBlockCopy

    src = make_pool(PREFILL_BLOCKS, 1, "cuda")
    dst = torch.zeros_like(make_pool(DECODE_BLOCKS, 2, "cuda"))
    copier = GraphedBlockCopy(src, dst)
    rng = random.Random(1)
    expected = torch.zeros_like(dst)
    free = list(range(DECODE_BLOCKS))
    rng.shuffle(free)
    for n in (1, 16, 17, 3, 40, 2, 15, 33, 1, 20):  # buckets 16, 16, 32, 16, 64, 16, 16, 64, 16, 32
        s = rng.sample(range(PREFILL_BLOCKS), n)
        d, free = free[:n], free[n:]
        copier(s, d)
        expected[:, :, d] = src[:, :, s]
        src[:, :, s] += 1  # queued after the copy: must not reach it
    torch.cuda.synchronize()
    assert sorted(copier._graphs) == [16, 32, 64]
    assert torch.equal(dst, expected)


def test_graphed_block_copy_writes_its_landing_cell_after_the_copy() -> None:
    """With a landing cell (page-locked host memory, as cuda_ipc's shared counters), each replay copies
    its number down after the kernel: queued behind a long kernel, the cell keeps the old number until the
    copy has run; a call whose bucket's last replay has not landed waits for it before rewriting the
    ids; an empty copy still writes its number."""
    from kernels.kv_block_copy import GraphedBlockCopy

    src = make_pool(PREFILL_BLOCKS, 1, "cuda")
    dst = torch.zeros_like(make_pool(DECODE_BLOCKS, 2, "cuda"))
    cell = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    copier = GraphedBlockCopy(src, dst, landing=cell)
    copier([0], [5], 1)  # captures bucket 16
    torch.cuda.synchronize()
    assert int(cell[0]) == 1
    torch.cuda._sleep(200_000_000)  # ~0.1 s at H200 clocks: the next replay waits behind it
    copier([1, 2, 3], [7, 9, 11], 2)
    assert int(cell[0]) == 1, "the cell moved before the copy ran"
    copier([4, 6], [12, 13], 3)  # same bucket, its buffer still unread: waits for the replay before
    torch.cuda.synchronize()
    assert int(cell[0]) == 3
    assert torch.equal(dst[:, :, [5, 7, 9, 11, 12, 13]], src[:, :, [0, 1, 2, 3, 4, 6]])
    copier([], [], 3 << 40)  # a number past 32 bits, and no blocks
    torch.cuda.synchronize()
    assert int(cell[0]) == 3 << 40
