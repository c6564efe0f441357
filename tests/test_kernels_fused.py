"""The fused per-layer kernels: Triton (under the interpreter) vs their torch references on small shapes,
and the references vs transformers' unfused ops.

Interpreter runs: fp32 and fp16 (the interpreter's bf16 casts are not the GPU's; tests/gpu covers bf16).
Outputs are poisoned with NaN first, so an unwritten element fails. The references must equal
transformers exactly in fp32: the CPU model's greedy output is compared with transformers'.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything here imports triton

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb
from triton.runtime.interpreter import InterpretedFunction

from engine.attention_metadata import AttentionMetadata
from engine.layers.rotary import RotaryEmbedding
from engine.model_config import ModelConfig
from engine.weights import load_model
from kernels import _backend
from kernels.fused_add_rmsnorm import (
    _rmsnorm_kernel,
    fused_add_rmsnorm_reference,
    fused_add_rmsnorm_triton,
    norm_input_reference,
    norm_input_triton,
    rms_norm_reference,
    rms_norm_triton,
)
from kernels.rotary_kv_write import HeadNorms, rotary_kv_write_reference, rotary_kv_write_triton
from kernels.silu_and_mul import silu_and_mul_reference, silu_and_mul_triton
from tests.hf_reference import tiny_random_model_dir

assert isinstance(_rmsnorm_kernel, InterpretedFunction), "run the CPU kernel tests under TRITON_INTERPRET=1"
DTYPES = [torch.float32, torch.float16]
# fp32: the same operations in the same order; fp16: the kernel keeps fp32 where the reference rounds
TOL = {torch.float32: {"rtol": 1e-6, "atol": 1e-6}, torch.float16: {"rtol": 2e-3, "atol": 2e-3}}
NORM_SHAPES = [(1, 64), (7, 100), (33, 576), (257, 128), (3, 4096)]  # (num_tokens, hidden)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


# ---- RMSNorm, with and without the residual add --------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", NORM_SHAPES)
def test_rms_norm(num_tokens, hidden, dtype):
    x = torch.randn(num_tokens, hidden, dtype=dtype)
    weight = torch.rand(hidden, dtype=dtype) + 0.5
    out = rms_norm_triton(x, weight, 1e-6, out=nan_like(x))
    torch.testing.assert_close(out, rms_norm_reference(x, weight, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", NORM_SHAPES)
def test_fused_add_rmsnorm_in_place(num_tokens, hidden, dtype):
    x, residual = torch.randn(num_tokens, hidden, dtype=dtype), torch.randn(num_tokens, hidden, dtype=dtype)
    weight = torch.rand(hidden, dtype=dtype) + 0.5
    want_x, want_residual = fused_add_rmsnorm_reference(x.clone(), residual.clone(), weight, 1e-5)
    got_x, got_residual = fused_add_rmsnorm_triton(x, residual, weight, 1e-5)
    assert got_x is x and got_residual is residual, "fused_add_rmsnorm works in place"
    assert torch.equal(got_residual, want_residual), "the add rounds once, as the unfused add does"
    torch.testing.assert_close(got_x, want_x, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "choices", "hidden", "order"), [(1, 8, 64, 0), (7, 2, 100, 0), (3, 4, 512, 64)]
)
def test_fused_add_rmsnorm_sums_a_moe_layers_choices_first(num_tokens, choices, hidden, order, dtype):
    """x (T, K, H), a MoE layer's weighted choices: summed in fp32 in choice order and rounded once, then added and
    normed; the residual bit for bit the unfused sum-then-add's, the normed rows a new tensor (in the wgmma K order
    where asked), x itself untouched."""
    from kernels.fused_add_rmsnorm import sum_choices_reference

    x = torch.randn(num_tokens, choices + 1, hidden, dtype=dtype)[:, 1:]  # the choices of a wider buffer
    residual = torch.randn(num_tokens, hidden, dtype=dtype)
    weight = torch.rand(hidden, dtype=dtype) + 0.5
    summed = sum_choices_reference(x)
    want_x, want_residual = fused_add_rmsnorm_reference(summed.clone(), residual.clone(), weight, 1e-5, order)
    ref_x, ref_residual = fused_add_rmsnorm_reference(x.clone(), residual.clone(), weight, 1e-5, order)
    assert torch.equal(ref_x, want_x) and torch.equal(ref_residual, want_residual)
    before = x.clone()
    got_x, got_residual = fused_add_rmsnorm_triton(x, residual, weight, 1e-5, order)
    assert got_residual is residual and got_x.shape == (num_tokens, hidden) and torch.equal(x, before)
    assert torch.equal(got_residual, want_residual), "the sum and the add round as the unfused kernels do"
    torch.testing.assert_close(got_x, want_x, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (5, 576), (3, 4096), (2, 48)])
def test_norm_input(num_tokens, hidden, dtype):
    """An RMSNorm's input as the int4 GEMMs take it: weight * h rounded once (exact), and the sums of squares
    of each 16 columns, for each row of a wider buffer."""
    h = torch.randn(num_tokens, hidden + 32, dtype=dtype)[:, :hidden]
    weight = torch.rand(hidden, dtype=dtype) + 0.5
    x, sumsq = norm_input_triton(h, weight)
    want_x, want_sumsq = norm_input_reference(h, weight)
    assert torch.equal(x, want_x) and sumsq.shape == (num_tokens, hidden // 16)
    torch.testing.assert_close(sumsq, want_sumsq, rtol=1e-6, atol=1e-6)
    norm = rms_norm_reference(h, weight, 1e-6).float()
    rstd = torch.rsqrt(sumsq.sum(-1, keepdim=True) / hidden + 1e-6)
    torch.testing.assert_close(x.float() * rstd, norm, **TOL[torch.float16])  # the norm, rounded elsewhere


@pytest.mark.parametrize("order", [64, 128])
def test_norms_write_the_wgmma_gemms_k_order(order):
    """order=chunk: the normed row in the fragment layout's K order (kernels/int4_dequant.py: layout_column), the same
    values as the plain kernel's, read through layout_order; fused, in place, the residual still in column order.
    layout_column, layout_order and the wgmma kernel's chunk_order agree."""
    from kernels.int4_dequant import layout_column, layout_order
    from kernels.w4a16_wgmma import chunk_order

    hidden = 512
    perm = layout_order(hidden, order, torch.device("cpu"))
    assert torch.equal(perm, chunk_order(hidden, order, torch.device("cpu")))
    assert torch.equal(torch.sort(perm).values, torch.arange(hidden)) and not torch.equal(
        perm, torch.arange(hidden)
    )
    assert torch.equal(torch.tensor([int(layout_column(p, order)) for p in range(hidden)]), perm)
    x, residual = torch.randn(5, hidden, dtype=torch.float16), torch.randn(5, hidden, dtype=torch.float16)
    weight = torch.rand(hidden, dtype=torch.float16) + 0.5
    plain = rms_norm_triton(x, weight, 1e-6)
    assert torch.equal(rms_norm_triton(x, weight, 1e-6, order=order), plain[:, perm])
    assert torch.equal(
        rms_norm_reference(x, weight, 1e-6, order=order), rms_norm_reference(x, weight, 1e-6)[:, perm]
    )
    want_x, want_residual = fused_add_rmsnorm_triton(x.clone(), residual.clone(), weight, 1e-5)
    got_x, got_residual = fused_add_rmsnorm_triton(x, residual, weight, 1e-5, order)
    assert got_x is x and torch.equal(got_x, want_x[:, perm]) and torch.equal(got_residual, want_residual)
    ref_x, ref_residual = fused_add_rmsnorm_reference(x.clone(), residual.clone(), weight, 1e-5, order)
    torch.testing.assert_close(ref_x, fused_add_rmsnorm_reference(
        x.clone(), residual.clone(), weight, 1e-5)[0][:, perm], rtol=0, atol=0)  # fmt: skip


