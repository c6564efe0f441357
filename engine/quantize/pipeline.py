"""`pdserve quantize`: a model to an int4 checkpoint, one decoder layer at a time.

    state = embeddings of the calibration tokens
    for each layer:
        rtn:  round each linear's weight to its group grid
        awq:  inputs of the layer's linears -> per-channel scales folded into the norm / previous linear,
              clipping, then round to the grid
        gptq: for qkv, o, gate_up, down in turn: inputs (with the ones before already quantized) ->
              Hessian -> GPTQ
        a mixture of experts' layer: its attention as above, its experts on the tokens routed to them
              (engine/quantize/experts.py); the routers stay dense
        the layer's weights become their dequantized values; state = the layer's output
    write the checkpoint (engine/quantize/export.py)

The next layer's inputs come from the quantized layers, as the served model computes them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.layers.moe import SparseMoeBlock
from engine.layers.norm import RMSNorm
from engine.model import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from engine.model_config import ModelConfig
from engine.quantize.awq import search_clip, search_scales
from engine.quantize.calibration import (
    CALIBRATION_TEXT,
    LayerRunner,
    State,
    linears,
    token_sequences,
)
from engine.quantize.experts import quantize_moe
from engine.quantize.export import quantization_config, write_checkpoint
from engine.quantize.gptq import gptq, hessian
from engine.quantize.grid import Grid, QuantizedWeight, round_to_nearest

logger = logging.getLogger(__name__)

METHODS = ("rtn", "awq", "gptq")
FORMATS = ("awq", "gptq")
# Calibration sequence length. GPTQ's error feedback weighs every calibration token alike, and in 512-token
# sequences the first positions (attention sinks, read by every later query) are 1 token in 512: on
# SmolLM2 it then moved error into their keys and values and lost to RTN on held-out text; with 64-token
# sequences it beats RTN (docs/architecture.md, Int4 weights). AWQ (AutoAWQ's 512) is not sensitive to it.
SEQ_LEN = {"rtn": 512, "awq": 512, "gptq": 64}


@dataclass(frozen=True)
class QuantizeConfig:
    model: str | None  # HF directory or GGUF file (None: the bundled model)
    out: str
    method: str = "awq"
    group_size: int = 128
    format: str | None = None  # awq | gptq; None: awq for awq, gptq for rtn and gptq
    sym: bool = False  # zero points fixed at 8 (GPTQ's sym=true, which vLLM's Marlin kernels need)
    desc_act: bool = False  # gptq: act order
    calibration: str | None = None  # a text file; None: engine/quantize/data/calibration.txt
    seq_len: int | None = None  # tokens per calibration sequence; None: SEQ_LEN[method]
    max_tokens: int | None = None  # calibrate on the text's first max_tokens tokens (None: all of it)
    device: str = "cpu"
    lm_head: bool = False  # quantize the LM head too (GPTQ format's lm_head=true)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.format is not None and self.format not in FORMATS:
            raise ValueError(f"format must be awq or gptq, got {self.format!r}")
        if self.fmt == "awq" and (self.sym or self.desc_act):
            raise ValueError("the AWQ format has no sym or desc_act: use --format gptq")
        if self.lm_head and self.fmt != "gptq":
            raise ValueError(
                "the AWQ format keeps the LM head dense: a quantized LM head needs --format gptq"
            )
        if self.desc_act and self.method != "gptq":
            raise ValueError("desc_act (act order) is GPTQ's column order: use --method gptq")
        if self.group_size <= 0 or self.group_size % 32:
            raise ValueError(f"group size must be a positive multiple of 32, got {self.group_size}")
        if self.sequence_length < 16 or (self.max_tokens is not None and self.max_tokens < 16):
            raise ValueError(
                f"seq_len and max_tokens must be at least 16, got {self.seq_len}, {self.max_tokens}"
            )

    @property
    def sequence_length(self) -> int:
        return self.seq_len or SEQ_LEN[self.method]

    @property
    def fmt(self) -> str:
        return self.format or ("awq" if self.method == "awq" else "gptq")

    @property
    def grid(self) -> Grid:
        return Grid(self.group_size, sym=self.sym, min_zero=1 if self.fmt == "gptq" else 0)


def quantize(cfg: QuantizeConfig) -> Path:
    """Quantize cfg.model and write the checkpoint to cfg.out; returns its path."""
    from engine.bundled import model_dir
    from engine.tokenizer import Tokenizer
    from engine.weights import load_model

    source = Path(model_dir(cfg.model))
    model, config = load_model(source, dtype=torch.float32, device=cfg.device)
    if config.architecture == "Phi3ForCausalLM":
        raise ValueError(
            "pdserve quantize writes q, k, v and gate, up as tensors of their own, and Phi-3's checkpoints fuse "
            "them (qkv_proj, gate_up_proj): a Phi-3 checkpoint cannot be quantized here"
        )
    if config.is_moe:
        check_experts(cfg, config)
    sizes = {k for layer in model.model.layers for k in input_sizes(layer)}  # type: ignore[arg-type]
    if any(k % cfg.group_size for k in sizes):
        raise ValueError(
            f"group size {cfg.group_size} does not divide every linear layer's input features "
            f"({', '.join(map(str, sorted(sizes)))}); the AWQ and GPTQ formats need whole groups: try "
            f"{largest_group(sizes)}"
        )
    if cfg.lm_head and config.vocab_size % 8:
        raise ValueError(
            f"a quantized LM head packs 8 vocabulary rows per int32: the vocabulary of {config.vocab_size} "
            "is not a multiple of 8"
        )
    text = Path(cfg.calibration).read_text() if cfg.calibration else CALIBRATION_TEXT.read_text()
    ids = Tokenizer.from_dir(source).encode(text, add_special_tokens=False)[: cfg.max_tokens]
    runner = LayerRunner(
        model, token_sequences(ids, min(cfg.sequence_length, config.max_position_embeddings))
    )
    state, results = runner.embed(), {}
    t0 = time.perf_counter()
    for i, layer in enumerate(model.model.layers):
        done = quantize_layer(cfg, runner, layer, state)  # type: ignore[arg-type]
        results.update({f"model.layers.{i}.{name}": w for name, w in done.items()})
        state = runner.run(layer, state)  # type: ignore[arg-type]
        logger.info("layer %d/%d quantized (%s) at %.0f s", i + 1, config.num_hidden_layers, cfg.method,
                    time.perf_counter() - t0)  # fmt: skip
    if cfg.lm_head:
        results["lm_head"] = quantize_lm_head(cfg, runner, model, state)
    quant = quantization_config(cfg.fmt, cfg.group_size, cfg.sym, cfg.desc_act, cfg.lm_head)
    write_checkpoint(Path(cfg.out), model, source, results, quant)
    return Path(cfg.out)


@torch.no_grad()
def quantize_lm_head(
    cfg: QuantizeConfig, runner: LayerRunner, model: LlamaForCausalLM, state: State
) -> QuantizedWeight:
    """The LM head on the grid: GPTQ over the final norm's outputs of the calibration text (what the head
    reads, from the quantized layers), else round to nearest. The model's head (maybe the embedding, when
    tied) keeps its dense weight."""
    weight = model.lm_head.weight.data
    if cfg.method != "gptq":
        return round_to_nearest(weight, cfg.grid)
    hidden, residual = state
    norm = model.model.norm
    x = norm(hidden.clone()) if residual is None else norm(hidden.clone(), residual.clone())[0]
    return gptq(weight, hessian(x), cfg.grid, cfg.desc_act)


def check_experts(cfg: QuantizeConfig, config: ModelConfig) -> None:
    """What int4 experts can be (engine/layers/moe.py: FusedMoE.quantize): one group size dividing both their
    input sizes."""
    h, i = config.hidden_size, config.moe_intermediate_size
    if h % cfg.group_size or i % cfg.group_size:
        fits = [g for g in (128, 64, 32) if h % g == 0 and i % g == 0]
        hint = (
            f"try {fits[0]}" if fits else "no multiple of 32 does, so these experts cannot be quantized here"
        )
        raise ValueError(
            f"int4 experts take one group size dividing both the hidden size ({h}) and the experts' intermediate "
            f"size ({i}); {cfg.group_size} does not: {hint}"
        )


def input_sizes(layer: LlamaDecoderLayer) -> list[int]:
    """The input features of every linear layer quantized in `layer` (experts included)."""
    attn, mlp = layer.self_attn, layer.mlp
    sizes = [attn.qkv_proj.input_size, attn.o_proj.input_size]
    dense = mlp.shared_expert if isinstance(mlp, SparseMoeBlock) else mlp
    if isinstance(mlp, SparseMoeBlock):
        sizes += [mlp.experts.hidden, mlp.experts.inter]
    if isinstance(dense, LlamaMLP):
        sizes += [dense.gate_up_proj.input_size, dense.down_proj.input_size]
    return sizes


def largest_group(sizes: set[int]) -> int:
    """The largest of 128, 64, 32 that divides every size (32: any model whose sizes are multiples of 32)."""
    return next((g for g in (128, 64) if all(k % g == 0 for k in sizes)), 32)


_PATHS = {
    "qkv": "self_attn.qkv_proj",
    "o": "self_attn.o_proj",
    "gate_up": "mlp.gate_up_proj",
    "down": "mlp.down_proj",
}


def quantize_layer(
    cfg: QuantizeConfig, runner: LayerRunner, layer: LlamaDecoderLayer, state: State
) -> dict[str, QuantizedWeight]:
    """Quantize one decoder layer in place (its linears hold their dequantized weights afterwards). A MoE layer's
    experts: engine/quantize/experts.py, on the block's input (for GPTQ with the attention quantized)."""
    out: dict[str, QuantizedWeight] = {}
    inputs = runner.inputs(layer, state) if cfg.method == "awq" else {}
    if cfg.method == "awq":
        apply_awq(layer, inputs, cfg.grid)
    for name, linear in linears(layer).items():
        weight = linear.weight.data
        if cfg.method == "gptq":
            x = runner.inputs(layer, state)[name]  # the linears before it are quantized already
            out[name] = gptq(weight, hessian(x), cfg.grid, cfg.desc_act)
        else:
            out[name] = round_to_nearest(weight, cfg.grid)
        weight.copy_(out[name].dequantize())
    done = {_PATHS[name]: w for name, w in out.items()}
    if isinstance(layer.mlp, SparseMoeBlock):
        block_input = runner.inputs(layer, state)["moe"] if cfg.method == "gptq" else inputs.get("moe")
        done |= quantize_moe(
            cfg.method, layer.mlp, layer.post_attention_layernorm, block_input, cfg.grid, cfg.desc_act
        )
    return done


