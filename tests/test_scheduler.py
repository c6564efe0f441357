"""Scheduler: budgets, chunked prefill, preemption, priorities, n > 1 children — no model needed."""

from engine.block_hash import extra_keys
from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus

BS = 4
EOS = 999


def make(num_blocks=64, **cfg):
    cfg = {"max_num_seqs": 8, "max_num_batched_tokens": 32, "max_model_len": 64, **cfg}
    bm = BlockManager(num_blocks, BS)
    return Scheduler(SchedulerConfig(**cfg), bm, {EOS}), bm


def seq(rid, n_prompt, max_tokens=4, priority=0, arrival=0.0, start=0):
    s = Sequence(
        rid,
        list(range(start, start + n_prompt)),
        SamplingParams(max_tokens=max_tokens),
        BS,
        extra_keys("m"),
        priority=priority,
        arrival_time=arrival,
    )
    return s


def step(sched, token=7):
    out = sched.schedule()
    sampled = {it.request_id: [token] for it in out.scheduled if it.sample}
    sched.postprocess(out, sampled)
    return out


def run_all(sched, limit=200):
    for _ in range(limit):
        if not sched.has_unfinished():
            return
        step(sched)
    raise AssertionError("did not finish")


def test_prefill_then_decode_one_token_each():
    sched, bm = make()
    a = seq("a", 10)
    sched.add(a)
    out = step(sched)
    assert [(it.request_id, len(it.token_ids), it.start_pos, it.sample) for it in out.scheduled] == [
        ("a", 10, 0, True)
    ]
    out = step(sched)
    assert [(len(it.token_ids), it.start_pos) for it in out.scheduled] == [(1, 10)]
    run_all(sched)
    assert a.status == SequenceStatus.FINISHED_LENGTH and a.output_token_ids == [7] * 4
    assert bm.num_free_blocks == bm.num_blocks


def test_chunked_prefill_splits_long_prompt_within_budget():
    sched, _ = make(max_num_batched_tokens=8)
    sched.add(seq("a", 20))
    sched.add(seq("b", 3))
    chunks = [
        [(it.request_id, len(it.token_ids), it.sample) for it in step(sched).scheduled] for _ in range(3)
    ]
    assert chunks == [[("a", 8, False)], [("a", 8, False)], [("a", 4, True), ("b", 3, True)]]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched, _ = make(max_num_batched_tokens=64, enable_chunked_prefill=False)
    sched.add(seq("a", 40))
    sched.add(seq("b", 30, start=100))
    out = step(sched)
    assert [it.request_id for it in out.scheduled] == ["a"]  # b would overflow the budget this step
    out = step(sched)
    assert sorted((it.request_id, len(it.token_ids)) for it in out.scheduled) == [("a", 1), ("b", 30)]


def test_max_num_seqs_caps_the_running_batch():
    sched, _ = make(max_num_seqs=2)
    for r in "abc":
        sched.add(seq(r, 2))
    assert [it.request_id for it in step(sched).scheduled] == ["a", "b"]
    assert len(sched.waiting) == 1


def test_eos_and_stop_token_end_a_request():
    sched, bm = make()
    a = seq("a", 3, max_tokens=10)
    sched.add(a)
    step(sched, token=EOS)
    assert a.status == SequenceStatus.FINISHED_STOPPED and a.output_token_ids == [EOS]
    b = Sequence("b", [1, 2], SamplingParams(max_tokens=10, stop_token_ids=[5]), BS, b"")
    sched.add(b)
    step(sched, token=5)
    assert b.status == SequenceStatus.FINISHED_STOPPED and b.stop_reason == 5
    assert bm.num_free_blocks == bm.num_blocks


def test_preemption_frees_the_newest_and_recomputes_it():
    sched, bm = make(num_blocks=6, max_num_batched_tokens=64)
    a, b = seq("a", 8, max_tokens=12), seq("b", 8, max_tokens=12, start=100)
    sched.add(a)
    sched.add(b)
    step(sched)  # 2 + 2 blocks
    preempted = []
    for _ in range(40):
        if not sched.has_unfinished():
            break
        preempted += step(sched).preempted
    assert preempted and preempted[0] == "b"  # the later arrival goes first
    assert sched.num_preemptions >= 1
    assert a.output_token_ids == [7] * 12 and b.output_token_ids == [7] * 12
    assert bm.num_free_blocks == bm.num_blocks


def test_priority_policy_admits_lowest_value_first_and_preempts_highest():
    sched, _ = make(max_num_seqs=1, scheduling_policy="priority")
    sched.add(seq("low", 2, priority=5, arrival=0.0))
    sched.add(seq("high", 2, priority=-1, arrival=1.0))
    assert [it.request_id for it in step(sched).scheduled] == ["high"]


def test_n_children_wait_for_parent_prompt_then_hit_its_blocks():
    sched, bm = make(max_num_batched_tokens=64)
    parent = seq("p#0", 10)
    child = Sequence("p#1", parent.prompt_token_ids, parent.params, BS, extra_keys("m"), parent=parent)
    sched.add(parent)
    sched.add(child)
    assert [it.request_id for it in step(sched).scheduled] == ["p#0"]
    out = step(sched)
    assert sorted(it.request_id for it in out.scheduled) == ["p#0", "p#1"]
    assert child.num_cached_tokens == 8
    assert child.block_table[:2] == parent.block_table[:2]
    run_all(sched)
    assert bm.num_free_blocks == bm.num_blocks


