"""The receiver's table of announced requests, shared by every transport.

    expect()           -> EXPECTED
    begin()  (by a transport thread, once the sender's header arrived and matched)
                       -> IN_FLIGHT
    finish() (by the same thread: every byte in the pool, or the error)
                       -> DONE | FAILED
    wait() / poll() (True or raising) / cancel()  -> forgotten
    cancel(wait=False) of an IN_FLIGHT request -> detached; finish() -> drained() hands its id back

Only `begin` admits writes to a request's blocks, and only for the exact blocks announced and with the
request's token (a random value the decode worker hands only to the prefill worker it asks), so a late or
stray sender can never write into blocks that were freed and handed to another request, nor a peer into
blocks granted to another. Before any of that, `_welcome` authenticates the peer (kvtransfer/auth.py).
Refusals of both kinds are logged and counted (`refusals`: "auth", "grant").

A transfer may come in parts, each carrying some of the pool's KV heads (lanes from tensor-parallel
ranks that split the heads differently, engine/tp/heads.py): `begin` admits a part whose heads no earlier
part took, the request is IN_FLIGHT while a part writes, back to EXPECTED between parts, and DONE once
parts covered every head. A part that fails stops the others (their abort) and the request FAILS when
the last one has stopped. A sender of every head at once is the one-part case. Every part carries the token.
"""

from __future__ import annotations

import abc
import collections
import enum
import hmac
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtransfer.auth import NO_AUTH, PeerAuth, new_nonce
from kvtransfer.base import Descriptor, DoneCallback, KVReceiver, KVTransferError
from kvtransfer.layout import HeadRange, PoolLayout
from kvtransfer.wire import HANDSHAKE_S, Channel, ControlServer, Kind, Message

logger = logging.getLogger(__name__)

CANCEL_GRACE_S = 10.0  # how long cancel() waits for a transfer already writing to end
CANCELLED_KEPT = 4096  # cancelled request ids remembered, for wait()'s error


class State(enum.IntEnum):
    EXPECTED = 0
    IN_FLIGHT = 1
    DONE = 2
    FAILED = 3


@dataclass
class _Entry:
    dst: tuple[int, ...]
    token: str = ""  # what the sender must show with its write (the decode worker gave it to one worker)
    state: State = State.EXPECTED
    error: str | None = None
    cancelled: bool = False
    # the parts writing now, by first head: what stops each (closes its connection)
    writing: dict[int, Callable[[], None] | None] = field(default_factory=dict)
    begun: list[HeadRange] = field(default_factory=list)  # every part admitted
    landed: int = 0  # KV heads whose part finished without error
    detached: bool = False  # cancelled without waiting: finish() hands it to drained()

    def abort_all(self) -> list[Callable[[], None]]:
        return [a for a in self.writing.values() if a is not None]


def next_begin(ch: Channel, io_timeout: float) -> Message:
    """A sender's next BEGIN, waited for as long as it takes (the pair idles between transfers); what
    follows it must arrive within io_timeout."""
    ch.settimeout(None)
    msg = ch.recv()
    ch.settimeout(io_timeout)
    if msg.kind != Kind.BEGIN:
        raise KVTransferError(f"kv peer {ch.peer} sent {msg.kind.name}, expected BEGIN")
    return msg