def test_rms_norm_strided_rows():
    """Rows of a wider buffer (a view, stride > hidden) read and written where they are."""
    buf = torch.randn(9, 200)
    x, weight = buf[:, :128], torch.rand(128) + 0.5
    out = rms_norm_triton(x, weight, 1e-6, out=nan_like(buf)[:, 64:192])
    torch.testing.assert_close(out, rms_norm_reference(x, weight, 1e-6), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_rms_norm_references_equal_transformers(dtype):
    hf = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    hf.weight.data = torch.rand(576).to(dtype) + 0.5
    x, residual = torch.randn(13, 576, dtype=dtype), torch.randn(13, 576, dtype=dtype)
    assert torch.equal(rms_norm_reference(x, hf.weight, 1e-5), hf(x))
    normed, new_residual = fused_add_rmsnorm_reference(x.clone(), residual.clone(), hf.weight, 1e-5)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(normed, hf(x + residual))


# ---- SiLU-and-mul ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,d", [(1, 64), (5, 100), (257, 32), (3, 1536), (2, 2500)])
def test_silu_and_mul(num_tokens, d, dtype):
    x = torch.randn(num_tokens, 2 * d, dtype=dtype) * 3
    out = silu_and_mul_triton(x, out=nan_like(x[:, :d]))
    torch.testing.assert_close(out, silu_and_mul_reference(x), **TOL[dtype])


@pytest.mark.parametrize("order", [64, 128])
def test_silu_and_mul_writes_the_wgmma_gemms_k_order(order):
    """order=chunk: the activation in the fragment layout's K order, the plain kernel's values read through
    layout_order, over several programs' blocks; the reference alike."""
    from kernels.int4_dequant import layout_order

    d = 1536
    perm = layout_order(d, order, torch.device("cpu"))
    x = torch.randn(3, 2 * d, dtype=torch.float16) * 3
    assert torch.equal(silu_and_mul_triton(x, order=order), silu_and_mul_triton(x)[:, perm])
    assert torch.equal(silu_and_mul_reference(x, order), silu_and_mul_reference(x)[:, perm])


def test_silu_and_mul_strided_rows():
    x = torch.randn(7, 2 * 96 + 40)[:, : 2 * 96]
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_reference(x), **TOL[torch.float32])


