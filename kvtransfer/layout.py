"""The KV pool's layout, descriptor fields, and moving blocks between pools.

pool: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), contiguous
       layer l, K(0)/V(1), block b -> one contiguous chunk of block_size*heads*head_dim elements

transfer payload: the bytes of (num_layers, 2, n, block_size, num_kv_heads, head_dim), contiguous
       = gather(pool, src_block_ids); its block i lands in dst_block_ids[i] (scatter)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtransfer.base import Descriptor, KVTransferError

MAX_SLICE_COPIES = 16  # above this many contiguous runs, a gather + scatter beats many small copies
# rows(): the widest first. complex128 is only a 16-byte container here: blocks are moved, never computed on.
WORDS: tuple[torch.dtype, ...] = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)


@dataclass(frozen=True)
class PoolLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"

    @classmethod
    def of(cls, pool: torch.Tensor) -> PoolLayout:
        if pool.dim() != 6 or pool.shape[1] != 2:
            raise KVTransferError(
                "kv pool must be (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), "
                f"got shape {tuple(pool.shape)}"
            )
        if not pool.is_contiguous():
            raise KVTransferError("kv pool must be contiguous")
        L, _, nb, bs, h, d = pool.shape
        return cls(L, nb, bs, h, d, str(pool.dtype).removeprefix("torch."))

    @classmethod
    def from_dict(cls, d: Any) -> PoolLayout:
        try:
            return cls(
                num_layers=int(d["num_layers"]),
                num_blocks=int(d["num_blocks"]),
                block_size=int(d["block_size"]),
                num_kv_heads=int(d["num_kv_heads"]),
                head_dim=int(d["head_dim"]),
                dtype=str(d["dtype"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise KVTransferError(f"kv descriptor has a bad 'layout' {d!r}: {e!r}") from e

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @property
    def torch_dtype(self) -> torch.dtype:
        dt = getattr(torch, self.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise KVTransferError(f"unknown kv pool dtype {self.dtype!r}")
        return dt

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        elem = self.torch_dtype.itemsize  # not torch.empty(): this is on every send's path
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def part(self, num_kv_heads: int) -> PoolLayout:
        """The layout of a transfer that carries `num_kv_heads` of this pool's KV heads (a lane between
        tensor-parallel ranks that split the heads differently)."""
        return PoolLayout(
            self.num_layers, self.num_blocks, self.block_size, num_kv_heads, self.head_dim, self.dtype
        )

    def check_peer(self, peer: PoolLayout) -> None:
        """Raise unless a pool of layout `peer` can exchange blocks with this one."""
        mine = (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)
        theirs = (peer.num_layers, peer.block_size, peer.num_kv_heads, peer.head_dim, peer.dtype)
        if mine != theirs:
            hint = "; start both workers with the same --kv-cache-dtype" if self.dtype != peer.dtype else ""
            raise KVTransferError(
                "kv pool layouts differ (num_layers, block_size, num_kv_heads, head_dim, dtype): "
                f"local {mine} vs remote {theirs}{hint}"
            )

    def check_ids(self, ids: Sequence[int], what: str) -> None:
        if len(ids) and (min(ids) < 0 or max(ids) >= self.num_blocks):  # C loops; then find the culprit
            bad = next(b for b in ids if not 0 <= b < self.num_blocks)
            raise KVTransferError(f"{what} block id {bad} out of range [0, {self.num_blocks})")

    def id_array(self, ids: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
        """`ids` as a flat int64 array, checked in [0, num_blocks): check_ids for a send's hot path, where
        a 256-id list costs ~8 us this way against ~15 through int() and min/max (numpy converts as int()
        does). One reduction checks both bounds: a negative id viewed as uint64 is above any block count."""
        try:
            a = np.asarray(ids, dtype=np.int64)
        except (TypeError, ValueError, OverflowError) as e:
            raise KVTransferError(f"{what} block ids are not integers: {e}") from e
        if a.ndim != 1:
            raise KVTransferError(f"{what} block ids must be a flat sequence, got shape {a.shape}")
        if a.size and int(a.view(np.uint64).max()) >= self.num_blocks:
            self.check_ids(a.tolist(), what)  # raises, naming the first bad id
        return a


@dataclass(frozen=True)
class HeadRange:
    """KV heads [start, start + count) of a pool: what one lane of a transfer reads or writes."""

    start: int
    count: int

    def whole(self, layout: PoolLayout) -> bool:
        return self.start == 0 and self.count == layout.num_kv_heads

    def overlaps(self, other: HeadRange) -> bool:
        return self.start < other.start + other.count and other.start < self.start + self.count

    @classmethod
    def from_meta(cls, value: Any, layout: PoolLayout) -> HeadRange:
        """A HELLO's "heads" ([start, count]) checked against the pool; absent: every head."""
        if value is None:
            return cls(0, layout.num_kv_heads)
        ok = isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value)
        if not ok or value[0] < 0 or value[1] < 1 or value[0] + value[1] > layout.num_kv_heads:
            raise KVTransferError(f"bad kv heads {value!r} for a pool of {layout.num_kv_heads} kv heads")
        return cls(value[0], value[1])


