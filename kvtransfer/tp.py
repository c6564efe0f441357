"""KV transfers between workers whose tensor-parallel ranks split the KV heads differently.

A prefill worker at TP P and a decode worker at TP D hold the same KV heads, split P ways and D ways
(engine/tp/heads.py). The transfer is a set of lanes: each decode rank receives the heads it owns, a
contiguous run at a time, from a prefill rank that holds them, straight into its own pool:

    H = 8 KV heads, P = 2, D = 1:   prefill rank 0 heads 0-3 ──lane──> decode rank 0 heads 0-3
                                    prefill rank 1 heads 4-7 ──lane──> decode rank 0 heads 4-7
    H = 8, P = 1, D = 2:            prefill rank 0 heads 0-3 ──lane──> decode rank 0 heads 0-3 (its 0-3)
                                    prefill rank 0 heads 4-7 ──lane──> decode rank 1 heads 4-7 (its 0-3)

A lane is an ordinary transport connection (tcp, nccl, cuda_ipc) that moves only its heads of each
block (kvtransfer/layout.py: Lane); a receiver takes a request's heads from any number of lanes and
reports it complete once every head has landed (kvtransfer/registry.py). Each rank runs its own lanes:
rank 0 here, the other ranks through their rank process (kvtransfer/tp_rank.py), in step order, so a
lane reads its blocks after the forward pass that wrote them on its rank. With P = D = 1 none of this
exists: `connect_sharded` and `create_sharded_receiver` return the plain sender and receiver.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.tp.heads import kv_head_ranges
from kvtransfer.auth import NO_AUTH, PeerAuth
from kvtransfer.base import Descriptor, KVReceiver, KVSender, KVTransferError, connect, create_receiver
from kvtransfer.layout import HeadRange, Lane, PoolLayout, field


@dataclass(frozen=True)
class Route:
    """One lane: prefill rank `src_rank` sends `lane.src` of its pool's heads into `lane.dst` of decode
    rank `dst_rank`'s pool."""

    src_rank: int
    dst_rank: int
    lane: Lane


def plan_routes(src: Sequence[range], dst: Sequence[range]) -> list[Route]:
    """The lanes that give each decode rank every KV head it holds. src[p] / dst[d]: the global KV heads
    prefill rank p / decode rank d holds, in its pool's order. A head several prefill ranks hold
    (replicated) comes to decode rank d from the (d mod k)-th of its k holders, spreading the load."""
    routes: list[Route] = []
    for d, heads in enumerate(dst):
        runs: list[list[int]] = []  # [src rank, src start, dst start, count]
        for j, h in enumerate(heads):
            holders = [p for p, held in enumerate(src) if h in held]
            if not holders:
                raise KVTransferError(f"no prefill rank holds kv head {h}")
            p = holders[d % len(holders)]
            i = src[p].index(h)
            last = runs[-1] if runs else None
            if last is not None and last[0] == p and last[1] + last[3] == i and last[2] + last[3] == j:
                last[3] += 1
            else:
                runs.append([p, i, j, 1])
        routes += [Route(p, d, Lane(HeadRange(i, n), HeadRange(j, n))) for p, i, j, n in runs]
    return routes


def decode_ranks(descriptor: Descriptor) -> tuple[int, list[range], list[Descriptor]]:
    """(total KV heads, each decode rank's heads, each decode rank's descriptor) of a receiver's
    descriptor: its "tp" part, or one rank holding every head."""
    tp = descriptor.get("tp")
    if tp is None:
        layout = PoolLayout.from_dict(field(descriptor, "layout", dict))
        return layout.num_kv_heads, [range(layout.num_kv_heads)], [descriptor]
    try:
        total = int(tp["num_kv_heads"])
        heads = [range(int(a), int(a) + int(n)) for a, n in tp["kv_heads"]]
        ranks = list(tp["ranks"])
    except (KeyError, TypeError, ValueError) as e:
        raise KVTransferError(f"kv descriptor has a bad 'tp' part: {e!r}") from e
    if len(heads) != len(ranks) or not all(isinstance(r, dict) for r in ranks):
        raise KVTransferError("kv descriptor's 'tp' part lists a descriptor and kv heads per rank")
    return total, heads, ranks


def runner_ranks(runner: Any) -> tuple[Any, int]:
    """(the other ranks or None, total KV heads) of an engine's model runner."""
    ranks = getattr(runner, "ranks", None)
    shard = getattr(runner, "shard", None)
    total = shard.total_kv_heads if shard is not None else runner.model_config.num_key_value_heads
    return ranks, total


