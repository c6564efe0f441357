"""cuda_ipc: same host; the prefill worker writes straight into the decode worker's pool.

The decode worker exports its pool once (a CUDA IPC memory handle, in the descriptor as JSON); each
prefill worker maps it at connect time and exports an interprocess CUDA event in its HELLO. Per
transfer, under kvtransfer.grants' protocol (the grant asked for at admission, by `prepare`), `send`
copies the blocks into the mapped pool on the caller's stream (on one GPU:
kernels.kv_block_copy.GraphedBlockCopy, the one-pass block-copy kernel and its ids' upload replayed as
one CUDA graph), records the event after the copy and sends DONE, then returns: the prefill worker's
loop goes on while the copy runs, and whatever it queues next on that stream (the next forward pass,
which may rewrite the source blocks) runs after it. The receiver's connection thread polls the event
(yielding the GIL between polls) and reports the request complete: the copy's end reaches the decode
worker with no message after it. `dst` travels packed (wire.pack_ids).

The event of a process that died with work queued never completes (the poll sees the connection
close instead), and a context torn down otherwise might read as reached; so each connection
also gets a slot in a small counter tensor the decode worker exports beside its pool. The sender's
stream writes the transfer's sequence number there after each copy (DONE carries it), and the
receiver reads the slot after the event: a request is complete only when its number is there.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from typing import Any

import torch

from engine import trace
from kernels.kv_block_copy import GraphedBlockCopy
from kvtransfer.base import Descriptor, DoneCallback, KVTransferError
from kvtransfer.grants import Completion, GrantReceiver, GrantSender
from kvtransfer.layout import PoolLayout, copy_blocks, field, gather, scatter, uses_kernel
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


MAX_SENDERS = 1024  # connections one decode worker serves at once: slots of its landing counters
LANDING_TIMEOUT_S = 60.0  # a queued copy that has not landed by then fails its request


class _Landing(Completion):
    """One connection's completion: the sender's interprocess event, then its landing-counter slot."""

    def __init__(self, receiver: CudaIpcKVReceiver, event: torch.cuda.Event, slot: int) -> None:
        self._receiver, self._event, self._slot = receiver, event, slot
        self._counter = receiver._landings[slot : slot + 1]
        self._read = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self.welcome = {"slot": slot}

    def landed(self, done: dict[str, Any], ch: Channel) -> str | None:
        seq = done.get("seq")
        if not isinstance(seq, int):
            return "DONE carries no sequence number"
        # Polled, not synchronize(): the event of a process that died with the copy queued never
        # completes, and a blocked thread could not see the socket close. sleep(0) hands the GIL to the
        # engine thread between polls; the copy takes at most a few hundred microseconds.
        deadline = time.monotonic() + LANDING_TIMEOUT_S
        polls = 0
        while not self._event.query():
            polls += 1
            if polls % 64 == 0:
                if ch.peer_closed():
                    return "the sender closed the connection with its copy still queued (it died?)"
                if time.monotonic() > deadline:
                    return f"the copy did not land within {LANDING_TIMEOUT_S:g} s"
            time.sleep(0 if polls < 4096 else 1e-4)
        trace.mark(str(done.get("request_id")), "kv.event_reached")
        stream = self._receiver._stream  # never waits on the engine's work
        with torch.cuda.stream(stream):
            self._read.copy_(self._counter, non_blocking=True)
        stream.synchronize()
        reached = int(self._read[0])
        trace.mark(str(done.get("request_id")), "kv.landing_read")
        if reached < seq:
            return f"the copy never landed (counter at {reached}, not {seq}): the sender's process died?"
        return None

    def close(self) -> None:
        self._receiver._free_slot(self._slot)


class CudaIpcKVReceiver(GrantReceiver):
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
        from torch.multiprocessing.reductions import reduce_tensor

        self._ipc = encode_ipc_args(reduce_tensor(pool)[1])  # pool must outlive the receiver
        index = pool.device.index if pool.device.index is not None else torch.cuda.current_device()
        self._uuid = _device_uuid(index)
        self._host = advertise_host or host
        self._landings = torch.zeros(MAX_SENDERS, dtype=torch.int64, device=pool.device)
        self._landings_ipc = encode_ipc_args(reduce_tensor(self._landings)[1])
        self._slots = list(range(MAX_SENDERS - 1, -1, -1))
        self._slots_lock = threading.Lock()
        self._stream = torch.cuda.Stream(pool.device)  # reads the counters; never waits on the engine's work
        super().__init__(pool, on_done, host, port, "kv-cuda-ipc")

    def descriptor(self) -> Descriptor:
        return {
            "transport": "cuda_ipc",
            "host": self._host,
            "port": self._server.port,
            "layout": self.layout.to_dict(),
            "device_uuid": self._uuid,
            "ipc": self._ipc,
            "landings_ipc": self._landings_ipc,
        }

    def _open_completion(self, hello: dict[str, Any]) -> Completion:
        try:
            handle = base64.b64decode(str(hello["event"]), validate=True)
            event = torch.cuda.Event.from_ipc_handle(self.pool.device, handle)
        except (KeyError, ValueError, RuntimeError) as e:
            raise KVTransferError(f"cannot open the sender's interprocess CUDA event: {e!r}") from e
        with self._slots_lock:
            if not self._slots:
                raise KVTransferError(f"this decode worker already serves {MAX_SENDERS} kv senders")
            slot = self._slots.pop()
        with torch.cuda.stream(self._stream):  # a new sender counts from 1
            self._landings[slot].zero_()
        self._stream.synchronize()
        return _Landing(self, event, slot)

    def _free_slot(self, slot: int) -> None:
        with self._slots_lock:
            self._slots.append(slot)


class CudaIpcKVSender(GrantSender):
    def __init__(self, descriptor: Descriptor, local_pool: torch.Tensor, *, timeout: float = 30.0) -> None:
        remote_layout = PoolLayout.from_dict(field(descriptor, "layout", dict))
        ipc, uuid = field(descriptor, "ipc", dict), field(descriptor, "device_uuid", str)
        host, port = field(descriptor, "host", str), field(descriptor, "port", int)
        if not local_pool.is_cuda:
            raise KVTransferError(
                f"cuda_ipc needs the prefill pool on a CUDA device, got {local_pool.device}"
            )
        PoolLayout.of(local_pool).check_peer(remote_layout)
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        index = _local_index(uuid)
        try:
            self._remote = rebuild_cuda_tensor(*decode_ipc_args(ipc, index))
        except RuntimeError as e:
            raise KVTransferError(f"cannot map the decode worker's kv pool over CUDA IPC: {e}") from e
        if PoolLayout.of(self._remote) != remote_layout:
            raise KVTransferError("the mapped kv pool's shape differs from the descriptor's layout")
        try:
            self._landings = rebuild_cuda_tensor(
                *decode_ipc_args(field(descriptor, "landings_ipc", dict), index)
            )
        except RuntimeError as e:
            raise KVTransferError(f"cannot map the decode worker's landing counters: {e}") from e
        self._seq = 0  # transfers launched on this connection
        # one GPU: the copy as a graph replay (None: eager copy_blocks, e.g. after a failed capture)
        self._graphed: GraphedBlockCopy | None = None
        if uses_kernel(local_pool, self._remote, [], []):
            self._graphed = GraphedBlockCopy(local_pool, self._remote)
        # recorded after every copy, on the decode GPU; the receiver waits on it
        with torch.cuda.device(self._remote.device):
            self._copied = torch.cuda.Event(interprocess=True)
            handle = self._copied.ipc_handle()
        self._keep: tuple[torch.Tensor, ...] = ()  # the cross-GPU path's staging, until the next copy
        hello = {"event": base64.b64encode(handle).decode()}
        super().__init__(local_pool, remote_layout, host, port, timeout, hello)
        slot = self._ch.welcome.get("slot")
        if not isinstance(slot, int) or not 0 <= slot < self._landings.numel():
            self.close()
            raise KVTransferError(f"kv receiver at {self._ch.peer} gave no landing slot (got {slot!r})")
        self._landing = self._landings[slot]

    def _stage(self, src: list[int], dst: list[int]) -> torch.Tensor | None:
        """Across GPUs, the source blocks are gathered before the grant is waited for (on one GPU the
        graphed copy has nothing to do ahead)."""
        if self._remote.device == self._pool.device:
            return None
        return gather(self._pool, src)

    def _launch(self, request_id: str, src: list[int], dst: list[int], staged: Any) -> dict[str, Any]:
        if self._remote.device == self._pool.device:
            self._copy_one_gpu(src, dst)
        else:  # the decode pool is on another GPU of this host: peer copy, then scatter there
            peer = staged.to(self._remote.device)
            scatter(self._remote, dst, peer)
            self._keep = (staged, peer)
        trace.mark(request_id, "kv.copy_queued")
        self._seq += 1
        with torch.cuda.device(self._remote.device):  # same stream as the copy: written only after it
            self._landing.fill_(self._seq)
        self._copied.record(torch.cuda.current_stream(self._remote.device))
        return {"seq": self._seq}

    def _copy_one_gpu(self, src: list[int], dst: list[int]) -> None:
        if self._graphed is not None:
            try:
                self._graphed(src, dst)
                return
            except RuntimeError as e:  # a capture this torch / driver refuses: copy eagerly from now on
                logger.warning("kv copy as a CUDA graph failed (%s): launching it eagerly instead", e)
                self._graphed = None
        copy_blocks(self._pool, src, self._remote, dst)

    def _drain(self) -> None:
        self._copied.synchronize()

    def close(self) -> None:
        super().close()
        self._remote = self._landings = self._landing = None  # type: ignore[assignment]
