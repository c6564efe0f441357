"""Bad input gets a ValueError naming the problem, queues nothing, and the engine keeps serving."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(bundled_model_dir):
    return LLM(dtype="float32", device="cpu", cpu_kv_cache_space=0.1, max_model_len=256)


def no_leak(llm):
    bm = llm.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished_requests()


def test_prompt_over_max_model_len_names_both_numbers(llm):
    with pytest.raises(ValueError, match=r"300 tokens.*max_model_len is 256"):
        llm.generate({"prompt_token_ids": [5] * 300})
    assert no_leak(llm)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    """vLLM's truncate_prompt_tokens: a prompt past max_model_len runs as its last k tokens (-1: as many as
    max_model_len allows), exactly as those tokens alone; a shorter prompt runs whole."""
    long = llm.engine.tokenizer.encode("The sky is blue and the grass is green. " * 40)
    assert len(long) > 256
    greedy = SamplingParams(temperature=0, max_tokens=6)
    alone = llm.generate({"prompt_token_ids": long[-50:]}, greedy)[0]
    cut = llm.generate(
        {"prompt_token_ids": long}, SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=50)
    )
    text = llm.generate(
        "The sky is blue and the grass is green. " * 40,
        SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=50),
    )
    for out in (cut[0], text[0]):
        assert out.prompt_token_ids == long[-50:] and out.outputs[0].token_ids == alone.outputs[0].token_ids
    short = llm.generate(
        {"prompt_token_ids": long[:20]}, SamplingParams(max_tokens=2, truncate_prompt_tokens=50)
    )
    assert short[0].prompt_token_ids == long[:20]
    rid = llm.engine.add_request(long, SamplingParams(max_tokens=2, truncate_prompt_tokens=200))
    assert llm.engine.requests[rid].prompt_token_ids == long[-200:]
    llm.engine.abort_request(rid)
    with pytest.raises(ValueError, match="maximum context length|max_model_len"):  # 256 kept: no room left
        llm.generate({"prompt_token_ids": long}, SamplingParams(max_tokens=2, truncate_prompt_tokens=-1))
    with pytest.raises(
        ValueError, match=r"truncate_prompt_tokens \(300\) is greater than max_model_len \(256\)"
    ):
        llm.generate({"prompt_token_ids": long}, SamplingParams(truncate_prompt_tokens=300))
    assert no_leak(llm)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate("")
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []})


def test_token_ids_outside_the_vocabulary(llm):
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10**7]})


def test_a_bad_prompt_in_a_batch_runs_nothing(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["Hello there", ""], SamplingParams(max_tokens=3))
    assert no_leak(llm)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be at least 1, or -1"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_bad_sampling_params(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_engine_keeps_serving_around_a_bad_request(llm):
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=8)
    alone = llm.generate("The sky is", greedy)[0].outputs[0].token_ids
    rid = engine.add_request("The sky is", greedy)
    engine.step()  # the good request is running
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([7] * 400, greedy)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("again", greedy, request_id=rid)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done[rid].outputs[0].token_ids == alone
    assert no_leak(llm)


def test_abort_frees_blocks(llm):
    engine = llm.engine
    rid = engine.add_request("Count to one hundred:", SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    engine.abort_request(rid)
    assert no_leak(llm)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="does-not-exist"):
        LLM("/nonexistent/does-not-exist", device="cpu")


def test_corrupt_safetensors(tmp_path, bundled_model_dir):
    import shutil

    bad = tmp_path / "bad-model"
    bad.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled_model_dir / name, bad / name)
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json" + b"\x00" * 64)
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(bad), device="cpu")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 100)
    with pytest.raises(ValueError, match="broken.gguf"):
        LLM(str(bad), device="cpu")
