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
rows, then its up rows) and layers.N.mlp.experts.w2. With expert parallelism (vLLM's enable_expert_parallel) a
rank holds E / N experts whole instead; a choice of another rank's expert contributes nothing there (the
kernels skip it), and the all-reduce sums every rank's experts.

AWQ and GPTQ checkpoints hold each expert's projections as their linear layers do (qweight, qzeros, scales; GPTQ's
g_idx); `FusedMoE.quantize` registers them stacked over experts (gate and up side by side in their output features)
as w13_qweight ... and w2_qweight ..., and `process_weights` re-lays them into kernels/fused_moe.py's Int4Experts.
Under GPTQ act order (g_idx out of group order) each expert's rows are sorted by group and the kernels read x through
the expert's permutation, as the dense linears do, while down's permutation goes into gate's and up's output features
(kernels/fused_moe.py: down_order_folded), so the activation needs none; gate's and up's act orders must agree (GPTQ computes them from
the one Hessian of their shared input), and down's input features must be whole on each rank (expert parallelism,
or none), since a rank's slice of an act-order down needs groups from every rank (the dense row-parallel layers
refuse act order across ranks too).

GGUF files hold each projection stacked over experts (ffn_{gate,up,down}_exps); a stack of Q4_0, Q4_1, Q4_K, Q8_0 or
Q6_K (gate and up of one type) stays quantized: `FusedMoE.quantize_gguf` takes each expert's rows of blocks, and
`process_weights` makes them Int4Experts (Q4_0, Q4_1, Q4_K) or Int8Experts (Q8_0, Q6_K). Other types load dense.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from engine.layers.linear import ReplicatedLinear, copy_checked, divide, set_weight_loader
from engine.layers.quant.config import QuantConfig
from engine.layers.quant.int4 import sorted_by_group
from engine.layers.quant.packing import AWQ_ORDER, NATURAL_ORDER, pack_rows, unpack_cols
from engine.model_config import ModelConfig
from kernels import _backend
from kernels.fused_moe import Experts, Int4Experts, Int8Experts, down_order_folded, fused_moe
from kernels.gemv import takes_add_norm_gemv
from kernels.int4_dequant import unpack_rows
from kernels.moe_route import Routing

