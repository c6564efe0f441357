"""Embeddings (engine/pooling.py): `LLM.embed` gives transformers' last-token hidden state, normalized or not,
through chunked prefill, prefix-cache hits and batches shared with generation; Matryoshka dimensions and
sentence-transformers pooler configs are honoured or refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, EmbeddingRequestOutput, PoolingParams, SamplingParams
from engine.sampling_params import embedding_params
from tests.hf_reference import hf_embedding, hf_greedy, tiny_random_model_dir

PROMPTS = [list(range(5, 45)), [7, 8, 9], [100, 101, 102, 103, 104, 105, 106]]  # the first: 40 tokens
ATOL = 1e-5


def make(model: Path, **kwargs) -> LLM:
    return LLM(str(model), device="cpu", dtype="float32", cpu_kv_cache_space=0.01, **kwargs)


def vectors(outs: list[EmbeddingRequestOutput]) -> list[torch.Tensor]:
    return [torch.tensor(o.outputs.embedding) for o in outs]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory) -> Path:
    return tiny_random_model_dir(tmp_path_factory.mktemp("embed"), request.param)


def test_embeddings_equal_transformers_last_token_state(tiny: Path) -> None:
    llm = make(tiny, max_num_batched_tokens=16)  # the 40-token prompt runs in three chunks
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS])
    assert [o.prompt_token_ids for o in outs] == PROMPTS and all(o.finished for o in outs)
    for got, prompt in zip(vectors(outs), PROMPTS):
        torch.testing.assert_close(got, hf_embedding(tiny, prompt), rtol=0, atol=ATOL)
        assert abs(float(got.norm()) - 1.0) < 1e-5
    raw = llm.embed({"prompt_token_ids": PROMPTS[2]}, PoolingParams(normalize=False))[0]
    torch.testing.assert_close(
        torch.tensor(raw.outputs.embedding),
        hf_embedding(tiny, PROMPTS[2], normalize=False),
        rtol=0,
        atol=ATOL,
    )
    assert raw.outputs.hidden_size == 64


def test_a_cached_prompt_embeds_the_same_and_blocks_come_back(tiny: Path) -> None:
    llm = make(tiny)
    first = llm.embed({"prompt_token_ids": PROMPTS[0]})[0]
    again = llm.embed({"prompt_token_ids": PROMPTS[0]})[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32  # two full blocks of 16
    torch.testing.assert_close(torch.tensor(again.outputs.embedding), torch.tensor(first.outputs.embedding))
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.scheduler.has_unfinished()
    counts = llm.engine.counters()  # vLLM's: prompt tokens, no generation, finished by stop
    assert counts["prompt_tokens"] == 2 * len(PROMPTS[0]) and counts["generation_tokens"] == 0
    assert counts["request_success/stop"] == 2


@pytest.mark.parametrize("overlapped", [False, True])
def test_embeddings_share_steps_with_generation(tiny: Path, overlapped: bool) -> None:
    llm = make(tiny, max_num_batched_tokens=24, async_scheduling=overlapped)
    engine = llm.engine
    gen = engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8))
    emb = [engine.add_request(p, embedding_params()) for p in PROMPTS]
    seqs = {rid: engine.requests[rid].seqs[0] for rid in emb}
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == gen and out.finished:
                tokens = out.outputs[0].token_ids
    assert tokens == hf_greedy(tiny, [PROMPTS[0]], [8])[0]
    for rid, prompt in zip(emb, PROMPTS):
        torch.testing.assert_close(
            torch.tensor(seqs[rid].embedding), hf_embedding(tiny, prompt), rtol=0, atol=ATOL
        )


def test_matryoshka_dimensions_and_sentence_transformers_configs(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        make(tiny).embed({"prompt_token_ids": PROMPTS[1]}, PoolingParams(dimensions=16))
    model = tmp_path / "matryoshka"
    model.mkdir()
    for f in tiny.iterdir():
        (model / f.name).symlink_to(f)
    (model / "config.json").unlink()
    config = json.loads((tiny / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32, 64]}))
    llm = make(model)
    out = llm.embed({"prompt_token_ids": PROMPTS[1]}, PoolingParams(dimensions=16))[0]
    want = torch.nn.functional.normalize(hf_embedding(tiny, PROMPTS[1], normalize=False)[:16], dim=-1)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, rtol=0, atol=ATOL)
    with pytest.raises(ValueError, match=r"dimensions 20 is not one this model gives: \[16, 32, 64\]"):
        llm.embed({"prompt_token_ids": PROMPTS[1]}, PoolingParams(dimensions=20))
    # sentence-transformers: a Pooling module without Normalize gives raw vectors; mean pooling is refused
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
    (model / "modules.json").write_text(json.dumps(modules))
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    raw = make(model).embed({"prompt_token_ids": PROMPTS[1]})[0]
    want = hf_embedding(tiny, PROMPTS[1], normalize=False)
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), want, rtol=0, atol=ATOL)
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    with pytest.raises(ValueError, match="pools by MEAN .* only LAST"):
        make(model).embed({"prompt_token_ids": PROMPTS[1]})
    with pytest.raises(ValueError, match="dimensions must be at least 1"):
        PoolingParams(dimensions=0)


def test_a_base_model_checkpoint_serves_embeddings_only(tmp_path: Path) -> None:
    """A checkpoint saved from the base model (Qwen2Model: tensors without `model.`, no LM head), as embedding
    models are published, loads; it embeds as the causal LM it came from does and refuses to generate."""
    from transformers import AutoModelForCausalLM

    tiny = tiny_random_model_dir(tmp_path, "qwen2")  # untied: the LM head is a tensor of its own
    base = tmp_path / "base"
    AutoModelForCausalLM.from_pretrained(tiny).model.save_pretrained(base)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (base / f).write_bytes((tiny / f).read_bytes())
    assert json.loads((base / "config.json").read_text())["architectures"] == ["Qwen2Model"]
    llm = make(base)
    got = vectors(llm.embed([{"prompt_token_ids": p} for p in PROMPTS]))
    for g, prompt in zip(got, PROMPTS):
        torch.testing.assert_close(g, hf_embedding(tiny, prompt), rtol=0, atol=ATOL)
    with pytest.raises(ValueError, match="base model with no LM head"):
        llm.generate({"prompt_token_ids": PROMPTS[1]})


def test_score_is_the_cosine_similarity_of_the_embeddings(tiny: Path) -> None:
    llm = make(tiny)
    ref = [hf_embedding(tiny, p) for p in PROMPTS]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    one_to_many = llm.score(prompts[0], prompts[1:])
    assert [o.prompt_token_ids for o in one_to_many] == [PROMPTS[0] + PROMPTS[1], PROMPTS[0] + PROMPTS[2]]
    for o, other in zip(one_to_many, ref[1:]):
        assert abs(o.outputs.score - float(ref[0] @ other)) < 1e-5
    pairwise = llm.score(prompts[:2], prompts[1:])
    assert abs(pairwise[1].outputs.score - float(ref[1] @ ref[2])) < 1e-5
    with pytest.raises(ValueError, match="give one text_1, or one per text_2"):
        llm.score(prompts[:2], prompts)
