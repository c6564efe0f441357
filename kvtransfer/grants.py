"""The grant protocol of a transport whose sender writes the receiver's pool itself (cuda_ipc).

The sender may only write blocks the receiver has granted it, and the receiver may only free blocks it
knows nobody writes. The grant is asked for when the prefill worker admits the request (`prepare`),
while its forward pass runs, so a transfer's path holds no round trip: `send` launches the copy, marks
the sender's completion signal after it on the same stream (cuda_ipc: a landing counter in shared host
memory) and says DONE; the receiver, already awake, watches that signal and reports the request complete.

    sender                                         receiver (a thread per connection)
    HELLO {layout, what the transport adds} ->     authenticate (kvtransfer/auth.py: TLS, CHALLENGE
                                                   first), check layout, set up the completion signal
                                        <-  WELCOME {what the transport adds}
    prepare: BEGIN {request_id, dst, nbytes, token} -> begin(): only announced blocks, with the request's
                                                   token, only once
                                        <-  READY {request_id} (granted) or {request_id, error}
    send: copy queued, signal marked
          DONE {request_id, nbytes, ...} ->        watch the signal until the copy has landed,
                                                   then finish(): complete
    release: RELEASE {request_id, reason} ->       finish(error): the blocks are the receiver's again
    cancel (receiver) of a granted request:
                                        <-  REVOKE {request_id}
          RELEASE, or nothing when its DONE is out already ->  finish

`send` without a `prepare` asks for the grant itself (one round trip on its path). A connection holds
any number of granted requests; DONEs come in launch order, and the signal marked last covers every
copy launched before it (one stream). A connection that closes fails every request granted on it and
not finished. A sender that dies after its DONE takes its queued GPU work with it: the signal is never
marked, and the receiver, watching the connection meanwhile, fails the request.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import functools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine import trace
from kvtransfer.auth import NO_AUTH, PeerAuth
from kvtransfer.base import KVSender, KVTransferError
from kvtransfer.layout import HeadRange, Lane, PoolLayout
from kvtransfer.registry import TableReceiver
from kvtransfer.wire import Channel, Kind, pack_ids, unpack_ids

logger = logging.getLogger(__name__)

IO_TIMEOUT_S = 60.0  # a grant's answer, a connection's handshake


class Completion(abc.ABC):
    """A connection's view of its sender's copies, made from the sender's HELLO."""

    welcome: dict[str, Any] = {}  # what WELCOME tells the sender

    @abc.abstractmethod
    def landed(self, done: dict[str, Any], ch: Channel) -> str | None:
        """After the sender's DONE `done`: return once its copy has landed (None), or why it has not (the
        sender gone meanwhile: `ch.peer_closed()`)."""

    @abc.abstractmethod
    def close(self) -> None:
        """The connection ended."""