def connect_sharded(
    descriptor: Descriptor, runner: Any, *, timeout: float = 30.0, auth: PeerAuth | None = None
) -> KVSender:
    """The sender from an engine (its model runner) to the receiver `descriptor` names: the plain one
    when neither side splits the KV heads, else one that sends every lane (each lane authenticated)."""
    ranks, total = runner_ranks(runner)
    if ranks is None and "tp" not in descriptor:
        return connect(descriptor, runner.kv_cache, timeout=timeout, auth=auth)
    return ShardedSender(descriptor, runner.kv_cache, ranks, total, timeout=timeout, auth=auth or NO_AUTH)


def create_sharded_receiver(
    transport: str, runner: Any, *, host: str = "127.0.0.1", auth: PeerAuth | None = None
) -> KVReceiver:
    """The receiver of an engine (its model runner): the plain one on one rank, else one whose every
    rank receives its own heads. `auth`: what every sender must prove (kvtransfer/auth.py)."""
    ranks, total = runner_ranks(runner)
    if ranks is None:
        return create_receiver(transport, runner.kv_cache, host=host, auth=auth)
    from kvtransfer.tp_receiver import ShardedReceiver

    return ShardedReceiver(transport, runner.kv_cache, ranks, runner.shard, host=host, auth=auth or NO_AUTH)


class ShardedSender(KVSender):
    """A prefill engine's sender to one decode worker, lane by lane. Threads: the engine's thread only
    (other ranks are reached through their step-ordered pipe)."""

    def __init__(
        self,
        descriptor: Descriptor,
        pool: torch.Tensor,
        ranks: Any,
        total_kv_heads: int,
        *,
        timeout: float,
        auth: PeerAuth = NO_AUTH,
    ) -> None:
        total, dst_heads, dst_descriptors = decode_ranks(descriptor)
        if total != total_kv_heads:
            raise KVTransferError(
                f"the decode worker's model has {total} kv heads, this one {total_kv_heads}"
            )
        src_heads = kv_head_ranges(total, ranks.size if ranks is not None else 1)
        routes = plan_routes(src_heads, dst_heads)
        self.queues_copy = descriptor.get("transport") == "cuda_ipc"
        self._ranks, self._key = ranks, uuid.uuid4().hex
        self._local: list[KVSender] = []
        try:
            for r in routes:
                if r.src_rank == 0:
                    self._local.append(
                        connect(dst_descriptors[r.dst_rank], pool, timeout=timeout, auth=auth, lane=r.lane)
                    )
            remote = [(r.src_rank, dst_descriptors[r.dst_rank], r.lane) for r in routes if r.src_rank]
            self._remote = bool(remote)
            if remote:
                self._ranks.call("connect", self._key, remote, timeout, auth)
        except (RuntimeError, KVTransferError) as e:
            self.close()
            raise KVTransferError(f"cannot connect every kv lane: {e}") from e

    def prepare(self, request_id: str, dst_block_ids: Sequence[int], token: str = "") -> None:
        for sender in self._local:
            sender.prepare(request_id, dst_block_ids, token)
        if self._remote:  # a failure there shows at send
            self._ranks.post("prepare", self._key, request_id, list(dst_block_ids), token)

    def release(self, request_id: str) -> None:
        for sender in self._local:
            sender.release(request_id)
        if self._remote:
            self._ranks.post("release", self._key, request_id)

    def send(
        self, request_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int], token: str = ""
    ) -> None:
        errors: list[str] = []

        def local() -> None:
            for sender in self._local:
                try:
                    sender.send(request_id, src_block_ids, dst_block_ids, token)
                except KVTransferError as e:
                    errors.append(f"rank 0: {e}")

        try:
            if self._remote:
                self._ranks.call("send", self._key, request_id, list(src_block_ids), list(dst_block_ids), token,
                                 during=local)  # fmt: skip
            else:
                local()
        except RuntimeError as e:  # a rank's lane failed, or a rank died
            errors.append(str(e))
        if errors:
            raise KVTransferError("; ".join(errors))

    def close(self) -> None:
        for sender in self._local:
            sender.close()
        self._local = []
        if getattr(self, "_remote", False):
            self._remote = False
            with contextlib.suppress(RuntimeError):  # the ranks are gone, and their senders with them
                self._ranks.post("close_sender", self._key)
