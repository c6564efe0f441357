"""The prefill worker's engine-side core, driven directly (no gRPC, no engine process): a prompt that
starts before the decode worker's grant is computed, its first token goes out mid-step, its blocks are
held until the grant comes (or the request ends), and then they are sent exactly."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.sampling_params import SamplingParams
from kvtransfer import create_receiver
from prefill_worker.core import PrefillCore
from serving.messages.from_engine import Error, FirstToken, FromEngine, KVEvents, KVSent
from serving.messages.to_engine import Abort, Grant, PrefillPrompt, ToEngine
from tests.hf_reference import tiny_worker_config

PROMPT = list(range(10, 50))  # 40 tokens: 3 blocks of 16


@pytest.fixture
def setup(tmp_path: Path):
    core = PrefillCore(tiny_worker_config(tmp_path, "prefill-test", kv_timeout_s=30.0))
    sent_now: list[FromEngine] = []
    core.bind(sent_now.extend)
    decode_pool = torch.zeros_like(core.engine.runner.kv_cache)
    receiver = create_receiver("tcp", decode_pool)
    yield core, sent_now, receiver, decode_pool
    receiver.close()
    for sender in core.senders.values():
        sender.close()


def run_until_idle(core: PrefillCore) -> list[FromEngine]:
    out: list[FromEngine] = []
    for _ in range(10):
        out += core.step()
        if not core.has_work():
            break
    return [m for m in out if not isinstance(m, KVEvents)]


def kinds(out: list[FromEngine]) -> list[tuple[str, str]]:
    return [(type(m).__name__, getattr(m, "request_id", "")) for m in out]


def error(out: list[FromEngine], rid: str, code: str) -> str:
    """The details of `out`, which must be exactly one Error of `rid` with `code`."""
    assert kinds(out) == [("Error", rid)]
    assert isinstance(out[0], Error) and out[0].code == code
    return out[0].details


def prefill(rid: str, prompt, params: SamplingParams, descriptor: str, dst=()) -> PrefillPrompt:
    return PrefillPrompt(rid, np.asarray(prompt, dtype=np.int64), params, None, descriptor, tuple(dst))


def start(core: PrefillCore, receiver, rid: str, dst: list[int]) -> None:
    params = SamplingParams(temperature=0, max_tokens=8)
    core.handle(prefill(rid, PROMPT, params, json.dumps(receiver.descriptor()), dst))


def test_grant_after_the_forward_pass_sends_the_held_blocks(setup) -> None:
    core, sent_now, receiver, decode_pool = setup
    free_before = core.blocks.num_free_blocks
    start(core, receiver, "r1", [])  # no reservation yet: the prefill starts anyway
    out = run_until_idle(core)
    assert out == []  # nothing to report until the blocks are sent
    assert kinds(sent_now) == [("FirstToken", "r1")]  # the first token left mid-step
    assert isinstance(sent_now[0], FirstToken) and sent_now[0].num_cached_tokens == 0
    held = core.jobs["r1"].parked
    assert held is not None and len(held) == 3
    assert all(core.blocks.blocks[b].ref_count == 1 for b in held)  # the finished sequence let go, we hold

    dst = [7, 3, 11]
    receiver.expect("r1", dst)
    core.handle(Grant("r1", tuple(dst)))
    out = run_until_idle(core)
    assert out == [KVSent("r1")] and len(sent_now) == 1  # the first token went out once
    receiver.wait("r1", timeout=10)  # every byte arrived
    source = core.engine.runner.kv_cache
    assert torch.equal(decode_pool[:, :, dst], source[:, :, held])
    assert "r1" not in core.jobs
    assert core.blocks.num_free_blocks == free_before  # held blocks back (as prefix cache)


def test_grant_before_the_forward_pass_sends_at_once(setup) -> None:
    core, sent_now, receiver, decode_pool = setup
    start(core, receiver, "r2", [])
    receiver.expect("r2", [5, 6, 9])
    core.handle(Grant("r2", (5, 6, 9)))
    out = run_until_idle(core)
    assert out == [KVSent("r2")]
    receiver.wait("r2", timeout=10)
    assert not any(b.ref_count for b in core.blocks.blocks)


def test_bad_grant_fails_the_request_and_frees_its_blocks(setup) -> None:
    core, _, receiver, _ = setup
    start(core, receiver, "r3", [])
    run_until_idle(core)
    core.handle(Grant("r3", (1, 2)))  # the prompt needs 3 blocks
    out = run_until_idle(core)
    assert "needs 3" in error(out, "r3", "UNAVAILABLE")
    assert not any(b.ref_count for b in core.blocks.blocks)


def test_abort_while_waiting_for_the_grant_releases_the_blocks(setup) -> None:
    core, _, receiver, _ = setup
    start(core, receiver, "r4", [])
    run_until_idle(core)
    assert core.jobs["r4"].parked
    core.handle(Abort("r4"))
    assert "r4" not in core.jobs
    assert not any(b.ref_count for b in core.blocks.blocks)
    core.handle(Grant("r4", (1, 2, 3)))  # a late grant for a forgotten request is ignored
    assert run_until_idle(core) == []


def test_a_grant_that_never_comes_times_out(setup) -> None:
    core, _, receiver, _ = setup
    core.config = dataclasses.replace(core.config, kv_timeout_s=0.0)
    start(core, receiver, "r5", [])
    out = run_until_idle(core)
    out += run_until_idle(core)
    assert "reserved no blocks" in error(out, "r5", "UNAVAILABLE")
    assert not any(b.ref_count for b in core.blocks.blocks)


@pytest.mark.parametrize("bad", [-1, 10**9])
def test_token_ids_outside_the_vocabulary_as_the_server_sends_them(setup, bad) -> None:
    """The server hands the prompt over as an int array (checked as one); a bad id is refused up front."""
    core, _, receiver, _ = setup
    prompt = np.array([*PROMPT[:-1], bad], dtype=np.int64)
    params = SamplingParams(temperature=0, max_tokens=8)
    core.handle(prefill("r6", prompt, params, json.dumps(receiver.descriptor())))
    details = error(core.step(), "r6", "INVALID_ARGUMENT")
    assert "vocabulary" in details and str(bad) in details
    assert "r6" not in core.jobs and not core.scheduler.has_unfinished()


@pytest.mark.parametrize("bad", ["not json", "[1, 2]", '"a string"'])
def test_a_kv_descriptor_that_is_not_a_json_object_is_invalid_argument(setup, bad) -> None:
    core, _, _, _ = setup
    free_before = core.blocks.num_free_blocks
    core.handle(prefill("bad-desc", PROMPT, SamplingParams(temperature=0), bad))
    error(run_until_idle(core), "bad-desc", "INVALID_ARGUMENT")
    assert "bad-desc" not in core.jobs and core.blocks.num_free_blocks == free_before


def test_requests_to_one_decode_worker_share_its_parsed_descriptor_and_sender(setup) -> None:
    """A decode worker sends the same descriptor JSON with every request: it is parsed once, and every
    transfer to that worker goes through one sender."""
    core, _, receiver, decode_pool = setup
    for i, dst in enumerate(([7, 8, 9], [10, 11, 12])):
        receiver.expect(f"s{i}", dst)
        start(core, receiver, f"s{i}", dst)
        run_until_idle(core)
        receiver.wait(f"s{i}", timeout=10)
    assert len(core._descriptors) == 1 and len(core.senders) == 1
    assert torch.count_nonzero(decode_pool[:, :, [7, 8, 9, 10, 11, 12]]) > 0


def test_a_grant_that_comes_while_the_forward_pass_runs_is_taken_then(setup) -> None:
    """The engine process hands the core grants that arrive mid-step (take_inbound): one for a request
    whose pass is running is handled before the pass ends, so its blocks go out from that step (not
    parked until the next); a grant for a request this core does not know yet stays in the loop's backlog."""
    core, sent_now, receiver, decode_pool = setup
    arrived: list[ToEngine] = [Grant("unknown", (1, 2, 3)), Grant("r7", (4, 8, 2))]
    left: list[ToEngine] = []
    calls: list[int] = []

    def take_inbound(wanted):
        # outside the forward pass's inference mode: a KV sender made here (its first grant) must not hold
        # inference tensors, which the copy then updates outside that mode (found on the GPU: cuda_ipc)
        assert not torch.is_inference_mode_enabled()
        calls.append(len(arrived))
        taken = [m for m in arrived if wanted(m)]
        left.extend(m for m in arrived if not wanted(m))
        arrived.clear()
        return taken

    shipped: list[tuple] = []  # (source blocks, the job's destination blocks) when the pass ended
    ship = core._ship

    def recording_ship(sched, sampled):
        shipped.extend(
            (list(it.block_table), core.jobs[it.request_id].dst_block_ids) for it in sched.scheduled
        )
        ship(sched, sampled)

    core._ship = recording_ship  # type: ignore[method-assign]
    core.bind(sent_now.extend, take_inbound)
    start(core, receiver, "r7", [])  # no reservation when the prompt starts
    receiver.expect("r7", [4, 8, 2])
    out = core.step()  # the grant "arrives" during this step's forward pass
    assert calls == [2]
    assert left == [Grant("unknown", (1, 2, 3))]
    assert len(shipped) == 1 and shipped[0][1] == [4, 8, 2]  # known when the pass ended
    assert [m for m in out if not isinstance(m, KVEvents)] == [KVSent("r7")]
    assert "r7" not in core.jobs  # sent from the step itself: never parked
    receiver.wait("r7", timeout=10)
    assert torch.equal(decode_pool[:, :, [4, 8, 2]], core.engine.runner.kv_cache[:, :, shipped[0][0]])


