"""cuda_ipc: same host; the prefill worker writes straight into the decode worker's pool.

The decode worker exports its pool once (a CUDA IPC memory handle, in the descriptor as JSON); each
prefill worker maps it at connect time and, per transfer, copies its blocks into the mapped pool on
the caller's stream (on one GPU: kernels.kv_block_copy.GraphedBlockCopy, the one-pass block-copy kernel
and its ids' upload replayed as one CUDA graph). `send` returns once the copy is queued: the prefill worker's loop
goes on while it runs, and whatever it queues next on that stream (the next forward pass, which may
rewrite the source blocks) runs after it. A completion thread waits for the copy and tells the receiver:

    sender                                      receiver (thread per connection)
    HELLO {layout}                   ->         check layout
                                     <-  WELCOME
    BEGIN {request_id, dst, nbytes}  ->         begin(): only announced blocks, only once
                                     <-  READY  (or a refusal: nothing is written)
    copy queued on the caller's stream; send() returns
    (completion thread: event sync)
    DONE {request_id, nbytes}        ->         finish(): length check; the request is complete

`dst` travels packed (wire.pack_ids). The next BEGIN on a connection waits for the previous DONE. A
sender that dies between READY and DONE closes the control socket: the request fails. A failure the
receiver finds after DONE fails the request on the decode side (the decode worker reports it).
"""

from __future__ import annotations

import base64
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine import trace
from kernels.kv_block_copy import GraphedBlockCopy
from kvtransfer.base import Descriptor, DoneCallback, KVSender, KVTransferError
from kvtransfer.layout import (
    PoolLayout,
    check_pair,
    copy_blocks,
    field,
    gather,
    scatter,
    uses_kernel,
)
from kvtransfer.registry import TableReceiver
from kvtransfer.wire import Channel, ControlServer, Kind, pack_ids, unpack_ids

logger = logging.getLogger(__name__)

IO_TIMEOUT_S = 60.0

