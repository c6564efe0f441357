"""Speculative decoding (engine/spec_decode.py): the n-gram proposer, the config's checks, and verification
that keeps the target's greedy output token for token — against transformers on the bundled SmolLM2, and
against the plain engine with drafts that are partly wrong on purpose (rejections at every position,
stops inside a draft, preemption, prefix-cache hits), with no block left held."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import Sampler
from engine.spec_decode import SpeculativeConfig, accepted_length, ngram_propose
from tests.hf_reference import hf_greedy, tiny_random_model_dir


def test_ngram_proposes_what_followed_the_latest_longest_match():
    assert ngram_propose([1, 2, 3, 4, 1, 2], 2, 1, 3) == [3, 4]
    # the longest suffix wins over a later shorter one: [5, 1, 2] matched at 0, not [1, 2] at 5
    assert ngram_propose([5, 1, 2, 9, 8, 1, 2, 7, 5, 1, 2], 3, 1, 3) == [9, 8, 1]
    assert ngram_propose([1, 2, 7, 1, 2, 8, 1, 2], 1, 2, 2) == [8]  # the most recent match
    assert ngram_propose([1, 2, 3, 4], 3, 1, 3) == []  # nothing recurs
    assert ngram_propose([4, 4, 4], 5, 1, 2) == [4]  # only what exists after the match
    assert ngram_propose([3, 9, 3], 4, 2, 4) == []  # below prompt_lookup_min


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be in [1, 16]"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens must be in [1, 16]"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "speculative method 'eagle' is not available"),
        ({"method": "ngram"}, "speculative_config needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "unknown speculative_config keys"),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "1 <= min <= max",
        ),
    ],
)
def test_bad_configs_are_refused_with_a_clear_message(bad, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SpeculativeConfig.from_dict(bad)


# ---- exact on the bundled model ---------------------------------------------------------------------

TEXTS = [
    "Repeat after me: the red fox jumps over the lazy dog. The red fox jumps over the lazy dog. The red",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Copy this list: apples, pears, plums, figs. Again: apples, pears,",
    "The capital of France is",
    "Hello",
    "Once upon a time, in a land far away,",
    "A B C D E F G A B C D",
    "To be, or not to be, that is the question. To be, or not",
    "Translate to French: I like apples.",
    "Water boils at",
]
MAX_TOKENS = [24, 20, 16, 18, 9, 5, 14, 12, 16, 10, 7]


@pytest.fixture(scope="module")
def prompts(bundled_model_dir):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(bundled_model_dir)
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def expected(bundled_model_dir, prompts):
    return hf_greedy(bundled_model_dir, prompts, MAX_TOKENS)


@pytest.mark.slow  # the bundled model on CPU, three engines
@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "adaptive": False},
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "adaptive": False},
        {"method": "self_draft", "num_speculative_tokens": 3, "num_draft_layers": 20, "adaptive": False},
    ],
    ids=["ngram-2", "ngram-5", "self_draft-3"],
)
def test_greedy_equals_transformers_batched(bundled_model_dir, prompts, expected, spec):
    llm = LLM(
        dtype="float32", device="cpu", cpu_kv_cache_space=0.25, max_model_len=1024, speculative_config=spec
    )
    params = [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > 10 and stats.num_accepted_tokens < stats.num_draft_tokens
    # each request's own counts add up to the engine's
    metrics = [o.metrics for o in outs if o.metrics is not None]
    assert sum(m.spec_decode_num_accepted_tokens for m in metrics) == stats.num_accepted_tokens
    assert sum(m.spec_decode_num_draft_tokens for m in metrics) == stats.num_draft_tokens
    best = max(metrics, key=lambda m: m.spec_decode_acceptance_rate)
    assert best.spec_decode_acceptance_rate > 0.3 and best.spec_decode_mean_accepted_length > 1.3
    assert best.spec_decode_num_accepted_tokens_per_pos[0] >= best.spec_decode_num_accepted_tokens_per_pos[-1]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    # the prefix cache holds accepted tokens only: the same prompts again hit it and give the same tokens
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert any(o.num_cached_tokens > 0 for o in again)


# ---- drafts that are partly wrong, against the plain engine -------------------------------------------


class OracleProposer:
    """Drafts the plain engine's own continuation, with every `wrong`-th drafted token changed, so drafts
    are accepted up to a known point and rejected there."""

    def __init__(self, references: list[list[int]], k: int, wrong: int) -> None:
        self.references, self.k, self.wrong = references, k, wrong
        self.calls = 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        for ref in self.references:
            if ref[: len(tokens)] == tokens and len(ref) > len(tokens):
                draft = ref[len(tokens) : len(tokens) + min(k, self.k)]
                self.calls += 1
                return [
                    (t + 1) % 256 if (self.calls + i) % self.wrong == 0 else t for i, t in enumerate(draft)
                ]
        return []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_random_model_dir(tmp_path_factory.mktemp("spec"), "llama3_scaled")


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in (1, 7, 16, 33, 50, 90, 4)]


def engine(tiny, **kw) -> LLM:
    return LLM(str(tiny), device="cpu", dtype="float32", max_model_len=160, **kw)


def outputs(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def with_oracle(llm: LLM, prompts, reference, k: int, wrong: int) -> OracleProposer:
    oracle = OracleProposer([p + r[0] for p, r in zip(prompts, reference)], k, wrong)
    proposer = llm.engine.scheduler.proposer
    assert proposer is not None
    proposer.propose = oracle.propose  # type: ignore[method-assign]  # its drafts; its own length policy
    return oracle


@pytest.mark.parametrize("wrong", [2, 3, 100])
def test_partly_wrong_drafts_keep_the_plain_output(tiny, batch, wrong):
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (20, 31, 7, 40, 12, 25, 60)]
    plain = outputs(engine(tiny), batch, params)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    llm = engine(tiny, speculative_config=spec)
    oracle = with_oracle(llm, batch, plain, 4, wrong)
    assert outputs(llm, batch, params) == plain
    stats = llm.engine.scheduler.spec_stats
    assert oracle.calls > 10 and stats.num_accepted_tokens > 0
    if wrong == 100:  # nearly every draft right: most steps gain several tokens
        assert stats.mean_accepted_length > 3
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens
        assert len(stats.accepted_per_pos) == 4 and stats.accepted_per_pos[0] >= stats.accepted_per_pos[3]


def test_stops_inside_a_draft_end_the_request_there(tiny, batch):
    """A stop token, a stop string or max_tokens that falls inside an accepted draft ends the request on
    the same token as without speculation; nothing after it is returned."""
    free = outputs(engine(tiny), batch, [SamplingParams(temperature=0, max_tokens=40)] * len(batch))
    tok = engine(tiny).tokenizer
    params = [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[free[i][0][5]]) for i in range(3)]
    params += [
        SamplingParams(temperature=0, max_tokens=40, stop=[tok.decode(free[i][0][8:10])]) for i in (3, 4)
    ]
    params += [SamplingParams(temperature=0, max_tokens=m) for m in (3, 6)]
    plain = outputs(engine(tiny), batch, params)
    assert all(len(p[0]) < 40 for p in plain[:5])
    llm = engine(tiny, speculative_config={"method": "ngram", "num_speculative_tokens": 6, "adaptive": False})
    with_oracle(llm, batch, free, 6, 1000)  # drafts run past every stop
    assert outputs(llm, batch, params) == plain


def test_preemption_prefix_hits_and_mixed_batches(tiny, batch):
    """A small pool preempts speculating requests; shared prefixes hit the cache; seeded sampling and
    penalties (which never draft) share the batch; all as the plain engine, nothing held after."""
    shared = batch[5][:48]
    prompts = [shared + p for p in batch[:4]] + batch[4:]
    params = [SamplingParams(temperature=0, max_tokens=30)] * 5
    params += [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=5)]
    params += [SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.2)]
    kw = {"num_gpu_blocks_override": 26, "enable_prefix_caching": True}
    ref = engine(tiny, **kw)
    plain = outputs(ref, prompts, params)
    llm = engine(
        tiny, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}, **kw
    )
    with_oracle(llm, prompts, plain, 3, 3)
    assert outputs(llm, prompts, params) == plain
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.prefix_hits > 0
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_seeded_sampling_gives_the_same_tokens_with_speculation(tiny, batch):
    """Each position is sampled with the noise plain decoding uses there, so a seeded request draws the
    same tokens with a draft (right or wrong) as without one."""
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=24, seed=100 + i) for i in range(7)
    ]
    plain = outputs(engine(tiny), batch, params)
    ngram = engine(
        tiny, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    )
    with_oracle(ngram, batch, plain, 4, 3)
    assert outputs(ngram, batch, params) == plain
    assert ngram.engine.scheduler.spec_stats.num_accepted_tokens > 0
    spec = {"method": "self_draft", "num_speculative_tokens": 3, "num_draft_layers": 1, "adaptive": False}
    self_draft = engine(tiny, speculative_config=spec)
    assert outputs(self_draft, batch, params) == plain
    assert self_draft.engine.scheduler.spec_stats.num_drafts > 20


def test_self_draft_greedy_under_preemption_keeps_the_plain_output(tiny, batch):
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (20, 31, 7, 40, 12, 25, 60)]
    kw = {"num_gpu_blocks_override": 14, "enable_prefix_caching": True}
    ref = engine(tiny, **kw)
    plain = outputs(ref, batch, params)
    spec = {"method": "self_draft", "num_speculative_tokens": 4, "num_draft_layers": 1, "adaptive": False}
    llm = engine(tiny, speculative_config=spec, **kw)
    assert outputs(llm, batch, params) == plain
    assert ref.engine.scheduler.num_preemptions > 0 and llm.engine.scheduler.num_preemptions > 0
    with pytest.raises(ValueError, match="num_draft_layers must be fewer than the model's 2 layers"):
        engine(tiny, speculative_config={**spec, "num_draft_layers": 2})


def test_the_acceptance_rule_draws_from_the_target_distribution():
    """Many draws on a small vocabulary, as vLLM's rejection-sampler test does: a one-hot draft d at one
    position is accepted with probability p(d), and a rejected position gives a token from the residual
    p without d, renormalized; the token after an accepted draft follows the next position's p."""
    n, vocab = 40_000, 6
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, vocab, generator=g) * 1.5
    p = torch.softmax(logits / 0.9, dim=-1)
    d = int(p[0].argmax())  # a likely draft: both outcomes get many draws
    assert 0.2 < p[0, d] < 0.8
    rows = logits.repeat(n, 1)  # (2n, vocab): positions 10 and 11 of n requests
    params = [SamplingParams(temperature=0.9, seed=s) for s in range(n) for _ in range(2)]
    out = Sampler(0)(rows, params, [None] * (2 * n), positions=[10, 11] * n).token_ids
    kept = [out[2 * i : 2 * i + 2][: accepted_length([d], out[2 * i : 2 * i + 2]) + 1] for i in range(n)]
    accepted = [k for k in kept if len(k) == 2]
    assert abs(len(accepted) / n - p[0, d].item()) < 0.01
    residual = p[0].clone()
    residual[d] = 0
    residual /= residual.sum()
    rejected = torch.bincount(torch.tensor([k[0] for k in kept if len(k) == 1]), minlength=vocab).float()
    assert rejected[d] == 0
    assert (rejected / rejected.sum() - residual).abs().sum() < 0.03  # total variation x 2
    after = torch.bincount(torch.tensor([k[1] for k in accepted]), minlength=vocab).float()
    assert (after / after.sum() - p[1]).abs().sum() < 0.05


