"""kvtransfer.grants on the CPU: cuda_ipc's protocol (grants asked at admission, DONE, RELEASE, REVOKE)
over real sockets and threads, with the GPU parts stood in for: the sender writes the receiver's pool
tensor in this process, and the completion signal is the DONE's sequence number, checked as landed when
the sender's copy has run. tests/gpu/test_kvtransfer_gpu.py runs the same protocol with CUDA IPC between
processes."""

from __future__ import annotations

import random
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from kvtransfer import KVTransferError
from kvtransfer.base import Descriptor
from kvtransfer.grants import Completion, GrantReceiver, GrantSender
from kvtransfer.wire import Channel, Kind, pack_ids

LAYERS, BLOCK, HEADS, DIM = 2, 4, 2, 8
DECODE_BLOCKS, PREFILL_BLOCKS = 48, 32


def make_pool(num_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, num_blocks, BLOCK, HEADS, DIM, generator=g)


class Landings(Completion):
    """A copy has landed when the sender's `copied` count reached the DONE's sequence number."""

    def __init__(self, receiver: SharedReceiver) -> None:
        self.receiver = receiver
        self.welcome = {"slot": 0}

    def landed(self, done: dict[str, Any], ch: Channel) -> str | None:
        self.receiver.landed += 1
        seq = done.get("seq")
        if not isinstance(seq, int) or self.receiver.copied < seq:
            return f"the copy never landed (seq {seq!r}, copied {self.receiver.copied})"
        return None

    def close(self) -> None:
        self.receiver.connections_closed += 1


class SharedReceiver(GrantReceiver):
    """The receiver's side with the pool shared in-process; `landed` counts completion checks."""

    transport = "test"

    def __init__(self, pool: torch.Tensor, on_done: Any = None) -> None:
        super().__init__(pool, on_done=on_done)
        self.landed = self.copied = self.connections_closed = 0

    def descriptor(self) -> Descriptor:
        return {"transport": "test", "port": self._server.port, "layout": self.layout.to_dict()}

    def _open_completion(self, hello: dict[str, Any]) -> Completion:
        if hello.get("signal") != "counter":
            raise KVTransferError("no completion signal in HELLO")
        return Landings(self)


class SharedSender(GrantSender):
    """The sender's side: writes the receiver's pool tensor directly (a stand-in for the mapped pool)."""

    def __init__(
        self, receiver: SharedReceiver, pool: torch.Tensor, signal: str = "counter", lands: bool = True
    ) -> None:
        self.receiver, self.lands = receiver, lands
        self.launched: list[str] = []
        super().__init__(
            pool, receiver.layout, "127.0.0.1", receiver.descriptor()["port"], 5.0, {"signal": signal}
        )

    def _launch(self, request_id: str, src: np.ndarray, dst: np.ndarray, staged: Any) -> dict[str, Any]:
        self.launched.append(request_id)
        if self.lands:  # else: as a sender whose queued copy died with its process
            self.receiver.pool[:, :, dst] = self._pool[:, :, src]
            self.receiver.copied += 1
        return {"seq": len(self.launched)}


@pytest.fixture
def pair() -> Any:
    decode, prefill = make_pool(DECODE_BLOCKS, 1), make_pool(PREFILL_BLOCKS, 2)
    receiver = SharedReceiver(decode)
    sender = SharedSender(receiver, prefill)
    yield receiver, sender, decode.clone(), prefill
    sender.close()
    receiver.close()


