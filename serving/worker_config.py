"""The config a prefill or decode worker's engine process is built from (picklable, frozen)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from kvtransfer import TRANSPORTS
from kvtransfer.auth import NO_AUTH, PeerAuth


@dataclass(frozen=True)
class WorkerConfig:
    engine: EngineConfig
    worker_id: str
    kv_transport: str = "tcp"
    kv_host: str = "127.0.0.1"
    local_prefill_threshold: int = 0  # decode: prompts up to this many tokens are prefilled locally
    max_pending: int = 256  # decode: requests waiting for blocks before new ones get RESOURCE_EXHAUSTED
    kv_timeout_s: float = 30.0
    kv_auth: PeerAuth = NO_AUTH  # how KV peers prove themselves (TLS, a shared secret)

    def __post_init__(self) -> None:
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {TRANSPORTS}, got {self.kv_transport!r}")
        if self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold must be non-negative")