# ---- in the served stack ----------------------------------------------------------------------------


@pytest.mark.slow  # pdserve up with the bundled model, twice
@pytest.mark.parametrize(
    "flags",
    [
        [
            "--speculative-method",
            "ngram",
            "--num-speculative-tokens",
            "4",
            "--speculative-config",
            '{"adaptive": false}',
        ],
        [
            "--speculative-config",
            '{"method": "self_draft", "num_speculative_tokens": 3, "num_draft_layers": 20, "adaptive": false}',
        ],
        ["--speculative-config", '{"method": "draft_model", "num_speculative_tokens": 3, "adaptive": false}'],
    ],
    ids=["ngram", "self_draft", "draft_model"],
)
def test_decode_workers_speculate_exactly(bundled_model_dir, prompts, expected, flags):
    """1 prefill + 1 decode worker: the decode worker verifies drafts and streams several tokens at a
    time; the router's output is transformers' greedy output, usage counts every token, and a stop string
    inside a draft ends the text where the plain engine ends it."""
    import concurrent.futures

    from tests.cluster import collect, greedy_request, start_cluster

    if "draft_model" in flags[-1]:  # the model drafts for itself: its KV is computed on the decode worker
        spec = json.loads(flags[-1])
        flags = [flags[0], json.dumps({**spec, "model": str(bundled_model_dir)})]
    cluster = start_cluster(1, 1, "tcp", "--metrics", *flags)
    try:
        stub = cluster.stub()

        def one(i: int):
            responses = list(stub.Generate(greedy_request(prompts[i], MAX_TOKENS[i]), timeout=120))
            return collect(iter(responses)), max(len(r.token_ids) for r in responses)

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(one, range(len(prompts))))
        assert [r[0][0][0] for r in results] == expected
        assert [r[0][2].completion_tokens for r in results] == [len(e) for e in expected]
        assert max(r[1] for r in results) > 1  # accepted drafts: several tokens in one response
        # the repeated phrase is drafted, and accepted past the stop: the text ends before it all the same
        from engine.tokenizer import Tokenizer

        full = Tokenizer.from_dir(bundled_model_dir).decode(expected[0])
        stop = " ".join(full.split()[-4:-2])  # late in the text: reached with drafts accepted
        assert stop in full
        stopped = collect(stub.Generate(greedy_request(prompts[0], 24, stop=[stop]), timeout=120))
        assert stopped[1][0] == full[: full.index(stop)]
        assert stopped[2].completion_tokens < 24 and stopped[0][0] == expected[0][: len(stopped[0][0])]
        cluster.wait_all_blocks_free()
        decode = next(w for w in cluster.workers if w["role"] == "decode")
        counters = _spec_counters(decode["metrics_port"], min_drafts=1)
        drafts = counters["pdserve:spec_decode_num_drafts_total"]
        accepted = counters["pdserve:spec_decode_num_accepted_tokens_total"]
        assert 0 < accepted <= counters["pdserve:spec_decode_num_draft_tokens_total"]
        if "draft_model" in flags[-1]:  # its own draft, over a KV cache the decode worker computed
            assert accepted > 0.9 * counters["pdserve:spec_decode_num_draft_tokens_total"]
        else:
            assert accepted < counters["pdserve:spec_decode_num_draft_tokens_total"]
        assert counters['pdserve:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] <= drafts
    finally:
        cluster.stop()


def _spec_counters(port: int, min_drafts: int, timeout: float = 10.0) -> dict[str, float]:
    """The decode worker's spec_decode counter samples (name with labels other than model_name -> value),
    once they show at least `min_drafts` drafts (its engine reports every 0.1 s)."""
    import re
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        samples = {}
        for line in text.splitlines():
            m = re.match(r'(pdserve:spec_decode_\w+)\{model_name="[^"]*"(,position="\d+")?\} (\S+)', line)
            if m:
                label = "{" + m.group(2)[1:] + "}" if m.group(2) else ""
                samples[m.group(1) + label] = float(m.group(3))
        if (
            samples.get("pdserve:spec_decode_num_drafts_total", 0) >= min_drafts
            or time.monotonic() > deadline
        ):
            return samples
        time.sleep(0.1)


# ---- adaptive draft lengths -----------------------------------------------------------------------------


def test_step_cost_interpolates_and_gives_the_marginal_cost():
    from engine.spec_decode import StepCost

    cost = StepCost()
    assert cost.time(10) is None and cost.slope(10) is None
    for n, t in ((1, 0.010), (64, 0.011), (256, 0.020), (1024, 0.060)):
        cost.observe(n, t)
    assert cost.time(64) == pytest.approx(0.011)
    assert cost.time(160) == pytest.approx(0.0155)  # halfway between 64 and 256
    assert cost.slope(300) == pytest.approx(0.040 / 768)  # nearest: 256 and 1024 tokens
    assert cost.slope(8) == pytest.approx(0.001 / 63)


def test_draft_lengths_follow_acceptance_and_cost():
    from engine.spec_decode import Proposer, SpecDecodeStats

    proposer = Proposer(SpeculativeConfig(num_speculative_tokens=5))
    good, poor = SpecDecodeStats(acceptance=0.9), SpecDecodeStats(acceptance=0.2)
    assert proposer.threshold(8, 8) == 0.0  # nothing measured yet: every draft pays
    assert proposer.length(poor, 0.0, room=5) == 5 and proposer.length(good, 0.0, room=3) == 3
    for n in (8, 16, 32, 64):  # memory-bound: 16 tokens cost little more than 8
        proposer.cost.observe(n, 0.010 + n * 1e-5)
    t = proposer.threshold(8, 8)
    assert 0 < t < 0.02
    assert t == pytest.approx(1e-5 * 8 / 0.01008)  # marginal cost x rows / step time
    # 0.2^3 = 0.008 clears it, 0.2^4 does not; 0.9^5 clears it easily
    assert proposer.length(good, t, room=5) == 5 and proposer.length(poor, t, room=5) == 3
    busy = Proposer(SpeculativeConfig(num_speculative_tokens=5))
    for n in (64, 128, 256, 512):  # compute-bound: time grows with every token
        busy.cost.observe(n, n * 1e-4)
    assert busy.threshold(256, 256) == pytest.approx(1.0)
    assert busy.length(good, busy.threshold(256, 256), room=5) == 0  # no draft pays: plain decode
    # a self-draft pass costs a third of a step, shared by the rows drafting: poor drafts stop
    cfg = SpeculativeConfig(method="self_draft", num_speculative_tokens=3, num_draft_layers=10)
    layered = Proposer(cfg, draft_cost_fraction=1 / 3)
    assert layered.threshold(8, 8, num_drafting=8) == pytest.approx(1 / 3)
    assert layered.threshold(8, 8, num_drafting=2) == pytest.approx(4 / 3)
    assert layered.length(poor, 1 / 3, room=3) == 0 and layered.length(good, 1 / 3, room=3) == 3
    fixed = Proposer(SpeculativeConfig(num_speculative_tokens=5, adaptive=False))
    fixed.cost.observe(64, 1.0), fixed.cost.observe(512, 100.0)
    assert fixed.length(poor, fixed.threshold(256, 256), room=4) == 4


def test_drafting_steps_in_order_only_while_its_gain_beats_the_overlap_it_loses():
    """A drafting step runs in order; the scheduler drafts only while its rows' expected gain (acceptance
    per depth, times how often lookups find a draft) is at least the tokens stepping in order loses against
    overlapped steps, both step times measured at the batch's size (the overlapped one first)."""
    from engine.block_hash import extra_keys
    from engine.block_manager import BlockManager
    from engine.config import SchedulerConfig
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence
    from engine.spec_decode import Proposer, SpecDecodeStats

    proposer = Proposer(SpeculativeConfig(num_speculative_tokens=4))
    good, poor = SpecDecodeStats(acceptance=0.9), SpecDecodeStats(acceptance=0.2)
    assert proposer.expected_gain(good, 0.0, 4) == pytest.approx(0.9 + 0.9**2 + 0.9**3 + 0.9**4)
    assert proposer.expected_gain(poor, 0.0, 2) == pytest.approx(0.2 + 0.04)
    assert proposer.in_order_cost(64) is None  # the overlapped step is not measured: measure it first
    proposer.overlapped.observe(64, 0.006)
    assert proposer.in_order_cost(64) == 0.0  # nor the in-order one yet
    proposer.in_order.observe(100, 0.009)  # the same bucket (64..127 rows)
    assert proposer.in_order_cost(64) == pytest.approx(64 * 0.003 / 0.006)  # 32 tokens lost
    assert proposer.in_order_cost(16) is None  # another batch size
    assert Proposer(SpeculativeConfig(adaptive=False)).in_order_cost(64) == 0.0

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=512), BlockManager(256, 16), {0}, proposer)
    rows = [
        Sequence(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=9), 16, extra_keys("m")) for i in range(64)
    ]
    for seq in rows:
        sched.add(seq)
    out = sched.schedule()
    sched.postprocess(out, {it.request_id: [8] for it in out.scheduled})
    for seq in rows:
        seq.spec_stats = SpecDecodeStats(acceptance=0.5)
    assert sched.would_draft() is True  # 64 x (0.5 + 0.25 + 0.125 + 0.0625) = 60 tokens against 32
    for seq in rows:
        seq.spec_stats = SpecDecodeStats(acceptance=0.3)
    assert sched.would_draft() is False  # 64 x 0.42 = 27 tokens: overlapped plain steps gain more
    for seq in rows:
        seq.spec_stats = SpecDecodeStats(acceptance=0.5)
        for _ in range(3):  # n-gram lookups that found nothing
            seq.spec_stats.observe_lookup(False)
    assert sched.would_draft() is False  # 60 x 0.343 = 21 tokens
    for seq in rows:  # 60 steps later the estimates have come most of the way back to the prior: try again
        seq.spec_stats.tried_at = sched.num_steps - 60
    assert sched.would_draft() is True


