"""Routing policies and the per-request routing path: events in, exact decisions out."""

from __future__ import annotations

import numpy as np
import pytest

from engine.block_hash import LazyBlockHashes
from router.index import InMemoryPrefixIndex
from router.policy import (
    NoWorkersError,
    PrefixRouter,
    RecentWork,
    RoutingDecision,
    RoutingView,
    make_policy,
)
from serving.kv_events import WorkerLoad
from tests.test_router_index import APPLIED, FakeClock, H, stored

BS = 16
PROMPT = np.arange(100, 100 + 40 * BS, dtype=np.int64)


def view(
    matches: dict[str, int],
    queued: dict[str, int],
    num_tokens: int = 10 * BS,
    *,
    decode: dict[str, WorkerLoad] | None = None,
    outstanding: dict[str, int] | None = None,
    decoding: dict[str, int] | None = None,
    recent: dict[str, float] | None = None,
) -> RoutingView:
    prefill = {w: WorkerLoad(queued_tokens=q) for w, q in queued.items()}
    return RoutingView(
        num_tokens, BS, matches, prefill, decode or {}, outstanding or {}, decoding or {}, recent or {}
    )


def test_prefix_aware_takes_the_longest_prefix() -> None:
    policy = make_policy("prefix_aware")
    d = policy.choose(view({"a": 2, "b": 8, "c": 5}, {"a": 0, "b": 0, "c": 0}))
    assert d == RoutingDecision("b", None, 8, 2 * BS)


def test_prefix_aware_weighs_the_queue_against_the_uncached_tokens() -> None:
    policy = make_policy("prefix_aware", per_token_cost=1.0)
    # b saves 2 blocks (32 tokens) over a but has 80 tokens queued: a is cheaper (64+0 < 32+80).
    assert policy.choose(view({"a": 6, "b": 8}, {"a": 0, "b": 80})).prefill_worker == "a"
    # With 20 queued, b is cheaper (32+20 < 64+0).
    assert policy.choose(view({"a": 6, "b": 8}, {"a": 0, "b": 20})).prefill_worker == "b"
    # per_token_cost 3 charges recomputation more: b wins with 80 queued (96+80 < 192+0).
    costly = make_policy("prefix_aware", per_token_cost=3.0)
    assert costly.choose(view({"a": 6, "b": 8}, {"a": 0, "b": 80})).prefill_worker == "b"


def test_prefix_aware_guard_leaves_out_an_overloaded_worker() -> None:
    policy = make_policy("prefix_aware", balance_factor=1.5, balance_slack=100)
    # mean queue 1000 -> limit 1600: b (holding everything) is out, c (least loaded) wins over a.
    d = policy.choose(view({"b": 10}, {"a": 1000, "b": 1700, "c": 300}, num_tokens=4000))
    assert d.prefill_worker == "c"
    assert d.matched_blocks == 0 and d.uncached_tokens == 4000


def test_prefix_aware_share_penalty_moves_work_off_a_hot_worker() -> None:
    policy = make_policy(
        "prefix_aware", per_token_cost=1.0, share_factor=1.2, share_slack=0, share_penalty=4.0
    )
    hot = {"a": 0.0, "b": 3000.0, "c": 0.0}  # b did all the recent work: mean 1000, b is 1800 over
    both = view({"b": 8, "c": 8}, {"a": 0, "b": 0, "c": 0}, recent=hot)
    assert policy.choose(both).prefill_worker == "c"  # c holds the same prefix: free to move
    only_b = view({"b": 9}, {"a": 0, "b": 0, "c": 0}, recent=hot)
    assert policy.choose(only_b).prefill_worker == "a"  # penalty 4 x 160 x 1.8 > the 144 tokens saved
    mild = {"a": 900.0, "b": 1300.0, "c": 800.0}  # b is 100 over 1.2 x mean: penalty 64 < 144 saved
    assert policy.choose(view({"b": 9}, {"a": 0, "b": 0, "c": 0}, recent=mild)).prefill_worker == "b"


