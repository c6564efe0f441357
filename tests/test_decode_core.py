"""The decode worker's engine-side core, driven directly (no gRPC, no engine process): what leaves its
outbox, and when, for a prompt prefilled elsewhere."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from decode_worker.core import DecodeCore
from engine.sampling_params import SamplingParams
from kvtransfer import connect
from kvtransfer.registry import State
from kvtransfer.wire import _FRAME, MAGIC, VERSION, Channel, Kind
from serving.messages.from_engine import BlocksReserved, Error, FromEngine, Landed, Tokens
from serving.messages.to_engine import Abort, Admit, KVArrived
from tests.hf_reference import tiny_worker_config


def make_core(tmp_path: Path, overlapped: bool) -> DecodeCore:
    config = tiny_worker_config(tmp_path, "decode-test")
    engine = dataclasses.replace(config.engine, async_scheduling=overlapped)
    return DecodeCore(dataclasses.replace(config, engine=engine))


@pytest.fixture
def core(tmp_path: Path):
    """These tests pin down which call each message leaves in: the in-order step (the overlapped one
    emits a step's tokens one call later, tested below)."""
    core = make_core(tmp_path, overlapped=False)
    yield core
    core.receiver.close()


def kinds(out: list[FromEngine]) -> list[tuple[str, str]]:
    return [(type(m).__name__, getattr(m, "request_id", "")) for m in out]


def admit(rid: str, prompt, params: SamplingParams) -> Admit:
    return Admit(rid, np.asarray(prompt, dtype=np.int64), params, prefill_remotely=True)


def reserved(out: list[FromEngine]) -> BlocksReserved:
    assert isinstance(out[0], BlocksReserved)
    return out[0]


def prefill_elsewhere(core: DecodeCore, grant: BlocksReserved, first_token: int) -> None:
    """What the prefill worker does for the granted request: write its blocks (any bytes will do here),
    showing the grant's token, then answer."""
    pool = torch.zeros_like(core.engine.runner.kv_cache)
    rid, dst = grant.request_id, list(grant.block_ids)
    with connect(core.receiver.descriptor(), pool) as sender:
        sender.send(rid, list(range(len(dst))), dst, grant.kv_token)
    core.handle(KVArrived(rid, first_token, None, 0))


def test_first_token_and_prefill_requests_leave_before_a_forward_pass(core: DecodeCore) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    core.handle(admit("r1", range(10, 30), params))
    out = core.step()
    assert kinds(out) == [("BlocksReserved", "r1")]  # the blocks are reserved and announced, no forward pass
    prefill_elsewhere(core, reserved(out), first_token=42)

    out = core.step()  # the first token joins at once, not after the next decode step; it did not end r1
    assert out == [Landed("r1", None, None)]
    assert core.scheduler.seqs["r1"].output_token_ids == [42]

    core.handle(admit("r2", range(40, 60), params))
    out = core.step()  # just flushed: this step runs the batch; r2's announcement rides along
    assert kinds(out) == [("BlocksReserved", "r2"), ("Tokens", "r1")]
    assert len(core.scheduler.seqs["r1"].output_token_ids) == 2
    assert isinstance(out[1], Tokens) and out[1].token_ids == (core.scheduler.seqs["r1"].output_token_ids[1],)

    out = core.step()  # nothing waiting to go out: a plain decode step
    assert kinds(out) == [("Tokens", "r1")]


def test_a_first_token_that_ends_the_request_lands_finished(core: DecodeCore) -> None:
    """max_tokens=1: the prefill worker's token is the whole completion. Landed carries the finish (the
    server has streamed the token itself), and the blocks are freed at once."""
    free = core.blocks.num_free_blocks
    core.handle(admit("r3", range(10, 30), SamplingParams(temperature=0, max_tokens=1)))
    prefill_elsewhere(core, reserved(core.step()), first_token=42)
    assert core.step() == [Landed("r3", "length", None)]
    assert "r3" not in core.scheduler.seqs and core.blocks.num_free_blocks == free
    assert not core.has_work()
    # its 20 prompt tokens came in 2 blocks; it was served (one first token) and ended there
    assert core.counters()["kv_transfer_bytes/tcp"] == 2 * core.receiver.layout.block_nbytes
    latencies = core.histograms()
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert latencies[name][3] == 1, name
    assert latencies["inter_token_latency_seconds"][3] == 0  # one token: no gap
    assert latencies["request_time_per_output_token_seconds"][3] == 0


@pytest.mark.parametrize("bad", [-1, 10**9])
def test_token_ids_outside_the_vocabulary_as_the_server_sends_them(core: DecodeCore, bad: int) -> None:
    """The server hands the prompt over as an int array (checked as one); a bad id is refused and
    nothing is reserved."""
    free = core.blocks.num_free_blocks
    prompt = np.array([10, 11, bad, 12], dtype=np.int64)
    core.handle(Admit("r9", prompt, SamplingParams(max_tokens=4), prefill_remotely=True))
    out = core.step()
    assert kinds(out) == [("Error", "r9")]
    assert isinstance(out[0], Error) and out[0].code == "INVALID_ARGUMENT"
    assert "vocabulary" in out[0].details and str(bad) in out[0].details
    assert core.blocks.num_free_blocks == free and not core.pending


def test_abort_while_its_kv_is_written_holds_the_blocks_until_the_write_stopped(core: DecodeCore) -> None:
    """A request aborted while a prefill worker is writing its blocks: the engine loop does not wait for
    the transfer to stop (cancel without waiting); the blocks stay reserved until the receiver says
    nothing writes them, and the next step frees them."""
    free = core.blocks.num_free_blocks
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    core.handle(admit("r5", range(10, 30), params))
    out = core.step()
    assert kinds(out) == [("BlocksReserved", "r5")]
    grant = reserved(out)
    dst = list(grant.block_ids)
    # a prefill worker announces the payload and stalls in the middle of it (a real tcp connection)
    ch = Channel.greet(
        "127.0.0.1", core.receiver.descriptor()["port"], 5, 5, {"layout": core.receiver.layout.to_dict()}
    )
    nbytes = len(dst) * core.receiver.layout.block_nbytes
    meta = json.dumps({"request_id": "r5", "dst": dst, "token": grant.kv_token}).encode()
    ch.sock.sendall(_FRAME.pack(MAGIC, VERSION, Kind.BEGIN, len(meta), nbytes) + meta + b"\0" * 64)
    deadline = time.monotonic() + 5
    while core.receiver._entries["r5"].state != State.IN_FLIGHT:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the transfer never began"
        time.sleep(0.005)

    t0 = time.monotonic()
    core.handle(Abort("r5"))
    assert time.monotonic() - t0 < 0.5
    assert "r5" in core.draining and core.blocks.num_free_blocks == free - len(dst)
    deadline = time.monotonic() + 5
    while not core.has_work():  # the receiver cut the write off; its id comes out of drained()
        assert time.monotonic() < deadline, "the cancelled transfer never drained"
        time.sleep(0.005)
    core.step()
    assert not core.draining and core.blocks.num_free_blocks == free
    ch.close()


def test_kv_done_before_every_byte_landed_never_blocks_the_loop(core: DecodeCore) -> None:
    """The prefill worker's kv_done can reach the decode engine before its receiver has the last byte
    (a copy still landing): the loop goes on, and the request joins the batch in the step after the
    bytes are in."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    core.handle(admit("r6", range(10, 30), params))
    grant = reserved(core.step())
    dst = list(grant.block_ids)
    hello = {"layout": core.receiver.layout.to_dict()}
    ch = Channel.greet("127.0.0.1", core.receiver.descriptor()["port"], 5, 5, hello)
    nbytes = len(dst) * core.receiver.layout.block_nbytes
    meta = json.dumps({"request_id": "r6", "dst": dst, "token": grant.kv_token}).encode()
    ch.sock.sendall(_FRAME.pack(MAGIC, VERSION, Kind.BEGIN, len(meta), nbytes) + meta + b"\0" * 64)

    t0 = time.monotonic()
    core.handle(KVArrived("r6", 42, None, 0))
    assert time.monotonic() - t0 < 0.5 and "r6" in core.landing and core.has_work()
    assert kinds(core.step()) == []  # still landing: nothing for r6 yet, and the step did not wait
    ch.sock.sendall(b"\0" * (nbytes - 64))
    deadline = time.monotonic() + 5
    out: list[FromEngine] = []
    while not out:
        assert time.monotonic() < deadline, "the request never joined the batch"
        out = core.step()
    assert out == [Landed("r6", None, None)]
    assert core.scheduler.seqs["r6"].output_token_ids == [42]
    assert "r6" not in core.landing
    ch.close()


def take(core: DecodeCore, out: list[FromEngine], tokens: dict[str, list[int]]) -> None:
    """Collect the step's tokens; a request whose blocks were just reserved is prefilled elsewhere now."""
    for m in out:
        if isinstance(m, Tokens):
            tokens[m.request_id] += list(m.token_ids)
        if isinstance(m, BlocksReserved):
            prefill_elsewhere(core, m, first_token=42 + int(m.request_id[1:]))


def test_overlapped_steps_stream_the_in_order_tokens_and_hold_frees_until_their_step_is_done(
    tmp_path: Path,
) -> None:
    """Overlapped steps (the default): the same tokens as the in-order core, a request aborted while its
    step is in flight frees its blocks only once that step is done, and nothing stays held at the end."""
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (12, 20, 7)]
    streams = []
    for overlapped in (False, True):
        core = make_core(tmp_path / str(overlapped), overlapped)
        tokens: dict[str, list[int]] = {f"r{i}": [42 + i] for i in range(len(params))}

        for i, p in enumerate(params):
            core.handle(admit(f"r{i}", range(10 + i, 30 + 3 * i), p))
            take(core, core.step(), tokens)
        held_while_in_flight = None
        for _ in range(400):
            if not core.has_work():
                break
            take(core, core.step(), tokens)
            if overlapped and held_while_in_flight is None and len(tokens["r1"]) > 5:
                assert core.engine.in_flight
                free_before = core.blocks.num_free_blocks
                core.handle(Abort("r1"))
                held_while_in_flight = core.blocks.num_free_blocks == free_before
        streams.append(tokens)
        assert core.blocks.num_free_blocks == core.blocks.num_blocks
        core.receiver.close()
        if overlapped:
            assert held_while_in_flight  # r1's blocks waited for the step that was still writing them
    in_order, overlapped_tokens = streams
    assert overlapped_tokens["r0"] == in_order["r0"] and overlapped_tokens["r2"] == in_order["r2"]
    assert len(in_order["r0"]) == 12 and len(in_order["r2"]) == 7
    assert overlapped_tokens["r1"] == in_order["r1"][: len(overlapped_tokens["r1"])]
