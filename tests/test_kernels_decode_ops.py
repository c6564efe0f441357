"""The one-row GEMV and the sort-free top-k/top-p cutoff: Triton (under the interpreter) against their torch
references on small shapes; tests/gpu repeats them compiled, at the model's sizes."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything here imports triton

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from kernels import _backend
from kernels.gemv import (
    _gemv_kernel,
    add_norm_gemv,
    add_norm_gemv_reference,
    dense_linear,
    dense_swiglu,
    gemv_reference,
    gemv_triton,
    swiglu_config,
)
from kernels.silu_and_mul import silu_and_mul_reference, silu_and_mul_triton
from kernels.top_p_cutoff import top_k_top_p_cutoff_reference, top_k_top_p_cutoff_triton

assert isinstance(_gemv_kernel, InterpretedFunction), "run the CPU kernel tests under TRITON_INTERPRET=1"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---- GEMV ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k", [(1, 16), (7, 100), (64, 576), (130, 512), (33, 1536), (960, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(n, k, dtype, bias):
    x = torch.randn(1, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype) / k**0.5
    b = torch.randn(n, dtype=dtype) if bias else None
    got = gemv_triton(x, w, b)
    want = gemv_reference(x, w, b)
    assert got.shape == (1, n) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("config", [(1, 16, 1), (2, 64, 2), (4, 128, 4), (8, 32, 4)])
def test_gemv_any_tile_covers_every_row(config):
    """Tiles that leave a tail in both N and K still write every output exactly once."""
    x, w = torch.randn(1, 200), torch.randn(37, 200)
    torch.testing.assert_close(gemv_triton(x, w, config=config), gemv_reference(x, w), rtol=1e-5, atol=1e-5)


def test_dense_linear_takes_the_kernel_for_one_half_precision_row(monkeypatch):
    calls = []
    monkeypatch.setattr(_backend, "FORCED_BACKEND", "triton")
    monkeypatch.setattr("kernels.gemv.gemv_triton", lambda *a, **kw: calls.append(a) or gemv_reference(*a))
    w16, w32 = torch.randn(8, 32, dtype=torch.float16), torch.randn(8, 32)
    dense_linear(torch.randn(1, 32, dtype=torch.float16), w16)
    assert len(calls) == 1
    dense_linear(torch.randn(2, 32, dtype=torch.float16), w16)  # two rows: a GEMM
    dense_linear(torch.randn(1, 32), w32)  # fp32: F.linear keeps its own rounding
    assert len(calls) == 1


_SMALL_SWIGLU = [(1, 16, None), (7, 100, (1, 32, 1)), (37, 200, (2, 64, 2))]


# the model-sized shape (default tiles over many programs) once a dtype: the interpreter takes ~20 s a case there
@pytest.mark.parametrize(
    "n,k,config,dtype,bias",
    [
        (*shape, dtype, bias)
        for shape in _SMALL_SWIGLU
        for dtype in (torch.float32, torch.float16)
        for bias in (False, True)
    ]
    + [(768, 576, None, torch.float32, True), (768, 576, None, torch.float16, False)],
)
def test_gemv_swiglu_equals_the_gemv_then_silu_and_mul(n, k, config, dtype, bias):
    """gate_up's GEMV with SwiGLU as its epilogue: the two unfused kernels' output bit for bit (same tile),
    and the torch reference."""
    x = torch.randn(1, k, dtype=dtype)
    w = torch.randn(2 * n, k, dtype=dtype) / k**0.5
    b = torch.randn(2 * n, dtype=dtype) if bias else None
    got = gemv_triton(x, w, b, config, swiglu=True)
    assert got.shape == (1, n) and got.dtype == dtype
    assert torch.equal(got, silu_and_mul_triton(gemv_triton(x, w, b, config or swiglu_config(n, k))))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, silu_and_mul_reference(gemv_reference(x, w, b)), rtol=tol, atol=tol)


def test_dense_swiglu_fuses_one_half_precision_row(monkeypatch):
    calls = []
    monkeypatch.setattr(_backend, "FORCED_BACKEND", "triton")
    real = gemv_triton
    monkeypatch.setattr("kernels.gemv.gemv_triton", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    w16 = torch.randn(16, 32, dtype=torch.float16)
    for m in (1, 2):  # two rows: the GEMM, then the activation's kernel
        x = torch.randn(m, 32, dtype=torch.float16)
        torch.testing.assert_close(
            dense_swiglu(x, w16), silu_and_mul_reference(x @ w16.T), rtol=2e-3, atol=2e-3
        )
    assert calls == [{"swiglu": True}]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k", [(8, 64), (37, 200), (128, 512)])
def test_add_norm_gemv_is_the_add_the_norm_and_the_router(monkeypatch, n, k, dtype):
    """A MoE layer's router beginning with the residual add and RMSNorm: the stream and the normed row as
    fused_add_rmsnorm leaves them, the logits as the GEMV makes them from that row; h and residual untouched."""
    monkeypatch.setattr(_backend, "FORCED_BACKEND", "triton")
    h, residual = torch.randn(1, k, dtype=dtype), torch.randn(1, k, dtype=dtype)
    norm_weight = (torch.rand(k) + 0.5).to(dtype)
    w = torch.randn(n, k, dtype=dtype) / k**0.5
    before = (h.clone(), residual.clone())
    x, stream, y = add_norm_gemv(h, residual, norm_weight, 1e-6, w)
    assert torch.equal(h, before[0]) and torch.equal(residual, before[1])
    want_x, want_stream, _ = add_norm_gemv_reference(h, residual, norm_weight, 1e-6, w)
    assert torch.equal(stream, want_stream)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(x, want_x, rtol=tol, atol=tol)
    torch.testing.assert_close(y, gemv_reference(x, w), rtol=tol, atol=tol)
    assert y.shape == (1, n) and y.dtype == dtype


# ---- top-k / top-p cutoff --------------------------------------------------------------------------


def _knobs(rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    top_k = torch.randint(1, vocab + 1, (rows, 1)).float()
    top_k[::3] = float(vocab)  # top-k off
    top_p = torch.rand(rows, 1) * 0.98 + 0.01
    top_p[1::4] = 1.0  # top-p off
    return top_k, top_p


def _kept_mass_disagreement(scaled, top_k, top_p, got, want) -> list[int]:
    """Rows where the cutoffs differ and the reference's boundary is not within rounding of top_p."""
    bad = []
    for r in (got != want).flatten().nonzero().flatten().tolist():
        row = scaled[r].double()
        kth = row.sort(descending=True).values[int(top_k[r]) - 1]
        p = torch.where(row >= kth, row, -torch.inf).softmax(0)
        lo_cut = min(got[r].item(), want[r].item())
        mass_above_lo = p[row > lo_cut].sum().item()
        if abs(mass_above_lo - top_p[r].item()) > 1e-5:
            bad.append(r)
    return bad


