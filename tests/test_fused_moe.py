"""The mixture-of-experts FFN: the Triton kernels (under the interpreter) against the torch reference, the
reference against transformers' experts, the pairs' alignment, and Mixtral / Qwen3-MoE models against
transformers (logits, greedy output at TP 1 and 2, on the torch path and through the kernels)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything here imports triton

import json
from pathlib import Path

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from engine.layers.moe import FusedMoE
from engine.llm import LLM
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.weights import load_model
from kernels import _backend
from kernels.fused_moe import _gate_up_kernel, align_pairs, fused_moe_reference, fused_moe_triton
from kernels.fused_moe_gemv import GEMV_TILES
from tests.hf_reference import hf_greedy, hf_model, tiny_random_model_dir

assert isinstance(_gate_up_kernel, InterpretedFunction), "run the CPU kernel tests under TRITON_INTERPRET=1"


def moe_inputs(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    probs = torch.softmax(torch.randn(tokens, experts, generator=gen), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k"),
    [
        (1, 64, 32, 4, 2),  # decode: two pairs, each in a block of padding
        (3, 40, 24, 8, 1),  # odd sizes: masked columns and K tails
        (17, 64, 48, 4, 4),  # every expert chosen by most tokens
        (70, 32, 16, 8, 4),  # 280 pairs: prefill's 64-row blocks
        (5, 32, 16, 16, 2),  # more experts than pairs: most get none
        (8, 64, 32, 4, 2),  # 16 pairs, a block each with no alignment, experts repeated
        (260, 32, 24, 2, 2),  # 260 rows an expert: prefill's taller tiles
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernels_match_the_reference(tokens, hidden, inter, experts, top_k, dtype) -> None:
    x, w13, w2, weights, ids = moe_inputs(tokens, hidden, inter, experts, top_k, dtype, seed=tokens)
    expected = fused_moe_reference(x, w13, w2, weights, ids)
    got = fused_moe_triton(x, w13, w2, weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("tokens", "tiles"),
    [(1, (16, 32, 8, None, None, None)), (70, (16, 32, 8, None, None, None)), (300, (32, 64, 8, 128, 32, 3))],
)
def test_other_tiles_match_the_reference(tokens: int, tiles: tuple) -> None:
    """The tiles bench.moe --sweep times: narrower column blocks than the default, more warps; prefill's taller
    blocks, another K tile and pipeline depth."""
    from kernels.fused_moe import Tiles

    x, w13, w2, weights, ids = moe_inputs(tokens, 64, 48, 4, 2, torch.float16, seed=3)
    expected = fused_moe_reference(x, w13, w2, weights, ids)
    got = fused_moe_triton(x, w13, w2, weights, ids, Tiles(*tiles))
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


def int4_experts(experts: int, n: int, k: int, group: int, seed: int, act_order: bool = False):
    """Random int4 experts; act_order: each expert's layout rows a random permutation of its input features."""
    from kernels.fused_moe import Int4Experts
    from kernels.int4_dequant import pack_rows

    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (experts, k, n), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(experts, k // group, n, generator=gen) * 0.02 + 0.005).half()
    zeros = torch.randint(0, 16, (experts, k // group, n), generator=gen, dtype=torch.uint8)
    perm = (
        torch.stack([torch.randperm(k, generator=gen) for _ in range(experts)]).int() if act_order else None
    )
    return Int4Experts(torch.stack([pack_rows(q[e]) for e in range(experts)]), scales, zeros, group, perm)


@pytest.mark.parametrize(
    ("tokens", "group", "act_order"),
    [(1, 32, False), (6, 64, False), (70, 32, False), (6, 32, True), (70, 64, True)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int4_kernels_match_the_reference(
    tokens: int, group: int, act_order: bool, dtype: torch.dtype
) -> None:
    """Int4 experts (the rows layout, one scale and zero a group) dequantized in the kernels' registers; under act
    order x and the activations read through each expert's permutation."""
    hidden, inter, experts, top_k = 128, 64, 4, 2
    x, _, _, weights, ids = moe_inputs(tokens, hidden, inter, experts, top_k, dtype, seed=tokens)
    w13, w2 = (
        int4_experts(experts, 2 * inter, hidden, group, 1, act_order),
        int4_experts(experts, hidden, inter, group, 2, act_order),
    )
    assert w13.shape == (experts, 2 * inter, hidden) and w2.shape == (experts, hidden, inter)
    expected = fused_moe_reference(x, w13.dequantize(dtype), w2.dequantize(dtype), weights, ids)
    torch.testing.assert_close(fused_moe_reference(x, w13, w2, weights, ids), expected, atol=0, rtol=0)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(fused_moe_triton(x, w13, w2, weights, ids), expected, atol=tol, rtol=tol)


def int4_offset_experts(experts: int, n: int, k: int, seed: int):
    """GGUF Q4_1's form: float offsets in place of zero points, groups of 32."""
    from kernels.fused_moe import Int4Experts

    w = int4_experts(experts, n, k, 32, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    offsets = (torch.rand(w.zeros.shape, generator=gen) * -0.1).half()
    return Int4Experts(w.qweight, w.scales, offsets, 32)


def int8_experts(experts: int, n: int, k: int, seed: int):
    """GGUF Q8_0's form: int8 rows, an fp16 scale per 32 input features."""
    from kernels.fused_moe import Int8Experts

    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (experts, n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(experts, n, k // 32, generator=gen) * 0.002 + 0.0005).half()
    return Int8Experts(q, scales, 32)


@pytest.mark.parametrize("tokens", [1, 6, 70])
@pytest.mark.parametrize("kinds", [("q4_1", "q8_0"), ("q8_0", "q4_1"), ("q8_0", "dense")])
def test_gguf_expert_kinds_in_the_kernels_match_the_reference(tokens: int, kinds: tuple[str, str]) -> None:
    """GGUF experts kept quantized (Q4_1's offsets, Q8_0's int8 rows), each stack of its own kind."""
    hidden, inter, experts, top_k = 64, 96, 4, 2
    x, w13_dense, w2_dense, weights, ids = moe_inputs(
        tokens, hidden, inter, experts, top_k, torch.float16, tokens
    )
    make = {"q4_1": int4_offset_experts, "q8_0": int8_experts}
    w13 = make[kinds[0]](experts, 2 * inter, hidden, 1) if kinds[0] != "dense" else w13_dense
    w2 = make[kinds[1]](experts, hidden, inter, 2) if kinds[1] != "dense" else w2_dense
    assert w13.shape == (experts, 2 * inter, hidden) and w2.shape == (experts, hidden, inter)
    dense = [w if isinstance(w, torch.Tensor) else w.dequantize(torch.float16) for w in (w13, w2)]
    expected = fused_moe_reference(x, *dense, weights, ids)
    torch.testing.assert_close(fused_moe_reference(x, w13, w2, weights, ids), expected, atol=0, rtol=0)
    torch.testing.assert_close(fused_moe_triton(x, w13, w2, weights, ids), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("kinds", [("int4", "q8_0"), ("q8_0", "q4_1")])
@pytest.mark.parametrize("tiles", [(128, 128, 8, 128, None, 3), (64, 64, 4, 128, None, 4)])
def test_quantized_experts_at_prefill_tiles_match_the_reference(kinds: tuple[str, str], tiles: tuple) -> None:
    """Quantized stacks at tiles() picks for many rows an expert, the transposed tiles' columns past the outputs
    (gate and up 96 columns, down 160: blocks of 64 or 128 part-filled) masked."""
    from kernels.fused_moe import Tiles

    hidden, inter, experts, top_k = 160, 96, 2, 2
    x, _, _, weights, ids = moe_inputs(70, hidden, inter, experts, top_k, torch.float16, seed=11)
    make = {
        "int4": lambda n, k, seed: int4_experts(experts, n, k, 32, seed),
        "q4_1": lambda n, k, seed: int4_offset_experts(experts, n, k, seed),
        "q8_0": lambda n, k, seed: int8_experts(experts, n, k, seed),
    }
    w13, w2 = make[kinds[0]](2 * inter, hidden, 1), make[kinds[1]](hidden, inter, 2)
    expected = fused_moe_reference(
        x, w13.dequantize(torch.float16), w2.dequantize(torch.float16), weights, ids
    )
    got = fused_moe_triton(x, w13, w2, weights, ids, Tiles(*tiles), gemv=None)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


def test_quantized_expert_stacks_check_their_shapes() -> None:
    from kernels.fused_moe import Int4Experts, Int8Experts

    w = int4_experts(2, 16, 64, 32, 0)
    with pytest.raises(ValueError, match="zero points or float offsets"):
        Int4Experts(w.qweight, w.scales, w.zeros.to(torch.int32), 32)
    with pytest.raises(ValueError, match="scales are fp16 or fp32"):
        Int4Experts(w.qweight, w.scales.double(), w.zeros, 32)
    with pytest.raises(ValueError, match=r"perm must be \(2, 64\) int32"):
        Int4Experts(w.qweight, w.scales, w.zeros, 32, torch.zeros(2, 32, dtype=torch.int32))
    ordered = int4_experts(2, 16, 64, 32, 0, act_order=True)  # the same words, rows permuted
    assert ordered.perm is not None and torch.equal(ordered.qweight, w.qweight)
    for e in range(2):  # layout row j is input feature perm[e, j]
        assert torch.equal(
            ordered.dequantize(torch.float32)[e][:, ordered.perm[e].long()], w.dequantize(torch.float32)[e]
        )
    q = torch.zeros(2, 16, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"must be \(2, 16, 2\)"):
        Int8Experts(q, torch.zeros(2, 16, 3, dtype=torch.float16), 32)
    with pytest.raises(ValueError, match="int8 with fp16 or fp32 scales"):
        Int8Experts(q.float(), torch.zeros(2, 16, 2, dtype=torch.float16), 32)


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "renormalize", "round_to"),
    [(1, 128, 8, True, torch.bfloat16), (5, 60, 4, False, torch.float16), (9, 8, 2, True, None), (3, 6, 1, False, None)],
)  # fmt: skip
def test_route_kernel_matches_the_reference(tokens, experts, top_k, renormalize, round_to) -> None:
    """The router's softmax, top k, renormalising and rounding in one kernel (Qwen3-30B-A3B's 128 experts top 8,
    Qwen2-MoE's 60 top 4, Mixtral's 8 top 2), and expert parallelism's local ids."""
    from kernels import moe_route as fm

    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens)) * 3
    for first, held in ((0, experts), (experts // 2, experts // 2)):
        want_w, want_ids = fm.route_reference(logits, top_k, renormalize, round_to, first, held)
        got_w, got_ids = fm.route_triton(logits, top_k, renormalize, round_to, first, held)
        assert got_ids.dtype == torch.int32 and torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-6)
    assert set(want_ids.flatten().tolist()) <= set(range(held + 1))  # the other rank's choices at `held`


def test_route_kernel_breaks_ties_by_the_lowest_expert() -> None:
    from kernels import moe_route as fm

    logits = torch.tensor([[0.5, 2.0, 2.0, 2.0, 0.1]])
    weights, ids = fm.route_triton(logits, 2, True)
    assert ids.tolist() == [[1, 2]] and torch.allclose(weights, torch.tensor([[0.5, 0.5]]))


def test_choices_sum_in_one_kernel_as_the_reference_does(monkeypatch) -> None:
    from kernels import fused_moe as fm

    # fp16: the interpreter truncates bf16 stores
    per_choice = torch.randn(3, 8, 200, generator=torch.Generator().manual_seed(0)).half()
    want = fm._sum_choices(per_choice)
    monkeypatch.setattr(fm._backend, "use_triton", lambda t: True)
    assert torch.equal(fm._sum_choices(per_choice), want)


def test_every_token_on_one_expert() -> None:
    x, w13, w2, weights, _ = moe_inputs(20, 32, 16, 4, 2, torch.float32, seed=1)
    ids = torch.tensor([[2, 0]] * 20)  # expert 2's rows span two 16-row blocks; experts 1 and 3 idle
    torch.testing.assert_close(
        fused_moe_triton(x, w13, w2, weights, ids), fused_moe_reference(x, w13, w2, weights, ids)
    )


def test_alignment_sorts_pairs_into_one_expert_blocks() -> None:
    ids = torch.tensor([[3, 1], [1, 0], [3, 1], [1, 2], [1, 3]])  # expert 1: 5 pairs, 3: 3, 0: 1, 2: 1
    pair_ids, block_experts, used = align_pairs(ids, 4, rows=4)
    pairs = ids.numel()
    assert used.item() == 4 + 8 + 4 + 4  # each expert's pairs padded to whole 4-row blocks
    assert pair_ids.numel() == block_experts.numel() * 4 >= used.item()
    blocks = pair_ids[: used.item()].view(-1, 4)
    seen = []
    for expert, rows in zip(block_experts.tolist(), blocks.tolist()):
        real = [p for p in rows if p < pairs]
        assert real and all(ids.flatten()[p] == expert for p in real)
        assert real == sorted(real)  # pair order kept within an expert
        seen += real
    assert sorted(seen) == list(range(pairs))  # each pair once
    assert (pair_ids[used.item() :] == pairs).all()  # the worst-case tail is padding
    assert (block_experts[used.item() // 4 :] == 4).all()  # blocks past the ones in use name no expert


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_reference_equals_transformers_experts(tmp_path: Path, arch: str) -> None:
    """One MoE block, ours against transformers' on the same checkpoint (router, top k, experts, sum)."""
    model_dir = tiny_random_model_dir(tmp_path, arch)
    ours, config = load_model(model_dir)
    layer = 1  # a MoE layer in both (qwen3_moe's layer 0 is a dense MLP)
    theirs = hf_model(model_dir).model.layers[layer].mlp
    x = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = theirs(x[None])
        expected = (expected[0] if isinstance(expected, tuple) else expected)[0]
        torch.testing.assert_close(ours.model.layers[layer].mlp(x), expected, atol=1e-6, rtol=1e-5)


PROMPTS = [list(range(5, 45)), [7, 8, 9], [100, 101, 102, 103, 104, 105, 106]]
MAX_TOKENS = [12, 9, 7]


def moe_layers_on_the_kernels(monkeypatch) -> None:
    """The MoE layers take the Triton kernels (interpreted), quantized experts included; the rest of the model stays
    on torch."""
    import engine.layers.moe as moe

    class OnTriton:
        @staticmethod
        def use_triton(x: torch.Tensor) -> bool:
            return True

    monkeypatch.setattr(moe, "_backend", OnTriton)
    monkeypatch.setattr(moe, "fused_moe", fused_moe_triton)


def generate_from(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(path), device="cpu", dtype="float32", cpu_kv_cache_space=0.01, block_size=4)
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=6) for _ in prompts]
        return [
            o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        ]
    finally:
        llm.engine.shutdown()


def generate(model_dir: Path, tp: int = 1, **kwargs) -> list[list[int]]:
    llm = LLM(
        str(model_dir), device="cpu", dtype="float32", tensor_parallel_size=tp, cpu_kv_cache_space=0.01,
        block_size=4, **kwargs,
    )  # fmt: skip
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=n) for n in MAX_TOKENS]
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not llm.engine.scheduler.has_unfinished()
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_engine_greedy_equals_transformers(tmp_path: Path, arch: str) -> None:
    model_dir = tiny_random_model_dir(tmp_path, arch)
    assert generate(model_dir) == hf_greedy(model_dir, PROMPTS, MAX_TOKENS)


def test_engine_through_the_kernels_equals_transformers(tmp_path: Path, monkeypatch) -> None:
    """The MoE layers through the Triton kernels (interpreted), the rest of the model on torch."""
    import engine.layers.moe as moe

    calls: list[int] = []

    def kernels(x, *args, **kwargs):
        calls.append(x.shape[0])
        return fused_moe_triton(x, *args, **kwargs)

    monkeypatch.setattr(moe, "fused_moe", kernels)
    model_dir = tiny_random_model_dir(tmp_path, "mixtral")
    assert generate(model_dir) == hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert max(calls) > 1 and min(calls) >= 1  # prefill's many rows and decode's few both took them


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_router_beginning_with_the_norm_equals_transformers(tmp_path: Path, monkeypatch, arch: str) -> None:
    """One sequence at a time, so that every decode step has one row: the post-attention residual add and RMSNorm
    run in the router's kernel (kernels/gemv.py: add_norm_gemv, interpreted, in fp32 here)."""
    import engine.layers.moe as moe
    import kernels.gemv as gemv

    rows: list[int] = []

    def one_row(h: torch.Tensor, weight: torch.Tensor) -> bool:
        rows.append(h.shape[0])
        return h.shape[0] == 1

    monkeypatch.setattr(moe, "takes_add_norm_gemv", one_row)
    monkeypatch.setattr(gemv, "takes_add_norm_gemv", one_row)
    model_dir = tiny_random_model_dir(tmp_path, arch)
    assert generate(model_dir, max_num_seqs=1) == hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert rows.count(1) >= 2 * (sum(MAX_TOKENS) - len(MAX_TOKENS))  # each decode step's layers, twice each


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_tp2_equals_transformers(tmp_path: Path, arch: str) -> None:
    """Each rank holds half of every expert's intermediate features; the router is whole on both."""
    model_dir = tiny_random_model_dir(tmp_path, arch)
    assert generate(model_dir, tp=2) == hf_greedy(model_dir, PROMPTS, MAX_TOKENS)


def test_tp_must_divide_the_experts_features(tmp_path: Path) -> None:
    model_dir = tiny_random_model_dir(tmp_path, "qwen3_moe", moe_intermediate_size=45)
    with pytest.raises(
        ValueError, match=r"moe_intermediate_size \(45\) is not divisible by tensor_parallel_size 2"
    ):
        LLM(str(model_dir), device="cpu", dtype="float32", tensor_parallel_size=2)


def test_checkpoint_missing_an_expert_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = tiny_random_model_dir(tmp_path, "mixtral")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"missing tensors: model\.layers\.1\.block_sparse_moe\.experts\.3\.w2"
    ):
        load_model(model_dir)


def test_misshapen_expert_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = tiny_random_model_dir(tmp_path, "qwen3_moe")
    tensors = load_file(model_dir / "model.safetensors")
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    tensors[name] = tensors[name][:40].contiguous()
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"cannot load {name}: shape mismatch"):
        load_model(model_dir)


def test_bad_moe_configs_are_refused(tmp_path: Path) -> None:
    model_dir = tiny_random_model_dir(tmp_path, "mixtral")
    config = json.loads((model_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) exceeds num_experts \(4\)"):
        ModelConfig.from_dict({**config, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="num_experts must be positive"):
        ModelConfig.from_dict({**config, "num_local_experts": 0})


def _qwen3_moe_dict() -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "max_position_embeddings": 64, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "norm_topk_prob": True, "mlp_only_layers": [1],
    }  # fmt: skip


def test_config_round_trips_through_hf_dict(tmp_path: Path) -> None:
    config = ModelConfig.from_dict(_qwen3_moe_dict())
    assert [config.is_moe_layer(i) for i in range(2)] == [True, False]
    assert ModelConfig.from_dict(config.to_hf_dict()) == config
    qwen2 = ModelConfig.from_dir(tiny_random_model_dir(tmp_path, "qwen2_moe"))
    assert qwen2.shared_expert_intermediate_size == 96 and qwen2.attention_bias and not qwen2.o_proj_bias
    assert [qwen2.is_moe_layer(i) for i in range(2)] == [False, True]  # decoder_sparse_step 2
    assert ModelConfig.from_dict(qwen2.to_hf_dict()) == qwen2


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp16_paths_agree_with_fp32(monkeypatch, backend: str) -> None:
    """Either path in fp16 stays within fp16's rounding of the fp32 reference."""
    from kernels.fused_moe import fused_moe

    monkeypatch.setattr(_backend, "FORCED_BACKEND", backend)
    x, w13, w2, weights, ids = moe_inputs(4, 32, 16, 4, 2, torch.float16, seed=3)
    expected = fused_moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids).float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_gguf_moe_equals_transformers(tmp_path: Path, arch: str) -> None:
    """llama.cpp's MoE layout (Mixtral as llama with experts and permuted q/k; qwen2moe with its shared expert;
    qwen3moe): the expert stacks split per expert, the router and shared gate mapped back. llama.cpp's MoEs have
    experts in every layer, so the tiny Qwen MoEs do too here."""
    from tests.quant_checkpoints import write_moe_gguf

    every_layer = {"qwen2_moe": {"decoder_sparse_step": 1}, "qwen3_moe": {"mlp_only_layers": []}}
    model_dir = tiny_random_model_dir(tmp_path, arch, **every_layer.get(arch, {}))
    gguf_path = tmp_path / f"{arch}.gguf"
    write_moe_gguf(model_dir, gguf_path)
    model, config = load_model(gguf_path)
    ours, expected = load_model(model_dir)
    assert config.is_moe and all(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    for field in ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "shared_expert_intermediate_size", "attention_bias", "qk_norm"):  # fmt: skip
        assert getattr(config, field) == getattr(expected, field), field
    theirs = dict(ours.named_parameters())
    got = dict(model.named_parameters())
    assert got.keys() == theirs.keys()
    for name, a in got.items():
        assert torch.equal(a, theirs[name]), name
    prompts = [[5, 6, 7, 8, 9], [40, 41]]
    assert generate_from(gguf_path, prompts) == hf_greedy(model_dir, prompts, [6, 6])


@pytest.mark.parametrize(
    ("arch", "types", "kept"),
    [
        ("mixtral", ("Q4_0", "Q4_0", "Q8_0"), {"w13": "Int4Experts", "w2": "Int8Experts"}),
        ("qwen3_moe", ("Q8_0", "Q8_0", "Q4_1"), {"w13": "Int8Experts", "w2": "Int4Experts"}),
        ("qwen2_moe", ("Q4_1", "Q8_0", "Q4_1"), {"w2": "Int4Experts"}),  # gate and up differ: w13 dense
    ],
)
def test_gguf_moe_experts_stay_quantized(
    tmp_path: Path, monkeypatch, arch: str, types: tuple, kept: dict
) -> None:
    """A GGUF MoE's Q4_0 / Q4_1 / Q8_0 expert stacks load as int4 / int8 experts, not dense, and serve the greedy
    output transformers gives on the same file dequantized: on the CPU path and through the kernels."""
    from engine.bundled import gguf_model_dir
    from tests.quant_checkpoints import write_moe_gguf

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    sizes = {"qwen2_moe": {"decoder_sparse_step": 1}, "qwen3_moe": {"mlp_only_layers": []}}.get(arch, {})
    if arch != "mixtral":
        sizes["moe_intermediate_size"] = 64  # whole blocks of 32
    model_dir = tiny_random_model_dir(tmp_path, arch, **sizes)
    gguf_path = tmp_path / f"{arch}.gguf"
    write_moe_gguf(model_dir, gguf_path, dict(zip(("gate", "up", "down"), types)))
    model, _ = load_model(gguf_path)
    for layer in (m for m in model.modules() if isinstance(m, FusedMoE)):
        assert {name: type(w).__name__ for name, w in layer.quantized.items()} == kept
        assert ("w13" in kept) != hasattr(layer, "w13") and ("w2" in kept) != hasattr(layer, "w2")
    prompts = [[5, 6, 7, 8, 9], [40, 41]]
    expected = hf_greedy(gguf_model_dir(gguf_path), prompts, [6, 6])
    assert generate_from(gguf_path, prompts) == expected

    moe_layers_on_the_kernels(monkeypatch)
    assert generate_from(gguf_path, prompts) == expected


@pytest.mark.parametrize("parallel", ["tp", "ep"])
def test_gguf_moe_quantized_experts_at_tp2(tmp_path: Path, monkeypatch, parallel: str) -> None:
    """Under tensor parallelism each rank takes its rows of gate's and up's blocks and its blocks of down's input
    features; under expert parallelism its experts' blocks whole."""
    from engine.bundled import gguf_model_dir
    from tests.quant_checkpoints import write_moe_gguf

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    model_dir = tiny_random_model_dir(tmp_path, "mixtral")  # 128 intermediate features: 2 blocks a rank
    gguf_path = tmp_path / "mixtral.gguf"
    write_moe_gguf(model_dir, gguf_path, {"gate": "Q4_1", "up": "Q4_1", "down": "Q8_0"})
    kwargs = {"enable_expert_parallel": True} if parallel == "ep" else {}
    assert generate(gguf_path, tp=2, **kwargs) == hf_greedy(gguf_model_dir(gguf_path), PROMPTS, MAX_TOKENS)


def test_gguf_moe_experts_whose_blocks_split_across_ranks_load_dense(tmp_path: Path) -> None:
    from tests.quant_checkpoints import write_moe_gguf

    model_dir = tiny_random_model_dir(tmp_path, "qwen3_moe", mlp_only_layers=[], moe_intermediate_size=96)
    gguf_path = tmp_path / "qwen3_moe.gguf"
    write_moe_gguf(model_dir, gguf_path, {"down": "Q4_0", "gate": "Q4_0", "up": "Q4_0"})
    model, _ = load_model(gguf_path, tp_rank=0, tp_size=2)  # down: 48 features a rank, a block and a half
    for layer in (m for m in model.modules() if isinstance(m, FusedMoE)):
        assert set(layer.quantized) == {"w13"} and layer.w2.shape == (4, 64, 48)


def test_gguf_moe_k_quant_experts_stay_quantized(tmp_path: Path, monkeypatch) -> None:
    """Q4_K experts as int4 in groups of 32 with fp32 scales and offsets, Q6_K as int8 rows in groups of 16: the
    products llama.cpp's dequantization takes, so the engine equals transformers on the file dequantized by gguf."""
    from engine.bundled import gguf_model_dir
    from kernels.fused_moe import Int4Experts, Int8Experts
    from tests.quant_checkpoints import write_moe_gguf

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    model_dir = tiny_random_model_dir(tmp_path, "mixtral", hidden_size=256, intermediate_size=256)
    gguf_path = tmp_path / "mixtral.gguf"
    write_moe_gguf(model_dir, gguf_path, {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"})
    model, _ = load_model(gguf_path)
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert layers and all(
        isinstance(m.quantized["w13"], Int4Experts) and isinstance(m.quantized["w2"], Int8Experts)
        for m in layers
    )
    dense = load_model(gguf_model_dir(gguf_path))[0]
    for got, want in zip(layers, (m for m in dense.modules() if isinstance(m, FusedMoE))):
        x = torch.zeros(1)
        assert torch.equal(got.weights(x)[0], want.w13) and torch.equal(got.weights(x)[1], want.w2)
    prompts = [[5, 6, 7, 8, 9], [40, 41]]
    expected = hf_greedy(gguf_model_dir(gguf_path), prompts, [6, 6])
    assert generate_from(gguf_path, prompts) == expected

    moe_layers_on_the_kernels(monkeypatch)
    assert generate_from(gguf_path, prompts[1:]) == expected[1:]  # one prompt: the interpreter is slow


@pytest.mark.parametrize(("arch", "fmt"), [("mixtral", "awq"), ("qwen3_moe", "gptq"), ("qwen2_moe", "awq")])
def test_int4_moe_checkpoint_equals_transformers_on_its_dequantized_weights(
    tmp_path: Path, arch: str, fmt: str
) -> None:
    """An AWQ / GPTQ MoE checkpoint (experts, attention and the shared expert int4; routers dense) serves the
    greedy output transformers gives on the same checkpoint dequantized: on the CPU path, and with the MoE
    layers through the int4 kernels (interpreted)."""
    from tests.quant_checkpoints import dequantized_copy, write_int4_moe

    sizes = {} if arch == "mixtral" else {"moe_intermediate_size": 64}  # whole groups of 32
    checkpoint = write_int4_moe(tiny_random_model_dir(tmp_path, arch, **sizes), tmp_path / "int4", fmt)
    dense = dequantized_copy(checkpoint, tmp_path / "dense")
    expected = hf_greedy(dense, PROMPTS, MAX_TOKENS)
    assert generate(checkpoint) == expected
    model, _ = load_model(checkpoint)
    experts = next(m for m in model.modules() if isinstance(m, FusedMoE))
    assert experts.quantized["w13"].qweight.dtype == torch.int32
    params = dict(experts.named_parameters())  # the KV-sizing line's weight bytes count the int4 experts
    assert (
        params["w13_qweight"] is not None
        and params["w2_qweight"].data_ptr() == experts.quantized["w2"].qweight.data_ptr()
    )


def test_int4_moe_through_the_kernels(tmp_path: Path, monkeypatch) -> None:
    from tests.quant_checkpoints import dequantized_copy, write_int4_moe

    moe_layers_on_the_kernels(monkeypatch)
    checkpoint = write_int4_moe(tiny_random_model_dir(tmp_path, "mixtral"), tmp_path / "int4", "gptq")
    assert generate(checkpoint) == hf_greedy(
        dequantized_copy(checkpoint, tmp_path / "dense"), PROMPTS, MAX_TOKENS
    )


def test_int4_moe_routed_in_the_gate_up_gemv_equals_transformers(tmp_path: Path, monkeypatch) -> None:
    """Mixtral's int4 experts with decode's pairs routed inside the gate_up GEMV (kernels/fused_moe_gemv.py, its
    routing prologue), prefill's by the route first: the engine's greedy output is transformers'."""
    import kernels.fused_moe as fm
    from kernels.moe_route import Routing
    from tests.quant_checkpoints import dequantized_copy, write_int4_moe

    moe_layers_on_the_kernels(monkeypatch)
    monkeypatch.setattr(Routing, "in_kernel", lambda self: True)  # the interpreter's logits are on the CPU
    routed: list[bool] = []
    real = fm.gate_up_gemv

    def gate_up(*args, **kwargs):
        routed.append(args[5] is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(fm, "gate_up_gemv", gate_up)
    checkpoint = write_int4_moe(tiny_random_model_dir(tmp_path, "mixtral"), tmp_path / "int4", "awq")
    assert generate(checkpoint) == hf_greedy(
        dequantized_copy(checkpoint, tmp_path / "dense"), PROMPTS, MAX_TOKENS
    )
    assert routed and all(routed)


@pytest.fixture(scope="module")
def act_order(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """A tiny Mixtral quantized by GPTQ with act order (`pdserve quantize --desc-act`), and transformers' greedy
    tokens on it dequantized."""
    from engine.quantize import QuantizeConfig, quantize
    from tests.quant_checkpoints import dequantized_copy

    root = tmp_path_factory.mktemp("act_order")
    config = QuantizeConfig(
        str(tiny_random_model_dir(root, "mixtral")), str(root / "gptq"), method="gptq", group_size=32,
        desc_act=True, max_tokens=256,
    )  # fmt: skip
    checkpoint = quantize(config)
    return checkpoint, hf_greedy(dequantized_copy(checkpoint, root / "dense"), PROMPTS, MAX_TOKENS)


def test_gptq_act_order_experts_through_the_kernels(act_order, monkeypatch) -> None:
    """Each expert's rows sorted by group at load and x read through gate_up's permutation; down's permutation is
    folded into gate's and up's output features, so down has none."""
    checkpoint, expected = act_order
    model, _ = load_model(checkpoint)
    experts = next(m for m in model.modules() if isinstance(m, FusedMoE))
    perm = experts.quantized["w13"].perm
    assert perm is not None and not torch.equal(perm[0], torch.arange(perm.shape[1], dtype=torch.int32))
    assert experts.quantized["w2"].perm is None and "w2_perm" not in dict(experts.named_parameters())
    moe_layers_on_the_kernels(monkeypatch)
    assert generate(checkpoint) == expected


@pytest.mark.parametrize("tokens", [1, 9])  # the GEMVs' pairs; the grouped kernels' aligned blocks
def test_down_order_folded_into_gate_up_is_the_same_layer(tokens: int) -> None:
    """down_order_folded: gate's and up's output features in down's row order, down without its perm; the layer's
    output is unchanged, on the reference and through the kernels."""
    from kernels.fused_moe import down_order_folded

    hidden, inter, top_k = 64, 32, 2
    x, _, _, weights, ids = moe_inputs(tokens, hidden, inter, 2, top_k, torch.float32, seed=tokens + 20)
    w13 = int4_experts(2, 2 * inter, hidden, 32, 3, act_order=True)
    w2 = int4_experts(2, hidden, inter, 32, 4, act_order=True)
    f13, f2 = down_order_folded(w13, w2)
    assert f2.perm is None and f13.perm is not None and torch.equal(f13.perm, w13.perm)
    dense13, folded13 = w13.dequantize(torch.float32), f13.dequantize(torch.float32)
    assert w2.perm is not None
    for e in range(2):
        order = w2.perm[e].long()
        assert torch.equal(folded13[e], dense13[e][torch.cat([order, order + inter])])
        assert torch.equal(f2.dequantize(torch.float32)[e], w2.dequantize(torch.float32)[e][:, order])
    expected = fused_moe_reference(x, dense13, w2.dequantize(torch.float32), weights, ids)
    got = fused_moe_reference(x, folded13, f2.dequantize(torch.float32), weights, ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for gemv in (None, GEMV_TILES):
        got = fused_moe_triton(x, f13, f2, weights, ids, gemv=gemv)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_gptq_act_order_refusals(act_order, tmp_path: Path) -> None:
    """Gate and up must share one order; down's features split over ranks would need every rank's groups."""
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.layers.quant.config import QuantConfig

    split = FusedMoE(2, 64, 64, tp_rank=0, tp_size=2)
    split.quantize(QuantConfig("gptq", group_size=32, desc_act=True))
    for name, param in split.named_parameters():
        param.data.zero_()
        if name == "w13_g_idx":
            param.data.copy_(torch.arange(64) // 32)
    # rank 0 holds down's first 32 features, group 0 in group order; expert 1's has half its rows in group 1
    split.get_parameter("w2_g_idx").data[1, 0, :16] = 1
    with pytest.raises(ValueError, match=r"act order \(desc_act\) is not supported on experts' down projections "
                       r"split across ranks \(2\)"):  # fmt: skip
        split.process_weights()
    checkpoint, _ = act_order
    changed = Path(shutil.copytree(checkpoint, tmp_path / "changed"))
    tensors = load_file(changed / "model.safetensors")
    name = "model.layers.0.block_sparse_moe.experts.1.w3.g_idx"
    tensors[name] = (
        torch.arange(tensors[name].numel(), dtype=torch.int32) // 32
    )  # up's in group order, gate's not
    save_file(tensors, changed / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\..*expert 1's gate and up have different g_idx"):
        load_model(changed)


@pytest.mark.parametrize(("arch", "fmt"), [("mixtral", "gptq"), ("qwen2_moe", "awq")])
def test_int4_moe_at_tp2_equals_transformers(tmp_path: Path, arch: str, fmt: str) -> None:
    """Each rank holds its half of every int4 expert's intermediate features (whole groups of 32)."""
    from tests.quant_checkpoints import dequantized_copy, write_int4_moe

    if arch == "mixtral":
        sizes = {"intermediate_size": 256}
    else:  # the shared expert's 128 features too split into whole groups
        sizes = {"moe_intermediate_size": 64, "shared_expert_intermediate_size": 128}
    checkpoint = write_int4_moe(tiny_random_model_dir(tmp_path, arch, **sizes), tmp_path / "int4", fmt)
    expected = hf_greedy(dequantized_copy(checkpoint, tmp_path / "dense"), PROMPTS, MAX_TOKENS)
    assert generate(checkpoint, tp=2) == expected


def test_choices_of_experts_held_elsewhere_add_nothing() -> None:
    """Expert parallelism's convention: a choice of expert E or past it (another rank's) contributes zero, in the
    kernels as in the reference; the rest is the sum over the experts held here."""
    x, w13, w2, weights, ids = moe_inputs(9, 32, 16, 4, 2, torch.float32, seed=5)
    elsewhere = torch.where(
        ids >= 2, 2, ids
    )  # this rank holds experts 0 and 1 of 4 (local ids 0, 1; 2: not here)
    here = fused_moe_reference(x, w13[:2], w2[:2], weights, elsewhere)
    masked = torch.where(ids < 2, weights, torch.zeros_like(weights))
    torch.testing.assert_close(here, fused_moe_reference(x, w13, w2, masked, ids))
    torch.testing.assert_close(fused_moe_triton(x, w13[:2], w2[:2], weights, elsewhere), here)


@pytest.mark.parametrize("tokens", [3, 9])  # 6 pairs a block each; 18 pairs aligned in blocks
def test_act_order_rows_gathered_for_the_grouped_kernels(tokens: int) -> None:
    """Under act order the grouped kernels read each pair's row of x, and of the activation, copied into its expert's
    row order first (_gather_by_perm), with single-pair blocks and aligned ones, choices of experts held elsewhere
    among them; the GEMVs kept out."""
    hidden, inter, top_k = 64, 32, 2
    x, _, _, weights, ids = moe_inputs(tokens, hidden, inter, 4, top_k, torch.float32, seed=tokens)
    w13 = int4_experts(2, 2 * inter, hidden, 32, 1, act_order=True)
    w2 = int4_experts(2, hidden, inter, 32, 2, act_order=True)
    elsewhere = torch.where(ids >= 2, 2, ids)  # experts 0 and 1 of 4 held here
    dense = w13.dequantize(torch.float32), w2.dequantize(torch.float32)
    expected = fused_moe_reference(x, *dense, weights, elsewhere)
    assert (elsewhere == 2).any() and (elsewhere < 2).any()
    got = fused_moe_triton(x, w13, w2, weights, elsewhere, gemv=None)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_expert_parallel_at_tp2_equals_transformers(tmp_path: Path, arch: str) -> None:
    """enable_expert_parallel: each rank holds 2 of the 4 experts whole; the all-reduce sums both ranks' experts
    (and, for Qwen2-MoE, the shared expert, split as a dense MLP)."""
    model_dir = tiny_random_model_dir(tmp_path, arch)
    assert generate(model_dir, tp=2, enable_expert_parallel=True) == hf_greedy(model_dir, PROMPTS, MAX_TOKENS)


def test_expert_parallel_int4_and_shards(tmp_path: Path) -> None:
    from engine.layers.moe import FusedMoE
    from tests.quant_checkpoints import dequantized_copy, write_int4_moe

    model_dir = tiny_random_model_dir(tmp_path, "mixtral")
    model, _ = load_model(model_dir, tp_rank=1, tp_size=2, expert_parallel=True)
    experts = next(m for m in model.modules() if isinstance(m, FusedMoE))
    whole, _ = load_model(model_dir)
    full = next(m for m in whole.modules() if isinstance(m, FusedMoE))
    assert torch.equal(experts.w13, full.w13[2:]) and torch.equal(
        experts.w2, full.w2[2:]
    )  # rank 1: experts 2, 3
    checkpoint = write_int4_moe(model_dir, tmp_path / "int4", "awq")
    expected = hf_greedy(dequantized_copy(checkpoint, tmp_path / "dense"), PROMPTS, MAX_TOKENS)
    assert generate(checkpoint, tp=2, enable_expert_parallel=True) == expected


def test_expert_parallel_needs_whole_experts_per_rank(tmp_path: Path) -> None:
    model_dir = tiny_random_model_dir(tmp_path, "mixtral", num_local_experts=3)
    with pytest.raises(ValueError, match=r"num_experts \(3\) is not divisible by tensor_parallel_size 2"):
        LLM(
            str(model_dir), device="cpu", dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True
        )


def test_decode_sized_batches_skip_the_alignment(monkeypatch) -> None:
    """Up to SINGLE_PAIRS pairs each pair is a block of its own: align_pairs' ops do not run."""
    import kernels.fused_moe as fm

    def no_alignment(*args):
        raise AssertionError("aligned")

    monkeypatch.setattr(fm, "align_pairs", no_alignment)
    x, w13, w2, weights, ids = moe_inputs(fm.SINGLE_PAIRS // 2, 32, 16, 4, 2, torch.float32, seed=8)
    torch.testing.assert_close(
        fused_moe_triton(x, w13, w2, weights, ids), fused_moe_reference(x, w13, w2, weights, ids)
    )
    x, w13, w2, weights, ids = moe_inputs(fm.SINGLE_PAIRS // 2 + 1, 32, 16, 4, 2, torch.float32, seed=8)
    with pytest.raises(AssertionError, match="aligned"):
        fused_moe_triton(x, w13, w2, weights, ids)


def test_prefill_tiles_by_rows_an_expert_and_dtype() -> None:
    """Taller tiles from 128 rows an expert (quantized) or 256 (dense); fp32 activations, whose exact products
    spill at those tiles on sm_90, keep the default."""
    from kernels.fused_moe import Tiles, tiles

    assert tiles(8 * 127, 8, True) == Tiles() and tiles(8 * 255, 8, False) == Tiles()
    assert tiles(8 * 128, 8, True) == Tiles(64, 64, 4, block_m=128, stages=4)
    assert tiles(8 * 256, 8, True) == Tiles(128, 128, 8, block_m=128, stages=3)
    assert tiles(8 * 256, 8, False) == Tiles(128, 128, 8, block_m=128, block_k=64, stages=3)
    assert tiles(8 * 4096, 8, True, torch.float32) == Tiles() == tiles(8 * 4096, 8, False, torch.float32)
