"""`pdserve serve` end to end, aggregated (`--prefill 0`: the decode worker prefills) and disaggregated
(`--prefill 1`): one command, the official `openai` client, transformers as the reference, `--api-key` and
`--served-model-name` in force, and SIGTERM stops every process it started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch

from engine.tokenizer import Tokenizer
from serving.roles import free_port
from tests.cluster import _Lines
from tests.hf_reference import hf_greedy, hf_logits

pytestmark = pytest.mark.slow

KEY = "sk-serve-test"
NAME = "smol-served"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
SMALL = ["--cpu-kv-cache-space", "0.1", "--max-model-len", "1024", "--dtype", "float32", "--device", "cpu"]


@dataclass
class Served:
    proc: subprocess.Popen
    out: _Lines
    url: str
    cluster: dict  # the `pdserve cluster:` line
    prefill: int
    decode: int

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def pids(self) -> list[int]:
        c = self.cluster
        return [c["router"]["pid"], c["gateway"]["pid"], *(w["pid"] for w in c["workers"])]


def start_serve(prefill: int, decode: int, timeout: float = 300.0) -> Served:
    port = free_port()
    cmd = [sys.executable, "-m", "serving.cli", "serve", "--prefill", str(prefill), "--decode", str(decode)]
    cmd += ["--port", str(port), "--api-key", KEY, "--served-model-name", NAME, *SMALL]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out = _Lines(proc.stdout, 2)
    cluster: dict | None = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = out.next(timeout=1.0)
        if line == "":
            raise AssertionError(f"pdserve serve exited with {proc.wait()}:\n{out.text()[-4000:]}")
        if line and line.startswith("pdserve cluster: "):
            cluster = json.loads(line.split(": ", 1)[1])
        if line and line.startswith("pdserve serve: "):
            assert cluster is not None, out.text()
            assert f"http://127.0.0.1:{port}/v1" in line
            return Served(proc, out, f"http://127.0.0.1:{port}", cluster, prefill, decode)
    proc.kill()
    raise AssertionError("pdserve serve did not become ready in time:\n" + out.text()[-4000:])


def process_groups_alive(pgids: list[int]) -> list[int]:
    """The pids of live processes in these process groups (each child of `serve` leads its own, its engine
    process in it), read from /proc."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if fields[0] != "Z" and int(fields[2]) in pgids:
            alive.append(int(stat.parent.name))
    return alive


@pytest.fixture(scope="module", params=[(0, 1), (1, 1)], ids=["aggregated", "disaggregated"])
def served(request, bundled_model_dir):
    s = start_serve(*request.param)
    try:
        yield s
    finally:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
            try:
                s.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                s.proc.kill()


@pytest.fixture(scope="module")
def tok(bundled_model_dir):
    return Tokenizer.from_dir(bundled_model_dir)


def test_the_workers_asked_for_and_nothing_else(served):
    roles = sorted(w["role"] for w in served.cluster["workers"])
    assert roles == ["decode"] * served.decode + ["prefill"] * served.prefill


def test_chat_greedy_matches_transformers(served, tok, bundled_model_dir):
    ids = tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True), add_special_tokens=False)
    expected = hf_greedy(bundled_model_dir, [ids], [24])[0]
    r = served.client().chat.completions.create(model=NAME, messages=CHAT, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == tok.decode(expected)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(expected))


def test_completion_greedy_matches_transformers(served, tok, bundled_model_dir):
    prompt = "The three primary colors are"
    expected = hf_greedy(bundled_model_dir, [tok.encode(prompt)], [12])[0]
    r = served.client().completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == tok.decode(expected)


def test_prompt_logprobs_match_transformers(served, tok, bundled_model_dir):
    """Prompt logprobs computed by the decode worker (aggregated) or by the prefill worker and carried on by the
    decode worker (disaggregated) are transformers' fp32 log-softmax, so the two ways serve the same."""
    prompt = "The three primary colors are"
    ids = tok.encode(prompt)
    ref = torch.log_softmax(hf_logits(bundled_model_dir, ids), -1)
    want = ref[torch.arange(len(ids) - 1), ids[1:]].tolist()
    r = served.client().completions.create(
        model=NAME, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1,
        extra_body={"prompt_logprobs": 1},
    )  # fmt: skip
    c = r.choices[0]
    assert c.text.startswith(prompt) and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=1e-3)
    got = c.model_extra["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    assert [got[i][str(t)]["logprob"] for i, t in enumerate(ids) if i] == pytest.approx(want, abs=1e-3)


def test_api_key_is_required(served):
    with pytest.raises(openai.AuthenticationError) as err:
        served.client("sk-wrong").models.list()
    assert err.value.status_code == 401
    r = httpx.get(served.url + "/v1/models", timeout=10)  # no key at all
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"


def test_models_lists_the_served_model_name(served):
    assert [m.id for m in served.client().models.list().data] == [NAME]


def test_sigterm_stops_every_process(served):
    """Last in the module: it stops the stack."""
    pids = served.pids()
    assert process_groups_alive(pids)
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=90) == 0, served.out.text()[-4000:]
    deadline = time.monotonic() + 30
    while (left := process_groups_alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes outlived pdserve serve: {left}"
    assert "Traceback" not in served.out.text(), served.out.text()[-4000:]