@pytest.mark.parametrize("rows,vocab", [(1, 1), (5, 7), (16, 100), (9, 1000), (4, 3000)])
def test_cutoff_matches_the_sort(rows, vocab):
    scaled = torch.randn(rows, vocab) * 3
    top_k, top_p = _knobs(rows, vocab)
    got = top_k_top_p_cutoff_triton(scaled, top_k, top_p)
    want = top_k_top_p_cutoff_reference(scaled, top_k, top_p)
    assert got.shape == (rows, 1)
    assert (got == want).float().mean() >= 0.9, "most rows agree exactly"
    assert _kept_mass_disagreement(scaled, top_k, top_p, got, want) == []


def test_cutoff_with_ties_and_masked_logits():
    """Runs of equal logits (the cutoff keeps a whole run, top-k cuts inside one) and -inf entries."""
    rows, vocab = 24, 200
    scaled = (torch.randn(rows, vocab) * 2).round()  # a handful of distinct values per row
    scaled[:, ::7] = float("-inf")
    top_k, top_p = _knobs(rows, vocab)
    top_k.clamp_(max=vocab - vocab // 7 - 1)
    got = top_k_top_p_cutoff_triton(scaled, top_k, top_p)
    want = top_k_top_p_cutoff_reference(scaled, top_k, top_p)
    assert _kept_mass_disagreement(scaled, top_k, top_p, got, want) == []
    assert torch.isfinite(got).all()


def test_cutoff_extremes():
    scaled = torch.tensor([[3.0, -1.0, 2.0, 2.0, -5.0, 0.5]])
    one = torch.ones(1, 1)
    cases = [  # (top_k, top_p, cutoff)
        (6, 1.0, -5.0),  # both off: everything stays
        (1, 1.0, 3.0),  # top-k 1: the max
        (2, 1.0, 2.0),  # top-k cuts inside a run of equal values: the run's value
        (6, 1e-6, 3.0),  # a tiny top-p keeps the top token
        (3, 0.999, 2.0),  # top-k 3, then all of their mass
    ]
    for k, p, cut in cases:
        got = top_k_top_p_cutoff_triton(scaled, one * k, one * p)
        want = top_k_top_p_cutoff_reference(scaled, one * k, one * p)
        assert got.item() == want.item() == cut, (k, p, got.item(), want.item())


def _search_rows(vocab: int) -> torch.Tensor:
    """Rows the top-p search settles at different depths: far-apart logits, ones a few ulps apart, runs
    of equal values, -inf entries, and rows whose least or largest logit is a zero of either sign."""
    near = 1.0 + torch.randint(0, 40, (vocab,)) * 2.0**-22  # 40 values 2 ulps apart
    masked = torch.randn(vocab) * 3
    masked[::3] = float("-inf")
    runs = (torch.randn(vocab) * 2).round()  # a handful of values, 0.0 and -0.0 among them
    at_least_zero = runs.abs()
    at_most_zero = -runs.abs()
    rows = [torch.randn(vocab) * 30, near, masked, runs, at_least_zero, at_most_zero]
    return torch.stack(rows)  # (6, vocab)


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.99, 0.999999, 1 - 2**-24])
def test_cutoff_search_settles_where_the_sort_does(top_p):
    """The search stops once its interval holds one logit value; the cutoff must not move for it, nor
    leave the row where top_p is near 1 and Z and the search's sums round differently."""
    vocab = 2500  # two whole blocks of lanes and a part
    scaled = _search_rows(vocab).repeat(2, 1)  # (12, vocab): top-k off, then on
    top_k = torch.full((12, 1), float(vocab))
    top_k[6:, 0] = torch.tensor([7.0, 1500.0, 1000.0, 900.0, 2000.0, 100.0])
    top_p = torch.full((12, 1), top_p)
    got = top_k_top_p_cutoff_triton(scaled, top_k, top_p)
    want = top_k_top_p_cutoff_reference(scaled, top_k, top_p)
    assert torch.isfinite(got).all(), got.flatten().tolist()
    assert _kept_mass_disagreement(scaled, top_k, top_p, got, want) == []


