"""Which implementation an op runs: Triton on CUDA tensors, the torch reference elsewhere.

`PDSERVE_ATTENTION_BACKEND=torch|triton` (read once, here, as is every kernel knob) forces one path for every op; tests
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
# PDSERVE_PDL=0 launches every kernel plainly, none as a programmatic dependent of the kernel before it
# (kernels/pdl.py): the A-B of `python3 -m bench.quant_int4`
PDL: bool = os.environ.get("PDSERVE_PDL", "1").strip() != "0"
# PDSERVE_FUSED_NORMS=0 keeps a decoder layer's norms in kernels of their own where its int4 GEMMs could carry
# them (engine/model.py, kernels/w4a16_mma.py)
FUSED_NORMS: bool = os.environ.get("PDSERVE_FUSED_NORMS", "1").strip() != "0"
# PDSERVE_FUSED_ROTARY=0 keeps RoPE and the KV-cache write in their own kernel where the int4 qkv GEMM carrying
# the norm could end in them (engine/model.py, kernels/w4a16_mma.py)
FUSED_ROTARY: bool = os.environ.get("PDSERVE_FUSED_ROTARY", "1").strip() != "0"
# PDSERVE_WGMMA=0 keeps 33-256 rows of 16-bit x against fragment-laid int4 weights on Hopper off the wgmma kernel
# (kernels/w4a16_wgmma.py), on the mma.sync kernel (up to 64 rows) or dequantizing for cuBLAS: the A-B of
# `python3 -m bench.quant_int4 --chunked` and `--batched`
WGMMA: bool = os.environ.get("PDSERVE_WGMMA", "1").strip() != "0"


def _read_steps(name: str) -> int:
    value = os.environ.get(name, "0").strip() or "0"
    if not value.isdigit() or int(value) > 8:
        raise ValueError(f"{name} must be a whole number of steps from 0 to 8, got {value!r}")
    return int(value)


# PDSERVE_W4A16_PREFETCH=N has the int4 tensor-core kernel (kernels/w4a16_mma.py) ask L2 for its words N steps past
# the step it loads into registers (0, the default: none): the A-B of `python3 -m bench.quant_int4 --sweep-prefetch`
W4A16_PREFETCH: int = _read_steps("PDSERVE_W4A16_PREFETCH")


def use_triton(tensor: torch.Tensor) -> bool:
    if FORCED_BACKEND is not None:
        return FORCED_BACKEND == "triton"
    return tensor.is_cuda


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: any small count exercises the same code paths
    return torch.cuda.get_device_properties(device).multi_processor_count


# Triton compiles a kernel once per "variant": its constexprs, its pointers' 16-byte alignment and each int
# argument's class (divisible by 16 or not). An int that depends on a step's batch (a block table's width, a
# split count in a workspace stride) would make a variant of each class, the second compiled in the middle of
# serving, a second or more of stall; such arguments are listed in the kernel's do_not_specialize.
def compiled_variants() -> dict[str, set[str]] | None:
    """The variants Triton has compiled in this process for each of the project's kernels (None where Triton
    keeps no such cache: the interpreter)."""
    import importlib
    import pkgutil

    import kernels

    out: dict[str, set[str]] = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        for obj in vars(importlib.import_module(f"kernels.{info.name}")).values():
            fn = obj
            # an autotuner or heuristics wraps its JITFunction as .fn; a JITFunction's own .fn is plain Python
            while not hasattr(fn, "device_caches") and hasattr(fn, "fn"):
                fn = fn.fn
            caches = getattr(fn, "device_caches", None)
            if not isinstance(caches, dict):
                continue
            keys = out.setdefault(getattr(fn, "__name__", repr(fn)), set())
            for cache in caches.values():
                if isinstance(cache, tuple) and isinstance(cache[0], dict):
                    keys.update(str(key) for key in cache[0])
    return out or None


def compiled_since(before: dict[str, set[str]] | None) -> dict[str, list[str]] | None:
    """The variants compiled since `before` (compiled_variants()), by kernel."""
    after = compiled_variants()
    if before is None or after is None:
        return None
    new = {name: sorted(keys - before.get(name, set())) for name, keys in after.items()}
    return {name: keys for name, keys in new.items() if keys}
