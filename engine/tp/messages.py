"""What rank 0 and the other ranks of a tensor-parallel engine say to each other: one frozen dataclass per
kind, pickled whole, one direction per pipe (engine/tp/ranks.py). Rank 0 writes every message to every
rank in the same order, so each rank runs the same steps, collectives included, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.config import CacheConfig
from engine.scheduler import SchedulerOutput

# ---- rank 0 -> rank r -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Start:
    """The rank's identity and how to load its share of the model (sent once, first)."""

    rank: int
    size: int
    store_port: int  # rank 0's TCPStore, on 127.0.0.1: the process group's rendezvous
    backend: str  # nccl | gloo
    device: str  # cuda:r | cpu
    model: str  # an HF directory or a dummy shape name
    dtype: str  # torch dtype name, e.g. "bfloat16"
    load_format: str
    seed: int
    log_level: int
    num_threads: int  # torch's intra-op threads on the CPU (0: leave the default)
    quantization: str | None = None  # EngineConfig.quantization (None: what the files say)
    expert_parallel: bool = False  # EngineConfig.enable_expert_parallel


@dataclass(frozen=True)
class BuildRunner:
    """Build the model runner (KV cache, CUDA graphs) with rank 0's settings, in step with rank 0."""

    cache: CacheConfig
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enforce_eager: bool
    seed: int


@dataclass(frozen=True)
class Launch:
    """Run one step: rank 0's plan, and which rows read the previous step's tokens on the device."""

    plan: SchedulerOutput
    inputs_from: list[int] | None
    after_previous: bool  # inputs_from refers to the step launched just before this one
    draft_layers: int | None  # self_draft speculation: the target's first layers draft


@dataclass(frozen=True)
class CaptureGraphs:
    pass


@dataclass(frozen=True)
class KVCall:
    """A call on the rank's KV transfer side (kvtransfer/tp_rank.py), in step order; answered by Reply
    when `call_id` is not None."""

    call_id: int | None
    method: str
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Shutdown:
    pass


ToRank = Start | BuildRunner | Launch | CaptureGraphs | KVCall | Shutdown

# ---- rank r -> rank 0 -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Loaded:
    """The rank's share of the weights is loaded; it joins the process group next."""

    rank: int


@dataclass(frozen=True)
class Ready:
    rank: int
    num_blocks: int


@dataclass(frozen=True)
class Reply:
    call_id: int
    value: Any = None
    error: str | None = None


@dataclass(frozen=True)
class KVEvent:
    """Something a rank's KV receiver did on its own threads (a request landed, failed, drained)."""

    rank: int
    kind: str
    args: tuple[Any, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class Failed:
    """The rank cannot go on: what went wrong (it exits after sending this)."""

    rank: int
    error: str


FromRank = Loaded | Ready | Reply | KVEvent | Failed
