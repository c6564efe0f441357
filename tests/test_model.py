"""The model against transformers: same weights, same logits (fp32, CPU, 1e-4 abs), through the paged cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention_metadata import AttentionMetadata
from engine.model import LlamaForCausalLM
from engine.weights import load_model
from tests.hf_reference import hf_greedy, hf_logits, tiny_random_model_dir

ATOL = 1e-4
TINY_ARCHS = ["llama", "qwen2", "qwen3", "phi3", "llama3_scaled", "mixtral", "qwen2_moe", "qwen3_moe"]


def new_kv_cache(model: LlamaForCausalLM, num_blocks: int, block_size: int) -> torch.Tensor:
    c = model.config
    return torch.zeros(c.num_hidden_layers, 2, num_blocks, block_size, c.num_key_value_heads, c.head_dim)


@torch.no_grad()
def step(
    model: LlamaForCausalLM,
    kv: torch.Tensor,
    chunks: list[
        tuple[list[int], int, list[int]]
    ],  # per sequence: (new token ids, tokens cached before, block table)
) -> list[torch.Tensor]:
    """One forward over a flattened batch; returns each sequence's logits rows, (q_len, vocab)."""
    ids = [t for new, _, _ in chunks for t in new]
    positions = [cached + i for new, cached, _ in chunks for i in range(len(new))]
    meta = AttentionMetadata.build(
        [len(new) for new, _, _ in chunks], [cached + len(new) for new, cached, _ in chunks],
        [table for _, _, table in chunks], kv.shape[3],
    )  # fmt: skip
    logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(positions), meta, kv))
    return list(logits.split([len(new) for new, _, _ in chunks]))


def prefill_then_decode(
    model: LlamaForCausalLM, ids: list[int], split: int, table: list[int], block_size: int
):
    """Logits for every position: prefill ids[:split], then one token per step."""
    kv = new_kv_cache(model, max(table) + 1, block_size)
    rows = step(model, kv, [(ids[:split], 0, table)])
    rows += [step(model, kv, [([ids[i]], i, table)])[0] for i in range(split, len(ids))]
    return torch.cat(rows)


@pytest.fixture(scope="module", params=TINY_ARCHS)
def tiny(request, tmp_path_factory) -> tuple[Path, LlamaForCausalLM]:
    model_dir = tiny_random_model_dir(tmp_path_factory.mktemp("tiny"), request.param)
    model, _ = load_model(model_dir)
    return model_dir, model


def tiny_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 297, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_tiny_prefill_matches_transformers(tiny):
    model_dir, model = tiny
    ids = tiny_prompt(45, seed=1)
    kv = new_kv_cache(model, 16, 4)
    (ours,) = step(model, kv, [(ids, 0, [9, 2, 14, 0, 7, 11, 3, 5, 13, 1, 8, 4])])
    torch.testing.assert_close(ours, hf_logits(model_dir, ids), atol=ATOL, rtol=0)


def test_tiny_decode_matches_transformers(tiny):
    model_dir, model = tiny
    ids = tiny_prompt(30, seed=2)
    ours = prefill_then_decode(model, ids, split=7, table=[5, 0, 9, 2, 7, 3, 8, 1], block_size=4)
    torch.testing.assert_close(ours, hf_logits(model_dir, ids), atol=ATOL, rtol=0)


