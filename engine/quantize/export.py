"""Writing a quantized model as a Hugging Face checkpoint that vLLM's and transformers' loaders read:
config.json with quantization_config, model.safetensors, the tokenizer files.

Tensor names, dtypes and packing are the formats' own (engine/layers/quant/awq.py and gptq.py draw them):
    AWQ (GEMM):  <linear>.qweight (K, N/8) int32, .qzeros (K/G, N/8) int32, .scales (K/G, N) fp16
    GPTQ:        <linear>.qweight (K/8, N) int32, .qzeros (K/G, N/8) int32 (zero points minus one),
                 .scales (K/G, N) fp16, .g_idx (K,) int32
Everything else (embeddings, norms, an untied LM head, biases) is fp16, as AutoAWQ and AutoGPTQ save it;
with GPTQ's lm_head=true (GPTQModel's option, which vLLM reads) the LM head is quantized too, as
lm_head.qweight etc., and the config no longer ties it to the embedding.
The merged layers are split back into q/k/v_proj and gate/up_proj. A mixture of experts' routed experts
are written one expert at a time under the architecture's names (Mixtral's block_sparse_moe.experts.E.{w1,w3,w2},
the Qwen MoEs' mlp.experts.E.{gate,up,down}_proj) in the same packing; the routers stay dense.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from engine.layers.moe import expert_tensors, to_moe_param
from engine.layers.quant.base import output_slot
from engine.layers.quant.packing import AWQ_ORDER, NATURAL_ORDER, pack_cols, pack_rows
from engine.model import STACKED_PARAMS, LlamaForCausalLM
from engine.quant_weights import checkpoint_parts
from engine.quantize.grid import QuantizedWeight

EXPERT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)")  # a routed expert's projection in the results
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
    "vocab.json", "merges.txt", "tokenizer.model",
)  # fmt: skip


def quantization_config(
    fmt: str, group_size: int, sym: bool, desc_act: bool, lm_head: bool = False
) -> dict[str, Any]:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "true_sequential": True, "damp_percent": 0.01, "static_groups": False, "lm_head": lm_head,
            "checkpoint_format": "gptq"}  # fmt: skip


def pack(fmt: str, w: QuantizedWeight) -> dict[str, torch.Tensor]:
    """One linear's tensors (without the name prefix) in the format's layout."""
    q, zeros = w.q.t().contiguous(), w.zeros.t().contiguous()  # (K, N), (K/G, N)
    scales = w.scales.t().contiguous().half()
    if fmt == "awq":
        return {"qweight": pack_cols(q, AWQ_ORDER), "qzeros": pack_cols(zeros, AWQ_ORDER), "scales": scales}
    if int(zeros.min()) < 1:
        raise ValueError(
            "GPTQ's classic format stores zero points minus one: a zero point of 0 cannot be stored"
        )
    return {
        "qweight": pack_rows(q),
        "qzeros": pack_cols(zeros - 1, NATURAL_ORDER),
        "scales": scales,
        "g_idx": w.g_idx.to(torch.int32),
    }


def checkpoint_tensors(
    model: LlamaForCausalLM, results: dict[str, QuantizedWeight], fmt: str
) -> dict[str, torch.Tensor]:
    """Every tensor of the quantized checkpoint under its Hugging Face name."""
    tensors: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    for prefix, result in results.items():
        if prefix == "lm_head":  # a quantized LM head (GPTQ lm_head=true): one part, the whole vocabulary
            tensors.update({f"lm_head.{name}": t.cpu() for name, t in pack(fmt, result).items()})
            continue
        if EXPERT.fullmatch(prefix):  # written with their stacks below
            continue
        layer = modules[prefix]
        shard_ids: list[str | int | None] = [
            sid for _, (ours, sid) in STACKED_PARAMS.items() if ours in prefix + "."
        ]
        shard_ids = shard_ids or [None]
        for part, shard in zip(checkpoint_parts(prefix), shard_ids, strict=True):
            offset, size = output_slot(layer, shard)  # type: ignore[arg-type]
            for name, t in pack(fmt, result.rows(offset, size)).items():
                tensors[f"{part}.{name}"] = t.cpu()
            bias = getattr(layer, "bias", None)
            if bias is not None:
                tensors[f"{part}.bias"] = bias.data[offset : offset + size].half().cpu()
    dense = {name: p for name, p in model.named_parameters() if name.rsplit(".", 1)[0] not in results}
    for name, param in dense.items():
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        moe = expert_tensors(model.config.architecture, name, param.data)
        if moe is None:
            tensors[name] = param.data.half().cpu().contiguous()
        else:
            tensors.update(moe_tensors(model.config.architecture, moe, results, fmt))
    return tensors


def moe_tensors(
    architecture: str, theirs: list[tuple[str, torch.Tensor]], results: dict[str, QuantizedWeight], fmt: str
) -> dict[str, torch.Tensor]:
    """A MoE parameter's checkpoint tensors (engine/layers/moe.py: expert_tensors): the router dense, each
    expert's projection as results' model.layers.N.mlp.experts.E.{gate,up,down} packed."""
    tensors = {}
    for name, t in theirs:
        ours = to_moe_param(architecture, name)
        assert ours is not None, name
        param, shard = ours
        if shard is None:  # the router
            tensors[name] = t.half().cpu().contiguous()
            continue
        expert, part = shard
        layer = param.split(".mlp.", 1)[0]
        packed = pack(fmt, results[f"{layer}.mlp.experts.{expert}.{part}"])
        tensors.update({f"{name.removesuffix('.weight')}.{kind}": v.cpu() for kind, v in packed.items()})
    return tensors


def write_checkpoint(
    out: Path,
    model: LlamaForCausalLM,
    source: Path,
    results: dict[str, QuantizedWeight],
    quant: dict[str, Any],
) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(model, results, quant["quant_method"])
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = (
        json.loads((source / "config.json").read_text())
        if (source / "config.json").is_file()
        else model.config.to_hf_dict()
    )
    config.pop("dtype", None)
    config.update(torch_dtype="float16", quantization_config=quant)
    if quant.get("lm_head"):  # the head has tensors of its own now; the embedding stays dense
        config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
