"""The engine's command-line flags and the `LLM`/`EngineConfig` keyword arguments they become."""

from __future__ import annotations

import argparse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="HF model dir, GGUF file or dummy shape (default: bundled SmolLM2)"
    )
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--dtype", default="auto", help="auto, float32, float16, bfloat16")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly: no CUDA graphs for decode steps (default: graphs on CUDA)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="the model's name in the API and in block hashes"
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {
        "model": args.model,
        "tokenizer": args.tokenizer,
        "dtype": args.dtype,
        "device": args.device,
        "load_format": args.load_format,
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": args.enable_prefix_caching,
        "enable_chunked_prefill": args.enable_chunked_prefill,
        "scheduling_policy": args.scheduling_policy,
        "seed": args.seed,
        "enforce_eager": args.enforce_eager,
    }
