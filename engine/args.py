"""The engine's command-line flags, the flat keyword arguments they become (`LLM(...)`'s), and the one
`EngineConfig` those arguments build."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from engine.config import CacheConfig, EngineConfig, SchedulerConfig

# the engine's max_model_len sets the scheduler's, so that one name is the engine's
_SCHEDULER_FIELDS = {f.name for f in fields(SchedulerConfig)} - {"max_model_len"}
_CACHE_FIELDS = {f.name for f in fields(CacheConfig)}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="HF model dir, GGUF file or dummy shape (default: bundled SmolLM2)"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    p.add_argument("--dtype", default="auto", help="auto, float32, float16, bfloat16")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "gguf", "dummy"],
        help="how to read the weights; dummy: random weights of a named shape (default: by the files)",
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=["awq", "gptq", "gguf"],
        help="serve int4 weights: awq, gptq (checkpoints with a quantization_config) or gguf (Q4_0, Q4_1 and "
        "Q8_0 tensors kept quantized); default: what the checkpoint says, gguf for a .gguf file",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output in tokens (default: the model's)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (default: 16)")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of the GPU's memory for weights, activations and the KV cache (default: 0.9)",
    )
    p.add_argument("--cpu-kv-cache-space", type=float, default=1.0, help="GiB of KV cache on the CPU")
    p.add_argument(
        "--num-gpu-blocks-override", type=int, default=None, help="this many KV blocks, whatever memory says"
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one batch (default: 256)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="most tokens one step computes, prompt chunks included (default: the scheduler's budget)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of prompt prefixes computed before (default on)",
    )
    p.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts over several steps, beside running decodes (default on)",
    )
    p.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="fcfs: first come, first served; priority: by the request's priority, then arrival",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over this many GPUs, one process each (default: 1; gloo processes on the CPU)",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="spread a mixture of experts' experts whole over the tensor-parallel ranks instead of splitting each "
        "expert (default: split)",
    )
    p.add_argument(
        "--swap-space",
        type=float,
        default=0.0,
        help="GiB of pinned CPU memory that preempted requests' KV blocks move to (default: 0, none)",
    )
    p.add_argument(
        "--preemption-mode",
        default="auto",
        choices=["auto", "swap", "recompute"],
        help="a preempted request's KV: swap to the CPU, recompute later, or auto: whichever costs less "
        "(default: auto; recompute without swap space)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e4m3"],
        help="auto: the model's dtype; fp8 (e4m3, per-layer scales): twice the tokens in the same memory",
    )
    p.add_argument(
        "--calculate-kv-scales",
        action="store_true",
        help="fp8 KV cache: per-layer K and V scales from a calibration pass at start-up (default: 1.0)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the engine's random state (default: 0)")
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly: no CUDA graphs for decode steps (default: graphs on CUDA)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="the model's name in the API and in block hashes"
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plan each step while the device runs the one before (offline engine and decode workers; "
        "default on)",
    )
    p.add_argument(
        "--speculative-method",
        default=None,
        choices=["ngram", "self_draft"],
        help="speculative decoding on decode workers and the offline engine (default: none)",
    )
    p.add_argument(
        "--num-speculative-tokens", type=int, default=None, help="tokens drafted per step (speculation)"
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        help='vLLM\'s speculative_config as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}\' or \'{"method": "self_draft", "num_speculative_tokens": 3, '
        '"num_draft_layers": 8}\'; --speculative-method and --num-speculative-tokens override its keys',
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The flags of `add_engine_args` as `engine_config` / `LLM(...)` keyword arguments."""
    names = (
        "model", "tokenizer", "dtype", "device", "load_format", "quantization", "max_model_len", "block_size",
        "gpu_memory_utilization", "cpu_kv_cache_space", "num_gpu_blocks_override", "max_num_seqs",
        "max_num_batched_tokens", "enable_prefix_caching", "enable_chunked_prefill", "scheduling_policy",
        "seed", "enforce_eager", "served_model_name", "tensor_parallel_size", "enable_expert_parallel", "swap_space",
        "preemption_mode",
        "kv_cache_dtype", "calculate_kv_scales",
    )  # fmt: skip
    kwargs = {name: getattr(args, name) for name in names}
    kwargs["async_scheduling"] = args.async_scheduling
    kwargs["speculative_config"] = speculative_config(args)
    return kwargs


def speculative_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """The speculative flags as one speculative_config dict (None: no speculation); ValueError for JSON
    that is not an object."""
    import json

    spec: dict[str, Any] = {}
    if args.speculative_config:
        spec = json.loads(args.speculative_config)
        if not isinstance(spec, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {args.speculative_config!r}")
    if args.speculative_method:
        spec["method"] = args.speculative_method
    if args.num_speculative_tokens is not None:
        spec["num_speculative_tokens"] = args.num_speculative_tokens
    if spec and "method" not in spec:
        spec["method"] = "ngram"
    return spec or None


def engine_config(**kwargs: Any) -> EngineConfig:
    """The EngineConfig of flat keyword arguments under vLLM's names: each names a field of EngineConfig,
    SchedulerConfig or CacheConfig (engine/config.py), and a field left out keeps its default; an unknown
    name is a TypeError. max_num_batched_tokens None (or left out) is the default budget, or max_model_len
    when that is longer and prompts are not chunked (each must fit in one step)."""
    scheduler = {k: kwargs.pop(k) for k in _SCHEDULER_FIELDS & kwargs.keys()}
    cache = {k: kwargs.pop(k) for k in _CACHE_FIELDS & kwargs.keys()}
    max_model_len = kwargs.get("max_model_len")
    budget = scheduler.get("max_num_batched_tokens")
    if budget is None:
        budget = SchedulerConfig.max_num_batched_tokens
        if not scheduler.get("enable_chunked_prefill", SchedulerConfig.enable_chunked_prefill):
            budget = max(budget, max_model_len or 0)
    scheduler["max_num_batched_tokens"] = budget
    # max_model_len None: the model's own, known once it loads (EngineCore sets the scheduler's then)
    sched = SchedulerConfig(**scheduler, max_model_len=max_model_len or budget)
    return EngineConfig(**kwargs, scheduler=sched, cache=CacheConfig(**cache))
