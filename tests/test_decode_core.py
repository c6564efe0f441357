"""The decode worker's engine-side core, driven directly (no gRPC, no engine process): what leaves its
outbox, and when, for a prompt prefilled elsewhere."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from decode_worker.core import DecodeCore
from engine.sampling_params import SamplingParams
from kvtransfer import connect
from tests.hf_reference import tiny_worker_config


@pytest.fixture
def core(tmp_path: Path):
    core = DecodeCore(tiny_worker_config(tmp_path, "decode-test"))
    yield core
    core.receiver.close()


def kinds(out: list[tuple]) -> list[tuple[str, str]]:
    return [(m[0], m[1]) for m in out]


def prefill_elsewhere(core: DecodeCore, rid: str, dst: list[int], first_token: int) -> None:
    """What the prefill worker does for `rid`: write its blocks (any bytes will do here), then answer."""
    pool = torch.zeros_like(core.engine.runner.kv_cache)
    with connect(core.receiver.descriptor(), pool) as sender:
        sender.send(rid, list(range(len(dst))), dst)
    core.handle(("kv_done", rid, first_token, None, 0))


def test_first_token_and_prefill_requests_leave_before_a_forward_pass(core: DecodeCore) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    core.handle(("add", "r1", list(range(10, 30)), params, 0, None, True))
    out = core.step()
    assert kinds(out) == [("prefill", "r1")]  # the blocks are reserved and announced, no forward pass
    prefill_elsewhere(core, "r1", out[0][2], first_token=42)

    out = core.step()  # the first token goes out at once, not after the next decode step
    assert [(m[0], m[1], m[2]) for m in out] == [("tokens", "r1", 42)]
    assert core.scheduler.seqs["r1"].output_token_ids == [42]

    core.handle(("add", "r2", list(range(40, 60)), params, 0, None, True))
    out = core.step()  # just flushed: this step runs the batch; r2's announcement rides along
    assert kinds(out) == [("prefill", "r2"), ("tokens", "r1")]
    assert len(core.scheduler.seqs["r1"].output_token_ids) == 2

    out = core.step()  # nothing waiting to go out: a plain decode step
    assert kinds(out) == [("tokens", "r1")]


@pytest.mark.parametrize("bad", [-1, 10**9])
def test_token_ids_outside_the_vocabulary_as_the_server_sends_them(core: DecodeCore, bad: int) -> None:
    """The server hands the prompt over as an int array (checked as one); a bad id is refused and
    nothing is reserved."""
    free = core.blocks.num_free_blocks
    prompt = np.array([10, 11, bad, 12], dtype=np.int64)
    core.handle(("add", "r9", prompt, SamplingParams(max_tokens=4), 0, None, True))
    out = core.step()
    assert [(m[0], m[1], m[2]) for m in out] == [("error", "r9", "INVALID_ARGUMENT")]
    assert "vocabulary" in out[0][3] and str(bad) in out[0][3]
    assert core.blocks.num_free_blocks == free and not core.pending