@dataclass(frozen=True)
class Lane:
    """One sender's part of a transfer between pools that hold different KV heads (tensor-parallel
    ranks): its `src` heads land in the receiver's `dst` heads (as many)."""

    src: HeadRange
    dst: HeadRange


def lane_layouts(
    pool: torch.Tensor, descriptor: Descriptor, lane: Lane | None
) -> tuple[PoolLayout, PoolLayout, dict[str, Any]]:
    """A sender's (layout of what it sends, the receiver's layout, its HELLO): the local pool's layout, or
    with a lane the layout of its share of the heads, which the receiver checks against the same share
    of its own pool (the HELLO's "heads"). KVTransferError when the two cannot exchange blocks."""
    local = PoolLayout.of(pool)
    remote = PoolLayout.from_dict(field(descriptor, "layout", dict))
    if lane is None:
        local.check_peer(remote)
        return local, remote, {"layout": local.to_dict()}
    if lane.src.count != lane.dst.count or lane.src.start + lane.src.count > local.num_kv_heads:
        raise KVTransferError(f"bad kv lane {lane} for a pool of {local.num_kv_heads} kv heads")
    HeadRange.from_meta([lane.dst.start, lane.dst.count], remote)  # raises when out of range
    sent = local.part(lane.src.count)
    sent.check_peer(remote.part(lane.dst.count))
    return sent, remote, {"layout": sent.to_dict(), "heads": [lane.dst.start, lane.dst.count]}