def test_ties_go_to_the_least_loaded_then_to_view_order() -> None:
    policy = make_policy("prefix_aware", per_token_cost=1.0)
    assert policy.choose(view({}, {"a": 5, "b": 0, "c": 0})).prefill_worker == "b"
    # a: 64 uncached + 96 queued = b: 160 uncached + 0 queued. Equal cost: the less loaded b wins.
    assert policy.choose(view({"a": 6}, {"a": 96, "b": 0})).prefill_worker == "b"
    # Our own in-flight count counts when the heartbeat has not caught up yet.
    assert policy.choose(view({}, {"a": 0, "b": 0}, outstanding={"a": 10})).prefill_worker == "b"


def test_least_loaded_round_robin_and_random() -> None:
    v = view({"c": 10}, {"a": 7, "b": 3, "c": 9})
    assert make_policy("least_loaded").choose(v).prefill_worker == "b"
    rr = make_policy("round_robin")
    assert [rr.choose(v).prefill_worker for _ in range(4)] == ["b", "c", "a", "b"]
    r1, r2 = make_policy("random", seed=3), make_policy("random", seed=3)
    picks = [r1.choose(v).prefill_worker for _ in range(30)]
    assert picks == [r2.choose(v).prefill_worker for _ in range(30)]
    assert set(picks) == {"a", "b", "c"}


def test_decode_worker_by_room_then_running_batch() -> None:
    decode = {
        "d1": WorkerLoad("decode", running_requests=2, free_blocks=100),
        "d2": WorkerLoad("decode", running_requests=5, free_blocks=900),
        "d3": WorkerLoad("decode", running_requests=1, free_blocks=5),  # no room for 11 blocks
    }
    v = view({}, {"a": 0}, decode=decode)
    assert make_policy("prefix_aware").choose(v).decode_worker == "d1"
    assert (
        make_policy("least_loaded")
        .choose(view({}, {"a": 0}, decode=decode, decoding={"d1": 6}))
        .decode_worker
        == "d2"
    )
    full = {w: WorkerLoad("decode", 1, r, 3) for w, r in (("d1", 4), ("d2", 2))}
    assert make_policy("prefix_aware").choose(view({}, {"a": 0}, decode=full)).decode_worker == "d2"


def test_make_policy_rejects_unknown_names_and_bad_parameters() -> None:
    with pytest.raises(ValueError, match="known: least_loaded, prefix_aware, random, round_robin"):
        make_policy("fastest")
    with pytest.raises(ValueError):
        make_policy("prefix_aware", balance_factor=0.5)
    with pytest.raises(ValueError):
        make_policy("prefix_aware", per_token_cost=0)


def test_recent_work_decays_and_survives_rescaling() -> None:
    clock = FakeClock()
    recent = RecentWork(window_s=10.0, clock=clock)
    recent.add("a", 100.0)
    clock.now += 10.0
    recent.add("b", 100.0)
    assert recent.decayed() == pytest.approx({"a": 100 / 2.718281828, "b": 100.0})
    clock.now += 10.0 * 600  # far past exp()'s range: rescaled, not overflowed
    recent.add("a", 1.0)
    assert recent.decayed() == pytest.approx({"a": 1.0, "b": 0.0})


def fleet(clock: FakeClock) -> tuple[InMemoryPrefixIndex, PrefixRouter]:
    index = InMemoryPrefixIndex(heartbeat_ttl=2.0, clock=clock)
    for w in ("p0", "p1", "p2"):
        index.heartbeat(w, 1, WorkerLoad())
    index.heartbeat("d0", 1, WorkerLoad("decode", free_blocks=1000))
    router = PrefixRouter(index, make_policy("prefix_aware"), block_size=BS, speculate_ttl=1.0, clock=clock)
    return index, router


