"""The fused per-layer kernels (RMSNorm + residual, RoPE + KV write, SiLU-and-mul) on the GPU.

Each Triton kernel against its torch reference over many shapes and bf16/fp16/fp32. The norm and
the activation reproduce the reference's roundings, so they are compared in the same dtype (one
ulp of slack: rsqrt/exp and the summation order differ); the rotation keeps fp32 where the
reference rounds each product, so it is compared with the reference on fp32 upcasts. Outputs and
caches are NaN-poisoned first. Then the model's forward with these kernels inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention_metadata import AttentionMetadata
from engine.layers.rotary import RotaryEmbedding
from engine.model_config import Llama3RopeScaling
from engine.weights import load_model
from kernels import _backend
from kernels.fused_add_rmsnorm import (
    fused_add_rmsnorm_reference,
    fused_add_rmsnorm_triton,
    rms_norm_reference,
    rms_norm_triton,
)
from kernels.rotary_kv_write import HeadNorms, rotary_kv_write_reference, rotary_kv_write_triton
from kernels.silu_and_mul import silu_and_mul_reference, silu_and_mul_triton

DEV = "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SAME_DTYPE_TOL = {
    torch.bfloat16: {"rtol": 2.5e-2, "atol": 1e-2},  # two ulps: the roundings compound once
    torch.float16: {"rtol": 3e-3, "atol": 1e-3},
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
}
ROPE_BOUND = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-6}  # ||out - ref|| / ||ref||
TOKENS = [1, 3, 64, 131, 257, 4096]
HIDDEN = [64, 100, 576, 1000, 2048, 3584, 4096, 5120, 8192]


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_rms_norm_and_fused_add(hidden, num_tokens, dtype):
    x = torch.randn(num_tokens, hidden, device=DEV, dtype=dtype)
    residual = torch.randn(num_tokens, hidden, device=DEV, dtype=dtype)
    weight = torch.rand(hidden, device=DEV, dtype=dtype) + 0.5
    out = rms_norm_triton(x, weight, 1e-5, out=nan_like(x))
    torch.testing.assert_close(out, rms_norm_reference(x, weight, 1e-5), **SAME_DTYPE_TOL[dtype])
    want_x, want_r = fused_add_rmsnorm_reference(x.clone(), residual.clone(), weight, 1e-5)
    got_x, got_r = fused_add_rmsnorm_triton(x, residual, weight, 1e-5)
    assert got_x is x and got_r is residual
    assert torch.equal(got_r, want_r), "the residual add rounds as torch's add does"
    torch.testing.assert_close(got_x, want_x, **SAME_DTYPE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "choices", "hidden"), [(1, 8, 2048), (7, 2, 4096), (300, 8, 2048)])
def test_fused_add_rmsnorm_sums_moe_choices(num_tokens, choices, hidden, dtype):
    """A MoE layer's (T, K, H) weighted choices summed (fp32, choice order, rounded once) before the add: the
    residual bit for bit the unfused sum-then-add's (Qwen3-30B-A3B's and Mixtral's shapes)."""
    from kernels.fused_add_rmsnorm import sum_choices_reference

    x = torch.randn(num_tokens, choices, hidden, device=DEV, dtype=dtype)
    residual = torch.randn(num_tokens, hidden, device=DEV, dtype=dtype)
    weight = torch.rand(hidden, device=DEV, dtype=dtype) + 0.5
    want_x, want_r = fused_add_rmsnorm_reference(sum_choices_reference(x), residual.clone(), weight, 1e-5)
    got_x, got_r = fused_add_rmsnorm_triton(x, residual, weight, 1e-5)
    assert got_r is residual and torch.equal(got_r, want_r), "the sum and the add round as the unfused ones"
    torch.testing.assert_close(got_x, want_x, **SAME_DTYPE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 257, 2048])
@pytest.mark.parametrize("d", [64, 100, 1536, 8960, 14336])
def test_silu_and_mul(d, num_tokens, dtype):
    x = torch.randn(num_tokens, 2 * d, device=DEV, dtype=dtype) * 3
    out = silu_and_mul_triton(x, out=nan_like(x[:, :d]))
    torch.testing.assert_close(out, silu_and_mul_reference(x), **SAME_DTYPE_TOL[dtype])


