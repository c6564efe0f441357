"""What AWQ, GPTQ and GGUF Q4 layers share once loaded: the kernels' int4 layout (kernels/int4_dequant.py)
and the W4A16 GEMM (kernels/w4a16_gemm.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import LinearBase
from engine.layers.quant.base import LinearMethod
from kernels import _backend, w4a16_mma, w4a16_wgmma
from kernels.int4_dequant import Int4Weight, fragment_chunk, int4_dequant_reference, to_fragments
from kernels.w4a16_gemm import w4a16_gemm, w4a16_swiglu


class Int4Method(LinearMethod):
    """A format's loading (create_weights, process_weights) over one forward pass: w4a16_gemm."""

    weight: Int4Weight | None = None

    def install(self, layer: LinearBase, w: Int4Weight) -> None:
        """Replace the checkpoint-format parameters with the layout's (qweight, scales, zeros, perm). On a GPU,
        groups of a multiple of 64 rows take the MMA's fragment order (kernels/w4a16_mma.py)."""
        for name, _ in list(layer.named_parameters(recurse=False)):
            if name != "bias":
                delattr(layer, name)
        if w.qweight.is_cuda and fragment_chunk(w):
            w = to_fragments(w)
        tensors = {"qweight": w.qweight, "scales": w.scales, "zeros": w.zeros}
        if w.perm is not None:
            tensors["perm"] = w.perm
        for name, tensor in tensors.items():
            # rows: qweight K-contiguous, each output column's words in one run (kernels/w4a16_gemm.py)
            rows = name == "qweight" and w.layout == "rows"
            laid = tensor.t().contiguous().t() if rows else tensor.contiguous()
            layer.register_parameter(name, nn.Parameter(laid, requires_grad=False))
        params = dict(layer.named_parameters(recurse=False))
        perm = params["perm"].data if "perm" in params else None
        self.weight = Int4Weight(
            params["qweight"].data, params["scales"].data, params["zeros"].data, w.group_size, perm, w.layout,
            w.chunk,
        )  # fmt: skip

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = self.weight
        assert w is not None, "process_weights has not run"
        if x.device.type == "cpu" and not _backend.use_triton(x):
            return F.linear(x, self.cpu_dense(lambda dtype: int4_dequant_reference(w, dtype), x.dtype), bias)
        return w4a16_gemm(x, w, bias)

    def apply_ordered(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert self.weight is not None, "process_weights has not run"
        return w4a16_gemm(x, self.weight, bias, ordered=True)

    def input_order(self, x: torch.Tensor) -> int:
        """The wgmma kernel's rows (kernels/w4a16_wgmma.py, where chosen) take x in the fragment layout's K order,
        which it otherwise gathers x into: w.chunk there, but under act order (whose permutation it composes)."""
        w = self.weight
        return w.chunk if w is not None and w.perm is None and w4a16_wgmma.chosen(x, w) else 0

    def apply_swiglu(
        self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None, ordered: bool = False,
        out_order: int = 0,
    ) -> torch.Tensor:  # fmt: skip
        if x.device.type == "cpu" and not _backend.use_triton(x):
            return super().apply_swiglu(layer, x, bias, ordered, out_order)
        assert self.weight is not None, "process_weights has not run"
        return w4a16_swiglu(x, self.weight, bias, ordered, out_order)

    def fuses_norms(self, x: torch.Tensor) -> bool:
        """Whether the GEMM can carry a norm or a residual add at x (kernels/w4a16_mma.py): fragment-laid weights
        without an act-order permutation, x on the mma.sync kernel's rows (up to its MAX_ROWS) but not the
        wgmma kernel's where chosen (kernels/w4a16_wgmma.py, faster there with the norms apart),
        PDSERVE_FUSED_NORMS not 0."""
        w = self.weight
        return (
            _backend.FUSED_NORMS and w is not None and w.perm is None and w4a16_mma.applies(x, w)
            and not w4a16_wgmma.chosen(x, w)
        )  # fmt: skip

    def fuses_rope(self, x: torch.Tensor, rope: w4a16_mma.RopeWrite) -> bool:
        """Whether the fused GEMM can end in RoPE and the KV-cache write: on the GPU kernel's path, 1-8 rows, a
        16-bit cache, half a head in whole column blocks (kernels/w4a16_mma.py rope_applies); the CPU reference
        takes the same rows and any cache but fp8."""
        w = self.weight
        if w is None:
            return False
        if w4a16_mma.applies(x, w):
            return w4a16_mma.rope_applies(x, w, rope)
        rows = x.shape[0] <= w4a16_mma.ROPE_MAX_ROWS
        return rows and rope.kv_cache.dtype in (torch.bfloat16, torch.float16, torch.float32)

    def apply_fused(
        self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None, **fused: Any
    ) -> torch.Tensor:
        """The GEMM with its norm, residual add or SwiGLU (kernels/w4a16_mma.py); its torch reference where the
        kernel does not run (the CPU tests of the model's fused path)."""
        assert self.weight is not None, "process_weights has not run"
        if w4a16_mma.applies(x, self.weight):
            return w4a16_mma.w4a16_mma(x, self.weight, bias, **fused)
        return w4a16_mma.w4a16_mma_reference(x, self.weight, bias, **fused).to(x.dtype)


def sorted_by_group(
    q: torch.Tensor, g_idx: torch.Tensor, group: int, what: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of q (K, N) reordered so each group is `group` consecutive rows, and the permutation (None when
    g_idx already is k // group). ValueError when g_idx does not give every group exactly `group` rows."""
    k = q.shape[0]
    natural = torch.arange(k, device=g_idx.device) // group
    if torch.equal(g_idx.long(), natural):
        return q, None
    perm = torch.sort(g_idx.long(), stable=True).indices
    if not torch.equal(g_idx.long()[perm], natural):
        raise ValueError(f"{what}: g_idx does not give each of the {k // group} groups {group} input rows")
    return q[perm], perm.to(torch.int32)
