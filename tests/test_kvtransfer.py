"""kvtransfer on the CPU: tcp and gloo between real processes, the receiver's contract, descriptors.

The decode side (receiver) lives in the test process; each prefill worker is a spawned process with
a pool drawn from its own seed, so the test can rebuild its source blocks and compare exactly.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import random
import threading
import time
from typing import Any

import pytest
import torch

from kvtransfer import KVTransferError, PoolLayout, connect, create_receiver
from kvtransfer.cuda_ipc import decode_ipc_args, encode_ipc_args
from kvtransfer.layout import copy_blocks, runs
from kvtransfer.wire import _FRAME, MAGIC, VERSION, Channel, Kind, pack_ids, unpack_ids

LAYERS, BLOCK, HEADS, DIM = 3, 4, 2, 8
DECODE_BLOCKS, PREFILL_BLOCKS = 64, 40
CPU_TRANSPORTS = ["tcp", "nccl"]  # nccl runs its gloo backend on CPU pools
SPAWN = mp.get_context("spawn")


def make_pool(num_blocks: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, num_blocks, BLOCK, HEADS, DIM, generator=g).to(dtype)


# -- prefill processes (spawned: module-level functions) -----------------------------------------------
def prefill_main(
    descriptor: dict, seed: int, jobs: list, q: Any, threads: int = 2, dtype: torch.dtype = torch.float32
) -> None:
    """Send every (request_id, src, dst) job, `threads` at a time over one sender; report each outcome."""
    pool = make_pool(PREFILL_BLOCKS, seed, dtype)
    with connect(json.loads(json.dumps(descriptor)), pool) as sender:  # the descriptor survives JSON

        def run(mine: list) -> None:
            for rid, src, dst in mine:
                try:
                    sender.send(rid, src, dst)
                    q.put((rid, None))
                except KVTransferError as e:
                    q.put((rid, str(e)))

        workers = [threading.Thread(target=run, args=(jobs[i::threads],)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()


def dying_prefill_main(descriptor: dict, how: str, q: Any) -> None:
    """Start a transfer of request "doomed" (blocks 0..7 -> 10..17), then die or hang up halfway."""
    pool = make_pool(PREFILL_BLOCKS, 0)
    sender: Any = connect(descriptor, pool)
    nbytes = 8 * PoolLayout.of(pool).block_nbytes
    body = json.dumps({"request_id": "doomed", "dst": list(range(10, 18)), "nbytes": nbytes}).encode()
    header = _FRAME.pack(
        MAGIC, VERSION, Kind.BEGIN, len(body), nbytes if descriptor["transport"] == "tcp" else 0
    )
    half = pool[:, :, :4].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    sender._ch.sock.sendall(header + body + (half if descriptor["transport"] == "tcp" else b""))
    q.put("started")
    q.close()
    q.join_thread()  # flushed before the process dies
    if how == "die":
        os._exit(1)  # no cleanup: sockets (and the gloo pair) close with the process
    sender._ch.sock.close()  # hang up the control connection, stay alive
    time.sleep(30)


# -- helpers ------------------------------------------------------------------------------------------
def random_jobs(rng: random.Random, prefix: str, count: int, free: list[int]) -> list:
    jobs = []
    for i in range(count):
        n = rng.randint(1, 6)
        src = rng.sample(range(PREFILL_BLOCKS), n)
        dst = [free.pop() for _ in range(n)]
        jobs.append((f"{prefix}-{i}", src, dst))
    return jobs


def collect(q: Any, n: int, procs: list, timeout: float = 90.0) -> dict:
    """n (request_id, error) outcomes from the prefill processes; fails fast if they all died."""
    out: dict[str, str | None] = {}
    deadline = time.monotonic() + timeout
    while len(out) < n:
        try:
            rid, err = q.get(timeout=1.0)
            out[rid] = err
        except queue.Empty:
            assert any(p.is_alive() for p in procs), f"prefill processes died; outcomes so far {out}"
            assert time.monotonic() < deadline, f"timed out; outcomes so far {out}"
    return out


@pytest.fixture(params=CPU_TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


# -- transfers between processes ----------------------------------------------------------------------
def test_concurrent_transfers_are_exact(transport: str) -> None:
    """2 prefill processes x 2 threads x 4 requests into one decode pool: dst blocks equal src, rest untouched."""
    check_concurrent_transfers(transport)


def test_nccl_in_layer_chunks_is_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """nccl moves large transfers in layer chunks, one send/recv each (kvtransfer.nccl.layer_chunks); chunking
    every transfer here (3 layers: 3 chunks) checks both sides agree on the pieces and their offsets."""
    from kvtransfer.nccl import layer_chunks

    monkeypatch.setenv("PDSERVE_KV_CHUNK_MIN_BYTES", "0")  # the spawned prefill processes inherit it
    assert layer_chunks(LAYERS, 1) == [(0, 1), (1, 2), (2, 3)]
    check_concurrent_transfers("nccl")


def test_layer_chunks_cover_the_layers_once() -> None:
    from kvtransfer.nccl import CHUNK_MIN_BYTES, layer_chunks

    assert layer_chunks(32, CHUNK_MIN_BYTES - 1) == [(0, 32)]
    assert layer_chunks(32, CHUNK_MIN_BYTES) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    for layers in (1, 2, 3, 5, 7, 80):
        chunks = layer_chunks(layers, CHUNK_MIN_BYTES)
        assert [lo for lo, _ in chunks] == [0] + [hi for _, hi in chunks[:-1]] and chunks[-1][1] == layers


def check_concurrent_transfers(transport: str, dtype: torch.dtype = torch.float32) -> None:
    pool = make_pool(DECODE_BLOCKS, 100, dtype)
    before = pool.clone()
    rng = random.Random(7)
    free = rng.sample(range(DECODE_BLOCKS), DECODE_BLOCKS)
    plans = {seed: random_jobs(rng, f"p{seed}", 4, free) for seed in (1, 2)}
    q = SPAWN.Queue()
    with create_receiver(transport, pool) as receiver:
        for jobs in plans.values():
            for rid, _, dst in jobs:
                receiver.expect(rid, dst)
        procs = [
            SPAWN.Process(target=prefill_main, args=(receiver.descriptor(), s, j, q, 2, dtype))
            for s, j in plans.items()
        ]
        for p in procs:
            p.start()
        outcomes = collect(q, sum(len(j) for j in plans.values()), procs)
        for jobs in plans.values():
            for rid, _, _ in jobs:
                receiver.wait(rid, timeout=5)  # send() returned: the receiver already knows
        for p in procs:
            p.join(30)
    assert all(err is None for err in outcomes.values()), outcomes
    written = torch.zeros(DECODE_BLOCKS, dtype=torch.bool)
    pool, before = _bits(pool), _bits(before)
    for seed, jobs in plans.items():
        source = _bits(make_pool(PREFILL_BLOCKS, seed, dtype))
        for _, src, dst in jobs:
            assert torch.equal(pool[:, :, dst], source[:, :, src])
            written[dst] = True
    assert torch.equal(pool[:, :, ~written], before[:, :, ~written])


def _bits(pool: torch.Tensor) -> torch.Tensor:
    """The pool's bytes as integers of its element size (fp8 has no torch.equal on the CPU)."""
    return pool.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[pool.element_size()])


