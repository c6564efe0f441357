"""Continuous batching with chunked prefill, prefix caching and preemption (recompute or swap).

There is no prefill or decode phase: each step gives every request "n more tokens" out of a
shared token budget, running requests first (decodes, then unfinished prefill chunks), waiting
requests after. When the pool runs out, the lowest-priority running request is preempted: its
blocks are freed and it recomputes later (its computed prefix often comes back from the cache), or its
KV moves to the CPU swap space and back when it runs again (engine/preemption.py decides which).
Under the priority policy a waiting request that cannot be admitted (max_num_seqs running, or no
blocks for its first chunk) preempts running requests of strictly lower priority, least urgent first.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from concurrent import futures
from dataclasses import dataclass

import numpy as np
import torch

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.preemption import Preemption
from engine.prompt_checks import banned_by_bad_words
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus
from engine.spec_decode import Proposer, SpecDecodeStats
from engine.stats import EngineStats
from engine.structured_output import allowed_mask, allows_other_than

# where a scheduled token is not known on the host yet (a step in flight samples it), its place in the
# host's inputs; the runner writes the real token on the device before the forward pass reads it
PENDING_TOKEN = 0


@dataclass
class ScheduledSeq:
    """One request's share of a step: what the model runner needs, copied out of the scheduler."""

    request_id: str
    token_ids: list[int]  # the new tokens to run
    start_pos: int  # position of token_ids[0]
    block_table: list[int]
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one
    params: SamplingParams
    generator: torch.Generator | None
    # (prompt ids, output ids) for the sampler's penalties; the sequence's own lists, read before postprocess
    history: tuple[list[int], list[int]] | None = None
    # the last num_draft of token_ids are a speculative draft to verify (engine/spec_decode.py)
    num_draft: int = 0
    # a drafting request's tokens so far (the sequence's own list, read at launch): a draft model computes
    # the positions its KV lacks from them (engine/model_runner.py: DraftModel.catch_up)
    context: list[int] | None = None
    # token ids the sampler must not pick for this token: the stops a request's min_tokens holds back
    banned: tuple[int, ...] = ()
    # prompt logprobs to compute (SamplingParams.prompt_logprobs): (the chunk's first row that needs them, the
    # prompt's next token at each such row), one row a prompt position not computed for them before
    prompt_logprobs: tuple[int, list[int]] | None = None
    # structured output: the tokens the sampled one may be, as int32 words of bits (engine/structured_output.py)
    allowed_mask: np.ndarray | None = None

    @property
    def seq_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    num_batched_tokens: int
    preempted: list[str]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class WaitingQueue:
    """fcfs: arrival order, preempted requests back at the front. priority: lowest (priority, arrival) first."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Sequence] = deque()
        self._heap: list[tuple[int, float, int, Sequence]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._fifo) + len(self._heap)

    def __iter__(self):
        return iter(list(self._fifo) + [item[-1] for item in self._heap])

    def push(self, seq: Sequence, front: bool = False) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (seq.priority, seq.arrival_time, next(self._counter), seq))
        elif front:
            self._fifo.appendleft(seq)
        else:
            self._fifo.append(seq)

    def peek(self) -> Sequence:
        return self._heap[0][-1] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[-1] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, seq: Sequence) -> None:
        if self.policy == "priority":
            self._heap = [item for item in self._heap if item[-1] is not seq]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(seq)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        eos_token_ids: set[int],
        proposer: Proposer | None = None,
        preemption: Preemption | None = None,
    ) -> None:
        # how victims give their blocks back (recompute, or swap with a swap space)
        self.preemption = preemption or Preemption(block_manager)
        self.proposer = proposer  # speculative drafts for decoding requests; None: one token a step
        self.spec_stats = SpecDecodeStats()
        self.num_steps = 0  # steps planned (the draft policy's clock)
        self.eos_token_ids = eos_token_ids
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.chunked_prefill = config.enable_chunked_prefill
        self.policy = config.scheduling_policy
        self.block_manager = block_manager
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Sequence] = []
        self.deferred: list[Sequence] = []  # n > 1 children waiting for their parent's prompt blocks
        self.compiling: list[Sequence] = []  # requests whose structured output's pattern still compiles
        self.num_preemptions = 0
        self.seqs: dict[str, Sequence] = {}  # every unfinished request by id
        # running counts for metrics: prompt tokens first admitted, tokens generated, requests finished
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.finished_by_reason: dict[str, int] = {}
        self.stats = EngineStats()  # latency histograms (engine/stats.py)

    def add(self, seq: Sequence) -> None:
        self.seqs[seq.request_id] = seq
        if not seq.settle_guide(wait=False):  # its structured output still compiling: it waits aside
            self.compiling.append(seq)
        elif seq.parent is not None and self.block_manager.enable_prefix_caching:
            self.deferred.append(seq)
        else:
            self.waiting.push(seq)

    def admit_prefilled(self, seq: Sequence) -> None:
        """Join a request whose prompt was computed elsewhere to the running batch, in the policy's order:
        its blocks hold the prompt's KV (counted in num_computed_tokens) and its first token is appended.
        A first token that ends the request finishes it here."""
        self.seqs[seq.request_id] = seq
        seq.status = SequenceStatus.RUNNING
        seq.prompt_logprobs_planned = len(seq.prompt_logprobs)  # the prefill worker computed them, if asked
        self.stats.scheduled(seq.times, seq.arrival_time)
        self.stats.tokens(seq.times, seq.arrival_time)
        self._insert_running(seq)
        status = self.stop_status(seq)
        if status is not None:
            self.finish(seq, status)

    def abort(self, request_id: str) -> bool:
        """Finish an unfinished request as aborted, freeing its blocks; False if it is not held here."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.running or len(self.waiting) or self.deferred or self.compiling)

    def schedule(self, drafts: bool = True) -> SchedulerOutput:
        """The next step's plan. `drafts=False`: no speculative drafts in it (an overlapped step, planned
        before the tokens a draft would start from are known)."""
        self._release_compiled()
        self._release_deferred()
        self.preemption.poll()
        self.num_steps += 1
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[str] = []
        by_priority = self._preempt_for_priority() if self.policy == "priority" else []
        for seq in list(self.running):
            if budget == 0 or seq.status != SequenceStatus.RUNNING:
                continue
            if seq.num_pending and self._ends_by_length(seq):
                continue  # its token in flight is its last: it finishes once that is known
            num_new = min(seq.num_tokens + seq.num_pending - seq.num_computed_tokens, budget)
            if not self._allocate_or_preempt(seq, num_new, preempted):
                continue
            scheduled.append(self._plan(seq, num_new))
            budget -= num_new
        if not preempted:
            budget = self._admit_waiting(budget, scheduled)
        if self.proposer is not None and drafts:
            budget = self._add_drafts(scheduled, budget)
        # one-token rows first: attention reads them with the decode kernel (engine/attention_metadata.py)
        scheduled.sort(key=lambda it: len(it.token_ids) > 1)
        self.preemption.flush()
        return SchedulerOutput(scheduled, self.max_num_batched_tokens - budget, by_priority + preempted)

    def _preempt_for_priority(self) -> list[str]:
        """Make room for the most urgent waiting request: while it cannot be admitted (max_num_seqs are
        running, or the pool cannot hold its first chunk) and the least urgent running request has a
        strictly lower priority (a larger value), preempt that one. Returns the preempted request ids."""
        preempted: list[str] = []
        bs = self.block_manager.block_size
        while len(self.waiting) and self.running:
            head, victim = self.waiting.peek(), self.running[-1]
            if head.num_pending or victim.priority <= head.priority:
                break
            first_chunk = min(head.num_tokens, self.max_num_batched_tokens)
            full = len(self.running) >= self.max_num_seqs
            if not full and self.block_manager.can_allocate(-(-first_chunk // bs)):
                break
            self._preempt(victim)
            preempted.append(victim.request_id)
        return preempted

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, preempted: list[str]) -> bool:
        while not self.block_manager.allocate(seq, seq.num_computed_tokens + num_new):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is seq:
                return False
        return True

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledSeq]) -> int:
        while len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.peek()
            if seq.num_pending:  # preempted while its last token was in flight: readmitted once it is known
                break
            hits = self.block_manager.match_prefix(seq)
            if seq.wants_prompt_logprobs:  # a hit serves only positions whose logprobs are already had
                hits = hits[: seq.prompt_logprobs_planned // self.block_manager.block_size]
            # a swapped-out request brings back its computed tokens past the hits from the CPU
            num_computed = max(
                len(hits) * self.block_manager.block_size, self.preemption.restorable_tokens(seq)
            )
            num_new = seq.num_tokens - num_computed
            if num_new > budget and not self.chunked_prefill:
                break
            num_new = min(num_new, budget)
            revived = sum(1 for b in hits if self.block_manager.blocks[b].ref_count == 0)
            need = -(-(num_computed + num_new) // self.block_manager.block_size) - len(hits)
            if not self.block_manager.can_allocate(need + revived):
                break
            self.waiting.pop()
            self.block_manager.allocate_prefix(seq, hits)
            self.preemption.restore(seq)
            self.block_manager.allocate(seq, num_computed + num_new)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_computed
                self.block_manager.record_prefix_query(seq.num_tokens, num_computed)
                self.num_prompt_tokens += seq.num_prompt_tokens
            self.stats.scheduled(seq.times, seq.arrival_time)
            seq.status = SequenceStatus.RUNNING
            self._insert_running(seq)
            scheduled.append(self._plan(seq, num_new))
            budget -= num_new
        return budget

    def _insert_running(self, seq: Sequence) -> None:
        if self.policy == "priority":
            key = (seq.priority, seq.arrival_time)
            idx = next((i for i, s in enumerate(self.running) if (s.priority, s.arrival_time) > key), None)
            self.running.insert(len(self.running) if idx is None else idx, seq)
        else:
            self.running.append(seq)

    def _add_drafts(self, scheduled: list[ScheduledSeq], budget: int) -> int:
        """Give the step's decoding requests speculative drafts, out of the budget left once everything
        else is scheduled; returns the budget left after them. Each request's draft length comes from the
        proposer's policy (its acceptance so far against the step's cost, engine/spec_decode.py); with
        none long enough to pay, the step is a plain decode step."""
        assert self.proposer is not None
        candidates = [(item, self.seqs[item.request_id]) for item in scheduled if self._may_draft(item)]
        if not candidates:
            return budget
        threshold = self.proposer.threshold(
            len(scheduled), self.max_num_batched_tokens - budget, len(candidates)
        )
        for item, seq in candidates:
            p = seq.params
            room = min(budget, self.max_model_len - seq.num_tokens - 1)
            if p.max_tokens is not None:  # the target's own token comes on top of the accepted ones
                room = min(room, p.max_tokens - seq.num_output_tokens - 1)
            if self.proposer.max_draft_len is not None:  # a draft model computes positions up to k past it
                room = min(room, self.proposer.max_draft_len - seq.num_tokens)
            k = self.proposer.length(seq.spec_stats, threshold, room)
            draft = self.proposer.propose(seq.all_token_ids, k) if k > 0 else []
            if k > 0:
                if seq.spec_stats is None:
                    seq.spec_stats = SpecDecodeStats()
                seq.spec_stats.observe_lookup(bool(draft))
                seq.spec_stats.tried_at = self.num_steps
            if not draft or not self.block_manager.allocate(seq, seq.num_tokens + len(draft)):
                continue  # no room for the draft's KV: a plain decode row, and nothing preempted for it
            item.token_ids = item.token_ids + draft
            item.num_draft = len(draft)
            item.block_table = list(seq.block_table)
            item.context = seq.all_token_ids
            budget -= len(draft)
        return budget

    def would_draft(self) -> bool:
        """Whether a decode step of the running batch now should draft: the drafts the proposer's policy
        would give its requests are expected to gain more tokens than stepping in order loses. Where they
        would not (a large batch, verification dear against a plain step, low acceptance, lookups that find
        nothing), the engine overlaps its steps instead (engine/engine_core.py: run_step)."""
        if self.proposer is None:
            return False
        rows = [s for s in self.running if s.status == SequenceStatus.RUNNING and not s.params.adjusts_logits]
        if not rows:
            return False
        n = len(self.running)
        threshold = self.proposer.threshold(n, n, len(rows))
        k = self.proposer.config.num_speculative_tokens
        cost = self.proposer.in_order_cost(n)
        if cost is None:
            return False
        gain, unseen = 0.0, None  # unseen: the gain of a request that has not drafted yet (the prior's)
        for s in rows:
            if s.spec_stats is None:
                if unseen is None:
                    unseen = self.proposer.expected_gain(None, threshold, k)
                gain += unseen
            else:
                idle = self.num_steps - s.spec_stats.tried_at
                gain += self.proposer.expected_gain(s.spec_stats, threshold, k, idle)
            if gain > 0 and gain >= cost:
                return True
        return False

    def _may_draft(self, item: ScheduledSeq) -> bool:
        """A request whose logits nothing adjusts (penalties, a logit bias, min_tokens) and whose one token to
        run is its newest (a decode row, or a prompt's last token) may verify a draft with it."""
        seq = self.seqs[item.request_id]
        return (
            item.sample
            and len(item.token_ids) == 1
            and not seq.num_pending
            and not seq.params.adjusts_logits
            and seq.num_computed_tokens + 1 == seq.num_tokens
        )

    def _plan(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        token_ids = seq.all_token_ids[start : start + num_new]
        if len(token_ids) < num_new:  # the last one is the token a step in flight samples
            token_ids.append(PENDING_TOKEN)
        sample = start + num_new == seq.num_tokens + seq.num_pending
        mask = None
        # the engine steps in order: the guide has every output token (since the reasoning's end, where it waits)
        if sample and seq.guide is not None and seq.reasoning_end_id is None:
            mask = allowed_mask(seq.guide, seq.guide_words)
        elif sample and seq.guide_failed:  # its pattern did not compile: end at once (stop_status: aborted)
            mask = np.zeros(seq.guide_words, dtype=np.int32)
            eos = min(self.eos_token_ids)
            mask[eos // 32] = np.int32(np.uint32(1 << (eos % 32)).view(np.int32))
        banned = self._banned(seq)
        if mask is not None and banned and not allows_other_than(mask, banned):
            # the pattern allows only tokens min_tokens or bad_words hold back (EOS where a match ends): the
            # pattern wins, else the row has no token left and the sampler would pick one outside it
            banned = ()
        prompt = None
        if seq.wants_prompt_logprobs:
            first = max(start, seq.prompt_logprobs_planned)
            end = min(start + num_new, len(seq.prompt_logprobs))
            if first < end:
                prompt = (first - start, seq.prompt_token_ids[first + 1 : end + 1])
                seq.prompt_logprobs_planned = end
        return ScheduledSeq(
            request_id=seq.request_id,
            token_ids=token_ids,
            start_pos=start,
            block_table=list(seq.block_table),
            sample=sample,
            params=seq.params,
            generator=seq.generator,
            history=(seq.prompt_token_ids, seq.output_token_ids),
            banned=banned,
            prompt_logprobs=prompt,
            allowed_mask=mask,
        )

    def _banned(self, seq: Sequence) -> tuple[int, ...]:
        """The tokens the token sampled next may not be: the stops (stop tokens, and EOS unless ignored) while
        the request has fewer than min_tokens output tokens (a token still on the device counts), as vLLM; and
        the bad words' last tokens that would complete one (the engine steps in order while a request has bad
        words, so its output is all on the host here)."""
        params = seq.params
        bad = tuple(banned_by_bad_words(seq.bad_words_ids, seq.output_token_ids)) if seq.bad_words_ids else ()
        if seq.num_output_tokens + seq.num_pending >= params.min_tokens:
            return bad
        eos = () if params.ignore_eos else tuple(sorted(self.eos_token_ids))
        return tuple(params.stop_token_ids or ()) + eos + bad

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.preemption.preempt(seq)
        seq.status = SequenceStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.push(seq, front=True)

    def _release_compiled(self) -> None:
        """Queue the requests whose patterns have compiled. With nothing else to run, wait a moment for one
        (the engine's loop would otherwise spin through empty steps meanwhile)."""
        if not self.compiling:
            return
        if not self.running and not len(self.waiting):
            futures.wait([s.guide_future for s in self.compiling if s.guide_future is not None], timeout=0.01,
                         return_when=futures.FIRST_COMPLETED)  # fmt: skip
        for seq in list(self.compiling):
            if seq.settle_guide(wait=False):
                self.compiling.remove(seq)
                self.seqs.pop(seq.request_id, None)
                self.add(seq)

    def _release_deferred(self) -> None:
        for seq in list(self.deferred):
            parent = seq.parent
            assert parent is not None
            if parent.is_finished or parent.num_computed_tokens >= parent.num_prompt_tokens:
                self.deferred.remove(seq)
                self.waiting.push(seq)

    def postprocess(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Sequence]:
        """Advance each scheduled request by its chunk, append its sampled tokens, stop what should stop.

        A request that verified a draft brings its accepted draft tokens and the target's token after
        them; the KV of its rejected draft positions is rolled back first, so that only accepted tokens
        are ever hashed for the prefix cache. Tokens are appended one at a time, and one that ends the
        request drops those after it. Returns the requests that got new tokens (finished ones included),
        `seq.new_tokens` saying how many."""
        updated = []
        for item in out.scheduled:
            seq = self.seqs[item.request_id]
            tokens = sampled[item.request_id] if item.sample else []
            rejected = item.num_draft - (len(tokens) - 1) if item.num_draft else 0
            seq.num_computed_tokens += len(item.token_ids) - rejected
            if rejected:
                self.block_manager.free_tail(seq, seq.num_computed_tokens)
            if item.num_draft:
                self.spec_stats.observe(item.num_draft, item.num_draft - rejected)
                if seq.spec_stats is None:
                    seq.spec_stats = SpecDecodeStats()
                seq.spec_stats.observe(item.num_draft, item.num_draft - rejected)
            self.block_manager.cache_computed_blocks(seq)
            if not item.sample:
                continue
            seq.new_tokens = 0
            self.stats.tokens(seq.times, seq.arrival_time)
            for token in tokens:
                seq.append_token(token)
                self.num_generation_tokens += seq.params.pooling is None  # an embedding's token is dropped
                seq.new_tokens += 1
                status = self.stop_status(seq)
                if status is not None:
                    self.finish(seq, status)
                    break
            updated.append(seq)
        self.preemption.poll()  # the step ran after this plan's swap copies: they are done
        return updated

    def stop_status(self, seq: Sequence) -> SequenceStatus | None:
        """How the request's newest token ends it (stop token, EOS, max_tokens, max_model_len), or None."""
        token = seq.output_token_ids[-1]
        params = seq.params
        if params.pooling is not None:  # an embedding request ends with the step that pooled it, as vLLM's
            return SequenceStatus.FINISHED_STOPPED
        # its structured output could not be held: its pattern did not compile, or a token it does not allow was
        # appended (engine/sequence.py)
        if seq.guide_failed:
            return SequenceStatus.FINISHED_ABORTED
        if token in (params.stop_token_ids or ()):
            seq.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        if not params.ignore_eos and token in self.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    # ---- overlapped scheduling (engine/engine_core.py: EngineCore.step_overlapped) ----------------------

    def launched(self, out: SchedulerOutput) -> list[Sequence]:
        """The step is queued on the device: advance every request past its chunk now, its sampled token
        counted as pending, so that the next step can be planned before this one's tokens are known.
        Returns the step's sequences, item by item, for `resolve`."""
        seqs = []
        for item in out.scheduled:
            seq = self.seqs[item.request_id]
            seq.num_computed_tokens += len(item.token_ids)
            seq.num_pending += item.sample
            seqs.append(seq)
        return seqs

    def resolve(
        self, out: SchedulerOutput, seqs: list[Sequence], sampled: dict[str, list[int]]
    ) -> list[Sequence]:
        """A launched step's tokens are known: append them and stop what should stop, as `postprocess`
        does. A request that finished or was aborted meanwhile takes nothing; one preempted meanwhile
        takes its token (computed before its blocks went). Returns the requests that got a token."""
        updated = []
        for item, seq in zip(out.scheduled, seqs):
            seq.num_pending -= item.sample
            if seq.is_finished:
                continue
            if item.sample:
                seq.append_token(sampled[item.request_id][0])  # no drafts here: one token each
                self.num_generation_tokens += seq.params.pooling is None  # an embedding's token is dropped
                seq.new_tokens = 1
                self.stats.tokens(seq.times, seq.arrival_time)
            # every computed position's token is known now (one step is in flight at most): hash them
            self.block_manager.cache_computed_blocks(seq)
            if not item.sample:
                continue
            status = self.stop_status(seq)
            if status is not None:
                self.finish(seq, status)
            updated.append(seq)
        self.preemption.poll()  # the step ran after its plan's swap copies: they are done
        return updated

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether the request reaches max_tokens or max_model_len with its pending tokens."""
        max_tokens = seq.params.max_tokens
        if max_tokens is not None and seq.num_output_tokens + seq.num_pending >= max_tokens:
            return True
        return seq.num_tokens + seq.num_pending >= self.max_model_len

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a request wherever it is and free its blocks."""
        if self.seqs.pop(seq.request_id, None) is not None and status.finish_reason is not None:
            reason = status.finish_reason
            self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
            self.stats.finished(seq.times, seq.arrival_time, seq.num_output_tokens)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.deferred:
            self.deferred.remove(seq)
        elif seq in self.compiling:
            self.compiling.remove(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self.preemption.forget(seq)
        seq.status = status
