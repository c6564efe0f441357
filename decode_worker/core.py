"""The decode worker's engine (runs in the engine process; see serving/engine_proc.py).

A request's life here (messages: serving/messages/):
  Admit      -> pending: waits until its prompt's blocks can be reserved (bounded queue)
  reserve    -> the prompt's blocks are taken and announced to the KV receiver; BlocksReserved goes out
                so the server asks the prefill worker to fill them
  KVArrived  -> once the receiver has every byte: the prompt counts as computed, the first token (sampled
                by the prefill worker, streamed by the server already) is appended, the sequence joins
                the running batch, and Landed says whether that token ended it
  step       -> continuous batching as in the offline engine; Tokens with each step's new tokens
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

from engine import trace
from engine.engine_core import EngineCore
from engine.sequence import Sequence, SequenceStatus
from engine.stats import HistogramSnapshot
from kvtransfer import KVTransferError
from kvtransfer.stats import TransferStats
from kvtransfer.tp import create_sharded_receiver
from serving.engine_proc import embedded, id_list, prompt_logprobs_of
from serving.messages.from_engine import BlocksReserved, Error, FromEngine, Landed, Tokens
from serving.messages.to_engine import Abort, Admit, Embed, KVArrived, KVFailed, ToEngine
from serving.worker_config import WorkerConfig

logger = logging.getLogger(__name__)


class DecodeCore:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.engine = EngineCore(config.engine)
        self.scheduler = self.engine.scheduler
        self.blocks = self.engine.block_manager
        self.receiver = create_sharded_receiver(
            config.kv_transport, self.engine.runner, host=config.kv_host, auth=config.kv_auth
        )
        address = self.receiver.descriptor()
        logger.info(
            "kv receiver (%s) listening on %s:%d, %s",
            config.kv_transport,
            address["host"],
            address["port"],
            config.kv_auth.describe(),
        )
        # the pool's bytes per block (fp8: half of bf16's)
        self.kv_stats = TransferStats(config.kv_transport, self.engine.runner.bytes_per_block())
        self.pending: deque[Sequence] = deque()
        self.awaiting_kv: dict[str, Sequence] = {}
        # KVArrived came, the receiver has not seen every byte yet: (seq, that message, deadline), checked
        # each step
        self.landing: dict[str, tuple[Sequence, KVArrived, float]] = {}
        # ended while a transfer still wrote their blocks: held until the receiver says it stopped
        self.draining: dict[str, Sequence] = {}
        self.outbox: list[FromEngine] = []
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
            **self.scheduler.preemption.load(),
        }

    def counters(self) -> dict[str, float]:
        refused = {f"kv_transfer_refused/{r}": n for r, n in self.receiver.refusal_counts().items()}
        return {**self.engine.counters(), **self.kv_stats.counters(), **refused}

    def histograms(self) -> dict[str, HistogramSnapshot]:
        return self.engine.histograms()

    def has_work(self) -> bool:
        return bool(
            self.pending
            or self.scheduler.has_unfinished()
            or self.engine.in_flight
            or self.outbox
            or self.landing
            or (self.draining and self.receiver.has_drained())
        )

    # ---- inbound ------------------------------------------------------------------------------------

    def handle(self, msg: ToEngine) -> None:
        if isinstance(msg, Admit):
            self._add(msg)
        elif isinstance(msg, KVArrived):
            self._kv_arrived(msg)
        elif isinstance(msg, KVFailed):
            self._kv_failed(msg.request_id, msg.reason)
        elif isinstance(msg, Abort):
            self._abort(msg.request_id)
        elif isinstance(msg, Embed):  # aggregated serving: embeddings are prefilled here
            self._add(Admit(msg.request_id, msg.prompt_token_ids, msg.params, msg.priority, msg.cache_salt))
        else:
            raise ValueError(f"a decode engine takes no {type(msg).__name__}")

    def _add(self, msg: Admit) -> None:
        rid = msg.request_id
        trace.mark(rid, "dcore.add")
        try:
            # on the server's array: cheaper than on a list
            self.engine.validate(msg.prompt_token_ids, msg.params)
        except ValueError as exc:
            self.outbox.append(Error(rid, "INVALID_ARGUMENT", str(exc)))
            return
        prompt_ids = id_list(msg.prompt_token_ids)
        seq = self.engine.make_sequence(rid, prompt_ids, msg.params, msg.priority, msg.cache_salt)
        if not msg.prefill_remotely or len(prompt_ids) <= self.config.local_prefill_threshold:
            self.scheduler.add(seq)
        elif len(self.pending) >= self.config.max_pending:
            queued = f"decode worker {self.config.worker_id} has {len(self.pending)} requests queued"
            self.outbox.append(Error(rid, "RESOURCE_EXHAUSTED", queued))
        else:
            self.pending.append(seq)

    def _kv_arrived(self, msg: KVArrived) -> None:
        rid = msg.request_id
        trace.mark(rid, "dcore.kv_done")
        seq = self.awaiting_kv.pop(rid, None)
        if seq is None:
            return  # aborted meanwhile
        self.landing[rid] = (seq, msg, time.monotonic() + self.config.kv_timeout_s)
        self._check_landed(rid)

    def _check_landed(self, rid: str) -> None:
        """The prefill worker has sent the prompt's KV: join the batch once the receiver has every byte
        (usually at once: cuda_ipc's copy lands before kv_done crosses gRPC). Never waits: a transfer
        still landing is checked again next step, up to kv_timeout_s."""
        seq, arrived, deadline = self.landing[rid]
        try:
            if not self.receiver.poll(rid):
                if time.monotonic() < deadline:
                    return
                raise KVTransferError(
                    f"not landed {self.config.kv_timeout_s:g} s after the prefill worker sent it"
                )
        except KVTransferError as exc:
            self.kv_stats.failed()
            del self.landing[rid]
            self._drop_transfer(seq)
            self.outbox.append(Error(rid, "UNAVAILABLE", f"KV transfer failed: {exc}"))
            return
        del self.landing[rid]
        self.kv_stats.moved(len(seq.block_table))
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.num_cached_tokens = arrived.num_cached_tokens
        self.blocks.cache_computed_blocks(seq)
        if arrived.first_logprobs is not None:
            seq.logprobs.append(arrived.first_logprobs)
        seq.settle_guide(wait=True)  # structured output: its pattern compiled while the prompt was prefilled
        seq.append_token(arrived.first_token_id)
        self.scheduler.admit_prefilled(seq)
        self.outbox.append(Landed(rid, seq.status.finish_reason, _stop_text(seq)))

    def _kv_failed(self, rid: str, reason: str) -> None:
        seq = self.awaiting_kv.pop(rid, None)
        if seq is None:
            seq = self._unland(rid)
        if seq is not None:
            logger.warning("request %s: its prompt's KV did not arrive: %s", rid, reason)
            self.kv_stats.failed()
            self._drop_transfer(seq)
            self.outbox.append(Error(rid, "UNAVAILABLE", reason))

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
        self.scheduler.abort(rid)

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

    def step(self) -> list[FromEngine]:
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
        if self.scheduler.has_unfinished() or self.engine.in_flight:
            # its KV receiver writes the pool too: frees wait for an overlapped step in flight
            updated, logprobs = self.engine.run_step(hold_frees=True)
            for seq in updated:
                self._emit(seq, logprobs.get(seq.request_id) or [])
        out, self.outbox = self.outbox, []
        return out

    def _reserve(self) -> None:
        """Reserve blocks for pending prompts in arrival order, while the pool allows."""
        while self.pending:
            seq = self.pending[0]
            if not self.blocks.allocate(seq, seq.num_prompt_tokens):
                break
            self.pending.popleft()
            token = secrets.token_hex(16)  # the grant: only the prefill worker handed it may write these
            self.receiver.expect(seq.request_id, list(seq.block_table), token)
            self.awaiting_kv[seq.request_id] = seq
            self.outbox.append(BlocksReserved(seq.request_id, tuple(seq.block_table), token))
            trace.mark(seq.request_id, "dcore.reserved")

    def _emit(self, seq: Sequence, logprobs: list[dict[int, float]]) -> None:
        if seq.params.pooling is not None:
            self.outbox.append(embedded(seq))
            return
        first = seq.num_output_tokens - seq.new_tokens
        self.outbox.append(
            Tokens(
                seq.request_id,
                tuple(seq.output_token_ids[first:]),
                tuple(logprobs),
                seq.status.finish_reason,
                _stop_text(seq),
                max(seq.num_cached_tokens, 0),
                # a prompt prefilled elsewhere had its first token (and these) streamed by the server
                prompt_logprobs_of(seq) if first == 0 else (),
            )
        )


def _stop_text(seq: Sequence) -> str | None:
    return None if seq.stop_reason is None else str(seq.stop_reason)
