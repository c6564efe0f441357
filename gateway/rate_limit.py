"""Per-tenant rate limits: requests per second and tokens per second, each a token bucket holding one
second's worth. A request takes one from its tenant's request bucket; its tokens (prompt and completion,
known when it ends) are taken from the token bucket afterwards, which may go below zero: the tenant's
next request waits until it refills. A refused request gets 429 with `Retry-After`; other tenants' buckets
are their own. Without tenants every request shares one bucket.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Bucket:
    rate: float  # per second; the bucket holds at most one second's worth (at least 1)
    level: float = field(init=False)
    at: float = 0.0

    def __post_init__(self) -> None:
        self.level = self.capacity

    @property
    def capacity(self) -> float:
        return max(self.rate, 1.0)

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait_for(self, need: float) -> float:
        """Seconds until the bucket holds `need` (0: now)."""
        return max(0.0, (need - self.level) / self.rate)


class TenantLimits:
    """`admit(tenant)`: None (admitted: one request taken) or the seconds to wait; `charge(tenant, tokens)`
    once a request's tokens are known. Thread-safe; `clock` is injectable for tests."""

    def __init__(
        self,
        requests_per_s: float | None = None,
        tokens_per_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, rate in (("requests", requests_per_s), ("tokens", tokens_per_s)):
            if rate is not None and rate <= 0:
                raise ValueError(f"the {name} per second limit must be positive, got {rate}")
        self.requests_per_s, self.tokens_per_s = requests_per_s, tokens_per_s
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[tuple[str, str | None], _Bucket] = {}

    @property
    def enabled(self) -> bool:
        return self.requests_per_s is not None or self.tokens_per_s is not None

    def admit(self, tenant: str | None) -> float | None:
        if not self.enabled:
            return None
        with self._lock:
            now = self._clock()
            requests = self._bucket("requests", tenant, self.requests_per_s, now)
            tokens = self._bucket("tokens", tenant, self.tokens_per_s, now)
            wait = max(
                requests.wait_for(1.0) if requests else 0.0,
                tokens.wait_for(math.ulp(0.0)) if tokens and tokens.level <= 0 else 0.0,
            )
            if wait > 0:
                return wait
            if requests:
                requests.level -= 1.0
            return None

    def charge(self, tenant: str | None, num_tokens: int) -> None:
        if self.tokens_per_s is None or num_tokens <= 0:
            return
        with self._lock:
            bucket = self._bucket("tokens", tenant, self.tokens_per_s, self._clock())
            assert bucket is not None
            bucket.level -= num_tokens

    def _bucket(self, kind: str, tenant: str | None, rate: float | None, now: float) -> _Bucket | None:
        if rate is None:
            return None
        bucket = self._buckets.get((kind, tenant))
        if bucket is None:
            bucket = self._buckets[(kind, tenant)] = _Bucket(rate, at=now)
        bucket.refill(now)
        return bucket


def retry_after(seconds: float) -> str:
    """The Retry-After header's value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
