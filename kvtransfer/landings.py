"""Landing counters in shared host memory: how a cuda_ipc receiver sees a copy land with a plain load.

The decode worker creates one small file under /dev/shm (MAX_SENDERS int64 cells, zeroed) and names it
in its descriptor; each prefill worker on the host maps the file and registers the mapping with CUDA
(page-locked, so its stream can write there). After each copy into the decode pool the sender's stream
copies the transfer's sequence number into its connection's cell (a device-to-host copy, ordered after
the copy on that stream); the receiver's connection thread reads the cell from its own mapping of the
same pages. A cell at `seq` or past it proves every copy up to `seq` has landed: no CUDA call on the
decode side, no message after the copy. A sender that dies with its copy queued never writes the cell.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile

import numpy as np

from kvtransfer.base import KVTransferError

MAX_SENDERS = 1024  # connections one decode worker serves at once: one cell each
NBYTES = MAX_SENDERS * 8  # two pages


def shm_dir() -> str:
    """Where the file lives: /dev/shm (memory, shared by every process of the host's IPC namespace)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


PREFIX = "pdserve-kv-landings-"


def _namespace() -> str:
    """This process's pid namespace (an inode number): a pid means something only inside it, and the
    containers of one host that share /dev/shm (ipc: host) each have their own."""
    try:
        return os.readlink("/proc/self/ns/pid").removeprefix("pid:[").removesuffix("]")
    except OSError:
        return "0"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def remove_orphans(directory: str) -> list[str]:
    """Remove the landing files of this pid namespace whose creator is gone; returns their paths."""
    mine = f"{PREFIX}{_namespace()}-"
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            pid = name.removeprefix(mine).split("-")[0]
            if name.startswith(mine) and pid.isdigit() and not _alive(int(pid)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(directory, name))
                    removed.append(os.path.join(directory, name))
    return removed


class LandingCounters:
    """The mapped file: `cells` (MAX_SENDERS int64, a numpy view); `create` on the decode side (the file is
    removed by `close`), `attach` on the prefill side."""

    def __init__(self, path: str, mm: mmap.mmap, owner: bool) -> None:
        self.path, self._mm, self._owner = path, mm, owner
        self.cells = np.frombuffer(mm, dtype=np.int64)

    @classmethod
    def create(cls, directory: str | None = None) -> LandingCounters:
        """A new zeroed file, named after this process (pid namespace, pid); the files that dead processes
        of this namespace left (a killed decode worker never runs close) are removed first."""
        directory = directory or shm_dir()
        remove_orphans(directory)
        fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{_namespace()}-{os.getpid()}-", dir=directory)
        try:
            os.ftruncate(fd, NBYTES)  # zero-filled
            mm = mmap.mmap(fd, NBYTES)
        finally:
            os.close(fd)
        return cls(path, mm, owner=True)

    @classmethod
    def attach(cls, path: str) -> LandingCounters:
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise KVTransferError(
                f"cannot open the decode worker's landing counters {path!r} ({e.strerror}): cuda_ipc needs "
                "both workers on one host sharing /dev/shm (containers: ipc: host)"
            ) from e
        try:
            if os.fstat(fd).st_size != NBYTES:
                raise KVTransferError(
                    f"landing counters {path!r} are {os.fstat(fd).st_size} bytes, not {NBYTES}"
                )
            mm = mmap.mmap(fd, NBYTES)
        finally:
            os.close(fd)
        return cls(path, mm, owner=False)

    def address(self) -> int:
        """The mapping's first byte (page-aligned), for cudaHostRegister."""
        return int(self.cells.ctypes.data)

    def close(self) -> None:
        """Unmaps (once no view of it is left; until then the mapping lives on) and, for the decode side,
        removes the file."""
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self._owner = False
        self.cells = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a view still exported: unmapped when it goes
            self._mm.close()
