"""`pdserve quantize` on mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): the checkpoint holds each expert's
AWQ / GPTQ tensors under the architecture's names with the routers dense, and the engine serving it gives
transformers' greedy tokens on the same checkpoint dequantized (fp32, CPU). GPTQ beats rounding on an expert's own
objective, AWQ's folding leaves the routers' logits as they were, and what int4 experts cannot be is refused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from engine.layers.moe import FusedMoE, SparseMoeBlock
from engine.quantize import QuantizeConfig, quantize
from engine.quantize.calibration import CALIBRATION_TEXT, LayerRunner, token_sequences
from engine.quantize.experts import Expert, experts_of, fold_scales, gptq_expert
from engine.quantize.grid import Grid, round_to_nearest
from engine.tokenizer import Tokenizer
from engine.weights import load_model
from serving.cli import main
from tests.hf_reference import hf_greedy, tiny_random_model_dir
from tests.quant_checkpoints import dequantized_copy

PROMPTS = [[5, 6, 7, 8, 9], [20, 30, 40], [100, 3, 250, 17, 9, 64, 2]]
# arch -> sizes: the Qwen MoEs' experts 64 features wide, so that groups of 32 divide them (48 does not)
SIZES: dict[str, dict[str, int]] = {
    "mixtral": {},
    "qwen2_moe": {"moe_intermediate_size": 64},
    "qwen3_moe": {"moe_intermediate_size": 64},
}
RUNS = {  # name: (arch, method, format)
    "mixtral_gptq": ("mixtral", "gptq", "gptq"),
    "mixtral_awq": ("mixtral", "awq", "awq"),
    "qwen2_moe_awq": ("qwen2_moe", "awq", "awq"),  # the shared expert and its gate take the input scale too
    "qwen2_moe_gptq": ("qwen2_moe", "gptq", "gptq"),
    "qwen2_moe_gptq_act": (
        "qwen2_moe",
        "gptq",
        "gptq",
    ),  # act order (--desc-act): gate and up share one order
    "qwen3_moe_rtn": ("qwen3_moe", "rtn", "gptq"),  # through the CLI
}
# checkpoint names: (the MoE block under model.layers.N, gate / up / down)
NAMES = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}
MOE_KEYS = {
    "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size",
}  # fmt: skip
H, E, G = 64, 4, 32  # the tiny models' hidden size and experts; the group size


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {arch: tiny_random_model_dir(root, arch, **sizes) for arch, sizes in SIZES.items()}


@pytest.fixture(scope="module")
def checkpoints(models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    for name, (arch, method, fmt) in RUNS.items():
        if method == "rtn":
            argv = ["quantize", "--model", str(models[arch]), "--out", str(root / name), "--method", method,
                    "--format", fmt, "--group-size", str(G), "--calibration-tokens", "512"]  # fmt: skip
            assert main(argv) == 0
        else:
            config = QuantizeConfig(
                str(models[arch]), str(root / name), method=method, format=fmt, group_size=G, max_tokens=512,
                desc_act=name.endswith("_act"),
            )  # fmt: skip
            assert quantize(config) == root / name
    return {name: root / name for name in RUNS}


@pytest.mark.parametrize("name", list(RUNS))
def test_engine_equals_transformers_on_the_dequantized_checkpoint(name, checkpoints, tmp_path):
    expected = hf_greedy(
        dequantized_copy(checkpoints[name], tmp_path / "dense"), PROMPTS, [12] * len(PROMPTS)
    )
    llm = LLM(str(checkpoints[name]), device="cpu", dtype="float32", cpu_kv_cache_space=0.01)
    experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.quant is not None and m.quant.method == RUNS[name][2] for m in experts)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=12)
    )
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def format_shapes(fmt: str, k: int, n: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """A linear's tensors (k input, n output features) in the format, as tests/test_quantize.py states them."""
    shapes = {"qweight": (k, n // 8), "qzeros": (k // G, n // 8), "scales": (k // G, n)}
    if fmt == "gptq":
        shapes |= {"qweight": (k // 8, n), "g_idx": (k,)}
    return {kind: (s, torch.float16 if kind == "scales" else torch.int32) for kind, s in shapes.items()}


def assert_quantized(
    tensors: dict[str, torch.Tensor], prefix: str, fmt: str, k: int, n: int, act_order: bool = False
) -> None:
    assert f"{prefix}.weight" not in tensors, prefix
    for kind, (shape, dtype) in format_shapes(fmt, k, n).items():
        t = tensors[f"{prefix}.{kind}"]
        assert (tuple(t.shape), t.dtype) == (shape, dtype), f"{prefix}.{kind}"
    if fmt == "gptq":  # in group order, or under act order G input features a group in another order
        g_idx, natural = tensors[f"{prefix}.g_idx"], torch.arange(k, dtype=torch.int32) // G
        assert torch.equal(g_idx.sort().values, natural) and torch.equal(g_idx, natural) != act_order, prefix


@pytest.mark.parametrize("name", list(RUNS))
def test_checkpoints_hold_each_experts_tensors_and_dense_routers(name, checkpoints, models):
    arch, _, fmt = RUNS[name]
    act = name.endswith("_act")
    path = checkpoints[name]
    tensors = load_file(str(path / "model.safetensors"))
    config, source = (json.loads((p / "config.json").read_text()) for p in (path, models[arch]))
    assert config["quantization_config"]["quant_method"] == fmt
    assert config["quantization_config"]["group_size"] == G
    moe_keys = MOE_KEYS & source.keys()
    assert moe_keys and {k: config[k] for k in moe_keys} == {k: source[k] for k in moe_keys}
    block, parts = NAMES[arch]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    moe_layers = [1] if arch != "mixtral" else [0, 1]  # the Qwen MoEs' layer 0 is a dense MLP
    for layer in moe_layers:
        prefix = f"model.layers.{layer}.{block}"
        router = tensors[f"{prefix}.gate.weight"]
        assert (tuple(router.shape), router.dtype) == ((E, H), torch.float16)
        for e in range(E):
            gate, up, down = (f"{prefix}.experts.{e}.{part}" for part in parts)
            assert_quantized(tensors, gate, fmt, H, inter, act)
            assert_quantized(tensors, up, fmt, H, inter, act)
            assert_quantized(tensors, down, fmt, inter, H, act)
            if act:  # gate and up, quantized as one linear, share one order
                assert torch.equal(tensors[f"{gate}.g_idx"], tensors[f"{up}.g_idx"])
    assert not any(".experts.w13" in t or ".experts.w2" in t for t in tensors)  # only the checkpoint's names
    if arch == "qwen2_moe":  # the shared expert is a dense MLP: quantized as one; its gate stays dense
        shared = "model.layers.1.mlp.shared_expert"
        for part, (k, n) in {"gate_proj": (H, 96), "up_proj": (H, 96), "down_proj": (96, H)}.items():
            assert_quantized(tensors, f"{shared}.{part}", fmt, k, n, act)
        gate = tensors["model.layers.1.mlp.shared_expert_gate.weight"]
        assert (tuple(gate.shape), gate.dtype) == ((1, H), torch.float16)
    if arch != "mixtral":  # layer 0's dense MLP, as a dense model's
        assert_quantized(tensors, "model.layers.0.mlp.down_proj", fmt, config["intermediate_size"], H, act)


def first_moe_layer(model_dir: Path, max_tokens: int = 512):
    """A LayerRunner over the shipped text (fp32, CPU), the first MoE layer and that layer's input state."""
    model, _ = load_model(model_dir)
    ids = Tokenizer.from_dir(model_dir).encode(CALIBRATION_TEXT.read_text(), add_special_tokens=False)
    runner = LayerRunner(model, token_sequences(ids[:max_tokens], 64))
    state = runner.embed()
    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            return runner, layer, state
        state = runner.run(layer, state)
    raise AssertionError("no MoE layer")


def test_gptq_beats_round_to_nearest_on_an_experts_own_objective(models):
    """Each expert's gate and up on its routed tokens and its down on its down inputs (from the quantized gate and
    up, as GPTQ takes them): GPTQ's weighted error ||x (W - Q)^T||^2 is well below rounding's."""
    runner, layer, state = first_moe_layer(models["mixtral"])
    x = runner.inputs(layer, state)["moe"]
    grid = Grid(G, min_zero=1)
    experts = experts_of(layer.mlp, x)
    assert sum(e.x.shape[0] for e in experts) == 2 * x.shape[0]  # top 2: every token at two experts
    for expert in experts:
        assert expert.x.shape[0] >= expert.w2.shape[1], "enough routed tokens for every expert's own Hessians"
        w13, w2 = expert.w13.clone(), expert.w2.clone()
        q13, q2 = gptq_expert(expert, x, grid)
        down_inputs = expert.down_inputs(expert.x)  # expert.w13 holds the quantized gate and up now
        for w, q, inputs in ((w13, q13, expert.x), (w2, q2, down_inputs)):
            err = {name: (inputs @ (w - dq).t()).pow(2).mean().item()
                   for name, dq in (("rtn", round_to_nearest(w, grid).dequantize()), ("gptq", q.dequantize()))}  # fmt: skip
            assert err["gptq"] < 0.7 * err["rtn"], (expert.name, err)


@pytest.mark.parametrize("routed", [0, H - 1])
def test_an_expert_with_too_few_tokens_takes_every_tokens_hessian(models, routed):
    """Fewer routed tokens than input features (or none): GPTQ on the Hessian of every token of the block, as if
    the router had sent them all."""
    runner, layer, state = first_moe_layer(models["qwen3_moe"])
    x = runner.inputs(layer, state)["moe"]
    expert = experts_of(layer.mlp, x)[0]
    few, every = (Expert(expert.name, expert.w13.clone(), expert.w2.clone(), t) for t in (x[:routed], x))
    grid = Grid(G, min_zero=1)
    for a, b in zip(gptq_expert(few, x, grid), gptq_expert(every, x, grid), strict=True):
        assert torch.equal(a.q, b.q) and torch.equal(a.scales, b.scales)
    assert torch.equal(few.w2, every.w2)


def test_awq_folding_leaves_the_routers_logits_unchanged(models):
    """The shared input scale goes into post_attention_layernorm (1 / s) and every expert's gate and up, the
    router and the shared expert's gate (s): on the calibration inputs the routers' logits and the layer's output
    (before rounding) are what they were, while the norm's weight did change."""
    runner, layer, state = first_moe_layer(models["qwen2_moe"])
    block, norm = layer.mlp, layer.post_attention_layernorm
    x = runner.inputs(layer, state)["moe"]
    router, shared_gate, out = block.gate(x), block.shared_expert_gate(x), runner.run(layer, state)[0]
    before = norm.weight.data.clone()
    fold_scales(block, norm, experts_of(block, x), x, Grid(G))
    folded = runner.inputs(layer, state)["moe"]
    assert not torch.allclose(norm.weight.data, before, rtol=1e-2)  # a scale far from 1 was folded
    assert torch.allclose(block.gate(folded), router, rtol=1e-5, atol=1e-5)
    assert torch.allclose(block.shared_expert_gate(folded), shared_gate, rtol=1e-5, atol=1e-5)
    assert torch.allclose(runner.run(layer, state)[0], out, rtol=1e-4, atol=1e-5)


# ---- refusals ------------------------------------------------------------------------------------


def test_a_group_size_that_cannot_divide_the_experts_is_refused(models, tmp_path, capsys):
    both = r"int4 experts take one group size dividing both the hidden size \(64\) and the experts' intermediate size"
    with pytest.raises(ValueError, match=both + r" \(128\); 128 does not: try 64"):
        quantize(QuantizeConfig(str(models["mixtral"]), str(tmp_path / "a"), method="rtn", group_size=128))
    narrow = tiny_random_model_dir(tmp_path, "qwen3_moe")  # experts of 48 features: 64 and 48 share no group
    argv = ["quantize", "--model", str(narrow), "--out", str(tmp_path / "b"), "--method", "rtn",
            "--group-size", "32"]  # fmt: skip
    assert main(argv) == 2
    assert re.search(both + r" \(48\); 32 does not: no multiple of 32 does", capsys.readouterr().err)
