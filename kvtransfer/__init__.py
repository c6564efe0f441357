"""pdserve kvtransfer: move paged KV blocks from a prefill worker's pool into a decode worker's pool.

One interface (base.py), three transports: cuda_ipc (same host), nccl (torch.distributed; gloo on
CPU) and tcp (host bytes, any two hosts). See docs/kvtransfer.md.
"""

from kvtransfer.base import (
    TRANSPORTS,
    Descriptor,
    KVReceiver,
    KVSender,
    KVTransferError,
    connect,
    create_receiver,
)
from kvtransfer.layout import PoolLayout

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
