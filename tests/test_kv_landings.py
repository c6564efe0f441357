"""kvtransfer.landings and cuda_ipc's completion on the CPU: the landing counters a decode worker
creates in /dev/shm, seen through a second mapping as a prefill worker maps them, and the receiver's
wait on its cell (landed when the cell reaches the DONE's number; failed when the sender's connection
closes first). On the GPU the sender's stream writes the cell (tests/gpu/test_kvtransfer_gpu.py)."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import pytest

from kvtransfer import KVTransferError
from kvtransfer.cuda_ipc import _Landing
from kvtransfer.landings import MAX_SENDERS, NBYTES, LandingCounters
from kvtransfer.wire import Channel


def test_a_second_mapping_sees_the_same_cells_and_close_removes_the_file() -> None:
    owner = LandingCounters.create()
    try:
        assert owner.cells.shape == (MAX_SENDERS,) and not owner.cells.any()
        other = LandingCounters.attach(owner.path)
        other.cells[7] = 41
        assert owner.cells[7] == 41
        owner.cells[8] = 5
        assert other.cells[8] == 5
        assert owner.address() % 4096 == 0  # page-aligned, as cudaHostRegister wants
        other.close()
        assert os.path.exists(owner.path), "only the decode side removes the file"
    finally:
        owner.close()
    assert not os.path.exists(owner.path)


def test_attach_explains_a_missing_or_foreign_file(tmp_path: Any) -> None:
    with pytest.raises(KVTransferError, match="sharing /dev/shm"):
        LandingCounters.attach(str(tmp_path / "gone"))
    short = tmp_path / "short"
    short.write_bytes(b"\0" * (NBYTES // 2))
    with pytest.raises(KVTransferError, match="not 8192"):
        LandingCounters.attach(str(short))


class _Receiver:
    """What _Landing needs of a CudaIpcKVReceiver: its counters and the slot list."""

    def __init__(self) -> None:
        self._landings = LandingCounters.create()
        self.freed: list[int] = []

    def _free_slot(self, slot: int) -> None:
        self.freed.append(slot)


@pytest.fixture
def landing() -> Any:
    """A _Landing on slot 3, a second mapping of its cells (the sender's), and a real TCP connection:
    (receiver's end, sender's end)."""
    receiver = _Receiver()
    sender_view = LandingCounters.attach(receiver._landings.path)
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    server.close()
    ends = Channel(accepted, "sender"), Channel(client, "receiver")
    yield _Landing(receiver, 3), sender_view.cells, ends
    for ch in ends:
        ch.close()
    sender_view.close()
    receiver._landings.close()


def test_landed_once_the_cell_reaches_the_number(landing: Any) -> None:
    completion, cells, (ch, _) = landing
    assert completion.welcome == {"slot": 3}
    cells[3] = 2
    assert completion.landed({"seq": 2}, ch) is None  # already there
    t0 = time.monotonic()
    writer = threading.Timer(0.05, lambda: cells.__setitem__(3, 3))
    writer.start()
    assert completion.landed({"seq": 3, "request_id": "r"}, ch) is None
    assert time.monotonic() - t0 >= 0.045, "returned before the cell was written"
    writer.join()
    cells[3] = 9  # a later transfer's number covers this one too (one stream, in order)
    assert completion.landed({"seq": 4}, ch) is None


def test_a_sender_gone_before_its_copy_landed_fails_the_wait(landing: Any) -> None:
    completion, cells, (ch, sender_end) = landing
    cells[3] = 4
    threading.Timer(0.05, sender_end.close).start()
    t0 = time.monotonic()
    error = completion.landed({"seq": 5}, ch)
    assert error is not None and "closed the connection" in error
    assert time.monotonic() - t0 < 5
    assert cells[3] == 4


def test_a_done_without_its_number_is_refused(landing: Any) -> None:
    completion, _, (ch, _) = landing
    assert completion.landed({"request_id": "r"}, ch) == "DONE carries no sequence number"
    completion.close()
    assert completion._receiver.freed == [3]


def test_create_removes_the_files_of_dead_workers_of_its_namespace_only(tmp_path: Any) -> None:
    """A decode worker killed with SIGKILL never closes its counters: the next one on the host removes
    its file (creator pid gone, same pid namespace), and leaves a live process's and another
    namespace's (another container sharing /dev/shm) alone."""
    import subprocess
    import sys

    from kvtransfer.landings import PREFIX, _namespace

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    ns = _namespace()
    stale = tmp_path / f"{PREFIX}{ns}-{dead_pid}-abc"
    live = tmp_path / f"{PREFIX}{ns}-{os.getpid()}-def"
    foreign = tmp_path / f"{PREFIX}{ns}1-{dead_pid}-ghi"
    unrelated = tmp_path / f"other-{dead_pid}"
    for f in (stale, live, foreign, unrelated):
        f.write_bytes(b"\0" * 8)
    counters = LandingCounters.create(str(tmp_path))
    try:
        assert not stale.exists() and live.exists() and foreign.exists() and unrelated.exists()
        assert os.path.basename(counters.path).startswith(f"{PREFIX}{ns}-{os.getpid()}-")
    finally:
        counters.close()
