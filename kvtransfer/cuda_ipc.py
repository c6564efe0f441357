"""cuda_ipc: same host; the prefill worker writes straight into the decode worker's pool.

The decode worker exports its pool once (a CUDA IPC memory handle, in the descriptor as JSON) and
creates its landing counters (kvtransfer.landings: int64 cells in a /dev/shm file, one per connection);
each prefill worker maps both at connect time. Per transfer, under kvtransfer.grants' protocol (the grant
asked for at admission, by `prepare`), `send` copies the blocks into the mapped pool on the caller's
stream and, on the same stream after the copy, writes the transfer's sequence number into its
connection's cell (on one GPU both are one CUDA graph replay: kernels.kv_block_copy.GraphedBlockCopy's
id upload, block-copy kernel and a device-to-host copy of the number), then says DONE {seq} and returns:
the prefill worker's loop goes on while the copy runs, and whatever it queues next on that stream (the
next forward pass, which may rewrite the source blocks) runs after it. The receiver's connection
thread, awake by then, reads its cell (a plain load from its own mapping; it yields the GIL between
reads) and reports the request complete once the cell reaches the DONE's number: the copy's end reaches
the decode worker with no message after it and no CUDA call there. A sender that dies with its copy
queued never writes its cell; the polling thread sees the connection close instead. `dst` travels
packed (wire.pack_ids).
"""

from __future__ import annotations

import base64
import functools
import logging
import os
import threading
import time
from typing import Any

import numpy as np
import torch

from engine import trace
from kernels.kv_block_copy import GraphedBlockCopy
from kvtransfer.auth import NO_AUTH, PeerAuth
from kvtransfer.base import Descriptor, KVTransferError
from kvtransfer.grants import Completion, GrantReceiver, GrantSender
from kvtransfer.landings import MAX_SENDERS, NBYTES, LandingCounters
from kvtransfer.layout import Lane, PoolLayout, copy_blocks, field, gather, lane_layouts, scatter, uses_kernel
from kvtransfer.wire import Channel

logger = logging.getLogger(__name__)

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


LANDING_TIMEOUT_S = 60.0  # a queued copy that has not landed by then fails its request
LANDING_SPIN_S = 0.02  # the receiver polls its cell yielding (~1 us a read) this long, then sleeping 0.1 ms
CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context


class _Landing(Completion):
    """One connection's completion: its cell in the landing counters."""

    def __init__(self, receiver: CudaIpcKVReceiver, slot: int) -> None:
        self._receiver, self._slot = receiver, slot
        self._cells = receiver._landings.cells  # keeps the mapping alive while this thread reads it
        self.welcome = {"slot": slot}

    def landed(self, done: dict[str, Any], ch: Channel) -> str | None:
        seq = done.get("seq")
        if not isinstance(seq, int):
            return "DONE carries no sequence number"
        cells, slot = self._cells, self._slot
        # Polled, yielding the GIL (and the core) between reads: os.sched_yield releases the GIL for the
        # engine thread and returns in about a microsecond. time.sleep(0) would sleep: Linux's 50 us timer
        # slack makes it ~80 us a call here, which a poll loop pays as landing latency (~40 us a transfer on
        # the H200 host). A copy takes at most a few milliseconds; past SPIN_S the
        # loop sleeps between reads. A sender that died with its copy queued shows as the socket closing.
        start = time.monotonic()
        deadline, spin_until = start + LANDING_TIMEOUT_S, start + LANDING_SPIN_S
        polls, pause = 0, os.sched_yield
        while cells[slot] < seq:
            polls += 1
            if polls % 64 == 0:
                now = time.monotonic()
                if ch.peer_closed():
                    return "the sender closed the connection with its copy still queued (it died?)"
                if now > deadline:
                    return f"the copy did not land within {LANDING_TIMEOUT_S:g} s"
                if now > spin_until:
                    pause = functools.partial(time.sleep, 1e-4)
            pause()
        trace.mark(str(done.get("request_id")), "kv.landing_read")
        return None

    def close(self) -> None:
        self._receiver._free_slot(self._slot)


class CudaIpcKVReceiver(GrantReceiver):
    transport = "cuda_ipc"

    def _open(self, host: str) -> None:
        pool = self.pool
        if not pool.is_cuda:
            raise KVTransferError(f"cuda_ipc needs the decode pool on a CUDA device, got {pool.device}")
        from torch.multiprocessing.reductions import reduce_tensor

        self._ipc = encode_ipc_args(reduce_tensor(pool)[1])  # pool must outlive the receiver
        index = pool.device.index if pool.device.index is not None else torch.cuda.current_device()
        self._uuid = _device_uuid(index)
        self._landings = LandingCounters.create()
        self._slots = list(range(MAX_SENDERS - 1, -1, -1))
        self._slots_lock = threading.Lock()

    def _fields(self) -> Descriptor:
        return {"device_uuid": self._uuid, "ipc": self._ipc, "landings": self._landings.path}

    def _open_completion(self, hello: dict[str, Any]) -> Completion:
        with self._slots_lock:
            if not self._slots:
                raise KVTransferError(f"this decode worker already serves {MAX_SENDERS} kv senders")
            slot = self._slots.pop()
        self._landings.cells[slot] = 0  # a new sender counts from 1
        return _Landing(self, slot)

    def _free_slot(self, slot: int) -> None:
        with self._slots_lock:
            self._slots.append(slot)

    def _shutdown(self) -> None:
        super()._shutdown()
        self._landings.close()


