"""A tensor-parallel rank's side of KV transfers (rank r >= 1 of a prefill or decode engine): the lanes
it sends from its pool, and the receiver of its pool. Rank 0 calls these through the rank's step-ordered
pipe (engine/tp/worker.py), so a send reads blocks the rank's earlier steps wrote; kvtransfer/tp.py and
kvtransfer/tp_receiver.py are rank 0's side.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

import torch

from engine.tp.heads import HeadShard
from kvtransfer.auth import PeerAuth
from kvtransfer.base import Descriptor, KVReceiver, KVSender, KVTransferError, connect, create_receiver
from kvtransfer.layout import Lane

logger = logging.getLogger(__name__)

Emit = Callable[..., None]  # emit(kind, *args): a KVEvent to rank 0


class RankKV:
    def __init__(self, pool: torch.Tensor, shard: HeadShard, emit: Emit) -> None:
        self.pool, self.rank, self.emit = pool, shard.rank, emit
        self.senders: dict[str, list[KVSender]] = {}  # by rank 0's sender key
        self.failed: dict[tuple[str, str], str] = {}  # (key, request) -> why its prepare failed
        self.receiver: KVReceiver | None = None

    # ---- prefill side: lanes out of this rank's pool ------------------------------------------------

    def connect(
        self, key: str, routes: Sequence[tuple[int, Descriptor, Lane]], timeout: float, auth: PeerAuth
    ) -> None:
        self.senders[key] = []
        for rank, descriptor, lane in routes:
            if rank == self.rank:
                self.senders[key].append(
                    connect(descriptor, self.pool, timeout=timeout, auth=auth, lane=lane)
                )

    def prepare(self, key: str, request_id: str, dst: list[int], token: str) -> None:
        for sender in self.senders.get(key, []):
            try:
                sender.prepare(request_id, dst, token)
            except KVTransferError as e:
                self.failed[(key, request_id)] = str(e)

    def send(self, key: str, request_id: str, src: list[int], dst: list[int], token: str) -> None:
        failed = self.failed.pop((key, request_id), None)
        if failed is not None:
            raise KVTransferError(failed)
        for sender in self.senders.get(key, []):
            sender.send(request_id, src, dst, token)

    def release(self, key: str, request_id: str) -> None:
        self.failed.pop((key, request_id), None)
        for sender in self.senders.get(key, []):
            sender.release(request_id)

    def close_sender(self, key: str) -> None:
        for sender in self.senders.pop(key, []):
            sender.close()
        self.failed = {k: v for k, v in self.failed.items() if k[0] != key}

    # ---- decode side: this rank's receiver ------------------------------------------------------------

    def open_receiver(self, transport: str, host: str, auth: PeerAuth) -> Descriptor:
        self.receiver = create_receiver(transport, self.pool, host=host, on_done=self._done, auth=auth)
        return self.receiver.descriptor()

    def _done(self, request_id: str, error: KVTransferError | None) -> None:
        self.emit("done", request_id, None if error is None else str(error))

    def expect(self, request_id: str, dst: list[int], token: str) -> None:
        assert self.receiver is not None
        self.receiver.expect(request_id, dst, token)

    def cancel(self, request_id: str, wait: bool) -> None:
        """Stop the request's write here; its end is reported (an event) once nothing writes its blocks."""
        assert self.receiver is not None
        if self.receiver.cancel(request_id, wait):
            self.emit("done", request_id, "cancelled")

    def forget(self, request_id: str) -> None:
        if self.receiver is not None:
            self.receiver.drained()
            with contextlib.suppress(KVTransferError):
                self.receiver.poll(request_id)

    def close_receiver(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    def close(self) -> None:
        for key in list(self.senders):
            self.close_sender(key)
        self.close_receiver()
