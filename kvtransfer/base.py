"""The kvtransfer interface: a sender on the prefill side, a receiver on the decode side.

One transfer moves, for every layer and for K and V, the prefill pool's blocks
`src_block_ids[i]` into the decode pool's blocks `dst_block_ids[i]`:

    pool: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    decode_pool[:, :, dst_block_ids[i]] = prefill_pool[:, :, src_block_ids[i]]   for every i

Lifecycle of one request (decode worker D, prefill worker P):

    D: receiver.expect(rid, dst_ids)        reserve-then-announce: only announced blocks can be written
    D -> P (gRPC): prefill(rid, tokens, dst_ids); P learned receiver.descriptor() once, at connect time
    P: sender.prepare(rid, dst_ids)         optional, at admission: asks for the blocks while the forward
                                            pass runs (cuda_ipc), so send() finds the grant waiting
    P: sender.send(rid, src_ids, dst_ids)   returns once D has every byte, else raises KVTransferError
       (or sender.release(rid): a prepared request P will not send after all)
    D: receiver.wait(rid, timeout)          returns once complete, else raises KVTransferError
    D: after wait() or cancel() returned or raised, nothing writes those blocks any more: free or use them.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvtransfer import TRANSPORTS

if TYPE_CHECKING:
    import torch

    from kvtransfer.auth import PeerAuth
    from kvtransfer.layout import Lane

Descriptor = dict[str, Any]  # JSON-able: str / int / float / bool / list / dict only
DoneCallback = Callable[[str, "KVTransferError | None"], None]


class KVTransferError(RuntimeError):
    """A transfer (or setting one up) failed; the request's destination blocks hold no usable data."""