class CudaIpcKVSender(GrantSender):
    queues_copy = True

    def __init__(
        self,
        descriptor: Descriptor,
        local_pool: torch.Tensor,
        *,
        timeout: float = 30.0,
        auth: PeerAuth = NO_AUTH,
        lane: Lane | None = None,
    ) -> None:
        ipc, uuid = field(descriptor, "ipc", dict), field(descriptor, "device_uuid", str)
        host, port = field(descriptor, "host", str), field(descriptor, "port", int)
        if not local_pool.is_cuda:
            raise KVTransferError(
                f"cuda_ipc needs the prefill pool on a CUDA device, got {local_pool.device}"
            )
        _, remote_layout, _ = lane_layouts(local_pool, descriptor, lane)  # raises when they cannot exchange
        self._lane = lane
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        index = _local_index(uuid)
        try:
            self._remote = rebuild_cuda_tensor(*decode_ipc_args(ipc, index))
        except RuntimeError as e:
            raise KVTransferError(f"cannot map the decode worker's kv pool over CUDA IPC: {e}") from e
        if PoolLayout.of(self._remote) != remote_layout:
            raise KVTransferError("the mapped kv pool's shape differs from the descriptor's layout")
        self._counters = LandingCounters.attach(field(descriptor, "landings", str))
        self._registered = False
        self._graphed: GraphedBlockCopy | None = None  # one GPU: the copy as a graph replay
        try:
            err = torch.cuda.cudart().cudaHostRegister(
                self._counters.address(), NBYTES, CUDA_HOST_REGISTER_PORTABLE
            )
            if int(err) != 0:
                raise KVTransferError(
                    f"cannot page-lock the landing counters for CUDA (cudaError {int(err)})"
                )
            self._registered = True
            cells = torch.from_numpy(self._counters.cells)
            if not cells.is_pinned():
                raise KVTransferError("this torch does not see the registered landing counters as pinned")
            self._seq = 0  # transfers launched on this connection
            self._seq_dev = torch.zeros(1, dtype=torch.int64, device=self._remote.device)
            self._keep: tuple[torch.Tensor, ...] = ()  # the cross-GPU path's staging, until the next copy
            super().__init__(local_pool, remote_layout, host, port, timeout, {}, auth, lane)
            slot = self._ch.welcome.get("slot")
            if not isinstance(slot, int) or not 0 <= slot < MAX_SENDERS:
                super().close()
                raise KVTransferError(f"kv receiver at {self._ch.peer} gave no landing slot (got {slot!r})")
        except BaseException:
            self._unmap()
            raise
        self._landing = cells[slot : slot + 1]  # written by this sender's stream only
        # whole blocks on one GPU: the block-copy kernel; a lane's share of the heads, or another GPU:
        # gathered here, copied there, scattered into the lane's heads
        self._one_gpu = self._remote.device == local_pool.device and lane is None
        if self._one_gpu and uses_kernel(local_pool, self._remote, [], []):
            self._graphed = GraphedBlockCopy(local_pool, self._remote, landing=self._landing)

    def _stage(self, src: np.ndarray, dst: np.ndarray) -> torch.Tensor | None:
        """Across GPUs, the source blocks are gathered before the grant is waited for (on one GPU the
        graphed copy has nothing to do ahead)."""
        if self._one_gpu:
            return None
        return gather(self._pool, src.tolist(), self._lane.src if self._lane is not None else None)

    def _launch(self, request_id: str, src: np.ndarray, dst: np.ndarray, staged: Any) -> dict[str, Any]:
        self._seq += 1
        if self._one_gpu:
            self._copy_one_gpu(src, dst, self._seq)
        else:  # the decode pool is on another GPU of this host: peer copy, then scatter there
            peer = staged.to(self._remote.device)
            scatter(self._remote, dst.tolist(), peer, self._lane.dst if self._lane is not None else None)
            self._keep = (staged, peer)
            self._mark_landing(self._seq)
        trace.mark(request_id, "kv.copy_queued")
        return {"seq": self._seq}

    def _mark_landing(self, seq: int) -> None:
        """Eagerly: the cell := seq on the decode GPU's current stream, after the copy queued there."""
        with torch.cuda.device(self._remote.device):
            self._seq_dev.fill_(seq)
            self._landing.copy_(self._seq_dev, non_blocking=True)

    def _copy_one_gpu(self, src: np.ndarray, dst: np.ndarray, seq: int) -> None:
        if self._graphed is not None:
            try:
                self._graphed(src, dst, seq)
                return
            except RuntimeError as e:  # a capture this torch / driver refuses: copy eagerly from now on
                logger.warning("kv copy as a CUDA graph failed (%s): launching it eagerly instead", e)
                self._graphed = None
        copy_blocks(self._pool, src.tolist(), self._remote, dst.tolist())
        self._mark_landing(seq)

    def _drain(self) -> None:
        for device in {self._pool.device, self._remote.device}:
            torch.cuda.synchronize(device)

    def _unmap(self) -> None:
        self._graphed = None  # its graph writes the counters
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._counters.address())
            self._registered = False
        self._counters.close()

    def close(self) -> None:
        super().close()
        self._remote = self._landing = None  # type: ignore[assignment]
        self._unmap()


RECEIVER, SENDER = CudaIpcKVReceiver, CudaIpcKVSender  # what create_receiver and connect build