def test_a_step_where_drafts_do_not_pay_is_a_plain_decode_step(tiny, batch):
    """With a cost where every token costs its share, the adaptive policy drafts nothing in a decode step,
    which is then exactly the plain engine's (rows of one token, graphed where graphs exist)."""
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (20, 31, 7, 40, 12, 25, 60)]
    plain = outputs(engine(tiny), batch, params)
    llm = engine(tiny, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    proposer = llm.engine.scheduler.proposer
    for n in (4, 8, 16, 32, 64, 128, 256):
        proposer.cost.observe(n, n * 1e-3)
    proposer.cost.observe = lambda n, t: None  # type: ignore[method-assign]  # keep this cost
    with_oracle(llm, batch, plain, 4, 1000)  # drafts that would all be accepted
    steps = []
    schedule = llm.engine.scheduler.schedule
    llm.engine.scheduler.schedule = lambda **kw: steps.append(schedule(**kw)) or steps[-1]  # type: ignore[method-assign]
    assert outputs(llm, batch, params) == plain
    decode_only = [s for s in steps if all(len(it.token_ids) - it.num_draft == 1 for it in s.scheduled)]
    assert len(decode_only) > 30
    assert all(it.num_draft == 0 for s in decode_only for it in s.scheduled)
    # a draft may still pay beside a long prefill chunk, whose time it hardly adds to
    prefill_steps = len(steps) - len(decode_only)
    assert llm.engine.scheduler.spec_stats.num_drafts <= prefill_steps * len(batch)


def test_plain_steps_overlap_and_drafting_resumes_when_it_pays(tiny, batch):
    """Where no request would gain from a draft, a speculating engine overlaps its plain steps (queued
    before the last one's tokens are read); as the batch shrinks and drafts pay again it steps in order
    and drafts. Greedy output is the plain engine's across the switches, nothing held after."""
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (20, 31, 7, 40, 12, 25, 60)]
    plain = outputs(engine(tiny), batch, params)
    llm = engine(tiny, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    proposer = llm.engine.scheduler.proposer
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):  # a step of n tokens takes 1 + n/2: each token is dear
        proposer.cost.observe(n, 1.0 + 0.5 * n)
    proposer.cost.observe = lambda n, t: None  # type: ignore[method-assign]  # keep this cost
    with_oracle(llm, batch, plain, 4, 3)
    runner, launches = llm.engine.runner, []
    launch = runner.launch
    runner.launch = lambda *a, **kw: launches.append(1) or launch(*a, **kw)  # type: ignore[method-assign]
    assert llm.engine.scheduler.would_draft() is False  # nothing runs yet
    assert outputs(llm, batch, params) == plain
    stats = llm.engine.scheduler.spec_stats
    assert len(launches) > 10  # 7 rows: a draft's 0.7 prior is under the threshold 3.5 / 4.5, so overlapped
    assert stats.num_drafts > 10 and stats.num_accepted_tokens > 0  # a row or two left: drafts pay
    assert llm.engine.in_flight is False