class GrantReceiver(TableReceiver):
    """The receiver's side: a transport adds `_open_completion` (and what TableReceiver asks for)."""

    @abc.abstractmethod
    def _open_completion(self, hello: dict[str, Any]) -> Completion:
        """From a sender's HELLO: its Completion; KVTransferError refuses the connection."""

    def _serve(self, ch: Channel) -> None:
        opened: list[Completion] = []

        def check(hello: dict[str, Any]) -> dict[str, Any]:
            opened.append(self._open_completion(hello))
            return opened[0].welcome

        granted: dict[str, int] = {}  # request id -> bytes announced, begun on this connection
        gone = "the connection closed"
        heads: HeadRange | None = None  # the pool's heads this connection writes (a lane's, or all)
        try:
            hello = self._welcome(ch, check)
            if hello is None:
                return
            heads = HeadRange.from_meta(hello.get("heads"), self.layout)
            completion = opened[0]
            ch.settimeout(None)  # idle between messages: the sender's liveness shows as EOF
            while True:
                msg = ch.recv()
                rid = str(msg.meta.get("request_id"))
                if msg.payload_len:
                    raise KVTransferError(f"kv peer {ch.peer} sent a payload with {msg.kind.name}")
                if msg.kind == Kind.BEGIN:
                    self._grant(ch, rid, msg.meta, granted, heads)
                elif msg.kind == Kind.DONE:
                    self._done(ch, rid, msg.meta, granted, completion, heads)
                elif msg.kind == Kind.RELEASE:
                    if granted.pop(rid, None) is not None:
                        reason = msg.meta.get("reason", "no reason given")
                        self.finish(rid, f"the sender released it: {reason}", heads)
                else:
                    raise KVTransferError(f"kv peer {ch.peer} sent {msg.kind.name} on a cuda_ipc connection")
        except KVTransferError as e:
            gone = str(e)
            raise
        finally:
            for rid in granted:
                self.finish(rid, f"sender gone before completing the copy: {gone}", heads)
            for c in opened:
                c.close()

    def _grant(
        self, ch: Channel, rid: str, meta: dict[str, Any], granted: dict[str, int], heads: HeadRange
    ) -> None:
        nbytes = meta.get("nbytes")
        nbytes = nbytes if isinstance(nbytes, int) else -1
        revoke = functools.partial(_revoke, ch, rid)
        try:
            dst, token = unpack_ids(meta.get("dst")), meta.get("token", "")
            self.begin(rid, dst, nbytes, token, revoke, ch.peer, heads=heads)
        except KVTransferError as e:
            ch.send(Kind.READY, {"request_id": rid, "error": str(e)})
            return
        granted[rid] = nbytes
        ch.send(Kind.READY, {"request_id": rid})

    def _done(
        self,
        ch: Channel,
        rid: str,
        meta: dict[str, Any],
        granted: dict[str, int],
        completion: Completion,
        heads: HeadRange,
    ) -> None:
        nbytes = granted.pop(rid, None)
        if nbytes is None:  # a write nobody granted: the sender is broken, drop it
            raise KVTransferError(f"sender reported request {rid!r} copied without a grant for it")
        error = meta.get("error")
        if error is None and meta.get("nbytes") != nbytes:
            error = f"sender reported {meta.get('nbytes')} bytes for {rid!r}, {nbytes} were granted"
        if error is None:
            trace.mark(rid, "kv.done_received")
            try:
                error = completion.landed(meta, ch)
            except RuntimeError as e:
                error = f"waiting for the copy failed: {type(e).__name__}: {e}"
        self.finish(rid, error, heads)


def _revoke(ch: Channel, rid: str) -> None:
    """cancel()'s hook for a granted request: ask the sender to drop it (it answers RELEASE, or its DONE
    is out already). A broken connection fails the request on its own."""
    with contextlib.suppress(KVTransferError):
        ch.send(Kind.REVOKE, {"request_id": rid})


class _State(enum.Enum):
    ASKED = "asked"
    GRANTED = "granted"
    REFUSED = "refused"
    REVOKED = "revoked"


@dataclass
class _Grant:
    dst: tuple[int, ...]
    ids: np.ndarray  # dst as int64, what send() launches with
    state: _State = _State.ASKED
    error: str | None = None


