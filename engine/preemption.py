"""What a preempted request does with its KV blocks: recompute (free them; the request recomputes its tokens
when it runs again) or swap (copy them to the CPU swap space and back, engine/swap.py).

`preemption_mode`: `recompute`, `swap`, or `auto`, which picks per victim: swap when copying its blocks out
and back in (blocks x bytes / the host link's bandwidth, measured at start-up) costs less than recomputing
its tokens (tokens / the prefill rate, measured at start-up). A victim that the CPU pool cannot hold is
recomputed in every mode, so a request whose KV fits in neither pool waits in the queue; it never fails.
Without swap space every victim is recomputed.

The scheduler calls `preempt` for each victim, `restorable_tokens` and `restore` when it admits a waiting
request (a swapped-out one comes back), `forget` when a request ends, `poll` as each step is planned and
`flush` once it is: the copies the plan needs run then, in one pass per direction.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.sequence import Sequence
from engine.swap import SwapSpace

MODES = ("swap", "recompute")


@dataclass(frozen=True)
class SwapCosts:
    """What auto mode weighs, measured at start-up (engine/swap_setup.py)."""

    link_bytes_per_s: float  # host <-> device, one direction (the mean of a copy out and one back in)
    prefill_tokens_per_s: float
    bytes_per_block: int

    def swap_seconds(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.bytes_per_block / self.link_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s


class Preemption:
    def __init__(
        self,
        block_manager: BlockManager,
        mode: str = "recompute",
        swap: SwapSpace | None = None,
        costs: SwapCosts | None = None,
    ) -> None:
        if mode not in ("auto", *MODES):
            raise ValueError(f"preemption_mode must be auto, swap or recompute, got {mode!r}")
        self.block_manager, self.mode, self.swap, self.costs = block_manager, mode, swap, costs
        self.counts = dict.fromkeys(MODES, 0)  # preemptions by the mode each one took

    def choose(self, seq: Sequence) -> str:
        """How the request would be preempted now."""
        if self.swap is None or self.mode == "recompute" or not self.swap.can_swap_out(seq):
            return "recompute"
        if self.mode == "swap" or self.costs is None:
            return "swap"
        copy = self.costs.swap_seconds(self.swap.blocks_to_copy_out(seq))
        return "swap" if copy < self.costs.recompute_seconds(seq.num_computed_tokens) else "recompute"

    def preempt(self, seq: Sequence) -> str:
        """Take the request's blocks back, by swap or recompute; returns which."""
        mode = self.choose(seq)
        if mode == "swap":
            assert self.swap is not None
            self.swap.swap_out(seq)
        else:
            self.block_manager.free(seq)
        self.counts[mode] += 1
        return mode

    def restorable_tokens(self, seq: Sequence) -> int:
        """Computed tokens that `restore` brings back to an admitted request (0 unless swapped out)."""
        return self.swap.restorable_tokens(seq) if self.swap is not None else 0

    def restore(self, seq: Sequence) -> None:
        """Admitting the request, after its prefix-cache hits: swap in what it has on the CPU."""
        if self.swap is not None:
            self.swap.swap_in(seq)

    def forget(self, seq: Sequence) -> None:
        if self.swap is not None:
            self.swap.forget(seq)

    def poll(self) -> None:
        if self.swap is not None:
            self.swap.poll()

    def flush(self) -> None:
        """The step's plan is made: run the swaps' copies it queued."""
        if self.swap is not None:
            self.swap.flush()

    def counters(self) -> dict[str, float]:
        """Preemptions by mode; with a swap space, the swaps' blocks, bytes and seconds each way."""
        out: dict[str, float] = {f"num_preemptions_by_mode/{m}": n for m, n in self.counts.items()}
        if self.swap is not None:
            st = self.swap.stats
            out.update({
                "kv_swap_out_blocks": st.out_blocks, "kv_swap_in_blocks": st.in_blocks,
                "kv_swap_out_bytes": st.out_bytes, "kv_swap_in_bytes": st.in_bytes,
                "kv_swap_out_seconds": st.out_seconds, "kv_swap_in_seconds": st.in_seconds,
            })  # fmt: skip
        return out

    def load(self) -> dict[str, int]:
        """The swap space's gauges for a worker's load report (cpu_cache_usage_perc, requests swapped)."""
        swap = self.swap
        if swap is None:
            return {"num_cpu_blocks": 0, "num_free_cpu_blocks": 0, "num_swapped": 0}
        return {
            "num_cpu_blocks": swap.num_blocks,
            "num_free_cpu_blocks": swap.cpu.num_free,
            "num_swapped": swap.num_swapped,
        }