def test_verification_replays_the_decode_graphs_as_one_row_per_position(tiny, batch):
    """A verification step replays the decode graphs (here their static-buffer stand-in on the CPU), each
    row's k + 1 positions as k + 1 decode rows: one request at a time verifying 3-token drafts uses the
    4-row bucket, and every token is the plain engine's; self_draft's drafts (written into the replayed
    inputs on the device) too."""
    from engine.attention import DecodeGraphPlan
    from tests.test_cuda_graph import with_static_graphs

    params = [SamplingParams(temperature=0, max_tokens=m) for m in (20, 31, 7, 40, 12, 25, 60)]
    plain = outputs(engine(tiny), batch, params)
    classes = [DecodeGraphPlan(160, 1, 0)]
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
        {"method": "self_draft", "num_speculative_tokens": 3, "num_draft_layers": 1, "adaptive": False},
    ):
        llm = engine(tiny, speculative_config=spec)
        graphs = with_static_graphs(llm, [1, 2, 4, 8, 16, 32], plans=lambda b: classes)
        if spec["method"] == "ngram":
            with_oracle(llm, batch, plain, 3, 3)
        got = [outputs(llm, [p], [sp])[0] for p, sp in zip(batch, params)]  # one request at a time
        assert got == plain
        stats = llm.engine.scheduler.spec_stats
        assert stats.num_drafts > 20 and stats.num_accepted_tokens > 0
        assert graphs.replay_counts[(4, 0)] > 20  # one row + its 3 drafted positions
        assert outputs(llm, batch, params) == plain  # and the whole batch at once: 7 x 4 rows, bucket 32
        assert graphs.replay_counts[(32, 0)] > 0