def test_finish_frees_a_waiting_or_running_request():
    sched, bm = make()
    a, b = seq("a", 4), seq("b", 4)
    sched.add(a)
    step(sched)
    sched.add(b)
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished() and bm.num_free_blocks == bm.num_blocks


def prefilled(bm, s, first_token=7):
    """`s` as a worker has it when its prompt's KV came from another worker: blocks held, prompt computed,
    first token appended."""
    assert bm.allocate(s, s.num_prompt_tokens)
    s.num_computed_tokens = s.num_prompt_tokens
    s.append_token(first_token)
    return s


def test_a_prefilled_request_joins_the_running_batch_in_priority_order():
    """admit_prefilled keeps the policy's order: under memory pressure the preempted request is still the
    lowest-priority one, whichever way it joined."""
    sched, bm = make(num_blocks=7, max_num_batched_tokens=64, scheduling_policy="priority")
    sched.add(seq("low", 8, max_tokens=20, priority=5))
    sched.add(seq("mid", 8, max_tokens=20, priority=1, start=100))
    step(sched)
    urgent = prefilled(bm, seq("urgent", 8, max_tokens=20, priority=-1, start=200))
    sched.admit_prefilled(urgent)
    assert [s.request_id for s in sched.running] == ["urgent", "mid", "low"]
    assert urgent.status == SequenceStatus.RUNNING and sched.seqs["urgent"] is urgent
    preempted = []
    for _ in range(10):
        preempted += step(sched).preempted
        if preempted:
            break
    assert preempted[0] == "low" and "urgent" in [s.request_id for s in sched.running]


def test_a_prefilled_request_whose_first_token_ends_it_is_finished_at_once():
    sched, bm = make()
    s = prefilled(bm, seq("one", 8, max_tokens=1))
    sched.admit_prefilled(s)
    assert s.status == SequenceStatus.FINISHED_LENGTH
    assert not sched.has_unfinished() and "one" not in sched.seqs and bm.num_free_blocks == bm.num_blocks
    eos = prefilled(bm, seq("eos", 8, max_tokens=5), first_token=EOS)
    assert sched.stop_status(eos) == SequenceStatus.FINISHED_STOPPED
    sched.admit_prefilled(eos)
    assert eos.status == SequenceStatus.FINISHED_STOPPED and bm.num_free_blocks == bm.num_blocks


def test_abort_ends_a_held_request_and_ignores_an_unknown_one():
    sched, bm = make()
    sched.add(seq("a", 4))
    step(sched)
    assert sched.abort("a") and not sched.abort("a") and not sched.abort("nobody")
    assert not sched.has_unfinished() and bm.num_free_blocks == bm.num_blocks


def _finish_order(sched, limit=300):
    order = []
    for _ in range(limit):
        if not sched.has_unfinished():
            return order
        out = step(sched)
        order += [it.request_id for it in out.scheduled if sched.seqs.get(it.request_id) is None]
    raise AssertionError("did not finish")


def test_an_urgent_arrival_preempts_a_less_urgent_request_when_max_num_seqs_run():
    sched, bm = make(max_num_seqs=2, scheduling_policy="priority")
    sched.add(seq("a", 4, max_tokens=20, priority=10, arrival=0.0))
    sched.add(seq("b", 4, max_tokens=20, priority=10, arrival=1.0, start=50))
    for _ in range(3):
        step(sched)
    sched.add(seq("urgent", 4, max_tokens=3, priority=0, arrival=2.0, start=100))
    out = step(sched)
    assert out.preempted == ["b"]  # the least urgent: equal priority, the later arrival
    assert "urgent" in [it.request_id for it in out.scheduled]
    order = _finish_order(sched)
    assert order[0] == "urgent" and sorted(order) == ["a", "b", "urgent"]
    assert bm.num_free_blocks == bm.num_blocks


def test_an_urgent_arrival_preempts_when_the_pool_is_full_but_never_an_equal_priority():
    sched, bm = make(num_blocks=8, max_num_seqs=8, scheduling_policy="priority")
    sched.add(seq("a", 13, max_tokens=16, priority=10, arrival=0.0))
    sched.add(seq("b", 13, max_tokens=16, priority=10, arrival=1.0, start=50))
    step(sched)
    assert bm.num_free_blocks == 0  # 14 tokens each: 4 blocks each
    sched.add(seq("same", 8, max_tokens=2, priority=10, arrival=2.0, start=100))
    assert step(sched).preempted == []  # not strictly more urgent: it waits
    sched.add(seq("urgent", 8, max_tokens=2, priority=0, arrival=3.0, start=200))
    out = step(sched)
    assert out.preempted and "urgent" in [it.request_id for it in out.scheduled]
    order = _finish_order(sched)
    assert order[0] == "urgent" and sorted(order) == ["a", "b", "same", "urgent"]
    assert bm.num_free_blocks == bm.num_blocks


def test_one_token_rows_come_first_in_a_mixed_step():
    """A decode row after a prompt chunk in running order is still scheduled first: attention reads the
    leading one-token rows with the decode kernel (engine/attention_metadata.py: num_decode_seqs)."""
    sched, _ = make(max_num_batched_tokens=10, scheduling_policy="priority")
    sched.add(seq("a", 2, max_tokens=8, priority=5))
    step(sched)  # a's prompt
    sched.add(seq("b", 12, priority=0, start=100))
    assert [(it.request_id, len(it.token_ids)) for it in step(sched).scheduled] == [("a", 1), ("b", 9)]
    assert [s.request_id for s in sched.running] == ["b", "a"]  # b, more urgent, runs first
    assert [(it.request_id, len(it.token_ids)) for it in step(sched).scheduled] == [("a", 1), ("b", 3)]