@pytest.mark.parametrize("queues_copy", [False, True])
def test_a_sender_that_queues_its_copy_ships_before_the_tokens_are_read(
    setup, monkeypatch, queues_copy
) -> None:
    """A prompt whose grant is in hand when its last step runs: with a sender that only queues its copy
    (cuda_ipc), the copy is queued while the GPU computes the step, before the host reads the sampled
    token (the first token then still goes out, and the blocks are exact); any other sender sends once
    the token is back."""
    from kvtransfer.tcp import TcpKVSender

    monkeypatch.setattr(TcpKVSender, "queues_copy", queues_copy)
    core, sent_now, receiver, decode_pool = setup
    order: list[str] = []
    sources: list[list[int]] = []
    send, read = core._send, core.engine.runner.sampler.__class__._logprobs

    def recording_send(rid, job, src, dst):
        order.append("send")
        sources.append(list(src))
        send(rid, job, src, dst)

    def recording_read(*args):  # the sampler's host side, after the step's results came back
        order.append("read")
        return read(*args)

    core._send = recording_send  # type: ignore[method-assign]
    monkeypatch.setattr(type(core.engine.runner.sampler), "_logprobs", staticmethod(recording_read))
    dst = [9, 4, 13]
    receiver.expect("q", dst)
    start(core, receiver, "q", dst)
    out = run_until_idle(core)
    assert order == (["send", "read"] if queues_copy else ["read", "send"])
    assert kinds(sent_now) == [("FirstToken", "q")]
    assert out == [KVSent("q")]
    receiver.wait("q", timeout=10)
    assert torch.equal(decode_pool[:, :, dst], core.engine.runner.kv_cache[:, :, sources[0]])
    assert torch.count_nonzero(decode_pool[:, :, dst]) > 0 and not core.jobs