# rebuild_cuda_tensor's arguments after (tensor_cls, size, stride, offset, storage_cls, dtype), by name
_IPC_FIELDS = (
    "device",
    "handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)
_BYTES_FIELDS = ("handle", "ref_counter_handle", "event_handle")


def encode_ipc_args(args: tuple[Any, ...]) -> dict[str, Any]:
    """reduce_tensor's rebuild arguments as a JSON-able dict (bytes in base64, no pickle)."""
    if len(args) != 6 + len(_IPC_FIELDS):
        raise KVTransferError(f"unexpected CUDA IPC handle layout ({len(args)} fields) from this torch")
    _, size, stride, offset, _, dtype = args[:6]
    out: dict[str, Any] = {
        "size": list(size),
        "stride": list(stride),
        "offset": int(offset),
        "dtype": str(dtype).removeprefix("torch."),
    }
    for name, value in zip(_IPC_FIELDS, args[6:], strict=True):
        if name in _BYTES_FIELDS and value is not None:
            value = base64.b64encode(value).decode()
        out[name] = value
    return out


def decode_ipc_args(ipc: dict[str, Any], device_index: int) -> tuple[Any, ...]:
    """The inverse of encode_ipc_args, for a consumer that sees the GPU as `device_index`."""
    try:
        fields = {n: ipc[n] for n in _IPC_FIELDS}
        for name in _BYTES_FIELDS:
            if fields[name] is not None:
                fields[name] = base64.b64decode(fields[name])
        fields["device"], fields["requires_grad"] = device_index, False
        dtype = getattr(torch, ipc["dtype"])
        head = (torch.Tensor, tuple(ipc["size"]), tuple(ipc["stride"]), int(ipc["offset"]))
        return (*head, torch.UntypedStorage, dtype, *(fields[n] for n in _IPC_FIELDS))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise KVTransferError(f"kv descriptor has a bad 'ipc' handle: {e!r}") from e


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _local_index(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if _device_uuid(i) == uuid:
            return i
    raise KVTransferError(
        f"the decode worker's GPU {uuid} is not visible here: cuda_ipc needs both workers on one host "
        "with that GPU visible to both (use nccl or tcp otherwise)"
    )


class CudaIpcKVReceiver(TableReceiver):
    def __init__(
        self,
        pool: torch.Tensor,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        on_done: DoneCallback | None = None,
    ) -> None:
        if not pool.is_cuda:
            raise KVTransferError(f"cuda_ipc needs the decode pool on a CUDA device, got {pool.device}")
        super().__init__(pool, on_done)
        from torch.multiprocessing.reductions import reduce_tensor

        self._ipc = encode_ipc_args(reduce_tensor(pool)[1])  # pool must outlive the receiver
        index = pool.device.index if pool.device.index is not None else torch.cuda.current_device()
        self._uuid = _device_uuid(index)
        self._host = advertise_host or host
        self._server = ControlServer(host, port, self._serve, "kv-cuda-ipc")

    def descriptor(self) -> Descriptor:
        return {
            "transport": "cuda_ipc",
            "host": self._host,
            "port": self._server.port,
            "layout": self.layout.to_dict(),
            "device_uuid": self._uuid,
            "ipc": self._ipc,
        }

    def _shutdown(self) -> None:
        self._server.close()

    def _serve(self, ch: Channel) -> None:
        if self._welcome(ch) is None:
            return
        while True:
            ch.settimeout(None)  # idle between transfers
            meta = ch.expect(Kind.BEGIN)
            ch.settimeout(IO_TIMEOUT_S)
            self._receive(ch, meta)

    def _receive(self, ch: Channel, meta: dict[str, Any]) -> None:
        rid, nbytes = str(meta.get("request_id")), meta.get("nbytes")
        try:
            self.begin(rid, unpack_ids(meta.get("dst")), nbytes if isinstance(nbytes, int) else -1)
        except KVTransferError as e:
            ch.send(Kind.READY, {"request_id": rid, "error": str(e)})
            return
        ch.send(Kind.READY, {"request_id": rid})
        try:
            done = ch.expect(Kind.DONE)  # the sender copies now; EOF here = it died mid-copy
        except KVTransferError as e:
            self.finish(rid, f"sender gone before completing the copy: {e}")
            raise
        error = done.get("error")
        if error is None and (done.get("request_id") != rid or done.get("nbytes") != nbytes):
            error = f"sender reported {done.get('nbytes')} bytes for {done.get('request_id')!r}"
        self.finish(rid, error)


@dataclass
class _InFlight:
    """A queued copy whose DONE is not out yet."""

    request_id: str
    nbytes: int
    copied: torch.cuda.Event  # recorded after the copy on the stream that ran it
    keep: torch.Tensor | None  # staging the copy still reads (cross-GPU path)


class CudaIpcKVSender(KVSender):
    def __init__(self, descriptor: Descriptor, local_pool: torch.Tensor, *, timeout: float = 30.0) -> None:
        self._layout = PoolLayout.of(local_pool)
        self._remote_layout = PoolLayout.from_dict(field(descriptor, "layout", dict))
        self._layout.check_peer(self._remote_layout)
        ipc, uuid = field(descriptor, "ipc", dict), field(descriptor, "device_uuid", str)
        host, port = field(descriptor, "host", str), field(descriptor, "port", int)
        if not local_pool.is_cuda:
            raise KVTransferError(
                f"cuda_ipc needs the prefill pool on a CUDA device, got {local_pool.device}"
            )
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        index = _local_index(uuid)
        try:
            self._remote = rebuild_cuda_tensor(*decode_ipc_args(ipc, index))
        except RuntimeError as e:
            raise KVTransferError(f"cannot map the decode worker's kv pool over CUDA IPC: {e}") from e
        if PoolLayout.of(self._remote) != self._remote_layout:
            raise KVTransferError("the mapped kv pool's shape differs from the descriptor's layout")
        self._pool = local_pool
        # one GPU: the copy as a graph replay (None: eager copy_blocks, e.g. after a failed capture)
        self._graphed: GraphedBlockCopy | None = None
        if uses_kernel(local_pool, self._remote, [], []):
            self._graphed = GraphedBlockCopy(local_pool, self._remote)
        self._cond = threading.Condition()
        self._in_flight: _InFlight | None = None  # at most one per connection (the receiver's order)
        self._broken: str | None = None
        self._closing = False
        self._ch = Channel.greet(host, port, timeout, IO_TIMEOUT_S, {"layout": self._layout.to_dict()})
        self._completer = threading.Thread(target=self._complete, name="kv-cuda-ipc-done", daemon=True)
        self._completer.start()

    def send(self, request_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> None:
        trace.mark(request_id, "kv.send")
        check_pair(src_block_ids, dst_block_ids)
        self._layout.check_ids(src_block_ids, "source")
        self._remote_layout.check_ids(dst_block_ids, "destination")
        nbytes = len(src_block_ids) * self._layout.block_nbytes
        src, dst = list(map(int, src_block_ids)), list(map(int, dst_block_ids))
        queued: _InFlight | None = None
        with self._cond:
            self._cond.wait_for(lambda: self._in_flight is None)  # the previous DONE is out
            if self._broken or self._closing:
                raise KVTransferError(f"kv sender to {self._ch.peer} is broken: {self._broken or 'closed'}")
            try:
                begin = {"request_id": request_id, "dst": pack_ids(dst), "nbytes": nbytes}
                self._ch.send(Kind.BEGIN, begin)
                trace.mark(request_id, "kv.begin_sent")
                staged, error = self._prestage(src, dst)  # local work while the receiver answers
                trace.mark(request_id, "kv.prestaged")
                reply = self._ch.expect(Kind.READY)
                trace.mark(request_id, "kv.ready")
                refused = reply.get("error")  # then nothing was written and the connection stays usable
                if refused is None and not error:
                    queued, error = self._copy(request_id, nbytes, src, dst, staged)
                if refused is None and error:
                    self._ch.send(Kind.DONE, {"request_id": request_id, "nbytes": nbytes, **error})
            except KVTransferError as e:
                self._broken = str(e)
                raise
            if refused is not None:
                raise KVTransferError(f"kv receiver refused request {request_id!r}: {refused}")
            if error:
                raise KVTransferError(f"kv copy of request {request_id!r} failed: {error['error']}")
            self._in_flight = queued
            self._cond.notify_all()

    def _prestage(self, src: list[int], dst: list[int]) -> tuple[torch.Tensor | None, dict[str, str]]:
        """Work that needs no grant, done while READY is on its way: across GPUs, the source blocks are
        gathered (on one GPU the graphed copy has nothing to do ahead)."""
        try:  # on the caller's stream: after the forward pass that wrote the blocks
            if self._remote.device == self._pool.device:
                return None, {}
            return gather(self._pool, src), {}
        except RuntimeError as e:
            return None, {"error": f"{type(e).__name__}: {e}"}

    def _copy(
        self, rid: str, nbytes: int, src: list[int], dst: list[int], staged: torch.Tensor | None
    ) -> tuple[_InFlight | None, dict[str, str]]:
        """Queue the write of the mapped pool: (the copy in flight, {}) or (None, {"error": why})."""
        copied = torch.cuda.Event()
        try:
            if self._remote.device == self._pool.device:
                self._copy_one_gpu(src, dst)
                copied.record(torch.cuda.current_stream(self._pool.device))
                trace.mark(rid, "kv.launched")
                return _InFlight(rid, nbytes, copied, staged), {}
            # the decode pool is on another GPU of this host: peer copy, then scatter there
            assert staged is not None
            peer = staged.to(self._remote.device)
            scatter(self._remote, dst, peer)
            copied.record(torch.cuda.current_stream(self._remote.device))
            return _InFlight(rid, nbytes, copied, peer), {}
        except RuntimeError as e:
            return None, {"error": f"{type(e).__name__}: {e}"}

    def _copy_one_gpu(self, src: list[int], dst: list[int]) -> None:
        if self._graphed is not None:
            try:
                self._graphed(src, dst)
                return
            except RuntimeError as e:  # a capture this torch / driver refuses: copy eagerly from now on
                logger.warning("kv copy as a CUDA graph failed (%s): launching it eagerly instead", e)
                self._graphed = None
        copy_blocks(self._pool, src, self._remote, dst)

    def _complete(self) -> None:
        """The completion thread: wait for each queued copy, then send its DONE."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._in_flight is not None or self._closing)
                item = self._in_flight
                if item is None:
                    return
            done: dict[str, Any] = {"request_id": item.request_id, "nbytes": item.nbytes}
            try:
                item.copied.synchronize()  # releases the GIL
            except RuntimeError as e:
                done["error"] = f"{type(e).__name__}: {e}"
            trace.mark(item.request_id, "kv.copied")
            try:
                self._ch.send(Kind.DONE, done)
            except KVTransferError as e:  # the receiver fails the request when the socket drops
                with self._cond:
                    self._broken = str(e)
            trace.mark(item.request_id, "kv.done_sent")
            with self._cond:
                self._in_flight = None
                self._cond.notify_all()

    def close(self) -> None:
        """Waits for the copy in flight (its DONE goes out), then closes the connection."""
        with self._cond:
            if self._closing:
                return
            self._cond.wait_for(lambda: self._in_flight is None, timeout=IO_TIMEOUT_S)
            self._closing = True
            self._cond.notify_all()
        self._completer.join(timeout=IO_TIMEOUT_S)
        self._ch.close()
        self._remote = None  # type: ignore[assignment]
