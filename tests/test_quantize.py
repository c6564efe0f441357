"""`pdserve quantize` and the AWQ / GPTQ loaders: checkpoints written here have the formats' tensors, and the
engine serving one gives transformers' greedy tokens on the same checkpoint dequantized (fp32, CPU); bad
quantization configs, packed shapes and options are refused with messages that name them.

The dequantized checkpoint is built with tests/quant_formats.py (AutoAWQ's and AutoGPTQ's unpacking,
written here), so the exporter and the loader are each checked against the formats, not against each other.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.quantize.gptq import gptq, hessian
from engine.quantize.grid import Grid, round_to_nearest
from serving.cli import main
from tests.hf_reference import hf_greedy, tiny_random_model_dir
from tests.quant_checkpoints import dequantized_copy

PROMPTS = [[5, 6, 7, 8, 9], [20, 30, 40], [100, 3, 250, 17, 9, 64, 2]]
RUNS = {  # name: pdserve quantize flags
    "rtn": ["--method", "rtn"],
    "awq": ["--method", "awq"],
    "gptq_act": ["--method", "gptq", "--desc-act"],
    "gptq_head": ["--method", "gptq", "--lm-head"],  # the (tied) LM head quantized too
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    # the vocabulary a multiple of 8, as GPTQ packs a quantized LM head's rows (the tokenizer has 300)
    return tiny_random_model_dir(tmp_path_factory.mktemp("dense"), vocab_size=304)


@pytest.fixture(scope="module")
def checkpoints(tiny, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    for name, flags in RUNS.items():
        argv = ["quantize", "--model", str(tiny), "--out", str(root / name), "--group-size", "32",
                "--calibration-tokens", "512", *flags]  # fmt: skip
        assert main(argv) == 0
    return {name: root / name for name in RUNS}


@pytest.mark.parametrize("name", list(RUNS))
def test_engine_equals_transformers_on_the_dequantized_checkpoint(name, checkpoints, tmp_path):
    dense = dequantized_copy(checkpoints[name], tmp_path / "dense")
    expected = hf_greedy(dense, PROMPTS, [12] * len(PROMPTS))
    llm = LLM(str(checkpoints[name]), device="cpu", dtype="float32", cpu_kv_cache_space=0.01)
    method = type(llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.quant_method).__name__
    assert method == ("AWQLinearMethod" if name == "awq" else "GPTQLinearMethod")
    head = llm.engine.runner.model.lm_head
    assert type(head).__name__ == ("QuantizedLMHead" if name == "gptq_head" else "ParallelLMHead")
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=12)
    )
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def test_norms_in_the_gemms_equal_transformers(checkpoints, tmp_path, monkeypatch):
    """The model's path with each layer's norms riding in its int4 GEMMs (engine/model.py: forward_fused; on a
    GPU at 1-16 rows), the qkv GEMM also ending in RoPE and the KV-cache write, taken on the CPU through the fused
    GEMM's torch reference: greedy output equals transformers' on the dequantized weights, and the path ran."""
    import kernels.w4a16_mma as mma
    from engine.layers.quant.int4 import Int4Method
    from engine.model import LlamaModel

    expected = hf_greedy(
        dequantized_copy(checkpoints["awq"], tmp_path / "dense"), PROMPTS, [12] * len(PROMPTS)
    )
    monkeypatch.setattr(Int4Method, "fuses_norms", lambda self, x: x.shape[0] <= 16)
    calls: list[int] = []
    real = LlamaModel.forward_fused
    monkeypatch.setattr(LlamaModel, "forward_fused", lambda self, *a: calls.append(1) or real(self, *a))
    ropes: list[bool] = []
    reference = mma.w4a16_mma_reference
    monkeypatch.setattr(
        mma, "w4a16_mma_reference", lambda *a, **kw: ropes.append(kw.get("rope") is not None) or reference(*a, **kw)
    )  # fmt: skip
    llm = LLM(str(checkpoints["awq"]), device="cpu", dtype="float32", cpu_kv_cache_space=0.01)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=12)
    )
    assert calls, "the fused path did not run"
    assert any(ropes), "the qkv GEMM did not end in RoPE and the KV-cache write"
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def test_x_written_in_the_wgmma_kernels_k_order_equals_transformers(checkpoints, tmp_path, monkeypatch):
    """Where a GEMM reads x in the fragment layout's K order (the wgmma kernel's rows on a GPU), the norm before qkv
    and gate_up and the SiLU-and-mul before down write it so and the GEMM takes it ungathered. Taken on the CPU with
    the order asked for at 3 rows or more and the ordered GEMM putting x back in column order first: greedy output
    equals transformers' on the dequantized weights, and every one of those GEMMs took ordered x."""
    from engine.layers.quant.int4 import Int4Method
    from kernels.int4_dequant import layout_order

    expected = hf_greedy(
        dequantized_copy(checkpoints["awq"], tmp_path / "dense"), PROMPTS, [12] * len(PROMPTS)
    )
    monkeypatch.setattr(Int4Method, "input_order", lambda self, x: 64 if x.shape[0] >= 3 else 0)
    ordered: set[int] = set()

    def apply_ordered(self, layer, x, bias):
        inverse = torch.argsort(layout_order(x.shape[1], 64, x.device))
        ordered.add(id(layer))
        return self.apply(layer, x.index_select(1, inverse), bias)

    monkeypatch.setattr(Int4Method, "apply_ordered", apply_ordered)
    llm = LLM(str(checkpoints["awq"]), device="cpu", dtype="float32", cpu_kv_cache_space=0.01)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=12)
    )
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    layers = llm.engine.runner.model.model.layers
    want = {
        id(p)
        for layer in layers
        for p in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    }
    assert ordered == want


