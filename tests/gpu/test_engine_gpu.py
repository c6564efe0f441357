"""The engine on CUDA (Triton kernels) against transformers and against the engine's own torch path.

Random weights (tiny checkpoints saved by transformers), fp32: greedy tokens must be equal."""

from __future__ import annotations

import pytest
import torch

import kernels._backend as backend
from engine import LLM, SamplingParams
from kernels import w4a16_mma, w4a16_wgmma
from tests.hf_reference import hf_greedy, tiny_random_model_dir

LENGTHS = [1, 5, 16, 17, 40, 100, 200]
MAX_TOKENS = [9, 12, 7, 16, 10, 14, 8]


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def run(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in batch],
        [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS],
    )
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(
    params=["llama", "qwen2", "qwen3", "phi3", "llama3_scaled", "mixtral", "qwen2_moe", "qwen3_moe"]
)
def tiny(request, tmp_path):
    return tiny_random_model_dir(tmp_path, request.param)


@pytest.mark.parametrize("budget", [8192, 32])  # whole prompts, and chunked prefill over cached pages
def test_triton_engine_matches_transformers(tiny, budget):
    llm = LLM(
        str(tiny),
        device="cuda",
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=budget,
        gpu_memory_utilization=0.05,
    )
    batch = prompts(llm.engine.model_config.vocab_size)
    want = hf_greedy(tiny, batch, MAX_TOKENS)
    assert run(llm, batch) == want
    again = llm.generate(
        {"prompt_token_ids": batch[-1]}, SamplingParams(temperature=0, max_tokens=MAX_TOKENS[-1])
    )
    assert again[0].num_cached_tokens > 0 and again[0].outputs[0].token_ids == want[-1]


def test_embeddings_on_cuda_match_transformers(tiny):
    """LLM.embed with CUDA graphs captured (a cached prompt's one recomputed token runs eagerly, not in a decode
    graph) and chunked prefill: fp32 vectors equal transformers' last-token states, with no leaked block."""
    from tests.hf_reference import hf_embedding

    llm = LLM(
        str(tiny), device="cuda", dtype="float32", max_model_len=256, max_num_batched_tokens=64,
        gpu_memory_utilization=0.05,
    )  # fmt: skip
    batch = prompts(llm.engine.model_config.vocab_size, seed=5)
    for _ in range(2):  # the second time every full block is cached
        outs = llm.embed([{"prompt_token_ids": p} for p in batch])
        for p, o in zip(batch, outs):
            got = torch.tensor(o.outputs.embedding)
            torch.testing.assert_close(got, hf_embedding(tiny, p), rtol=0, atol=1e-4)
    assert outs[-1].num_cached_tokens > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_prompt_logprobs_on_cuda_match_transformers(tiny):
    """Prompt logprobs with CUDA graphs captured (the step runs eagerly) and chunked prefill: each prompt
    token's logprob and the top 3 equal the log-softmax of transformers' fp32 logits, copied back with no
    leaked block."""
    from tests.hf_reference import hf_logits

    llm = LLM(
        str(tiny), device="cuda", dtype="float32", max_model_len=256, max_num_batched_tokens=64,
        gpu_memory_utilization=0.05,
    )  # fmt: skip
    batch = prompts(llm.engine.model_config.vocab_size, seed=3)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in batch],
        SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3),
    )
    for p, o in zip(batch, outs):
        ref = torch.log_softmax(hf_logits(tiny, p), dim=-1)
        got = o.prompt_logprobs
        assert got is not None and len(got) == len(p) and got[0] is None
        for i in range(1, len(p)):
            want = [p[i], *ref[i - 1].topk(3).indices.tolist()]
            assert all(t in got[i] and abs(got[i][t] - ref[i - 1, t].item()) < 1e-3 for t in want), i
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_structured_output_on_cuda_matches_transformers(tiny):
    """A regex and a choice held by masks unpacked on the device (CUDA graphs captured, steps in order): the
    tokens transformers' greedy generate gives under the same patterns, and texts that match them."""
    import re

    from engine.structured_output import GuideFactory, StructuredOutputsParams
    from tests.hf_reference import GuideMask

    llm = LLM(str(tiny), device="cuda", dtype="float32", max_model_len=256, gpu_memory_utilization=0.05)
    so = [
        StructuredOutputsParams(regex="[0-9]{3}-[a-z]{2}"),
        StructuredOutputsParams(choice=["red", "green"]),
    ]
    batch = prompts(llm.engine.model_config.vocab_size, seed=4)[2:4]
    factory = GuideFactory(llm.engine.tokenizer, llm.engine.model_config.vocab_size)
    extra = [{"logits_processor": [GuideMask(factory.guide(s), len(p))]} for p, s in zip(batch, so)]
    want = hf_greedy(tiny, batch, [12, 12], extra)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in batch],
        [SamplingParams(temperature=0, max_tokens=12, structured_outputs=s) for s in so],
    )
    assert [o.outputs[0].token_ids for o in outs] == want
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", outs[0].outputs[0].text) and outs[1].outputs[0].text in (
        "red",
        "green",
    )
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_triton_and_torch_paths_agree(tiny, monkeypatch):
    llm = LLM(
        str(tiny),
        device="cuda",
        dtype="float32",
        max_model_len=256,
        gpu_memory_utilization=0.05,
        enable_prefix_caching=False,
        enforce_eager=True,  # a captured graph holds the Triton kernels whatever the backend says
    )
    batch = prompts(llm.engine.model_config.vocab_size, seed=1)
    monkeypatch.setattr(backend, "FORCED_BACKEND", "triton")
    triton_out = run(llm, batch)
    monkeypatch.setattr(backend, "FORCED_BACKEND", "torch")
    assert run(llm, batch) == triton_out


