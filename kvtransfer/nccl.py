"""nccl: torch.distributed point-to-point, one world of 2 per (prefill, decode) pair; gloo on CPU.

The decode worker hosts one TCPStore and a TCP control server. Each prefill worker that connects gets
its own process group of two (rank 0 = decode, rank 1 = prefill) on a PrefixStore keyed by a random
pair id, built from the backend classes directly, so one decode process holds any number of groups
and never touches torch.distributed's global default group:

    prefill P1 --control TCP--> decode D  <--control TCP-- prefill P2
    P1 <==== group "pair/<id1>" ====> D <==== group "pair/<id2>" ====> P2

    sender                                      receiver (thread per pair)
    HELLO {layout, pair_id}          ->         authenticate (kvtransfer/auth.py), check layout
                                     <-  WELCOME
    both build ProcessGroupNCCL / ProcessGroupGloo(PrefixStore(pair_id, store), rank, 2)
    BEGIN {request_id, dst, nbytes,  ->         begin(); recv into staging buffers on the pool's device
           token}
    per layer chunk: gather, pg.send ==>        per layer chunk: recv, scatter into the pool
                                                (a refused request is still received, then dropped,
                                                 so both sides stay in step); synchronise
                                     <-  ACK {request_id[, error]}

A large transfer goes in layer chunks (`layer_chunks`, the same on both sides). On CUDA the sender's
gather of chunk i+1 then overlaps the send of chunk i, and the receiver's scatter of chunk i the
receive of chunk i+1: the three passes pipeline instead of running one after another (gloo's blocking
ops just run chunk by chunk).

While data moves, both sides watch the control socket (EOF = the peer died or hung up): gloo's
blocking wait runs on a helper thread, NCCL's event is polled; an NCCL group whose peer vanished is
aborted. A sender's close() drops its group, which closes gloo's connections too.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from kvtransfer.auth import NO_AUTH, PeerAuth
from kvtransfer.base import Descriptor, KVSender, KVTransferError
from kvtransfer.layout import HeadRange, Lane, check_pair, field, gather, lane_layouts, scatter
from kvtransfer.registry import TableReceiver, next_begin
from kvtransfer.wire import Channel, Kind

TIMEOUT_S = 60.0  # group setup and one transfer's data


def _backend_for(pool: torch.Tensor) -> str:
    return "nccl" if pool.is_cuda else "gloo"


def _make_group(backend: str, store: Any, rank: int, local_addr: str, timeout: float) -> Any:
    """A standalone 2-rank backend (no global default group): ProcessGroupGloo or ProcessGroupNCCL."""
    td = datetime.timedelta(seconds=timeout)
    try:
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = td
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_addr)]
            return dist.ProcessGroupGloo(store, rank, 2, opts)
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = td
        return dist.ProcessGroupNCCL(store, rank, 2, nccl_opts)
    except (RuntimeError, AttributeError) as e:
        raise KVTransferError(f"cannot build the {backend} group (rank {rank}): {e}") from e


CHUNK_MIN_BYTES = 32 * 2**20  # below this a transfer goes whole: more NCCL ops would cost more than they hide
MAX_CHUNKS = 4


def layer_chunks(num_layers: int, nbytes: int) -> list[tuple[int, int]]:
    """The [l0, l1) layer ranges a transfer of nbytes moves as, one send/recv each; both sides compute it
    from the layout and BEGIN's nbytes. PDSERVE_KV_CHUNK_MIN_BYTES (both sides alike) overrides the size
    from which a transfer is chunked (the tests use 0 to chunk small transfers)."""
    threshold = int(os.environ.get("PDSERVE_KV_CHUNK_MIN_BYTES", CHUNK_MIN_BYTES))
    count = min(MAX_CHUNKS, num_layers) if nbytes >= threshold else 1
    bounds = [num_layers * i // count for i in range(count + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(count) if bounds[i] < bounds[i + 1]]


def _complete(work: Any, pg: Any, ch: Channel, cuda: bool, timeout: float) -> None:
    """Wait for a send/recv (on CUDA: and everything queued on the current stream before this call);
    raise KVTransferError if it fails, times out, or the peer disappears.

    The control socket is watched while waiting: EOF there means the peer is gone or gave up. gloo's
    wait blocks (and a group cannot be woken from another thread), so it runs on a helper thread that
    also holds the last reference to `pg`; NCCL's wait only orders the stream, so its event is polled.
    `work` None (CUDA only): just the current stream's work.
    """
    if cuda:
        try:
            if work is not None:
                work.wait()
        except RuntimeError as e:
            raise KVTransferError(f"kv transfer with {ch.peer} failed: {e}") from e
        event = torch.cuda.Event()
        event.record()
        finished = event.query
    else:
        done, errors = threading.Event(), []

        def waiter(work: Any = work, pg: Any = pg) -> None:
            try:
                work.wait()
            except RuntimeError as e:
                errors.append(e)
            finally:
                done.set()

        threading.Thread(target=waiter, name="kv-gloo-wait", daemon=True).start()
        finished = done.is_set
    deadline = time.monotonic() + timeout
    while not finished():
        if ch.peer_closed():
            raise KVTransferError(f"kv peer {ch.peer} disconnected mid-transfer")
        if time.monotonic() > deadline:
            raise KVTransferError(f"kv transfer with {ch.peer} timed out after {timeout:g} s")
        time.sleep(20e-6 if cuda else 1e-3)
    if not cuda and errors:
        raise KVTransferError(f"kv transfer with {ch.peer} failed: {errors[0]}") from errors[0]


def _abort(pg: Any) -> None:
    """Tear down an NCCL group (a pending NCCL op never ends by itself when its peer vanished), so no
    NCCL thread outlives the pair. gloo groups close their connections when dropped."""
    abort = getattr(pg, "abort", None) if isinstance(pg, getattr(dist, "ProcessGroupNCCL", ())) else None
    if abort is not None:
        with contextlib.suppress(RuntimeError):
            abort()


def _check_pair_id(hello: dict[str, Any]) -> None:
    pair_id = hello.get("pair_id")
    if not isinstance(pair_id, str) or not pair_id.isalnum():
        raise KVTransferError(f"bad pair id {pair_id!r}")


class NcclKVReceiver(TableReceiver):
    transport = "nccl"

    def _open(self, host: str) -> None:
        self._backend = _backend_for(self.pool)
        td = datetime.timedelta(seconds=TIMEOUT_S)
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=td)

    def _fields(self) -> Descriptor:
        return {"backend": self._backend, "store_port": self._store.port}

    def _serve(self, ch: Channel) -> None:
        hello = self._welcome(ch, _check_pair_id)
        if hello is None:
            return
        heads = HeadRange.from_meta(hello.get("heads"), self.layout)  # every head, or a lane's share
        pair_id = hello["pair_id"]
        store = dist.PrefixStore(f"pdserve-kv/{pair_id}", self._store)
        pg = _make_group(self._backend, store, 0, ch.sock.getsockname()[0], TIMEOUT_S)
        if self.pool.is_cuda:
            torch.cuda.set_device(self.pool.device)
        stream = torch.cuda.Stream(self.pool.device) if self.pool.is_cuda else None
        try:
            while True:
                msg = next_begin(ch, TIMEOUT_S)
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    self._receive(ch, pg, msg.meta, heads)
        finally:  # the pair ends: the sender hung up, failed, or the receiver closed
            _abort(pg)

    def _receive(self, ch: Channel, pg: Any, meta: dict[str, Any], heads: HeadRange) -> None:
        rid, nbytes = str(meta.get("request_id")), meta.get("nbytes")
        block_nbytes = self.layout.part(heads.count).block_nbytes
        if (
            not isinstance(nbytes, int)
            or not 0 <= nbytes <= self.layout.num_blocks * block_nbytes
            or nbytes % block_nbytes
        ):
            raise KVTransferError(f"kv peer {ch.peer} announced a bad size {nbytes!r}")
        try:
            dst: tuple[int, ...] | None = self.begin(
                rid, meta.get("dst"), nbytes, meta.get("token", ""), peer=ch.peer, heads=heads
            )
            refusal = None
        except KVTransferError as e:
            dst, refusal = None, str(e)
        cuda = self.pool.is_cuda
        chunks = layer_chunks(self.layout.num_layers, nbytes) if nbytes else []
        per_layer = nbytes // self.layout.num_layers
        bufs = [
            torch.empty((l1 - l0) * per_layer, dtype=torch.uint8, device=self.pool.device)
            for l0, l1 in chunks
        ]
        scatter_now = dst is not None and not self.is_cancelled(rid)
        try:
            if (
                cuda
            ):  # every recv queued at once; each chunk's scatter waits (on the stream) for its recv only
                works = [pg.recv([b], 1, 0) for b in bufs]
                for (l0, l1), buf, work in zip(chunks, bufs, works, strict=True):
                    try:
                        work.wait()
                    except RuntimeError as e:
                        raise KVTransferError(f"kv transfer with {ch.peer} failed: {e}") from e
                    if scatter_now:
                        assert dst is not None
                        scatter(self.pool[l0:l1], dst, buf, heads)
                _complete(None, pg, ch, True, TIMEOUT_S)  # the last recv and scatter, watching the peer
            else:
                for (l0, l1), buf in zip(chunks, bufs, strict=True):
                    _complete(pg.recv([buf], 1, 0), pg, ch, False, TIMEOUT_S)
                    if scatter_now:
                        assert dst is not None
                        scatter(self.pool[l0:l1], dst, buf, heads)
        except KVTransferError as e:
            if dst is not None:
                self.finish(rid, str(e), heads)
            raise
        if dst is not None:
            refusal = self.finish(rid, None, heads)
        ch.send(Kind.ACK, {"request_id": rid, **({"error": refusal} if refusal else {})})


class NcclKVSender(KVSender):
    def __init__(
        self,
        descriptor: Descriptor,
        local_pool: torch.Tensor,
        *,
        timeout: float = 30.0,
        auth: PeerAuth = NO_AUTH,
        lane: Lane | None = None,
    ) -> None:
        self._layout, self._remote, hello = lane_layouts(local_pool, descriptor, lane)
        self._heads = lane.src if lane is not None else None
        backend = field(descriptor, "backend", str)
        if backend != _backend_for(local_pool):
            raise KVTransferError(
                f"the receiver uses {backend!r}, which needs the prefill pool on "
                f"{'CUDA' if backend == 'nccl' else 'the CPU'}; this pool is on {local_pool.device}"
            )
        host = field(descriptor, "host", str)
        store_port = field(descriptor, "store_port", int)
        self._pool = local_pool
        pair_id = uuid.uuid4().hex
        hello = {**hello, "pair_id": pair_id}
        # the group is formed only after the handshake: with an authenticated peer
        self._ch = Channel.greet(host, field(descriptor, "port", int), timeout, TIMEOUT_S, hello, auth)
        td = datetime.timedelta(seconds=timeout)
        try:
            store = dist.TCPStore(host, store_port, is_master=False, timeout=td)
        except RuntimeError as e:
            self._ch.close()
            raise KVTransferError(f"cannot reach the kv receiver's store at {host}:{store_port}: {e}") from e
        prefixed = dist.PrefixStore(f"pdserve-kv/{pair_id}", store)
        self._pg = _make_group(backend, prefixed, 1, self._ch.sock.getsockname()[0], timeout)
        self._stream = torch.cuda.Stream(local_pool.device) if local_pool.is_cuda else None
        self._lock = threading.Lock()
        self._broken: str | None = None

    def send(
        self, request_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int], token: str = ""
    ) -> None:
        check_pair(src_block_ids, dst_block_ids)
        self._layout.check_ids(src_block_ids, "source")
        self._remote.check_ids(dst_block_ids, "destination")
        nbytes = len(src_block_ids) * self._layout.block_nbytes
        dst = [int(b) for b in dst_block_ids]
        meta = {"request_id": request_id, "dst": dst, "nbytes": nbytes, "token": token}
        with self._lock:
            if self._broken:
                raise KVTransferError(f"kv sender to {self._ch.peer} is broken: {self._broken}")
            try:
                self._ch.send(Kind.BEGIN, meta)
                if nbytes:
                    self._push(src_block_ids)
                ack = self._ch.expect(Kind.ACK)
            except KVTransferError as e:
                self._broken = str(e)
                _abort(self._pg)
                self._pg = None
                raise
        if "error" in ack:
            raise KVTransferError(f"kv receiver refused request {request_id!r}: {ack['error']}")

    def _push(self, src: Sequence[int]) -> None:
        nbytes = len(src) * self._layout.block_nbytes
        chunks = layer_chunks(self._layout.num_layers, nbytes)
        if self._stream is None:
            for l0, l1 in chunks:
                buf = gather(self._pool[l0:l1], src, self._heads)
                work = self._pg.send([buf.view(-1).view(torch.uint8)], 0, 0)
                _complete(work, self._pg, self._ch, False, TIMEOUT_S)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self._pool.device))
        with torch.cuda.stream(self._stream):
            # each send waits (NCCL's stream on this one) for its own gather, so the next gather overlaps it
            bufs, works = [], []
            for l0, l1 in chunks:
                bufs.append(gather(self._pool[l0:l1], src, self._heads))
                works.append(self._pg.send([bufs[-1].view(-1).view(torch.uint8)], 0, 0))
            for work in works[:-1]:
                try:
                    work.wait()
                except RuntimeError as e:
                    raise KVTransferError(f"kv transfer with {self._ch.peer} failed: {e}") from e
            _complete(works[-1], self._pg, self._ch, True, TIMEOUT_S)  # bufs live until every send is done

    def close(self) -> None:
        self._ch.close()
        self._pg = None  # dropping the group closes its connections (gloo's abort() does not)


RECEIVER, SENDER = NcclKVReceiver, NcclKVSender  # what create_receiver and connect build