def test_rope_rides_in_the_qkv_gemm_only_where_it_can(checkpoints, monkeypatch):
    """The fused path hands RoPE and the KV-cache write to the qkv GEMM at 1-8 rows of a 16-bit or fp32 cache; an
    fp8 cache (it stores quantized), 9 or more rows and PDSERVE_FUSED_ROTARY=0 keep rotary_kv_write."""
    import kernels._backend as backend
    from engine.attention_metadata import AttentionMetadata
    from engine.layers.quant.int4 import Int4Method
    from kernels.kv_quant import FP8_DTYPE

    monkeypatch.setattr(Int4Method, "fuses_norms", lambda self, x: x.shape[0] <= 16)
    llm = LLM(str(checkpoints["awq"]), device="cpu", dtype="float32", cpu_kv_cache_space=0.01)
    attn = llm.engine.runner.model.model.layers[0].self_attn
    shape = (2, 4, 16, attn.num_kv_heads, attn.head_dim)
    cos_sin = torch.zeros(64, attn.head_dim)

    def rope(rows: int, dtype: torch.dtype):
        x = torch.zeros(rows, attn.qkv_proj.input_size)
        one = torch.ones(1, dtype=torch.int32)
        meta = AttentionMetadata(torch.zeros(rows, dtype=torch.long), one, one, one.view(1, 1), rows, rows)
        cache = torch.zeros(shape).to(dtype)
        return attn.rope_write(x, torch.zeros(rows, dtype=torch.long), cos_sin, cache, meta)

    assert rope(1, torch.float32) is not None and rope(8, torch.bfloat16) is not None
    assert rope(9, torch.float32) is None and rope(1, FP8_DTYPE) is None
    monkeypatch.setattr(backend, "FUSED_ROTARY", False)
    assert rope(1, torch.float32) is None


