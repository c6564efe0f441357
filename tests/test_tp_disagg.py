"""Prefill and decode workers at different tensor-parallel sizes, their engine-side cores driven directly
(no gRPC): the KV heads travel lane by lane between the ranks that hold them (kvtransfer/tp.py), and the
tokens equal transformers'. The lanes' routing and the receiver's head-by-head completion are checked on
bare pools too."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from decode_worker.core import DecodeCore
from engine.sampling_params import SamplingParams
from kvtransfer import KVTransferError, connect, create_receiver
from kvtransfer.layout import HeadRange, Lane
from kvtransfer.tp import Route, plan_routes
from prefill_worker.core import PrefillCore
from serving.messages.from_engine import BlocksReserved, Error, FirstToken, KVSent, Landed, Tokens
from serving.messages.to_engine import Admit, KVArrived, PrefillPrompt
from tests.hf_reference import hf_greedy, tiny_random_model_dir, tiny_worker_config

PROMPTS = [list(range(10, 50)), [3, 4, 5, 6, 7], list(range(60, 80))]
MAX_TOKENS = [6, 4, 5]


@contextlib.contextmanager
def cores(
    tmp_path: Path, prefill_tp: int, decode_tp: int, transport: str
) -> Iterator[tuple[PrefillCore, DecodeCore]]:
    def config(worker_id: str, tp: int):
        base = tiny_worker_config(tmp_path, worker_id, kv_transport=transport)
        return dataclasses.replace(base, engine=dataclasses.replace(base.engine, tensor_parallel_size=tp))

    prefill = PrefillCore(config("prefill-tp", prefill_tp))
    try:
        decode = DecodeCore(config("decode-tp", decode_tp))
    except BaseException:
        prefill.engine.shutdown()
        raise
    try:
        yield prefill, decode
    finally:
        for sender in prefill.senders.values():
            sender.close()
        decode.receiver.close()
        prefill.engine.shutdown()
        decode.engine.shutdown()


def disaggregated(prefill: PrefillCore, decode: DecodeCore) -> list[list[int]]:
    """Every prompt through decode -> prefill -> KV transfer -> decode, as the two servers pass messages."""
    descriptor = json.dumps(decode.receiver.descriptor())
    rids = [f"r{i}" for i in range(len(PROMPTS))]
    prompt = dict(zip(rids, PROMPTS))
    params = {r: SamplingParams(temperature=0.0, max_tokens=m) for r, m in zip(rids, MAX_TOKENS)}
    for rid in rids:
        decode.handle(Admit(rid, np.asarray(prompt[rid]), params[rid], prefill_remotely=True))
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    first: dict[str, FirstToken] = {}
    done: set[str] = set()
    deadline = time.monotonic() + 120
    while len(done) < len(rids):
        assert time.monotonic() < deadline, f"not done: {set(rids) - done}"
        for m in decode.step():
            assert not isinstance(m, Error), m
            if isinstance(m, BlocksReserved):
                ids = np.asarray(prompt[m.request_id])
                prefill.handle(
                    PrefillPrompt(
                        m.request_id,
                        ids,
                        params[m.request_id],
                        None,
                        descriptor,
                        m.block_ids,
                        kv_token=m.kv_token,
                    )
                )
            elif isinstance(m, Tokens):
                tokens[m.request_id] += m.token_ids
            if isinstance(m, (Tokens, Landed)) and m.finish_reason is not None:
                done.add(m.request_id)
        while prefill.has_work():
            for m in prefill.step():
                assert not isinstance(m, Error), m
                if isinstance(m, FirstToken):
                    first[m.request_id] = m
                    tokens[m.request_id].append(m.token_id)
                elif isinstance(m, KVSent):
                    f = first[m.request_id]
                    decode.handle(KVArrived(m.request_id, f.token_id, f.logprobs, f.num_cached_tokens))
    return [tokens[r] for r in rids]


def assert_no_leak(*cores_: PrefillCore | DecodeCore) -> None:
    for core in cores_:
        bm = core.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> list[list[int]]:
    return hf_greedy(tiny_random_model_dir(tmp_path_factory.mktemp("hf")), PROMPTS, MAX_TOKENS)


# prefill TP 2 into decode TP 1 over tcp runs as a cluster too (tests/test_tp_cluster.py)
@pytest.mark.parametrize(("prefill_tp", "decode_tp", "transport"), [(1, 2, "tcp"), (2, 1, "nccl")])
def test_prefill_and_decode_at_different_tp_equal_transformers(
    tmp_path: Path, expected, prefill_tp: int, decode_tp: int, transport: str
) -> None:
    # the tiny model: 2 KV heads, one on each rank of the TP 2 side
    with cores(tmp_path, prefill_tp, decode_tp, transport) as (prefill, decode):
        assert disaggregated(prefill, decode) == expected
        assert_no_leak(prefill, decode)
        if decode_tp > 1:
            check_rank_by_rank(decode, prefill.engine.runner.kv_cache)


def check_rank_by_rank(decode: DecodeCore, pool: torch.Tensor) -> None:
    """A decode worker at TP 2 (one KV head a rank): a request is complete once both ranks have their head,
    and a cancelled one is the caller's again once every rank has stopped it."""
    receiver = decode.receiver
    rank0, rank1 = receiver.descriptor()["tp"]["ranks"]
    receiver.expect("half", [1, 2])
    with connect(rank0, pool, lane=Lane(HeadRange(0, 1), HeadRange(0, 1))) as sender:
        sender.send("half", [3, 4], [1, 2])
    assert not receiver.poll("half")  # rank 1's head has not come
    with connect(rank1, pool, lane=Lane(HeadRange(1, 1), HeadRange(0, 1))) as sender:
        sender.send("half", [3, 4], [1, 2])
    deadline = time.monotonic() + 10
    while not receiver.poll("half"):  # rank 1's report crosses its pipe
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert torch.equal(decode.engine.runner.kv_cache[:, :, [1, 2]], pool[:, :, [3, 4], :, :1])
    # cancelled without waiting: the caller's at once if rank 1 has answered already, else once drained
    receiver.expect("gone", [5])
    if not receiver.cancel("gone", wait=False):
        while "gone" not in receiver.drained():
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert "gone" not in receiver.drained()
    with pytest.raises(KVTransferError, match="never expected"):
        receiver.poll("gone")