@pytest.mark.parametrize("order", [64, 128])
@pytest.mark.parametrize("hidden,num_tokens", [(4096, 200), (14336, 40), (640, 3)])
def test_norms_and_activation_write_the_wgmma_gemms_k_order(hidden, num_tokens, order):
    """order=chunk, one to 16 warps a row: the normed rows (in place too, where a position is written by another thread
    than the one that read its column) and the activation in the fragment layout's K order are the plain kernels'
    values read through layout_order, bit for bit; the residual is the plain add's."""
    from kernels.int4_dequant import layout_order

    perm = layout_order(hidden, order, torch.device(DEV))
    x = torch.randn(num_tokens, hidden, device=DEV, dtype=torch.bfloat16)
    residual = torch.randn(num_tokens, hidden, device=DEV, dtype=torch.bfloat16)
    weight = torch.rand(hidden, device=DEV, dtype=torch.bfloat16) + 0.5
    assert torch.equal(
        rms_norm_triton(x, weight, 1e-5, order=order), rms_norm_triton(x, weight, 1e-5)[:, perm]
    )
    y = x.clone()
    assert torch.equal(
        rms_norm_triton(y, weight, 1e-5, out=y, order=order), rms_norm_triton(x, weight, 1e-5)[:, perm]
    )
    want_x, want_r = fused_add_rmsnorm_triton(x.clone(), residual.clone(), weight, 1e-5)
    got_x, got_r = fused_add_rmsnorm_triton(x, residual, weight, 1e-5, order)
    assert torch.equal(got_x, want_x[:, perm]) and torch.equal(got_r, want_r)
    act = torch.randn(num_tokens, 2 * hidden, device=DEV, dtype=torch.bfloat16) * 3
    assert torch.equal(silu_and_mul_triton(act, order=order), silu_and_mul_triton(act)[:, perm])


def test_silu_and_mul_strided_rows():
    x = torch.randn(33, 2 * 1536 + 64, device=DEV, dtype=torch.bfloat16)[:, : 2 * 1536]
    torch.testing.assert_close(
        silu_and_mul_triton(x), silu_and_mul_reference(x), **SAME_DTYPE_TOL[torch.bfloat16]
    )


# (num_heads, num_kv_heads, head_dim): Llama-3-8B, SmolLM2 (GQA 3), MHA, GQA 4 at 128, GQA 8
ROPE_HEADS = [(32, 8, 128), (9, 3, 64), (4, 4, 64), (16, 4, 128), (8, 1, 128)]
LLAMA31 = Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
MAX_POS = 131072


def rope_case(num_tokens, heads, block_size, dtype, scaling):
    num_heads, num_kv_heads, head_dim = heads
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEV, dtype=dtype)
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split(sizes, dim=-1))
    rope = RotaryEmbedding(head_dim, 500000.0, MAX_POS, scaling)
    cache = rope.cos_sin_cache(dtype, torch.device(DEV))
    positions = torch.randint(0, MAX_POS, (num_tokens,), device=DEV)
    num_blocks = -(-2 * num_tokens // block_size)
    slots = torch.randperm(num_blocks * block_size, device=DEV)[:num_tokens]
    slots[1::4] = -1
    kv_cache = torch.full(
        (2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), device=DEV, dtype=dtype
    )
    return q, k, v, positions, cache, kv_cache, slots


def check_rope(q, k, v, positions, cache, kv_cache, slots, q_before, dtype):
    kv_ref = kv_cache.float().clone()
    kv_ref.fill_(float("nan"))
    q_ref = rotary_kv_write_reference(
        q_before.float(), k.float(), v.float(), positions, cache.float(), kv_ref, slots
    )
    assert rel_err(q, q_ref) < ROPE_BOUND[dtype]
    kept = slots >= 0
    rows = kv_cache.flatten(1, 2)[:, slots[kept]]  # (2, kept, num_kv_heads, head_dim)
    ref_rows = kv_ref.flatten(1, 2)[:, slots[kept]]
    assert not rows.isnan().any(), "a kept token's k or v was not written"
    assert rel_err(rows[0], ref_rows[0]) < ROPE_BOUND[dtype]
    assert torch.equal(rows[1], v[kept]), "v is copied exactly"
    assert kv_cache.isnan().sum() == kv_cache.numel() - rows.numel(), "a skipped slot was written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("heads", ROPE_HEADS, ids=str)
def test_rotary_kv_write(heads, num_tokens, block_size, dtype):
    case = rope_case(num_tokens, heads, block_size, dtype, LLAMA31)
    q_before = case[0].clone()
    rotary_kv_write_triton(*case)
    check_rope(*case, q_before, dtype)


@pytest.mark.parametrize("kv_heads_per_program", [1, 3, 8])
@pytest.mark.parametrize("scaling", [None, LLAMA31], ids=["default", "llama3"])
def test_rotary_kv_write_program_layouts(scaling, kv_heads_per_program):
    case = rope_case(300, (32, 8, 128), 16, torch.bfloat16, scaling)
    q_before = case[0].clone()
    rotary_kv_write_triton(*case, kv_heads_per_program=kv_heads_per_program)
    check_rope(*case, q_before, torch.bfloat16)


@pytest.mark.parametrize("num_tokens", [1, 33, 300])
def test_rotary_kv_write_with_head_norms(num_tokens):
    """Qwen3's q_norm and k_norm in the rotary write, against the unfused kernels (rms_norm over each head, then the
    write): equal but where a sum of squares summed in two halves rounds apart, within a bf16 rounding."""
    q, k, v, positions, cache, kv_cache, slots = rope_case(num_tokens, (32, 8, 128), 16, torch.bfloat16, None)
    norms = HeadNorms(*(torch.rand(128, device=DEV, dtype=torch.bfloat16) + 0.5 for _ in range(2)), 1e-6)
    q_normed = rms_norm_triton(q.reshape(-1, 128), norms.q_weight, norms.eps).view(q.shape)
    k_normed = rms_norm_triton(k.reshape(-1, 128), norms.k_weight, norms.eps).view(k.shape)
    kv_unfused = kv_cache.clone()
    rotary_kv_write_triton(q_normed, k_normed, v, positions, cache, kv_unfused, slots)
    rotary_kv_write_triton(q, k, v, positions, cache, kv_cache, slots, head_norms=norms)
    kept = kv_cache.flatten(1, 2)[:, slots[slots >= 0]]
    kept_unfused = kv_unfused.flatten(1, 2)[:, slots[slots >= 0]]
    for got, want in ((q, q_normed), (kept, kept_unfused)):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)
        assert (got == want).float().mean() > 0.99
    assert kv_cache.isnan().sum() == kv_unfused.isnan().sum(), "the same slots written"


