"""pdserve kvtransfer: move paged KV blocks from a prefill worker's pool into a decode worker's pool.

One interface (base.py), three transports: cuda_ipc (same host), nccl (torch.distributed; gloo on
CPU) and tcp (host bytes, any two hosts). See docs/kvtransfer.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# every transport: its name is its module here (kvtransfer/<name>.py), which defines RECEIVER and SENDER
TRANSPORTS = ("tcp", "nccl", "cuda_ipc")

if TYPE_CHECKING:
    from kvtransfer.base import Descriptor, KVReceiver, KVSender, KVTransferError, connect, create_receiver
    from kvtransfer.layout import PoolLayout

_LAZY = {
    **dict.fromkeys(
        ("Descriptor", "KVReceiver", "KVSender", "KVTransferError", "connect", "create_receiver"),
        "kvtransfer.base",
    ),
    "PoolLayout": "kvtransfer.layout",
}


def __getattr__(name: str) -> Any:
    # the interface pulls in torch: it is imported when first asked for, so the CLI reads TRANSPORTS without
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtransfer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "TRANSPORTS",
    "Descriptor",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "PoolLayout",
    "connect",
    "create_receiver",
]
