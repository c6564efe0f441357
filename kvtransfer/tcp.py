"""tcp: host bytes over one TCP connection per (prefill, decode) pair; works between any two hosts.

sender                                              receiver (thread per connection)
          (TLS, CHALLENGE, HELLO {layout}, WELCOME: kvtransfer/auth.py's handshake; the layout checked)
gather src blocks into one contiguous buffer (L, 2, n, bs, h, d); on CUDA, copied to pinned host
BEGIN {request_id, dst, token}   ->                begin(): dst must be the announced blocks, the
  + payload                                         token the request's;
                                                    CPU pool: recv_into each (layer, K/V, dst run) slice
                                                    of the pool; CUDA pool: pinned staging, one H2D copy
                                                    and scatter
                                 <-  ACK {request_id[, error]}
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from kvtransfer.auth import NO_AUTH, PeerAuth
from kvtransfer.base import Descriptor, KVSender, KVTransferError
from kvtransfer.layout import (
    HeadRange,
    Lane,
    byte_view,
    check_pair,
    field,
    gather,
    lane_layouts,
    runs,
    scatter,
)
from kvtransfer.registry import TableReceiver, next_begin
from kvtransfer.wire import Channel, Kind, Message

IO_TIMEOUT_S = 60.0  # a transfer whose bytes stop flowing this long fails
_DRAIN_CHUNK = 1 << 20


def _pinned(buf: torch.Tensor | None, nbytes: int) -> torch.Tensor:
    """A pinned host byte buffer of at least nbytes (reused while large enough)."""
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
    return buf


class TcpKVReceiver(TableReceiver):
    transport = "tcp"

    def _serve(self, ch: Channel) -> None:
        hello = self._welcome(ch)
        if hello is None:
            return
        heads = HeadRange.from_meta(hello.get("heads"), self.layout)  # every head, or a lane's share
        staging: torch.Tensor | None = None
        while True:
            staging = self._receive(ch, next_begin(ch, IO_TIMEOUT_S), staging, heads)

    def _receive(
        self, ch: Channel, msg: Message, staging: torch.Tensor | None, heads: HeadRange
    ) -> torch.Tensor | None:
        rid = str(msg.meta.get("request_id"))
        try:
            meta = msg.meta
            dst = self.begin(
                rid, meta.get("dst"), msg.payload_len, meta.get("token", ""), ch.close, ch.peer, heads=heads
            )
        except KVTransferError as e:
            self._drain(ch, msg.payload_len)
            ch.send(Kind.ACK, {"request_id": rid, "error": str(e)})
            return staging
        try:
            if self.pool.is_cuda or not heads.whole(self.layout):
                staging = self._read_staged(ch, dst, msg.payload_len, staging, heads)
            else:
                self._read_direct(ch, dst)
        except Exception as e:
            self.finish(rid, f"{type(e).__name__}: {e}", heads)
            raise KVTransferError(str(e)) from e
        error = self.finish(rid, None, heads)
        ch.send(Kind.ACK, {"request_id": rid, **({"error": error} if error else {})})
        return staging

    def _read_direct(self, ch: Channel, dst: Sequence[int]) -> None:
        """Payload order is (layer, K/V, block): each run of consecutive dst blocks is one pool slice."""
        dst_runs = runs(dst)
        for layer in range(self.layout.num_layers):
            for kv in range(2):
                for _, first, n in dst_runs:
                    ch.recv_into(byte_view(self.pool[layer, kv, first : first + n]))

    def _read_staged(
        self, ch: Channel, dst: Sequence[int], nbytes: int, staging: torch.Tensor | None, heads: HeadRange
    ) -> torch.Tensor:
        """Into a host buffer, then scattered into the pool (on CUDA: one upload; a lane's share of the KV
        heads: into those heads of each block)."""
        if not self.pool.is_cuda:
            staging = (
                staging
                if staging is not None and staging.numel() >= nbytes
                else torch.empty(nbytes, dtype=torch.uint8)
            )
            ch.recv_into(byte_view(staging[:nbytes]))
            scatter(self.pool, dst, staging[:nbytes], heads)
            return staging
        staging = _pinned(staging, nbytes)
        ch.recv_into(byte_view(staging[:nbytes]))
        stream = torch.cuda.Stream(self.pool.device)
        with torch.cuda.stream(stream):
            scatter(self.pool, dst, staging[:nbytes].to(self.pool.device, non_blocking=True), heads)
        stream.synchronize()
        return staging

    def _drain(self, ch: Channel, nbytes: int) -> None:
        """Read and drop a refused transfer's payload, so the connection stays usable."""
        if nbytes > self.layout.num_blocks * self.layout.block_nbytes:
            raise KVTransferError(f"kv peer {ch.peer} announced {nbytes} bytes, more than the whole pool")
        scratch = bytearray(min(nbytes, _DRAIN_CHUNK))
        view = memoryview(scratch)
        while nbytes > 0:
            n = min(nbytes, len(scratch))
            ch.recv_into(view[:n])
            nbytes -= n


class TcpKVSender(KVSender):
    def __init__(
        self,
        descriptor: Descriptor,
        local_pool: torch.Tensor,
        *,
        timeout: float = 30.0,
        auth: PeerAuth = NO_AUTH,
        lane: Lane | None = None,
    ) -> None:
        self._pool, self._lane = local_pool, lane
        self._layout, self._remote, hello = lane_layouts(local_pool, descriptor, lane)
        self._lock = threading.Lock()
        self._staging: torch.Tensor | None = None
        self._broken: str | None = None
        host, port = field(descriptor, "host", str), field(descriptor, "port", int)
        self._ch = Channel.greet(host, port, timeout, IO_TIMEOUT_S, hello, auth)

    def send(
        self, request_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int], token: str = ""
    ) -> None:
        check_pair(src_block_ids, dst_block_ids)
        self._layout.check_ids(src_block_ids, "source")
        self._remote.check_ids(dst_block_ids, "destination")
        with self._lock:
            if self._broken:
                raise KVTransferError(f"kv sender to {self._ch.peer} is broken: {self._broken}")
            payload = byte_view(self._stage(src_block_ids))
            meta = {"request_id": request_id, "dst": [int(b) for b in dst_block_ids], "token": token}
            try:
                self._ch.send(Kind.BEGIN, meta, payload)
                ack = self._ch.expect(Kind.ACK)
            except KVTransferError as e:
                self._broken = str(e)
                raise
        if "error" in ack:
            raise KVTransferError(f"kv receiver refused request {request_id!r}: {ack['error']}")

    def _stage(self, src: Sequence[int]) -> torch.Tensor:
        """The source blocks as one contiguous host tensor (L, 2, n, bs, h, d)."""
        heads = self._lane.src if self._lane is not None else None
        if not self._pool.is_cuda:
            return gather(self._pool, src, heads)
        nbytes = len(src) * self._layout.block_nbytes
        self._staging = _pinned(self._staging, nbytes)
        stream = torch.cuda.Stream(self._pool.device)
        stream.wait_stream(torch.cuda.current_stream(self._pool.device))
        with torch.cuda.stream(stream):
            staged = gather(self._pool, src, heads)
            self._staging[:nbytes].copy_(staged.view(-1).view(torch.uint8), non_blocking=True)
        stream.synchronize()
        return self._staging[:nbytes]

    def close(self) -> None:
        self._ch.close()


RECEIVER, SENDER = TcpKVReceiver, TcpKVSender  # what create_receiver and connect build
