"""What each worker of `pdserve up` / `pdserve serve` computes on: its GPUs (CUDA_VISIBLE_DEVICES, a GPU per
tensor-parallel rank; ranks compute on the first ones listed), or on a host without GPUs its share of the
CPU cores (OMP_NUM_THREADS)."""

from __future__ import annotations

import argparse
import os


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out: CUDA_VISIBLE_DEVICES's list, else every GPU torch sees."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def assign_gpus(gpus: list[str], workers: list[tuple[str, int]], transport: str) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each worker, given as (role, tensor_parallel_size) in start order: its own
    GPUs, the next ones of `gpus`, round-robin (workers share GPUs when there are fewer than their ranks;
    give them a smaller --gpu-memory-utilization then); a cuda_ipc prefill worker also lists every decode
    worker's GPUs after its own (it maps their KV pools). None for each (every worker sees every GPU) when
    there are none; ValueError, naming both counts, for a worker with more ranks than there are GPUs."""
    if not gpus:
        return [None] * len(workers)
    own, at = [], 0
    for role, tp in workers:
        if tp > len(gpus):
            raise ValueError(
                f"a {role} worker at tensor parallel size {tp} needs {tp} GPUs, {len(gpus)} are visible"
            )
        own.append([gpus[(at + i) % len(gpus)] for i in range(tp)])
        at += tp
    decode = [g for (role, _), mine in zip(workers, own) if role == "decode" for g in mine]
    out: list[str | None] = []
    for (role, _), mine in zip(workers, own):
        extra = (
            [g for g in dict.fromkeys(decode) if g not in mine]
            if role == "prefill" and transport == "cuda_ipc"
            else []
        )
        out.append(",".join(mine + extra))
    return out


def role_sizes(args: argparse.Namespace, passthrough: list[str]) -> tuple[dict[str, int], bool]:
    """({role: tensor_parallel_size}, whether the workers run on the CPU) from `up`'s --prefill-tp and
    --decode-tp, which default to the workers' own --tensor-parallel-size, else 1."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--device", default=None)
    workers, _ = p.parse_known_args(passthrough)
    sizes = {
        "prefill": args.prefill_tp or workers.tensor_parallel_size,
        "decode": args.decode_tp or workers.tensor_parallel_size,
    }
    for role, tp in sizes.items():
        if tp < 1:
            raise ValueError(f"--{role}-tp must be at least 1, got {tp}")
    return sizes, workers.device == "cpu"


def cpu_threads(ranks: int) -> str | None:
    """OMP_NUM_THREADS for engines of `ranks` rank processes in all that share this host's cores: an equal
    share each (torch otherwise gives every process a thread per core, and on a few cores their spinning
    threads take the CPU from each other: a 2 x 2 cluster on 2 cores ran 4-5x slower). None when the user
    set OMP_NUM_THREADS: theirs stands."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    return str(max(1, (os.cpu_count() or 1) // max(1, ranks)))