def test_router_sends_a_shared_prefix_to_the_worker_that_holds_it() -> None:
    clock = FakeClock()
    index, router = fleet(clock)
    assert index.apply(stored("p1", 1, 1, *H[:6])) is APPLIED
    assert index.apply(stored("p2", 1, 1, *H[:2])) is APPLIED
    d = router.route(H[:8], 8 * BS + 3)
    assert d == RoutingDecision("p1", "d0", 6, 2 * BS + 3)
    router.prefill_done(d)
    router.request_done(d)
    # A new prompt nobody holds goes to the least loaded prefill worker, in id order on ties.
    assert router.route([H[11]], BS + 1).prefill_worker == "p0"


def test_speculation_keeps_a_burst_together_until_events_arrive() -> None:
    clock = FakeClock()
    index, router = fleet(clock)
    first = router.route(H[:10], 10 * BS)
    assert first.prefill_worker == "p0" and first.matched_blocks == 0
    router.prefill_done(first)  # done, but its BlockStored events have not reached the index
    second = router.route(H[:10], 10 * BS)
    assert (second.prefill_worker, second.matched_blocks) == ("p0", 10)
    clock.now += 1.5  # the speculation expired unconfirmed: p0 holds nothing as far as we know
    for w in ("p0", "p1", "p2"):
        index.heartbeat(w, 1, WorkerLoad())
    assert index.match(H[:10]) == {}


def test_a_prompt_nobody_holds_is_hashed_past_its_first_block_only_when_speculated() -> None:
    """The router routes with a lazy chain and speculate_later: it hashes one block of a prompt that no
    worker holds before the decision, the rest once it speculates (its own call, or the next decision's)."""
    clock = FakeClock()
    index, router = fleet(clock)
    index.apply(stored("p1", 1, 1, *LazyBlockHashes(PROMPT[: 2 * BS], BS)))
    cold = LazyBlockHashes(PROMPT[2 * BS :], BS)  # no worker holds its first block
    first = router.route(cold, len(cold) * BS, speculate_later=True)
    assert (first.prefill_worker, first.matched_blocks, len(cold._hashes)) == ("p0", 0, 1)
    warm = LazyBlockHashes(PROMPT, BS)  # p1 holds its first two blocks: read up to the third
    second = router.route(warm, len(PROMPT), speculate_later=True)
    assert (second.prefill_worker, second.matched_blocks) == ("p1", 2)
    assert len(cold._hashes) == len(cold)  # the next decision speculated the first one's blocks first
    assert 3 <= len(warm._hashes) < len(warm)
    router.speculate_pending()
    assert len(warm._hashes) == len(warm)
    assert index.match(list(cold)) == {"p0": len(cold)}
    assert index.match(list(warm)) == {"p1": len(warm)}


def test_dead_worker_is_routed_around_and_no_worker_is_an_error() -> None:
    clock = FakeClock()
    index, router = fleet(clock)
    index.apply(stored("p1", 1, 1, *H[:6]))
    clock.now += 1.5
    for w in ("p0", "p2"):
        index.heartbeat(w, 1, WorkerLoad())
    clock.now += 1.0  # p1 silent for 2.5 s > its 2 s TTL
    d = router.route(H[:6], 6 * BS)
    assert d.prefill_worker in ("p0", "p2") and d.matched_blocks == 0
    assert d.decode_worker is None  # the decode worker went silent too
    clock.now += 5.0
    with pytest.raises(NoWorkersError):
        router.route(H[:6], 6 * BS)


def test_policies_that_ignore_the_index_do_not_speculate() -> None:
    clock = FakeClock()
    index, _ = fleet(clock)
    rr = PrefixRouter(index, make_policy("round_robin"), block_size=BS, clock=clock)
    d = rr.route(H[:4], 4 * BS)
    assert d.matched_blocks == 0
    assert index.match(H[:4]) == {}
