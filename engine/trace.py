"""Per-request stage timestamps across processes, for finding where a request's time goes.

Off unless PDSERVE_TRACE names a directory: then every process appends lines
`<time.monotonic()> <pid> <request id> <stage> <time.time()>` to `<dir>/trace-<pid>.txt`. CLOCK_MONOTONIC is one
clock for every process on a host, so the stages of one request line up across the router, the
workers' servers and their engine processes. `python -m bench.trace_report DIR` summarises them.
"""

from __future__ import annotations

import os
import time
from typing import IO

_DIR = os.environ.get("PDSERVE_TRACE") or None
_file: IO[str] | None = None

enabled = _DIR is not None


def mark(request_id: str, stage: str) -> None:
    """Record that `request_id` reached `stage` now (a no-op unless tracing is on)."""
    global _file
    if _DIR is None:
        return
    now = time.monotonic()
    if _file is None:
        os.makedirs(_DIR, exist_ok=True)
        _file = open(os.path.join(_DIR, f"trace-{os.getpid()}.txt"), "a", buffering=1)  # noqa: SIM115
    _file.write(f"{now:.6f} {os.getpid()} {request_id} {stage} {time.time():.6f}\n")