def test_preemption_on_cuda_recomputes_exactly(tiny):
    llm = LLM(
        str(tiny),
        device="cuda",
        dtype="float32",
        max_model_len=256,
        num_gpu_blocks_override=16,
        enable_prefix_caching=False,
    )
    batch = prompts(llm.engine.model_config.vocab_size, seed=2)[:5]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in batch], SamplingParams(temperature=0, max_tokens=60)
    )
    want = hf_greedy(tiny, batch, [60] * len(batch))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        SamplingParams(
            temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, logprobs=3, seed=1, max_tokens=4, ignore_eos=True,
            repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.2,
        ),
    ],
    ids=["greedy", "sampled_with_logprobs_and_penalties"],
)  # fmt: skip
def test_a_step_waits_for_nothing_before_during(tiny, params):
    """Every step (prefill and decode) queues its whole work, uploads included, before the host waits on
    the GPU: during() (where the prefill worker queues its KV copy) runs with nothing synchronised yet.
    torch's sync debug mode raises on any synchronising CUDA call made before the hook turns it off."""
    llm = LLM(str(tiny), device="cuda", dtype="float32", max_model_len=256, gpu_memory_utilization=0.05)
    engine = llm.engine
    batch = prompts(engine.model_config.vocab_size)
    llm.generate({"prompt_token_ids": batch[-1]}, params)  # compiles the kernels, warms the pinned cache
    engine.add_request(batch[-2], params)
    modes: list[int] = []

    def during(sched):
        modes.append(torch.cuda.get_sync_debug_mode())
        torch.cuda.set_sync_debug_mode(0)

    steps = 0
    while engine.has_unfinished_requests():
        torch.cuda.set_sync_debug_mode("error")
        try:
            updated, _ = engine.step_core(during=during)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        steps += 1
        for seq in updated:
            if seq.is_finished:
                engine.requests.clear()
    assert steps == 4 and modes == [2] * 4  # one prefill and three decode steps, each hook with "error" on


@pytest.mark.parametrize("int4", [False, True], ids=["bf16", "awq_int4"])
def test_serving_compiles_no_kernel_after_start_up(int4, tmp_path):
    """Start-up compiles every kernel variant that serving needs (engine/engine_core.py: _warm_up_kernels;
    kernels/_backend.py): a ragged workload of mixed steps (prompt chunks beside decode rows, contexts short
    and past 16 decode splits), greedy and sampled rows with every filter, compiles nothing more, with bf16
    weights and with AWQ int4 ones (group 64: the fragment layout's kernels with their norms, RoPE and SwiGLU at
    1-32 rows, and on Hopper the wgmma kernel at 33-256 with norms and SiLU-and-mul writing x in its K order,
    1-64 rows of the first elsewhere; dequantizing past them). A variant compiled mid-run stalls its step by a
    second or more."""
    model = "SmolLM2-135M"
    if int4:  # dummy int4 weights in SmolLM2's shapes
        import json

        from engine.model_config import dummy_config

        quant = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}
        config = {**dummy_config(model).to_hf_dict(), "quantization_config": quant}
        (tmp_path / "config.json").write_text(json.dumps(config))
        model = str(tmp_path)
    llm = LLM(
        model, load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=6144,
        max_num_batched_tokens=512, max_num_seqs=128, gpu_memory_utilization=0.3, enable_prefix_caching=False,
    )  # fmt: skip
    if int4:  # the batches below reach both kernels' row ranges
        layer = llm.engine.runner.model.model.layers[0]
        down = layer.mlp.down_proj.quant_method.weight

        def rows(m: int) -> torch.Tensor:
            return torch.zeros(m, 576, device="cuda", dtype=torch.bfloat16)

        hopper = torch.cuda.get_device_capability()[0] == 9
        assert layer.fuses_norms(rows(1))
        assert layer.fuses_norms(rows(w4a16_wgmma.MIN_ROWS - 1 if hopper else w4a16_mma.MAX_ROWS))
        if hopper:
            assert not layer.fuses_norms(rows(w4a16_wgmma.MIN_ROWS))
            assert w4a16_wgmma.chosen(rows(w4a16_wgmma.MIN_ROWS), down) and w4a16_wgmma.chosen(
                rows(128), down
            )
    before = backend.compiled_variants()
    assert before is not None and before["_paged_decode_kernel"]
    g = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(1, 5600, (24,), generator=g)] + [1, 15, 16, 17, 5999]
    lengths += [int(n) for n in torch.randint(1, 200, (100,), generator=g)]  # top-p's kernel takes >= 64 rows
    batch = [{"prompt_token_ids": torch.randint(3, 49152, (n,), generator=g).tolist()} for n in lengths]
    kinds = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, ignore_eos=True, seed=1),
        SamplingParams(temperature=0.7, top_k=40, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.1, max_tokens=24, ignore_eos=True, logprobs=3),
        SamplingParams(
            temperature=0.9, repetition_penalty=1.2, presence_penalty=0.5, max_tokens=24, ignore_eos=True
        ),
    ]
    outs = llm.generate(batch, [kinds[i % len(kinds) if i < 29 else 1] for i in range(len(batch))])
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert backend.compiled_since(before) == {}