class TableReceiver(KVReceiver):
    """KVReceiver's request bookkeeping and its control server, the one construction path of every
    receiver; a transport names itself (`transport`) and adds `_serve`, and may add `_open`, `_fields`
    and `_shutdown`."""

    transport: str  # the descriptor's "transport" and its threads' name

    def __init__(
        self,
        pool: torch.Tensor,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        on_done: DoneCallback | None = None,
        auth: PeerAuth = NO_AUTH,
    ) -> None:
        self.pool = pool
        self._auth = auth
        self.refusals: collections.Counter[str] = collections.Counter()  # "auth", "grant": refused peers
        self.layout = PoolLayout.of(pool)
        self._on_done = on_done
        self._entries: dict[str, _Entry] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._drained: list[str] = []  # detached cancels whose write has ended, for drained()
        # the latest cancelled request ids (bounded), so a wait() on one says so, not "never expected"
        self._cancelled: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._host = advertise_host or host
        self._open(host)
        # last: from here on senders connect, each served by `_serve` on a thread of its own
        self._server = ControlServer(host, port, self._serve, f"kv-{self.transport}")

    def _open(self, host: str) -> None:
        """The transport's own resources, made before the first sender can connect (KVTransferError: this
        pool cannot be served)."""

    @abc.abstractmethod
    def _serve(self, ch: Channel) -> None:
        """One sender's connection, from its HELLO until it closes (on a thread of its own)."""

    def descriptor(self) -> Descriptor:
        common = {"transport": self.transport, "host": self._host, "port": self._server.port}
        return {**common, "layout": self.layout.to_dict(), **self._fields()}

    def _fields(self) -> Descriptor:
        """What the transport's senders need beyond the address and the layout."""
        return {}

    def _welcome(
        self, ch: Channel, check: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None
    ) -> dict[str, Any] | None:
        """A receiver's side of the handshake (kvtransfer/auth.py): the sender's HELLO once it has
        authenticated and its pool layout (and `check`, which raises KVTransferError and may return fields
        for WELCOME) pass, after WELCOME; else None, after WELCOME {error} where the peer can read it."""
        ch.settimeout(HANDSHAKE_S)
        nonce = new_nonce()
        try:
            if self._auth.tls:
                ch.start_tls(self._auth.server_context(), server_side=True)
            ch.send(Kind.CHALLENGE, {"nonce": nonce})
            hello = ch.expect(Kind.HELLO)
        except KVTransferError as e:
            if self._auth.authenticates:  # no certificate, another CA's, or no HELLO at all
                self.refused("auth", ch.peer, str(e))
            return None
        try:
            self._auth.check_mac("hello", nonce, hello)
        except KVTransferError as e:
            self.refused("auth", ch.peer, str(e))
            ch.send(Kind.WELCOME, {"error": "authentication failed"})
            return None
        try:
            heads = HeadRange.from_meta(hello.get("heads"), self.layout)  # the pool's heads its parts write
            self.layout.part(heads.count).check_peer(PoolLayout.from_dict(hello.get("layout")))
            fields = check(hello) if check is not None else None
        except KVTransferError as e:
            ch.send(Kind.WELCOME, {"error": str(e)})
            return None
        ch.send(Kind.WELCOME, self._auth.signed("welcome", hello.get("nonce"), fields or {}))
        return hello

    def refused(self, reason: str, peer: str, why: str) -> None:
        """A peer that failed to authenticate ("auth") or wrote what it was not granted ("grant"): logged
        and counted; nothing of it reached the pool."""
        logger.warning(
            "kv receiver refused %s from %s: %s", "a connection" if reason == "auth" else "a write", peer, why
        )
        with self._cond:
            self.refusals[reason] += 1

    def refusal_counts(self) -> dict[str, int]:
        with self._cond:
            return dict(self.refusals)

    # -- decode worker side -------------------------------------------------------------------------
    def expect(self, request_id: str, dst_block_ids: Sequence[int], token: str = "") -> None:
        dst = tuple(int(b) for b in dst_block_ids)
        self.layout.check_ids(dst, "destination")
        if len(set(dst)) != len(dst):
            raise KVTransferError(f"request {request_id!r}: destination block ids repeat")
        with self._cond:
            if self._closed:
                raise KVTransferError("kv receiver is closed")
            if request_id in self._entries:
                raise KVTransferError(f"request {request_id!r} is already expected")
            self._entries[request_id] = _Entry(dst, token)
            self._cancelled.pop(request_id, None)

    def wait(self, request_id: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            self._cond.wait_for(
                lambda: self._ended(request_id), timeout=max(0.0, deadline - time.monotonic())
            )
        if self.poll(request_id):
            return
        self.cancel(request_id)
        raise KVTransferError(f"kv transfer of request {request_id!r} timed out after {timeout:g} s")

    def _ended(self, request_id: str) -> bool:
        """(With the lock) whether a known request's transfer is DONE or FAILED (an unknown one: True, so
        wait() goes on to poll()'s error)."""
        entry = self._entries.get(request_id)
        return entry is None or entry.state >= State.DONE

    def poll(self, request_id: str) -> bool:
        with self._cond:
            entry = self._entries.get(request_id)
            if entry is None:
                if request_id in self._cancelled:
                    raise KVTransferError(f"request {request_id!r} was cancelled")
                raise KVTransferError(f"request {request_id!r} was never expected (or already waited for)")
            if entry.state < State.DONE:
                return False
            del self._entries[request_id]
        if entry.state == State.FAILED:
            raise KVTransferError(f"kv transfer of request {request_id!r} failed: {entry.error}")
        return True

    def cancel(self, request_id: str, wait: bool = True) -> bool:
        with self._cond:
            entry = self._entries.get(request_id)
            if entry is None:
                return True
            entry.cancelled = True
            if entry.state != State.IN_FLIGHT:
                del self._entries[request_id]
                self._note_cancelled(request_id)
                return True
            aborts = entry.abort_all()
            entry.detached = not wait
        for abort in aborts:
            abort()
        if not wait:
            return False
        with self._cond:
            ended = self._cond.wait_for(lambda: entry.state != State.IN_FLIGHT, timeout=CANCEL_GRACE_S)
            if self._entries.pop(request_id, None) is not None:
                self._note_cancelled(request_id)
        if not ended:
            raise KVTransferError(
                f"request {request_id!r}: a transfer still writes its blocks {CANCEL_GRACE_S:g} s after "
                "cancel; do not reuse them"
            )
        return True

    def _note_cancelled(self, request_id: str) -> None:
        """(With the lock) a cancelled request left the table: a wait() on it ends now, saying so."""
        self._cancelled[request_id] = None
        if len(self._cancelled) > CANCELLED_KEPT:
            self._cancelled.popitem(last=False)
        self._cond.notify_all()

    def drained(self) -> list[str]:
        with self._cond:
            out, self._drained = self._drained, []
        return out

    def has_drained(self) -> bool:
        return bool(self._drained)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self._shutdown()
        with self._cond:
            pending = [(rid, e) for rid, e in self._entries.items() if e.state < State.DONE]
            for rid, entry in pending:
                entry.error, entry.writing = entry.error or "kv receiver closed", {}
                self._settle(rid, entry)
        if self._on_done is not None:
            for rid, entry in pending:
                self._on_done(rid, KVTransferError(entry.error or "kv receiver closed"))

    def _shutdown(self) -> None:
        """Stop the transport's threads and sockets (a transport with more to release extends it)."""
        self._server.close()

    # -- transport threads --------------------------------------------------------------------------
    def begin(
        self,
        request_id: str,
        dst_block_ids: object,
        nbytes: int,
        token: object = "",
        abort: Callable[[], None] | None = None,
        peer: str = "?",
        heads: HeadRange | None = None,
    ) -> tuple[int, ...]:
        """Admit a sender's transfer (of the KV heads `heads`; None: all of them); returns the destination
        blocks, or raises with the refusal. A write that was not granted (unknown request, other blocks, a
        wrong token, a second write of the same heads) is logged and counted too; one for a request the
        receiver cancelled is the ordinary race with a client gone."""
        try:
            return self._admit(request_id, dst_block_ids, nbytes, token, abort, heads)
        except KVTransferError as e:
            with self._cond:
                race = (
                    self._closed
                    or request_id in self._cancelled
                    or (request_id in self._entries and self._entries[request_id].cancelled)
                )
            if not race:
                self.refused("grant", peer, str(e))
            raise

    def _admit(
        self,
        request_id: str,
        dst_block_ids: object,
        nbytes: int,
        token: object,
        abort: Callable[[], None] | None,
        heads: HeadRange | None,
    ) -> tuple[int, ...]:
        part = heads if heads is not None else HeadRange(0, self.layout.num_kv_heads)
        with self._cond:
            entry = self._entries.get(request_id)
            if self._closed or entry is None or entry.cancelled:
                raise KVTransferError(
                    f"receiver does not expect request {request_id!r} (unknown or cancelled)"
                )
            if not isinstance(token, str) or not hmac.compare_digest(token, entry.token):
                raise KVTransferError(f"request {request_id!r}: the write's token is not the one granted")
            if entry.state >= State.DONE or entry.error is not None:
                raise KVTransferError(f"request {request_id!r} is already {entry.state.name.lower()}")
            if any(part.overlaps(b) for b in entry.begun):
                state = entry.state.name.lower() if part.whole(self.layout) else "sent for these kv heads"
                raise KVTransferError(f"request {request_id!r} is already {state}")
            if not isinstance(dst_block_ids, list) or tuple(dst_block_ids) != entry.dst:
                raise KVTransferError(
                    f"request {request_id!r}: destination blocks differ from the ones the receiver reserved"
                )
            want = len(entry.dst) * self.layout.part(part.count).block_nbytes
            if nbytes != want:
                raise KVTransferError(f"request {request_id!r}: {nbytes} bytes announced, {want} expected")
            entry.state = State.IN_FLIGHT
            entry.writing[part.start] = abort
            entry.begun.append(part)
            return entry.dst

    def is_cancelled(self, request_id: str) -> bool:
        with self._cond:
            entry = self._entries.get(request_id)
            return entry is None or entry.cancelled

    def finish(self, request_id: str, error: str | None, heads: HeadRange | None = None) -> str | None:
        """Record the outcome of a begun transfer (its part of `heads`); returns the error the sender is
        told (None: this part landed)."""
        part = heads if heads is not None else HeadRange(0, self.layout.num_kv_heads)
        aborts: list[Callable[[], None]] = []
        with self._cond:
            entry = self._entries.get(request_id)
            if entry is None or entry.state >= State.DONE or part.start not in entry.writing:
                return error or f"request {request_id!r} was forgotten by the receiver"
            del entry.writing[part.start]
            if entry.cancelled and error is None:
                error = f"request {request_id!r} was cancelled by the receiver"
            if error is None:
                entry.landed += part.count
            elif entry.error is None:
                entry.error = error
                aborts = entry.abort_all()  # the other parts cannot make the request whole any more
            ended = self._settle(request_id, entry)
        for abort in aborts:
            abort()
        if ended and self._on_done is not None:
            self._on_done(request_id, None if entry.error is None else KVTransferError(entry.error))
        return error

    def _settle(self, request_id: str, entry: _Entry) -> bool:
        """(With the lock) after a part finished: whether the request ended (DONE or FAILED)."""
        if entry.writing:
            return False  # another part still writes
        if entry.error is None and entry.landed < self.layout.num_kv_heads:
            entry.state = State.EXPECTED  # between parts: the next may begin, a cancel frees at once
            return False
        entry.state = State.DONE if entry.error is None else State.FAILED
        if entry.detached:  # its blocks go back through drained(); a wait() on it hears "cancelled"
            del self._entries[request_id]
            self._drained.append(request_id)
            self._note_cancelled(request_id)
        self._cond.notify_all()
        return True