def test_fp8_blocks_travel_unchanged(transport: str) -> None:
    """An fp8 KV cache's blocks (half a bf16 block's bytes) move bit for bit, as any dtype's."""
    check_concurrent_transfers(transport, torch.float8_e4m3fn)


def test_an_fp8_pool_and_a_bf16_pool_refuse_each_other() -> None:
    with (
        create_receiver("tcp", make_pool(DECODE_BLOCKS, 2, torch.bfloat16)) as receiver,
        pytest.raises(KVTransferError, match="layouts differ.*same --kv-cache-dtype"),
    ):
        connect(receiver.descriptor(), make_pool(PREFILL_BLOCKS, 1, torch.float8_e4m3fn))


@pytest.mark.parametrize("how", ["die", "hang_up"])
def test_broken_sender_fails_the_request(transport: str, how: str) -> None:
    """A sender that dies or hangs up mid-transfer makes wait() raise within seconds, never succeed."""
    pool = make_pool(DECODE_BLOCKS, 100)
    q = SPAWN.Queue()
    done: list = []
    with create_receiver(transport, pool, on_done=lambda rid, err: done.append((rid, err))) as receiver:
        receiver.expect("doomed", list(range(10, 18)))
        proc = SPAWN.Process(target=dying_prefill_main, args=(receiver.descriptor(), how, q))
        proc.start()
        assert q.get(timeout=60) == "started"
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match="doomed"):
            receiver.wait("doomed", timeout=20)
        assert time.monotonic() - t0 < 5
        proc.kill()
        proc.join()
    assert len(done) == 1 and done[0][0] == "doomed" and isinstance(done[0][1], KVTransferError)