def test_checkpoints_have_the_formats_tensors_and_config(checkpoints, tiny):
    for name, path in checkpoints.items():
        tensors = load_file(str(path / "model.safetensors"))
        quant = json.loads((path / "config.json").read_text())["quantization_config"]
        k, n, g = 64, 32, 32  # the tiny model's hidden size, one k_proj's rows (2 kv heads of 16), group
        prefix = "model.layers.1.self_attn.k_proj"
        if name == "awq":
            assert quant == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                             "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
            shapes = {"qweight": (k, n // 8), "qzeros": (k // g, n // 8), "scales": (k // g, n)}
        else:
            assert {key: quant[key] for key in ("quant_method", "bits", "group_size", "desc_act", "sym")} == {
                "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": name == "gptq_act", "sym": False,
            }  # fmt: skip
            assert quant["checkpoint_format"] == "gptq"
            assert quant["lm_head"] == (name == "gptq_head")
            shapes = {
                "qweight": (k // 8, n),
                "qzeros": (k // g, n // 8),
                "scales": (k // g, n),
                "g_idx": (k,),
            }
        for kind, shape in shapes.items():
            t = tensors[f"{prefix}.{kind}"]
            assert tuple(t.shape) == shape and t.dtype == (torch.float16 if kind == "scales" else torch.int32)
        assert f"{prefix}.weight" not in tensors
        assert tensors["model.embed_tokens.weight"].dtype == torch.float16
        assert (path / "tokenizer.json").is_file()
        config = json.loads((path / "config.json").read_text())
        if name == "gptq_head":  # the head's own tensors, no longer tied to the (dense) embedding
            vocab = tensors["model.embed_tokens.weight"].shape[0]
            assert tuple(tensors["lm_head.qweight"].shape) == (k // 8, vocab)
            assert tuple(tensors["lm_head.scales"].shape) == (k // g, vocab)
            assert "lm_head.weight" not in tensors and config["tie_word_embeddings"] is False
        else:
            assert not any(t.startswith("lm_head.") for t in tensors) and config["tie_word_embeddings"]
    g_idx = load_file(str(checkpoints["gptq_act"] / "model.safetensors"))[
        "model.layers.0.mlp.down_proj.g_idx"
    ]
    assert not torch.equal(g_idx, torch.arange(128, dtype=torch.int32) // 32)  # act order: permuted groups
    assert torch.equal(torch.bincount(g_idx), torch.full((4,), 32))


def test_gptq_beats_round_to_nearest_on_its_own_objective():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g) @ torch.randn(64, 64, generator=g)  # correlated input channels
    w = torch.randn(48, 64, generator=g) * 0.05
    grid = Grid(32)
    err = {name: (x @ (w - q.dequantize()).t()).pow(2).mean().item()
           for name, q in (("rtn", round_to_nearest(w, grid)), ("gptq", gptq(w, hessian(x), grid)))}  # fmt: skip
    assert err["gptq"] < 0.7 * err["rtn"]


# ---- refusals ------------------------------------------------------------------------------------


def edited(checkpoint: Path, tmp_path: Path, quant: dict | None = None, tensor: str | None = None) -> Path:
    out = tmp_path / "edited"
    shutil.copytree(checkpoint, out)
    if quant is not None:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"].update(quant)
        (out / "config.json").write_text(json.dumps(config))
    if tensor is not None:
        tensors = load_file(str(out / "model.safetensors"))
        tensors[tensor] = tensors[tensor][:, :-1].contiguous()
        save_file(tensors, str(out / "model.safetensors"))
    return out


def engine(path: Path, **kwargs) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", cpu_kv_cache_space=0.01, **kwargs)


@pytest.mark.parametrize(
    "quant,message",
    [
        ({"bits": 3}, r"unsupported quantization_config: bits=3"),
        ({"quant_method": "squeezellm"}, r"unsupported quantization method 'squeezellm'"),
        ({"version": "gemv"}, r"unsupported AWQ version 'gemv'"),
        ({"zero_point": False}, r"zero_point=false"),
    ],
)
def test_an_unsupported_quantization_config_is_named(quant, message, checkpoints, tmp_path):
    with pytest.raises(ValueError, match=message):
        engine(edited(checkpoints["awq"], tmp_path, quant=quant))


def test_a_mismatched_packed_shape_names_the_tensor(checkpoints, tmp_path):
    bad = edited(checkpoints["gptq_act"], tmp_path, tensor="model.layers.1.mlp.up_proj.scales")
    with pytest.raises(ValueError, match=r"cannot load model.layers.1.mlp.up_proj.scales: shape mismatch"):
        engine(bad)


def test_quantization_must_match_the_checkpoint(checkpoints, tiny):
    with pytest.raises(ValueError, match=r"quantization='awq', but .* is a dense checkpoint"):
        engine(tiny, quantization="awq")
    with pytest.raises(ValueError, match=r"quantization='gptq', but .* holds a AWQ checkpoint"):
        engine(checkpoints["awq"], quantization="gptq")
    with pytest.raises(ValueError, match=r"quantization='gguf' needs a .gguf file"):
        engine(tiny, quantization="gguf")


def test_the_cli_reports_a_dense_checkpoint_served_as_awq(tiny, capsys):
    assert main(["generate", "hi", "--model", str(tiny), "--device", "cpu", "--quantization", "awq"]) == 2
    assert "is a dense checkpoint" in capsys.readouterr().err


def test_quantize_refuses_options_its_format_lacks(tiny, tmp_path, capsys):
    assert (
        main(["quantize", "--model", str(tiny), "--out", str(tmp_path / "x"), "--method", "awq", "--sym"])
        == 2
    )
    assert "the AWQ format has no sym or desc_act" in capsys.readouterr().err
    assert main(["quantize", "--model", str(tiny), "--out", str(tmp_path / "y"), "--group-size", "48"]) == 2
    assert "group size must be a positive multiple of 32" in capsys.readouterr().err
    assert main(["quantize", "--model", str(tiny), "--out", str(tmp_path / "z"), "--lm-head"]) == 2
    assert "a quantized LM head needs --format gptq" in capsys.readouterr().err
    odd = tiny_random_model_dir(tmp_path, vocab_size=300)
    argv = ["quantize", "--model", str(odd), "--out", str(tmp_path / "w"), "--method", "rtn", "--lm-head"]
    assert main([*argv, "--group-size", "32"]) == 2
    assert "the vocabulary of 300 is not a multiple of 8" in capsys.readouterr().err


def test_dummy_weights_take_a_directorys_quantization_config(checkpoints):
    """load_format="dummy" on a directory: random weights in its shapes and its quantization, LM head
    included (how the benchmarks build an 8B shape with a quantized head)."""
    llm = engine(checkpoints["gptq_head"], load_format="dummy")
    model = llm.engine.runner.model
    assert type(model.lm_head).__name__ == "QuantizedLMHead"
    assert type(model.lm_head.quant_method).__name__ == "GPTQLinearMethod"
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match=r"quantization='awq', but .* declares GPTQ"):
        engine(checkpoints["gptq_head"], load_format="dummy", quantization="awq")


def test_every_command_that_builds_an_engine_takes_quantization():
    from serving.cli import build_parser
    from serving.serve import _argv

    parser = build_parser()
    for command in (["generate", "hi"], ["prefill"], ["decode"]):
        assert parser.parse_args([*command, "--quantization", "gptq"]).quantization == "gptq"
    args = parser.parse_args(["serve", "some/model", "--quantization", "awq"])
    assert _argv(args.worker_flags, args) == ["--quantization", "awq"]  # `serve` hands it to every worker


def test_qwen3_awq_checkpoint_with_norms_in_the_gemms_equals_transformers(tmp_path, monkeypatch):
    """Qwen3's per-head q and k norms sit between the qkv GEMM and RoPE, so that GEMM leaves RoPE and the KV-cache
    write to the attention: AWQ on the tiny Qwen3, served with each layer's norms in its int4 GEMMs, gives
    transformers' greedy tokens on the dequantized checkpoint."""
    import kernels.w4a16_mma as mma
    from engine.layers.quant.int4 import Int4Method

    dense = tiny_random_model_dir(tmp_path, "qwen3", vocab_size=304)
    argv = ["quantize", "--model", str(dense), "--out", str(tmp_path / "awq"), "--group-size", "32",
            "--calibration-tokens", "512", "--method", "awq"]  # fmt: skip
    assert main(argv) == 0
    expected = hf_greedy(dequantized_copy(tmp_path / "awq", tmp_path / "dq"), PROMPTS, [12] * len(PROMPTS))
    monkeypatch.setattr(Int4Method, "fuses_norms", lambda self, x: x.shape[0] <= 16)
    calls: list[tuple[bool, bool]] = []  # (took its norm, ended in RoPE) per fused GEMM
    reference = mma.w4a16_mma_reference
    monkeypatch.setattr(
        mma, "w4a16_mma_reference",
        lambda *a, **kw: calls.append((kw.get("norm") is not None, kw.get("rope") is not None))
        or reference(*a, **kw),
    )  # fmt: skip
    llm = LLM(str(tmp_path / "awq"), device="cpu", dtype="float32", cpu_kv_cache_space=0.01)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=12)
    )
    assert any(norm for norm, _ in calls), "no GEMM took its norm"
    assert not any(rope for _, rope in calls), "a qkv GEMM ended in RoPE before the per-head norms"
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def test_a_phi3_checkpoint_is_refused_by_name(tmp_path, capsys):
    phi3 = tiny_random_model_dir(tmp_path, "phi3")
    assert main(["quantize", "--model", str(phi3), "--out", str(tmp_path / "q"), "--group-size", "32"]) == 2
    assert "Phi-3's checkpoints fuse them" in capsys.readouterr().err