def test_rotary_kv_write_to_output():
    q, k, v, positions, cache, kv_cache, slots = rope_case(17, (32, 8, 128), 16, torch.bfloat16, None)
    q_before = q.clone()
    out = rotary_kv_write_triton(q, k, v, positions, cache, kv_cache, slots, q_out=nan_like(q_before))
    assert torch.equal(q, q_before)
    check_rope(out, k, v, positions, cache, kv_cache, slots, q_before, torch.bfloat16)


def test_fused_kernels_in_a_cuda_graph():
    """Captured once, replayed on new inputs copied into the same buffers: the same results as eager."""
    q, k, v, positions, cache, kv_cache, slots = rope_case(8, (32, 8, 128), 16, torch.bfloat16, None)
    x, residual = (torch.randn(8, 4096, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    weight, gate_up = (
        torch.rand(4096, device=DEV, dtype=torch.bfloat16),
        torch.randn(8, 2 * 14336, device=DEV),
    )
    bufs = [q, k, v, positions, slots, x, residual, gate_up]

    def step():
        rotary_kv_write_triton(q, k, v, positions, cache, kv_cache, slots)
        fused_add_rmsnorm_triton(x, residual, weight, 1e-5)
        return silu_and_mul_triton(gate_up)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        act = step()
    for seed in range(3):
        torch.manual_seed(seed)
        fresh = [torch.randn_like(b) if b.is_floating_point() else b.clone() for b in bufs]
        fresh[3] = torch.randint(0, MAX_POS, (8,), device=DEV)
        for b, f in zip(bufs, fresh, strict=True):
            b.copy_(f)
        graph.replay()
        got = [q.clone(), x.clone(), residual.clone(), act.clone(), kv_cache.clone()]
        for b, f in zip(bufs, fresh, strict=True):
            b.copy_(f)
        want_act = step()
        for g, w in zip(got, [q, x, residual, want_act, kv_cache], strict=True):
            assert torch.equal(g.nan_to_num(), w.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_model_forward_triton_matches_torch_and_captures(dtype, monkeypatch):
    """Dummy SmolLM2 decode step (8 sequences): the fused Triton path vs the torch references, and the
    same forward captured in a CUDA graph and replayed."""
    model, c = load_model("SmolLM2-135M", load_format="dummy", device=DEV, dtype=dtype)
    kv = torch.randn(
        c.num_hidden_layers, 2, 8 * 13, 16, c.num_key_value_heads, c.head_dim, device=DEV, dtype=dtype
    )
    seq_lens = [1, 17, 40, 100, 64, 5, 200, 33]
    tables = [list(range(13 * i, 13 * i + 13)) for i in range(8)]  # 13 pages of 16 hold 200 tokens
    meta = AttentionMetadata.build([1] * 8, seq_lens, tables, 16, DEV)
    ids = torch.randint(0, c.vocab_size, (8,), device=DEV)
    positions = torch.tensor([n - 1 for n in seq_lens], device=DEV)

    def forward(backend):
        monkeypatch.setattr(_backend, "FORCED_BACKEND", backend)
        cache = kv.clone()
        with torch.inference_mode():
            return model(ids, positions, meta, cache), cache

    (out_t, kv_t), (out_r, kv_r) = forward("triton"), forward("torch")
    assert rel_err(out_t, out_r) < (3e-2 if dtype == torch.bfloat16 else 1e-4)
    assert rel_err(kv_t, kv_r) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    monkeypatch.setattr(_backend, "FORCED_BACKEND", "triton")
    cache = kv.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode():
        model(ids, positions, meta, cache)  # warm
        with torch.cuda.graph(graph):
            out_g = model(ids, positions, meta, cache)
        graph.replay()
    assert rel_err(out_g, out_t) < 1e-6
