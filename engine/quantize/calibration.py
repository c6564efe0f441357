"""Calibration: the shipped texts as token sequences, and one decoder layer at a time over them.

The layers are the engine's own (engine/model.py), run as one batch of prefill sequences over a scratch
KV cache, so the quantizer sees exactly the activations the engine computes. A layer's input is the
(hidden, residual) pair the model hands from layer to layer (the norms add the residual in place, so
every run works on copies).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.layers.linear import LinearBase
from engine.layers.moe import SparseMoeBlock
from engine.model import LlamaDecoderLayer, LlamaForCausalLM

DATA = Path(__file__).resolve().parent / "data"
CALIBRATION_TEXT = DATA / "calibration.txt"
HELDOUT_TEXT = DATA / "heldout.txt"
BLOCK = 16

State = tuple[torch.Tensor, torch.Tensor | None]  # (hidden, residual)


def token_sequences(ids: list[int], seq_len: int) -> list[list[int]]:
    """Consecutive pieces of seq_len tokens (the last one shorter)."""
    return [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]


def linears(layer: LlamaDecoderLayer) -> dict[str, LinearBase]:
    """The layer's linears, in the order they run: the attention's and a dense MLP's (a MoE layer's experts are
    engine/quantize/experts.py's)."""
    attn, mlp = layer.self_attn, layer.mlp
    if isinstance(mlp, SparseMoeBlock):
        return {"qkv": attn.qkv_proj, "o": attn.o_proj}
    return {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}


def calibrated(layer: LlamaDecoderLayer) -> dict[str, nn.Module]:
    """The modules whose inputs calibration reads: the linears, and a MoE block ("moe"), whose input the router
    and every expert read."""
    moe = {"moe": layer.mlp} if isinstance(layer.mlp, SparseMoeBlock) else {}
    return {**linears(layer), **moe}


class LayerRunner:
    """The calibration batch's positions, attention metadata and a one-layer KV cache."""

    def __init__(self, model: LlamaForCausalLM, sequences: list[list[int]]) -> None:
        device = next(model.parameters()).device
        lens = [len(s) for s in sequences]
        tables, used = [], 0
        for n in lens:
            blocks = -(-n // BLOCK)
            tables.append(list(range(used, used + blocks)))
            used += blocks
        cfg = model.config
        self.model = model
        self.meta = AttentionMetadata.build(lens, lens, tables, BLOCK, device)
        self.ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
        self.positions = torch.tensor([p for n in lens for p in range(n)], dtype=torch.long, device=device)
        dtype = model.model.embed_tokens.weight.dtype
        self.cos_sin = model.model.rotary_emb.cos_sin_cache(dtype, device)
        self.kv = torch.zeros(
            2, used, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=device
        )

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]

    @torch.no_grad()
    def embed(self) -> State:
        return self.model.model.embed_tokens(self.ids), None

    @torch.no_grad()
    def run(self, layer: LlamaDecoderLayer, state: State) -> State:
        hidden, residual = state
        return layer(
            hidden.clone(), None if residual is None else residual.clone(), self.positions, self.cos_sin,
            self.kv, self.meta,
        )  # fmt: skip

    @torch.no_grad()
    def inputs(self, layer: LlamaDecoderLayer, state: State) -> dict[str, torch.Tensor]:
        """What each of `calibrated(layer)` receives: {"qkv" | "o" | "gate_up" | "down" | "moe": (T, in_features)}."""
        seen: dict[str, torch.Tensor] = {}
        hooks = [
            module.register_forward_pre_hook(
                lambda _m, args, name=name: seen.__setitem__(name, args[0].clone())
            )
            for name, module in calibrated(layer).items()
        ]
        try:
            self.run(layer, state)
        finally:
            for hook in hooks:
                hook.remove()
        return seen


@torch.no_grad()
def perplexity(
    model: LlamaForCausalLM, ids: list[int], seq_len: int = 512, kv_dtype: torch.dtype | None = None
) -> float:
    """exp(mean next-token cross entropy) over consecutive pieces of seq_len tokens, each scored alone.
    `kv_dtype`: the scratch KV cache's (default the model's; fp8 uses the scales set on the model's layers)."""
    total, count = 0.0, 0
    for piece in token_sequences(ids, min(seq_len, model.config.max_position_embeddings)):
        if len(piece) < 2:
            continue
        runner = LayerRunner(model, [piece])
        kv = runner.kv.unsqueeze(0).expand(model.config.num_hidden_layers, *runner.kv.shape)
        kv = kv.to(kv_dtype or kv.dtype).contiguous()
        hidden = model(runner.ids, runner.positions, runner.meta, kv)
        logits = model.compute_logits(hidden[:-1])  # (n - 1, vocab) fp32
        target = runner.ids[1:]
        total += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        count += target.numel()
    return float(torch.exp(torch.tensor(total / count)))
