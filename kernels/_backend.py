"""Which implementation an op runs: Triton on CUDA tensors, the torch reference elsewhere.

`PDSERVE_ATTENTION_BACKEND=torch|triton` (read once, here) forces one path for every op; tests
set `FORCED_BACKEND` directly. Triton on CPU tensors needs Triton's interpreter, which
`TRITON_INTERPRET=1` selects when triton is first imported (triton.language's own helpers are
compiled then), so it must be in the environment before anything imports triton.
"""

from __future__ import annotations

import functools
import os

import torch

_CHOICES = ("torch", "triton")


def _read_env() -> str | None:
    value = os.environ.get("PDSERVE_ATTENTION_BACKEND", "").strip().lower()
    if value and value not in _CHOICES:
        raise ValueError(f"PDSERVE_ATTENTION_BACKEND must be one of {_CHOICES}, got {value!r}")
    return value or None


FORCED_BACKEND: str | None = _read_env()


def use_triton(tensor: torch.Tensor) -> bool:
    if FORCED_BACKEND is not None:
        return FORCED_BACKEND == "triton"
    return tensor.is_cuda


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: any small count exercises the same code paths
    return torch.cuda.get_device_properties(device).multi_processor_count
