"""Checkpoints for the quantization tests: a quantized checkpoint dequantized into a plain Hugging Face model
(with tests/quant_formats.py's independent unpacking), and a llama.cpp-style GGUF of a tiny model with
chosen tensor types."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.torch import load_file, save_file

from engine.model_config import ModelConfig
from engine.weights import iter_safetensors
from tests.quant_formats import awq_dense, gptq_dense


def dequantized_copy(checkpoint: Path, out: Path) -> Path:
    """The checkpoint with every quantized linear replaced by its dense fp32 weight, as a plain HF model."""
    tensors = load_file(str(checkpoint / "model.safetensors"))
    config = json.loads((checkpoint / "config.json").read_text())
    quant = config.pop("quantization_config")
    dense = {}
    for name, t in tensors.items():
        prefix, kind = name.rsplit(".", 1)
        if kind in ("qzeros", "scales", "g_idx"):
            continue
        if kind != "qweight":
            dense[name] = t.float()
            continue
        parts = {
            k: tensors[f"{prefix}.{k}"]
            for k in ("qweight", "qzeros", "scales", "g_idx")
            if f"{prefix}.{k}" in tensors
        }
        w = awq_dense(parts, quant["group_size"]) if quant["quant_method"] == "awq" else gptq_dense(parts)
        dense[f"{prefix}.weight"] = w
    out.mkdir()
    save_file(dense, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(checkpoint / f, out / f)
    return out


GGUF_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}  # fmt: skip
GGUF_ARCHS = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
# per layer: checkpoint module -> GGUF type (the rest F32)
TYPES = {
    "0": {"q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q4_0", "o_proj": "Q8_0", "gate_proj": "Q4_1",
          "up_proj": "Q4_1"},  # down_proj stays F32: dense
    "1": {"q_proj": "Q4_1", "k_proj": "Q4_1", "v_proj": "Q8_0", "o_proj": "Q4_1", "gate_proj": "Q8_0",
          "up_proj": "Q8_0", "down_proj": "Q4_0"},  # qkv mixes types: dense
}  # fmt: skip


def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # convert_hf_to_gguf.py's q/k row order
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: Path, out: Path) -> None:
    """A llama.cpp-style GGUF of the tiny model (llama or qwen3) with the linear layers in TYPES' types (token_embd
    Q8_0)."""
    import gguf
    from gguf.quants import quantize

    c = ModelConfig.from_dir(model_dir)
    arch = GGUF_ARCHS[c.architecture]
    writer = gguf.GGUFWriter(str(out), arch=arch)
    for add, value in (
        (writer.add_block_count, c.num_hidden_layers), (writer.add_context_length, c.max_position_embeddings),
        (writer.add_embedding_length, c.hidden_size), (writer.add_feed_forward_length, c.intermediate_size),
        (writer.add_head_count, c.num_attention_heads), (writer.add_head_count_kv, c.num_key_value_heads),
        (writer.add_rope_freq_base, c.rope_theta), (writer.add_layer_norm_rms_eps, c.rms_norm_eps),
        (writer.add_vocab_size, c.vocab_size), (writer.add_bos_token_id, c.bos_token_id),
        (writer.add_eos_token_id, c.eos_token_id[0]), (writer.add_key_length, c.head_dim),
        (writer.add_value_length, c.head_dim),
    ):  # fmt: skip
        add(value)
    add_tokenizer(writer, model_dir)
    for name, tensor in iter_safetensors(model_dir):
        w = tensor.numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):  # llama.cpp permutes llama's only
            w = permute(w, c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads)
        stem, kind = name.rsplit(".", 1)
        parts = stem.split(".")
        layer, module = (parts[2], ".".join(parts[3:])) if stem.startswith("model.layers.") else (None, stem)
        gguf_name = f"blk.{layer}.{GGUF_NAMES[module]}.{kind}" if layer else f"{GGUF_NAMES[module]}.{kind}"
        qtype = TYPES.get(layer or "", {}).get(parts[-1]) or (
            "Q8_0" if module == "model.embed_tokens" else None
        )
        if qtype is None:
            writer.add_tensor(gguf_name, w)
        else:
            kind_ = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(gguf_name, quantize(w, kind_), raw_dtype=kind_)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_tokenizer(writer, model_dir: Path) -> None:
    """The tiny model's byte-level BPE as GGUF tokenizer metadata (so the engine can convert the file)."""
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["content"] for t in spec["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t in special else 1 for t in tokens])


GGUF_MOE_ARCHS = {
    "MixtralForCausalLM": "llama",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
}
GGUF_MOE_NAMES = {  # the router, the shared expert (Qwen2-MoE) and, stacked over experts, each expert's parts
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}  # fmt: skip
GGUF_EXPERT_PARTS = {
    "w1": "gate",
    "w3": "up",
    "w2": "down",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}


def write_moe_gguf(model_dir: Path, out: Path, expert_types: dict[str, str] | None = None) -> None:
    """A llama.cpp-style F32 GGUF of a tiny MoE model (Mixtral as llama with experts, qwen2moe, qwen3moe): each
    layer's experts stacked into ffn_{gate,up,down}_exps (E, ., .), the shared expert's gate a vector;
    `expert_types`: a GGUF type for some of the stacks (gate, up, down), the rest F32."""
    import re

    import gguf
    from gguf.quants import quantize

    c = ModelConfig.from_dir(model_dir)
    arch = GGUF_MOE_ARCHS[c.architecture]
    writer = gguf.GGUFWriter(str(out), arch=arch)
    dense = c.intermediate_size if arch != "llama" else c.moe_intermediate_size
    for add, value in (
        (writer.add_block_count, c.num_hidden_layers), (writer.add_context_length, c.max_position_embeddings),
        (writer.add_embedding_length, c.hidden_size), (writer.add_feed_forward_length, dense),
        (writer.add_head_count, c.num_attention_heads), (writer.add_head_count_kv, c.num_key_value_heads),
        (writer.add_rope_freq_base, c.rope_theta), (writer.add_layer_norm_rms_eps, c.rms_norm_eps),
        (writer.add_vocab_size, c.vocab_size), (writer.add_bos_token_id, c.bos_token_id),
        (writer.add_eos_token_id, c.eos_token_id[0]), (writer.add_key_length, c.head_dim),
        (writer.add_value_length, c.head_dim), (writer.add_expert_count, c.num_experts),
        (writer.add_expert_used_count, c.num_experts_per_tok), (writer.add_expert_weights_norm, c.norm_topk_prob),
    ):  # fmt: skip
        add(value)
    if arch != "llama":
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    if c.shared_expert_intermediate_size:
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    add_tokenizer(writer, model_dir)
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, tensor in iter_safetensors(model_dir):
        w = tensor.numpy()
        m = re.fullmatch(
            r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight", name
        )
        if m:
            experts.setdefault((m.group(1), GGUF_EXPERT_PARTS[m.group(3)]), {})[int(m.group(2))] = w
            continue
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            w = permute(w, c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads)
        stem, kind = name.rsplit(".", 1)
        parts = stem.split(".")
        layer, module = (parts[2], ".".join(parts[3:])) if stem.startswith("model.layers.") else (None, stem)
        gguf_name = {**GGUF_NAMES, **GGUF_MOE_NAMES}[module]
        if module == "mlp.shared_expert_gate":
            w = w.reshape(-1)
        writer.add_tensor(f"blk.{layer}.{gguf_name}.{kind}" if layer else f"{gguf_name}.{kind}", w)
    for (layer, part), stack in experts.items():
        w = np.stack([stack[e] for e in sorted(stack)])
        qtype = (expert_types or {}).get(part)
        if qtype is None:
            writer.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", w)
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            raw = random_k_blocks(w.shape, qtype, int(layer)) if qtype.endswith("_K") else quantize(w, kind)
            writer.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def random_k_blocks(shape: tuple[int, ...], qtype: str, seed: int) -> np.ndarray:
    """Random Q4_K or Q6_K super-blocks of a (..., K) tensor (gguf-py cannot quantize to them): random nibbles,
    6-bit scales and mins or int8 scales, with super-block scales d (and dmin) small enough for a tiny model."""
    nbytes = {"Q4_K": 144, "Q6_K": 210}[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // 256, nbytes), dtype=np.uint8)
    if qtype == "Q4_K":  # d, dmin: the first two fp16s
        blocks[..., 0:4] = rng.uniform(1e-4, 3e-4, (*blocks.shape[:-1], 2)).astype(np.float16).view(np.uint8)
    else:  # d: the last fp16
        blocks[..., 208:210] = (
            rng.uniform(3e-5, 8e-5, (*blocks.shape[:-1], 1)).astype(np.float16).view(np.uint8)
        )
    return blocks.reshape(*shape[:-1], -1)


def write_int4_moe(model_dir: Path, out: Path, fmt: str, group: int = 32) -> Path:
    """The tiny MoE as an AWQ or GPTQ checkpoint (round to nearest, `group` inputs a group): every attention
    projection, expert and shared-expert projection quantized as AutoAWQ / GPTQModel write them; the routers
    (gate, shared_expert_gate), norms, embeddings and LM head dense."""
    import re

    from engine.quantize.export import pack, quantization_config
    from engine.quantize.grid import Grid, round_to_nearest

    grid = Grid(group, min_zero=1 if fmt == "gptq" else 0)
    quantized = re.compile(r".*\.layers\.\d+\..*(proj|experts\.\d+\.w\d)\.weight")
    tensors = {}
    for name, tensor in iter_safetensors(model_dir):
        if not quantized.fullmatch(name):
            tensors[name] = tensor.contiguous()
            continue
        prefix = name.removesuffix(".weight")
        for kind, value in pack(fmt, round_to_nearest(tensor.float(), grid)).items():
            tensors[f"{prefix}.{kind}"] = value.contiguous()
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, group, sym=False, desc_act=False)
    (out / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(model_dir / f, out / f)
    return out