def test_prepared_requests_land_exactly_in_any_order(pair: Any) -> None:
    """Grants asked for at admission, several open on one connection at once, sent in another order."""
    receiver, sender, before, prefill = pair
    rng = random.Random(0)
    dsts = rng.sample(range(DECODE_BLOCKS), 24)
    jobs = [(f"r{i}", rng.sample(range(PREFILL_BLOCKS), 6), dsts[6 * i : 6 * i + 6]) for i in range(4)]
    for rid, _, dst in jobs:
        receiver.expect(rid, dst)
    for rid, _, dst in jobs:
        sender.prepare(rid, dst)
    for rid, src, dst in reversed(jobs):
        sender.send(rid, src, dst)
    for rid, _, _ in jobs:
        receiver.wait(rid, timeout=5)
    assert receiver.landed == 4  # every completion waited for the sender's signal first
    written = torch.zeros(DECODE_BLOCKS, dtype=torch.bool)
    for _, src, dst in jobs:
        assert torch.equal(receiver.pool[:, :, dst], prefill[:, :, src])
        written[dst] = True
    assert torch.equal(receiver.pool[:, :, ~written], before[:, :, ~written])


def test_send_without_prepare_asks_for_the_grant_itself(pair: Any) -> None:
    receiver, sender, _, prefill = pair
    receiver.expect("plain", [5, 9, 3])
    sender.send("plain", [0, 1, 2], [5, 9, 3])
    receiver.wait("plain", timeout=5)
    assert torch.equal(receiver.pool[:, :, [5, 9, 3]], prefill[:, :, [0, 1, 2]])


def test_cancel_revokes_an_unused_grant_and_send_then_refuses(pair: Any) -> None:
    receiver, sender, before, _ = pair
    receiver.expect("gone", [1, 2])
    sender.prepare("gone", [1, 2])
    _wait_granted(sender, "gone")
    t0 = time.monotonic()
    receiver.cancel("gone")  # REVOKE -> RELEASE: after it returns nothing writes blocks 1, 2
    assert time.monotonic() - t0 < 2
    with pytest.raises(KVTransferError, match="cancelled"):
        sender.send("gone", [0, 1], [1, 2])
    assert sender.launched == []
    assert torch.equal(receiver.pool, before)
    receiver.expect("after", [1, 2])  # the blocks, given to another request, take its transfer
    sender.send("after", [3, 4], [1, 2])
    receiver.wait("after", timeout=5)


