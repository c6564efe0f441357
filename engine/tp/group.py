"""The process group of a tensor-parallel engine: torch.distributed's default group, one per process.

The model's layers all-reduce and all-gather over it (engine/layers/). Rank 0 (the engine process) and
each rank process join it once; kvtransfer never touches it (its nccl transport builds groups of its own),
so a worker's KV transfers and its tensor parallelism live side by side.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# A collective waits this long for a peer that is alive but late (a rank still loading, compiling). A dead
# peer is seen at once: gloo's connection closes, and NCCL's group is aborted (engine/tp/ranks.py).
TIMEOUT = datetime.timedelta(minutes=10)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join(backend: str, store: dist.Store, rank: int, size: int) -> None:
    if dist.is_initialized():
        raise ValueError(
            "this process already belongs to a torch.distributed group (another tensor-parallel engine?): "
            "shut that engine down first"
        )
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=TIMEOUT)


def leave() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError) as e:  # aborted after a rank died
            logger.warning("leaving the process group: %s", e)


def abort() -> None:
    """Make collectives in flight return (NCCL): called when a rank died. gloo needs nothing: its
    connections to the dead rank close, and its collectives raise."""
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return
    from torch.distributed import distributed_c10d as c10d

    try:
        if hasattr(c10d, "_abort_process_group"):
            c10d._abort_process_group()
        else:
            dist.group.WORLD._get_backend(torch.device("cuda")).abort()  # type: ignore[union-attr]
    except (AttributeError, RuntimeError, ValueError) as e:
        logger.warning("could not abort the NCCL group: %s", e)


def all_ranks_min(value: int, device: torch.device) -> int:
    """The smallest `value` over the ranks (e.g. the KV blocks every rank's memory holds)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
