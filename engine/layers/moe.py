"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's top-k experts,
whose SwiGLU MLPs run in kernels/fused_moe.py and are summed, weighted by the router. Qwen2-MoE adds a shared
expert every token takes (a dense MLP), scaled by sigmoid(x . shared_expert_gate).

The router (`gate`, (E, H)) is whole on every rank, so every rank picks the same experts. Tensor parallelism
splits each expert's intermediate features as the dense MLP's are split (gate and up by rows, down by
columns), and the ranks' partial sums are all-reduced.

Checkpoint names, per architecture:
    Mixtral:    layers.N.block_sparse_moe.gate.weight, layers.N.block_sparse_moe.experts.E.{w1,w3,w2}.weight
    Qwen-MoE:   layers.N.mlp.gate.weight,              layers.N.mlp.experts.E.{gate,up,down}_proj.weight
                (Qwen2-MoE also layers.N.mlp.shared_expert.{gate,up,down}_proj.weight, layers.N.mlp.shared_expert_gate.weight)
(w1 = gate, w3 = up, w2 = down). Ours: layers.N.mlp.gate.weight, layers.N.mlp.experts.w13 (every expert's gate
rows, then its up rows) and layers.N.mlp.experts.w2.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from engine.layers.linear import ReplicatedLinear, copy_checked, divide, set_weight_loader
from engine.model_config import ModelConfig
from kernels.fused_moe import fused_moe


@dataclass(frozen=True)
class ExpertNames:
    """How an architecture's checkpoints name a MoE layer's tensors."""

    block: str  # the module under layers.N
    parts: dict[str, str]  # checkpoint name of gate / up / down -> ours


_NAMES = {
    "MixtralForCausalLM": ExpertNames("block_sparse_moe", {"w1": "gate", "w3": "up", "w2": "down"}),
    "Qwen2MoeForCausalLM": ExpertNames("mlp", {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}),
    "Qwen3MoeForCausalLM": ExpertNames("mlp", {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}),
}


class FusedMoE(nn.Module):
    """Every expert's weights of one layer, this rank's slice: w13 (E, 2 * I / tp, H), w2 (E, H, I / tp)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.inter = divide(inter, tp_size, "moe_intermediate_size")
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.inter), requires_grad=False)
        set_weight_loader(self.w13, self.weight_loader)
        set_weight_loader(self.w2, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """shard_id (expert, "gate" | "up" | "down"): one expert's whole checkpoint tensor, of which this rank
        takes its intermediate features."""
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and 0 <= shard_id[0] < param.shape[0]):
            raise ValueError(f"bad shard id {shard_id!r} for {param.shape[0]} experts")
        expert, part = shard_id
        dim = 1 if part == "down" else 0  # down reads the intermediate features, gate and up write them
        if loaded.dim() != 2 or loaded.shape[dim] != self.inter * self.tp_size:
            raise ValueError(
                f"shape mismatch: checkpoint has {tuple(loaded.shape)}, an expert's {part} has "
                f"{self.inter * self.tp_size} intermediate features along dim {dim}"
            )
        piece = loaded.narrow(dim, self.tp_rank * self.inter, self.inter)
        if part == "down":
            copy_checked(self.w2.data[expert], piece)
        else:
            offset = 0 if part == "gate" else self.inter
            copy_checked(self.w13.data[expert].narrow(0, offset, self.inter), piece)


class SparseMoeBlock(nn.Module):
    def __init__(
        self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1, shared_expert: nn.Module | None = None
    ) -> None:
        """shared_expert: the dense MLP of config.shared_expert_intermediate_size features (Qwen2-MoE), made by
        the model (engine/model.py: LlamaMLP)."""
        super().__init__()
        self.architecture, self.top_k = config.architecture, config.num_experts_per_tok
        self.num_experts, self.tp_size = config.num_experts, tp_size
        self.renormalize = config.norm_topk_prob
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)
        self.experts = FusedMoE(
            config.num_experts, config.hidden_size, config.moe_intermediate_size, tp_rank, tp_size
        )
        self.shared_expert = shared_expert
        self.shared_expert_gate = (
            ReplicatedLinear(config.hidden_size, 1) if shared_expert is not None else None
        )

    def input_order(self, x: torch.Tensor) -> int:
        return 0  # x in column order: the router and the experts are dense

    def forward(self, x: torch.Tensor, ordered: bool = False) -> torch.Tensor:  # (num_tokens, hidden)
        """The router's softmax in fp32 over every expert, the top k of it (renormalised to sum to 1 where the
        config says so; the Qwen MoEs round them to the model's dtype), then the chosen experts' weighted sum, plus
        the gated shared expert's output where there is one."""
        assert not ordered, "a MoE layer takes x in column order"
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # (num_tokens, num_experts)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.architecture != "MixtralForCausalLM":
            weights = weights.to(x.dtype).float()
        out = fused_moe(x, self.experts.w13, self.experts.w2, weights, ids)
        if self.tp_size > 1:
            dist.all_reduce(out)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def checkpoint_names(self, layer: str) -> set[str]:
        """The checkpoint tensors of this block in layer `layer` (e.g. "model.layers.3")."""
        names = _NAMES[self.architecture]
        block = f"{layer}.{names.block}"
        experts = {
            f"{block}.experts.{e}.{part}.weight" for e in range(self.num_experts) for part in names.parts
        }
        return experts | {f"{block}.gate.weight"}