def _drained_within(receiver: SharedReceiver, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while not receiver.has_drained() and time.monotonic() < deadline:
        time.sleep(0.005)
    return receiver.drained()


def test_cancel_without_waiting_hands_the_blocks_back_through_drained(pair: Any) -> None:
    """cancel(wait=False) of a granted request returns False at once; once the sender has released
    the grant, drained() names the request (once), and the blocks were never written."""
    receiver, sender, before, _ = pair
    receiver.expect("quick", [5, 6])
    assert receiver.cancel("unknown", wait=False) and receiver.cancel("quick", wait=False)  # not granted
    receiver.expect("gone", [1, 2])
    sender.prepare("gone", [1, 2])
    _wait_granted(sender, "gone")
    assert receiver.cancel("gone", wait=False) is False
    assert _drained_within(receiver, 5) == ["gone"]
    assert receiver.drained() == [] and not receiver.has_drained()
    with pytest.raises(KVTransferError, match="cancelled"):
        sender.send("gone", [0, 1], [1, 2])
    assert sender.launched == [] and torch.equal(receiver.pool, before)


def test_cancel_without_waiting_never_waits_on_a_silent_sender() -> None:
    """A sender that holds a grant and ignores REVOKE (a wedged prefill worker): cancel(wait=False)
    still returns at once, the request stays undrained while that sender may write, and drains when
    its connection closes."""
    receiver = SharedReceiver(make_pool(DECODE_BLOCKS, 1))
    try:
        receiver.expect("held", [3])
        ch = Channel.greet("127.0.0.1", receiver.descriptor()["port"], 5, 5, _hello(receiver))
        nbytes = receiver.layout.block_nbytes
        ch.send(Kind.BEGIN, {"request_id": "held", "dst": pack_ids([3]), "nbytes": nbytes})
        assert ch.expect(Kind.READY) == {"request_id": "held"}
        t0 = time.monotonic()
        assert receiver.cancel("held", wait=False) is False
        assert time.monotonic() - t0 < 0.5
        assert ch.expect(Kind.REVOKE) == {"request_id": "held"}  # asked, never answered
        assert _drained_within(receiver, 0.3) == []
        ch.close()
        assert _drained_within(receiver, 5) == ["held"]
    finally:
        receiver.close()


def test_poll_is_a_wait_that_never_waits(pair: Any) -> None:
    receiver, sender, _, prefill = pair
    receiver.expect("p", [9, 10])
    assert receiver.poll("p") is False  # expected, nothing sent yet
    sender.send("p", [0, 1], [9, 10])
    deadline = time.monotonic() + 5
    while not receiver.poll("p"):  # True once: every byte is in, the request forgotten
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert torch.equal(receiver.pool[:, :, [9, 10]], prefill[:, :, [0, 1]])
    with pytest.raises(KVTransferError, match="never expected"):
        receiver.poll("p")
    receiver.expect("dropped", [11])
    sender.prepare("dropped", [11])
    sender.release("dropped")
    deadline = time.monotonic() + 5
    with pytest.raises(KVTransferError, match="released"):
        while not receiver.poll("dropped"):
            assert time.monotonic() < deadline
            time.sleep(0.005)


def test_released_grant_fails_the_request_and_writes_nothing(pair: Any) -> None:
    receiver, sender, before, _ = pair
    receiver.expect("dropped", [7, 8])
    sender.prepare("dropped", [7, 8])
    sender.release("dropped")
    sender.release("dropped")  # idempotent
    with pytest.raises(KVTransferError, match="released"):
        receiver.wait("dropped", timeout=5)
    assert torch.equal(receiver.pool, before)


def test_refused_grant_keeps_the_connection(pair: Any) -> None:
    receiver, sender, before, _ = pair
    sender.prepare("stranger", [4])  # never expected: READY carries the refusal
    with pytest.raises(KVTransferError, match="refused"):
        sender.send("stranger", [0], [4])
    receiver.expect("wrong-blocks", [10, 11])
    with pytest.raises(KVTransferError, match="differ from the ones the receiver reserved"):
        sender.send("wrong-blocks", [0, 1], [11, 10])
    assert torch.equal(receiver.pool, before)
    receiver.expect("fine", [12])
    sender.send("fine", [5], [12])
    receiver.wait("fine", timeout=5)


def test_send_to_other_blocks_than_prepared_is_refused(pair: Any) -> None:
    receiver, sender, before, _ = pair
    receiver.expect("moved", [20, 21])
    sender.prepare("moved", [20, 21])
    with pytest.raises(KVTransferError, match="differ from prepare"):
        sender.send("moved", [0, 1], [21, 22])
    with pytest.raises(KVTransferError, match="released"):  # and the grant went back
        receiver.wait("moved", timeout=5)
    assert torch.equal(receiver.pool, before)


def test_send_checks_every_id_before_anything_is_written(pair: Any) -> None:
    """send() takes its ids as numpy does (lists or arrays) and checks them before it launches; a prepared
    request's grant survives a refused call."""
    receiver, sender, before, prefill = pair
    receiver.expect("bad", [20, 21])
    sender.prepare("bad", [20, 21])
    for src, match in (
        ([0, -1], "source block id -1 out of range"),
        ([0, PREFILL_BLOCKS], f"source block id {PREFILL_BLOCKS} out of range"),
        ([[0, 1]], "flat sequence"),
        (["a", "b"], "not integers"),
        ([0], "1 source blocks but 2 destination blocks"),
    ):
        with pytest.raises(KVTransferError, match=match):
            sender.send("bad", src, [20, 21])
    with pytest.raises(KVTransferError, match="destination block ids repeat"):
        sender.send("unprepared", [0, 1], [7, 7])
    with pytest.raises(KVTransferError, match=f"destination block id {DECODE_BLOCKS} out of range"):
        sender.send("unprepared", [0, 1], [7, DECODE_BLOCKS])
    assert sender.launched == [] and torch.equal(receiver.pool, before)
    sender.send("bad", np.array([3, 4]), np.array([20, 21], dtype=np.int32))
    receiver.wait("bad", timeout=5)
    assert torch.equal(receiver.pool[:, :, [20, 21]], prefill[:, :, [3, 4]])


def test_closed_sender_fails_its_granted_requests() -> None:
    receiver = SharedReceiver(make_pool(DECODE_BLOCKS, 1))
    sender = SharedSender(receiver, make_pool(PREFILL_BLOCKS, 2))
    try:
        receiver.expect("orphan", [3])
        sender.prepare("orphan", [3])
        _wait_granted(sender, "orphan")
        sender.close()
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match="sender gone"):
            receiver.wait("orphan", timeout=10)
        assert time.monotonic() - t0 < 2
        with pytest.raises(KVTransferError, match="broken"):
            sender.prepare("late", [4])
    finally:
        receiver.close()


