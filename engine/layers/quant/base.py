"""The linear-method contract and the one weight loader every quantized parameter uses.

A method owns a layer's weight: `create_weights` registers the checkpoint's tensors (this rank's part,
in the checkpoint's format), `process_weights` re-lays them for the kernel once all are loaded, `apply`
computes x W^T (+ bias). Each checkpoint tensor says how its dims map onto the layer's features (`Axis`),
so the loader cuts the rank's slice and places a merged layer's part (q/k/v, gate/up) as the dense
layers do (engine/layers/linear.py): column-parallel layers split the output features, row-parallel ones
the input features.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    set_weight_loader,
)
from kernels.silu_and_mul import silu_and_mul


@dataclass(frozen=True)
class Axis:
    """Dim `dim` of a checkpoint tensor holds `elements` entries per `features` features (a packed int32
    holds 8 outputs: features=8; a group's scale covers G inputs: features=G; a GGUF block 32 inputs in B
    bytes: features=32, elements=B)."""

    dim: int
    features: int = 1
    elements: int = 1

    def size(self, features: int) -> int:
        if features % self.features:
            raise ValueError(f"{features} features do not fall in whole blocks of {self.features}")
        return features // self.features * self.elements


class LinearMethod(ABC):
    _dense: torch.Tensor | None = None

    def cpu_dense(self, make: Callable[[torch.dtype], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The CPU path's dense (N, K) weight: dequantized on first use and kept, so a CPU engine costs the
        dense model's time (and memory) per step; GPUs keep only the quantized tensors."""
        if self._dense is None or self._dense.dtype != dtype:
            self._dense = make(dtype)
        return self._dense

    @abstractmethod
    def create_weights(self, layer: LinearBase) -> None: ...

    @abstractmethod
    def process_weights(self, layer: LinearBase) -> None: ...

    @abstractmethod
    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def apply_ordered(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`apply` for x whose columns come in input_order(x)'s K order; only where that is not 0."""
        raise ValueError(f"{type(self).__name__} takes x in column order only")

    def input_order(self, x: torch.Tensor) -> int:
        """The fragment chunk in whose K order the GEMM at x's rows reads x ungathered (engine/layers/linear.py:
        LinearBase.input_order); 0: column order."""
        return 0

    def apply_swiglu(
        self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None, ordered: bool = False,
        out_order: int = 0,
    ) -> torch.Tensor:  # fmt: skip
        """silu(gate) * up of `apply` for a (gate | up) layer, in out_order's K order (0: column order); a method
        whose kernel fuses it overrides this."""
        y = self.apply_ordered(layer, x, bias) if ordered else self.apply(layer, x, bias)
        return silu_and_mul(y, out_order)

    def add_param(
        self,
        layer: LinearBase,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        out: Axis | None,
        inp: Axis | None,
    ) -> None:
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        layer.register_parameter(name, param)
        set_weight_loader(param, PartLoader(layer, out, inp))


def tensor(layer: nn.Module, name: str) -> torch.Tensor:
    return layer.get_parameter(name).data


def output_slot(layer: LinearBase, shard_id: object) -> tuple[int, int]:
    """(offset, size) of a checkpoint part in this rank's output features."""
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.num_heads * layer.head_size, layer.num_kv_heads * layer.head_size
        slots: dict[object, tuple[int, int]] = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
    elif isinstance(layer, MergedColumnParallelLinear):
        tp = layer.tp_size
        sizes = layer.output_sizes
        slots = {i: (sum(sizes[:i]) // tp, s // tp) for i, s in enumerate(sizes)}
    else:
        slots = {None: (0, layer.output_size)}
    if shard_id not in slots:
        raise ValueError(
            f"bad shard id {shard_id!r} for {type(layer).__name__} (expected one of {list(slots)})"
        )
    return slots[shard_id]


class PartLoader:
    """The weight_loader of one quantized parameter: copies a full (unsharded) checkpoint tensor's rank
    slice into it (into its part's rows, when the layer is merged). A tensor without an output axis
    (GPTQ's g_idx) is loaded by every part of a merged layer: they must agree."""

    def __init__(self, layer: LinearBase, out: Axis | None, inp: Axis | None) -> None:
        self.layer, self.out, self.inp = layer, out, inp
        self.loaded_once = False

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        layer, out, inp = self.layer, self.out, self.inp
        offset, size = output_slot(layer, shard_id)
        dst = param.data
        expected = list(dst.shape)
        column, row = layer.tp_dim == 0, layer.tp_dim == 1
        if out is not None:
            expected[out.dim] = out.size(size)
            dst = dst.narrow(out.dim, out.size(offset), expected[out.dim])
        full = list(expected)
        if out is not None and column:
            full[out.dim] *= layer.tp_size
        if inp is not None and row:
            full[inp.dim] *= layer.tp_size
        if tuple(loaded.shape) != tuple(full):
            raise ValueError(
                f"shape mismatch: checkpoint has {tuple(loaded.shape)}, model expects {tuple(full)}"
            )
        src = loaded
        if out is not None and column:
            src = src.narrow(out.dim, layer.tp_rank * expected[out.dim], expected[out.dim])
        if inp is not None and row:
            src = src.narrow(inp.dim, layer.tp_rank * expected[inp.dim], expected[inp.dim])
        if out is None and self.loaded_once and not torch.equal(dst, src.to(dst.device, dst.dtype)):
            raise ValueError("differs between the parts of a merged layer, which share one input order")
        dst.copy_(src)
        self.loaded_once = out is None
