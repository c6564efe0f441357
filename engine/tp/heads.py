"""How tensor parallelism splits a model: which heads, KV heads and vocabulary rows each rank holds.

Rank r of N holds query heads [r * H/N, (r + 1) * H/N) and, when N divides the KV heads, KV heads
[r * KV/N, (r + 1) * KV/N). When N exceeds the KV head count (and is a multiple of it), each rank holds
the one KV head its query heads read, so KV heads are replicated N/KV times:

    H = 8 query heads, KV = 2, N = 4:   rank   0     1     2     3
                                        q      0-1   2-3   4-5   6-7
                                        kv     0     0     1     1

The vocabulary is split in ceil(V/N) rows per rank; the last rank's rows past V are zero and their logits
are dropped after the gather.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadShard:
    """One rank's share of the attention heads."""

    rank: int
    size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    head_start: int  # first query head (global index)
    kv_head_start: int  # first KV head (global index)
    total_kv_heads: int

    @property
    def kv_heads(self) -> range:
        """The global KV heads this rank holds, in its pool's order."""
        return range(self.kv_head_start, self.kv_head_start + self.num_kv_heads)


def shard_heads(total_heads: int, total_kv_heads: int, tp_size: int, rank: int) -> HeadShard:
    """Rank `rank`'s heads; ValueError naming the counts when `tp_size` cannot split them."""
    check_heads(total_heads, total_kv_heads, tp_size)
    heads = total_heads // tp_size
    kv = kv_head_ranges(total_kv_heads, tp_size)[rank]
    return HeadShard(rank, tp_size, heads, len(kv), rank * heads, kv.start, total_kv_heads)


def kv_head_ranges(total_kv_heads: int, tp_size: int) -> list[range]:
    """The global KV heads each of `tp_size` ranks holds (a replicated head appears on several ranks)."""
    if tp_size <= total_kv_heads:
        kv = total_kv_heads // tp_size
        return [range(r * kv, (r + 1) * kv) for r in range(tp_size)]
    return [range(r * total_kv_heads // tp_size, r * total_kv_heads // tp_size + 1) for r in range(tp_size)]


def check_heads(total_heads: int, total_kv_heads: int, tp_size: int) -> None:
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tp_size}")
    if total_heads % tp_size:
        raise ValueError(
            f"num_attention_heads ({total_heads}) is not divisible by tensor_parallel_size {tp_size}"
        )
    if tp_size <= total_kv_heads and total_kv_heads % tp_size:
        raise ValueError(
            f"num_key_value_heads ({total_kv_heads}) is not divisible by tensor_parallel_size {tp_size}"
        )
    if tp_size > total_kv_heads and tp_size % total_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp_size} exceeds num_key_value_heads ({total_kv_heads}) and is not a "
            "multiple of it, so the KV heads cannot be replicated evenly"
        )


def vocab_rows_per_rank(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size)


def check_model(num_heads: int, num_kv_heads: int, intermediate_size: int, tp_size: int) -> None:
    """ValueError unless a model of these sizes splits over `tp_size` ranks (checked before any rank
    starts)."""
    check_heads(num_heads, num_kv_heads, tp_size)
    if intermediate_size % tp_size:
        raise ValueError(
            f"intermediate_size ({intermediate_size}) is not divisible by tensor_parallel_size {tp_size}"
        )