def test_routes_send_each_decode_rank_its_heads_from_a_holder() -> None:
    def lane(src: int, dst: int, n: int) -> Lane:
        return Lane(HeadRange(src, n), HeadRange(dst, n))

    eight = [range(0, 8)]
    halves = [range(0, 4), range(4, 8)]
    assert plan_routes(halves, eight) == [Route(0, 0, lane(0, 0, 4)), Route(1, 0, lane(0, 4, 4))]
    assert plan_routes(eight, halves) == [Route(0, 0, lane(0, 0, 4)), Route(0, 1, lane(4, 0, 4))]
    assert plan_routes(halves, halves) == [Route(0, 0, lane(0, 0, 4)), Route(1, 1, lane(0, 0, 4))]
    # 2 KV heads replicated over 4 prefill ranks, to 4 decode ranks: each decode rank from another holder
    replicated = [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [(r.src_rank, r.dst_rank) for r in plan_routes(replicated, replicated)] == [
        (0, 0),
        (1, 1),
        (2, 2),
        (3, 3),
    ]
    assert [(r.src_rank, r.lane) for r in plan_routes(replicated, [range(0, 2)])] == [
        (0, lane(0, 0, 1)),
        (2, lane(0, 1, 1)),
    ]


@pytest.mark.parametrize("transport", ["tcp", "nccl"])
def test_a_request_lands_once_its_lanes_covered_every_head(transport: str) -> None:
    pool = torch.randn(2, 2, 6, 4, 4, 3)  # (layers, K/V, blocks, block size, 4 KV heads, head dim)
    halves = [pool[:, :, :, :, :2].contiguous(), pool[:, :, :, :, 2:].contiguous()]  # two prefill ranks
    target = torch.zeros_like(pool)
    with create_receiver(transport, target) as receiver:
        senders = [
            connect(receiver.descriptor(), h, lane=Lane(HeadRange(0, 2), HeadRange(2 * i, 2)))
            for i, h in enumerate(halves)
        ]
        receiver.expect("r", [5, 0])
        senders[0].send("r", [1, 3], [5, 0])
        assert not receiver.poll("r")  # heads 2-3 have not come
        with pytest.raises(KVTransferError, match="already sent for these kv heads"):
            senders[0].send("r", [1, 3], [5, 0])
        senders[1].send("r", [1, 3], [5, 0])
        receiver.wait("r", timeout=10)
        assert torch.equal(target[:, :, [5, 0]], pool[:, :, [1, 3]])
        assert not target[:, :, [1, 2, 3, 4]].any()
        for s in senders:
            s.close()
