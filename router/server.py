"""gRPC Router service: tokenize, pick a prefill and a decode worker, stream detokenized tokens back.
Configured with no prefill workers, it picks a decode worker alone, which prefills (router/aggregated.py).

Workers are found by address (flags); a poller asks each for its load every `poll_s` and keeps what it
learns in the router's own table (router/workers.py): a worker is routed to from its first answer, and
dropped when it stops answering (at once when nobody listens there, or after `heartbeat_ttl_s` with its
decode stream silent too) or its decode stream breaks. The calls already on a stream go on while it carries
frames: a draining worker refuses polls while its last tokens are still on their way. The prefix index (in
memory or Redis) is heartbeated too and says who holds which blocks; when it fails, routing goes on by load
alone (router/fallback_index.py). `n > 1` fans out into n decode requests (seeds seed, seed+1, ...); the
prefill worker's prefix cache makes the copies cheap.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np

from engine import trace
from engine.block_hash import LazyBlockHashes, extra_keys
from engine.output_processor import TextStream
from engine.sampling_params import SamplingParams, completion_params
from engine.structured_output import THINK_MARKERS
from engine.tokenizer import Tokenizer, compile_chat_template
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.admission import admit, admit_embedding, detokenize, tokenize
from router.aggregated import DecodeOnlyRouter
from router.errors import SHUTTING_DOWN, Stop, decode_failure
from router.fallback_index import FallbackIndex
from router.index import ApplyResult, InMemoryPrefixIndex, PrefixIndex
from router.metrics import RouterMetrics
from router.policy import LOCAL_PREFILL, NoWorkersError, PrefixRouter, RoutingDecision, make_policy
from router.prompts import PromptEncoder
from router.supervise import Failures, run_forever
from router.workers import State, WorkerTable
from serving.grpc_common import params_to_proto
from serving.kv_events import EventBatch, Snapshot
from serving.logs import bind_request, new_request_id
from serving.mux import ManyCall, ManyStream
from serving.tls import PLAINTEXT, TLSConfig

R = TypeVar("R")

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Router"


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    model_dir: str
    served_model_name: str
    policy: str = "prefix_aware"
    redis_url: str | None = None  # None: the in-memory index
    poll_s: float = 0.5
    heartbeat_ttl_s: float = 3.0
    redis_timeout_s: float = 0.05  # per Redis call; past it the request is routed by load alone
    redis_bulk_timeout_s: float = (
        5.0  # per Redis call that carries a snapshot or event batches (off the loop)
    )
    drain_timeout_s: float = 30.0  # on SIGTERM, how long streams in flight may take to finish
    metrics_port: int | None = None  # Prometheus /metrics; None or 0: off
    metrics_compat: str | None = None  # "vllm": every series under vllm: as well (serving/metrics_compat.py)
    # how long a routing decision marks the prompt's blocks as held before the worker's own events say so
    speculate_ttl_s: float = 5.0
    tokenize_threads: int = 2
    # prompts being tokenized or queued for it, and their characters; past either RESOURCE_EXHAUSTED
    max_pending_prompts: int = 1024
    max_pending_prompt_chars: int = 1 << 24
    tls: TLSConfig = PLAINTEXT  # its server and its channels to the workers (serving/tls.py)
    log_prompts: bool = False  # each prompt's text at DEBUG (never at INFO)
    chat_template: str | None = None  # template text that replaces the model's (--chat-template)

    def __post_init__(self) -> None:
        if self.chat_template is not None:
            compile_chat_template(self.chat_template)  # ValueError: it does not parse
        if min(self.poll_s, self.heartbeat_ttl_s, self.redis_timeout_s) <= 0 or self.drain_timeout_s < 0:
            raise ValueError(
                "poll_s, heartbeat_ttl_s and redis_timeout_s must be positive, drain_timeout_s >= 0"
            )
        if min(self.tokenize_threads, self.max_pending_prompts, self.max_pending_prompt_chars) < 1:
            raise ValueError(
                "tokenize_threads, max_pending_prompts and max_pending_prompt_chars must be >= 1"
            )


@dataclass
class _Started:
    """A completion whose decode call is open (RouterServicer._start): what its task goes on with, and what
    it holds until `RouterServicer._release` (the router's accounting of its work, the decode call)."""

    sub_id: str
    params: SamplingParams
    decision: RoutingDecision
    call: ManyCall
    prompt_ids: np.ndarray
    prompt_list: list[int] | None  # the prompt as a list where the call was made from one
    first_seen: bool = False  # the first chunk came: the prefill's share of the accounting is settled
    ended: bool = False  # the decode worker ended the call itself
    released: bool = False


_Stop = Stop


class RouterServicer(pb_grpc.RouterServicer):
    def __init__(self, config: RouterConfig, index: PrefixIndex | None = None) -> None:
        self.config = config
        # a dummy-weights model has no tokenizer: token-id prompts only, no text
        has_tokenizer = Path(config.model_dir, "tokenizer.json").is_file()
        self.tokenizer = Tokenizer.from_dir(config.model_dir, config.chat_template) if has_tokenizer else None
        self.prompts = (
            PromptEncoder(
                self.tokenizer,
                config.tokenize_threads,
                config.max_pending_prompts,
                config.max_pending_prompt_chars,
            )
            if self.tokenizer
            else None
        )
        self.metrics = RouterMetrics()
        self.index = FallbackIndex(
            index or _make_index(config, self.metrics), retry_s=config.poll_s, metrics=self.metrics
        )
        self.router: PrefixRouter | DecodeOnlyRouter | None = None
        self.channels = {a: config.tls.aio_channel(a) for a in (*config.prefill, *config.decode)}
        self.roles = {**{a: "prefill" for a in config.prefill}, **{a: "decode" for a in config.decode}}
        self.workers = WorkerTable(self.roles, config.heartbeat_ttl_s, self.metrics)
        self._poll_failures = {a: Failures(f"polling {a}", logger) for a in self.channels}
        self._pull_failures = {a: Failures(f"pulling KV events from {a}", logger) for a in config.prefill}
        self._pulls: dict[str, asyncio.Task] = {}  # prefill address -> its event pull in progress
        self._decode_streams: dict[str, ManyStream] = {}
        self.model_info: pb.ModelInfo | None = None
        self._event_pos: dict[str, tuple[int, int]] = {}  # prefill address -> (epoch, last seq applied)
        self._ids = itertools.count()
        self._active: dict[int, asyncio.Queue] = {}  # each Generate call's queue of chunks, for the drain
        self.draining = False  # refusing new requests (SIGTERM)
        self._background: set[asyncio.Task] = set()

    def not_serving_reason(self) -> str | None:
        """None while the router can serve: a prefill and a decode worker are up. Else why not."""
        if self.draining:
            return SHUTTING_DOWN
        if self.model_info is None:
            return "no worker has answered yet"
        return self.workers.not_serving_reason()

    def ready(self) -> bool:
        return self.not_serving_reason() is None

    # ---- workers -----------------------------------------------------------------------------------

    async def poll_forever(self) -> None:
        await run_forever("the worker poller", self.poll_once, self.config.poll_s, logger)

    async def poll_once(self) -> None:
        """Ask every worker for its load (and a prefill worker for its KV events) once."""
        await asyncio.gather(*(self._poll(a) for a in self.channels))
        for address, stream in self._decode_streams.items():
            self.workers.heard(address, stream.last_read)
        for address in self.workers.expire():
            self._drop_decode_stream(address)
        self._drop_silent_streams()
        self.index.reap()
        self.metrics.index_entries.set(self.index.num_entries())

    async def _poll(self, address: str) -> None:
        failures = self._poll_failures[address]
        try:
            await self._poll_worker(address)
        except Exception:  # one worker's surprise must not stop the others' polls, nor the next round
            failures.failed()
            return
        failures.ok()

    async def _poll_worker(self, address: str) -> None:
        stub = pb_grpc.DecodeStub if self.roles[address] == "decode" else pb_grpc.PrefillStub
        try:
            reply = await stub(self.channels[address]).GetLoad(pb.LoadRequest(), timeout=1.0)
        except grpc.aio.AioRpcError as exc:
            # routed around at once when nobody listens there; its decode stream's calls go on while it
            # still carries them (a draining worker's last tokens), see _drop_silent_streams
            unreachable = exc.code() == grpc.StatusCode.UNAVAILABLE
            self.workers.failed(address, f"GetLoad: {exc.code().name}", at_once=unreachable)
            return
        self._learn_model(reply)
        if self.workers.seen(address, reply):
            self._event_pos.pop(address, None)  # restarted: its events start over
        pos = self._event_pos.get(address)
        seq = pos[1] if pos is not None and pos[0] == reply.epoch else None
        load = self.workers.load(address)
        result = self.index.heartbeat(address, reply.epoch, load, seq)  # an index that lost `seq`: RESYNC
        if reply.role != "prefill" or not self.index.up or address in self._pulls:
            return  # while the index is down the worker keeps its events (or a snapshot follows)
        if result is ApplyResult.RESYNC_NEEDED:
            self._event_pos.pop(address, None)
        task = asyncio.get_running_loop().create_task(self._pull(address))  # never holds up the polls
        self._pulls[address] = task
        task.add_done_callback(lambda _: self._pulls.pop(address, None))

    def _learn_model(self, reply: pb.WorkerLoad) -> None:
        if self.router is not None:
            return
        if not self.config.prefill:  # aggregated serving
            self.router = DecodeOnlyRouter(reply.block_size, self.workers.routable)
        else:
            self.router = PrefixRouter(
                self.index,
                make_policy(self.config.policy),
                block_size=reply.block_size,
                speculate_ttl=self.config.speculate_ttl_s,
                live=self.workers.routable,
            )
        self.model_info = pb.ModelInfo(
            model=self.config.served_model_name,
            max_model_len=reply.max_model_len,
            vocab_size=reply.vocab_size,
            block_size=reply.block_size,
            max_token_chars=self.prompts.max_token_chars if self.prompts is not None else 0,
            think_tokens=self.tokenizer is not None
            and all(self.tokenizer.backend.token_to_id(m) is not None for m in THINK_MARKERS),
            eos_token_ids=sorted(self.tokenizer.eos_token_ids) if self.tokenizer is not None else [],
        )

    async def _pull(self, address: str) -> None:
        failures = self._pull_failures[address]
        try:
            await self._pull_events(address)
        except Exception:
            failures.failed()  # the next poll tries again
            return
        failures.ok()

    async def _pull_events(self, address: str) -> None:
        """Apply the prefill worker's new prefix-cache events; a gap or a new epoch brings a full snapshot.
        The index calls run on a thread: a snapshot can take the index a while."""
        epoch, after = self._event_pos.get(address, (0, 0))
        try:
            reply = await pb_grpc.PrefillStub(self.channels[address]).GetKVEvents(
                pb.KVEventsRequest(epoch=epoch, after_seq=after), timeout=5.0
            )
        except grpc.aio.AioRpcError:
            return
        pos = await asyncio.to_thread(self._apply_events, address, (epoch, after), reply)
        if pos is None:
            self._event_pos.pop(
                address, None
            )  # a gap, or the index failed: the next poll asks for a snapshot
        else:
            self._event_pos[address] = pos

    def _apply_events(
        self, address: str, pos: tuple[int, int], reply: pb.KVEventsResponse
    ) -> tuple[int, int] | None:
        """Apply a GetKVEvents reply to the index; the (epoch, seq) now applied, or None to resync."""
        if reply.snapshot:
            snap = Snapshot.from_bytes(reply.snapshot)
            self.index.resync(address, snap.epoch, snap.seq, snap.hashes)
            self.metrics.index_events.labels("snapshot").inc()
            pos = (snap.epoch, snap.seq)
        for data in reply.batches:
            batch = dataclasses.replace(EventBatch.from_bytes(data), worker_id=address)
            result = self.index.apply(batch)
            self.metrics.index_events.labels(result.value).inc()
            if result == ApplyResult.RESYNC_NEEDED:
                return None
            pos = (batch.epoch, batch.seq)
        return pos if self.index.up else None

    def _drop_silent_streams(self) -> None:
        """A down decode worker's stream whose calls have heard nothing (not even a pong) for the heartbeat
        TTL: the worker is gone without closing its connection, so its calls fail instead of hanging."""
        now = time.monotonic()
        for address, stream in list(self._decode_streams.items()):
            silent = now - stream.last_read > self.config.heartbeat_ttl_s
            if silent and stream.open_calls and self.workers.state(address) is State.DOWN:
                self._drop_decode_stream(address)

    def _drop_decode_stream(self, address: str) -> None:
        """A decode worker went down: its stream's calls fail now, and its return gets a fresh stream."""
        stream = self._decode_streams.pop(address, None)
        if stream is not None:
            stream.close()

    # ---- the public API ----------------------------------------------------------------------------

    async def GetModelInfo(
        self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        """The model's limits; UNAVAILABLE, with the reason, while the router cannot serve."""
        reason = self.not_serving_reason()
        if reason is not None or self.model_info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, reason or "no worker has answered yet")
            raise AssertionError("abort raises")
        return self.model_info

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        return await self._with_tokenizer(tokenize, request, context)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        return await self._with_tokenizer(detokenize, request, context)

    async def _with_tokenizer(self, call: Callable[..., Awaitable[R]], request: Any, context: Any) -> R:
        """call(request, model info, served name, prompt encoder) once the router can serve; a Stop it raises
        aborts the RPC with its status and details."""
        info = await self.GetModelInfo(pb.ModelInfoRequest(), context)
        try:
            return await call(request, info, self.config.served_model_name, self.prompts)
        except Stop as stop:
            await context.abort(stop.code, stop.details)
            raise AssertionError("abort raises") from None

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id or new_request_id()
        bind_request(rid)
        trace.mark(rid, "router.recv")
        key = next(self._ids)
        out: asyncio.Queue = asyncio.Queue()
        self._active[key] = out
        try:
            if self.draining:
                raise _Stop(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
            prompt_ids, params = await self._admit(request)
            if self.config.log_prompts and logger.isEnabledFor(logging.DEBUG):
                logger.debug("request %s prompt: %r", rid, _prompt_of(request))
            async for chunk in self._fan_out(rid, request, prompt_ids, params, out):
                yield chunk
        except _Stop as stop:
            await context.abort(stop.code, stop.details)
        except Exception:
            logger.exception("request %s failed in the router", rid)
            await context.abort(grpc.StatusCode.INTERNAL, "the router failed on this request; see its log")
        finally:
            self._active.pop(key, None)

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        """One prompt's embedding from the prefill worker that holds the most of its prefix (routed as a prompt
        is, its blocks speculated there), or a decode worker in aggregated serving. Drained as Generate is."""
        rid = request.request_id or new_request_id()
        bind_request(rid)
        key = next(self._ids)
        out: asyncio.Queue = asyncio.Queue()
        self._active[key] = out
        call: asyncio.Future | None = None
        stop: asyncio.Future | None = None
        try:
            if self.draining:
                raise _Stop(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
            if self.router is None or self.model_info is None:
                raise _Stop(grpc.StatusCode.UNAVAILABLE, "no worker is up yet")
            prompt_ids = await admit_embedding(
                request, self.model_info, self.config.served_model_name, self.prompts
            )
            call = asyncio.ensure_future(self._embed(rid, request, prompt_ids))
            stop = asyncio.ensure_future(out.get())  # the drain's end_all
            await asyncio.wait({call, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not call.done():
                raise stop.result()
            return call.result()
        except _Stop as refused:
            await context.abort(refused.code, refused.details)
        except Exception:
            logger.exception("embedding request %s failed in the router", rid)
            await context.abort(grpc.StatusCode.INTERNAL, "the router failed on this request; see its log")
        finally:
            for pending in (call, stop):
                if pending is not None and not pending.done():
                    pending.cancel()  # the call: the client went, or the drain ended it (the worker's goes with it)
            self._active.pop(key, None)
        raise AssertionError("abort raises")

    async def _embed(self, rid: str, request: pb.EmbedRequest, prompt_ids: np.ndarray) -> pb.EmbedResponse:
        assert self.router is not None
        hashes = LazyBlockHashes(
            prompt_ids,
            self.router.block_size,
            extra_keys(self.config.served_model_name, request.cache_salt or None),
        )
        try:
            decision = self.router.route(hashes, len(prompt_ids), speculate_later=True)
        except NoWorkersError as exc:
            raise _Stop(grpc.StatusCode.UNAVAILABLE, self.workers.no_worker("prefill")) from exc
        role = "prefill" if decision.prefill_worker != LOCAL_PREFILL else "decode"
        target = decision.prefill_worker if role == "prefill" else decision.decode_worker
        try:
            if target is None:
                raise _Stop(grpc.StatusCode.UNAVAILABLE, self.workers.no_worker("decode"))
            self.metrics.routed(self._reason(decision), decision.matched_blocks)
            stub = pb_grpc.PrefillStub if role == "prefill" else pb_grpc.DecodeStub
            logger.info(
                "embedding request %s: %d prompt tokens to %s worker %s", rid, len(prompt_ids), role, target
            )
            pending = stub(self.channels[target]).Embed(
                pb.WorkerEmbedRequest(
                    request_id=rid, prompt_token_ids=prompt_ids.tolist(), pooling=request.pooling,
                    priority=request.priority, cache_salt=request.cache_salt,
                )
            )  # fmt: skip
            self.router.speculate_pending()  # the call is out: its blocks are the worker's to compute
            try:
                reply = await pending
            except grpc.aio.AioRpcError as exc:
                raise self._embed_failure(exc, role, target) from exc
        finally:
            self.router.prefill_done(decision)
            self.router.request_done(decision)
        reply.request_id = rid
        return reply

    def _embed_failure(self, exc: grpc.aio.AioRpcError, role: str, address: str) -> Stop:
        """The client's status for a worker's Embed that failed: its own refusals as they are, the rest
        UNAVAILABLE (a worker unreachable is routed around until it answers a poll again)."""
        code, details = exc.code(), exc.details() or ""
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
            return _Stop(code, details)
        if code == grpc.StatusCode.INTERNAL:
            return _Stop(code, f"{role} worker {address} failed on this request (an internal error)")
        if details != SHUTTING_DOWN and self.workers.failed(address, "its call failed", at_once=True):
            task = asyncio.get_running_loop().create_task(self._poll(address))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return _Stop(
            grpc.StatusCode.UNAVAILABLE, f"{role} worker {address} became unavailable; retry the request"
        )

    # ---- the drain ---------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._active)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to `timeout` s for every Generate call to end; True if they did."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self._active and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return not self._active

    def end_all(self) -> int:
        """End every request in flight with UNAVAILABLE "server shutting down" (their worker calls are
        cancelled, which frees their blocks); return how many."""
        for out in self._active.values():
            out.put_nowait(_Stop(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN))
        return len(self._active)

    async def close(self) -> None:
        for task in list(self._pulls.values()):
            task.cancel()
        await asyncio.gather(*self._pulls.values(), return_exceptions=True)
        for stream in self._decode_streams.values():
            stream.close()
        self._decode_streams.clear()
        await asyncio.gather(*(ch.close() for ch in self.channels.values()), return_exceptions=True)
        self.index.close()
        if self.prompts is not None:
            self.prompts.close()

    async def _admit(self, request: pb.GenerateRequest) -> tuple[np.ndarray, SamplingParams]:
        if self.router is None or self.model_info is None:
            raise _Stop(grpc.StatusCode.UNAVAILABLE, "no worker is up yet")
        return await admit(request, self.model_info, self.config.served_model_name, self.prompts)

    async def _fan_out(
        self,
        rid: str,
        request: pb.GenerateRequest,
        prompt_ids: np.ndarray,
        params: SamplingParams,
        out: asyncio.Queue | None = None,
    ):
        """Run the n completions concurrently and interleave their chunks; usage comes last. A `Stop` put on
        `out` (the drain's) ends the request."""
        out = asyncio.Queue() if out is None else out
        if self.draining and not out.empty():
            raise out.get_nowait()
        # Each completion is routed and its decode call's frame queued here, not a loop turn later in a task.
        # What a started completion holds is released by its task or, should the task be cancelled before
        # it ran, by the `finally` below (`_release` acts once).
        started: list[_Started] = []
        tasks: list[asyncio.Task] = []
        usage = pb.Usage(prompt_tokens=len(prompt_ids))
        try:
            for i in range(params.n):
                started.append(self._start(rid, i, request, prompt_ids, params))
                tasks.append(asyncio.create_task(self._completion(rid, i, request, started[-1], out)))
            for _ in range(params.n):
                while (item := await out.get()) is not None:
                    if isinstance(item, _Stop):
                        raise item
                    usage.completion_tokens += len(item.token_ids)
                    if item.index == 0 and item.HasField("usage"):
                        usage.cached_tokens = item.usage.cached_tokens
                    item.ClearField("usage")
                    item.prompt_tokens = usage.prompt_tokens
                    yield item
            logger.info(
                "request %s finished: %d prompt tokens, %d completion tokens",
                rid,
                usage.prompt_tokens,
                usage.completion_tokens,
            )
            yield pb.GenerateResponse(request_id=rid, usage=usage)
        finally:
            for task in tasks:
                task.cancel()
            for st in started:
                self._release(st)

    async def _completion(
        self,
        rid: str,
        index: int,
        request: pb.GenerateRequest,
        started: _Started,
        out: asyncio.Queue,
    ) -> None:
        assert self.router is not None
        try:
            self.router.speculate_pending()  # after the write loop has sent the decode call's frame
            await self._decode(rid, index, request, started, out)
        except _Stop as stop:
            out.put_nowait(stop)
        except Exception:  # never leave the client waiting
            logger.exception("completion %s/%d failed", rid, index)
            out.put_nowait(_Stop(grpc.StatusCode.INTERNAL, "the router failed on this request; see its log"))
        finally:
            out.put_nowait(None)

    def _decode_stream(self, address: str) -> ManyStream:
        """The shared stream that carries every call to one decode worker (serving/mux.py)."""
        stream = self._decode_streams.get(address)
        if stream is None:
            stub = pb_grpc.DecodeStub(self.channels[address])
            stream = self._decode_streams[address] = ManyStream(stub.GenerateMany, pb.DecodeFrame, "chunk")
        return stream

    def _route(self, prompt_ids: np.ndarray, salt: str | None) -> RoutingDecision:
        """Route a completion. The prompt's blocks are hashed as far as the index holds them; the rest is
        hashed and speculated by `_completion`, once the decode call's frame has gone out (or by the next
        routing decision, whichever comes first)."""
        assert self.router is not None
        hashes = LazyBlockHashes(
            prompt_ids, self.router.block_size, extra_keys(self.config.served_model_name, salt)
        )
        try:
            decision = self.router.route(hashes, len(prompt_ids), speculate_later=True)
        except NoWorkersError as exc:
            raise _Stop(grpc.StatusCode.UNAVAILABLE, self.workers.no_worker("prefill")) from exc
        if decision.decode_worker is None:
            self.router.prefill_done(decision)  # routed, but it will not run
            raise _Stop(grpc.StatusCode.UNAVAILABLE, self.workers.no_worker("decode"))
        self.metrics.routed(self._reason(decision), decision.matched_blocks)
        return decision

    def _reason(self, decision: RoutingDecision) -> str:
        assert self.router is not None
        uses_index = isinstance(self.router, PrefixRouter) and self.router.policy.uses_index
        if uses_index and not self.index.up:  # a DecodeOnlyRouter (no prefill workers) reads no index
            return "fallback"
        return "prefix_hit" if decision.matched_blocks else "load"

    def _start(
        self,
        rid: str,
        index: int,
        request: pb.GenerateRequest,
        prompt_ids: np.ndarray,
        params: SamplingParams,
    ) -> _Started:
        """Route completion `index` and queue its decode call's frame (raises _Stop: nothing is held then)."""
        child = completion_params(params, index)
        sub_id = f"{rid}.{index}" if params.n > 1 else rid
        decision = self._route(prompt_ids, request.cache_salt or None)
        assert decision.decode_worker is not None
        sampling = params_to_proto(child)
        sampling.n = 1
        # the client's ids as they came, unless truncate_prompt_tokens cut them at admission
        by_ids = request.WhichOneof("prompt") == "token_ids" and len(prompt_ids) == len(request.token_ids.ids)
        as_list = None if by_ids else prompt_ids.tolist()  # the detokenizer's is made after the call went out
        logger.info(
            "request %s: %d prompt tokens to prefill %s, decode %s",
            sub_id,
            len(prompt_ids),
            decision.prefill_worker,
            decision.decode_worker,
        )
        trace.mark(sub_id, "router.call_decode")
        call = self._decode_stream(decision.decode_worker).open(
            request_id=sub_id,
            # a proto's repeated field copies in ~1 us; from an array it would take ~250
            prompt_token_ids=request.token_ids.ids if by_ids else as_list,
            sampling=sampling,
            priority=request.priority,
            cache_salt=request.cache_salt,
            prefill_address=decision.prefill_worker,
        )
        return _Started(sub_id, child, decision, call, prompt_ids, as_list)

    def _decode_worker_failed(self, address: str, exc: grpc.aio.AioRpcError) -> None:
        """Route around a decode worker whose call broke until it answers a poll again (one is made now)."""
        logger.info("a call to decode worker %s failed: %s: %s", address, exc.code().name, exc.details())
        if self.workers.failed(address, "its call failed", at_once=True):
            self._drop_decode_stream(address)
            task = asyncio.get_running_loop().create_task(self._poll(address))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _release(self, started: _Started) -> None:
        """Settle a completion's accounting and stop its decode call unless the worker ended it; once."""
        if started.released:
            return
        started.released = True
        assert self.router is not None
        if not started.first_seen:
            self.router.prefill_done(started.decision)
        self.router.request_done(started.decision)
        if not started.ended:  # cancelled, failed or the stream broke: stop the call on the decode worker
            started.call.cancel()

    async def _decode(
        self,
        rid: str,
        index: int,
        request: pb.GenerateRequest,
        started: _Started,
        out: asyncio.Queue,
    ) -> None:
        decision, call = started.decision, started.call
        assert self.router is not None and decision.decode_worker is not None
        if self.tokenizer is not None:
            prompt = started.prompt_list if started.prompt_list is not None else started.prompt_ids.tolist()
            text: TextStream | None = TextStream(self.tokenizer, prompt, started.params)
        else:
            text = None
        shown = 0
        try:
            async for chunk in call:
                if not started.first_seen:
                    trace.mark(started.sub_id, "router.first_chunk")
                    self.router.prefill_done(decision)
                    started.first_seen = True
                stopped, kept = _detokenize(text, chunk)
                finish = "stop" if stopped else chunk.finish_reason
                stop_reason = text.stop if text is not None and stopped else chunk.stop_reason
                visible = text.visible(bool(finish)) if text is not None else ""
                whole = kept == len(chunk.token_ids)
                resp = pb.GenerateResponse(
                    request_id=rid,
                    index=index,
                    token_ids=chunk.token_ids if whole else chunk.token_ids[:kept],
                    text=visible[shown:],
                    logprobs=chunk.logprobs if whole else chunk.logprobs[:kept],
                    finish_reason=finish,
                    stop_reason=stop_reason,
                    prompt_logprobs=chunk.prompt_logprobs,  # on completion 0's first chunk, when asked for
                )
                if chunk.num_cached_tokens:
                    resp.usage.cached_tokens = chunk.num_cached_tokens
                shown = len(visible)
                out.put_nowait(resp)
                if finish:
                    if stopped:  # a stop string: the decode worker frees the request's blocks
                        call.cancel()
                    started.ended = True  # otherwise the decode worker ended the call itself
                    return
        except grpc.aio.AioRpcError as exc:
            failure = decode_failure(exc, decision.decode_worker, decision.prefill_worker)
            if failure.worker_down:
                self._decode_worker_failed(decision.decode_worker, exc)
            raise failure.stop from exc
        finally:
            self._release(started)
        raise _Stop(
            grpc.StatusCode.UNAVAILABLE, f"decode worker {decision.decode_worker} ended the stream early"
        )


def _detokenize(text: TextStream | None, chunk: pb.DecodeChunk) -> tuple[bool, int]:
    """Add the chunk's tokens (one or several) to the completion's text, in order. Returns whether a stop
    string ended the text and how many of the tokens are kept: those up to the one that completed it."""
    ids = chunk.token_ids
    if text is None:
        return False, len(ids)
    if not ids:  # the end of a completion whose last token came in an earlier chunk
        return text.finish(), 0
    last = len(ids) - 1
    for i, token in enumerate(ids):
        if text.add(token, last=i == last and bool(chunk.finish_reason)):
            return True, i + 1
    return False, len(ids)


def _prompt_of(request: pb.GenerateRequest) -> object:
    """The request's prompt as the client sent it (for --log-prompts at DEBUG only)."""
    kind = request.WhichOneof("prompt")
    if kind == "chat":
        return [(m.role, m.content) for m in request.chat.messages]
    return list(request.token_ids.ids) if kind == "token_ids" else request.text


def _make_index(config: RouterConfig, metrics: RouterMetrics) -> PrefixIndex:
    if config.redis_url:
        from router.redis_mirror import RedisMirrorIndex

        return RedisMirrorIndex(
            config.redis_url,
            heartbeat_ttl=config.heartbeat_ttl_s,
            timeout_s=config.redis_timeout_s,
            bulk_timeout_s=config.redis_bulk_timeout_s,
            on_error=lambda operation: metrics.redis_errors.labels(operation).inc(),
        )
    return InMemoryPrefixIndex(heartbeat_ttl=config.heartbeat_ttl_s)


def add_servicer(servicer: RouterServicer, server: grpc.aio.Server) -> None:
    pb_grpc.add_RouterServicer_to_server(servicer, server)