class KVSender(abc.ABC):
    """Prefill side of one (prefill worker, decode worker) pair, made by `connect()`.

    Threads: `send` may be called from any thread; concurrent calls on one sender are serialised
    (one transfer at a time per pair, in call order). Use one sender per decode worker.

    Ownership: the sender reads `local_pool` (the prefill worker's pool, passed to `connect`) and never
    writes it. On CUDA, `send` orders itself after the work already queued on the caller's current
    stream (the forward pass that wrote the blocks). The caller keeps the source blocks unchanged until
    `send` returns; a sender whose `send` only queues the copy queues it on the caller's stream, so
    work queued there afterwards (which may rewrite the blocks) runs after it. The sender owns its sockets / process group / mapped memory; `close`
    (which lets a transfer in flight finish) releases them.

    Failure: a failure seen before `send` returns (peer gone, refused request, bad block ids, timeout)
    raises KVTransferError; one seen after it (an asynchronous sender's copy or DONE) only reaches the
    receiver. Either way the receiver never reports the request complete. After a failure the sender
    may be unusable: close it and `connect` again.
    """

    # send() only queues the copy on the caller's stream and tells the receiver to watch for it (cuda_ipc):
    # the prefill worker calls it while the GPU still computes the step, before it reads the step's tokens
    queues_copy: bool = False

    def prepare(self, request_id: str, dst_block_ids: Sequence[int], token: str = "") -> None:
        """Announce a `send` of these destination blocks to come (when the request is admitted, before its
        forward pass), so a transport that needs the receiver's grant before writing (cuda_ipc) asks for
        it now and `send` does not wait for it. Optional: `send` asks itself when nothing was prepared.
        A prepared request must end in `send` or `release`. Raises KVTransferError (a broken sender)."""
        del request_id, dst_block_ids, token  # the transports that write through the receiver need no grant

    def release(self, request_id: str) -> None:
        """A prepared request will not be sent (cancelled, failed): the receiver stops holding it as
        granted. Idempotent; a no-op for a request never prepared or already sent."""
        del request_id

    @abc.abstractmethod
    def send(
        self, request_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int], token: str = ""
    ) -> None:
        """Move the blocks. Returns once every byte arrived (the receiver confirmed it), or, for a sender
        that only queues the copy (cuda_ipc), once it is queued and the receiver told to wait for it.
        `token` is the one the receiver's `expect` was given for the request (the decode worker hands it
        to the prefill worker it asks); a write without it is refused."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the connection. Idempotent."""

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVReceiver(abc.ABC):
    """Decode side: owns the decode worker's pool as a write target and serves any number of senders.

    Threads: the receiver runs its own daemon threads (one accepting connections, one per connected
    sender); `expect`, `wait`, `cancel`, `descriptor` and `close` may be called from any thread.
    `on_done(request_id, error_or_None)`, when given, runs on a receiver thread as each announced
    request completes or fails: keep it short (put the event on a queue); `wait` still works after it.

    Ownership: the caller keeps allocating blocks; the receiver writes only blocks announced with
    `expect`, only for the request they were announced for. After `wait` or `cancel` returns or raises,
    no write to that request's blocks is in progress or will start, and the receiver has forgotten the
    request: the caller frees or uses the blocks.

    Failure: a request is reported complete only once every byte has arrived (length-checked against
    len(dst_block_ids) * bytes per block); a short read, a dead sender, a closed connection, a
    mismatching block list or a timeout makes `wait` raise KVTransferError, never return.
    """

    @abc.abstractmethod
    def descriptor(self) -> Descriptor:
        """What a prefill worker needs to `connect`: transport, address, pool layout (JSON-able)."""

    @abc.abstractmethod
    def expect(self, request_id: str, dst_block_ids: Sequence[int], token: str = "") -> None:
        """Announce that `request_id` will fill exactly these blocks (in this order), written by the sender
        that shows `token`."""

    @abc.abstractmethod
    def wait(self, request_id: str, timeout: float) -> None:
        """Block until the request's blocks are complete; raise KVTransferError on failure or timeout."""

    @abc.abstractmethod
    def poll(self, request_id: str) -> bool:
        """`wait` that never waits: True (and the request forgotten) once every byte is in the pool, False
        while its transfer is still expected or under way; KVTransferError (forgotten) if it failed."""

    @abc.abstractmethod
    def cancel(self, request_id: str, wait: bool = True) -> bool:
        """Forget the request (client gone); a transfer for it is refused or stopped. Idempotent.

        Returns True once nothing writes the request's blocks any more (they are the caller's again);
        with a transfer writing them, that takes a word with its sender (cuda_ipc: REVOKE -> RELEASE, or
        the copy landing; raises KVTransferError after CANCEL_GRACE_S). wait=False never blocks: it
        returns False at once when a transfer still writes the blocks, and the request id comes out of
        `drained()` when that write has ended (released, landed, failed, or its sender's connection
        closed); until then the blocks are not the caller's."""

    @abc.abstractmethod
    def drained(self) -> list[str]:
        """Requests cancelled with wait=False whose last write has ended since the last call."""

    @abc.abstractmethod
    def has_drained(self) -> bool:
        """Whether drained() has anything (cheap, no lock)."""

    def refusal_counts(self) -> dict[str, int]:
        """Peers refused so far, by reason: "auth" (did not authenticate), "grant" (wrote what was not
        granted to it)."""
        return {}

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving; every pending request fails. Idempotent."""

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def create_receiver(
    transport: str,
    pool: torch.Tensor,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    advertise_host: str | None = None,
    on_done: DoneCallback | None = None,
    auth: PeerAuth | None = None,
) -> KVReceiver:
    """Start a receiver of `transport` serving `pool` on host:port (port 0: any free port); `auth` says how
    senders must prove themselves (kvtransfer/auth.py; None: they need not)."""
    from kvtransfer.auth import NO_AUTH

    module = _transport(transport, f"unknown kv transport {transport!r}")
    receiver: KVReceiver = module.RECEIVER(
        pool, host=host, port=port, advertise_host=advertise_host, on_done=on_done, auth=auth or NO_AUTH
    )
    return receiver


def connect(
    descriptor: Descriptor,
    local_pool: torch.Tensor,
    *,
    timeout: float = 30.0,
    auth: PeerAuth | None = None,
    lane: Lane | None = None,
) -> KVSender:
    """Connect to the receiver that `descriptor` names; the transport is `descriptor["transport"]`.
    `lane`: send only those KV heads of each block, into those of the receiver's blocks (tensor-parallel
    ranks that split the heads differently: kvtransfer/tp.py); None: every head.

    Raises KVTransferError with the reason for a malformed descriptor, a pool whose layout differs from
    the receiver's (all but num_blocks must match), or a receiver that cannot be reached in `timeout` s.
    """
    if not isinstance(descriptor, dict):
        raise KVTransferError(f"kv descriptor must be a dict, got {type(descriptor).__name__}")
    transport = descriptor.get("transport")
    module = _transport(transport, f"kv descriptor names unknown transport {transport!r}")
    import torch  # the transports need it; the interface alone does not (a worker's server process)

    from kvtransfer.auth import NO_AUTH

    with torch.inference_mode(False):  # a sender's own tensors are updated in place on every send
        extra = {"lane": lane} if lane is not None else {}
        sender: KVSender = module.SENDER(
            descriptor, local_pool, timeout=timeout, auth=auth or NO_AUTH, **extra
        )
    return sender


def _transport(name: object, unknown: str) -> ModuleType:
    """The transport's module (imported on first use: nccl and cuda_ipc pull in what tcp needs not)."""
    if name not in TRANSPORTS:
        raise KVTransferError(f"{unknown}; expected one of {', '.join(TRANSPORTS)}")
    return importlib.import_module(f"kvtransfer.{name}")