# ---- a separate draft model -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """Another random model with the tiny models' tokenizer, and its copy that holds only 64 positions."""
    import json
    import shutil

    draft = tiny_random_model_dir(tmp_path_factory.mktemp("draft"), "llama", seed=7)
    short = draft.parent / "tiny-short"
    shutil.copytree(draft, short)
    config = json.loads((short / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (short / "config.json").write_text(json.dumps(config))
    return draft, short


def test_draft_model_keeps_the_plain_output(tiny, tiny_draft, batch):
    """With the target as its own draft every draft is accepted (so the draft's KV cache, caught up lazily
    on the shared block tables, is right); with another model's drafts, or one that holds fewer
    positions than the target, and under preemption and prefix-cache hits, the output is the plain one."""
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (20, 31, 7, 40, 12, 25, 60)]
    kw = {"num_gpu_blocks_override": 12, "enable_prefix_caching": True}
    ref = engine(tiny, **kw)
    shared = batch[5][:40]
    prompts = [shared + p for p in batch[:3]] + batch[3:]
    plain = outputs(ref, prompts, params)
    assert ref.engine.scheduler.num_preemptions > 0
    for draft, everything in ((str(tiny), True), (str(tiny_draft[0]), False), (str(tiny_draft[1]), False)):
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "adaptive": False}
        llm = engine(tiny, speculative_config=spec, **kw)
        assert outputs(llm, prompts, params) == plain
        stats = llm.engine.scheduler.spec_stats
        assert stats.num_drafts > 20
        proposer = llm.engine.scheduler.proposer
        assert proposer is not None
        # a pass costs the draft's share of the target's parameters: all of them for the target itself;
        # the other drafts share its shape but tie their embeddings, which the target does not
        assert proposer.draft_cost_fraction == 1.0 if everything else 0.5 < proposer.draft_cost_fraction < 1.0
        if everything:
            assert stats.acceptance_rate > 0.95
        assert llm.engine.block_manager.prefix_hits > 0
    # the short draft drafts only below its 64 positions
    assert llm.engine.runner.draft is not None and llm.engine.runner.draft.max_model_len == 64


