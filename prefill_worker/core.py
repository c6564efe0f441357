"""The prefill worker's engine (runs in the engine process; see serving/engine_proc.py).

Each request is "compute the prompt, sample one token": it reuses this worker's prefix cache, is batched
and chunked with other prompts by the ordinary scheduler, and when its last chunk has run, its blocks go
to the decode worker's reserved blocks through kvtransfer before the scheduler lets go of them. The
blocks then stay here as prefix cache. A failed transfer fails only that request.

Messages (serving/messages/): PrefillPrompt, then Grant when it came without its blocks; FirstToken goes out
mid-step as soon as the token is sampled, KVSent once the blocks are written.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable

from engine import trace
from engine.engine_core import EngineCore
from engine.scheduler import SchedulerOutput
from engine.stats import HistogramSnapshot
from kvtransfer import KVSender, KVTransferError
from kvtransfer.stats import TransferStats
from kvtransfer.tp import connect_sharded
from serving.engine_proc import embedded, id_list, prompt_logprobs_of
from serving.kv_events import KVEventPublisher
from serving.messages.from_engine import Error, FirstToken, FromEngine, KVEvents, KVSent, Snapshot
from serving.messages.to_engine import Abort, Embed, Grant, PrefillPrompt, TakeSnapshot, ToEngine
from serving.worker_config import WorkerConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Job:
    descriptor: dict
    sender_key: str  # the descriptor's canonical JSON: one sender per decode worker
    dst_block_ids: list[int] | None  # None: the decode worker's grant has not come yet
    need: int  # blocks of the prompt
    kv_token: str = ""  # the decode worker's token for those blocks: the receiver admits a write showing it
    error: str | None = None
    # computed before the grant came: the held source blocks; `computed` once its step ended (KVSent is due
    # when they are sent)
    parked: list[int] | None = None
    computed: bool = False
    parked_at: float = 0.0
    prepared: bool = False  # the sender holds a grant for it: it ends in send() or release()
    shipped: bool = False  # its KV copy was queued while its last step computed (_during)
    first_sent: bool = False  # its FirstToken went out mid-step


class PrefillCore:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.engine = EngineCore(config.engine)
        self.scheduler = self.engine.scheduler
        self.blocks = self.engine.block_manager
        self.jobs: dict[str, _Job] = {}
        # the pool's bytes per block (fp8: half of bf16's)
        self.kv_stats = TransferStats(config.kv_transport, self.engine.runner.bytes_per_block())
        self.senders: dict[str, KVSender] = {}
        self.outbox: list[FromEngine] = []
        # prefix-cache events for the router's index: every block hashed or evicted here
        self.events = KVEventPublisher(config.worker_id, lambda: list(self.blocks.cached))
        self.blocks.on_event = self.events.on_block_event
        self._send_now: Callable[[list[FromEngine]], None] | None = None
        self._take_inbound: Callable[[Callable[[ToEngine], bool]], list[ToEngine]] | None = None
        self._descriptors: dict[str, tuple[dict, str]] = {}  # kv descriptor JSON -> (parsed, sender key)
        self.embeds: set[str] = set()  # embedding requests (Embed) not yet answered

    def bind(
        self,
        send_now: Callable[[list[FromEngine]], None],
        take_inbound: Callable[[Callable[[ToEngine], bool]], list[ToEngine]] | None = None,
    ) -> None:
        """The engine process's sender (first tokens go out mid-step, before their KV transfer) and its
        mid-step reader (grants that come while a forward pass runs are handled then)."""
        self._send_now = send_now
        self._take_inbound = take_inbound

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
            **self.scheduler.preemption.load(),
        }

    def counters(self) -> dict[str, float]:
        return {**self.engine.counters(), **self.kv_stats.counters()}

    def histograms(self) -> dict[str, HistogramSnapshot]:
        return {**self.engine.histograms(), **self.kv_stats.histograms()}

    def has_work(self) -> bool:
        self._expire_parked()
        return bool(self.scheduler.has_unfinished() or self.outbox)

    def handle(self, msg: ToEngine) -> None:
        if isinstance(msg, PrefillPrompt):
            self._add(msg)
        elif isinstance(msg, Grant):
            self._grant(msg.request_id, msg.dst_block_ids, msg.kv_token)
        elif isinstance(msg, Embed):
            self._embed(msg)
        elif isinstance(msg, Abort):
            self._abort(msg.request_id)
        elif isinstance(msg, TakeSnapshot):
            self.outbox.append(Snapshot(msg.request_id, self.events.snapshot().to_bytes()))
        else:
            raise ValueError(f"a prefill engine takes no {type(msg).__name__}")

    def _add(self, msg: PrefillPrompt) -> None:
        rid, prompt_ids, dst_block_ids = msg.request_id, msg.prompt_token_ids, msg.dst_block_ids
        trace.mark(rid, "pcore.add")
        # the first token only: the decode worker acts on its stops. A request with min_tokens must not get
        # EOS or a stop token here either, so its ignore_eos stays its own and the scheduler bans them
        p = msg.params
        first_only = dataclasses.replace(
            p,
            n=1,
            max_tokens=1,
            stop=None,
            ignore_eos=p.ignore_eos or not p.min_tokens,
            min_tokens=min(p.min_tokens, 1),
        )
        need = -(-len(prompt_ids) // self.blocks.block_size)
        try:
            self.engine.validate(prompt_ids, first_only)  # on the server's array: cheaper than on a list
            if dst_block_ids and len(dst_block_ids) != need:
                raise ValueError(
                    f"{len(prompt_ids)} prompt tokens need {need} blocks, got {len(dst_block_ids)}"
                )
            descriptor, key = self._descriptor(msg.kv_descriptor)
        except ValueError as exc:
            self.outbox.append(Error(rid, "INVALID_ARGUMENT", str(exc)))
            return
        job = self.jobs[rid] = _Job(descriptor, key, list(dst_block_ids) or None, need, msg.kv_token)
        seq = self.engine.make_sequence(rid, id_list(prompt_ids), first_only, msg.priority, msg.cache_salt)
        self.scheduler.add(seq)
        if job.dst_block_ids is not None:
            self._prepare(rid, job)

    def _embed(self, msg: Embed) -> None:
        """An embedding request: the prompt computed with this worker's prefix cache, no KV leaves."""
        try:
            self.engine.validate(msg.prompt_token_ids, msg.params)
            if msg.params.pooling is None:
                raise ValueError("an embedding request needs pooling params")
        except ValueError as exc:
            self.outbox.append(Error(msg.request_id, "INVALID_ARGUMENT", str(exc)))
            return
        ids = id_list(msg.prompt_token_ids)
        self.scheduler.add(
            self.engine.make_sequence(msg.request_id, ids, msg.params, msg.priority, msg.cache_salt)
        )
        self.embeds.add(msg.request_id)

    def _abort(self, rid: str) -> None:
        self.embeds.discard(rid)
        self.scheduler.abort(rid)
        job = self.jobs.pop(rid, None)
        if job is not None and job.parked is not None:
            self.blocks.release(job.parked)
        if job is not None:
            self._release(rid, job)

    def step(self) -> list[FromEngine]:
        if self.scheduler.has_unfinished():
            updated, logprobs = self.engine.step_core(after_run=self._ship, during=self._during)
            for seq in updated:
                if seq.request_id in self.embeds:
                    self.embeds.discard(seq.request_id)
                    self.outbox.append(embedded(seq))
                    continue
                job = self.jobs.get(seq.request_id)
                if job is None:
                    continue
                if not job.first_sent:  # no mid-step sender bound: it goes out with the step
                    first = FirstToken(
                        seq.request_id,
                        seq.output_token_ids[-1],
                        next(iter(logprobs.get(seq.request_id) or []), None),
                        max(seq.num_cached_tokens, 0),
                        prompt_logprobs_of(seq),
                    )
                    self.outbox.append(first)
                    job.first_sent = True
                if job.parked is not None:  # waits for the grant; its blocks stay held
                    job.computed = True
                    continue
                del self.jobs[seq.request_id]
                self._release(seq.request_id, job)  # finished without its transfer (none when sent)
                self.outbox.append(_outcome(seq.request_id, job))
        batch = self.events.flush()
        if batch is not None:
            self.outbox.append(KVEvents(batch.to_bytes()))
        out, self.outbox = self.outbox, []
        return out

    def _during(self, sched: SchedulerOutput) -> None:
        """While the GPU computes the step: take the grants that came meanwhile, then queue the KV copy of
        every prompt this step finishes whose grant is in hand, behind the step's work on the GPU (a sender
        that only queues its copy: cuda_ipc). The copy then starts when the step's sampling ends, not
        after the host has read the tokens and gone through send(): ~0.1 ms of host time per transfer
        off the path, and the copy runs after the tokens' copy to the host, so it delays no first token."""
        self._grants_meanwhile()
        for item in sched.scheduled:
            job = self.jobs.get(item.request_id)
            if not item.sample or job is None or not job.prepared or job.error is not None:
                continue
            assert job.dst_block_ids is not None  # prepared: the grant came
            sender = self.senders.get(job.sender_key)
            if sender is not None and sender.queues_copy:
                job.shipped = True
                self._send(item.request_id, job, item.block_table, job.dst_block_ids)

    def _grants_meanwhile(self) -> None:
        """While the forward pass computes: take the grants that came for requests known here. The decode
        worker reserves its blocks as the prompt reaches this worker, so a grant often arrives just after
        the pass started; handled now, its transfer is prepared (cuda_ipc asks for the write grant) before
        the pass ends, and the send after it need not wait for that round trip."""
        if self._take_inbound is None:
            return
        for msg in self._take_inbound(lambda m: isinstance(m, Grant) and m.request_id in self.jobs):
            try:
                self.handle(msg)
            except Exception as exc:  # as the engine loop treats a message it cannot handle
                logger.exception("engine failed on a grant mid-step")
                assert isinstance(msg, Grant)
                self.outbox.append(Error(msg.request_id, "INTERNAL", f"{type(exc).__name__}: {exc}"))

    def _ship(self, sched: SchedulerOutput, sampled: dict) -> None:
        """Send every prompt finished this step into its decode worker's blocks (the blocks are still held)."""
        for item in sched.scheduled:
            job = self.jobs.get(item.request_id)
            if not item.sample or job is None:
                continue
            seq = self.scheduler.seqs.get(item.request_id)
            if self._send_now is not None and seq is not None and item.request_id in sampled:
                tokens, logprobs = sampled[item.request_id]  # one: the decode worker streams it on now
                cached = max(seq.num_cached_tokens, 0)
                first = FirstToken(item.request_id, tokens[0], logprobs[0], cached, prompt_logprobs_of(seq))
                self._send_now([first])
                job.first_sent = True
            if job.error is not None or job.shipped:
                continue  # a bad grant or a failed copy: fails when this step ends; or queued already
            if job.dst_block_ids is None:  # computed before the decode worker's grant: hold the blocks
                job.parked, job.parked_at = list(item.block_table), time.monotonic()
                self.blocks.hold(job.parked)
                trace.mark(item.request_id, "pcore.parked")
                continue
            self._send(item.request_id, job, item.block_table, job.dst_block_ids)

    def _prepare(self, rid: str, job: _Job) -> None:
        """Ask the decode worker's receiver for the blocks now, while the prompt computes (cuda_ipc's
        grant; a no-op for the other transports), so the transfer does not wait for it."""
        assert job.dst_block_ids is not None
        try:
            self._sender(job).prepare(rid, job.dst_block_ids, job.kv_token)
            job.prepared = True
        except KVTransferError as exc:
            self.kv_stats.failed()
            job.error = f"KV transfer to the decode worker failed: {exc}"
            self._drop_sender(job)

    def _release(self, rid: str, job: _Job) -> None:
        """A prepared request that will not be sent: hand its grant back (the decode worker frees the
        blocks when its own side ends)."""
        if not job.prepared:
            return
        job.prepared = False
        sender = self.senders.get(job.sender_key)
        if sender is not None:
            try:
                sender.release(rid)
            except KVTransferError:
                self._drop_sender(job)  # closing it fails the grant on the decode side

    def _send(self, rid: str, job: _Job, src: list[int], dst: list[int]) -> None:
        trace.mark(rid, "pcore.send")
        job.prepared = False  # send() consumes the grant, or fails it
        started = time.perf_counter()
        try:
            self._sender(job).send(rid, src, dst, job.kv_token)
            trace.mark(rid, "pcore.sent")
            self.kv_stats.moved(len(src), time.perf_counter() - started)
        except KVTransferError as exc:
            self.kv_stats.failed()
            job.error = f"KV transfer to the decode worker failed: {exc}"
            self._drop_sender(job)

    def _grant(self, rid: str, dst_block_ids: tuple[int, ...], kv_token: str = "") -> None:
        """The decode worker reserved the prompt's blocks: send now if the prompt is already computed."""
        job = self.jobs.get(rid)
        if job is None or job.dst_block_ids is not None or job.error is not None:
            return  # aborted meanwhile, or granted already (the first grant stands)
        dst = list(dst_block_ids)
        if len(dst) != job.need:
            job.error = f"the grant holds {len(dst)} blocks, the prompt needs {job.need}"
        else:
            job.dst_block_ids, job.kv_token = dst, kv_token
        if job.parked is None:
            if job.error is None:
                self._prepare(rid, job)
            return  # still computing: _ship sends (or fails) it when its forward pass ends
        if job.error is None:
            self._send(rid, job, job.parked, dst)
        self._unpark(rid, job)

    def _unpark(self, rid: str, job: _Job) -> None:
        assert job.parked is not None
        self.blocks.release(job.parked)
        del self.jobs[rid]
        if job.error is not None or job.computed:
            self.outbox.append(_outcome(rid, job))

    def _expire_parked(self) -> None:
        """A computed prompt whose grant never came: fail it and let its blocks go."""
        now = time.monotonic()
        for rid, job in list(self.jobs.items()):
            waited = now - job.parked_at
            if job.parked is not None and job.computed and waited > self.config.kv_timeout_s:
                job.error = f"the decode worker reserved no blocks within {self.config.kv_timeout_s:g} s"
                self._unpark(rid, job)

    def _descriptor(self, descriptor_json: str) -> tuple[dict, str]:
        """(descriptor, sender key) of a request's kv descriptor. A decode worker sends the same JSON with
        every request, so it is parsed once (ValueError for JSON that is not an object)."""
        known = self._descriptors.get(descriptor_json)
        if known is None:
            descriptor = json.loads(descriptor_json)
            if not isinstance(descriptor, dict):
                raise ValueError(f"kv_descriptor must be a JSON object, got {type(descriptor).__name__}")
            if len(self._descriptors) >= 64:  # decode workers come and go (restarts): keep it bounded
                self._descriptors.clear()
            known = self._descriptors[descriptor_json] = (descriptor, json.dumps(descriptor, sort_keys=True))
        return known

    def _sender(self, job: _Job) -> KVSender:
        sender = self.senders.get(job.sender_key)
        if sender is None:
            sender = connect_sharded(job.descriptor, self.engine.runner, auth=self.config.kv_auth)
            self.senders[job.sender_key] = sender
        return sender

    def _drop_sender(self, job: _Job) -> None:
        sender = self.senders.pop(job.sender_key, None)
        if sender is not None:
            sender.close()


def _outcome(rid: str, job: _Job) -> KVSent | Error:
    """A finished request's last message: its blocks are in the decode worker's pool, or they are not."""
    if job.error is None:
        return KVSent(rid)
    logger.warning("request %s failed: %s", rid, job.error)
    return Error(rid, "UNAVAILABLE", job.error)
