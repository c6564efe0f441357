"""A tensor-parallel rank r >= 1, started by rank 0 (engine/tp/ranks.py) as `python -m engine.tp.worker
PLAN_FD REPLY_FD`: load this rank's share of the model, join the process group, then run what rank 0
sends, in its order, until Shutdown or until rank 0 is gone (its pipe ends)."""

from __future__ import annotations

import contextlib
import logging
import pickle
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from engine.model_runner import LaunchedStep
from engine.tp import group
from engine.tp.heads import shard_heads
from engine.tp.messages import (
    BuildRunner,
    CaptureGraphs,
    Failed,
    FromRank,
    KVCall,
    KVEvent,
    Launch,
    Loaded,
    Ready,
    Reply,
    Shutdown,
    Start,
    ToRank,
)
from engine.tp.runner import RankRunner, rank_model_config

logger = logging.getLogger(__name__)


class RankWorker:
    def __init__(self, start: Start, reply: Connection) -> None:
        from engine.weights import load_model

        self.start, self._reply = start, reply
        self._reply_lock = threading.Lock()  # KV events come from receiver threads
        self.device = torch.device(start.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        elif start.num_threads:
            torch.set_num_threads(start.num_threads)
        self.dtype = getattr(torch, start.dtype)
        self.model, self.config = load_model(
            start.model, dtype=self.dtype, load_format=start.load_format, device=self.device,
            tp_rank=start.rank, tp_size=start.size, quantization=start.quantization,
            expert_parallel=start.expert_parallel,
        )  # fmt: skip
        self.shard = shard_heads(
            self.config.num_attention_heads, self.config.num_key_value_heads, start.size, start.rank
        )
        self.send(Loaded(start.rank))
        store = dist.TCPStore("127.0.0.1", start.store_port, start.size, False, timeout=group.TIMEOUT)
        group.join(start.backend, store, start.rank, start.size)
        self.runner: RankRunner | None = None
        self.last: LaunchedStep | None = None
        self.kv: Any = None  # kvtransfer.tp_rank.RankKV, made by the first KV call

    def send(self, msg: FromRank) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._reply_lock:
            self._reply.send_bytes(data)

    def run(self, plan: Connection) -> None:
        while True:
            msg: ToRank = pickle.loads(plan.recv_bytes())
            if isinstance(msg, Shutdown):
                return
            self.handle(msg)

    def handle(self, msg: ToRank) -> None:
        if isinstance(msg, Launch):
            assert self.runner is not None
            self.runner.draft_layers = msg.draft_layers
            prev = self.last if msg.after_previous else None
            self.last = self.runner.launch(msg.plan, msg.inputs_from, prev)
        elif isinstance(msg, KVCall):
            self._kv_call(msg)
        elif isinstance(msg, BuildRunner):
            self.runner = RankRunner(
                self.model, rank_model_config(self.config, self.shard), msg.cache, msg.max_num_batched_tokens,
                self.device, self.dtype, msg.seed, max_num_seqs=msg.max_num_seqs,
                max_model_len=msg.max_model_len, enforce_eager=msg.enforce_eager,
            )  # fmt: skip
            self.send(Ready(self.start.rank, self.runner.num_blocks))
        elif isinstance(msg, CaptureGraphs):
            assert self.runner is not None
            self.runner.capture_graphs()
        else:
            raise TypeError(f"a rank takes no {type(msg).__name__}")

    def _kv_call(self, msg: KVCall) -> None:
        """The rank's side of a KV transfer (kvtransfer/tp_rank.py); its answer goes back as Reply."""
        if self.kv is None:
            from kvtransfer.tp_rank import RankKV

            assert self.runner is not None
            self.kv = RankKV(self.runner.kv_cache, self.shard, self._kv_event)
        try:
            value, error = getattr(self.kv, msg.method)(*msg.args), None
        except Exception as e:  # the caller on rank 0 raises it
            value, error = None, f"{type(e).__name__}: {e}"
        if msg.call_id is not None:
            self.send(Reply(msg.call_id, value, error))
        elif error is not None:  # nobody waits for this one's answer
            logger.warning("rank %d: kv %s failed: %s", self.start.rank, msg.method, error)

    def _kv_event(self, kind: str, *args: Any) -> None:
        self.send(KVEvent(self.start.rank, kind, args))


def main(argv: list[str]) -> int:
    plan = Connection(int(argv[0]), writable=False)
    reply = Connection(int(argv[1]), readable=False)
    start: Start = pickle.loads(plan.recv_bytes())
    logging.basicConfig(
        level=start.log_level, format=f"%(asctime)s %(levelname)s %(name)s [rank {start.rank}]: %(message)s"
    )
    worker: RankWorker | None = None
    try:
        worker = RankWorker(start, reply)
        worker.run(plan)
        group.leave()  # asked to stop: every rank leaves the group (after a failure none waits for it)
        return 0
    except (EOFError, BrokenPipeError):
        return 0  # rank 0 is gone or closed the pipe: nothing is left to do
    except BaseException as e:
        logger.error("rank %d failed: %s", start.rank, traceback.format_exc())
        with contextlib.suppress(OSError):
            reply.send_bytes(pickle.dumps(Failed(start.rank, f"{type(e).__name__}: {e}")))
        return 1
    finally:
        if worker is not None and worker.kv is not None:
            worker.kv.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