def test_tiny_mixed_batch_matches_transformers(tiny):
    """Prefill, chunked prefill over a cached prefix, and decode, flattened into the same forward passes."""
    model_dir, model = tiny
    a, b = tiny_prompt(13, seed=3), tiny_prompt(21, seed=4)
    ta, tb = [6, 1, 10, 4], [3, 11, 0, 8, 2, 9]
    kv = new_kv_cache(model, 12, 4)
    a_rows, b_rows = step(model, kv, [(a[:12], 0, ta), (b[:8], 0, tb)])
    b_rows2, a_rows2 = step(model, kv, [(b[8:], 8, tb), ([a[12]], 12, ta)])
    torch.testing.assert_close(torch.cat([a_rows, a_rows2]), hf_logits(model_dir, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([b_rows, b_rows2]), hf_logits(model_dir, b), atol=ATOL, rtol=0)


def test_compute_logits_is_float32_for_bf16_models(tiny):
    model_dir, _ = tiny
    model, _ = load_model(model_dir, dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = tiny_prompt(9, seed=5)
    (logits,) = step(model, new_kv_cache(model, 4, 4).bfloat16(), [(ids, 0, [2, 0, 3])])
    assert logits.dtype == torch.float32
    assert (logits.argmax(-1) == hf_logits(model_dir, ids).argmax(-1)).float().mean() > 0.5


# ---- the bundled SmolLM2-135M-Instruct -------------------------------------------------------------

BUNDLED_TABLE = [6, 1, 11, 3]  # block_size 16: 64 slots, deliberately out of order


@pytest.fixture(scope="module")
def bundled(bundled_model_dir):
    model, _ = load_model(bundled_model_dir)
    return model


@pytest.fixture(scope="module")
def prompt50(bundled_model_dir) -> list[int]:
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(bundled_model_dir)
    messages = [
        {
            "role": "user",
            "content": "Name three rivers in Europe; for each, say which sea it flows into and one city on its banks.",
        }
    ]
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert 45 <= len(ids) <= 55
    return ids


@pytest.mark.slow
def test_bundled_prefill_matches_transformers(bundled, bundled_model_dir, hf_bundled, prompt50):
    kv = new_kv_cache(bundled, 12, 16)
    (ours,) = step(bundled, kv, [(prompt50, 0, BUNDLED_TABLE)])
    torch.testing.assert_close(ours, hf_logits(bundled_model_dir, prompt50), atol=ATOL, rtol=0)


@pytest.mark.slow
def test_bundled_decode_matches_transformers(bundled, bundled_model_dir, hf_bundled, prompt50):
    ours = prefill_then_decode(bundled, prompt50, split=30, table=BUNDLED_TABLE, block_size=16)
    torch.testing.assert_close(ours, hf_logits(bundled_model_dir, prompt50), atol=ATOL, rtol=0)


@pytest.mark.slow
def test_bundled_answers_sensibly(bundled, bundled_model_dir, hf_bundled):
    """Logit equality cannot catch a wrong GGUF q/k un-permutation (both sides load our conversion); a right answer can."""
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(bundled_model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    kv, table, out = new_kv_cache(bundled, 4, 16), [2, 0, 3, 1], []
    logits = step(bundled, kv, [(ids, 0, table)])[0][-1]
    while len(out) < 12 and (not out or out[-1] not in tok.eos_token_ids):
        out.append(int(logits.argmax()))
        logits = step(bundled, kv, [([out[-1]], len(ids) + len(out) - 1, table)])[0][-1]
    assert "Paris" in tok.decode(out)
    assert out == hf_greedy(bundled_model_dir, [ids], [12])[0]


# ---- dummy weights ---------------------------------------------------------------------------------


def test_dummy_smollm2_shapes_and_forward():
    model, config = load_model("SmolLM2-135M", load_format="dummy")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # the real model's count (tied)
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == ((9 + 2 * 3) * 64, 576)
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 1536, 576)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert float(model.model.norm.weight.min()) == 1.0
    (logits,) = step(model, new_kv_cache(model, 2, 16), [([1, 2, 3], 0, [1])])
    assert logits.shape == (3, 49152) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("Llama-3-8B", 8_030_261_248),
        ("Qwen2.5-7B", 7_615_616_512),
        ("Qwen3-8B", 8_190_735_360),
        ("Qwen3-30B-A3B", 30_532_122_624),
        ("Mixtral-8x7B", 46_702_792_704),
        ("Phi-4", 14_659_507_200),
    ],
)
def test_dummy_big_shapes_on_meta(name, params):
    model, config = load_model(name, load_format="dummy", device="meta", dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == params  # the real models' counts
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert (model.model.layers[0].self_attn.qkv_proj.bias is not None) == config.attention_bias


def test_dummy_weights_are_seeded(tiny):
    model_dir, _ = tiny
    a, _ = load_model(model_dir, load_format="dummy")
    b, _ = load_model(model_dir, load_format="dummy")
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name


# ---- tensor-parallel weight sharding (the loaders only; no process group needed) -------------------


def test_tensor_parallel_shards_reassemble():
    from engine.layers import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    def load(layer, weight, shard_id=None):
        layer.weight.weight_loader(layer.weight, weight, shard_id)
        return layer.weight.data

    w = torch.randn(8, 6)
    col = [load(ColumnParallelLinear(6, 8, tp_rank=r, tp_size=2), w) for r in (0, 1)]
    row = [load(RowParallelLinear(6, 8, tp_rank=r, tp_size=2), w) for r in (0, 1)]
    emb = [load(VocabParallelEmbedding(8, 6, tp_rank=r, tp_size=2), w) for r in (0, 1)]
    # a vocabulary that does not divide: ceil(8 / 3) = 3 rows a rank, the last rank's third row zero
    padded = [load(VocabParallelEmbedding(8, 6, tp_rank=r, tp_size=3), w) for r in (0, 1, 2)]
    assert torch.equal(torch.cat(padded)[:8], w) and not torch.cat(padded)[8:].any()
    assert (
        torch.equal(torch.cat(col), w)
        and torch.equal(torch.cat(row, 1), w)
        and torch.equal(torch.cat(emb), w)
    )

    gate, up = torch.randn(8, 6), torch.randn(8, 6)
    for r in (0, 1):
        merged = MergedColumnParallelLinear(6, [8, 8], tp_rank=r, tp_size=2)
        load(merged, gate, 0), load(merged, up, 1)
        assert torch.equal(merged.weight, torch.cat([gate[4 * r : 4 * r + 4], up[4 * r : 4 * r + 4]]))

    head = 3  # 4 q heads, 2 kv heads: rank r holds q heads 2r, 2r+1 and kv head r
    q, k, v = torch.randn(4 * head, 6), torch.randn(2 * head, 6), torch.randn(2 * head, 6)
    for r in (0, 1):
        qkv = QKVParallelLinear(6, head, 4, 2, tp_rank=r, tp_size=2)
        load(qkv, q, "q"), load(qkv, k, "k"), load(qkv, v, "v")
        expected = [
            q[2 * head * r : 2 * head * (r + 1)],
            k[head * r : head * (r + 1)],
            v[head * r : head * (r + 1)],
        ]
        assert torch.equal(qkv.weight, torch.cat(expected))
    # 4 q heads, 1 kv head over 2 ranks: each rank holds 2 q heads and a copy of the kv head they read
    for r in (0, 1):
        qkv = QKVParallelLinear(6, head, 4, 1, tp_rank=r, tp_size=2)
        load(qkv, q, "q"), load(qkv, k[:head], "k"), load(qkv, v[:head], "v")
        assert torch.equal(qkv.weight, torch.cat([q[2 * head * r : 2 * head * (r + 1)], k[:head], v[:head]]))
    with pytest.raises(
        ValueError, match=r"num_key_value_heads \(4\) is not divisible by tensor_parallel_size 3"
    ):
        QKVParallelLinear(6, head, 6, 4, tp_size=3)
    with pytest.raises(ValueError, match=r"exceeds num_key_value_heads \(2\) and is not a multiple"):
        QKVParallelLinear(6, head, 6, 2, tp_size=3)
