"""The fragment-order int4 layout of bench/quant_mma.py: re-laying the weights and reading them back the way
the mma.sync kernel reads them (its lanes' words, nibbles and permuted K order) gives the dense GEMM."""

from __future__ import annotations

import pytest
import torch

from bench.quant_mma import fragment_gemm_reference, relayout


@pytest.mark.parametrize(("n", "k", "group", "q"), [(40, 256, 128, 2), (17, 256, 64, 1), (100, 576, 64, 1)])
@pytest.mark.parametrize("offsets", [False, True], ids=["zero_points", "offsets"])
def test_fragment_layout_reads_back_as_the_dense_weight(n, k, group, q, offsets):
    g = torch.Generator().manual_seed(n + k)
    values = torch.randint(0, 16, (n, k), generator=g)
    scales = (torch.rand(k // group, n, generator=g) * 0.02 + 0.001).half()
    if offsets:
        zeros = (torch.randn(k // group, n, generator=g) * 0.05).half()
    else:
        zeros = torch.randint(0, 16, (k // group, n), generator=g, dtype=torch.uint8)
    x = torch.randn(3, k, generator=g, dtype=torch.float64)
    words = relayout(values, q)
    assert words.shape == (-(-n // 16), k // 64, 32, 4) and words.dtype == torch.int32
    rows = torch.arange(k) // group
    s, z = scales.double()[rows].t(), zeros.double()[rows].t()
    dense = values.double() * s + z if offsets else (values.double() - z) * s
    torch.testing.assert_close(fragment_gemm_reference(x, words, scales, zeros, n, group, q), x @ dense.t())
    # a different chunk size reads the same words differently: the check is not blind to the K order
    if k % 128 == 0 and q == 1:
        assert not torch.allclose(
            fragment_gemm_reference(x, words, scales, zeros, n, group, 2), x @ dense.t()
        )
