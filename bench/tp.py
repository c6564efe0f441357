"""Tensor parallelism on 2 GPUs: batch-1 decode at TP 2 against TP 1, and the all-reduce time of a decode
step against NCCL alone moving the same bytes (the Llama-3-8B shape, dummy bf16 weights).

    python3 -m bench.tp --out-dir DIR

- decode tok/s at batch 1 = 255 / (time of a 256-token generate - time of a 1-token generate), median of
  3 each after a warm-up at full length, 128 prompt tokens, greedy, ignore_eos; TP 1 and TP 2 each in a
  child process of their own (a clean GPU), CUDA graphs on. Goal: TP 2 >= 1.6x TP 1.
- all-reduce time per step: the NCCL kernels' time per decode step at batch 1 on rank 0 (torch.profiler
  over 48 steps of the TP 2 engine), against the same collectives alone in two fresh processes: per step
  the engine all-reduces 2 x 32 layers' (1, 4096) bf16 outputs inside the decode graph, the embedding's
  (1, 4096) eagerly and all-gathers the LM head's (1, 128256 / 2) bf16 logits eagerly; the benchmark
  replays a CUDA graph of the 64 all-reduces and runs the other two eagerly, the median of 200 steps.
Records: tp2_decode_b1_llama3-8b (tok/s, baseline TP 1), tp2_allreduce_per_step_llama3-8b (us, baseline
the NCCL benchmark). About 3 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPE, HIDDEN, LAYERS, VOCAB = "Llama-3-8B", 4096, 32, 128256
IN_LEN, OUT_LEN, REPS, STEPS = 128, 256, 3, 48
GOAL = 1.6
COMMAND = "python3 -m bench.tp"


def decode_tps(generate) -> dict[str, float]:
    """generate(n) -> seconds of one n-token generation of a fresh prompt."""
    generate(OUT_LEN)
    full = statistics.median(generate(OUT_LEN) for _ in range(REPS))
    one = statistics.median(generate(1) for _ in range(REPS))
    return {"tok_s": (OUT_LEN - 1) / (full - one), "full_s": full, "first_token_s": one}


def engine_part(tp: int) -> dict[str, Any]:
    import torch

    from engine import LLM, SamplingParams

    llm = LLM(SHAPE, load_format="dummy", dtype="bfloat16", tensor_parallel_size=tp, enable_prefix_caching=False,
              max_num_seqs=64, gpu_memory_utilization=0.9)  # fmt: skip
    g = torch.Generator().manual_seed(0)

    def generate(n: int) -> float:
        ids = torch.randint(10, VOCAB - 10, (IN_LEN,), generator=g).tolist()
        t = time.perf_counter()
        llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t

    out: dict[str, Any] = {"tp": tp, **decode_tps(generate)}
    if tp > 1:
        out["nccl_us_per_step"], out["kernels"] = nccl_time_per_step(llm)
    llm.engine.shutdown()
    return out


def nccl_time_per_step(llm: Any) -> tuple[float, dict[str, float]]:
    """Rank 0's NCCL kernel time per decode step at batch 1 (torch.profiler over STEPS steps)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4 * STEPS, ignore_eos=True)
    rid = engine.add_request(list(range(10, 10 + IN_LEN)), params)
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            engine.step()
        torch.cuda.synchronize()
    engine.abort_request(rid)
    by_name: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "nccl" in e.name.lower():
            by_name[e.name[:80]] = by_name.get(e.name[:80], 0.0) + (e.time_range.end - e.time_range.start)
    return sum(by_name.values()) / STEPS, {k: v / STEPS for k, v in by_name.items()}