def test_done_without_a_grant_drops_the_connection() -> None:
    """A sender that claims a copy it was never granted is cut off; its granted requests fail."""
    receiver = SharedReceiver(make_pool(DECODE_BLOCKS, 1))
    try:
        receiver.expect("held", [2])
        ch = Channel.greet("127.0.0.1", receiver.descriptor()["port"], 5, 5, _hello(receiver))
        ch.send(
            Kind.BEGIN, {"request_id": "held", "dst": pack_ids([2]), "nbytes": receiver.layout.block_nbytes}
        )
        assert ch.expect(Kind.READY) == {"request_id": "held"}
        ch.send(Kind.DONE, {"request_id": "other", "nbytes": receiver.layout.block_nbytes})
        with pytest.raises(KVTransferError, match="without a grant"):
            receiver.wait("held", timeout=5)
        with pytest.raises(KVTransferError, match="closed"):
            ch.recv()
        ch.close()
    finally:
        receiver.close()


def test_a_copy_that_never_landed_fails_its_request() -> None:
    """DONE came but the landing proof did not (cuda_ipc: a dead sender's event reads as reached while
    its copy never ran): the request fails, never completes."""
    receiver = SharedReceiver(make_pool(DECODE_BLOCKS, 1))
    sender = SharedSender(receiver, make_pool(PREFILL_BLOCKS, 2), lands=False)
    try:
        receiver.expect("lost", [6, 7])
        sender.send("lost", [0, 1], [6, 7])
        with pytest.raises(KVTransferError, match="never landed"):
            receiver.wait("lost", timeout=5)
    finally:
        sender.close()
        receiver.close()
    assert receiver.connections_closed == 1


def test_hello_without_a_completion_signal_is_refused() -> None:
    receiver = SharedReceiver(make_pool(DECODE_BLOCKS, 1))
    try:
        with pytest.raises(KVTransferError, match="no completion signal"):
            SharedSender(receiver, make_pool(PREFILL_BLOCKS, 2), signal="none")
    finally:
        receiver.close()


