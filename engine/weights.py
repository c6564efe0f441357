"""Where weights come from: a Hugging Face safetensors directory, a GGUF file, or random ("dummy").

Each source is an iterator of (hf_name, tensor); `LlamaForCausalLM.load_weights` consumes it.
Every failure is a ValueError that names the file and the problem.
"""

from __future__ import annotations

import functools
import json
import re
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.layers.moe import expert_tensors, gguf_expert_tensors
from engine.model import LlamaForCausalLM
from engine.model_config import ModelConfig, dummy_config

if TYPE_CHECKING:
    from engine.quant_weights import QuantPlan

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")

_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    # mixtures of experts: the router and the expert stacks (E, ., .), split per expert by iter_gguf
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_exps",
    "ffn_up_exps": "mlp.experts.up_exps",
    "ffn_down_exps": "mlp.experts.down_exps",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GGUF_ARCHS = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
}  # fmt: skip


# ---- safetensors ---------------------------------------------------------------------------------


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{index}: unreadable safetensors index: {e}") from e
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} lists files that do not exist: {', '.join(absent)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no weights (*.safetensors) in model directory {model_dir}")
    return files


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in safetensors_files(Path(model_dir)):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_tensor(name)
        except Exception as e:  # safetensors raises its own SafetensorError
            raise ValueError(f"{path}: corrupt or truncated safetensors file: {e}") from e


# ---- GGUF ----------------------------------------------------------------------------------------


def open_gguf(path: str | Path) -> Any:
    """A GGUF file's reader (read-only; parsing the metadata takes seconds, so a file read again unchanged,
    as the quantized path does on every load, gets the same reader)."""
    try:
        stat = Path(path).stat()
        return _open_gguf(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
    except Exception as e:
        raise ValueError(f"{path}: corrupt or truncated GGUF file: {e}") from e


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, size: int, mtime_ns: int) -> Any:
    import gguf

    return gguf.GGUFReader(path)


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_model_config(reader: Any) -> ModelConfig:
    """A ModelConfig from GGUF metadata (llama.cpp keys, `{arch}.block_count` etc.)."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_GGUF_ARCHS)}")

    def meta(key: str, default: Any = None) -> Any:
        value = gguf_field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata is missing {arch}.{key}")
        return value

    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    architecture = _GGUF_ARCHS[arch]
    moe: dict[str, Any] = {}
    experts = int(gguf_field(reader, f"{arch}.expert_count", 0) or 0)
    if experts:  # Mixtral is written as llama with experts; the Qwen MoEs renormalise as their configs do
        architecture = "MixtralForCausalLM" if arch == "llama" else architecture
        moe = dict(
            num_experts=experts,
            num_experts_per_tok=int(meta("expert_used_count")),
            moe_intermediate_size=int(
                gguf_field(reader, f"{arch}.expert_feed_forward_length") or meta("feed_forward_length")
            ),
            norm_topk_prob=bool(gguf_field(reader, f"{arch}.expert_weights_norm", arch != "qwen2moe")),
            shared_expert_intermediate_size=int(
                gguf_field(reader, f"{arch}.expert_shared_feed_forward_length", 0) or 0
            ),
        )
    vocab = gguf_field(reader, f"{arch}.vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens", []))
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=int(meta("attention.key_length", hidden // heads)),
        rms_norm_eps=float(str(np.float32(meta("attention.layer_norm_rms_epsilon")))),  # 1e-05, not 9.99e-06
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta("context_length")),
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        attention_bias=arch in ("qwen2", "qwen2moe"),
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=() if eos is None else (int(eos),),
        torch_dtype="float32",
        **moe,
    )


def gguf_to_hf_name(name: str) -> str:
    stem, _, kind = name.rpartition(".")  # kind: weight | bias
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{kind}"
    if stem in _GGUF_NAMES:
        return f"{_GGUF_NAMES[stem]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face counterpart this loader knows")


def unpermute_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's q/k row permutation (HF rotate_half -> llama.cpp interleaved pairs).

    llama.cpp: w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2); this is its inverse.
    """
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def iter_gguf(
    reader: Any,
    config: ModelConfig,
    skip: set[str] = frozenset(),  # type: ignore[assignment]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized fp32 tensors under Hugging Face names, q/k un-permuted for the llama architecture;
    `skip`: names left out (the ones engine/quant_weights.py loads quantized)."""
    from gguf.quants import dequantize

    permuted = gguf_field(reader, "general.architecture") == "llama"
    for tensor in reader.tensors:
        name = gguf_to_hf_name(tensor.name)
        if name in skip:
            continue
        try:
            data = dequantize(tensor.data, tensor.tensor_type)
        except Exception as e:
            raise ValueError(
                f"cannot dequantize GGUF tensor {tensor.name} ({tensor.tensor_type.name}): {e}"
            ) from e
        data = data.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if permuted and ".q_proj." in name:
            data = unpermute_rotary(data, config.num_attention_heads)
        elif permuted and ".k_proj." in name:
            data = unpermute_rotary(data, config.num_key_value_heads)
        elif name.endswith(".shared_expert_gate.weight"):
            data = data.reshape(1, -1)  # llama.cpp keeps the one-output gate as a vector
        weight = torch.from_numpy(np.array(data, dtype=np.float32))  # a writable copy, not the memmap
        yield from gguf_expert_tensors(config.architecture, name, weight) or [(name, weight)]


def gguf_file(path: Path) -> Path:
    if path.is_file():
        return path
    files = sorted(path.glob("*.gguf"))
    if len(files) != 1:
        raise ValueError(f"expected one .gguf file in {path}, found {len(files)}")
    return files[0]


# ---- dummy ---------------------------------------------------------------------------------------


@torch.no_grad()
def init_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Random weights for speed work: normal(0, 0.02) everywhere, norms at 1; same seed, same weights, at
    any tensor-parallel size (each tensor is drawn whole, from its own seed, and loaded as a checkpoint's)."""
    device = next(model.parameters()).device
    if device.type == "meta":
        return
    if any(getattr(m, "quant_method", None) is not None for m in model.modules()):
        _fill_dummy_floats(model, seed)  # the int4 tensors: engine/quant_weights.py
        return
    model.load_weights(iter_dummy(model.config, next(model.parameters()).dtype, device, seed))


def _fill_dummy_floats(model: LlamaForCausalLM, seed: int) -> None:
    """A quantized model's floating-point parameters (norms, embeddings, dense layers, scales) in place."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if not param.is_floating_point():
            continue
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)


def iter_dummy(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """A dummy checkpoint under Hugging Face names: each unsharded tensor from a generator seeded by its name."""
    with torch.device("meta"):
        whole = LlamaForCausalLM(config)  # the unsharded shapes
    for name, param in whole.named_parameters():
        if name.endswith("norm.weight"):
            tensor = torch.ones(param.shape, dtype=dtype, device=device)
        else:
            gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            tensor = torch.empty(param.shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
        yield from split_stacked(name, tensor, config)


def split_stacked(name: str, tensor: torch.Tensor, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """An unsharded parameter as the checkpoint tensors it is stacked from (qkv_proj: q, k, v; gate_up_proj:
    gate, up; a MoE layer's experts: each expert's gate, up and down), each under its Hugging Face name; any other
    parameter as it is."""
    experts = expert_tensors(config.architecture, name, tensor)
    if experts is not None:
        yield from experts
    elif ".qkv_proj." in name:
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        for part, piece in zip(("q", "k", "v"), tensor.split([q, kv, kv])):
            yield name.replace(".qkv_proj.", f".{part}_proj."), piece
    elif ".gate_up_proj." in name:
        for part, piece in zip(("gate", "up"), tensor.chunk(2)):
            yield name.replace(".gate_up_proj.", f".{part}_proj."), piece
    else:
        yield name, tensor


# ---- load_model ----------------------------------------------------------------------------------


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device,
    tp_rank: int = 0,
    tp_size: int = 1,
    plan: QuantPlan | None = None,
    expert_parallel: bool = False,
) -> LlamaForCausalLM:
    """The model (tensor-parallel rank `tp_rank`'s share) with uninitialized parameters, allocated directly in
    `dtype` on `device`; with a quantization plan, its linear layers get their methods' tensors instead of
    dense weights."""
    from engine.layers.linear import deferred_weights
    from engine.quant_weights import attach_methods

    with _default_dtype(dtype), torch.device(device):
        if plan is None:
            return LlamaForCausalLM(config, tp_rank, tp_size, expert_parallel=expert_parallel).eval()
        with deferred_weights():
            head = getattr(plan, "quantized_lm_head", False)
            net = LlamaForCausalLM(
                config, tp_rank, tp_size, quantized_lm_head=head, expert_parallel=expert_parallel
            ).eval()
        attach_methods(net, plan)
        return net


def resolve_format(path: Path, load_format: str) -> str:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; expected one of {', '.join(LOAD_FORMATS)}")
    if load_format != "auto":
        return load_format
    if path.is_file():
        return "gguf"
    if not (path / "config.json").is_file() and any(path.glob("*.gguf")):
        return "gguf"
    return "safetensors"


def load_model(
    model: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    load_format: str = "auto",
    device: str | torch.device = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
    quantization: str | None = None,
    expert_parallel: bool = False,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build and load a model: a HF directory, a .gguf file, or (load_format="dummy") a DUMMY_SHAPES name;
    with tp_size > 1, tensor-parallel rank tp_rank's share of it (a MoE's experts spread whole over the ranks
    with expert_parallel). `quantization` (awq, gptq, gguf; None: what the files say) is
    engine/quant_weights.py's."""
    from engine.quant_weights import (
        gguf_kept,
        init_dummy_quantized,
        iter_gguf_quantized,
        process_weights,
        quant_plan,
    )

    path = Path(model)
    if load_format == "dummy":
        config = dummy_config(str(model)) if not path.is_dir() else ModelConfig.from_dir(path)
        net = build_model(
            config,
            dtype,
            device,
            tp_rank,
            tp_size,
            quant_plan(path, quantization, load_format),
            expert_parallel,
        )
        init_dummy_weights(net)
        init_dummy_quantized(net)
        process_weights(net)
        return net, config
    if not path.exists():
        raise ValueError(f"model path does not exist: {path}")
    gguf = resolve_format(path, load_format) == "gguf"
    if not gguf and not path.is_dir():
        raise ValueError(f"not a model directory: {path}")
    reader = open_gguf(gguf_file(path)) if gguf else None
    plan = quant_plan(path, quantization, "gguf" if gguf else load_format, reader)
    if gguf:
        config = gguf_model_config(reader)
    else:
        config = ModelConfig.from_dir(path)
        safetensors_files(path)  # fail early when there are none
    net = build_model(config, dtype, device, tp_rank, tp_size, plan, expert_parallel)
    if gguf:
        kept = gguf_kept(net)
        weights = iter_gguf_quantized(reader, config, kept) if kept else iter_gguf(reader, config)
    else:
        weights = iter_safetensors(path)
    net.load_weights(weights)
    process_weights(net)
    return net, config
