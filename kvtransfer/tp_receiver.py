"""A tensor-parallel decode engine's receiver: every rank runs a receiver of its own over its own pool
(rank 0 here, the others in their rank processes, kvtransfer/tp_rank.py), and this one keeps the
request table that the decode worker sees (kvtransfer/tp.py says how the heads travel).

    expect(rid, dst)   -> every rank expects the request (the other ranks answer before this returns, so
                          no lane can reach a rank before its announcement)
    each rank's part   -> that rank's receiver reports it ended (rank 0: on_done; others: a KVEvent)
    poll / wait        -> complete once every rank's part ended without error; a failed part cancels
                          the others, and the request fails once they all stopped writing
    cancel(wait=False) -> the id comes out of drained() once every rank's write has ended
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.tp.heads import HeadShard, kv_head_ranges
from kvtransfer.auth import NO_AUTH, PeerAuth
from kvtransfer.base import Descriptor, DoneCallback, KVReceiver, KVTransferError, create_receiver

POLL_S = 0.01


@dataclass
class _Request:
    pending: set[int]  # ranks whose part has not ended (0: this process's receiver)
    error: str | None = None
    cancelled: bool = False
    detached: bool = False  # cancelled without waiting: drained() hands it back once nothing is pending


@dataclass
class _Table:
    requests: dict[str, _Request] = field(default_factory=dict)
    drained: list[str] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)


class ShardedReceiver(KVReceiver):
    def __init__(
        self,
        transport: str,
        pool: torch.Tensor,
        ranks: Any,
        shard: HeadShard,
        *,
        host: str = "127.0.0.1",
        on_done: DoneCallback | None = None,
        auth: PeerAuth = NO_AUTH,
    ) -> None:
        self._ranks, self._size, self._on_done = ranks, ranks.size, on_done
        self._t = _Table()
        self._local = create_receiver(transport, pool, host=host, on_done=self._local_done, auth=auth)
        ranks.on_event = self._remote_event
        try:
            remote = ranks.call("open_receiver", transport, host, auth)
        except RuntimeError as e:
            self._local.close()
            raise KVTransferError(f"cannot open the kv receivers of every rank: {e}") from e
        heads = kv_head_ranges(shard.total_kv_heads, self._size)
        self._descriptor = {
            **self._local.descriptor(),
            "tp": {
                "num_kv_heads": shard.total_kv_heads,
                "kv_heads": [[h.start, len(h)] for h in heads],
                "ranks": [self._local.descriptor(), *remote],
            },
        }

    def descriptor(self) -> Descriptor:
        return self._descriptor

    def expect(self, request_id: str, dst_block_ids: Sequence[int], token: str = "") -> None:
        dst = [int(b) for b in dst_block_ids]
        with self._t.cond:
            if request_id in self._t.requests:
                raise KVTransferError(f"request {request_id!r} is already expected")
            self._t.requests[request_id] = _Request(set(range(self._size)))
        try:
            self._local.expect(request_id, dst, token)
            self._ranks.call("expect", request_id, dst, token)
        except (RuntimeError, KVTransferError) as e:
            self.cancel(request_id)
            raise KVTransferError(f"request {request_id!r}: {e}") from e

    def poll(self, request_id: str) -> bool:
        with self._t.cond:
            req = self._t.requests.get(request_id)
            if req is None:
                raise KVTransferError(f"request {request_id!r} was never expected (or already waited for)")
            if req.pending:
                return False
            del self._t.requests[request_id]
        error = req.error
        try:
            self._local.poll(request_id)  # forgets it here
        except KVTransferError as e:
            error = error or str(e)
        self._ranks.post("forget", request_id)
        if req.cancelled:
            raise KVTransferError(f"request {request_id!r} was cancelled")
        if error is not None:
            raise KVTransferError(f"kv transfer of request {request_id!r} failed: {error}")
        return True

    def wait(self, request_id: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.poll(request_id):
            if time.monotonic() > deadline:
                self.cancel(request_id)
                raise KVTransferError(f"kv transfer of request {request_id!r} timed out after {timeout:g} s")
            with self._t.cond:
                self._t.cond.wait(POLL_S)

    def cancel(self, request_id: str, wait: bool = True) -> bool:
        with self._t.cond:
            req = self._t.requests.get(request_id)
            if req is None:
                return True
            req.cancelled, req.detached = True, not wait
        if self._local.cancel(request_id, wait):
            self._ended(request_id, 0, None)
        if wait:  # each rank answers once its write has ended (its end reported before its answer)
            try:
                self._ranks.call("cancel", request_id, True)
            except RuntimeError as e:
                raise KVTransferError(f"request {request_id!r}: cancelling on every rank failed: {e}") from e
        else:
            self._ranks.post("cancel", request_id, False)
        with self._t.cond:
            if req.pending:
                return False
            self._t.requests.pop(request_id, None)
            if request_id in self._t.drained:
                self._t.drained.remove(request_id)
        self._ranks.post("forget", request_id)
        return True

    def drained(self) -> list[str]:
        self._local.drained()  # tracked through on_done; emptied so it does not grow
        with self._t.cond:
            out, self._t.drained = self._t.drained, []
        for rid in out:
            self._ranks.post("forget", rid)
        return out

    def has_drained(self) -> bool:
        return bool(self._t.drained)

    def close(self) -> None:
        self._local.close()
        with contextlib.suppress(RuntimeError):  # the ranks are gone, and their receivers with them
            self._ranks.post("close_receiver")
        with self._t.cond:
            for req in self._t.requests.values():
                req.error, req.pending = req.error or "kv receiver closed", set()
            self._t.cond.notify_all()

    # ---- each rank's part ending ---------------------------------------------------------------------

    def _local_done(self, request_id: str, error: KVTransferError | None) -> None:
        self._ended(request_id, 0, None if error is None else str(error))

    def _remote_event(self, event: Any) -> None:
        if event.kind == "done":
            request_id, error = event.args
            self._ended(request_id, event.rank, error)

    def _ended(self, request_id: str, rank: int, error: str | None) -> None:
        """Rank `rank`'s part of the request stopped writing (landed, or not: `error`)."""
        stop_others = False
        with self._t.cond:
            req = self._t.requests.get(request_id)
            if req is None or rank not in req.pending:
                return
            req.pending.discard(rank)
            if error is not None and req.error is None and not req.cancelled:
                req.error, stop_others = error, bool(req.pending)
            done = not req.pending
            if done and req.detached:
                del self._t.requests[request_id]
                self._t.drained.append(request_id)
            self._t.cond.notify_all()
        if stop_others:  # the request cannot be whole: the other parts stop, then it fails
            self._local.cancel(request_id, wait=False)
            with contextlib.suppress(RuntimeError):  # a dead rank: the engine fails as a whole
                self._ranks.post("cancel", request_id, False)
        if done and self._on_done is not None:
            self._on_done(request_id, None if req.error is None else KVTransferError(req.error))