def test_refusals_keep_the_pool_and_connection(transport: str) -> None:
    """Unannounced, cancelled, or mismatched requests are refused; the pool is untouched; later sends work."""
    pool = make_pool(DECODE_BLOCKS, 100)
    before = pool.clone()
    with create_receiver(transport, pool) as receiver:
        receiver.expect("wrong-dst", [1, 2])
        receiver.expect("cancelled", [3])
        receiver.cancel("cancelled")
        receiver.expect("good", [5, 9])
        jobs = [
            ("unknown", [0], [4]),
            ("wrong-dst", [0, 1], [2, 1]),
            ("cancelled", [0], [3]),
            ("good", [7, 8], [5, 9]),
        ]
        q = SPAWN.Queue()
        proc = SPAWN.Process(target=prefill_main, args=(receiver.descriptor(), 4, jobs, q, 1))
        proc.start()
        outcomes = collect(q, len(jobs), [proc])
        proc.join(30)
        receiver.wait("good", timeout=10)
        with pytest.raises(KVTransferError, match="timed out"):
            receiver.wait("wrong-dst", timeout=0.2)
    assert "does not expect" in outcomes["unknown"]
    assert "differ" in outcomes["wrong-dst"]
    assert "does not expect" in outcomes["cancelled"]
    assert outcomes["good"] is None
    assert torch.equal(pool[:, :, [5, 9]], make_pool(PREFILL_BLOCKS, 4)[:, :, [7, 8]])
    untouched = [b for b in range(DECODE_BLOCKS) if b not in (5, 9)]
    assert torch.equal(pool[:, :, untouched], before[:, :, untouched])


# -- the receiver's contract, in one process ----------------------------------------------------------
def test_receiver_contract_in_process() -> None:
    pool = make_pool(DECODE_BLOCKS, 100, torch.bfloat16)  # bf16 travels as bytes too
    src_pool = make_pool(PREFILL_BLOCKS, 5, torch.bfloat16)
    with create_receiver("tcp", pool) as receiver, connect(receiver.descriptor(), src_pool) as sender:
        with pytest.raises(KVTransferError, match="never expected"):
            receiver.wait("nobody", timeout=0.1)
        with pytest.raises(KVTransferError, match="out of range"):
            receiver.expect("r", [DECODE_BLOCKS])
        receiver.expect("r", [3, 4, 5])
        with pytest.raises(KVTransferError, match="already expected"):
            receiver.expect("r", [6])
        with pytest.raises(KVTransferError, match="3 source blocks but 2"):
            sender.send("r", [0, 1, 2], [3, 4])
        sender.send("r", [10, 11, 12], [3, 4, 5])
        receiver.wait("r", timeout=5)
        assert torch.equal(pool[:, :, 3:6], src_pool[:, :, 10:13])
        with pytest.raises(KVTransferError, match="refused"):
            sender.send("r", [10, 11, 12], [3, 4, 5])  # forgotten after wait: a repeat is refused
        receiver.expect("empty", [])
        sender.send("empty", [], [])
        receiver.wait("empty", timeout=5)
        receiver.expect("pending", [7])
    with pytest.raises(KVTransferError, match="closed"):
        receiver.wait("pending", timeout=1)


def test_bad_descriptors_raise_clear_errors() -> None:
    pool = make_pool(8, 0)
    with pytest.raises(KVTransferError, match="unknown transport 'pigeon'"):
        connect({"transport": "pigeon"}, pool)
    with pytest.raises(KVTransferError, match="must be a dict"):
        connect("tcp://x", pool)  # type: ignore[arg-type]
    with pytest.raises(KVTransferError, match="lacks field 'layout'"):
        connect({"transport": "tcp", "host": "127.0.0.1", "port": 1}, pool)
    good_layout = PoolLayout.of(make_pool(16, 0)).to_dict()
    with pytest.raises(KVTransferError, match="'port' must be int"):
        connect({"transport": "tcp", "host": "127.0.0.1", "port": "1", "layout": good_layout}, pool)
    with pytest.raises(KVTransferError, match="layouts differ"):
        connect(
            {"transport": "tcp", "host": "127.0.0.1", "port": 1, "layout": {**good_layout, "head_dim": 64}},
            pool,
        )
    with pytest.raises(KVTransferError, match="cannot connect"):
        connect({"transport": "tcp", "host": "127.0.0.1", "port": 1, "layout": good_layout}, pool, timeout=2)
    with pytest.raises(KVTransferError, match="needs the prefill pool on CUDA"):
        nccl = {"transport": "nccl", "backend": "nccl", "host": "127.0.0.1", "port": 1, "store_port": 2}
        connect({**nccl, "layout": good_layout}, pool)
    with pytest.raises(KVTransferError, match="CUDA"):
        create_receiver("cuda_ipc", pool)
    with pytest.raises(KVTransferError, match="unknown kv transport"):
        create_receiver("carrier", pool)
    with pytest.raises(KVTransferError, match=r"\(num_layers, 2, "):
        create_receiver("tcp", torch.zeros(2, 3, 4))


