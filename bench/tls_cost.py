"""What TLS costs the disaggregated TTFT: two clusters side by side on the CPU (router + prefill + decode over
tcp, the bundled model), one in plaintext, one with mutual TLS on every gRPC hop and on the KV channel (plus
the KV HMAC secret), both up at once; requests alternate between them, so both see the same machine load.

    python3 -m bench.tls_cost --out-dir DIR        # 512-token prompts, 12 timed requests each

Records `security_tls_ttft_ratio_512`: the TLS cluster's median TTFT over the plaintext one's (goal <= 1.05).
The pairs run in ABBA order (each cluster first in turn); the median of the pairs' own ratios and the KV
transfer of the same prompt alone (a tcp receiver and sender in this process, plaintext against TLS, the
SmolLM2 pool layout) are recorded beside it: the one part of the path that TLS makes longer in proportion
to the prompt.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.record import record

COMMAND = "python3 -m bench.tls_cost"


def _ttft(stub, ids: list[int], rid: str) -> float:
    from tests.cluster import greedy_request

    req = greedy_request(ids, 1, ignore_eos=True)
    req.request_id = rid
    t0 = time.perf_counter()
    stream = stub.Generate(req)
    next(iter(stream))
    elapsed = time.perf_counter() - t0
    for _ in stream:
        pass
    return elapsed


def kv_transfer_ms(tokens: int, runs: int = 20) -> dict[str, float]:
    """Median ms of one tcp KV transfer of `tokens` tokens (SmolLM2's pool: 30 layers, 3 kv heads of 64, fp32,
    blocks of 16), plaintext against mutual TLS, sender and receiver in this process."""
    import torch

    from kvtransfer import connect, create_receiver
    from kvtransfer.auth import NO_AUTH, PeerAuth
    from tests.certs import make_certs

    certs = make_certs(Path(tempfile.mkdtemp(prefix="pdserve-certs-")))
    tls = PeerAuth(None, certs.cert, certs.key, certs.ca)
    blocks = -(-tokens // 16)
    src = torch.randn(30, 2, blocks, 16, 3, 64)
    out = {}
    for name, auth in (("plaintext", NO_AUTH), ("mtls", tls)):
        dst = torch.zeros(30, 2, blocks, 16, 3, 64)
        times = []
        with (
            create_receiver("tcp", dst, auth=auth) as receiver,
            connect(receiver.descriptor(), src, auth=auth) as s,
        ):
            for i in range(runs + 1):
                receiver.expect(f"r{i}", list(range(blocks)), "t")
                t0 = time.perf_counter()
                s.send(f"r{i}", list(range(blocks)), list(range(blocks)), "t")
                times.append(time.perf_counter() - t0)
                receiver.wait(f"r{i}", 10)
        out[name] = statistics.median(times[1:]) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args()

    from protos import pdserve_pb2_grpc as pb_grpc
    from serving.tls import PLAINTEXT, TLSConfig
    from tests.certs import make_certs
    from tests.cluster import start_cluster

    certs = make_certs(Path(tempfile.mkdtemp(prefix="pdserve-certs-")))
    tls = TLSConfig(certs.cert, certs.key, certs.ca)
    plain = start_cluster(1, 1, "tcp", "--no-enable-prefix-caching")
    os.environ["PDSERVE_KV_SECRET"] = "bench-kv-secret-0123456789"  # the TLS cluster's workers read it
    secure = start_cluster(1, 1, "tcp", "--no-enable-prefix-caching", *certs.flags())
    del os.environ["PDSERVE_KV_SECRET"]
    try:
        stubs = {
            "plaintext": pb_grpc.RouterStub(PLAINTEXT.channel(plain.router)),
            "mtls": pb_grpc.RouterStub(tls.channel(secure.router)),
        }
        times: dict[str, list[float]] = {k: [] for k in stubs}
        for i in range(args.runs + 1):  # the first of each is a warm-up
            ids = [100 + (7 * i + 13 * j) % 40000 for j in range(args.tokens)]
            order = list(stubs) if i % 2 else list(stubs)[::-1]  # ABBA: each cluster first in turn
            for name in order:
                t = _ttft(stubs[name], ids, f"{name}-{i}")
                if i:
                    times[name].append(t)
    finally:
        plain.stop()
        secure.stop()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratio = med["mtls"] / med["plaintext"]
    paired = statistics.median(m / p for m, p in zip(times["mtls"], times["plaintext"], strict=True))
    kv = kv_transfer_ms(args.tokens)
    print(
        f"{'prompt':>7} {'plaintext ms':>13} {'mTLS ms':>9} {'ratio':>7} {'paired':>7} {'kv plain ms':>12} {'kv mTLS ms':>11}"
    )
    print(
        f"{args.tokens:>7} {med['plaintext']:>13.1f} {med['mtls']:>9.1f} {ratio:>7.3f} {paired:>7.3f} "
        f"{kv['plaintext']:>12.1f} {kv['mtls']:>11.1f}"
    )
    record(
        f"security_tls_ttft_ratio_{args.tokens}",
        ratio,
        "ratio",
        baseline=med["plaintext"],
        baseline_name="median TTFT (ms) of the same cluster in plaintext, requests alternating",
        ratio=ratio,
        goal="<= 1.05",
        out_dir=args.out_dir,
        command=COMMAND,
        extra={
            "mtls_median_ms": med["mtls"],
            "median_of_paired_ratios": paired,
            "kv_transfer_median_ms": kv,
            "plaintext_ms": [x * 1e3 for x in times["plaintext"]],
            "mtls_ms": [x * 1e3 for x in times["mtls"]],
            "what": "router + prefill + decode over tcp on the CPU, bundled SmolLM2 fp32, max_tokens=1; "
            "mTLS on every gRPC hop and the KV channel, KV HMAC secret",
        },
    )


if __name__ == "__main__":
    main()