def to_moe_param(architecture: str, hf_name: str) -> tuple[str, tuple[int, str] | None] | None:
    """(our parameter, shard id) of a MoE layer's checkpoint tensor, or None for any other tensor."""
    names = _NAMES.get(architecture)
    if names is None:
        return None
    parts = "|".join(names.parts)
    m = re.fullmatch(
        rf"(.*\.layers\.\d+)\.{names.block}\.(?:gate|experts\.(\d+)\.({parts}))\.weight", hf_name
    )
    if m is None:
        return None
    layer, expert, part = m.groups()
    if expert is None:
        return f"{layer}.mlp.gate.weight", None
    ours = names.parts[part]
    return f"{layer}.mlp.experts.{'w2' if ours == 'down' else 'w13'}", (int(expert), ours)


def expert_tensors(
    architecture: str, param_name: str, tensor: torch.Tensor
) -> list[tuple[str, torch.Tensor]] | None:
    """An unsharded MoE parameter of ours as the checkpoint tensors it is made of (a dummy checkpoint), or None
    for any other parameter."""
    names = _NAMES.get(architecture)
    m = re.fullmatch(r"(.*\.layers\.\d+)\.mlp\.(gate\.weight|experts\.w13|experts\.w2)", param_name)
    if names is None or m is None:
        return None
    layer, what = m.groups()
    block = f"{layer}.{names.block}"
    if what == "gate.weight":
        return [(f"{block}.gate.weight", tensor)]
    hf = {ours: theirs for theirs, ours in names.parts.items()}
    if what == "experts.w2":
        return [(f"{block}.experts.{e}.{hf['down']}.weight", w) for e, w in enumerate(tensor)]
    return [
        (f"{block}.experts.{e}.{hf[part]}.weight", piece)
        for e, w in enumerate(tensor)
        for part, piece in zip(("gate", "up"), w.chunk(2))
    ]


def gguf_expert_tensors(
    architecture: str, name: str, tensor: torch.Tensor
) -> list[tuple[str, torch.Tensor]] | None:
    """A llama.cpp MoE tensor, as engine/weights.py names it (model.layers.N.mlp.gate.weight for ffn_gate_inp,
    model.layers.N.mlp.experts.{gate,up,down}_exps.weight for the (E, ., .) expert stacks), as this architecture's
    checkpoint tensors; None for any other tensor."""
    names = _NAMES.get(architecture)
    m = re.fullmatch(r"(.*\.layers\.\d+)\.mlp\.(?:gate|experts\.(gate|up|down)_exps)\.weight", name)
    if names is None or m is None:
        return None
    layer, part = m.groups()
    block = f"{layer}.{names.block}"
    if part is None:
        return [(f"{block}.gate.weight", tensor)]
    theirs = {ours: hf for hf, ours in names.parts.items()}[part]
    return [(f"{block}.experts.{e}.{theirs}.weight", w) for e, w in enumerate(tensor)]
