"""How the serving processes stay warm between a request's messages, read once from the environment.

While calls are open on a stream and it has been quiet for KEEP_WARM_S, the caller sends a ping and the
server answers it (serving/mux.py), and an engine process polls its pipe at that period (serving/
engine_proc.py): both processes' paths stay warm for the reply that is coming. On the H200 hosts a message
on an open stream took 0.60-0.65 ms one way after 50 ms of quiet and 0.27-0.31 ms with a ping every 2 ms.
They go on for KEEP_WARM_LINGER_S after the last call closed, so the next request of a steady trickle also
meets warm processes on its way in; then they stop, and an idle server makes no wake-ups. Pinging costs
~500 small frames a second per stream during the window.

PDSERVE_KEEP_WARM_MS (default 2; 0: off) and PDSERVE_KEEP_WARM_LINGER_MS (default 1000; 0: only while
calls are open)."""

from __future__ import annotations

import os

KEEP_WARM_S = float(os.environ.get("PDSERVE_KEEP_WARM_MS", "2")) / 1e3
KEEP_WARM_LINGER_S = float(os.environ.get("PDSERVE_KEEP_WARM_LINGER_MS", "1000")) / 1e3