def test_concurrent_senders_threads_and_cancels(pair: Any) -> None:
    """Two threads prepare and send over one sender while a third cancels some requests at random:
    every request either lands exactly or fails cleanly, and no cancelled request's blocks are written."""
    receiver, sender, before, prefill = pair
    rng = random.Random(5)
    dsts = rng.sample(range(DECODE_BLOCKS), 40)
    jobs = [(f"c{i}", rng.sample(range(PREFILL_BLOCKS), 2), dsts[2 * i : 2 * i + 2]) for i in range(20)]
    for rid, _, dst in jobs:
        receiver.expect(rid, dst)
    cancelled = {rid for rid, _, _ in jobs if rng.random() < 0.3}
    outcomes: dict[str, str | None] = {}

    def run(mine: list) -> None:
        for rid, src, dst in mine:
            try:
                sender.prepare(rid, dst)
                time.sleep(0.002)
                sender.send(rid, src, dst)
                outcomes[rid] = None
            except KVTransferError as e:
                outcomes[rid] = str(e)

    def cancel() -> None:
        for rid in sorted(cancelled):
            receiver.cancel(rid)

    threads = [threading.Thread(target=run, args=(jobs[i::2],)) for i in range(2)]
    threads.append(threading.Thread(target=cancel))
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for rid, src, dst in jobs:
        if rid in cancelled:
            # cancel() returned: either it won (nothing written, send refused) or the copy was out already
            if outcomes[rid] is not None:
                assert "cancelled" in str(outcomes[rid]) or "refused" in str(outcomes[rid]), outcomes[rid]
                assert torch.equal(receiver.pool[:, :, dst], before[:, :, dst]), rid
            continue
        assert outcomes[rid] is None, outcomes[rid]
        receiver.wait(rid, timeout=5)
        assert torch.equal(receiver.pool[:, :, dst], prefill[:, :, src]), rid


def _wait_granted(sender: SharedSender, rid: str) -> None:
    deadline = time.monotonic() + 5
    while sender._grants[rid].state.value != "granted":
        assert time.monotonic() < deadline, "no READY came"
        time.sleep(0.001)


def _hello(receiver: SharedReceiver) -> dict[str, Any]:
    return {"layout": receiver.layout.to_dict(), "signal": "counter"}


def test_peer_closed_sees_eof_without_consuming_a_message() -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    ch = Channel(a, "pair")
    assert not ch.peer_closed()  # open, nothing to read
    Channel(b, "pair").send(Kind.READY, {"request_id": "x"})
    assert not ch.peer_closed()  # a message waits: still open, and the message stays
    b.close()
    assert not ch.peer_closed()  # the message comes before the EOF
    assert ch.expect(Kind.READY) == {"request_id": "x"}
    assert ch.peer_closed()
    ch.close()


def _in_condition_wait(thread: threading.Thread) -> bool:
    """Whether `thread` is inside a Condition.wait_for (its predicate runs under the lock, so a cancel
    from another thread lands while it waits, not before)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == "wait_for" and frame.f_code.co_filename == threading.__file__:
            return True
        frame = frame.f_back
    return False


def test_a_wait_ends_at_once_when_another_thread_cancels_the_request(pair: Any) -> None:
    """wait() on a request that another thread cancels returns when it is cancelled, saying so, instead of
    sleeping to its timeout and then calling the request unknown; for a granted one, cancelled without
    waiting, as soon as the sender hands the grant back."""
    receiver, sender, _, _ = pair
    receiver.expect("announced", [30])
    receiver.expect("granted", [31])
    sender.prepare("granted", [31])
    _wait_granted(sender, "granted")
    outcomes: dict[str, tuple[str, float]] = {}

    def waiter(rid: str) -> None:
        t0 = time.monotonic()
        try:
            receiver.wait(rid, timeout=20)
            outcomes[rid] = ("returned", time.monotonic() - t0)
        except KVTransferError as e:
            outcomes[rid] = (str(e), time.monotonic() - t0)

    threads = [threading.Thread(target=waiter, args=(rid,)) for rid in ("announced", "granted")]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while not all(_in_condition_wait(t) for t in threads):  # both inside receiver.wait before the cancels
        assert time.monotonic() < deadline, "the waiters never reached wait()"
        time.sleep(0.005)
    assert receiver.cancel("announced") is True
    assert receiver.cancel("granted", wait=False) is False
    for t in threads:
        t.join(timeout=10)
    for rid in ("announced", "granted"):
        message, waited = outcomes[rid]
        assert "cancelled" in message and waited < 5, (rid, message, waited)
    with pytest.raises(KVTransferError, match="was cancelled"):
        receiver.poll("announced")
    receiver.expect("announced", [30])  # an id cancelled before can be expected again
    assert receiver.poll("announced") is False
