"""GGUF files served with their Q4_0, Q4_1 and Q8_0 linear layers kept quantized: the engine's greedy tokens
equal transformers' on the same file dequantized (fp32, CPU); other tensor types, and merged layers whose
parts differ in type, are dequantized at load. The bundled Q4_1 model served in 4 bits equals the dense one.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.bundled import gguf_model_dir
from tests.hf_reference import hf_greedy, tiny_random_model_dir
from tests.quant_checkpoints import write_gguf

PROMPTS = [[5, 6, 7, 8, 9], [20, 30, 40], [100, 3, 250, 17, 9, 64, 2]]


def method_names(llm: LLM) -> list[dict[str, str]]:
    names = []
    for layer in llm.engine.runner.model.model.layers:
        mods = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
                "down": layer.mlp.down_proj}  # fmt: skip
        names.append({k: type(m.quant_method).__name__ for k, m in mods.items()})
    return names


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_q4_and_q8_layers_stay_quantized_and_equal_transformers(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    model_dir = tiny_random_model_dir(tmp_path, arch)
    write_gguf(model_dir, tmp_path / "tiny.gguf")
    llm = LLM(str(tmp_path / "tiny.gguf"), device="cpu", dtype="float32", cpu_kv_cache_space=0.01)
    assert method_names(llm) == [  # the types tests/quant_checkpoints.py: TYPES gives each layer
        {"qkv": "GGUFInt4Method", "o": "GGUFInt8Method", "gate_up": "GGUFInt4Method", "down": "NoneType"},
        {"qkv": "NoneType", "o": "GGUFInt4Method", "gate_up": "GGUFInt8Method", "down": "GGUFInt4Method"},
    ]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=12)
    )
    dequantized = gguf_model_dir(tmp_path / "tiny.gguf")  # the file dequantized to an fp32 HF directory
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(
        dequantized, PROMPTS, [12] * len(PROMPTS)
    )


@pytest.mark.slow
def test_bundled_q4_1_model_served_in_4_bits_equals_the_dense_model(bundled_model_dir):
    llm = LLM(quantization="gguf", device="cpu", dtype="float32", cpu_kv_cache_space=0.05, max_model_len=512)
    methods = method_names(llm)
    assert len(methods) == 30 and all(set(m.values()) == {"GGUFInt4Method"} for m in methods)
    model = llm.engine.runner.model
    linear_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".layers." in n
                       and "norm" not in n)  # fmt: skip
    dense_params = 30 * (576 * (576 + 2 * 192) + 576 * 576 + 2 * 576 * 1536 + 1536 * 576)
    assert linear_bytes == dense_params * 20 // 32  # Q4_1: 20 bytes per 32 weights (int4, fp16 scale and min)
    prompts = [
        llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": c}],
                                                               add_generation_prompt=True), add_special_tokens=False)
        for c in ("What is the capital of France?", "Write a short poem about the sea.")
    ]  # fmt: skip
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16)
    )
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == hf_greedy(bundled_model_dir, prompts, [16, 16])
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the tied Q8_0 table, dequantized
