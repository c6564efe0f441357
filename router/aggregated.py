"""Aggregated serving: a router configured with no prefill workers sends each request to one decode worker,
which prefills the prompt itself (the decode request's prefill_address is empty, so the worker never waits
for a KV transfer)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

from engine.block_hash import BlockHash
from router.policy import LOCAL_PREFILL, RoutingDecision, RoutingView, least_busy_decode
from serving.kv_events import WorkerLoad


class DecodeOnlyRouter:
    """PrefixRouter's interface over decode workers alone: the least busy one with room for the prompt, no
    index lookups. `live` gives the live workers and their loads (the router's polls). Thread-safe."""

    def __init__(self, block_size: int, live: Callable[[], Mapping[str, WorkerLoad]]) -> None:
        self.block_size = block_size
        self._live = live
        self._lock = threading.Lock()
        self._decoding: dict[str, int] = {}

    def route(
        self, block_hashes: Sequence[BlockHash], num_tokens: int, *, speculate_later: bool = False
    ) -> RoutingDecision:
        """A decision whose decode_worker is None when no decode worker is live (it reads no hashes)."""
        decode = {w: load for w, load in self._live().items() if load.role != "prefill"}
        with self._lock:
            view = RoutingView(num_tokens, self.block_size, {}, {}, decode, decoding=self._decoding)
            worker = least_busy_decode(view)
            if worker is not None:
                self._decoding[worker] = self._decoding.get(worker, 0) + 1
        return RoutingDecision(LOCAL_PREFILL, worker, 0, num_tokens)

    def speculate_pending(self) -> None:
        pass  # no index: nothing to speculate

    def prefill_done(self, decision: RoutingDecision) -> None:
        pass  # the decode worker's own load report counts its prefill work

    def request_done(self, decision: RoutingDecision) -> None:
        if decision.decode_worker is None:
            return
        with self._lock:
            left = self._decoding.get(decision.decode_worker, 0) - 1
            if left > 0:
                self._decoding[decision.decode_worker] = left
            else:
                self._decoding.pop(decision.decode_worker, None)