class GrantSender(KVSender):
    """The sender's side: a transport adds `_launch` (and `_stage`, `_drain`, the HELLO's fields)."""

    def __init__(
        self,
        local_pool: torch.Tensor,
        remote_layout: PoolLayout,
        host: str,
        port: int,
        timeout: float,
        hello: dict[str, Any],
        auth: PeerAuth = NO_AUTH,
        lane: Lane | None = None,
    ) -> None:
        self._pool = local_pool
        self._layout = PoolLayout.of(local_pool)
        self._remote_layout = remote_layout
        if lane is not None:  # a share of the heads: the layout of what it sends, into the same share there
            self._layout = self._layout.part(lane.src.count)
            hello = {**hello, "heads": [lane.dst.start, lane.dst.count]}
            remote_layout = remote_layout.part(lane.dst.count)
        self._layout.check_peer(remote_layout)
        self._cond = threading.Condition()
        self._grants: dict[str, _Grant] = {}
        self._broken: str | None = None
        self._closing = False
        self._ch = Channel.greet(
            host, port, timeout, IO_TIMEOUT_S, {"layout": self._layout.to_dict(), **hello}, auth
        )
        self._ch.settimeout(None)  # the reader waits for grants as long as it takes; wait_for bounds it
        self._reader = threading.Thread(target=self._read, name="kv-grants", daemon=True)
        self._reader.start()

    # -- what a transport provides ------------------------------------------------------------------
    def _stage(self, src: np.ndarray, dst: np.ndarray) -> Any:
        """Work that needs no grant, done before waiting for it (cuda_ipc across GPUs: the gather)."""
        del src, dst

    @abc.abstractmethod
    def _launch(self, request_id: str, src: np.ndarray, dst: np.ndarray, staged: Any) -> dict[str, Any]:
        """Queue the copy into the receiver's pool, then mark the completion signal after it; returns what
        DONE adds for the receiver's Completion. Raises RuntimeError when the copy cannot be queued."""

    def _drain(self) -> None:
        """Return once every launched copy has landed (close() waits for it)."""

    # -- KVSender -----------------------------------------------------------------------------------
    def prepare(self, request_id: str, dst_block_ids: Sequence[int], token: str = "") -> None:
        dst = list(map(int, dst_block_ids))
        self._remote_layout.check_ids(dst, "destination")
        with self._cond:
            if request_id in self._grants:
                raise KVTransferError(f"request {request_id!r} is already prepared on this sender")
            self._ask(request_id, dst, token)

    def release(self, request_id: str) -> None:
        with self._cond:
            grant = self._grants.pop(request_id, None)
            if grant is None or grant.state in (_State.REFUSED, _State.REVOKED) or self._broken:
                return  # nothing held at the receiver (a revoked grant's RELEASE went with its answer)
            self._say(Kind.RELEASE, {"request_id": request_id, "reason": "the prefill worker dropped it"})

    def send(
        self, request_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int], token: str = ""
    ) -> None:
        # Every microsecond here is on the transfer's path (the copy is queued at the end): ids travel as
        # numpy arrays, and a prepared request's destination is the grant's, checked by prepare().
        trace.mark(request_id, "kv.send")
        src = self._layout.id_array(src_block_ids, "source")
        with self._cond:
            grant = self._grants.get(request_id)
        if grant is not None and tuple(dst_block_ids) == grant.dst:
            dst = grant.ids
        else:
            dst = self._remote_layout.id_array(dst_block_ids, "destination")
            if len(np.unique(dst)) != len(dst):
                raise KVTransferError("destination block ids repeat")
        if len(src) != len(dst):
            raise KVTransferError(f"{len(src)} source blocks but {len(dst)} destination blocks")
        nbytes = len(src) * self._layout.block_nbytes
        try:
            staged = self._stage(src, dst)  # on the caller's stream: after the forward pass
        except RuntimeError as e:
            self.release(request_id)
            raise KVTransferError(f"kv copy of request {request_id!r} failed: {type(e).__name__}: {e}") from e
        with self._cond:
            grant = self._grants.get(request_id)
            if grant is None:
                grant = self._ask(request_id, dst, token)
            elif grant.ids is not dst and grant.dst != tuple(dst.tolist()):
                self.release(request_id)
                raise KVTransferError(
                    f"request {request_id!r}: send's destination blocks differ from prepare's"
                )
            if grant.state == _State.ASKED:
                trace.mark(request_id, "kv.wait_grant")
                self._cond.wait_for(
                    lambda: grant.state != _State.ASKED or self._broken is not None, timeout=IO_TIMEOUT_S
                )
            self._grants.pop(request_id, None)
            trace.mark(request_id, "kv.granted")
            if grant.state == _State.REFUSED:
                raise KVTransferError(f"kv receiver refused request {request_id!r}: {grant.error}")
            if grant.state == _State.REVOKED:
                raise KVTransferError(f"kv receiver cancelled request {request_id!r}")
            if grant.state == _State.ASKED:
                self._break(self._broken or f"no grant for request {request_id!r} in {IO_TIMEOUT_S:g} s")
                raise KVTransferError(f"kv sender to {self._ch.peer} is broken: {self._broken}")
            if self._broken or self._closing:  # the receiver failed the grant when the connection went
                raise KVTransferError(f"kv sender to {self._ch.peer} is broken: {self._broken or 'closed'}")
            # granted: launched under the lock, so a REVOKE read meanwhile finds it gone (its DONE follows)
            try:
                done = {
                    **self._launch(request_id, src, dst, staged),
                    "request_id": request_id,
                    "nbytes": nbytes,
                }
                trace.mark(request_id, "kv.launched")
            except RuntimeError as e:
                done = {"request_id": request_id, "error": f"{type(e).__name__}: {e}"}
            self._say(Kind.DONE, done)
            trace.mark(request_id, "kv.done_sent")
        if "error" in done:
            raise KVTransferError(f"kv copy of request {request_id!r} failed: {done['error']}")

    def close(self) -> None:
        """Waits for the launched copies, then closes the connection (the receiver fails what was granted
        and not sent)."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        try:
            self._drain()
        except RuntimeError as e:
            logger.warning("kv sender to %s: waiting for its last copies failed: %s", self._ch.peer, e)
        self._ch.close()
        self._reader.join(timeout=IO_TIMEOUT_S)

    # -- internals (with self._cond held) -------------------------------------------------------------
    def _ask(self, rid: str, dst: Sequence[int] | np.ndarray, token: str) -> _Grant:
        if self._broken or self._closing:
            raise KVTransferError(f"kv sender to {self._ch.peer} is broken: {self._broken or 'closed'}")
        ids = np.asarray(dst, dtype=np.int64)
        grant = self._grants[rid] = _Grant(tuple(ids.tolist()), ids)
        self._say(
            Kind.BEGIN,
            {
                "request_id": rid,
                "dst": pack_ids(ids),
                "nbytes": len(ids) * self._layout.block_nbytes,
                "token": token,
            },
        )
        trace.mark(rid, "kv.begin_sent")
        return grant

    def _say(self, kind: Kind, meta: dict[str, Any]) -> None:
        try:
            self._ch.send(kind, meta)
        except KVTransferError as e:
            self._break(str(e))
            raise

    def _break(self, why: str) -> None:
        """The connection is unusable: close it, so the receiver fails everything granted on it."""
        if self._broken is None:
            self._broken = why
        self._ch.close()
        self._cond.notify_all()

    def _read(self) -> None:
        """The reader thread: grants, refusals and revocations, in the receiver's order."""
        try:
            while True:
                msg = self._ch.recv()
                rid = str(msg.meta.get("request_id"))
                with self._cond:
                    grant = self._grants.get(rid)
                    if msg.kind == Kind.READY:
                        if grant is not None and grant.state == _State.ASKED:
                            error = msg.meta.get("error")
                            grant.state = _State.GRANTED if error is None else _State.REFUSED
                            grant.error = None if error is None else str(error)
                            self._cond.notify_all()
                    elif msg.kind == Kind.REVOKE:
                        # a grant still unused: drop it and say so; one being launched is not in the table
                        # any more (its DONE follows), and one released has its RELEASE on the way
                        if grant is not None and grant.state in (_State.ASKED, _State.GRANTED):
                            grant.state = _State.REVOKED
                            self._say(Kind.RELEASE, {"request_id": rid, "reason": "revoked by the receiver"})
                            self._cond.notify_all()
                    else:
                        raise KVTransferError(f"kv receiver {self._ch.peer} sent {msg.kind.name}")
        except KVTransferError as e:
            with self._cond:
                if not self._closing:
                    self._break(str(e))