def test_without_a_mid_step_sender_the_first_token_leaves_with_the_step(tmp_path: Path) -> None:
    """A core that no engine process bound: its FirstToken goes out with the step's messages, still before
    KVSent, and once."""
    core = PrefillCore(tiny_worker_config(tmp_path, "prefill-unbound"))
    receiver = create_receiver("tcp", torch.zeros_like(core.engine.runner.kv_cache))
    try:
        dst = [2, 5, 8]
        receiver.expect("u", dst)
        start(core, receiver, "u", dst)
        out = run_until_idle(core)
        assert kinds(out) == [("FirstToken", "u"), ("KVSent", "u")]
        receiver.wait("u", timeout=10)
    finally:
        receiver.close()
        for sender in core.senders.values():
            sender.close()


def test_transfers_are_counted_in_bytes_and_timed(setup) -> None:
    core, _, receiver, _ = setup
    start(core, receiver, "r9", [])
    receiver.expect("r9", [5, 6, 9])
    core.handle(Grant("r9", (5, 6, 9)))
    assert run_until_idle(core) == [KVSent("r9")]
    pool = core.engine.runner.kv_cache  # (num_layers, 2, num_blocks, ...)
    block_bytes = pool[:, :, 0].numel() * pool.element_size()
    assert core.counters()["kv_transfer_bytes/tcp"] == 3 * block_bytes
    assert core.counters()["kv_transfer_failures/tcp"] == 0
    _, counts, seconds, n = core.histograms()["kv_transfer_seconds/tcp"]
    assert n == 1 == sum(counts) and 0 < seconds < 10
    assert core.histograms()["request_prefill_time_seconds"][3] == 1  # the engine's own, beside them


def test_a_transfer_to_a_receiver_gone_is_counted_as_failed(setup) -> None:
    core, _, receiver, _ = setup
    descriptor = json.dumps(receiver.descriptor())
    receiver.close()
    core.handle(prefill("r10", PROMPT, SamplingParams(temperature=0, max_tokens=8), descriptor, [5, 6, 9]))
    out = run_until_idle(core)
    assert "KV transfer" in error(out, "r10", "UNAVAILABLE")
    assert core.counters()["kv_transfer_failures/tcp"] == 1
    assert (
        core.counters()["kv_transfer_bytes/tcp"] == 0 and "kv_transfer_seconds/tcp" not in core.histograms()
    )


def test_a_prompt_is_queued_with_the_request_priority(setup) -> None:
    core, _, receiver, _ = setup
    params = SamplingParams(temperature=0, max_tokens=8)
    msg = PrefillPrompt(
        "urgent", np.asarray(PROMPT, dtype=np.int64), params, None, json.dumps(receiver.descriptor()), (), -4
    )
    core.handle(msg)
    assert core.scheduler.seqs["urgent"].priority == -4  # the prefill queue orders by it (priority policy)
    core.handle(Abort("urgent"))
    run_until_idle(core)
    assert not any(b.ref_count for b in core.blocks.blocks)
