"""The one-row GEMV (alone and ending in SwiGLU) and the sort-free top-k/top-p cutoff, compiled, at the models'
sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.gemv import gemv_triton, swiglu_config
from kernels.silu_and_mul import silu_and_mul_triton
from kernels.top_p_cutoff import top_k_top_p_cutoff_reference, top_k_top_p_cutoff_triton

SHAPES = [  # (N, K): Llama-3-8B qkv, o, gate_up, down, LM head; SmolLM2 qkv, o, gate_up, down, LM head
    (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
    (960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576),
]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_against_fp64(n, k, dtype, bias):
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    y = gemv_triton(x, w, b)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    assert torch.isfinite(y).all()
    err = (y.double() - ref).norm() / ref.norm()
    assert err < 4e-3, err  # one rounding of the output to half precision
    cublas = torch.nn.functional.linear(x, w, b)
    assert (cublas.double() - ref).norm() / ref.norm() < 4e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(14336, 4096), (1536, 576), (1000, 300)])  # gate_up's outputs: 8B, SmolLM2
def test_gemv_swiglu_equals_the_gemv_then_silu_and_mul(n, k, dtype):
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    w = torch.randn(2 * n, k, device="cuda", dtype=dtype) / k**0.5
    b = torch.randn(2 * n, device="cuda", dtype=dtype)
    for bias in (None, b):
        y = gemv_triton(x, w, bias, swiglu=True)
        assert torch.equal(y, silu_and_mul_triton(gemv_triton(x, w, bias, swiglu_config(n, k))))
        gate, up = (x.double() @ w.double().T + (0 if bias is None else bias.double())).chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
        assert (y.double() - ref).norm() / ref.norm() < 1e-2  # the rounded gate, up, silu and product


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(128, 2048), (8, 4096), (64, 7168), (60, 1000)])  # Qwen3-MoE, Mixtral, ...
def test_add_norm_gemv_is_the_add_the_norm_and_the_router(n, k, dtype):
    """The router with the residual add and RMSNorm before it: the stream bit for bit the unfused add's, the normed
    row within one rounding of fused_add_rmsnorm's (its sum of squares may add up in another order), the logits
    the product of that row, rounded once."""
    from kernels.fused_add_rmsnorm import fused_add_rmsnorm_triton
    from kernels.gemv import add_norm_gemv

    h, residual = torch.randn(1, k, device="cuda", dtype=dtype), torch.randn(1, k, device="cuda", dtype=dtype)
    norm_weight = (torch.rand(k, device="cuda") + 0.5).to(dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
    x, stream, y = add_norm_gemv(h, residual, norm_weight, 1e-6, w)
    want_x, want_stream = fused_add_rmsnorm_triton(h.clone(), residual.clone(), norm_weight, 1e-6)
    assert torch.equal(stream, want_stream)
    close = torch.isclose(x.float(), want_x.float(), rtol=1e-2, atol=1e-3)
    assert close.all() and (x != want_x).float().mean() < 0.01
    torch.testing.assert_close(y.float(), x.double().matmul(w.double().T).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_cutoff_against_the_sort_at_llama3_vocab(rows):
    vocab = 128_256
    scaled = torch.randn(rows, vocab, device="cuda") * 2.5
    top_k = torch.full((rows, 1), float(vocab), device="cuda")
    top_k[1::2] = torch.randint(1, 2000, (rows // 2, 1), device="cuda").float()
    top_p = torch.rand(rows, 1, device="cuda") * 0.9 + 0.05
    got = top_k_top_p_cutoff_triton(scaled, top_k, top_p)
    want = top_k_top_p_cutoff_reference(scaled, top_k, top_p)
    for r in (got != want).flatten().nonzero().flatten().tolist():  # only near-ties of the kept mass
        row = scaled[r].double()
        kth = row.sort(descending=True).values[int(top_k[r]) - 1]
        p = torch.where(row >= kth, row, -torch.inf).softmax(0)
        lo = min(got[r].item(), want[r].item())
        assert abs(p[row > lo].sum().item() - top_p[r].item()) < 1e-5, r
    assert (got == want).float().mean() >= 0.9


def test_batch_one_engine_in_bf16_takes_the_gemv_and_keeps_transformers_tokens(tmp_path, monkeypatch):
    """A batch-1 decode step in half precision runs every linear layer as the GEMV (graphs on); its greedy
    tokens match the same engine with cuBLAS for every linear (the tiny model's choices are far from ties),
    and transformers' (fp32) greedy output on most prompts."""
    import kernels.gemv as gemv
    from engine import LLM, SamplingParams
    from tests.hf_reference import hf_greedy, tiny_random_model_dir

    tiny = tiny_random_model_dir(tmp_path, "qwen2")  # q/k/v bias: the GEMV's bias path too
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (1, 9, 31, 64)]
    calls = []
    real = gemv.gemv_triton
    monkeypatch.setattr(gemv, "gemv_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    kw = dict(device="cuda", dtype="bfloat16", max_model_len=256, num_gpu_blocks_override=64)
    llm = LLM(str(tiny), **kw)
    params = SamplingParams(temperature=0, max_tokens=24)
    with_gemv = [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in batch]
    assert calls, "the batch-1 step never took the GEMV"
    monkeypatch.setattr("engine.layers.linear.dense_linear", torch.nn.functional.linear)
    monkeypatch.setattr("engine.layers.linear.dense_swiglu", lambda *a: silu_and_mul_triton(F.linear(*a)))
    monkeypatch.setattr("engine.layers.embedding.dense_linear", torch.nn.functional.linear)
    eager = LLM(str(tiny), enforce_eager=True, **kw)
    with_cublas = [eager.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in batch]
    assert with_gemv == with_cublas
    want = hf_greedy(tiny, batch, [24] * len(batch))  # fp32 on the CPU
    assert sum(a == b for a, b in zip(with_gemv, want)) >= len(batch) - 1
