"""Stable, collision-resistant prefix-block hashes, identical in router and workers.

hash(block) = SHA-256(domain tag, parent hash, the block's token ids, extra keys), every field
length-prefixed so no two different inputs share an encoding. Extra keys are domain-separated
(model id, the request's optional cache_salt): requests with different salts never share a block.
Never Python's hash(): it is randomised per process and weak.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

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
    token_ids: Sequence[int], block_size: int, extra: bytes = b"", parent: BlockHash = NONE_HASH
) -> list[BlockHash]:
    """The hash chain of every *full* block of token_ids (a partial tail block has no hash)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes
