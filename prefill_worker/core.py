"""The prefill worker's engine (runs in the engine process; see engine/engine_proc.py).

Each request is "compute the prompt, sample one token": it reuses this worker's prefix cache, is batched
and chunked with other prompts by the ordinary scheduler, and when its last chunk has run, its blocks go
to the decode worker's reserved blocks through kvtransfer before the scheduler lets go of them. The
blocks then stay here as prefix cache. A failed transfer fails only that request.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable

import numpy as np

from engine import trace
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.sequence import SequenceStatus
from engine.worker_config import WorkerConfig
from kvtransfer import KVSender, KVTransferError, connect
from router.events import KVEventPublisher

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Job:
    descriptor: dict
    dst_block_ids: list[int]
    error: str | None = None


class PrefillCore:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.engine = EngineCore(config.engine)
        self.scheduler = self.engine.scheduler
        self.blocks = self.engine.block_manager
        self.jobs: dict[str, _Job] = {}
        self.senders: dict[str, KVSender] = {}
        self.outbox: list[tuple] = []
        # prefix-cache events for the router's index: every block hashed or evicted here
        self.events = KVEventPublisher(config.worker_id, lambda: list(self.blocks.cached))
        self.blocks.on_event = self.events.on_block_event
        self._send_now: Callable[[list[tuple]], None] | None = None

    def bind(self, send_now: Callable[[list[tuple]], None]) -> None:
        """The engine process's sender: first tokens go out mid-step, before their KV transfer."""
        self._send_now = send_now

    def info(self) -> dict:
        return {
            **self.engine.describe(),
            "role": "prefill",
            "worker_id": self.config.worker_id,
            "epoch": self.events.epoch,
        }

    def load(self) -> dict:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_free_blocks": self.blocks.num_free_blocks,
            "num_total_blocks": self.blocks.num_blocks,
        }

    def has_work(self) -> bool:
        return bool(self.scheduler.has_unfinished() or self.outbox)

    def handle(self, msg: tuple) -> None:
        kind, rid = msg[0], msg[1]
        if kind == "prefill":
            self._add(rid, *msg[2:])
        elif kind == "abort":
            seq = self.scheduler.seqs.get(rid)
            if seq is not None:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            self.jobs.pop(rid, None)
        elif kind == "snapshot":
            self.outbox.append(("snapshot", rid, self.events.snapshot().to_bytes()))
        else:
            raise ValueError(f"unknown message {kind!r}")

    def _add(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        salt: str | None,
        descriptor_json: str,
        dst_block_ids: list[int],
    ) -> None:
        trace.mark(rid, "pcore.add")
        prompt_ids = prompt_ids.tolist() if isinstance(prompt_ids, np.ndarray) else list(prompt_ids)
        first_only = dataclasses.replace(params, n=1, max_tokens=1, stop=None, ignore_eos=True)
        need = -(-len(prompt_ids) // self.blocks.block_size)
        try:
            self.engine.validate(prompt_ids, first_only)
            if len(dst_block_ids) != need:
                raise ValueError(
                    f"{len(prompt_ids)} prompt tokens need {need} blocks, got {len(dst_block_ids)}"
                )
            descriptor = json.loads(descriptor_json)
        except ValueError as exc:
            self.outbox.append(("error", rid, "INVALID_ARGUMENT", str(exc)))
            return
        self.jobs[rid] = _Job(descriptor, list(dst_block_ids))
        self.scheduler.add(self.engine.make_sequence(rid, prompt_ids, first_only, 0, salt))

    def step(self) -> list[tuple]:
        if self.scheduler.has_unfinished():
            updated, logprobs = self.engine.step_core(after_run=self._ship)
            for seq in updated:
                job = self.jobs.pop(seq.request_id, None)
                if job is None:
                    continue
                if job.error is not None:
                    self.outbox.append(("error", seq.request_id, "UNAVAILABLE", job.error))
                else:
                    self.outbox.append(
                        (
                            "prefilled",
                            seq.request_id,
                            seq.output_token_ids[-1],
                            logprobs.get(seq.request_id),
                            max(seq.num_cached_tokens, 0),
                        )
                    )
        batch = self.events.flush()
        if batch is not None:
            self.outbox.append(("kv_events", "", batch.to_bytes()))
        out, self.outbox = self.outbox, []
        return out

    def _ship(self, sched: SchedulerOutput, sampled: dict) -> None:
        """Send every prompt finished this step into its decode worker's blocks (the blocks are still held)."""
        for item in sched.scheduled:
            job = self.jobs.get(item.request_id)
            if not item.sample or job is None:
                continue
            seq = self.scheduler.seqs.get(item.request_id)
            if self._send_now is not None and seq is not None and item.request_id in sampled:
                token, logprobs = sampled[item.request_id]  # the decode worker streams it on now
                self._send_now([("first", item.request_id, token, logprobs, max(seq.num_cached_tokens, 0))])
            trace.mark(item.request_id, "pcore.send")
            try:
                self._sender(job.descriptor).send(item.request_id, item.block_table, job.dst_block_ids)
                trace.mark(item.request_id, "pcore.sent")
            except KVTransferError as exc:
                job.error = f"KV transfer to the decode worker failed: {exc}"
                self._drop_sender(job.descriptor)

    def _sender(self, descriptor: dict) -> KVSender:
        key = json.dumps(descriptor, sort_keys=True)
        sender = self.senders.get(key)
        if sender is None:
            sender = self.senders[key] = connect(descriptor, self.engine.runner.kv_cache)
        return sender

    def _drop_sender(self, descriptor: dict) -> None:
        sender = self.senders.pop(json.dumps(descriptor, sort_keys=True), None)
        if sender is not None:
            sender.close()