def test_silu_and_mul_reference_equals_transformers_mlp_activation():
    gate, up = torch.randn(11, 300), torch.randn(11, 300)
    want = torch.nn.SiLU()(gate) * up  # on a contiguous gate: torch's vector and scalar silu differ in a bit
    torch.testing.assert_close(silu_and_mul_reference(torch.cat([gate, up], dim=-1)), want, rtol=0, atol=1e-6)


# ---- rotary embedding + KV-cache write ------------------------------------------------------------

# (num_heads, num_kv_heads, head_dim): GQA 1, 3, 4, 8; head_dim 64 and 128
ROPE_HEADS = [(4, 4, 64), (6, 2, 64), (8, 2, 128), (8, 1, 64)]
BLOCK_SIZE, NUM_BLOCKS, MAX_POS = 16, 20, 512


def qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    """q, k, v as the model produces them: strided views of one fused projection output."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    shape = (num_tokens, -1, head_dim)
    return q.view(shape), k.view(shape), v.view(shape)


def rope_inputs(num_tokens: int, head_dim: int, dtype: torch.dtype):
    cache = RotaryEmbedding(head_dim, 10000.0, MAX_POS).cos_sin_cache(dtype, torch.device("cpu"))
    positions = torch.randint(0, MAX_POS, (num_tokens,))
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:num_tokens]
    slots[::3] = -1  # skipped rows: q still rotates, nothing is written
    return positions, cache, slots


def run_both(q, k, v, positions, cache, slots, head_norms=None, **kwargs):
    """(q, kv_cache) from the kernel and from the reference; the caches start NaN-poisoned."""
    kv_shape = (2, NUM_BLOCKS, BLOCK_SIZE, k.shape[1], k.shape[2])
    kv_ref, kv_got = (
        torch.full(kv_shape, float("nan"), dtype=q.dtype),
        torch.full(kv_shape, float("nan"), dtype=q.dtype),
    )
    q_ref = rotary_kv_write_reference(q.clone(), k, v, positions, cache, kv_ref, slots, head_norms=head_norms)
    q_got = rotary_kv_write_triton(q, k, v, positions, cache, kv_got, slots, head_norms=head_norms, **kwargs)
    return (q_got, kv_got), (q_ref, kv_ref)


@pytest.mark.parametrize("kv_heads_per_program", [1, 2, None])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", ROPE_HEADS, ids=str)
def test_rotary_kv_write(num_heads, num_kv_heads, head_dim, kv_heads_per_program):
    q, k, v = qkv_views(7, num_heads, num_kv_heads, head_dim, torch.float32)
    positions, cache, slots = rope_inputs(7, head_dim, torch.float32)
    (q_got, kv_got), (q_ref, kv_ref) = run_both(
        q, k, v, positions, cache, slots, kv_heads_per_program=kv_heads_per_program
    )
    assert q_got is q, "q is rotated in place"
    torch.testing.assert_close(q_got, q_ref, **TOL[torch.float32])
    torch.testing.assert_close(kv_got, kv_ref, equal_nan=True, **TOL[torch.float32])
    assert not kv_got[1].flatten(0, 1)[slots[slots >= 0]].isnan().any(), "every kept row's v written"


@pytest.mark.parametrize("num_tokens,dtype", [(1, torch.float16), (257, torch.float32), (33, torch.float16)])
def test_rotary_kv_write_token_counts_and_dtypes(num_tokens, dtype):
    """Odd token counts, both program layouts (below and above the interpreter's 8 'SMs'), fp16."""
    q, k, v = qkv_views(num_tokens, 6, 2, 64, dtype)
    positions, cache, slots = rope_inputs(num_tokens, 64, dtype)
    (q_got, kv_got), (q_ref, kv_ref) = run_both(q, k, v, positions, cache, slots)
    torch.testing.assert_close(q_got, q_ref, **TOL[dtype])
    torch.testing.assert_close(kv_got, kv_ref, equal_nan=True, **TOL[dtype])


@pytest.mark.parametrize(
    "num_tokens,dtype,kv_heads_per_program",
    [(7, torch.float32, 1), (9, torch.float32, None), (33, torch.float16, 2)],
)
def test_rotary_kv_write_with_head_norms(num_tokens, dtype, kv_heads_per_program):
    """Qwen3's q_norm and k_norm in the same launch: each q and k head RMS-normed (RMSNorm's reference over
    (tokens * heads, head_dim) rows, which tests below hold to transformers), then rotated; v as it is."""
    q, k, v = qkv_views(num_tokens, 8, 2, 64, dtype)
    q_before, k_before, v_before = q.clone(), k.clone(), v.clone()
    positions, cache, slots = rope_inputs(num_tokens, 64, dtype)
    norms = HeadNorms((torch.rand(64) + 0.5).to(dtype), (torch.rand(64) + 0.5).to(dtype), 1e-6)
    (q_got, kv_got), (q_ref, kv_ref) = run_both(
        q, k, v, positions, cache, slots, head_norms=norms, kv_heads_per_program=kv_heads_per_program
    )
    assert q_got is q and torch.equal(k, k_before) and torch.equal(v, v_before), (
        "q in place, k and v untouched"
    )
    torch.testing.assert_close(q_got, q_ref, **TOL[dtype])
    torch.testing.assert_close(kv_got, kv_ref, equal_nan=True, **TOL[dtype])
    unnormed = rotary_kv_write_reference(q_before, k, v, positions, cache, kv_ref.clone(), slots)
    assert not torch.allclose(unnormed, q_ref, atol=0.1), "the norms change q"


def test_rotary_kv_write_to_output_leaves_q():
    q, k, v = qkv_views(5, 8, 2, 64, torch.float32)
    q_before = q.clone()
    positions, cache, slots = rope_inputs(5, 64, torch.float32)
    kv = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 64)
    out = rotary_kv_write_triton(q, k, v, positions, cache, kv, slots, q_out=nan_like(q_before))
    assert torch.equal(q, q_before)
    torch.testing.assert_close(
        out,
        rotary_kv_write_reference(q.clone(), k, v, positions, cache, kv.clone(), slots),
        **TOL[torch.float32],
    )


