"""The sampler on CUDA: the same tokens as on the CPU for the same seeds and positions, no host syncs
before the results are read, and its device part captured in a CUDA graph replays like eager."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, sampling_tensors, stages_of
from engine.sampling_ops import sample_tokens
from engine.sampling_params import SamplingParams
from kernels.sampling_noise import greedy_argmax, gumbel_noise_reference, gumbel_noise_triton

ROWS, VOCAB = 64, 32_000
CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=0.7, top_k=40),
    SamplingParams(temperature=1.1, top_k=100, top_p=0.9, min_p=0.05),
]


def well_separated_logits(seed: int) -> torch.Tensor:
    """(ROWS, VOCAB): distinct values a quarter apart, shuffled, so that no filter cutoff or Gumbel
    argmax sits within float rounding of a tie."""
    g = torch.Generator().manual_seed(seed)
    values = torch.arange(VOCAB, dtype=torch.float32) * -0.25
    return torch.stack([values[torch.randperm(VOCAB, generator=g)] for _ in range(ROWS)])


def row_knobs(params: SamplingParams, seed: int):
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-(2**62), 2**62, (ROWS,), generator=g).tolist()
    positions = torch.randint(0, 4096, (ROWS,), generator=g).tolist()
    return [params] * ROWS, seeds, positions


def test_noise_kernel_matches_its_reference_on_the_device():
    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(2**63), 2**63 - 1, (ROWS,), generator=g).cuda()
    positions = torch.randint(0, 1 << 30, (ROWS,), generator=g).cuda()
    got = gumbel_noise_triton(seeds, positions, VOCAB)
    ref = gumbel_noise_reference(seeds.cpu(), positions.cpu(), VOCAB)
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-6, atol=1e-6)
    assert (got.cpu() == ref).float().mean() > 0.999


@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_is_torch_argmax_on_the_device(rows, dtype):
    """Llama-3-8B's vocabulary, ties placed within and across the kernel's blocks: the first index wins."""
    g = torch.Generator().manual_seed(rows)
    vocab = 128_256
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    for r in range(rows):
        ties = torch.randint(0, vocab, (1 + r % 3,), generator=g)
        logits[r, ties] = 30.0
    got = greedy_argmax(logits.cuda())
    assert got.device.type == "cuda"
    assert got.cpu().tolist() == logits.float().argmax(dim=-1).tolist()


@pytest.mark.parametrize("params", CASES)
def test_gpu_draws_the_cpu_tokens(params):
    logits = well_separated_logits(1)
    rows, seeds, positions = row_knobs(params, 2)
    cpu = sample_tokens(
        logits, sampling_tensors(rows, seeds, positions, VOCAB, torch.device("cpu")), stages_of(rows, VOCAB)
    )
    t = sampling_tensors(rows, seeds, positions, VOCAB, torch.device("cuda"))
    gpu = sample_tokens(logits.cuda(), t, stages_of(rows, VOCAB))
    assert gpu.cpu().tolist() == cpu.tolist()


def test_sampling_queues_everything_before_the_read():
    """torch's sync debug mode raises on any synchronising call made before the results are read."""
    logits = well_separated_logits(3).cuda()
    params = [
        SamplingParams(
            temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, logprobs=3, seed=i,
            repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.2,
        ) if i % 3 else SamplingParams(temperature=0)
        for i in range(ROWS)
    ]  # fmt: skip
    histories = [([1, 2, 3], [5, 5, i]) for i in range(ROWS)]
    sampler = Sampler()
    sampler(logits, params, [None] * ROWS, histories)  # compiles the kernel, warms the pinned cache
    modes: list[int] = []

    def before_read() -> None:
        modes.append(torch.cuda.get_sync_debug_mode())
        torch.cuda.set_sync_debug_mode(0)

    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler(logits, params, [None] * ROWS, histories, before_read=before_read)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert modes == [2]
    assert out.token_ids[::3] == logits[::3].argmax(-1).tolist()
    assert all(lp is None if i % 3 == 0 else len(lp) >= 3 for i, lp in enumerate(out.logprobs))


def test_sampling_replays_in_a_cuda_graph():
    params = CASES[1]
    rows, seeds, positions = row_knobs(params, 4)
    stages = stages_of(rows, VOCAB)
    static_logits = well_separated_logits(5).cuda()
    t = sampling_tensors(rows, seeds, positions, VOCAB, torch.device("cuda"))
    sample_tokens(static_logits, t, stages)  # compiles the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_tokens = sample_tokens(static_logits, t, stages)
    for step in range(3):
        logits = well_separated_logits(10 + step).cuda()
        _, seeds, positions = row_knobs(params, 20 + step)
        fresh = sampling_tensors(rows, seeds, positions, VOCAB, torch.device("cuda"))
        for name in ("seed", "position", "temperature", "top_k", "top_p", "min_p"):
            getattr(t, name).copy_(getattr(fresh, name))
        static_logits.copy_(logits)
        graph.replay()
        assert static_tokens.tolist() == sample_tokens(logits, fresh, stages).tolist()


def test_structured_output_masks_leave_the_same_tokens_on_the_device():
    """apply_masks (structured output's bit words) on CUDA keeps exactly the tokens it keeps on the CPU, a row
    without a mask keeps all, and the greedy pick is the best allowed token."""
    import numpy as np

    from engine.sampler import apply_masks

    logits = well_separated_logits(7)[:4]
    g = np.random.default_rng(0)
    words = -(-VOCAB // 32)
    masks = [
        g.integers(-(2**31), 2**31, words, dtype=np.int64).astype(np.int32),
        None,
        np.zeros(words, np.int32),
    ]
    masks[2][5] = 1 << 3  # token 5 * 32 + 3 alone
    masks.append(masks[0])
    cpu = apply_masks(logits, masks)
    gpu = apply_masks(logits.cuda(), masks)
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.isfinite(cpu[1]).all() and torch.isfinite(cpu[2]).sum() == 1 and torch.isfinite(cpu[2, 163])
    bits = np.unpackbits(masks[0].view(np.uint8), bitorder="little")[:VOCAB].astype(bool)
    assert torch.equal(torch.isfinite(cpu[0]), torch.from_numpy(bits))
    assert greedy_argmax(gpu).tolist()[2] == 163