def test_a_draft_models_kv_follows_overlapped_plain_steps(tiny, batch):
    """Where the policy drafts nothing the engine overlaps its steps, and the draft computes nothing: when
    drafting resumes it catches up on the positions those steps computed, as one chunk. With the target as
    its own draft, every draft after such a stretch of plain steps is then accepted."""
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True) for _ in range(3)]
    plain = [tokens for tokens, _, _ in outputs(engine(tiny), batch[1:4], params)]
    spec = {"method": "draft_model", "model": str(tiny), "num_speculative_tokens": 3, "adaptive": False}
    llm = engine(tiny, speculative_config=spec)
    proposer = llm.engine.scheduler.proposer
    assert proposer is not None and llm.engine.config.async_scheduling
    draft_now, overlapped = {"on": False}, {"steps": 0}
    length, step_overlapped = proposer.length, llm.engine.step_overlapped

    def gated_length(stats, threshold, room):
        return length(stats, threshold, room) if draft_now["on"] else 0

    def counted(*args, **kwargs):
        overlapped["steps"] += 1
        return step_overlapped(*args, **kwargs)

    proposer.length = gated_length  # plain steps first (overlapped), then drafts over what they computed
    llm.engine.step_overlapped = counted
    draft = llm.engine.runner.draft
    assert draft is not None
    passes = {"plain": 0, "drafting": 0}
    draft.model.register_forward_hook(lambda *_: passes.__setitem__(phase(), passes[phase()] + 1))

    def phase() -> str:
        return "drafting" if draft_now["on"] else "plain"

    for i, (prompt, p) in enumerate(zip(batch[1:4], params, strict=True)):
        llm.engine.add_request(prompt, p, request_id=str(i))
    done: dict[str, list[int]] = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        draft_now["on"] = overlapped["steps"] >= 20
    assert overlapped["steps"] >= 20
    assert [done[str(i)] for i in range(3)] == plain
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_drafts > 5 and stats.acceptance_rate > 0.95, stats
    assert passes["plain"] == 0  # steps that draft nothing run no draft pass, prompts' included
    assert passes["drafting"] > 0


