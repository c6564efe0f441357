from __future__ import annotations

import os

import torch  # noqa: E402

# On CPU, Triton kernels run under the interpreter; set before anything imports triton.
# On a GPU machine (tests/gpu) they must run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402


def _patch_the_interpreter_once_a_launch() -> None:
    """Triton's interpreter patches triton.language around each launch, and again (never undone) at every call of a
    nested @triton.jit function: a third of an int4 MoE engine test's time. Within a launch a nested call whose
    modules the launch already patched skips the repeat; what runs is unchanged. Any other Triton: left alone."""
    try:
        import inspect
        import threading

        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    executor = getattr(interpreter, "GridExecutor", None)
    patch, grid_call = (
        getattr(interpreter, "_patch_lang", None),
        vars(executor).get("__call__") if executor else None,
    )
    if patch is None or grid_call is None:
        return
    local = threading.local()  # each thread's launches under way, outermost first

    def under_way() -> list[set[int]]:
        if not hasattr(local, "launches"):
            local.launches = []
        return local.launches

    def langs(fn: Any) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_once(fn: Any) -> Any:
        launches = under_way()
        if launches and langs(fn) <= launches[-1]:
            return None  # a nested call: its return value is not read
        scope = patch(fn)
        if launches:
            launches[-1] |= langs(fn)
        return scope

    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        launches = under_way()
        launches.append(set())
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._patch_lang = patch_once
    executor.__call__ = launch


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_interpreter_once_a_launch()


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def bundled_model_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (converted from the GGUF on first use)."""
    from engine.bundled import bundled_model_dir as convert

    return convert()


@pytest.fixture(scope="session")
def hf_bundled(bundled_model_dir: Path) -> Any:
    """transformers' model for the bundled directory, fp32 on CPU."""
    from tests.hf_reference import hf_model

    return hf_model(bundled_model_dir)


# Tests that start router / gateway processes and wait on their drains, restarts or deadlines (seconds
# each): `slow`, so `make test-fast` leaves them to `make test`. Kept here while their files are reworked;
# a `@pytest.mark.slow` in the file itself does the same.
PROCESS_TESTS = {
    "test_router_faults.py": {
        "test_redis_killed_then_restarted_empty",
        "test_redis_hung_by_sigstop",
        "test_huge_prompts_are_refused_early_and_do_not_starve_polls",
        "test_a_decode_worker_that_dies_and_returns_on_its_address",
        "test_sigterm_drains_streams_then_exits_cleanly",
        "test_an_emptied_redis_is_resynced_from_the_workers",
        "test_a_prefill_worker_restarted_with_a_new_epoch_is_resynced",
        "test_a_draining_worker_gets_nothing_new",
        "test_tokenizing_is_bounded_and_a_full_queue_refuses",
    },
    "test_gateway_limits.py": {
        "test_sigterm_lets_streams_finish_within_the_drain_timeout",
        "test_sigterm_past_the_drain_timeout_ends_streams_with_an_error_event",
        "test_a_second_signal_ends_the_drain_at_once",
    },
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        name = getattr(item, "originalname", item.name)
        if name in PROCESS_TESTS.get(item.path.name, ()):
            item.add_marker(pytest.mark.slow)
