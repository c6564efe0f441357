"""Quantized models: which linear method each layer gets (a plan), building the model with them, the GGUF
tensors kept quantized, dummy int4 weights, and re-laying every method's tensors once loaded.

    plan = quant_plan(path, quantization, load_format)    # None: dense
    net = build_model(config, dtype, device, plan=plan)    # engine/weights.py: layers get their methods
    net.load_weights(checkpoint tensors)                   # each parameter's weight_loader
    process_weights(net)                                   # AWQ / GPTQ / GGUF -> the kernels' layout
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from engine.layers.linear import LinearBase
from engine.layers.moe import FusedMoE, gguf_expert_tensors
from engine.layers.quant import (
    AWQLinearMethod,
    GGUFInt4Method,
    GGUFInt8Method,
    GPTQLinearMethod,
    LinearMethod,
    QuantConfig,
    resolve_quantization,
)
from engine.layers.quant.gguf import BLOCK_BYTES, EXPERT_BLOCKS, GGUFMethod
from engine.model import STACKED_PARAMS
from engine.model_config import ModelConfig

DUMMY_SCALE = 0.007  # a group of N(0, 0.02) weights spans about 15 of these steps
EXPERT_STACKS = {"w13": ("gate", "up"), "w2": ("down",)}  # a MoE layer's stacks and the GGUF parts in each


class QuantPlan(Protocol):
    quantized_lm_head: bool  # the LM head is a linear layer the plan gives a method (else dense)

    def method_for(self, prefix: str, layer: LinearBase) -> LinearMethod | None: ...

    def quantize_experts(self, prefix: str, layer: FusedMoE) -> None:
        """Give a MoE layer's expert stacks the checkpoint's quantized tensors (else they load dense)."""


def checkpoint_parts(prefix: str) -> list[str]:
    """The checkpoint modules a layer of ours loads: q/k/v_proj for qkv_proj, gate/up_proj for gate_up_proj."""
    parts = [prefix.replace(ours.strip("."), hf.strip(".")) for hf, (ours, _) in STACKED_PARAMS.items()
             if ours in prefix + "."]  # fmt: skip
    return list(dict.fromkeys(parts)) or [prefix]


class CheckpointPlan:
    """AWQ or GPTQ: every linear layer of the decoder, except `modules_to_not_convert`; the LM head too
    where a GPTQ config says lm_head=true."""

    def __init__(self, config: QuantConfig) -> None:
        self.config = config
        self.quantized_lm_head = config.lm_head

    def method_for(self, prefix: str, layer: LinearBase) -> LinearMethod | None:
        if prefix.endswith((".mlp.gate", ".shared_expert_gate")):  # MoE routers stay dense in these formats
            return None
        parts = checkpoint_parts(prefix)
        skipped = [any(s in p for s in self.config.modules_to_not_convert) for p in parts]
        if all(skipped):
            return None
        if any(skipped):
            raise ValueError(f"modules_to_not_convert leaves only some of {', '.join(parts)} dense")
        return AWQLinearMethod(self.config) if self.config.method == "awq" else GPTQLinearMethod(self.config)

    def quantize_experts(self, prefix: str, layer: FusedMoE) -> None:
        layer.quantize(self.config)  # AWQ / GPTQ experts are int4 too


class GGUFPlan:
    """A layer whose checkpoint tensors are all Q4_0, all Q4_1 or all Q8_0 stays quantized; any other type
    is dequantized at load (engine/weights.py: iter_gguf) into a dense layer. A MoE's stack of experts (gate and up
    together, down apart) stays quantized in those types and in Q4_K and Q6_K (engine/layers/moe.py)."""

    quantized_lm_head = False  # an untied output tensor is dequantized, whatever its type

    def __init__(self, reader: Any) -> None:
        from engine.weights import gguf_to_hf_name

        self.types = {gguf_to_hf_name(t.name): t.tensor_type.name for t in reader.tensors}

    def qtype(self, prefix: str) -> str | None:
        kinds = {self.types.get(f"{part}.weight") for part in checkpoint_parts(prefix)}
        kind = kinds.pop() if len(kinds) == 1 else None
        return kind if kind in BLOCK_BYTES else None

    def method_for(self, prefix: str, layer: LinearBase) -> LinearMethod | None:
        kind = self.qtype(prefix)
        if kind is None or prefix.endswith(".mlp.gate"):  # a MoE router: dequantized (llama.cpp keeps it F32)
            return None
        return GGUFInt8Method(kind) if kind == "Q8_0" else GGUFInt4Method(kind)

    def quantize_experts(self, prefix: str, layer: FusedMoE) -> None:
        kinds = {
            stack: {self.types.get(f"{prefix}.{part}_exps.weight") for part in parts}
            for stack, parts in EXPERT_STACKS.items()
        }
        kept = {
            stack: str(types.pop())
            for stack, types in kinds.items()
            if len(types) == 1 and types <= EXPERT_BLOCKS.keys()
        }
        if kept:
            layer.quantize_gguf(kept)


def quant_plan(
    path: Path, quantization: str | None, load_format: str, reader: Any = None
) -> QuantPlan | None:
    """The plan for a checkpoint (None: dense); `reader`: the GGUF file's, when the caller has opened it."""
    resolved = resolve_quantization(path, quantization, load_format)
    if resolved is None:
        return None
    if resolved == "gguf":
        from engine.weights import gguf_file, open_gguf

        return GGUFPlan(reader if reader is not None else open_gguf(gguf_file(path)))
    assert isinstance(resolved, QuantConfig)
    return CheckpointPlan(resolved)


