"""Structured output after a reasoning model's thinking (StructuredOutputsParams.reasoning, as vLLM holds it with a
reasoning parser): on a tiny model whose tokenizer has <think> and </think> as tokens of their own, the text is
free until </think> and held to the pattern after it; a prompt whose last marker is </think> (thinking off) is held
from its first token. Greedy output equals transformers' generate with a logits processor that waits the same."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.structured_output import THINK_MARKERS, GuideFactory, StructuredOutputsParams
from tests.hf_reference import GuideMask, hf_greedy, tiny_random_model_dir

THINK, END = 300, 301  # the markers' ids: the tokenizer's 300 tokens, then these two (the model has 304)


def with_think_tokens(tmp_path: Path) -> Path:
    """A tiny random model whose tokenizer has <think> and </think> as tokens of their own, kept in decoded text
    (Qwen3's are added tokens, not special ones)."""
    from tokenizers import AddedToken, Tokenizer

    model = tiny_random_model_dir(tmp_path, "llama", vocab_size=304)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in THINK_MARKERS])
    tok.save(str(model / "tokenizer.json"))
    assert [tok.token_to_id(m) for m in THINK_MARKERS] == [THINK, END]
    return model


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return with_think_tokens(tmp_path_factory.mktemp("think"))


PROMPTS = {
    "opens its thinking": [5, 6, 7, THINK],  # DeepSeek-R1's template: the model thinks first
    "names no marker": [5, 6, 7, 8],  # Qwen3 thinking: the model writes <think> itself
    "closed its thinking": [5, 6, THINK, END, 8],  # Qwen3 with enable_thinking off
}


@pytest.mark.parametrize("bias", [100.0, 1.5])  # </think> at once, or wherever the model reaches it
def test_the_pattern_holds_from_the_thinkings_end(model: Path, bias: float) -> None:
    so = StructuredOutputsParams(choice=["yes", "no"], reasoning=THINK_MARKERS)
    params = SamplingParams(temperature=0.0, max_tokens=24, logit_bias={END: bias}, structured_outputs=so)
    llm = LLM(str(model), device="cpu", dtype="float32", cpu_kv_cache_space=0.01)
    prompts = list(PROMPTS.values())
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    factory = GuideFactory(llm.engine.tokenizer, llm.engine.model_config.vocab_size)
    plain = StructuredOutputsParams(choice=["yes", "no"])
    extra = [
        {
            "sequence_bias": {(END,): bias},
            "logits_processor": [GuideMask(factory.guide(plain), len(p), after=None if END in p else END)],
        }
        for p in prompts
    ]
    want = hf_greedy(model, prompts, [24] * len(prompts), extra)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == want
    tok = llm.engine.tokenizer
    for (case, prompt), out in zip(PROMPTS.items(), got):
        if END in prompt:  # held from the first token: </think> is not "yes" or "no"
            assert END not in out and tok.decode(out, skip_special_tokens=True) in ("yes", "no"), case
        elif END in out:  # thought, then answered within the pattern
            after = out[out.index(END) + 1 :]
            assert tok.decode(after, skip_special_tokens=True) in ("yes", "no"), (case, out)
    if bias == 100.0:  # </think> is the first token wherever the text is free
        assert [out[0] == END for out in got] == [True, True, False]
    else:  # a free token, then </think> and the answer; a text that never ends its thinking runs free
        assert got[0].index(END) > 0 and END not in got[1] and len(got[1]) == 24
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_markers_that_are_not_tokens_are_refused(model: Path) -> None:
    llm = LLM(str(model), device="cpu", dtype="float32", cpu_kv_cache_space=0.01)
    so = StructuredOutputsParams(regex="[a-z]+", reasoning=("<reason>", "</reason>"))
    with pytest.raises(
        ValueError, match="reasoning marker '<reason>' is not a token of this model's vocabulary"
    ):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(structured_outputs=so))
    with pytest.raises(ValueError, match="reasoning must be two markers"):
        StructuredOutputsParams(regex="[a-z]+", reasoning=("<think>",))  # type: ignore[arg-type]


@pytest.mark.slow
def test_the_gateway_holds_a_reasoning_models_answer_after_its_thinking(model: Path) -> None:
    """Through the gateway (`--reasoning-parser deepseek_r1`) and the router, which says the tokenizer has the
    markers as tokens: the text thinks freely, then answers within the pattern; `reasoning` is the thinking,
    `content` the answer, both as transformers' greedy tokens give them."""
    import httpx

    from tests.cluster import openai_stack

    flags = ("--model", str(model), "--max-model-len", "256")
    with openai_stack(up_flags=flags, gateway_flags=("--reasoning-parser", "deepseek_r1")) as stack:
        body = {"model": stack.model, "messages": [{"role": "user", "content": "is the sky blue?"}],
                "max_tokens": 24, "temperature": 0, "logit_bias": {str(END): 1.9},
                "structured_outputs": {"choice": ["yes", "no"]}}  # fmt: skip
        got = stack.post("/v1/chat/completions", body).json()
        prompt = httpx.post(stack.url + "/tokenize", json={"messages": body["messages"]}).json()["tokens"]
    llm_tok = LLM(str(model), device="cpu", dtype="float32", cpu_kv_cache_space=0.01).engine.tokenizer
    factory = GuideFactory(llm_tok, 304)
    mask = GuideMask(factory.guide(StructuredOutputsParams(choice=["yes", "no"])), len(prompt), after=END)
    want = hf_greedy(model, [prompt], [24], [{"sequence_bias": {(END,): 1.9}, "logits_processor": [mask]}])[0]
    assert END in want, want  # the reference thinks, then answers
    cut = want.index(END)
    message = got["choices"][0]["message"]
    assert message["reasoning"] == llm_tok.decode(want[:cut], skip_special_tokens=True)
    assert message["content"] == llm_tok.decode(want[cut + 1 :], skip_special_tokens=True)
    assert message["content"] in ("yes", "no")
