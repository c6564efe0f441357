"""Aggregated routing (router/aggregated.py): with no prefill workers configured, each request goes to the
least busy decode worker with room for it, which prefills it itself; and the router serves without any."""

from __future__ import annotations

from protos import pdserve_pb2 as pb
from router.aggregated import DecodeOnlyRouter
from router.metrics import RouterMetrics
from router.policy import LOCAL_PREFILL
from router.workers import WorkerTable
from serving.kv_events import WorkerLoad


def test_least_busy_decode_worker_with_room_and_its_count_released():
    live = {
        "a": WorkerLoad(role="decode", running_requests=0, free_blocks=1, total_blocks=8),  # no room
        "b": WorkerLoad(role="decode", running_requests=0, free_blocks=8, total_blocks=8),
        "c": WorkerLoad(role="decode", running_requests=0, free_blocks=8, total_blocks=8),
    }
    router = DecodeOnlyRouter(block_size=16, live=lambda: live)
    first = router.route((), 40)  # 3 blocks + 1
    assert (first.prefill_worker, first.decode_worker, first.uncached_tokens) == (LOCAL_PREFILL, "b", 40)
    second = router.route((), 40)  # b has one routed to it now, its report none yet
    assert second.decode_worker == "c"
    router.request_done(first)
    router.request_done(second)
    assert router.route((), 40).decode_worker == "b"


def test_no_live_decode_worker_is_a_decision_without_one():
    assert DecodeOnlyRouter(16, dict).route((), 10).decode_worker is None


def test_a_router_without_prefill_workers_serves_once_a_decode_worker_is_up():
    table = WorkerTable({"d:1": "decode"}, ttl_s=3.0, metrics=RouterMetrics())
    assert table.not_serving_reason() == "no live decode worker (1 known: d:1 not answered yet)"
    table.seen("d:1", pb.WorkerLoad(role="decode", epoch=1, num_free_blocks=8, num_total_blocks=8))
    assert table.not_serving_reason() is None
    disagg = WorkerTable({"p:1": "prefill", "d:1": "decode"}, ttl_s=3.0, metrics=RouterMetrics())
    disagg.seen("d:1", pb.WorkerLoad(role="decode", epoch=1))
    assert disagg.not_serving_reason() == "no live prefill worker (1 known: p:1 not answered yet)"
