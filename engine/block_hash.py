"""Stable, collision-resistant prefix-block hashes, identical in router and workers.

hash(block) = SHA-256(domain tag, parent hash, the block's token ids, extra keys), every field
length-prefixed so no two different inputs share an encoding. Extra keys are domain-separated
(model id, the request's optional cache_salt): requests with different salts never share a block.
Never Python's hash(): it is randomised per process and weak.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import overload

import numpy as np

BlockHash = bytes  # 32 bytes

_DOMAIN = b"pdserve.block.v1"
NONE_HASH: BlockHash = hashlib.sha256(_DOMAIN + b".root").digest()


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<I", len(payload)) + payload


def extra_keys(model_id: str, cache_salt: str | None = None) -> bytes:
    """Encode the per-request keys that every block hash of the request carries."""
    out = _field(b"m", model_id.encode())
    if cache_salt is not None:
        out += _field(b"s", cache_salt.encode())
    return out


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    h = hashlib.sha256(_DOMAIN)
    h.update(_field(b"p", parent))
    h.update(_field(b"t", struct.pack(f"<{len(token_ids)}I", *token_ids)))
    h.update(_field(b"x", extra))
    return h.digest()


def hash_prompt_blocks(
    token_ids: Sequence[int] | np.ndarray, block_size: int, extra: bytes = b"", parent: BlockHash = NONE_HASH
) -> list[BlockHash]:
    """The hash chain of every *full* block of token_ids (a partial tail block has no hash).

    Equal to chaining hash_block, about 3.5x faster for long prompts (it runs on the router and on both
    workers for every request): the tokens are packed once, and each block's whole input (domain tag,
    parent, tokens, extra keys) goes to one sha256() call as one joined byte string."""
    full = len(token_ids) // block_size
    if full == 0:
        return []
    raw = np.asarray(token_ids[: full * block_size], dtype="<u4").tobytes()  # OverflowError out of uint32
    step = 4 * block_size
    head = _DOMAIN + b"p" + struct.pack("<I", len(parent))  # every parent is a 32-byte digest
    tokens_field = b"t" + struct.pack("<I", step)
    extra_field = _field(b"x", extra)
    sha256, join = hashlib.sha256, b"".join
    hashes: list[BlockHash] = []
    for start in range(0, full * step, step):
        parent = sha256(join((head, parent, tokens_field, raw[start : start + step], extra_field))).digest()
        hashes.append(parent)
    return hashes


class LazyBlockHashes(Sequence[BlockHash]):
    """`hash_prompt_blocks(token_ids, block_size, extra)` as a sequence whose hashes are computed as far as
    they are read, in chunks that double in size (at most twice the hashing that was read). The router
    looks a prompt up in its prefix index with it: the lookup reads the chain only while some worker holds
    the block, so a prompt no worker holds costs one hash before it is routed, not one per block (4096
    tokens: 256, ~0.2 ms); the rest is hashed when its blocks are speculated, after the decode call went
    out."""

    def __init__(self, token_ids: Sequence[int] | np.ndarray, block_size: int, extra: bytes = b"") -> None:
        self._ids, self._block_size, self._extra = token_ids, block_size, extra
        self._len = len(token_ids) // block_size
        self._hashes: list[BlockHash] = []

    def __len__(self) -> int:
        return self._len

    def _upto(self, n: int) -> list[BlockHash]:
        hashes, bs = self._hashes, self._block_size
        if n > len(hashes):
            parent = hashes[-1] if hashes else NONE_HASH
            hashes += hash_prompt_blocks(self._ids[len(hashes) * bs : n * bs], bs, self._extra, parent)
        return hashes

    @overload
    def __getitem__(self, i: int) -> BlockHash: ...
    @overload
    def __getitem__(self, i: slice) -> list[BlockHash]: ...
    def __getitem__(self, i: int | slice) -> BlockHash | list[BlockHash]:
        if isinstance(i, slice):
            return self._upto(self._len)[i]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError("block index out of range")
        return self._upto(i + 1)[i]

    def __iter__(self) -> Iterator[BlockHash]:
        return hashed_as_read(self._upto, self._len)


def hashed_as_read(upto: Callable[[int], list[BlockHash]], n: int) -> Iterator[BlockHash]:
    """The first `n` hashes of a chain, from `upto(k)` (the chain computed so far, at least k long), asked for
    in runs that double, so a reader that stops early has paid for at most twice what it read."""
    i, run = 0, 1
    while i < n:
        hashes = upto(min(n, i + run))
        yield from hashes[i:n]
        i, run = min(n, len(hashes)), run * 2
