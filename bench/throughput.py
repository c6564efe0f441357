"""Offline throughput, shaped like vLLM's benchmark_throughput: N random prompts, fixed lengths, ignore_eos.

    python -m bench.throughput [--num-prompts 256 1000] [--input-len 1024] [--output-len 256]
                               [--hf-batches 64 128] [--out-dir DIR] [--profile]

For each N (dummy bf16 weights of the Llama-3-8B shape, engine/model_config.py: DUMMY_SHAPES), the engine's
`LLM.generate` of N prompts of random token ids, greedy and then `temperature=0.8, top_p=0.95`, reports
output tok/s (N x output_len / wall time) and total tok/s (prompt tokens too), with the wall time split into
the steps that carry prompt tokens and the decode-only ones, the host time of schedule and postprocess, and the
caching allocator's device mallocs, frees and retries and the Triton kernel variants compiled during the run.

The ceiling is the workload's roofline, from figures measured in this run:
- prefill: the prompt's matmul FLOPs (2 x the matmul weights x prompt tokens, causal attention's QK and PV,
  one lm_head row per prompt) at the bf16 matmul rate measured here (the best of the model's own GEMM
  shapes at 8192 rows);
- decode: each later token's step reads the weights once per step of a full batch (max_num_seqs rows: the
  N prompts decode in ceil(N / max_num_seqs) waves) and every row's KV so far, at the measured
  device-to-device copy bandwidth (bench.kernels).
--profile adds, after the timed runs, the kernel time by name of the first PROFILE_STEPS steps of a full batch
(each step run alone under torch.profiler, the device synchronized after it), with each step's prompt tokens and
decode rows: where a prompt-carrying step's time goes. It goes into the records' `extra` as `step_profiles`.
The baseline is transformers' eager `generate` (dynamic cache, sdpa) over the same prompts at each batch in
--hf-batches, the best of them kept. The engine and transformers run in child processes.
Records: bench/results/engine_throughput_*.json (or --out-dir).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPE, SHAPE_KEY = "Llama-3-8B", "llama3-8b"
MAX_NUM_SEQS = 256
GPU_MEMORY_UTILIZATION = 0.9
GOALS = {"roofline": 0.75, "baseline": 2.5, "sampled": 0.95}
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
COMMAND = "python -m bench.throughput"
PROFILE_STEPS = 40


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


# ---- the engine -----------------------------------------------------------------------------------


def engine_part(
    shape: str, nums: list[int], in_len: int, out_len: int, device: str | None, profile_steps: bool = False
) -> dict[str, Any]:
    import torch

    from engine import LLM, SamplingParams
    from kernels import _backend

    llm = LLM(
        shape, load_format="dummy", dtype="bfloat16", device=device, enable_prefix_caching=False,
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION, max_num_seqs=MAX_NUM_SEQS,
        max_model_len=in_len + out_len + 16,
    )  # fmt: skip
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    timers = StepTimers(engine)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    warm = prompts(min(8, max(nums)), in_len, vocab, seed=99)
    llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(max_tokens=8, ignore_eos=True))
    out: dict[str, Any] = {
        "weight_bytes": sum(p.numel() * p.element_size() for p in engine.runner.model.parameters()),
        "num_kv_blocks": engine.runner.num_blocks,
        "max_num_seqs": MAX_NUM_SEQS,
        "runs": {},
    }
    for n in nums:
        batch = [{"prompt_token_ids": p} for p in prompts(n, in_len, vocab, seed=n)]
        for label, temperature, top_p in (
            ("greedy", 0.0, 1.0),
            ("sampled", SAMPLED["temperature"], SAMPLED["top_p"]),
        ):
            params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=out_len, ignore_eos=True)
            timers.reset()
            sync()
            before = allocator_counts(engine.device)
            variants = _backend.compiled_variants()
            t0 = time.perf_counter()
            results = llm.generate(batch, params)
            sync()
            wall = time.perf_counter() - t0
            after = allocator_counts(engine.device)
            compiled = _backend.compiled_since(variants)
            produced = sum(len(r.outputs[0].token_ids) for r in results)
            if produced != n * out_len:
                raise RuntimeError(f"{label} {n}: {produced} tokens, expected {n * out_len}")
            out["runs"][f"{n}_{label}"] = {
                "wall_s": wall,
                "output_tok_s": n * out_len / wall,
                "total_tok_s": n * (in_len + out_len) / wall,
                **timers.summary(),
                "allocator": {k: after[k] - before[k] for k in after},
                "triton_variants_compiled": None if compiled is None else sum(map(len, compiled.values())),
                "triton_compiled": None
                if compiled is None
                else {k: [v[:400] for v in keys] for k, keys in compiled.items()},
            }
            print(json.dumps({f"{n}_{label}": out["runs"][f"{n}_{label}"]}), flush=True)
    if profile_steps and engine.device.type == "cuda":
        out["step_profiles"] = step_profiles(engine, in_len, out_len, vocab)
        print(json.dumps({"step_profiles": out["step_profiles"]}), flush=True)
    return out


def allocator_counts(device: Any) -> dict[str, int]:
    """The caching allocator's device mallocs and frees and its retries (a retry frees the cache and
    synchronizes the device): a run that grows the pool pays for them."""
    import torch

    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def step_profiles(engine: Any, in_len: int, out_len: int, vocab: int) -> list[dict[str, Any]]:
    """The first PROFILE_STEPS steps of MAX_NUM_SEQS prompts, each profiled alone: its prompt tokens, decode
    rows, wall time and kernel time by name (the device synchronized after each step, so a step's window
    holds the kernels it launched)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    params = SamplingParams(max_tokens=out_len, ignore_eos=True)
    for i, p in enumerate(prompts(MAX_NUM_SEQS, in_len, vocab, seed=7)):
        engine.add_request(p, params, request_id=f"profile-{i}")
    sched = engine.scheduler
    schedule = sched.schedule
    seen: dict[str, int] = {}

    def counting(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        lens = [len(it.token_ids) for it in out.scheduled]
        seen.update(prompt_tokens=sum(n for n in lens if n > 1), decode_rows=sum(1 for n in lens if n == 1))
        return out

    sched.schedule = counting
    steps: list[dict[str, Any]] = []
    try:
        torch.cuda.synchronize()
        while engine.has_unfinished_requests() and len(steps) < PROFILE_STEPS:
            seen.clear()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t = time.perf_counter()
                engine.step()
                torch.cuda.synchronize()
                wall = time.perf_counter() - t
            by_name: dict[str, float] = {}
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0:
                    by_name[e.name[:90]] = (
                        by_name.get(e.name[:90], 0.0) + e.time_range.end - e.time_range.start
                    )
            top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
            steps.append({
                **seen, "wall_ms": wall * 1e3, "kernel_ms": sum(by_name.values()) / 1e3,
                "top_kernels_ms": {name: us / 1e3 for name, us in top},
            })  # fmt: skip
    finally:
        sched.schedule = schedule
        for rid in list(engine.requests):
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    return steps


class StepTimers:
    """Wall time of every engine step, split by whether it carries prompt tokens, and the host time of the
    scheduler's schedule and postprocess. Also the time the host waits for a step's tokens (`collect_wait_s`:
    what is left is host work the device may have waited for), and the decode-only steps' mean wall time by
    rows: a full batch, at least half of one, fewer."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        step, sched = engine.step, engine.scheduler
        schedule, postprocess = sched.schedule, sched.postprocess
        runner = engine.runner
        collect = runner.collect
        self._last_prefill = False
        self._last_rows = 0

        def timed_step(*args: Any, **kwargs: Any) -> Any:  # final_only from LLM.generate
            t = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t
                key = "prefill_steps" if self._last_prefill else "decode_steps"
                self.totals[key + "_s"] += dt
                self.totals[key] += 1
                if not self._last_prefill:
                    self.decode_steps.append((self._last_rows, dt))

        def timed_schedule(*args: Any, **kwargs: Any) -> Any:  # drafts=False from an overlapped step
            t = time.perf_counter()
            out = schedule(*args, **kwargs)
            self._last_prefill = any(len(it.token_ids) > 1 for it in out.scheduled)
            self._last_rows = len(out.scheduled)
            self.totals["schedule_s"] += time.perf_counter() - t
            return out

        def timed_collect(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return collect(*args, **kwargs)
            finally:
                self.totals["collect_wait_s"] += time.perf_counter() - t

        def timed_postprocess(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return postprocess(*args, **kwargs)
            finally:
                self.totals["postprocess_s"] += time.perf_counter() - t

        engine.step, sched.schedule, sched.postprocess = timed_step, timed_schedule, timed_postprocess
        runner.collect = timed_collect
        self.reset()

    def reset(self) -> None:
        self.totals: dict[str, float] = dict.fromkeys(
            (
                "prefill_steps",
                "prefill_steps_s",
                "decode_steps",
                "decode_steps_s",
                "schedule_s",
                "postprocess_s",
                "collect_wait_s",
            ),
            0.0,
        )
        self.decode_steps: list[tuple[int, float]] = []  # (rows, seconds) of each decode-only step

    def summary(self) -> dict[str, Any]:
        t: dict[str, Any] = dict(self.totals)
        if t["decode_steps"]:
            t["decode_step_ms"] = t["decode_steps_s"] / t["decode_steps"] * 1e3
        full = max((rows for rows, _ in self.decode_steps), default=0)
        buckets: dict[str, list[float]] = {}
        for rows, dt in self.decode_steps:
            key = "full" if rows == full else "half_or_more" if 2 * rows >= full else "fewer"
            buckets.setdefault(key, []).append(dt)
        t["decode_step_ms_by_rows"] = {
            k: {"steps": len(v), "mean_ms": sum(v) / len(v) * 1e3} for k, v in buckets.items()
        }
        return t


# ---- transformers ---------------------------------------------------------------------------------


def hf_part(shape: str, n: int, batches: list[int], in_len: int, out_len: int) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.model_config import dummy_config

    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(json.dumps(dummy_config(shape).to_hf_dict()))
        config = AutoConfig.from_pretrained(d)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    all_prompts = torch.tensor(prompts(n, in_len, config.vocab_size, seed=n), device="cuda")
    out: dict[str, Any] = {"transformers": transformers.__version__, "batches": {}}

    def generate(ids: torch.Tensor, new: int) -> None:
        model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip

    generate(all_prompts[:2], 4)  # warm-up
    for b in batches:
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            done = 0
            while done < min(n, b):  # one full batch: its rate is the rate of all N in waves of b
                generate(all_prompts[done : done + b], out_len)
                done += b
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            out["batches"][str(b)] = {"output_tok_s": min(n, b) * out_len / wall, "wall_s": wall}
        except torch.OutOfMemoryError as exc:
            out["batches"][str(b)] = {"error": f"out of memory: {str(exc)[:120]}"}
        torch.cuda.empty_cache()
        print(json.dumps({"hf": b, **out["batches"][str(b)]}), flush=True)
    return out


# ---- the roofline ---------------------------------------------------------------------------------


def matmul_tflops(shape: str) -> dict[str, float]:
    """bf16 TFLOP/s of the model's GEMMs at 8192 rows (QKV, O, gate/up, down), each the median of 20."""
    import torch

    from engine.model_config import dummy_config

    c = dummy_config(shape)
    h, kv = c.hidden_size, c.num_key_value_heads * c.head_dim
    shapes = {
        "qkv": (h, c.num_attention_heads * c.head_dim + 2 * kv),
        "o": (c.num_attention_heads * c.head_dim, h),
        "gate_up": (h, 2 * c.intermediate_size),
        "down": (c.intermediate_size, h),
    }
    rates = {}
    for name, (k, n) in shapes.items():
        a = torch.randn(8192, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ w.t()
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ w.t()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        times.sort()
        rates[name] = 2 * 8192 * k * n / times[len(times) // 2] / 1e12
    return rates


def roofline(
    shape: str, n: int, in_len: int, out_len: int, tflops: float, copy_gbs: float
) -> dict[str, float]:
    """Seconds the workload needs at the measured rates, and the output tok/s that gives."""
    from engine.model_config import dummy_config

    c = dummy_config(shape)
    h, layers, hd = c.hidden_size, c.num_hidden_layers, c.head_dim
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    matmul_weights = layers * (h * (q + 2 * kv) + q * h + 3 * h * c.intermediate_size)
    attention = layers * 2 * 2 * q * in_len * (in_len + 1) / 2  # QK^T and PV over the causal half
    prefill_flops = n * (2 * matmul_weights * in_len + attention + 2 * h * c.vocab_size)
    embed = c.vocab_size * h
    weight_bytes = 2 * (matmul_weights + embed * (1 if c.tie_word_embeddings else 2) + h * (2 * layers + 1))
    kv_per_token = 2 * layers * kv * 2
    waves = math.ceil(n / MAX_NUM_SEQS)
    later = out_len - 1  # the first token comes with the prompt's own step
    decode_bytes = waves * later * weight_bytes + n * kv_per_token * sum(
        in_len + j for j in range(1, later + 1)
    )
    prefill_s = prefill_flops / (tflops * 1e12)
    decode_s = decode_bytes / (copy_gbs * 1e9)
    return {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "seconds": prefill_s + decode_s,
        "output_tok_s": n * out_len / (prefill_s + decode_s),
        "prefill_tflop": prefill_flops / 1e12,
        "decode_gb": decode_bytes / 1e9,
    }


# ---- the run --------------------------------------------------------------------------------------


def child(args: list[str], timeout: float) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "-m", "bench.throughput", *args, "--json", f.name]
        proc = subprocess.run(cmd, timeout=timeout, cwd=Path(__file__).resolve().parent.parent)
        if proc.returncode != 0:
            return {"error": f"{' '.join(args[:2])}: exit {proc.returncode}"}
        return json.loads(Path(f.name).read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", nargs="+", type=int, default=[256, 1000])
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--hf-batches", nargs="*", type=int, default=[64, 128])
    p.add_argument("--shape", default=SHAPE, help="a dummy shape; another than the default writes no records")
    p.add_argument("--device", default=None, help="for the engine part alone (e.g. cpu for a smoke run)")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--profile", action="store_true", help="kernel time by name of a full batch's first steps")
    p.add_argument("--part", choices=["engine", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    lens = (args.input_len, args.output_len)
    if args.part:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        if args.part == "engine":
            result = engine_part(args.shape, args.num_prompts, *lens, args.device, args.profile)
        else:
            result = hf_part(args.shape, max(args.num_prompts), args.hf_batches, *lens)
        args.json.write_text(json.dumps(result, indent=1))
        return
    common = ["--num-prompts", *map(str, args.num_prompts), "--input-len", str(lens[0]),
              "--output-len", str(lens[1]), "--shape", args.shape, *(["--profile"] if args.profile else [])]  # fmt: skip
    if args.device == "cpu":  # a smoke run of the engine path alone: no roofline, no baseline, no records
        print(json.dumps(child(["--part", "engine", *common, "--device", "cpu"], 1800), indent=1))
        return

    import torch

    from bench.kernels import copy_bandwidth

    copies = copy_bandwidth()
    copy_gbs = max(copies["copy_"], copies["mul_kernel"])
    rates = matmul_tflops(args.shape)
    tflops = max(rates.values())
    torch.cuda.empty_cache()
    print(f"d2d copy {copy_gbs:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s ({rates})", flush=True)
    eng = child(["--part", "engine", *common], 540)
    hf = (
        child(["--part", "hf", *common, "--hf-batches", *map(str, args.hf_batches)], 420)
        if args.hf_batches
        else {}
    )
    print(json.dumps({"engine": eng, "transformers": hf}, indent=1), flush=True)
    if "error" in eng:
        print(eng["error"])
        return
    best = max(
        ((int(b), r["output_tok_s"]) for b, r in hf.get("batches", {}).items() if "output_tok_s" in r),
        key=lambda br: br[1], default=None,
    )  # fmt: skip
    rows = []
    for n in args.num_prompts:
        roof = roofline(args.shape, n, *lens, tflops, copy_gbs)
        greedy = eng["runs"][f"{n}_greedy"]["output_tok_s"]
        for label in ("greedy", "sampled"):
            run = eng["runs"][f"{n}_{label}"]
            tps = run["output_tok_s"]
            ratio = tps / roof["output_tok_s"]
            base_ratio = tps / best[1] if best else None
            suffix = "" if label == "greedy" else "_sampled"
            name = f"engine_throughput_{SHAPE_KEY}_{n}x{lens[0]}x{lens[1]}{suffix}"
            goal = (
                f">= {GOALS['roofline']} of the workload roofline, >= {GOALS['baseline']}x transformers eager"
            )
            if label == "sampled":
                goal += f", >= {GOALS['sampled']}x greedy"
            met = ratio >= GOALS["roofline"] and base_ratio is not None and base_ratio >= GOALS["baseline"]
            met = met and (label == "greedy" or tps / greedy >= GOALS["sampled"])
            if args.shape == SHAPE:
                from bench.record import record

                record(
                    name, tps, "output tok/s", ceiling=roof["output_tok_s"],
                    ceiling_name=(f"workload roofline: {roof['prefill_tflop']:.0f} TFLOP at {tflops:.0f} TFLOP/s + "
                                  f"{roof['decode_gb']:.0f} GB at {copy_gbs:.0f} GB/s"),
                    baseline=best[1] if best else None,
                    baseline_name=f"transformers eager generate, batch {best[0]} (best of {args.hf_batches})" if best else None,
                    baseline_ratio=base_ratio, goal=goal, out_dir=args.out_dir, command=COMMAND,
                    extra={"run": run, "roofline": roof, "greedy_output_tok_s": greedy, "sampled_params": SAMPLED,
                           "copy_gbs": copy_gbs, "matmul_tflops": rates, "transformers": hf,
                           **({"step_profiles": eng["step_profiles"]} if "step_profiles" in eng else {})},
                )  # fmt: skip
            base_s = f"; transformers {best[1]:.0f} ({base_ratio:.2f}x)" if best and base_ratio else ""
            vs = f"; {tps / greedy:.2f}x greedy" if label == "sampled" else ""
            rows.append([f"{n} x {lens[0]}/{lens[1]} {label}", f"{tps:.0f}", f"roofline {roof['output_tok_s']:.0f}{base_s}{vs}",
                         f"{ratio:.2f}", goal, "yes" if met else "NO"])  # fmt: skip
    print(
        "\n| figure | output tok/s | ceiling / baseline | ratio | goal | met? |\n| --- | ---: | --- | ---: | --- | --- |"
    )
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
