"""The fp8 KV cache and the swap space on CUDA.

- Each fp8 kernel against its torch reference's fp8 path (quantize on write; dequantize, then attend), compiled,
  over GQA 1/3/4/8, head_dim 64/128, block 16/32, batch 1..256, contexts to 32k, split and unsplit, bf16 /
  fp16 / fp32 queries; the writes store the reference's bytes.
- Swap copies between a CUDA pool and the pinned CPU pool (the block-copy kernel through the pinned pool's
  device mapping, on the side stream), any ids, fp8 and bf16: bytes exact both ways.
- The engine (tiny random checkpoints, fp32, CUDA graphs and overlapped steps on) under heavy preemption with
  swap and auto mode equals transformers' greedy output; with an fp8 cache the Triton path equals the
  torch path, graphs equal eager, and calibrated scales (set after the graphs were captured) are read."""

from __future__ import annotations

import pytest
import torch

import kernels._backend as backend
from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.swap import IN, OUT, SwapSpace
from kernels.kv_cache_write import kv_cache_write_reference, kv_cache_write_triton
from kernels.kv_quant import FP8_DTYPE, quantize
from kernels.paged_decode_attention import paged_decode_attention_reference, paged_decode_attention_triton
from kernels.paged_prefill_attention import paged_prefill_attention_reference, paged_prefill_attention_triton
from kernels.rotary_kv_write import rotary_kv_write_reference, rotary_kv_write_triton
from tests.gpu.paged_inputs import every_fp8_pair, make_paged_kv, query_start_loc
from tests.gpu.test_kernels_gpu import DECODE_BATCHES, HEADS, PREFILL_BATCHES, check, nan_like
from tests.hf_reference import hf_greedy, tiny_random_model_dir

DEV = "cuda"


def fp8_paged(seq_lens, heads, block_size, scale):
    _, num_kv_heads, head_dim = heads
    kv, tables, lens = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, torch.float32, DEV)
    kv = kv * 4 * scale.view(2, 1, 1, 1, 1)
    return torch.stack([quantize(kv[0], scale[0]), quantize(kv[1], scale[1])]), tables, lens


def test_fp8_words_convert_as_torch_converts_their_bytes():
    """The decode's inline assembly (PRMT + cvt per two bytes) on every 16-bit word, against torch's cast."""
    want, got = every_fp8_pair(DEV)
    finite = ~want.isnan()
    assert (got[finite].view(torch.int16) == want[finite].view(torch.int16)).all()


@pytest.mark.parametrize("batch", list(DECODE_BATCHES))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_fp8_decode(heads, block_size, batch):
    scale = torch.tensor([0.05, 0.2], device=DEV)
    cache, tables, lens = fp8_paged(DECODE_BATCHES[batch], heads, block_size, scale)
    num_heads, _, head_dim = heads
    for dtype in (torch.bfloat16, torch.float16):
        query = torch.randn(len(lens), num_heads, head_dim, device=DEV, dtype=dtype)
        out = paged_decode_attention_triton(
            query, cache, lens, tables, head_dim**-0.5, kv_scale=scale, out=nan_like(query)
        )
        ref = paged_decode_attention_reference(query.float(), cache, lens, tables, head_dim**-0.5, scale)
        check(out, ref, dtype)


@pytest.mark.parametrize("num_splits", [2, 64])
def test_fp8_decode_split_and_fp32(num_splits):
    scale = torch.tensor([1.0, 1.0], device=DEV)
    cache, tables, lens = fp8_paged([8191, 5000, 1, 300], (32, 8, 128), 16, scale)
    for dtype in (torch.bfloat16, torch.float32):
        query = torch.randn(4, 32, 128, device=DEV, dtype=dtype)
        out = paged_decode_attention_triton(
            query, cache, lens, tables, 0.088, num_splits=num_splits, kv_scale=scale, out=nan_like(query)
        )
        check(out, paged_decode_attention_reference(query.float(), cache, lens, tables, 0.088, scale), dtype)