def attach_methods(net: nn.Module, plan: QuantPlan) -> None:
    """Give every linear layer (built without a dense weight) its method's parameters, or a dense weight; a MoE
    layer's experts their checkpoint's int4 tensors where the plan's experts are not dense."""
    for prefix, layer in net.named_modules():
        if isinstance(layer, FusedMoE):
            try:
                plan.quantize_experts(prefix, layer)
            except ValueError as e:
                raise ValueError(f"{prefix}: {e}") from e
        if not isinstance(layer, LinearBase):
            continue
        method = plan.method_for(prefix, layer)
        if method is None:
            layer.create_weight()
            continue
        try:
            method.create_weights(layer)
        except ValueError as e:
            raise ValueError(f"{prefix}: {e}") from e
        layer.quant_method = method


def gguf_kept(net: nn.Module) -> set[str]:
    """The GGUF tensors that load quantized: those of the layers that got a GGUF method, and the expert stacks
    kept quantized."""
    linears = {
        f"{part}.weight"
        for prefix, layer in net.named_modules()
        if isinstance(layer, LinearBase) and isinstance(layer.quant_method, GGUFMethod)
        for part in checkpoint_parts(prefix)
    }
    experts = {
        f"{prefix}.{part}_exps.weight"
        for prefix, layer in net.named_modules()
        if isinstance(layer, FusedMoE)
        for stack in layer.gguf
        for part in EXPERT_STACKS[stack]
    }
    return linears | experts


def process_weights(net: nn.Module) -> None:
    for prefix, layer in net.named_modules():
        try:
            if isinstance(layer, LinearBase) and isinstance(layer.quant_method, LinearMethod):
                layer.quant_method.process_weights(layer)
            elif isinstance(layer, FusedMoE):
                layer.process_weights()
        except ValueError as e:
            raise ValueError(f"{prefix}: {e}") from e


@torch.no_grad()
def init_dummy_quantized(net: nn.Module, seed: int = 0) -> None:
    """Random AWQ / GPTQ tensors for speed work: random nibbles, scales of DUMMY_SCALE, g_idx k // G."""
    layers: list[nn.Module] = [
        m for m in net.modules() if isinstance(m, LinearBase) and m.quant_method is not None
    ]
    layers += [m for m in net.modules() if isinstance(m, FusedMoE) and m.quant is not None]
    device = next(net.parameters()).device
    if not layers or device.type == "meta":
        return
    gen = torch.Generator(device=device).manual_seed(seed)
    for layer in layers:
        for name, param in layer.named_parameters(recurse=False):
            kind = name.split("_", 1)[1] if isinstance(layer, FusedMoE) else name  # w13_qweight: qweight
            if kind in ("qweight", "qzeros"):
                param.random_(-(2**31), 2**31 - 1, generator=gen)
            elif kind == "scales":
                param.fill_(DUMMY_SCALE)
            elif kind == "g_idx":  # each row k // G
                k, groups = param.shape[-1], layer.get_parameter(name.replace("g_idx", "scales")).shape[-2]
                param.copy_(torch.arange(k, device=device) // (k // groups))


def iter_gguf_quantized(
    reader: Any, config: ModelConfig, kept: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The GGUF's tensors under Hugging Face names: those in `kept` as raw blocks (name.qweight, uint8
    (N, bytes)), the rest dequantized as engine/weights.py's iter_gguf gives them. q/k rows are
    un-permuted either way (a row is one output feature's blocks)."""
    from engine.weights import gguf_field, gguf_to_hf_name, iter_gguf, unpermute_rotary

    dense = iter_gguf(reader, config, skip=kept)
    permuted = gguf_field(reader, "general.architecture") == "llama"
    for tensor in reader.tensors:
        name = gguf_to_hf_name(tensor.name)
        if name not in kept:
            continue
        if "_exps." in name:  # (E, N, K/32 * bytes): each expert's rows as a tensor of its own
            stack = np.asarray(tensor.data).reshape(int(tensor.shape[-1]), int(tensor.shape[-2]), -1)
            raw = torch.from_numpy(np.array(stack, dtype=np.uint8))
            experts = gguf_expert_tensors(config.architecture, name, raw, "qweight")
            assert experts is not None, name
            yield from experts
            continue
        rows = np.asarray(tensor.data).reshape(int(tensor.shape[-1]), -1)  # (N, K/32 * bytes)
        if permuted and ".q_proj." in name:
            rows = unpermute_rotary(rows, config.num_attention_heads)
        elif permuted and ".k_proj." in name:
            rows = unpermute_rotary(rows, config.num_key_value_heads)
        yield name.removesuffix(".weight") + ".qweight", torch.from_numpy(np.array(rows, dtype=np.uint8))
    yield from dense


def quantized_source(model: str | None, quantization: str | None, load_format: str) -> str | None:
    """The GGUF file whose tensors stay quantized: `model` when it is a .gguf file (and quantization is
    unset or gguf), the bundled model's file with quantization="gguf" and no model; else None."""
    if load_format not in ("auto", "gguf") or quantization not in (None, "gguf"):
        return None
    if model is None:
        if quantization != "gguf":
            return None
        from engine.bundled import bundled_gguf_path

        return str(bundled_gguf_path())
    return model if Path(model).is_file() else None