@torch.no_grad()
def apply_awq(layer: LlamaDecoderLayer, inputs: dict[str, torch.Tensor], grid: Grid) -> None:
    """Search and fold each linear's input scales, then clip every linear but q and k (attention scores
    are sensitive to them; AutoAWQ leaves them too). A MoE layer's MLP is engine/quantize/experts.py's."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, o = attn.qkv_proj.weight.data, attn.o_proj.weight.data
    v_rows = slice(qkv.shape[0] - attn.num_kv_heads * attn.head_dim, qkv.shape[0])
    s = search_scales(inputs["qkv"], qkv, grid)
    layer.input_layernorm.weight.data.div_(s)
    qkv.mul_(s)
    scaled_qkv, scaled_o = inputs["qkv"] / s, inputs["o"]
    if v_rows.stop - v_rows.start == o.shape[1]:  # no GQA: o_proj's inputs are v's outputs, row for row
        s = search_scales(inputs["o"], o, grid)
        qkv[v_rows].div_(s[:, None])
        if attn.qkv_proj.bias is not None:
            attn.qkv_proj.bias.data[v_rows].div_(s)
        o.mul_(s)
        scaled_o = inputs["o"] / s
    qkv[v_rows] = search_clip(scaled_qkv, qkv[v_rows], grid)
    o.copy_(search_clip(scaled_o, o, grid))
    if isinstance(mlp, LlamaMLP):
        awq_mlp(mlp, layer.post_attention_layernorm, inputs, grid)


def awq_mlp(mlp: LlamaMLP, norm: RMSNorm, inputs: dict[str, torch.Tensor], grid: Grid) -> None:
    gate_up, down = mlp.gate_up_proj.weight.data, mlp.down_proj.weight.data
    inter = down.shape[1]
    s = search_scales(inputs["gate_up"], gate_up, grid)
    norm.weight.data.div_(s)
    gate_up.mul_(s)
    scaled_gate_up = inputs["gate_up"] / s
    s = search_scales(inputs["down"], down, grid)
    gate_up[inter:].div_(s[:, None])  # up's rows: silu(gate) * up / s
    down.mul_(s)
    gate_up.copy_(search_clip(scaled_gate_up, gate_up, grid))
    down.copy_(search_clip(inputs["down"] / s, down, grid))
