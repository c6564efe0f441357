"""`pdserve up` keeps its children running (serving/supervisor.py): a child that dies is reaped at once (no
zombie, nothing left of its process group), logged with its role and address, and restarted on the same
address after a growing backoff; on stop every child gets SIGTERM and stragglers are killed. First with
small stand-in processes, then with a real cluster whose decode worker and router are killed with -9."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from serving.supervisor import Backoff, Child, StopSignals, Supervisor
from tests.cluster import (
    Stream,
    collect,
    greedy_request,
    health,
    process_state,
    start_cluster,
    wait_until,
    worker_load,
)


def test_backoff_doubles_up_to_its_cap():
    assert [Backoff().delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    with pytest.raises(ValueError):
        Backoff(first_s=0)


def _run_in_thread(supervisor: Supervisor, signals: StopSignals) -> threading.Thread:
    thread = threading.Thread(target=supervisor.run, args=(signals,), daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(60)
def test_a_child_that_keeps_exiting_is_reaped_logged_and_restarted_with_growing_backoff(capsys, caplog):
    caplog.set_level(logging.WARNING, logger="serving.supervisor")
    child = Child("decode", "127.0.0.1:1", [sys.executable, "-c", "import sys; sys.exit(3)"])
    supervisor = Supervisor([child], drain_timeout_s=1, backoff=Backoff(first_s=0.2, cap_s=0.8))
    signals = StopSignals()
    supervisor.start_all()
    pids, times = [child.pid], [time.monotonic()]

    def restarted() -> bool:
        if child.running() and child.pid != pids[-1]:
            pids.append(child.pid)
            times.append(time.monotonic())
        return len(pids) >= 5

    thread = _run_in_thread(supervisor, signals)
    wait_until(restarted, 30, "four restarts", every=0.01)
    signals.count = 1
    thread.join(10)
    assert supervisor.drain(signals) in (0, 1)  # the last one may have exited (3) or still be running
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(gap >= want for gap, want in zip(gaps, [0.2, 0.4, 0.8, 0.8])), gaps
    assert all(process_state(pid) is None for pid in pids[:-1])  # every dead one reaped
    lines = [json.loads(x.split(": ", 1)[1]) for x in capsys.readouterr().out.splitlines()]
    assert [x["pid"] for x in lines][:4] == pids[1:5]
    assert all(x["role"] == "decode" and x["address"] == "127.0.0.1:1" for x in lines)
    assert f"decode 127.0.0.1:1 (pid {pids[0]}) died: exit code 3; restarting in 0.2 s" in caplog.text


_STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen(["sleep", "120"])
open(sys.argv[1], "w").write(str(grandchild.pid))
time.sleep(120)
"""


@pytest.mark.timeout(60)
def test_drain_kills_a_child_that_ignores_sigterm_with_its_process_group(tmp_path: Path):
    pid_file = tmp_path / "grandchild"
    stubborn = Child("prefill", "127.0.0.1:2", [sys.executable, "-c", _STUBBORN, str(pid_file)])
    polite = Child("router", "127.0.0.1:3", [sys.executable, "-c", "import time; time.sleep(120)"])
    supervisor = Supervisor([stubborn, polite], drain_timeout_s=0.5, stop_margin_s=0.5)
    supervisor.start_all()
    grandchild = int(wait_until(lambda: pid_file.exists() and pid_file.read_text(), 30, "the grandchild"))
    t0 = time.monotonic()
    assert supervisor.drain(StopSignals()) == 1  # one had to be killed
    assert time.monotonic() - t0 < 10
    assert polite.proc is not None and polite.proc.returncode == -signal.SIGTERM
    assert stubborn.proc is not None and stubborn.proc.returncode == -signal.SIGKILL
    wait_until(lambda: process_state(grandchild) in (None, "Z"), 10, "the grandchild killed")


def test_one_deadline_bounds_the_whole_stop_across_tiers():
    """Children of two tiers that ignore SIGTERM are killed by the drain timeout plus the margin counted once
    (the second tier gets the margin, not a second drain timeout)."""
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    children = [
        Child(role, f"127.0.0.1:{i}", [sys.executable, "-c", code])
        for i, role in enumerate(["router", "decode"])
    ]
    supervisor = Supervisor(children, drain_timeout_s=3, stop_margin_s=0.5)
    supervisor.start_all()
    wait_until(lambda: all(_ignores_sigterm(c.pid) for c in children), 30, "the children ignoring SIGTERM")
    t0 = time.monotonic()
    assert supervisor.drain(StopSignals()) == 1
    assert time.monotonic() - t0 < 6  # per-tier deadlines would take 2 x 3.5 s
    assert all(c.proc is not None and c.proc.returncode == -signal.SIGKILL for c in children)


def test_drain_of_children_that_exit_0_on_sigterm_is_clean():
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); time.sleep(120)"
    children = [Child("decode", f"127.0.0.1:{i}", [sys.executable, "-c", code]) for i in range(2)]
    supervisor = Supervisor(children, drain_timeout_s=5)
    supervisor.start_all()
    # a SIGTERM before their handler is set would kill them (not exit 0)
    wait_until(lambda: all(_has_handler(c.pid) for c in children), 30, "the children's handlers")
    assert supervisor.drain(StopSignals()) == 0