def test_held_slots_follow_block_generations():
    """What a draft's cache holds is kept per block: leading slots, contiguous; a block taken again for
    new contents holds nothing, a prefix hit on a block keeps what it held."""
    from engine.block_manager import BlockManager
    from engine.model_runner import HeldSlots
    from engine.sequence import Sequence

    blocks = BlockManager(6, 4)
    held = HeldSlots(6, 4)
    held.generations = blocks.generations
    first = Sequence("a", list(range(10)), SamplingParams(max_tokens=4), 4)
    assert blocks.allocate(first, 10)
    table = first.block_table
    assert held.length(table, 10) == 0
    held.mark(table, 0, 6)
    assert held.length(table, 10) == 6 and held.length(table, 5) == 5
    held.mark(table, 6, 10)
    assert held.length(table, 10) == 10
    held.mark(table, 0, 3)  # writing again what is held keeps what lies past it
    assert held.length(table, 10) == 10
    first.num_computed_tokens = 10
    blocks.cache_computed_blocks(first)  # its two full blocks are cached
    blocks.free(first)
    second = Sequence("b", list(range(8)) + [99, 98], SamplingParams(max_tokens=4), 4)
    hits = blocks.match_prefix(second)
    assert hits == table[:2]
    blocks.allocate_prefix(second, hits)
    assert blocks.allocate(second, 10)
    assert second.block_table[:2] == table[:2]
    assert held.length(second.block_table, 10) == 8  # the hits hold theirs; the new third block nothing
    others = Sequence("c", [7] * 24, SamplingParams(max_tokens=4), 4)
    blocks.free(second)
    assert blocks.allocate(others, 24)  # every block taken for new contents
    assert held.length(others.block_table, 24) == 0


def test_a_draft_with_another_tokenizer_is_refused_at_start_up(tiny, bundled_model_dir):
    spec = {"method": "draft_model", "model": str(bundled_model_dir), "num_speculative_tokens": 3}
    with pytest.raises(ValueError) as err:
        engine(tiny, speculative_config=spec)
    message = str(err.value)
    assert "does not share the target 'tiny-llama3_scaled'" in message and "vocabulary sizes" in message
    assert repr(bundled_model_dir.name) in message
    with pytest.raises(ValueError, match='draft_model needs "model"'):
        SpeculativeConfig(method="draft_model", num_speculative_tokens=2)


def test_a_decode_worker_takes_a_draft_model_and_a_prefill_worker_drops_speculation():
    import argparse

    from engine.args import add_engine_args
    from serving.roles import add_worker_args, worker_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    add_worker_args(p)
    args = p.parse_args(
        ["--speculative-config", '{"method": "draft_model", "model": "/m", "num_speculative_tokens": 2}']
    )
    spec = worker_config(args, "decode").engine.speculative_config
    assert spec is not None and spec.method == "draft_model" and spec.model == "/m"
    assert worker_config(args, "prefill").engine.speculative_config is None