def hf_config(head_dim: int, rope: str) -> LlamaConfig:
    common = {"hidden_size": 4 * head_dim, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": head_dim, "max_position_embeddings": 4096, "intermediate_size": 64}  # fmt: skip
    if rope == "default":
        return LlamaConfig(**common, rope_theta=500000.0)
    scaling = {
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 256},
        "linear": {"rope_type": "linear", "factor": 4.0},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        "yarn_mscale": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 24, "truncate": False},
    }[rope]  # fmt: skip
    return LlamaConfig(**common, rope_parameters={**scaling, "rope_theta": 500000.0})


@pytest.mark.parametrize("rope", ["default", "llama3", "linear", "yarn", "yarn_mscale"])
@pytest.mark.parametrize("head_dim", [64, 128])
@torch.no_grad()
def test_rotary_reference_equals_transformers(head_dim, rope):
    """Our cache (the model's RotaryEmbedding from the parsed config) and rotation vs transformers'."""
    hf = hf_config(head_dim, rope)
    config = ModelConfig.from_dict({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]})
    assert (config.rope_scaling is None) == (rope == "default")
    assert ModelConfig.from_dict(config.to_hf_dict()) == config
    ours = RotaryEmbedding(head_dim, config.rope_theta, config.max_position_embeddings, config.rope_scaling)
    positions = torch.tensor([0, 1, 17, 255, 256, 1000, 4095])
    q, k, v = qkv_views(len(positions), 4, 2, head_dim, torch.float32)
    cos, sin = LlamaRotaryEmbedding(hf)(q, positions[None])  # each (1, num_tokens, head_dim)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos[0], sin[0], unsqueeze_dim=1)
    kv = torch.zeros(2, 1, 8, 2, head_dim)
    slots = torch.arange(len(positions))
    got_q = rotary_kv_write_reference(
        q.clone(), k, v, positions, ours.cos_sin_cache(torch.float32, q.device), kv, slots
    )
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=1e-6)  # cos/sin may differ in the last ulp
    torch.testing.assert_close(kv[0].flatten(0, 1)[: len(positions)], want_k, rtol=0, atol=1e-6)
    assert torch.equal(kv[1].flatten(0, 1)[: len(positions)], v)