Quantized = Int4Experts | Int8Experts
logger = logging.getLogger(__name__)


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
    """Every expert's weights of one layer, this rank's slice: w13 (E, 2 * I / tp, H), w2 (E, H, I / tp); or, once
    `quantize`d, their AWQ / GPTQ tensors, made Int4Experts by `process_weights`."""

    def __init__(
        self, num_experts: int, hidden: int, inter: int, tp_rank: int = 0, tp_size: int = 1,
        expert_parallel: bool = False,
    ) -> None:  # fmt: skip
        """expert_parallel: this rank holds experts [first, first + E / tp) whole (their intermediate features
        unsplit); else every expert, its intermediate features split over the ranks."""
        super().__init__()
        self.expert_parallel = expert_parallel and tp_size > 1
        # the ranks an expert's intermediate features are split over, and this rank's place among them
        self.tp_rank, self.tp_size = (0, 1) if self.expert_parallel else (tp_rank, tp_size)
        self.total_experts, self.hidden = num_experts, hidden
        self.num_experts = (
            divide(num_experts, tp_size, "num_experts") if self.expert_parallel else num_experts
        )
        self.first = tp_rank * self.num_experts if self.expert_parallel else 0
        self.inter = divide(inter, self.tp_size, "moe_intermediate_size")
        self.quant: QuantConfig | None = None
        self.gguf: dict[str, str] = {}  # stack (w13, w2) -> its GGUF type, for the stacks kept quantized
        self.quantized: dict[str, Quantized] = {}  # stack -> its experts as the kernels take them
        self._dense: dict[str, torch.Tensor] = {}  # quantized stacks dequantized, for the CPU path
        self.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * self.inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_experts, hidden, self.inter), requires_grad=False)
        set_weight_loader(self.w13, self.weight_loader)
        set_weight_loader(self.w2, self.weight_loader)

    def checkpoint_kinds(self, stack: str) -> tuple[str, ...]:
        """The tensors a checkpoint holds per expert projection of a stack (w13, w2)."""
        if stack in self.gguf:
            return ("qweight",)  # the projection's rows of blocks
        if self.quant is None:
            return ("weight",)
        return (
            ("qweight", "qzeros", "scales", "g_idx")
            if self.quant.method == "gptq"
            else ("qweight", "qzeros", "scales")
        )

    def quantize_gguf(self, types: dict[str, str]) -> None:
        """Keep the stacks in `types` (w13, w2 -> a type of EXPERT_BLOCKS) as the GGUF's blocks: each expert's rows
        (output features) of K / block blocks, this rank's rows of gate and up and its blocks of down's input features.
        A stack whose input features on this rank are not whole blocks (tensor parallelism) loads dense instead."""
        from engine.layers.quant.gguf import EXPERT_BLOCKS

        for name, qtype in types.items():
            n, k = (2 * self.inter, self.hidden) if name == "w13" else (self.hidden, self.inter)
            weights, nbytes = EXPERT_BLOCKS[qtype]
            if k % weights:
                logger.info("%s experts: %d input features a rank are not whole %s blocks of %d; loaded dense",
                            name, k, qtype, weights)  # fmt: skip
                continue
            delattr(self, name)
            param = nn.Parameter(
                torch.empty(self.num_experts, n, k // weights * nbytes, dtype=torch.uint8),
                requires_grad=False,
            )
            self.register_parameter(f"{name}_qweight", param)
            set_weight_loader(param, self.weight_loader)
            self.gguf[name] = qtype

    def quantize(self, config: QuantConfig) -> None:
        """Replace the dense stacks by an AWQ or GPTQ checkpoint's tensors, stacked over experts (the last dim
        is the output features, packed or not: gate's first half and up's second half in w13's)."""
        h, i, e = self.hidden, self.inter, self.num_experts
        g = config.group_for(h)
        if config.group_for(i) != g or h % g or i % g or g % 32:
            raise ValueError(
                f"int4 experts take one group size, a multiple of 32 dividing both {h} and {i} features, not {g}"
            )
        del self.w13, self.w2
        self.quant, self.group = config, g
        self.kinds: dict[str, str] = {}  # parameter -> checkpoint tensor kind
        for name, (k, n) in (("w13", (h, 2 * i)), ("w2", (i, h))):
            if config.method == "awq":
                shapes = {"qweight": ((k, n // 8), torch.int32), "qzeros": ((k // g, n // 8), torch.int32)}
            else:
                shapes = {"qweight": ((k // 8, n), torch.int32), "qzeros": ((k // g, n // 8), torch.int32),
                          "g_idx": ((2 if name == "w13" else 1, k), torch.int32)}  # fmt: skip
            shapes["scales"] = ((k // g, n), torch.float16)
            for kind, (shape, dtype) in shapes.items():
                param = nn.Parameter(torch.empty(e, *shape, dtype=dtype), requires_grad=False)
                self.register_parameter(f"{name}_{kind}", param)
                set_weight_loader(param, self.weight_loader)
                self.kinds[f"{name}_{kind}"] = kind

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """shard_id (expert, "gate" | "up" | "down"): one expert's whole checkpoint tensor, of which this rank
        takes its intermediate features (dense, GGUF blocks), or which goes whole into its expert's slot (int4)."""
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and 0 <= shard_id[0] < self.total_experts):
            raise ValueError(f"bad shard id {shard_id!r} for {self.total_experts} experts")
        expert, part = shard_id[0] - self.first, shard_id[1]
        if not 0 <= expert < self.num_experts:
            return  # another rank's expert (expert parallelism)
        if self.gguf.get("w2" if part == "down" else "w13"):
            self._load_gguf(param, loaded, expert, part)
            return
        if self.quant is not None:
            name = next(n for n, p in self.named_parameters(recurse=False) if p is param)
            self._load_int4(self.kinds[name], param, loaded, expert, part)
            return
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

    def _load_int4(
        self, kind: str, param: nn.Parameter, loaded: torch.Tensor, expert: int, part: str
    ) -> None:
        """One expert's tensor of one projection: gate's and up's output features (the last dim, packed or not)
        are this rank's slice of the checkpoint's, placed side by side; down's input features (dim 0: rows, words
        or groups) are this rank's slice; g_idx is one row per part."""
        dst = param.data[expert]
        dim = 0
        if kind == "g_idx":
            dst = dst[1 if part == "up" else 0]
        elif part != "down":
            half = dst.shape[-1] // 2
            dst, dim = dst.narrow(-1, 0 if part == "gate" else half, half), dst.dim() - 1
        if part != "down" and kind == "g_idx":
            full = tuple(dst.shape)  # gate's and up's input features are whole on every rank
        else:
            full = tuple(n * self.tp_size if d == dim else n for d, n in enumerate(dst.shape))
        if tuple(loaded.shape) != full:
            raise ValueError(f"shape mismatch: checkpoint has {tuple(loaded.shape)}, model expects {full}")
        if full != tuple(dst.shape):
            loaded = loaded.narrow(dim, self.tp_rank * dst.shape[dim], dst.shape[dim])
        copy_checked(dst, loaded)

    def _load_gguf(self, param: nn.Parameter, loaded: torch.Tensor, expert: int, part: str) -> None:
        """One expert's rows of blocks of one projection: this rank's rows of gate or up, placed as w13's first or
        second half; this rank's blocks of down's input features."""
        dst = param.data[expert]
        dim = 1 if part == "down" else 0  # down: blocks of its input features; gate, up: rows
        if part != "down":
            dst = dst.narrow(0, 0 if part == "gate" else self.inter, self.inter)
        full = tuple(n * self.tp_size if d == dim else n for d, n in enumerate(dst.shape))
        if loaded.dtype != torch.uint8 or tuple(loaded.shape) != full:
            raise ValueError(
                f"shape mismatch: checkpoint has {tuple(loaded.shape)} {loaded.dtype}, an expert's {part} "
                f"{self.gguf['w2' if part == 'down' else 'w13']} blocks are {full} uint8"
            )
        copy_checked(dst, loaded.narrow(dim, self.tp_rank * dst.shape[dim], dst.shape[dim]))

    def process_weights(self) -> None:
        """The checkpoint's int4 tensors as Int4Experts (kernels/int4_dequant.py's rows layout), GGUF blocks as
        Int4Experts or Int8Experts."""
        if self.quant is None and not self.gguf:
            return
        laid: dict[str, Quantized] = {name: self._int4(name) for name in ("w13", "w2")} if self.quant else {}
        w13, w2 = laid.get("w13"), laid.get("w2")
        if isinstance(w13, Int4Experts) and isinstance(w2, Int4Experts) and w2.perm is not None:
            laid["w13"], laid["w2"] = down_order_folded(w13, w2)  # the activation made in down's row order
        laid |= {name: self._from_gguf(name, qtype) for name, qtype in self.gguf.items()}
        for name in [n for n, _ in self.named_parameters(recurse=False) if n.split("_")[0] in laid]:
            delattr(self, name)
        for name, experts in laid.items():  # parameters again, so the model's weight bytes count them
            kinds: tuple[str, ...] = (
                ("qweight", "scales", "zeros") if isinstance(experts, Int4Experts) else ("qweight", "scales")
            )
            if isinstance(experts, Int4Experts) and experts.perm is not None:
                kinds += ("perm",)
            for kind in kinds:
                self.register_parameter(
                    f"{name}_{kind}", nn.Parameter(getattr(experts, kind), requires_grad=False)
                )
        self.quantized = laid

    def _from_gguf(self, name: str, qtype: str) -> Quantized:
        from engine.layers.quant.gguf import EXPERT_BLOCKS, unpack_q4, unpack_q4_k, unpack_q6_k, unpack_q8

        raw = self.get_parameter(f"{name}_qweight").data
        weights, nbytes = EXPERT_BLOCKS[qtype]
        blocks = raw.view(*raw.shape[:2], -1, nbytes)  # (E, N, K / weights, bytes)
        if qtype == "Q8_0":
            return Int8Experts(*unpack_q8(blocks), 32)
        if qtype == "Q6_K":
            return Int8Experts(*unpack_q6_k(blocks), 16)
        if qtype == "Q4_K":
            return Int4Experts(*unpack_q4_k(blocks), 32)
        return Int4Experts(*unpack_q4(blocks, qtype), 32)

    def _int4(self, name: str) -> Int4Experts:
        assert self.quant is not None
        qweight, qzeros = (
            self.get_parameter(f"{name}_qweight").data,
            self.get_parameter(f"{name}_qzeros").data,
        )
        scales, g = self.get_parameter(f"{name}_scales").data, self.group
        perm = None
        if self.quant.method == "awq":
            q = torch.stack([pack_rows(unpack_cols(w, AWQ_ORDER), check=False) for w in qweight])
            zeros = torch.stack([unpack_cols(z, AWQ_ORDER) for z in qzeros])
        else:
            q, perm = self._in_group_order(name, self.get_parameter(f"{name}_g_idx").data, qweight)
            zeros = torch.stack([unpack_cols(z, NATURAL_ORDER) for z in qzeros])
            if self.quant.zeros_minus_one:
                zeros = zeros + 1
        return Int4Experts(q.contiguous(), scales.contiguous(), zeros.contiguous(), g, perm)

    def _in_group_order(
        self, name: str, g_idx: torch.Tensor, qweight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A GPTQ stack's qweight (E, K / 8, N) with each expert's rows sorted by group, and the experts'
        permutations (E, K) int32 (None: every g_idx (E, parts, K) already in group order)."""
        g = self.group
        k = g_idx.shape[-1]
        if name == "w2":  # down's input features are this rank's: its groups counted from the rank's first
            g_idx = g_idx - self.tp_rank * (k // g)
        natural = (torch.arange(k, device=g_idx.device) // g).to(g_idx.dtype)
        if torch.equal(g_idx, natural.expand_as(g_idx)):
            return qweight, None
        if name == "w2" and self.tp_size > 1:
            raise ValueError(
                f"GPTQ act order (desc_act) is not supported on experts' down projections split across ranks "
                f"({self.tp_size}); with expert parallelism each rank holds its experts whole"
            )
        differ = (g_idx != g_idx[:, :1]).any(-1).any(-1)
        if differ.any():
            raise ValueError(
                f"GPTQ act order: expert {int(differ.nonzero()[0])}'s gate and up have different g_idx; int4 experts "
                "read x once for both"
            )
        rows, perms = [], []
        for e in range(g_idx.shape[0]):
            q, perm = sorted_by_group(unpack_rows(qweight[e]), g_idx[e, 0], g, f"{name} expert {e}")
            rows.append(qweight[e] if perm is None else pack_rows(q, check=False))
            perms.append(torch.arange(k, dtype=torch.int32, device=g_idx.device) if perm is None else perm)
        return torch.stack(rows), torch.stack(perms)

    def weights(self, x: torch.Tensor) -> tuple[Experts, Experts]:
        """(w13, w2) as the kernels take them at x: quantized experts on the GPU, their dense dequantization (made
        once) on the CPU path."""
        return self._stack("w13", x), self._stack("w2", x)

    def _stack(self, name: str, x: torch.Tensor) -> Experts:
        experts = self.quantized.get(name)
        if experts is None:
            return self.get_parameter(name)
        if _backend.use_triton(x):
            return experts
        dense = self._dense.get(name)
        if dense is None or dense.dtype != x.dtype:
            dense = self._dense[name] = experts.dequantize(x.dtype)
        return dense


class SparseMoeBlock(nn.Module):
    def __init__(
        self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1, shared_expert: nn.Module | None = None,
        expert_parallel: bool = False,
    ) -> None:  # fmt: skip
        """shared_expert: the dense MLP of config.shared_expert_intermediate_size features (Qwen2-MoE), made by
        the model (engine/model.py: LlamaMLP)."""
        super().__init__()
        self.architecture, self.top_k = config.architecture, config.num_experts_per_tok
        self.num_experts, self.tp_size = config.num_experts, tp_size
        self.renormalize = config.norm_topk_prob
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)
        self.experts = FusedMoE(
            config.num_experts, config.hidden_size, config.moe_intermediate_size, tp_rank, tp_size,
            expert_parallel,
        )  # fmt: skip
        self.shared_expert = shared_expert
        self.shared_expert_gate = (
            ReplicatedLinear(config.hidden_size, 1) if shared_expert is not None else None
        )

    def input_order(self, x: torch.Tensor) -> int:
        return 0  # x in column order: the router and the experts are dense

    def routes_after_norm(self, h: torch.Tensor) -> bool:
        """Whether the router's GEMV can begin with the residual add and the norm before it at the sublayer output
        h (kernels/gemv.py: add_norm_gemv): a dense router without a bias, at one row on the Triton path."""
        gate = self.gate
        return gate.quant_method is None and gate.bias is None and takes_add_norm_gemv(h, gate.weight)

    def forward(
        self, x: torch.Tensor, ordered: bool = False, summed: bool = True, logits: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The router's softmax in fp32 over every expert, the top k of it (renormalised to sum to 1 where the
        config says so; the Qwen MoEs round them to the model's dtype), then the chosen experts' weighted sum, plus
        the gated shared expert's output where there is one: (num_tokens, hidden). summed=False, with neither a
        shared expert nor an all-reduce: (num_tokens, k, hidden), each choice's weighted output, which the norm
        after sums as it adds the residual (engine/layers/norm.py), one kernel fewer. logits: the router's output
        at x where the kernel that normed x made it (add_norm_gemv)."""
        assert not ordered, "a MoE layer takes x in column order"
        experts = self.experts
        routing = Routing(
            self.gate(x) if logits is None else logits, self.top_k, self.renormalize,
            round_to=None if self.architecture == "MixtralForCausalLM" else x.dtype,
            first=experts.first, held=experts.num_experts,
        )  # fmt: skip
        per_choice = not summed and self.tp_size == 1 and self.shared_expert is None
        # routed by the kernels: inside the int4 gate_up GEMV at decode's few pairs, else by the route kernel first
        out = fused_moe(x, *experts.weights(x), None, None, summed=not per_choice, routing=routing)
        if per_choice:
            return out
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
            f"{block}.experts.{e}.{part}.{kind}"
            for e in range(self.experts.total_experts)
            for part, ours in names.parts.items()
            for kind in self.experts.checkpoint_kinds("w2" if ours == "down" else "w13")
        }
        return experts | {f"{block}.gate.weight"}


def to_moe_param(architecture: str, hf_name: str) -> tuple[str, tuple[int, str] | None] | None:
    """(our parameter, shard id) of a MoE layer's checkpoint tensor, or None for any other tensor."""
    names = _NAMES.get(architecture)
    if names is None:
        return None
    parts = "|".join(names.parts)
    m = re.fullmatch(
        rf"(.*\.layers\.\d+)\.{names.block}\.(?:gate\.weight|experts\.(\d+)\.({parts})\.(\w+))", hf_name
    )
    if m is None:
        return None
    layer, expert, part, kind = m.groups()
    if expert is None:
        return f"{layer}.mlp.gate.weight", None
    ours = names.parts[part]
    stack = "w2" if ours == "down" else "w13"
    return f"{layer}.mlp.experts.{stack}" + ("" if kind == "weight" else f"_{kind}"), (int(expert), ours)


def _per_expert(
    names: ExpertNames, layer: str, part: str, stack: torch.Tensor, kind: str = "weight"
) -> list[tuple[str, torch.Tensor]]:
    """An (E, ., .) stack of one projection (ours: gate, up or down) as each expert's checkpoint tensor."""
    theirs = {ours: hf for hf, ours in names.parts.items()}[part]
    return [(f"{layer}.{names.block}.experts.{e}.{theirs}.{kind}", w) for e, w in enumerate(stack)]


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
    if what == "gate.weight":
        return [(f"{layer}.{names.block}.gate.weight", tensor)]
    if what == "experts.w2":
        return _per_expert(names, layer, "down", tensor)
    gate, up = tensor.chunk(2, dim=1)
    return _per_expert(names, layer, "gate", gate) + _per_expert(names, layer, "up", up)


def gguf_expert_tensors(
    architecture: str, name: str, tensor: torch.Tensor, kind: str = "weight"
) -> list[tuple[str, torch.Tensor]] | None:
    """A llama.cpp MoE tensor, as engine/weights.py names it (model.layers.N.mlp.gate.weight for ffn_gate_inp,
    model.layers.N.mlp.experts.{gate,up,down}_exps.weight for the (E, ., .) expert stacks), as this architecture's
    checkpoint tensors; None for any other tensor. kind "qweight": a stack's rows of blocks, kept quantized."""
    names = _NAMES.get(architecture)
    m = re.fullmatch(r"(.*\.layers\.\d+)\.mlp\.(?:gate|experts\.(gate|up|down)_exps)\.weight", name)
    if names is None or m is None:
        return None
    layer, part = m.groups()
    if part is None:
        return [(f"{layer}.{names.block}.gate.weight", tensor)]
    return _per_expert(names, layer, part, tensor, kind)