def test_cuda_ipc_handle_round_trips_through_json() -> None:
    """The descriptor's IPC handle is plain JSON (no pickle) and rebuilds the same arguments."""
    args = (
        torch.Tensor,
        torch.Size([2, 2, 8, 4, 2, 8]),
        (1024, 512, 64, 16, 8, 1),
        0,
        torch.UntypedStorage,
        torch.bfloat16,
        0,
        b"\x00\xffhandle",
        4096,
        512,
        False,
        b"/torch_123",
        7,
        b"\x01event",
        True,
    )
    ipc = json.loads(json.dumps(encode_ipc_args(args)))
    back = decode_ipc_args(ipc, device_index=3)
    assert back[:6] == (
        torch.Tensor,
        (2, 2, 8, 4, 2, 8),
        (1024, 512, 64, 16, 8, 1),
        0,
        torch.UntypedStorage,
        torch.bfloat16,
    )
    assert back[6:] == (3, b"\x00\xffhandle", 4096, 512, False, b"/torch_123", 7, b"\x01event", True)
    with pytest.raises(KVTransferError, match="bad 'ipc'"):
        decode_ipc_args({"size": [1]}, 0)


@pytest.mark.parametrize(
    "src,dst",
    [
        ([0, 1, 2, 3], [9, 3, 15, 4]),  # one source run -> scattered
        ([5, 1, 9, 2], [10, 11, 12, 13]),  # scattered -> one destination run
        ([4, 5, 6], [20, 21, 22]),  # both runs: one slice copy
        (list(range(30)), random.Random(1).sample(range(64), 30)),  # many runs: gather + scatter
    ],
)
@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "triton"])  # triton: the CUDA path
def test_copy_blocks_matches_indexing(src: list[int], dst: list[int], kernel: bool) -> None:
    source, target = make_pool(PREFILL_BLOCKS, 1), make_pool(DECODE_BLOCKS, 2)
    expected = target.clone()
    expected[:, :, dst] = source[:, :, src]
    copy_blocks(source, src, target, dst, kernel=kernel)
    assert torch.equal(target, expected)


def test_runs() -> None:
    assert runs([3, 4, 5, 9, 1, 2]) == [(0, 3, 3), (3, 9, 1), (4, 1, 2)]
    assert runs([]) == []


def test_packed_ids_round_trip_and_refuse_garbage() -> None:
    ids = [0, 1, 17, 2**31 - 1, 123456]
    assert unpack_ids(pack_ids(ids)) == ids
    assert unpack_ids(pack_ids([])) == []
    for bad in (None, 7, [1, 2], "not base64!", "AAA=", "AAAAAAA="):  # the last two: 2 and 5 bytes
        assert unpack_ids(bad) is None, bad


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_receiver_refuses_a_mismatched_pool_at_hello(transport: str) -> None:
    """A descriptor that lies about the receiver's pool gets past the sender's own check; the receiver
    still refuses at HELLO, with its reason, and serves on."""
    with create_receiver(transport, make_pool(DECODE_BLOCKS, 2)) as receiver:
        other = torch.zeros(LAYERS, 2, 4, BLOCK, HEADS, 2 * DIM)
        lying = {**receiver.descriptor(), "layout": PoolLayout.of(other).to_dict()}
        with pytest.raises(KVTransferError, match="refused the connection: kv pool layouts differ"):
            connect(lying, other)
        connect(receiver.descriptor(), make_pool(PREFILL_BLOCKS, 1)).close()


def test_nccl_receiver_refuses_a_bad_pair_id() -> None:
    with create_receiver("nccl", make_pool(DECODE_BLOCKS, 2)) as receiver:
        d = receiver.descriptor()
        ch = Channel.connect(d["host"], d["port"], 5)
        ch.expect(Kind.CHALLENGE)
        ch.send(Kind.HELLO, {"layout": d["layout"], "pair_id": "../escape"})
        assert "bad pair id" in ch.expect(Kind.WELCOME)["error"]
        ch.close()
