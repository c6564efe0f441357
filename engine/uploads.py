"""Host tensors onto the GPU without making the host wait for the GPU.

`tensor.to("cuda")` from pageable memory is a synchronous copy: torch waits for the stream after it, so
a step's small uploads (token ids, positions, block tables, sampling knobs) each cost a round trip, and
one made while work is queued (e.g. the sampler's, behind the forward pass) holds the host until that
work is done. From pinned memory the copy is queued like a kernel (torch's pinned-memory cache keeps the
buffer until the copy has read it).
"""

from __future__ import annotations

import torch


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` (a CPU tensor) on `device`, queued on the current stream when that is a CUDA device."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