@pytest.mark.parametrize("batch", list(PREFILL_BATCHES))
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_fp8_prefill(heads, batch):
    seqs = PREFILL_BATCHES[batch]
    scale = torch.tensor([0.3, 0.07], device=DEV)
    cache, tables, lens = fp8_paged([q + c for q, c in seqs], heads, 16, scale)
    num_heads, _, head_dim = heads
    qsl = query_start_loc([q for q, _ in seqs], DEV)
    query = torch.randn(sum(q for q, _ in seqs), num_heads, head_dim, device=DEV, dtype=torch.bfloat16)
    out = paged_prefill_attention_triton(
        query, cache, qsl, lens, tables, head_dim**-0.5, kv_scale=scale, out=nan_like(query)
    )
    ref = paged_prefill_attention_reference(query.float(), cache, qsl, lens, tables, head_dim**-0.5, scale)
    check(out, ref, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_writes_store_the_references_bytes(dtype):
    scale = torch.tensor([0.05, 0.2], device=DEV)
    kv = (torch.randn(300, 2, 8, 128, device=DEV) * 10).to(dtype)
    slots = torch.randperm(64 * 16, device=DEV)[:300]
    slots[::7] = -1
    got = torch.zeros(2, 64, 16, 8, 128, device=DEV, dtype=FP8_DTYPE)
    want = got.clone()
    kv_cache_write_triton(kv[:, 0], kv[:, 1], got, slots, scale)
    kv_cache_write_reference(kv[:, 0], kv[:, 1], want, slots, scale)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # RoPE fused with the write (fp32 inputs): V's bytes exact; K's too but where the kernel's fused
    # multiply-add rounds the rotation to the other side of an fp8 rounding boundary (one step apart)
    q, k, v = (torch.randn(300, n, 128, device=DEV) * 5 for n in (32, 8, 8))
    cos_sin = torch.randn(4096, 128, device=DEV)
    positions = torch.randint(0, 4096, (300,), device=DEV)
    got.zero_()
    want.zero_()
    rotary_kv_write_triton(q.clone(), k, v, positions, cos_sin, got, slots, kv_scale=scale)
    rotary_kv_write_reference(q.clone(), k, v, positions, cos_sin, want, slots, kv_scale=scale)
    assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))
    differ = got[0].view(torch.uint8) != want[0].view(torch.uint8)
    assert differ.float().mean() < 1e-3
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=0.125, atol=2**-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8_DTYPE])
def test_swap_copies_are_exact_both_ways(dtype):
    gpu = torch.randn(4, 2, 300, 16, 8, 128, device=DEV).to(dtype)
    swap = SwapSpace([gpu], 200, BlockManager(300, 16))
    assert swap.cpu_pools[0].is_pinned() and swap.cpu_pools[0].dtype == dtype
    src = torch.randperm(300)[:150].tolist()
    dst = torch.randperm(200)[:150].tolist()
    # compared as bytes: indexing needs no fp8 kernels
    cpu, dev = swap.cpu_pools[0].view(torch.uint8), gpu.view(torch.uint8)
    swap._copy(OUT, src, dst, [])
    swap.synchronize()
    assert torch.equal(cpu[:, :, dst], dev[:, :, src].cpu())
    back = torch.randperm(300)[:150].tolist()
    before = dev.clone()
    swap._copy(IN, dst, back, [])
    torch.cuda.synchronize()
    assert torch.equal(dev[:, :, back], before[:, :, src])
    untouched = [b for b in range(300) if b not in set(back)]
    assert torch.equal(dev[:, :, untouched], before[:, :, untouched])
    swap.synchronize()
    assert swap.stats.out_blocks == swap.stats.in_blocks == 150 and swap.stats.out_seconds > 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_random_model_dir(tmp_path_factory.mktemp("kvmem"), "llama")


def batch(vocab: int, n: int = 6, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, vocab, (int(x),), generator=g).tolist()
        for x in torch.randint(5, 60, (n,), generator=g)
    ]


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int = 40) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens)
    )
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("mode", ["swap", "auto"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_swapping_engine_on_cuda_matches_transformers(tiny, mode, prefix_caching):
    llm = LLM(
        str(tiny), device="cuda", dtype="float32", max_model_len=128, block_size=8, num_gpu_blocks_override=16,
        swap_space=0.01, preemption_mode=mode, enable_prefix_caching=prefix_caching,
    )  # fmt: skip
    prompts = batch(llm.engine.model_config.vocab_size)
    assert generate(llm, prompts) == hf_greedy(tiny, prompts, [40] * len(prompts))
    preemption = llm.engine.scheduler.preemption
    assert preemption.swap is not None and preemption.swap.cpu.num_free == preemption.swap.num_blocks
    assert sum(preemption.counts.values()) > 0
    if mode == "swap":  # auto may find recomputing this tiny model cheaper than the copies
        assert preemption.counts["recompute"] == 0 and preemption.swap.stats.in_blocks > 0


def test_fp8_engine_paths_agree_and_read_calibrated_scales(tiny, monkeypatch):
    def fp8_llm(**kw):
        return LLM(str(tiny), device="cuda", dtype="float32", max_model_len=128, gpu_memory_utilization=0.05,
                   kv_cache_dtype="fp8", enable_prefix_caching=False, **kw)  # fmt: skip

    prompts = batch(300, seed=1)
    graphs = fp8_llm(calculate_kv_scales=True)
    assert graphs.engine.runner.graphs is not None and not (graphs.engine.kv_scales == 1.0).all()
    eager = fp8_llm(calculate_kv_scales=True, enforce_eager=True)
    want = generate(eager, prompts)  # the Triton kernels, eagerly
    assert generate(graphs, prompts) == want  # the graphs read the scales set after they were captured
    monkeypatch.setattr(backend, "FORCED_BACKEND", "torch")
    assert generate(eager, prompts) == want  # the references: quantize, dequantize, then attend
