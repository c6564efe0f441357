"""The Llama family: Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Phi-3 / Phi-4, SmolLM2, and the mixtures of experts
Mixtral, Qwen2-MoE and Qwen3-MoE (RMSNorm, RoPE, GQA, SwiGLU; Qwen3 also an RMSNorm over each q and k head before RoPE;
Phi-3's checkpoints hold q, k, v and gate, up fused, which the loader splits; a MoE layer's MLP is
engine/layers/moe.py's).

One forward pass takes a flattened batch of new tokens (prefill chunks and decode tokens mixed),
their positions, one AttentionMetadata and the paged KV cache of every layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import cast

import torch
from torch import nn

from engine.attention import PagedAttention
from engine.attention_metadata import AttentionMetadata
from engine.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    QuantizedLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from engine.layers.moe import SparseMoeBlock, to_moe_param
from engine.model_config import ModelConfig
from kernels import _backend
from kernels.fused_add_rmsnorm import norm_input
from kernels.gemv import add_norm_gemv
from kernels.rotary_kv_write import HeadNorms, rotary_kv_write
from kernels.w4a16_mma import NextNorm, NormedInput, RopeWrite

# checkpoint name fragment -> (our parameter fragment, shard id)
STACKED_PARAMS: dict[str, tuple[str, str | int]] = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}
IGNORED_CHECKPOINT_SUFFIXES = ("rotary_emb.inv_freq",)
BASE_MODEL_NAMES = (
    "embed_tokens.",
    "layers.",
    "norm.",
)  # a base model's tensors: the causal LM's under `model.`


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads,
            bias=config.attention_bias, tp_rank=tp_rank, tp_size=tp_size,
        )  # fmt: skip
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim, config.hidden_size,
            bias=config.o_proj_bias, tp_rank=tp_rank, tp_size=tp_size,
        )  # fmt: skip
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    @property
    def head_norms(self) -> HeadNorms | None:  # q_norm and k_norm, applied in the rotary write
        if self.q_norm is None or self.k_norm is None:
            return None
        return HeadNorms(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)

    def forward(
        self,
        hidden: torch.Tensor,  # (num_tokens, hidden)
        positions: torch.Tensor,  # (num_tokens,) int64
        cos_sin_cache: torch.Tensor,  # (max_positions, head_dim): cos | sin
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
        meta: AttentionMetadata,
        ordered: bool = False,  # hidden's columns in the K order qkv_proj.input_order named
    ) -> torch.Tensor:  # (num_tokens, hidden)
        qkv = self.qkv_proj(hidden, ordered)  # (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
        return self.o_proj(self.attend(qkv, positions, cos_sin_cache, kv_cache, meta))

    def attend(
        self,
        qkv: torch.Tensor,  # (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        written: bool = False,  # the qkv GEMM already rotated q and wrote k and v (rope_write)
    ) -> torch.Tensor:  # (num_tokens, num_heads * head_dim): o_proj's input
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # (num_tokens, num_heads, head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (num_tokens, num_kv_heads, head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # (num_tokens, num_kv_heads, head_dim)
        if not written:
            # q rotated in place; rotated k and v go straight into the cache, so attention skips its write; each
            # q and k head RMS-normed first where the model says so
            rotary_kv_write(
                q,
                k,
                v,
                positions,
                cos_sin_cache,
                kv_cache,
                meta.slot_mapping,
                self.attn.kv_scale,
                self.head_norms,
            )
        return self.attn(q, None, None, kv_cache, meta)  # (num_tokens, num_heads * head_dim)

    def rope_write(
        self, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> RopeWrite | None:  # fmt: skip
        """What the int4 qkv GEMM needs to end in RoPE and the KV-cache write at x (kernels/w4a16_mma.py), or
        None where it cannot: an fp8 cache, heads it cannot split, q and k normed per head, PDSERVE_FUSED_ROTARY=0."""
        if not _backend.FUSED_ROTARY or self.q_norm is not None:
            return None
        rope = RopeWrite(
            positions, cos_sin_cache, kv_cache, meta.slot_mapping, self.num_heads, self.num_kv_heads
        )  # fmt: skip
        return rope if self.qkv_proj.fuses_rope(x, rope) else None


class LlamaMLP(nn.Module):
    def __init__(
        self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1, intermediate_size: int | None = None
    ) -> None:
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], tp_rank=tp_rank, tp_size=tp_size
        )
        self.down_proj = RowParallelLinear(inter, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size)

    def input_order(self, x: torch.Tensor) -> int:
        return self.gate_up_proj.input_order(x)

    def forward(self, x: torch.Tensor, ordered: bool = False) -> torch.Tensor:  # (num_tokens, hidden)
        """ordered: x's columns in the K order gate_up_proj.input_order named. The activation, silu(gate) * up
        (num_tokens, inter / tp), comes in the K order down_proj reads it in."""
        order = self.down_proj.input_order(x)
        act = self.gate_up_proj(x, ordered, swiglu=True, out_order=order)
        return self.down_proj(act, order != 0)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        tp_rank: int = 0,
        tp_size: int = 1,
        index: int = 0,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp_rank, tp_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: LlamaMLP | SparseMoeBlock
        if config.is_moe_layer(index):
            inter = config.shared_expert_intermediate_size
            shared = LlamaMLP(config, tp_rank, tp_size, inter) if inter else None
            self.mlp = SparseMoeBlock(config, tp_rank, tp_size, shared, expert_parallel)
        else:
            self.mlp = LlamaMLP(config, tp_rank, tp_size)

    def forward(
        self,
        hidden: torch.Tensor,  # (num_tokens, hidden): the previous sublayer's output, or a MoE layer's choices
        residual: torch.Tensor | None,  # (num_tokens, hidden): the stream before it; None for layer 0
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The norms add the residual in place: hidden and residual are overwritten. Each writes its normed rows in
        the K order the GEMM after it reads them in (the wgmma kernel's rows: LinearBase.input_order). A MoE layer
        may return its (num_tokens, k, hidden) weighted choices unsummed: the next norm sums them."""
        order = self.self_attn.qkv_proj.input_order(hidden)
        if residual is None:
            hidden, residual = self.input_layernorm(hidden, order=order), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual, order)
        hidden = self.self_attn(hidden, positions, cos_sin_cache, kv_cache, meta, order != 0)
        norm = self.post_attention_layernorm
        if isinstance(self.mlp, SparseMoeBlock):  # its choices unsummed where it can: the next norm sums them
            if self.mlp.routes_after_norm(hidden):  # the add, the norm and the router: one kernel
                hidden, residual, logits = add_norm_gemv(
                    hidden, residual, norm.weight, norm.eps, self.mlp.gate.weight
                )
                return self.mlp(hidden, summed=False, logits=logits), residual
            hidden, residual = norm(hidden, residual)
            return self.mlp(hidden, summed=False), residual
        order = self.mlp.input_order(hidden)
        hidden, residual = norm(hidden, residual, order)
        return self.mlp(hidden, order != 0), residual

    def fuses_norms(self, x: torch.Tensor) -> bool:
        """Whether forward_fused can run this layer at x's rows: its four GEMMs carry norms (int4, up to
        kernels/w4a16_mma.py's MAX_ROWS rows, short of the rows kernels/w4a16_wgmma.py takes)."""
        attn, mlp = self.self_attn, self.mlp
        if not isinstance(mlp, LlamaMLP):
            return False
        return all(p.fuses_norms(x) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))

    def forward_fused(
        self,
        stream: torch.Tensor,  # (num_tokens, hidden): the residual stream, added into in place
        x: torch.Tensor,  # (num_tokens, hidden): input_layernorm's weight times the stream
        sumsq: torch.Tensor,  # (num_tokens, hidden / 16) fp32: the stream's sums of squares, 16 columns each
        next_weight: torch.Tensor,  # the norm after this layer's (the next layer's input norm, or the final one)
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer with no norm kernel: its norms ride in its int4 GEMMs (kernels/w4a16_mma.py). qkv_proj and
        gate_up_proj take 1 / rms from sumsq; o_proj and down_proj add into the stream and leave the next norm's
        (x, sumsq), which this returns for next_weight."""
        attn, mlp = self.self_attn, self.mlp
        assert isinstance(mlp, LlamaMLP), "a MoE layer's norms are kernels of their own"
        rope = attn.rope_write(x, positions, cos_sin_cache, kv_cache, meta)
        qkv = attn.qkv_proj.fused(x, norm=NormedInput(sumsq, self.input_layernorm.eps), rope=rope)
        out = attn.attend(qkv, positions, cos_sin_cache, kv_cache, meta, written=rope is not None)
        mid = NextNorm(self.post_attention_layernorm.weight, torch.empty_like(x), torch.empty_like(sumsq))
        attn.o_proj.fused(out, add_to=stream, next_norm=mid)
        act = mlp.gate_up_proj.fused(
            mid.normed, swiglu=True, norm=NormedInput(mid.sumsq, self.post_attention_layernorm.eps)
        )
        after = NextNorm(next_weight, torch.empty_like(x), torch.empty_like(sumsq))
        mlp.down_proj.fused(act, add_to=stream, next_norm=after)
        return after.normed, after.sumsq


class LlamaModel(nn.Module):
    def __init__(
        self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1, expert_parallel: bool = False
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.max_position_embeddings, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, tp_rank, tp_size, i, expert_parallel)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,  # (num_tokens,) int64
        positions: torch.Tensor,  # (num_tokens,) int64
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        num_layers: int | None = None,  # only the first num_layers, then the final norm (an early exit)
    ) -> torch.Tensor:  # (num_tokens, hidden)
        hidden = self.embed_tokens(input_ids)  # (num_tokens, hidden)
        cos_sin_cache = self.rotary_emb.cos_sin_cache(hidden.dtype, hidden.device)
        layers = cast(list[LlamaDecoderLayer], list(self.layers[:num_layers]))
        if layers and all(layer.fuses_norms(hidden) for layer in layers):
            return self.forward_fused(hidden, positions, cos_sin_cache, meta, kv_cache, layers)
        residual = None
        for i, layer in enumerate(layers):
            hidden, residual = layer(hidden, residual, positions, cos_sin_cache, kv_cache[i], meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def forward_fused(
        self,
        stream: torch.Tensor,  # the embedding's output, which the layers add into
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        layers: list[LlamaDecoderLayer],
    ) -> torch.Tensor:
        """The layers with their norms in their int4 GEMMs (LlamaDecoderLayer.forward_fused), then the final norm
        as forward rounds it. The first layer's input, its norm's weight times the stream, is rounded as the
        GEMMs round theirs (norm_input)."""
        x, sumsq = norm_input(stream, layers[0].input_layernorm.weight)
        for i, layer in enumerate(layers):
            after = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else self.norm.weight
            x, sumsq = layer.forward_fused(
                stream, x, sumsq, after, positions, cos_sin_cache, kv_cache[i], meta
            )
        return self.norm(stream)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1, quantized_lm_head: bool = False,
        expert_parallel: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.config = config
        self.has_lm_head = True  # False: a base model's checkpoint, which serves embeddings only
        self.model = LlamaModel(config, tp_rank, tp_size, expert_parallel)
        self.lm_head: ParallelLMHead | QuantizedLMHead
        if quantized_lm_head:  # a linear layer, which the quantization plan gives its method
            self.lm_head = QuantizedLMHead(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank, tp_size)
            if config.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # (num_tokens,) int64
        positions: torch.Tensor,  # (num_tokens,) int64
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        num_layers: int | None = None,  # only the first num_layers, then the final norm (an early exit)
    ) -> torch.Tensor:  # (num_tokens, hidden)
        return self.model(input_ids, positions, meta, kv_cache, num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (n, hidden) -> (n, vocab) fp32
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors (Hugging Face names); ValueError names anything missing or unexpected. A base
        model's checkpoint (names without `model.`, as sentence-transformers and embedding models such as
        Qwen3-Embedding save theirs) loads too; with no LM head of its own it serves embeddings only
        (`has_lm_head`)."""
        params = dict(self.named_parameters())
        seen: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in self._unfused(weights):
            if name.startswith(BASE_MODEL_NAMES):
                name = "model." + name
            if name.endswith(IGNORED_CHECKPOINT_SUFFIXES) or (self._tied and name == "lm_head.weight"):
                continue
            param_name, shard_id = to_moe_param(self.config.architecture, name) or to_param_name(name)
            if param_name not in params:
                unexpected.append(name)
                continue
            try:
                params[param_name].weight_loader(params[param_name], tensor, shard_id)  # type: ignore[attr-defined]
            except ValueError as e:
                raise ValueError(f"cannot load {name}: {e}") from e
            seen.add(name)
        if unexpected:
            raise ValueError(f"checkpoint has tensors this model does not: {_names(unexpected)}")
        missing = sorted(self.checkpoint_names() - seen)
        if missing == ["lm_head.weight"]:  # a base model: its hidden states are all it gives
            self.has_lm_head = False
        elif missing:
            raise ValueError(f"checkpoint is missing tensors: {_names(missing)}")

    def _unfused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Phi-3's fused tensors (`qkv_proj`: q, k, v rows; `gate_up_proj`: gate, up rows) as the separate ones
        the other checkpoints hold, so that each rank's loader takes its slice of each."""
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        for name, tensor in weights:
            if ".self_attn.qkv_proj." in name:
                for part, piece in zip(("q", "k", "v"), tensor.split([q, kv, kv], dim=0)):
                    yield name.replace(".qkv_proj.", f".{part}_proj."), piece
            elif ".mlp.gate_up_proj." in name:
                for part, piece in zip(("gate", "up"), tensor.chunk(2, dim=0)):
                    yield name.replace(".gate_up_proj.", f".{part}_proj."), piece
            else:
                yield name, tensor

    @property
    def _tied(self) -> bool:
        return self.config.tie_word_embeddings and isinstance(self.lm_head, ParallelLMHead)

    def checkpoint_names(self) -> set[str]:
        """The Hugging Face tensor names a complete checkpoint of this model holds."""
        names: set[str] = set()
        for i, layer in enumerate(cast(list[LlamaDecoderLayer], list(self.model.layers))):
            if isinstance(layer.mlp, SparseMoeBlock):
                names |= layer.mlp.checkpoint_names(f"model.layers.{i}")
        for param_name, _ in self.named_parameters():
            if ".mlp.experts." in param_name or param_name.endswith(".mlp.gate.weight"):
                continue  # a MoE layer's, named above
            stacked = [hf for hf, (ours, _) in STACKED_PARAMS.items() if ours in param_name]
            names.update(param_name.replace(STACKED_PARAMS[hf][0], hf) for hf in stacked)
            if not stacked:
                names.add(param_name)
        return names


def to_param_name(hf_name: str) -> tuple[str, str | int | None]:
    for hf, (ours, shard_id) in STACKED_PARAMS.items():
        if hf in hf_name:
            return hf_name.replace(hf, ours), shard_id
    return hf_name, None


def _names(names: list[str], limit: int = 12) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
