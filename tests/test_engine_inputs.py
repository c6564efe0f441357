"""The engine's inputs built and checked without a model: engine_config from flat arguments, a prompt's
checks (engine/prompt_checks.py), a seeded request's completion params."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from engine.args import add_engine_args, engine_config, engine_kwargs
from engine.prompt_checks import check_prompt, fit_max_tokens
from engine.sampling_params import SamplingParams, completion_params


def test_each_argument_reaches_its_config() -> None:
    config = engine_config(
        model="m", dtype="float32", max_model_len=512, max_num_seqs=3, scheduling_policy="priority",
        block_size=32, cpu_kv_cache_space=0.5, num_gpu_blocks_override=7, served_model_name="x",
    )  # fmt: skip
    assert (config.model, config.dtype, config.max_model_len, config.served_model_name) == (
        "m",
        "float32",
        512,
        "x",
    )
    assert (config.scheduler.max_num_seqs, config.scheduler.scheduling_policy) == (3, "priority")
    assert config.scheduler.max_model_len == 512
    assert (
        config.cache.block_size,
        config.cache.cpu_kv_cache_space,
        config.cache.num_gpu_blocks_override,
    ) == (
        32,
        0.5,
        7,
    )
    with pytest.raises(TypeError, match="max_num_seq"):
        engine_config(max_num_seq=3)


def test_the_step_budget_defaults() -> None:
    assert engine_config().scheduler.max_num_batched_tokens == 8192
    assert engine_config(max_num_batched_tokens=100, max_model_len=64).scheduler.max_num_batched_tokens == 100
    unchunked = engine_config(enable_chunked_prefill=False, max_model_len=20000)
    assert unchunked.scheduler.max_num_batched_tokens == 20000  # a whole prompt fits in one step
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine_config(enable_chunked_prefill=False, max_num_batched_tokens=100, max_model_len=200)


def test_the_cli_flags_build_the_same_config_as_the_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(**engine_kwargs(parser.parse_args([]))) == engine_config()


@pytest.mark.parametrize("ids", [[5, 6, 7], np.array([5, 6, 7])])
def test_a_prompt_that_fits_passes(ids) -> None:
    check_prompt(ids, max_model_len=4, vocab_size=8)


@pytest.mark.parametrize(
    "ids, words",
    [
        ([], "the prompt is empty"),
        ([1, 2, 3, 4], "the prompt is 4 tokens long, but max_model_len is 4"),
        ([1, 8, -1], r"out of the vocabulary \[0, 8\): \[8, -1\]"),
        (np.array([1, 9]), r"out of the vocabulary \[0, 8\): \[9\]"),
    ],
)
def test_a_bad_prompt_is_named(ids, words) -> None:
    with pytest.raises(ValueError, match=words):
        check_prompt(ids, max_model_len=4, vocab_size=8)


def test_max_tokens_fits_beside_the_prompt() -> None:
    assert fit_max_tokens(10, None, 16) == 6
    assert fit_max_tokens(10, 6, 16) == 6
    with pytest.raises(ValueError, match=r"maximum context length is 16 tokens, but 17 were requested"):
        fit_max_tokens(10, 7, 16)


def test_seeded_completions_draw_from_consecutive_seeds() -> None:
    params = SamplingParams(n=3, seed=40, stop="end", temperature=0.7)
    children = [completion_params(params, i) for i in range(3)]
    assert children[0] is params
    assert [c.seed for c in children] == [40, 41, 42]
    assert all(c.stop_strings == ["end"] and c.temperature == 0.7 for c in children)
    unseeded = SamplingParams(n=2)
    assert completion_params(unseeded, 1) is unseeded