def test_cutoff_keeps_a_run_of_zeros():
    """0.0 and -0.0 compare equal, so the search must start under both when kth is a zero."""
    scaled = torch.tensor([[2.0, 0.0, 1.0, -0.0, 3.0]])
    one = torch.ones(1, 1)
    for k, p, cut in [(5, 0.99, 0.0), (4, 0.99, 0.0), (5, 0.9, 1.0), (2, 0.99, 2.0)]:
        got = top_k_top_p_cutoff_triton(scaled, one * k, one * p)
        want = top_k_top_p_cutoff_reference(scaled, one * k, one * p)
        assert got.item() == want.item() == cut, (k, p, got.item(), want.item())


def test_cutoff_next_to_masked_logits_with_top_p_near_one():
    """-inf logits carry no mass, so some finite logit is the cutoff even where top_p * Z rounds above the
    mass of all the finite logits."""
    rows, vocab = 16, 2000
    scaled = torch.randn(rows, vocab) * 3
    scaled[:, ::5] = float("-inf")
    top_k = torch.full((rows, 1), float(vocab))
    top_p = torch.full((rows, 1), 1 - 2**-24)
    got = top_k_top_p_cutoff_triton(scaled, top_k, top_p)
    finite_least = scaled.masked_fill(scaled == float("-inf"), float("inf")).amin(dim=-1, keepdim=True)
    assert ((got >= finite_least) & (got < float("inf"))).all(), got.flatten().tolist()
    want = top_k_top_p_cutoff_reference(scaled, top_k, top_p)
    assert _kept_mass_disagreement(scaled, top_k, top_p, got, want) == []


@pytest.mark.parametrize("cap", [1, 16])
def test_cutoff_with_a_small_copy_buffer(monkeypatch, cap):
    """A buffer of a few logits makes the search take several passes over the row before it copies the
    logits inside its interval out (one pass at CAP 1024 on these rows), and end there on one logit."""
    import kernels.top_p_cutoff as cutoff

    monkeypatch.setattr(cutoff, "CAP", cap)
    rows, vocab = 12, 3000
    scaled = torch.randn(rows, vocab) * 3
    scaled[::4] = scaled[::4].round()  # runs of equal values, more than the buffer holds
    top_k, top_p = _knobs(rows, vocab)
    got = top_k_top_p_cutoff_triton(scaled, top_k, top_p)
    want = top_k_top_p_cutoff_reference(scaled, top_k, top_p)
    assert (got == want).float().mean() >= 0.9, "most rows agree exactly"
    assert _kept_mass_disagreement(scaled, top_k, top_p, got, want) == []
