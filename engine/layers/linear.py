"""Linear layers that own their weight loading (nano-vllm style).

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)`, which copies a full
(unsharded) checkpoint tensor into this rank's slice. With tp_size 1 nothing is sliced, so tensor
parallelism is a config change: column-parallel layers split their output rows, row-parallel layers
split their input columns and all-reduce the partial sums.

    QKVParallelLinear weight, per rank (rows = output features):
    +-----------------------+  0
    | q: num_heads/tp heads |
    +-----------------------+  q_size
    | k: kv_heads/tp heads  |
    +-----------------------+  q_size + kv_size
    | v: kv_heads/tp heads  |
    +-----------------------+  q_size + 2 * kv_size

With tp > kv_heads, k and v are one head each: the KV head this rank's q heads read (engine/tp/heads.py).

A quantized layer (engine/layers/quant/) is built inside `deferred_weights()`, which leaves the dense
weight out; its `quant_method` then registers the checkpoint's tensors and computes the matmul.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from engine.tp.heads import shard_heads
from kernels.gemv import dense_linear, dense_swiglu
from kernels.silu_and_mul import silu_and_mul

WeightLoader = Callable[..., None]
_DEFER_WEIGHTS: ContextVar[bool] = ContextVar("defer_linear_weights", default=False)


class LinearMethod(Protocol):
    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def apply_ordered(
        self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor: ...

    def apply_swiglu(
        self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None, ordered: bool = False,
        out_order: int = 0,
    ) -> torch.Tensor: ...  # fmt: skip

    def input_order(self, x: torch.Tensor) -> int: ...


@contextmanager
def deferred_weights() -> Iterator[None]:
    """Linear layers built in this context make no dense weight (a quantization method gives theirs)."""
    token = _DEFER_WEIGHTS.set(True)
    try:
        yield
    finally:
        _DEFER_WEIGHTS.reset(token)


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"shape mismatch: checkpoint has {tuple(src.shape)}, model expects {tuple(dst.shape)}"
        )
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    copy_checked(param.data, loaded_weight)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor parallel size {denominator}")
    return numerator // denominator


class LinearBase(nn.Module):
    """y = x W^T (+ b), W of shape (output_size, input_size) for this rank."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, tp_dim: int | None, tp_rank: int, tp_size: int
    ) -> None:
        super().__init__()
        self.tp_dim, self.tp_rank, self.tp_size = tp_dim, tp_rank, tp_size
        self.input_size, self.output_size = input_size, output_size  # this rank's
        self.quant_method: LinearMethod | None = None
        if not _DEFER_WEIGHTS.get():
            self.create_weight()
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)

    def create_weight(self) -> None:
        self.weight = nn.Parameter(torch.empty(self.output_size, self.input_size), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        raise NotImplementedError

    def _shard(self, loaded_weight: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's equal slice of a full tensor along `dim`."""
        size = divide(loaded_weight.shape[dim], self.tp_size, f"checkpoint dim {dim}")
        return loaded_weight.narrow(dim, self.tp_rank * size, size)

    def forward(self, x: torch.Tensor, ordered: bool = False) -> torch.Tensor:
        return self.matmul(x, self.bias, ordered)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, ordered: bool = False) -> torch.Tensor:
        """x W^T (+ b); ordered: x's columns come in the K order input_order(x) named (the kernel that made x wrote
        them so)."""
        if self.quant_method is not None:
            if ordered:
                return self.quant_method.apply_ordered(self, x, bias)
            return self.quant_method.apply(self, x, bias)
        assert not ordered, "a dense layer takes x in column order"
        return dense_linear(x, self.weight, bias)

    def input_order(self, x: torch.Tensor) -> int:
        """The fragment chunk in whose K order (kernels/int4_dequant.py: layout_column) this layer's GEMM at x's
        rows reads x without gathering it, so that the kernel making x (a norm, SiLU-and-mul) can write it so; 0:
        column order (every dense layer, and int4 ones off the wgmma kernel's rows)."""
        return self.quant_method.input_order(x) if self.quant_method is not None else 0

    def fuses_norms(self, x: torch.Tensor) -> bool:
        """Whether this layer's GEMM carries the norm before it or the residual add after it, for x
        (engine/model.py: LlamaDecoderLayer.forward_fused): an unsharded int4 layer whose method says so."""
        fuses = getattr(self.quant_method, "fuses_norms", None)
        return self.tp_size == 1 and fuses is not None and bool(fuses(x))

    def fuses_rope(self, x: torch.Tensor, rope: Any) -> bool:
        """Whether this layer's fused GEMM (fuses_norms) can also end in RoPE and the KV-cache write (a
        kernels/w4a16_mma.RopeWrite)."""
        fuses = getattr(self.quant_method, "fuses_rope", None)
        return self.fuses_norms(x) and fuses is not None and bool(fuses(x, rope))

    def fused(self, x: torch.Tensor, **fused: Any) -> torch.Tensor:
        """x W^T by the GEMM that carries a norm (norm=), the residual add (add_to=, next_norm=) or SwiGLU
        (swiglu=True): kernels/w4a16_mma.py. Only where fuses_norms(x)."""
        method: Any = self.quant_method  # an Int4Method (engine/layers/quant/int4.py)
        return method.apply_fused(self, x, self.bias, **fused)


class ReplicatedLinear(LinearBase):
    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ):
        super().__init__(input_size, output_size, bias, None, tp_rank, tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        copy_checked(param.data, loaded_weight)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks (dim 0 of W and of the bias)."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ):
        super().__init__(input_size, divide(output_size, tp_size, "output size"), bias, 0, tp_rank, tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        copy_checked(param.data, self._shard(loaded_weight, 0))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_up_proj: shard 0 = gate, 1 = up)."""

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"bad shard id {shard_id!r} for a merged linear of {len(self.output_sizes)} parts"
            )
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        copy_checked(param.data.narrow(0, offset, size), self._shard(loaded_weight, 0))

    def forward(
        self, x: torch.Tensor, ordered: bool = False, swiglu: bool = False, out_order: int = 0
    ) -> torch.Tensor:
        """x W^T; with `swiglu` (gate_up_proj: two equal parts) silu(gate) * up of it, (n, output_size / 2),
        in one kernel where the matmul has one that ends in it (one row on the GPU: kernels/gemv.py,
        kernels/w4a16_gemm.py), written in out_order's K order (the next layer's input_order; 0: column order).
        ordered: as in matmul."""
        if not swiglu:
            return self.matmul(x, self.bias, ordered)
        assert len(self.output_sizes) == 2 and self.output_sizes[0] == self.output_sizes[1], self.output_sizes
        if self.quant_method is not None:
            return self.quant_method.apply_swiglu(self, x, self.bias, ordered, out_order)
        assert not ordered, "a dense layer takes x in column order"
        if out_order:
            return silu_and_mul(dense_linear(x, self.weight, self.bias), out_order)
        return dense_swiglu(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; heads split across ranks (shard ids "q", "k", "v")."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        self.head_size, self.total_num_kv_heads = head_size, total_num_kv_heads
        shard = shard_heads(total_num_heads, total_num_kv_heads, tp_size, tp_rank)
        # more ranks than KV heads: each rank holds the one KV head its query heads read (replicated)
        self.num_heads, self.num_kv_heads, self.kv_head_start = (
            shard.num_heads, shard.num_kv_heads, shard.kv_head_start,
        )  # fmt: skip
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp_size
        super().__init__(hidden_size, output_size, bias, tp_rank, tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        slots = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
        if shard_id not in slots:
            raise ValueError(f"bad shard id {shard_id!r} for a qkv linear (expected 'q', 'k' or 'v')")
        offset, size = slots[str(shard_id)]
        if shard_id == "q":
            part = self._shard(loaded_weight, 0)
        else:  # this rank's KV heads, by head index (not an equal split: they may be replicated)
            if loaded_weight.shape[0] != self.total_num_kv_heads * self.head_size:
                raise ValueError(
                    f"shape mismatch: checkpoint has {tuple(loaded_weight.shape)}, model expects "
                    f"{self.total_num_kv_heads * self.head_size} rows"
                )
            part = loaded_weight.narrow(0, self.kv_head_start * self.head_size, kv_size)
        copy_checked(param.data.narrow(0, offset, size), part)


class RowParallelLinear(LinearBase):
    """Input features split across ranks (dim 1 of W); partial outputs are summed with all_reduce.

    The bias is whole on every rank and added once, by rank 0, before the reduction.
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ):
        super().__init__(divide(input_size, tp_size, "input size"), output_size, bias, 1, tp_rank, tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        copy_checked(param.data, self._shard(loaded_weight, 1) if param.dim() == 2 else loaded_weight)

    def forward(self, x: torch.Tensor, ordered: bool = False) -> torch.Tensor:
        y = self.matmul(x, self.bias if self.tp_rank == 0 else None, ordered)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y
