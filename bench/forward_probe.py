"""Diagnostic: one prefill step of a fresh prompt, timed three ways, in and out of company on the GPU.

    python -m bench.forward_probe [--tokens 512 4096] [--out-dir DIR]      # on the GPU

Why: the served workers' forward pass of a 512-token prompt took ~30-36 ms where the benchmark process's
single engine took ~20 (BENCHMARKS.md, TTFT), while at 4096 tokens they matched. Per step it records the
wall time (add_request -> first token), the host time to queue the model's forward pass, and the GPU time
of that forward pass (CUDA events), in three settings:
  alone        this process's engine, the only CUDA context on the GPU
  idle peer    the same, while another process holds an idle CUDA context on the same GPU
  child        a spawned process's engine (as the workers' engine processes are), this process idle
  sleep / spin the host sleeps, or spins, 20 ms before each step (the GPU idle either way)
Dummy Llama-3-8B weights, bf16, prefix caching off; median of --reps after a warm-up.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

UTIL = 0.35  # two engines share the GPU in the "child" setting


def build(model: str) -> Any:
    from bench.disagg import dummy_llm

    return dummy_llm(model, UTIL).engine


def measure(
    engine: Any, tokens: list[int], reps: int, gap: str = "", gap_s: float = 0.02
) -> dict[int, dict[str, float]]:
    """{tokens: {wall_ms, host_ms, gpu_ms}} medians; the model's forward is wrapped to time it. Before each
    step, gap "sleep" leaves the host idle for gap_s (as a served worker waits between requests), "spin"
    keeps this thread busy for as long."""
    from engine import SamplingParams

    model = engine.runner.model
    forward = model.forward
    host: list[float] = []
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def timed(*args: Any, **kwargs: Any) -> Any:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        host.append(time.perf_counter() - t0)
        end.record()
        events.append((start, end))
        return out

    model.forward = timed
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    result = {}
    try:
        for n in tokens:
            wall, host_n, gpu_n = [], [], []
            for i in range(reps + 1):
                host.clear()
                events.clear()
                prompt = torch.randint(
                    10, vocab - 10, (n,), generator=torch.Generator().manual_seed(i)
                ).tolist()
                torch.cuda.synchronize()
                if gap == "sleep":
                    time.sleep(gap_s)
                elif gap == "spin":
                    until = time.perf_counter() + gap_s
                    while time.perf_counter() < until:
                        pass
                t0 = time.perf_counter()
                engine.add_request(prompt, params, request_id=f"probe-{n}-{i}")
                while not any(o.outputs[0].token_ids for o in engine.step()):
                    pass
                torch.cuda.synchronize()
                if i:  # the first is a warm-up
                    wall.append(time.perf_counter() - t0)
                    host_n.append(sum(host))
                    gpu_n.append(sum(s.elapsed_time(e) for s, e in events) / 1e3)
                while engine.has_unfinished_requests():
                    engine.step()
            result[n] = {
                "wall_ms": statistics.median(wall) * 1e3,
                "host_ms": statistics.median(host_n) * 1e3,
                "gpu_ms": statistics.median(gpu_n) * 1e3,
            }
    finally:
        model.forward = forward
    return result


def idle_peer(ready: Any, stop: Any) -> None:
    """Hold a CUDA context (and some memory) on the GPU and do nothing."""
    keep = torch.zeros(64 << 20, device="cuda")
    torch.cuda.synchronize()
    ready.set()
    stop.wait()
    del keep


def child(model: str, tokens: list[int], reps: int, conn: Any) -> None:
    conn.send(measure(build(model), tokens, reps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Llama-3-8B")
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    engine = build(args.model)
    found = {"alone": measure(engine, args.tokens, args.reps)}
    ready, stop = ctx.Event(), ctx.Event()
    peer = ctx.Process(target=idle_peer, args=(ready, stop), daemon=True)
    peer.start()
    ready.wait(120)
    found["idle peer"] = measure(engine, args.tokens, args.reps)
    stop.set()
    peer.join(30)
    found["alone again"] = measure(engine, args.tokens, args.reps)
    found["sleep 20 ms"] = measure(engine, args.tokens, args.reps, "sleep")
    found["spin 20 ms"] = measure(engine, args.tokens, args.reps, "spin")
    found["sleep 20 ms again"] = measure(engine, args.tokens, args.reps, "sleep")
    parent, end = ctx.Pipe()
    proc = ctx.Process(target=child, args=(args.model, args.tokens, args.reps, end), daemon=True)
    proc.start()
    found["child"] = parent.recv()
    proc.join(60)
    print(f"{'setting':<12} {'tokens':>6} {'wall ms':>8} {'host ms':>8} {'gpu ms':>8}")
    for setting, by_n in found.items():
        for n, t in by_n.items():
            print(f"{setting:<12} {n:>6} {t['wall_ms']:8.2f} {t['host_ms']:8.2f} {t['gpu_ms']:8.2f}")
    from bench.record import record

    for n in args.tokens:  # the figure: the first setting's step against the same step later on
        record(
            f"forward_probe_llama3-8b_{n}",
            found["alone"][n]["wall_ms"],
            "ms",
            baseline=found["alone again"][n]["wall_ms"],
            baseline_name="the same step in the same process after the other settings ran ('alone again')",
            extra={"settings": {k: v[n] for k, v in found.items()}, "reps": args.reps},
            out_dir=args.out_dir,
            command="python -m bench.forward_probe",
        )


if __name__ == "__main__":
    main()