_LOGS_ITS_STOP = """
import signal, sys, time
log, role = sys.argv[1], sys.argv[2]
def stop(*_):
    with open(log, "a") as f:
        f.write(role + " term\\n")
    time.sleep(0.3)  # drains
    with open(log, "a") as f:
        f.write(role + " exit\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
time.sleep(120)
"""


def test_drain_stops_each_caller_before_what_it_calls(tmp_path: Path):
    log = tmp_path / "stops"
    roles = ["prefill", "decode", "router", "gateway", "prefill", "decode"]  # started in any order
    children = [
        Child(role, f"127.0.0.1:{i}", [sys.executable, "-c", _LOGS_ITS_STOP, str(log), role])
        for i, role in enumerate(roles)
    ]
    supervisor = Supervisor(children, drain_timeout_s=5)
    supervisor.start_all()
    wait_until(lambda: all(_has_handler(c.pid) for c in children), 30, "the children's handlers")
    assert supervisor.drain(StopSignals()) == 0
    events = log.read_text().split("\n")[:-1]
    assert len(events) == 2 * len(roles)
    order = ["gateway", "router", "decode", "prefill"]
    for before, after in zip(order, order[1:]):  # every one of a tier has exited before the next gets SIGTERM
        last_exit = max(i for i, e in enumerate(events) if e == f"{before} exit")
        first_term = min(i for i, e in enumerate(events) if e == f"{after} term")
        assert last_exit < first_term, events


def _has_handler(pid: int) -> bool:
    """Whether the process catches SIGTERM (/proc's SigCgt mask)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def _ignores_sigterm(pid: int) -> bool:
    """Whether the process ignores SIGTERM (/proc's SigIgn mask)."""
    with open(f"/proc/{pid}/status") as f:
        ignored = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(ignored & (1 << (signal.SIGTERM - 1)))


def _landed_on(worker: dict, stub, streams: list[Stream]) -> bool:
    """Start one more long stream; True once the worker runs a request."""
    streams.append(Stream(stub, greedy_request([1, 422, 3458, 314, 9 + len(streams)], 200, ignore_eos=True)))
    wait_until(lambda: streams[-1].tokens or streams[-1].error, 120, "the new stream streaming")
    load = worker_load(worker)
    return load is not None and load.num_running > 0


def _engine_process(worker_pid: int) -> int:
    """The worker's engine process: its child started by multiprocessing's spawn."""
    with open(f"/proc/{worker_pid}/task/{worker_pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return pid
    raise AssertionError(f"worker {worker_pid} has no engine process among {children}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_decode_worker_router_or_engine_process_is_restarted_on_its_address():
    cluster = start_cluster(1, 2, "tcp", "--policy", "round_robin")
    streams: list[Stream] = []
    try:
        stub = cluster.stub()
        streams += [
            Stream(stub, greedy_request([1, 422 + i, 3458, 314], 300, ignore_eos=True)) for i in range(4)
        ]
        wait_until(lambda: all(len(s.tokens) >= 2 for s in streams), 180, "every stream streaming")
        decode = [w for w in cluster.workers if w["role"] == "decode"]
        loads = wait_until(
            lambda: (x := [worker_load(w) for w in decode]) and sum(y.num_running for y in x if y) == 4 and x,
            30,
            "both decode workers' loads counting the streams",
        )
        busy, held = next((w, x.num_running) for w, x in zip(decode, loads) if x.num_running > 0)
        os.kill(busy["pid"], signal.SIGKILL)
        wait_until(lambda: sum(s.error is not None for s in streams) >= held, 30, "its streams ending")
        failed = [s for s in streams if s.error is not None]
        assert len(failed) == held and all(s.error.code() == grpc.StatusCode.UNAVAILABLE for s in failed)

        restarted = json.loads(cluster.wait_line("pdserve restarted: ", timeout=60))
        assert (restarted["role"], restarted["address"]) == ("decode", busy["address"])
        assert f"decode {busy['address']} (pid {busy['pid']}) died: killed by SIGKILL" in cluster.output()
        assert process_state(busy["pid"]) is None  # reaped: not left <defunct>
        wait_until(lambda: health(busy["address"]) == "SERVING", 180, "the restarted decode worker serving")
        wait_until(lambda: _landed_on(busy, stub, streams), 300, "a request on the restarted worker", every=0)
        for s in streams:
            s.cancel()

        os.kill(cluster.router_pid, signal.SIGKILL)
        again = json.loads(cluster.wait_line("pdserve restarted: ", timeout=60))
        assert (again["role"], again["address"]) == ("router", cluster.router)
        wait_until(lambda: health(cluster.router) == "SERVING", 180, "the restarted router serving")
        tokens, _, _ = collect(cluster.stub().Generate(greedy_request([1, 422, 3458], 4, ignore_eos=True)))
        assert len(tokens[0]) == 4

        other = next(w for w in decode if w is not busy)  # its engine process dies: the worker exits 1
        os.kill(_engine_process(other["pid"]), signal.SIGKILL)
        back = json.loads(cluster.wait_line("pdserve restarted: ", timeout=60))
        assert (back["role"], back["address"]) == ("decode", other["address"])
        assert f"decode {other['address']} (pid {other['pid']}) died: exit code 1" in cluster.output()
        wait_until(
            lambda: health(other["address"]) == "SERVING", 180, "the other decode worker serving again"
        )
        cluster.proc.send_signal(signal.SIGTERM)
        assert cluster.proc.wait(timeout=120) == 0
    finally:
        for s in streams:
            s.cancel()
        cluster.stop()
