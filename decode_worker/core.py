"""The decode worker's engine (runs in the engine process; see serving/engine_proc.py).

A request's life here:
  add        -> pending: waits until its prompt's blocks can be reserved (bounded queue)
  reserve    -> the prompt's blocks are taken and announced to the KV receiver; ("prefill", rid, block_ids)
                goes out so the server asks the prefill worker to fill them
  kv_done    -> every byte arrived: the prompt counts as computed, the first token (sampled by the prefill
                worker) is appended, and the sequence joins the running batch
  step       -> continuous batching as in the offline engine; ("tokens", rid, ...) per new token
Short prompts (up to local_prefill_threshold tokens) skip the transfer and are prefilled here.
Preempted sequences recompute locally. Every path ends in `_end`, which frees the blocks; a request
ended while a transfer still writes its blocks waits in `draining` until the receiver reports the write
stopped (`_collect_drained`), so the loop never waits on a prefill worker.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque

import numpy as np

from engine import trace
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus
from kvtransfer import KVTransferError, create_receiver
from serving.engine_proc import id_list
from serving.worker_config import WorkerConfig

logger = logging.getLogger(__name__)


class DecodeCore:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.engine = EngineCore(config.engine)
        self.scheduler = self.engine.scheduler
        self.blocks = self.engine.block_manager
        self.receiver = create_receiver(config.kv_transport, self.engine.runner.kv_cache, host=config.kv_host)
        self.pending: deque[Sequence] = deque()
        self.awaiting_kv: dict[str, Sequence] = {}
        # kv_done came, the receiver has not seen every byte yet: (seq, first token, its logprobs, cached
        # tokens, deadline), checked each step
        self.landing: dict[str, tuple[Sequence, int, dict[int, float] | None, int, float]] = {}
        # ended while a transfer still wrote their blocks: held until the receiver says it stopped
        self.draining: dict[str, Sequence] = {}
        self.outbox: list[tuple] = []
        self._held_back = False  # the last step sent the outbox and skipped a due forward pass
        self.epoch = secrets.randbits(63) + 1  # a restarted worker is a new worker to the router

    def info(self) -> dict:
        return {
            **self.engine.describe(),
            "role": "decode",
            "worker_id": self.config.worker_id,
            "epoch": self.epoch,
            "kv_descriptor": self.receiver.descriptor(),
            "local_prefill_threshold": self.config.local_prefill_threshold,
        }

    def load(self) -> dict:
        return {
            "num_running": len(self.scheduler.running) + len(self.awaiting_kv) + len(self.landing),
            "num_waiting": len(self.scheduler.waiting) + len(self.pending),
            "num_free_blocks": self.blocks.num_free_blocks,
            "num_total_blocks": self.blocks.num_blocks,
        }

    def has_work(self) -> bool:
        return bool(
            self.pending
            or self.scheduler.has_unfinished()
            or self.outbox
            or self.landing
            or (self.draining and self.receiver.has_drained())
        )

    # ---- inbound ------------------------------------------------------------------------------------

    def handle(self, msg: tuple) -> None:
        kind, rid = msg[0], msg[1]
        if kind == "add":
            self._add(rid, *msg[2:])
        elif kind == "kv_done":
            self._kv_done(rid, *msg[2:])
        elif kind == "kv_failed":
            self._kv_failed(rid, msg[2])
        elif kind == "abort":
            self._abort(rid)
        else:
            raise ValueError(f"unknown message {kind!r}")

    def _add(
        self,
        rid: str,
        prompt_ids: np.ndarray | list[int],
        params: SamplingParams,
        priority: int,
        salt: str | None,
        remote: bool,
    ) -> None:
        trace.mark(rid, "dcore.add")
        try:
            self.engine.validate(prompt_ids, params)  # on the server's array: cheaper than on a list
        except ValueError as exc:
            self.outbox.append(("error", rid, "INVALID_ARGUMENT", str(exc)))
            return
        prompt_ids = id_list(prompt_ids)
        seq = self.engine.make_sequence(rid, prompt_ids, params, priority, salt)
        if not remote or len(prompt_ids) <= self.config.local_prefill_threshold:
            self.scheduler.add(seq)
        elif len(self.pending) >= self.config.max_pending:
            self.outbox.append(
                (
                    "error",
                    rid,
                    "RESOURCE_EXHAUSTED",
                    f"decode worker {self.config.worker_id} has {len(self.pending)} requests queued",
                )
            )
        else:
            self.pending.append(seq)

    def _kv_done(
        self, rid: str, first_token: int, logprobs: dict[int, float] | None, num_cached: int
    ) -> None:
        trace.mark(rid, "dcore.kv_done")
        seq = self.awaiting_kv.pop(rid, None)
        if seq is None:
            return  # aborted meanwhile
        deadline = time.monotonic() + self.config.kv_timeout_s
        self.landing[rid] = (seq, first_token, logprobs, num_cached, deadline)
        self._check_landed(rid)

    def _check_landed(self, rid: str) -> None:
        """The prefill worker has sent the prompt's KV: join the batch once the receiver has every byte
        (usually at once: cuda_ipc's copy lands before kv_done crosses gRPC). Never waits: a transfer
        still landing is checked again next step, up to kv_timeout_s."""
        seq, first_token, logprobs, num_cached, deadline = self.landing[rid]
        try:
            if not self.receiver.poll(rid):
                if time.monotonic() < deadline:
                    return
                raise KVTransferError(
                    f"not landed {self.config.kv_timeout_s:g} s after the prefill worker sent it"
                )
        except KVTransferError as exc:
            del self.landing[rid]
            self._drop_transfer(seq)
            self.outbox.append(("error", rid, "UNAVAILABLE", f"KV transfer failed: {exc}"))
            return
        del self.landing[rid]
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.num_cached_tokens = num_cached
        self.blocks.cache_computed_blocks(seq)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        seq.append_token(first_token)
        self.scheduler.seqs[rid] = seq
        seq.status = SequenceStatus.RUNNING
        self.scheduler.running.append(seq)
        status = self.scheduler._stop_status(seq)
        if status is not None:
            self.scheduler.finish(seq, status)
        self._emit(seq, logprobs)

    def _kv_failed(self, rid: str, reason: str) -> None:
        seq = self.awaiting_kv.pop(rid, None)
        if seq is None:
            seq = self._unland(rid)
        if seq is not None:
            self._drop_transfer(seq)
            self.outbox.append(("error", rid, "UNAVAILABLE", reason))

    def _abort(self, rid: str) -> None:
        seq = self.awaiting_kv.pop(rid, None)
        if seq is None:
            seq = self._unland(rid)
        if seq is not None:
            self._drop_transfer(seq)
            return
        for seq in list(self.pending):
            if seq.request_id == rid:
                self.pending.remove(seq)
                return
        seq = self.scheduler.seqs.get(rid)
        if seq is not None:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def _end(self, seq: Sequence, status: SequenceStatus) -> None:
        self.blocks.free(seq)
        seq.status = status

    def _drop_transfer(self, seq: Sequence) -> None:
        """End a request whose KV has not arrived. Its blocks are freed once nothing writes them: at once,
        or, while a transfer is writing (cuda_ipc: a granted copy), when the receiver reports it stopped
        (`_collect_drained`). The loop never waits for the prefill worker's answer, which a wedged
        prefill worker would hold back for seconds."""
        if self.receiver.cancel(seq.request_id, wait=False):
            self._end(seq, SequenceStatus.FINISHED_ABORTED)
        else:
            seq.status = SequenceStatus.FINISHED_ABORTED
            self.draining[seq.request_id] = seq

    def _unland(self, rid: str) -> Sequence | None:
        waiting = self.landing.pop(rid, None)
        return waiting[0] if waiting is not None else None

    def _collect_drained(self) -> None:
        for rid in self.receiver.drained():
            seq = self.draining.pop(rid, None)
            if seq is not None:
                self.blocks.free(seq)

    # ---- the step -----------------------------------------------------------------------------------

    def step(self) -> list[tuple]:
        self._collect_drained()
        for rid in list(self.landing):
            self._check_landed(rid)
        self._reserve()
        if self.outbox and not self._held_back:
            # Prefill requests for the blocks just reserved and first tokens of prompts prefilled
            # elsewhere leave before this step's forward pass, not after it; but never twice in a
            # row while a batch is running, so a stream of arrivals cannot hold that batch back.
            self._held_back = self.scheduler.has_unfinished()
            out, self.outbox = self.outbox, []
            return out
        self._held_back = False
        if self.scheduler.has_unfinished():
            updated, logprobs = self.engine.step_core()
            for seq in updated:
                self._emit(seq, logprobs.get(seq.request_id))
        out, self.outbox = self.outbox, []
        return out

    def _reserve(self) -> None:
        """Reserve blocks for pending prompts in arrival order, while the pool allows."""
        while self.pending:
            seq = self.pending[0]
            if not self.blocks.allocate(seq, seq.num_prompt_tokens):
                break
            self.pending.popleft()
            self.receiver.expect(seq.request_id, list(seq.block_table))
            self.awaiting_kv[seq.request_id] = seq
            self.outbox.append(("prefill", seq.request_id, list(seq.block_table)))
            trace.mark(seq.request_id, "dcore.reserved")

    def _emit(self, seq: Sequence, logprobs: dict[int, float] | None) -> None:
        self.outbox.append(
            (
                "tokens",
                seq.request_id,
                seq.output_token_ids[-1],
                logprobs,
                seq.status.finish_reason,
                None if seq.stop_reason is None else str(seq.stop_reason),
                max(seq.num_cached_tokens, 0),
            )
        )