def field(desc: Descriptor, key: str, kind: type) -> Any:
    """desc[key], checked to be a `kind`, or a KVTransferError that names the field."""
    if key not in desc:
        raise KVTransferError(f"kv descriptor for {desc.get('transport')!r} lacks field {key!r}")
    value = desc[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise KVTransferError(f"kv descriptor field {key!r} must be {kind.__name__}, got {value!r}")
    return value


def check_pair(src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> None:
    if len(src_block_ids) != len(dst_block_ids):
        raise KVTransferError(
            f"{len(src_block_ids)} source blocks but {len(dst_block_ids)} destination blocks"
        )
    if len(set(dst_block_ids)) != len(dst_block_ids):
        raise KVTransferError("destination block ids repeat")


def runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ids: (position in ids, first id, length)."""
    out: list[tuple[int, int, int]] = []
    for pos, b in enumerate(ids):
        if out and out[-1][1] + out[-1][2] == b:
            p, first, n = out[-1]
            out[-1] = (p, first, n + 1)
        else:
            out.append((pos, b, 1))
    return out


def index_tensor(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.int64, device=device)


def rows(pool: torch.Tensor, word: torch.dtype | None = None) -> torch.Tensor:
    """The pool as (num_layers * 2, num_blocks, words): one row per (layer, K/V, block), in the widest
    word that divides a block. Block copies are bit copies, and torch's strided-copy and index kernels
    move one element per thread unvectorised, so 16-byte words move 8x the bytes per thread of bf16
    (measured on the H200: int64 rows copied 1.7x faster than int16 rows)."""
    flat = pool.view(pool.shape[0] * pool.shape[1], pool.shape[2], -1)
    row_bytes = flat.shape[2] * flat.element_size()
    for w in (word,) if word is not None else WORDS:
        if row_bytes % w.itemsize == 0:
            return flat.view(w)
    return flat


def gather(pool: torch.Tensor, ids: Sequence[int], heads: HeadRange | None = None) -> torch.Tensor:
    """The blocks `ids`, contiguous: (num_layers * 2, len(ids), words), i.e. (L, 2, n, bs, h, d) in bytes;
    with `heads`, only those KV heads: (L, 2, n, bs, heads.count, d)."""
    if heads is not None and heads.count != pool.shape[4]:
        index = index_tensor(ids, pool.device)
        return pool.index_select(2, index)[:, :, :, :, heads.start : heads.start + heads.count].contiguous()
    return rows(pool).index_select(1, index_tensor(ids, pool.device))


def scatter(
    pool: torch.Tensor, ids: Sequence[int], data: torch.Tensor, heads: HeadRange | None = None
) -> None:
    """pool[:, :, ids[i]] = block i of `data`, a contiguous tensor laid out as gather() returns (any dtype);
    with `heads`, into those KV heads of each block only."""
    if heads is not None and heads.count != pool.shape[4]:
        L, two, _, bs, _, d = pool.shape
        part = data.reshape(-1).view(torch.uint8).view(pool.dtype).view(L, two, len(ids), bs, heads.count, d)
        pool[:, :, index_tensor(ids, pool.device), :, heads.start : heads.start + heads.count] = part
        return
    target = rows(pool)
    words = data.reshape(-1).view(torch.uint8).view(target.dtype).view(target.shape[0], len(ids), -1)
    target.index_copy_(1, index_tensor(ids, pool.device), words)


def uses_kernel(
    src_pool: torch.Tensor, dst_pool: torch.Tensor, src_ids: Sequence[int], dst_ids: Sequence[int]
) -> bool:
    """Both pools on one CUDA device: kernels/kv_block_copy.py moves any id pattern in one pass and one
    launch, at 0.92 of a device-to-device copy_ (H200, kernel alone). torch's slice copies take one launch
    per (layer, K/V) row even for one run of ids (64 for Llama-3-8B), which costs more host time."""
    return src_pool.is_cuda and dst_pool.device == src_pool.device


def needs_staging(src_ids: Sequence[int], dst_ids: Sequence[int]) -> bool:
    """True when both sides are too fragmented for torch's one-pass copies: copy_blocks then gathers first
    (unless the block-copy kernel runs, see uses_kernel)."""
    return min(len(runs(src_ids)), len(runs(dst_ids))) > MAX_SLICE_COPIES


def copy_blocks(
    src_pool: torch.Tensor,
    src_ids: Sequence[int],
    dst_pool: torch.Tensor,
    dst_ids: Sequence[int],
    staged: torch.Tensor | None = None,
    *,
    kernel: bool | None = None,
    device_ids: torch.Tensor | None = None,
) -> None:
    """dst_pool[:, :, dst_ids[i]] = src_pool[:, :, src_ids[i]]. Both pools on one device. Where uses_kernel
    (or kernel=True) the Triton block-copy kernel does it in one pass for any ids; otherwise torch copies
    slices in one pass when either side is a few contiguous runs, else gathers then scatters (two passes;
    `staged` = gather(src_pool, src_ids) when the caller gathered ahead). `device_ids`: the ids already on
    the GPU as kernels.kv_block_copy.upload_ids returns them, uploaded ahead on this stream."""
    if staged is None and (uses_kernel(src_pool, dst_pool, src_ids, dst_ids) if kernel is None else kernel):
        from kernels.kv_block_copy import kv_block_copy_triton, upload_ids

        n = len(src_ids)
        if device_ids is None:
            device_ids = upload_ids(src_ids, dst_ids, src_pool.device)
        kv_block_copy_triton(src_pool, device_ids[:n], dst_pool, device_ids[n : 2 * n])
        return
    src_runs, dst_runs = runs(src_ids), runs(dst_ids)
    if staged is not None or min(len(src_runs), len(dst_runs)) > MAX_SLICE_COPIES:
        scatter(dst_pool, dst_ids, gather(src_pool, src_ids) if staged is None else staged)
        return
    src_rows, dst_rows = rows(src_pool), rows(dst_pool)
    if len(src_runs) <= len(dst_runs):
        for pos, first, n in src_runs:  # contiguous source slice -> scattered destination
            src = src_rows[:, first : first + n]  # (L * 2, n, words), strided
            dst_part = dst_ids[pos : pos + n]
            if len(runs(dst_part)) == 1:
                dst_rows[:, dst_part[0] : dst_part[0] + n].copy_(src)
            else:
                dst_rows.index_copy_(1, index_tensor(dst_part, dst_pool.device), src)
    else:
        for pos, first, n in dst_runs:  # scattered source -> contiguous destination slice
            out = dst_rows[:, first : first + n]
            torch.index_select(src_rows, 1, index_tensor(src_ids[pos : pos + n], src_pool.device), out=out)


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes (any dtype, bf16 too)."""
    return memoryview(t.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
