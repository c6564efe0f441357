"""Safe across hosts: the threat model's checks.

- KV injection (no model): a forged HELLO, a wrong HMAC, a replayed HELLO, a write into blocks not granted to
  the writer: refused, logged, counted, and the receiver's pool unchanged (compared whole); an nccl group is
  never formed with a peer that failed to authenticate.
- Insecure listen: a worker told to listen on a non-loopback address without TLS exits with the message.
- One stack (`pdserve serve`, the bundled model, mutual TLS with certificates made here, an HMAC secret on the
  KV channel, tenants from a keys file, a real redis-server): the openai client is served end to end; a
  client without a certificate or with one from another CA is refused at every port (router, decode,
  prefill, the KV channel); two tenants never share prefix blocks; a second gateway's rate limits answer
  429 with Retry-After to one tenant only; and a marker planted in the prompts and the API keys is nowhere
  in the INFO logs, in Redis or in any /metrics.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.block_hash import extra_keys, hash_prompt_blocks
from engine.tokenizer import Tokenizer
from gateway.tenants import CacheSalts
from kvtransfer import KVTransferError, connect, create_receiver
from kvtransfer.auth import PeerAuth
from kvtransfer.wire import _FRAME, MAGIC, VERSION, Channel, Kind
from protos import pdserve_pb2 as pb
from serving.roles import free_port
from serving.tls import TLSConfig
from tests.certs import Certs, make_certs
from tests.chaos.tools import RedisServer
from tests.cluster import _Lines, wait_until
from tests.hf_reference import hf_greedy

MARKER = "zq7MARKERv41x"  # planted in prompts and API keys: must show up nowhere
SECRET = b"kv-secret-for-the-tests-0123456789"
NAME = "smol-secure"
SALT_SECRET = "salt-secret-for-the-tests"
KEYS = {"alice": f"sk-{MARKER}-alice", "bob": f"sk-{MARKER}-bob"}
SMALL = ["--cpu-kv-cache-space", "0.1", "--max-model-len", "1024", "--dtype", "float32", "--device", "cpu"]


# ---- KV injection, against a receiver in this process ------------------------------------------------


def pool(blocks: int, seed: int) -> torch.Tensor:
    return torch.randn(2, 2, blocks, 4, 2, 8, generator=torch.Generator().manual_seed(seed))


def refused_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "kv receiver refused" in r.getMessage()]


def test_forged_wrong_and_replayed_hellos_are_refused_logged_counted(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="kvtransfer.registry")
    dst = pool(8, 0)
    before = dst.clone()
    with create_receiver("tcp", dst, auth=PeerAuth(SECRET)) as receiver:
        desc = receiver.descriptor()
        receiver.expect("r", [1, 2], "token")
        # a HELLO whose mac is made up
        ch = Channel.connect(desc["host"], desc["port"], 5)
        ch.expect(Kind.CHALLENGE)
        ch.send(Kind.HELLO, {"layout": desc["layout"], "nonce": "00", "mac": "ab" * 32})
        assert ch.expect(Kind.WELCOME) == {"error": "authentication failed"}
        ch.close()
        # a HELLO signed right for one connection, replayed on another (whose challenge differs)
        ch = Channel.connect(desc["host"], desc["port"], 5)
        nonce = ch.expect(Kind.CHALLENGE)["nonce"]
        hello = PeerAuth(SECRET).signed("hello", nonce, {"layout": desc["layout"], "nonce": "11"})
        ch.close()
        ch = Channel.connect(desc["host"], desc["port"], 5)
        ch.expect(Kind.CHALLENGE)
        ch.send(Kind.HELLO, hello)
        assert ch.expect(Kind.WELCOME) == {"error": "authentication failed"}
        ch.close()
        # a sender with another secret, and one with none
        for auth in (PeerAuth(b"another-secret-0123456789"), None):
            with pytest.raises(KVTransferError, match="refused the connection: authentication failed"):
                connect(desc, pool(8, 1), auth=auth)
        # BEGIN without a handshake at all: the connection never gets past HELLO
        ch = Channel.connect(desc["host"], desc["port"], 5)
        ch.expect(Kind.CHALLENGE)
        meta = json.dumps({"request_id": "r", "dst": [1, 2], "token": "token"}).encode()
        payload = len(meta) + 2 * receiver.layout.block_nbytes
        ch.sock.sendall(_FRAME.pack(MAGIC, VERSION, Kind.BEGIN, len(meta), payload) + meta)
        assert ch.peer_closed() or wait_until(ch.peer_closed, 5, "the receiver hanging up")
        ch.close()
        # six connections that did not authenticate: the made-up mac, the one closed after its challenge,
        # the replay, the other secret, no secret, and BEGIN in place of HELLO
        wait_until(lambda: receiver.refusal_counts() == {"auth": 6}, 5, "six refusals counted")
        assert not receiver.poll("r")  # the announced request is still waiting, untouched
    assert torch.equal(dst, before)
    assert len(refused_lines(caplog)) == 6
    assert all("a connection" in line for line in refused_lines(caplog))


def test_a_sender_with_the_secret_refuses_a_receiver_without_it() -> None:
    impostor = create_receiver("tcp", pool(8, 0))  # no secret
    with impostor, pytest.raises(KVTransferError, match="the welcome carries no HMAC"):
        connect(impostor.descriptor(), pool(8, 1), auth=PeerAuth(SECRET))


def test_writes_into_blocks_not_granted_are_refused_and_the_pool_is_unchanged(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="kvtransfer.registry")
    dst, src = pool(8, 0), pool(8, 1)
    before = dst.clone()
    with create_receiver("tcp", dst, auth=PeerAuth(SECRET)) as receiver:
        receiver.expect("r", [1, 2], "granted-token")
        with connect(receiver.descriptor(), src, auth=PeerAuth(SECRET)) as sender:
            for rid, blocks, token in (
                ("r", [5, 6], "granted-token"),  # other blocks than the ones reserved for it
                ("r", [1, 2], "a-guessed-token"),  # the blocks, but not the token handed to the worker asked
                ("r", [1, 2], ""),  # no token
                ("other", [3, 4], "granted-token"),  # a request the receiver never announced
            ):
                with pytest.raises(KVTransferError, match="kv receiver refused request"):
                    sender.send(rid, [0, 1], blocks, token)
            assert torch.equal(dst, before)
            assert receiver.refusal_counts() == {"grant": 4}
            assert len(refused_lines(caplog)) == 4
            sender.send("r", [0, 1], [1, 2], "granted-token")  # the granted write itself lands
        receiver.wait("r", 5)
    assert torch.equal(dst[:, :, 1:3], src[:, :, 0:2])
    untouched = [b for b in range(8) if b not in (1, 2)]
    assert torch.equal(dst[:, :, untouched], before[:, :, untouched])


def test_an_nccl_group_is_formed_only_with_an_authenticated_peer() -> None:
    with create_receiver("nccl", pool(8, 0), auth=PeerAuth(SECRET)) as receiver:
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match="authentication failed"):
            connect(receiver.descriptor(), pool(8, 1), auth=PeerAuth(b"not-the-secret-0123456"))
        assert time.monotonic() - t0 < 5  # refused at HELLO, not after waiting on a group's rendezvous
        assert receiver.refusal_counts() == {"auth": 1}
        connect(receiver.descriptor(), pool(8, 1), auth=PeerAuth(SECRET)).close()


# ---- listening without TLS ---------------------------------------------------------------------------


def test_a_worker_asked_to_listen_off_loopback_without_tls_exits_with_the_reason() -> None:
    cmd = [sys.executable, "-m", "serving.cli", "decode", "--host", "0.0.0.0", "--port", "0", *SMALL]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "refusing to serve the decode worker's gRPC on 0.0.0.0 without TLS" in done.stderr
    assert "--insecure" in done.stderr and "Traceback" not in done.stderr


def test_insecure_allows_plaintext_off_loopback_with_a_warning(caplog) -> None:
    TLSConfig().check_listen("127.0.0.1", "gRPC")
    TLSConfig().check_listen("localhost", "gRPC")
    with pytest.raises(ValueError, match="without TLS"):
        TLSConfig().check_listen("0.0.0.0", "gRPC")
    TLSConfig().check_listen("0.0.0.0", "the KV receiver", authenticated=True)  # its HMAC secret
    with caplog.at_level(logging.WARNING, logger="serving.tls"):
        TLSConfig(insecure=True).check_listen("0.0.0.0", "gRPC")
    assert "without TLS (--insecure)" in caplog.text


# ---- one secured stack -------------------------------------------------------------------------------


@dataclass
class Stack:
    proc: subprocess.Popen
    out: _Lines
    url: str
    cluster: dict
    certs: Certs
    redis: RedisServer
    keys_file: Path
    kv_port: int
    limited: subprocess.Popen  # a second gateway on the same router, with rate limits
    limited_out: _Lines
    limited_url: str

    def client(self, tenant: str, url: str | None = None) -> openai.OpenAI:
        base = (url or self.url) + "/v1"
        return openai.OpenAI(base_url=base, api_key=KEYS[tenant], max_retries=0, timeout=120)

    def addresses(self) -> dict[str, str]:
        out = {"router": self.cluster["router"]["address"]}
        out.update({w["role"]: w["address"] for w in self.cluster["workers"]})
        return out

    def metrics_ports(self) -> list[int]:
        return [self.cluster["router"]["metrics_port"], *(w["metrics_port"] for w in self.cluster["workers"])]


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    keys_file = tmp_path_factory.mktemp("keys") / "api_keys"
    keys_file.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    redis = RedisServer()
    redis.start()
    port = free_port()
    cmd = [sys.executable, "-m", "serving.cli", "--log-level", "INFO", "serve", "--port", str(port)]
    cmd += ["--prefill", "1", "--decode", "1", "--served-model-name", NAME, "--redis-url", redis.url]
    cmd += ["--metrics", "--api-keys-file", str(keys_file), *certs.flags(), *SMALL]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDSERVE_KV_SECRET": SECRET.decode()}
    env["PDSERVE_CACHE_SALT_SECRET"] = SALT_SECRET
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out = _Lines(proc.stdout, None)
    limited: subprocess.Popen | None = None
    try:
        cluster = json.loads(_wait_line(out, "pdserve cluster: ", 300))
        # started while `serve` starts its own gateway
        limited, limited_url = _limited_gateway(cluster["router"]["address"], keys_file, certs)
        limited_out = _Lines(limited.stdout, None)
        _wait_line(out, "pdserve serve: ", 120)
        line = next(x for x in out.all if "kv receiver (tcp) listening on" in x)
        assert "mTLS + HMAC" in line, line
        kv_port = int(line.split("listening on ")[1].split(",")[0].rsplit(":", 1)[1])
        yield Stack(
            proc, out, f"http://127.0.0.1:{port}", cluster, certs, redis, keys_file, kv_port,
            limited, limited_out, limited_url,
        )  # fmt: skip
    finally:
        for child in (limited, proc):
            if child is not None:
                child.send_signal(signal.SIGTERM)
                try:
                    child.wait(timeout=90)
                except subprocess.TimeoutExpired:
                    child.kill()
        redis.stop()


def _limited_gateway(router: str, keys_file: Path, certs: Certs) -> tuple[subprocess.Popen, str]:
    """`pdserve gateway` alone on the stack's router (mutual TLS), one request per 5 s for each tenant."""
    port = free_port()
    cmd = [sys.executable, "-m", "serving.cli", "--log-level", "INFO", "gateway", "--port", str(port)]
    cmd += ["--router", router, "--api-keys-file", str(keys_file), *certs.flags()]
    cmd += ["--rate-limit-requests-per-s", "0.2", "--rate-limit-tokens-per-s", "1000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"


def _wait_line(out: _Lines, prefix: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = out.next(timeout=1.0)
        if line == "":
            raise AssertionError("pdserve serve exited:\n" + out.text()[-4000:])
        if line and line.startswith(prefix):
            return line[len(prefix) :].strip()
    raise AssertionError(f"no {prefix!r} line in time:\n" + out.text()[-4000:])


@pytest.fixture(scope="module")
def tok(bundled_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(bundled_model_dir)


CHAT = [{"role": "user", "content": f"My code word is {MARKER}. What is the capital of France?"}]


@pytest.mark.slow
def test_mtls_stack_serves_the_openai_client(stack: Stack, tok: Tokenizer, bundled_model_dir) -> None:
    ids = tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True), add_special_tokens=False)
    expected = hf_greedy(bundled_model_dir, [ids], [8])[0]
    for tenant in KEYS:
        r = stack.client(tenant).chat.completions.create(
            model=NAME, messages=CHAT, max_tokens=8, temperature=0
        )
        assert r.choices[0].message.content == tok.decode(expected)


def _health(address: str, credentials: grpc.ChannelCredentials | None) -> str:
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _kv_attempt(port: int, context: ssl.SSLContext | None) -> str:
    """Open the KV channel (TLS with `context`, or plaintext bytes of a HELLO) and say how it ended."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        if context is None:
            body = json.dumps({"layout": {}, "nonce": "00"}).encode()
            sock.sendall(_FRAME.pack(MAGIC, VERSION, Kind.HELLO, len(body), 0) + body)
            return "closed" if sock.recv(64) == b"" else "answered"
        with context.wrap_socket(sock, server_hostname="127.0.0.1") as tls:
            return "closed" if tls.recv(64) == b"" else "answered"
    except (ssl.SSLError, OSError) as exc:
        return f"refused: {exc}"
    finally:
        sock.close()


def _metric(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.slow
def test_no_certificate_or_another_cas_is_refused_at_every_port(stack: Stack) -> None:
    c = stack.certs
    good = grpc.ssl_channel_credentials(
        Path(c.ca).read_bytes(), Path(c.key).read_bytes(), Path(c.cert).read_bytes()
    )
    no_cert = grpc.ssl_channel_credentials(Path(c.ca).read_bytes())
    rogue = grpc.ssl_channel_credentials(
        Path(c.ca).read_bytes(), Path(c.rogue_key).read_bytes(), Path(c.rogue_cert).read_bytes()
    )
    for role, address in stack.addresses().items():
        assert _health(address, good) == "SERVING", role
        for how, creds in (("plaintext", None), ("no certificate", no_cert), ("another CA", rogue)):
            assert _health(address, creds) == "UNAVAILABLE", (role, how)
    decode_metrics = next(w["metrics_port"] for w in stack.cluster["workers"] if w["role"] == "decode")
    before = _metric(
        decode_metrics, 'pdserve:kv_transfer_refused_total{model_name="smol-secure",reason="auth"}'
    )
    no_cert_ctx = ssl.create_default_context(cafile=c.ca)
    rogue_ctx = ssl.create_default_context(cafile=c.ca)
    rogue_ctx.load_cert_chain(c.rogue_cert, c.rogue_key)
    for how, ctx in (("plaintext HELLO", None), ("no certificate", no_cert_ctx), ("another CA", rogue_ctx)):
        assert _kv_attempt(stack.kv_port, ctx) != "answered", how
    name = 'pdserve:kv_transfer_refused_total{model_name="smol-secure",reason="auth"}'
    wait_until(lambda: _metric(decode_metrics, name) >= before + 3, 10, "three refusals counted")
    assert stack.out.text().count("kv receiver refused a connection") >= 3


def _cached(client: openai.OpenAI, ids: list[int]) -> int:
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=1, temperature=0)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.usage.prompt_tokens_details.cached_tokens or 0


@pytest.mark.slow
def test_two_tenants_never_share_prefix_blocks(stack: Stack, tok: Tokenizer) -> None:
    ids = tok.encode(" ".join(f"line {i} of a long shared system prompt." for i in range(10)))
    alice, bob = stack.client("alice"), stack.client("bob")
    assert _cached(alice, ids) == 0
    assert _cached(alice, ids) > 0
    assert _cached(bob, ids) == 0  # the same prompt, right after alice's: nothing of hers is reused
    assert _cached(bob, ids) > 0
    # the router's index (Redis) holds each tenant's own chain of block hashes, none in common
    channel = TLSConfig(stack.certs.cert, stack.certs.key, stack.certs.ca).channel(
        stack.addresses()["router"]
    )
    with channel:
        from protos import pdserve_pb2_grpc as pb_grpc

        block_size = pb_grpc.RouterStub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=5).block_size
    salts = CacheSalts(SALT_SECRET)
    chains = {
        t: set(hash_prompt_blocks(ids, block_size, extra_keys(NAME, salts.salt(t, None))))
        for t in ("alice", "bob")
    }
    assert chains["alice"] and not chains["alice"] & chains["bob"]
    redis = stack.redis.client()
    held = f"pdserve:kv:w:{stack.addresses()['prefill']}:blocks"
    wait_until(
        lambda: chains["alice"] | chains["bob"] <= set(redis.smembers(held)), 10, "both chains indexed"
    )
    redis.close()


@pytest.mark.slow
def test_rate_limits_answer_429_to_one_tenant_only(stack: Stack) -> None:
    url = stack.limited_url
    body = {"model": NAME, "prompt": f"Say {MARKER}", "max_tokens": 1, "temperature": 0}
    wait_until(lambda: _status(url + "/health") == 200, 60, "the rate-limited gateway serving")

    def post(key: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"}
        return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)

    assert post(KEYS["alice"]).status_code == 200
    limited = post(KEYS["alice"])
    assert limited.status_code == 429, limited.text
    assert int(limited.headers["Retry-After"]) >= 1
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert post(KEYS["bob"]).status_code == 200  # another tenant, its own budget
    # SIGHUP rereads the keys file: a new tenant's key works from then on
    carol = f"sk-{MARKER}-carol"
    with stack.keys_file.open("a") as f:
        f.write(f"{carol} carol\n")
    assert post(carol).status_code == 401
    stack.limited.send_signal(signal.SIGHUP)
    wait_until(lambda: post(carol).status_code == 200, 10, "carol's key accepted")


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0


@pytest.mark.slow
def test_no_prompt_or_key_in_logs_redis_or_metrics(stack: Stack) -> None:
    """Last in the module: after the others' traffic (the marker in chat prompts, completion prompts and
    every API key)."""
    pages = [httpx.get(f"http://127.0.0.1:{p}/metrics", timeout=5).text for p in stack.metrics_ports()]
    pages += [httpx.get(url + "/metrics", timeout=5).text for url in (stack.url, stack.limited_url)]
    assert all(MARKER not in page for page in pages)
    redis = stack.redis.client()
    stored = [key + b"".join(_values(redis, key)) for key in redis.scan_iter(count=1000)]
    redis.close()
    assert stored and all(MARKER.encode() not in x for x in stored)
    logs = stack.out.text() + stack.limited_out.text()
    assert "INFO" in logs and "request " in logs  # the per-request INFO lines were written
    assert MARKER not in logs


def _values(redis, key: bytes) -> list[bytes]:
    kind = redis.type(key)
    if kind == b"string":
        return [redis.get(key) or b""]
    if kind == b"set":
        return list(redis.smembers(key))
    if kind == b"zset":
        return list(redis.zrange(key, 0, -1))
    if kind == b"list":
        return list(redis.lrange(key, 0, -1))
    if kind == b"hash":
        return [k + v for k, v in redis.hgetall(key).items()]
    if kind == b"stream":
        return [b"".join(k + v for k, v in fields.items()) for _, fields in redis.xrange(key)]
    return []
