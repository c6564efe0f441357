"""Long-lived router tasks that never die: every failure is logged once per change and retried with backoff."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable


class Failures:
    """A task's run of failures: the first is logged with its traceback, the recovery once, nothing between.

    Call `failed()` from inside the `except` block (so the traceback is the one being handled); it returns
    how long to back off: doubling from `base_s` up to `max_s`.
    """

    def __init__(self, what: str, logger: logging.Logger, base_s: float = 0.05, max_s: float = 2.0) -> None:
        self.what = what
        self.logger = logger
        self.base_s = base_s
        self.max_s = max_s
        self.count = 0

    def failed(self) -> float:
        self.count += 1
        if self.count == 1:
            self.logger.exception("%s failed; retrying with backoff (up to %.1f s)", self.what, self.max_s)
        return min(self.max_s, self.base_s * 2 ** (self.count - 1))

    def ok(self) -> None:
        if self.count:
            self.logger.warning("%s works again after %d failed attempts", self.what, self.count)
            self.count = 0


async def run_forever(
    what: str,
    step: Callable[[], Awaitable[None]],
    interval_s: float,
    logger: logging.Logger,
    max_backoff_s: float = 2.0,
) -> None:
    """`await step()` every `interval_s` until cancelled; an exception backs off and tries again."""
    failures = Failures(what, logger, max_s=max_backoff_s)
    while True:
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception:
            await asyncio.sleep(failures.failed())
            continue
        failures.ok()
        await asyncio.sleep(interval_s)