def nccl_worker(rank: int, port: int, result: str) -> None:
    """One of two processes timing the decode step's collectives alone (see the module's docstring)."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2)
    layer_out = torch.randn(LAYERS * 2, 1, HIDDEN, dtype=torch.bfloat16, device="cuda")
    embed = torch.randn(1, HIDDEN, dtype=torch.bfloat16, device="cuda")
    logits = torch.randn(1, VOCAB // 2, dtype=torch.bfloat16, device="cuda")
    parts = [torch.empty_like(logits) for _ in range(2)]

    def graphed() -> None:
        for i in range(LAYERS * 2):
            dist.all_reduce(layer_out[i])

    dist.all_reduce(embed)  # the communicator exists before the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graphed()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed()
    times = []
    for i in range(250):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dist.all_reduce(embed)
        graph.replay()
        dist.all_gather(parts, logits)
        torch.cuda.synchronize()
        if i >= 50:
            times.append(time.perf_counter() - t)
    if rank == 0:
        Path(result).write_text(json.dumps({"us_per_step": statistics.median(times) * 1e6}))
    dist.destroy_process_group()


def nccl_baseline(timeout: float) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmds = [[sys.executable, "-m", "bench.tp", "--nccl-rank", str(r), "--port", str(port), "--json", f.name]
                for r in (0, 1)]  # fmt: skip
        procs = [subprocess.Popen(c, cwd=Path(__file__).resolve().parent.parent) for c in cmds]
        codes = [p.wait(timeout=timeout) for p in procs]
        if any(codes):
            return {"error": f"nccl benchmark exit codes {codes}"}
        return json.loads(Path(f.name).read_text())


def child(tp: int, timeout: float) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "-m", "bench.tp", "--tp", str(tp), "--json", f.name]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, timeout=timeout, cwd=Path(__file__).resolve().parent.parent)
        if proc.returncode != 0:
            return {"error": f"TP {tp}: exit {proc.returncode}"}
        result = json.loads(Path(f.name).read_text())
        result["child_s"] = time.perf_counter() - t0
        return result


def write_records(tp1: dict, tp2: dict, nccl: dict, out_dir: Path | None) -> list[list[str]]:
    from bench.record import record

    if any("error" in r for r in (tp1, tp2, nccl)):
        return [["error", json.dumps([r.get("error") for r in (tp1, tp2, nccl)]), "", "", "", ""]]
    speedup = tp2["tok_s"] / tp1["tok_s"]
    record(
        "tp2_decode_b1_llama3-8b", tp2["tok_s"], "tok/s", baseline=tp1["tok_s"],
        baseline_name="the engine at TP 1, same run (tok/s)", goal=f">= {GOAL}x TP 1", out_dir=out_dir,
        command=COMMAND, extra={"tp1": tp1, "tp2": tp2},
    )  # fmt: skip
    ar = tp2["nccl_us_per_step"]
    record(
        "tp2_allreduce_per_step_llama3-8b", ar, "us", baseline=nccl["us_per_step"],
        baseline_name="the same collectives alone (64 graphed all-reduces of (1, 4096) bf16, one eager, one "
        "all-gather of (1, 64128) bf16), two processes, same run (us)",
        goal="close to the NCCL benchmark (ratio near 1)", out_dir=out_dir, command=COMMAND,
        extra={"kernels_us_per_step": tp2["kernels"], "nccl_benchmark": nccl},
    )  # fmt: skip
    return [
        ["decode b1 llama3-8b TP 2 tok/s", f"{tp2['tok_s']:.0f}", f"TP 1 {tp1['tok_s']:.0f}", f"{speedup:.2f}",
         f">= {GOAL}x", "yes" if speedup >= GOAL else "NO"],
        ["all-reduce us/step TP 2", f"{ar:.0f}", f"NCCL alone {nccl['us_per_step']:.0f}",
         f"{ar / nccl['us_per_step']:.2f}", "near 1", "-"],
    ]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--tp", type=int, help=argparse.SUPPRESS)
    p.add_argument("--nccl-rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.nccl_rank is not None:
        nccl_worker(args.nccl_rank, args.port, str(args.json))
        return
    if args.tp is not None:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        args.json.write_text(json.dumps(engine_part(args.tp), indent=1))
        return
    import torch

    if torch.cuda.device_count() < 2:
        sys.exit("bench.tp needs 2 GPUs")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0,1")
    tp1, tp2 = child(1, 300), child(2, 300)
    nccl = nccl_baseline(120)
    print(json.dumps({"tp1": tp1, "tp2": tp2, "nccl": nccl}, indent=1), flush=True)
    rows = write_records(tp1, tp2, nccl, args.out_dir)
    print("\n| figure | value | baseline | ratio | goal | met? |\n| --- | ---: | --- | ---: | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
