"""A mixture-of-experts layer's MLP on the grid (engine/layers/moe.py: SparseMoeBlock): each routed expert on the
calibration tokens its router sends it, the shared expert (Qwen2-MoE, a dense MLP) on every token. The routers
(gate, shared_expert_gate) stay dense, as the AWQ and GPTQ formats keep them.

    x = the block's input (post_attention_layernorm's output)
    an expert's tokens: the rows of x whose top k of softmax(router(x)) hold it (SparseMoeBlock.forward's pick)
    rtn:  each expert's gate, up and down rounded to the grid
    gptq: gate and up from the Hessian of the expert's tokens, then down from the Hessian of its down inputs
          silu(gate x) * up x with gate and up already quantized (an expert routed fewer tokens than the
          linear's input features: every token of x instead); with act order gate and up, quantized as one
          linear, share one column order
    awq:  (AutoAWQ's Mixtral and Qwen-MoE recipe) one input scale for every expert's gate and up, searched on x
          and folded into the norm, the routers' weights multiplied by it so their logits are unchanged; per
          expert an up -> down scale searched on its down inputs; clipping per expert; then round to the grid

Every expert's weights hold their dequantized values afterwards, so the next layer's inputs come from them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.layers.moe import SparseMoeBlock
from engine.layers.norm import RMSNorm
from engine.model import LlamaMLP
from engine.quantize.awq import search_clip, search_scales, search_shared_scales
from engine.quantize.gptq import gptq, hessian
from engine.quantize.grid import Grid, QuantizedWeight, round_to_nearest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Expert:
    """One SwiGLU expert: views of the model's weights (written in place) and the tokens it reads."""

    name: str  # under the decoder layer: "mlp.experts.3", or "mlp.shared_expert"
    w13: torch.Tensor  # (2 * I, H): gate's rows, then up's
    w2: torch.Tensor  # (H, I)
    x: torch.Tensor  # (T_e, H): the calibration tokens routed to it

    @property
    def shared(self) -> bool:
        return self.name.endswith("shared_expert")

    def down_inputs(self, x: torch.Tensor) -> torch.Tensor:  # (T_e, H) -> (T_e, I)
        gate, up = (x @ self.w13.t()).chunk(2, dim=1)
        return F.silu(gate) * up

    def results(self, w13: QuantizedWeight, w2: QuantizedWeight) -> dict[str, QuantizedWeight]:
        """Under the names engine/quantize/export.py writes: the shared expert's as its linears, a routed
        expert's as gate, up and down."""
        if self.shared:
            return {f"{self.name}.gate_up_proj": w13, f"{self.name}.down_proj": w2}
        inter = self.w2.shape[1]
        return {f"{self.name}.gate": w13.rows(0, inter), f"{self.name}.up": w13.rows(inter, inter),
                f"{self.name}.down": w2}  # fmt: skip


def routed(block: SparseMoeBlock, x: torch.Tensor) -> list[torch.Tensor]:
    """Each expert's tokens: the indices of the rows of x (T, H) whose top k of the router's softmax hold it."""
    probs = torch.softmax(block.gate(x).float(), dim=-1)  # (T, E)
    ids = torch.topk(probs, block.top_k, dim=-1).indices  # (T, k)
    return [torch.nonzero((ids == e).any(-1)).squeeze(1) for e in range(block.num_experts)]


def experts_of(block: SparseMoeBlock, x: torch.Tensor | None) -> list[Expert]:
    """The block's experts with their tokens of x (T, H) (None: none, for rounding); the shared expert, which
    reads every token, last."""
    fused = block.experts
    assert fused.quant is None and fused.num_experts == block.num_experts, "whole, dense experts"
    tokens = x if x is not None else fused.w13.new_empty(0, fused.hidden)
    out = [
        Expert(f"mlp.experts.{e}", fused.w13.data[e], fused.w2.data[e], tokens[rows])
        for e, rows in enumerate(routed(block, tokens))
    ]
    mlp = block.shared_expert
    if mlp is not None:
        assert isinstance(mlp, LlamaMLP)
        out.append(
            Expert("mlp.shared_expert", mlp.gate_up_proj.weight.data, mlp.down_proj.weight.data, tokens)
        )
    return out