# ---- the model on the fused kernels ---------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama3_scaled"])
@torch.no_grad()
def test_tiny_model_triton_path_equals_torch_path(arch, tmp_path, monkeypatch):
    """A prefill then two decode steps through the whole model (fused kernels, in-place norms, attention
    reading the cache the fused RoPE wrote): the interpreted Triton path gives the torch path's logits."""
    model, config = load_model(tiny_random_model_dir(tmp_path, arch))
    steps = [([9], [9], 0), ([1], [10], 9), ([1], [11], 10)]  # (query_lens, seq_lens, first position)
    ids = torch.randint(0, config.vocab_size, (11,))
    logits = {}
    for backend in ("torch", "triton"):
        monkeypatch.setattr(_backend, "FORCED_BACKEND", backend)
        kv = torch.zeros(config.num_hidden_layers, 2, 4, 4, config.num_key_value_heads, config.head_dim)
        rows = []
        for q_lens, s_lens, start in steps:
            meta = AttentionMetadata.build(q_lens, s_lens, [[2, 0, 3]], block_size=4)
            positions = torch.arange(start, start + q_lens[0])
            rows.append(model.compute_logits(model(ids[positions], positions, meta, kv)))
        logits[backend] = torch.cat(rows)
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=1e-4, atol=1e-4)
