"""Batch-1 decode speed of the engine against its roofline and transformers' compiled generate (GPU).

    python -m bench.latency [--shapes llama3-8b smollm2] [--baseline-shapes ...] [--out-dir DIR]

Per shape (dummy bf16 weights of a named shape, engine/model_config.py: DUMMY_SHAPES), 128 prompt tokens,
256 generated, greedy, ignore_eos:
- decode tok/s = 255 / (time of a 256-token generate - time of a 1-token generate), median of 3 each,
  after a warm-up at full length: the engine (CUDA graphs; the eager path beside it) and transformers'
  `generate` with a static cache, which compiles its decode step (torch.compile, CUDA graphs), warmed by
  two full-length calls first (its first call at a shape is 2-3x slower);
- the roofline: weight bytes / the device-to-device copy bandwidth measured in this run (bench.kernels);
- GPU busy fraction of steady decode at batch 1 and 64: kernel time per step (torch.profiler over N steps,
  intervals merged) over the wall time per step of N steps run without the profiler (which slows steps
  down; the fraction inside the profiled span is kept too); with the host time of each step's phases and
  the kernels that take the step's time;
- start-up: seconds of `LLM()` (weights, memory profile, KV cache, graph capture), the first in its process.
The engine and transformers run in child processes (one each per shape), so each starts on a clean GPU.
Records: bench/results/engine_*.json (or --out-dir).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {"llama3-8b": "Llama-3-8B", "smollm2": "SmolLM2-135M"}
IN_LEN, OUT_LEN, REPS = 128, 256, 3
BUSY_STEPS = 48
GPU_MEMORY_UTILIZATION = 0.95  # the graphs' memory is counted before the KV cache takes the rest
GOALS = {"roofline": 0.85, "baseline": 1.5, "smollm2_tps": 1200.0, "busy": 0.9, "startup_s": 20.0}
COMMAND = "python -m bench.latency"


def prompt(vocab: int, seed: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (IN_LEN,), generator=g).tolist()


def decode_tps(generate) -> dict[str, float]:
    """generate(n) -> seconds of one n-token generation of a fresh prompt."""
    generate(OUT_LEN)
    full = statistics.median(generate(OUT_LEN) for _ in range(REPS))
    one = statistics.median(generate(1) for _ in range(REPS))
    return {"tok_s": (OUT_LEN - 1) / (full - one), "full_s": full, "first_token_s": one}


# ---- the engine -----------------------------------------------------------------------------------


def engine_part(shape: str) -> dict[str, Any]:
    import torch

    from engine import LLM, SamplingParams

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm = LLM(
        SHAPES[shape], load_format="dummy", dtype="bfloat16", enable_prefix_caching=False,
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
    )  # fmt: skip
    startup = time.perf_counter() - t0
    free_after_startup = torch.cuda.mem_get_info()[0]
    engine = llm.engine
    runner = engine.runner
    vocab = engine.model_config.vocab_size
    seeds = iter(range(10**6))

    def generate(n: int) -> float:
        ids = prompt(vocab, next(seeds))
        t = time.perf_counter()
        llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t

    out: dict[str, Any] = {
        "startup_s": startup,
        "weight_bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters()),
        "num_graphs": len(runner.graphs.keys) if runner.graphs else 0,
        "num_buckets": len(runner.graphs.captured) if runner.graphs else 0,
        "num_kv_blocks": runner.num_blocks,
        "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
        "free_gib_after_startup": free_after_startup / 2**30,
        "graphs": decode_tps(generate),
    }
    graphs, runner.graphs = runner.graphs, None
    out["eager"] = decode_tps(generate)
    runner.graphs = graphs
    del graphs  # the runner's reference only: recapturing below frees them
    for batch in (1, 64):
        out[f"b{batch}"] = steady_decode(engine, batch, vocab)
    # A-B: the graphs again with the other short-context plan (engine/attention.py: SHORT_SPLIT)
    import engine.attention as attention

    default = attention.splits_short()
    attention.SHORT_SPLIT = not default
    runner.capture_graphs()
    out["short_split_other"] = {"short_split": not default, **decode_tps(generate)}
    attention.SHORT_SPLIT = None
    out["short_split"] = default
    return out


def steady_decode(engine: Any, batch: int, vocab: int) -> dict[str, Any]:
    """Host phases per step and the GPU's busy fraction over BUSY_STEPS steps of `batch` decoding rows."""
    import torch

    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4 * BUSY_STEPS + 64, ignore_eos=True)
    rids = [engine.add_request(prompt(vocab, 1000 + i), params) for i in range(batch)]
    for _ in range(8):  # the prefill steps, then a few decode ones
        engine.step()
    phases = time_phases(engine)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(BUSY_STEPS):
        engine.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    for wrapped in phases.pop("_restore"):
        wrapped()
    result: dict[str, Any] = {
        "step_ms": wall / BUSY_STEPS * 1e3,
        "tok_s": batch * BUSY_STEPS / wall,
        "host_ms_per_step": {k: v / BUSY_STEPS * 1e3 for k, v in phases.items()},
    }
    result.update(profile_steps(engine, batch))
    if result.get("kernel_us_per_step"):  # the profiler slows the steps down: divide by the plain ones
        result["busy_in_profile"] = result.pop("busy")
        result["busy"] = result["kernel_us_per_step"] / (result["step_ms"] * 1e3)
    for rid in rids:
        engine.abort_request(rid)
    return result