@torch.no_grad()
def quantize_moe(
    method: str,
    block: SparseMoeBlock,
    norm: RMSNorm,
    x: torch.Tensor | None,
    grid: Grid,
    desc_act: bool = False,
) -> dict[str, QuantizedWeight]:
    """Quantize the block's experts in place. x (T, H): the block's calibration input (None for rtn, which reads
    none); norm: the norm making it, where AWQ folds its scale; desc_act: GPTQ's act order. Keys are relative to
    the decoder layer."""
    experts = experts_of(block, x)
    if method == "awq":
        assert x is not None, "AWQ searches its scales on the block's input"
        experts = fold_scales(block, norm, experts, x, grid)
        clip(experts, grid)
    out: dict[str, QuantizedWeight] = {}
    for expert in experts:
        if method == "gptq":
            assert x is not None, "GPTQ takes its Hessians from the block's input"
            out.update(expert.results(*gptq_expert(expert, x, grid, desc_act)))
            continue
        w13, w2 = round_to_nearest(expert.w13, grid), round_to_nearest(expert.w2, grid)
        expert.w13.copy_(w13.dequantize())
        expert.w2.copy_(w2.dequantize())
        out.update(expert.results(w13, w2))
    return out


def gptq_expert(
    expert: Expert, x: torch.Tensor, grid: Grid, desc_act: bool = False
) -> tuple[QuantizedWeight, QuantizedWeight]:
    """Gate and up from the Hessian of the expert's tokens, then down from that of its down inputs computed
    with the quantized gate and up. A linear whose expert got fewer tokens than its input features (or none)
    takes the Hessian of every token of the block x (T, H) instead, as llm-compressor's calibrate_all_experts
    does for all experts: fewer tokens leave the Hessian singular but for its damping, and the error feedback
    would move error into directions no token measured."""
    tokens = calibration_tokens(expert.x, x, expert.w13.shape[1])
    w13 = gptq(expert.w13, hessian(tokens), grid, desc_act)
    expert.w13.copy_(w13.dequantize())
    tokens = calibration_tokens(expert.x, x, expert.w2.shape[1])
    w2 = gptq(expert.w2, hessian(expert.down_inputs(tokens)), grid, desc_act)
    expert.w2.copy_(w2.dequantize())
    return w13, w2


def calibration_tokens(routed: torch.Tensor, every: torch.Tensor, features: int) -> torch.Tensor:
    if routed.shape[0] < features:
        logger.debug("%d routed tokens for %d input features: calibrating on all %d", routed.shape[0],
                     features, every.shape[0])  # fmt: skip
        return every
    return routed


@torch.no_grad()
def fold_scales(
    block: SparseMoeBlock, norm: RMSNorm, experts: list[Expert], x: torch.Tensor, grid: Grid
) -> list[Expert]:
    """AWQ's scales, folded so the float block computes the same: 1 / s into the norm and s into every expert's
    gate and up and into the routers (whose logits stay as they were); per expert, 1 / s_e into up's rows and s_e
    into down. Returns the experts with their scaled tokens (x / s)."""
    s = search_shared_scales(x, [(e.x, e.w13) for e in experts], grid)  # (H,)
    norm.weight.data.div_(s)
    for router in (block.gate, block.shared_expert_gate):
        if router is not None:
            router.weight.data.mul_(s)
    scaled = []
    for e in experts:
        e.w13.mul_(s)
        scaled.append(Expert(e.name, e.w13, e.w2, e.x / s))
        if e.x.shape[0] == 0:
            continue  # no tokens to search on: rounded to nearest as it is
        inputs = scaled[-1].down_inputs(scaled[-1].x)
        s_down = search_scales(inputs, e.w2, grid)  # (I,)
        e.w13[e.w2.shape[1] :].div_(s_down[:, None])  # up's rows: silu(gate) * up / s_down
        e.w2.mul_(s_down)
    return scaled


@torch.no_grad()
def clip(experts: list[Expert], grid: Grid) -> None:
    """AWQ's clipping of each expert's gate and up (on its tokens) and down (on its down inputs)."""
    for e in experts:
        if e.x.shape[0] == 0:
            continue
        inputs = e.down_inputs(e.x)
        e.w13.copy_(search_clip(e.x, e.w13, grid))
        e.w2.copy_(search_clip(inputs, e.w2, grid))