def time_phases(engine: Any) -> dict[str, Any]:
    """Wrap the step's phases with host timers: schedule, the forward pass's launch (graph replay with its
    input upload, or the eager forward), logits + sampling (which waits for the GPU), postprocess."""
    totals: dict[str, Any] = defaultdict(float)
    restore = []

    def wrap(obj: Any, name: str, key: str) -> None:
        original = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[key] += time.perf_counter() - t

        setattr(obj, name, timed)
        restore.append(lambda: delattr(obj, name) if name in vars(obj) else None)

    runner = engine.runner
    if runner.graphs is not None:
        wrap(runner.graphs.inputs, "fill", "graph inputs: fill (host)")
        wrap(runner.graphs.inputs, "upload", "graph inputs: upload")
    wrap(engine.scheduler, "schedule", "schedule")
    wrap(engine.scheduler, "postprocess", "postprocess")
    wrap(runner, "run", "runner.run (all, steps in order)")
    wrap(runner, "launch", "runner.launch (overlapped: inputs, forward, sampling queued)")
    wrap(runner, "collect", "runner.collect (overlapped: waits for the step's tokens)")
    wrap(runner, "_replay", "forward launch (graph: fill + upload + replay)")
    wrap(runner, "_forward_eager", "forward launch (eager)")
    wrap(runner.model, "compute_logits", "compute_logits launch")
    sampler = runner.sampler

    class TimedSampler:
        def __getattr__(self, name: str) -> Any:
            return getattr(sampler, name)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return sampler(*args, **kwargs)
            finally:
                totals["sampler (incl. waiting for the GPU)"] += time.perf_counter() - t

        def queue(self, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return sampler.queue(*args, **kwargs)
            finally:
                totals["sampler queue (overlapped)"] += time.perf_counter() - t

    runner.sampler = TimedSampler()
    restore.append(lambda: setattr(runner, "sampler", sampler))
    totals["_restore"] = restore
    return totals


def profile_steps(engine: Any, batch: int) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(BUSY_STEPS):
            engine.step()
        torch.cuda.synchronize()
    kernels = [
        e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0
    ]
    if not kernels:
        return {"busy": None, "note": "the profiler saw no kernels"}
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, (cur_s, cur_e) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = spans[-1][1] - spans[0][0]
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        by_name[e.name][0] += e.time_range.end - e.time_range.start
        by_name[e.name][1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:15]
    return {
        "busy": busy / span,
        "kernel_us_per_step": busy / BUSY_STEPS,
        "span_us_per_step": span / BUSY_STEPS,
        "kernels_per_step": len(kernels) / BUSY_STEPS,
        "top_kernels": [
            {"name": n[:90], "us_per_step": t / BUSY_STEPS, "calls_per_step": c / BUSY_STEPS}
            for n, (t, c) in top
        ],
    }


# ---- transformers ---------------------------------------------------------------------------------


def hf_part(shape: str) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.model_config import dummy_config

    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(json.dumps(dummy_config(SHAPES[shape]).to_hf_dict()))
        config = AutoConfig.from_pretrained(d)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    vocab = config.vocab_size
    seeds = iter(range(10**6))

    def generate(n: int) -> float:
        ids = torch.tensor([prompt(vocab, next(seeds))], device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            cache_implementation="static", pad_token_id=0,
        )  # fmt: skip
        torch.cuda.synchronize()
        return time.perf_counter() - t

    t0 = time.perf_counter()
    generate(OUT_LEN)  # compiles the decode step at this shape
    compile_s = time.perf_counter() - t0
    out: dict[str, Any] = dict(decode_tps(generate))  # its own warm-up call at full length first
    out.update(
        compile_s=compile_s, transformers=transformers.__version__, compiled=hasattr(model, "_compiled_call")
    )
    return out


# ---- the run --------------------------------------------------------------------------------------


def child(part: str, shape: str, timeout: float) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "-m", "bench.latency", "--part", part, "--shape", shape, "--json", f.name]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, timeout=timeout, cwd=Path(__file__).resolve().parent.parent)
        if proc.returncode != 0:
            return {"error": f"{part} {shape}: exit {proc.returncode}"}
        result = json.loads(Path(f.name).read_text())
        result["child_s"] = time.perf_counter() - t0
        return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument(
        "--baseline-shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES),
        help="shapes to time transformers at (default all; its compile takes minutes)",
    )  # fmt: skip
    p.add_argument("--part", choices=["engine", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--shape", choices=list(SHAPES), help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.part:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        result = engine_part(args.shape) if args.part == "engine" else hf_part(args.shape)
        args.json.write_text(json.dumps(result, indent=1))
        return

    import torch

    from bench.kernels import copy_bandwidth

    copies = copy_bandwidth()
    copy_gbs = max(copies["copy_"], copies["mul_kernel"])
    torch.cuda.empty_cache()
    print(f"d2d copy {copy_gbs:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    rows = []
    for shape in args.shapes:
        eng = child("engine", shape, 420)
        hf = child("hf", shape, 420) if shape in args.baseline_shapes else {}
        print(json.dumps({"shape": shape, "engine": eng, "transformers": hf}, indent=1), flush=True)
        rows += write_records(shape, eng, hf, copy_gbs, args.out_dir)
    print(
        "\n| figure | value | ceiling / baseline | ratio | goal | met? |\n| --- | ---: | --- | ---: | --- | --- |"
    )
    for row in rows:
        print("| " + " | ".join(row) + " |")


def write_records(shape: str, eng: dict, hf: dict, copy_gbs: float, out_dir: Path | None) -> list[list[str]]:
    from bench.record import record

    if "error" in eng:
        return [[f"{shape} engine", eng["error"], "", "", "", ""]]
    roofline = copy_gbs * 1e9 / eng["weight_bytes"]
    tps = eng["graphs"]["tok_s"]
    base = hf.get("tok_s")
    rows = []
    goal = f">= {GOALS['roofline']} of roofline and >= {GOALS['baseline']}x transformers compiled"
    if shape == "smollm2":
        goal = f">= {GOALS['smollm2_tps']:.0f} tok/s"
    rec = record(
        f"engine_decode_b1_{shape}", tps, "tok/s", ceiling=roofline,
        ceiling_name=f"roofline: {eng['weight_bytes'] / 1e9:.2f} GB of weights / {copy_gbs:.0f} GB/s copy",
        baseline=base, baseline_name="transformers static cache + torch.compile generate (tok/s)",
        baseline_ratio=tps / base if base else None, goal=goal, out_dir=out_dir, command=COMMAND,
        extra={"copy_gbs": copy_gbs, "engine": eng, "transformers": hf},
    )  # fmt: skip
    met = (
        tps >= GOALS["smollm2_tps"]
        if shape == "smollm2"
        else rec["ratio"] >= GOALS["roofline"] and (base is not None and tps / base >= GOALS["baseline"])
    )
    base_s = f"{base:.0f} tok/s transformers ({tps / base:.2f}x)" if base else "-"
    rows.append([f"decode b1 {shape} tok/s", f"{tps:.0f}", f"roofline {roofline:.0f}; {base_s}",
                 f"{rec['ratio']:.2f}", goal, "yes" if met else "NO"])  # fmt: skip
    other = eng.get("short_split_other", {})
    if other:
        rows.append([f"  same, short-context split {other['short_split']} (default {eng['short_split']})",
                     f"{other['tok_s']:.0f}", "-", "-", "-", "-"])  # fmt: skip
    rows.append(["  same, eager (enforce_eager)", f"{eng['eager']['tok_s']:.0f}", "-", "-", "-", "-"])
    if shape == "llama3-8b":
        for batch in (1, 64):
            busy = eng[f"b{batch}"].get("busy")
            if busy is None:
                continue
            record(
                f"engine_gpu_busy_b{batch}_{shape}", busy, "fraction", ceiling=1.0, ceiling_name="always busy",
                goal=f">= {GOALS['busy']}", out_dir=out_dir, command=COMMAND, extra=eng[f"b{batch}"],
            )  # fmt: skip
            rows.append([f"GPU busy b{batch} {shape}", f"{busy:.2f}", "1.0", f"{busy:.2f}", f">= {GOALS['busy']}",
                         "yes" if busy >= GOALS["busy"] else "NO"])  # fmt: skip
        s = eng["startup_s"]
        record(
            f"engine_startup_{shape}", s, "s", baseline=GOALS["startup_s"], baseline_name="goal (s)",
            goal=f"<= {GOALS['startup_s']:.0f} s", out_dir=out_dir, command=COMMAND,
            extra={k: eng[k] for k in ("num_graphs", "num_buckets", "num_kv_blocks", "gpu_memory_utilization", "free_gib_after_startup")},
        )  # fmt: skip
        rows.append([f"LLM() start-up {shape} ({eng['num_graphs']} graphs)", f"{s:.1f} s", "-", "-",
                     f"<= {GOALS['startup_s']:.0f} s", "yes" if s <= GOALS["startup_s"] else "NO"])  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
