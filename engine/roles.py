"""`pdserve prefill|decode|router|up`: one role per process, or a whole local cluster."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--worker-id", default=None)
    p.add_argument("--kv-transport", default="tcp", choices=["tcp", "nccl", "cuda_ipc"])
    p.add_argument("--kv-host", default="127.0.0.1", help="address the KV receiver listens on (decode)")
    p.add_argument(
        "--local-prefill-threshold",
        type=int,
        default=0,
        help="decode: prompts up to this many tokens are prefilled locally, not transferred",
    )
    p.add_argument("--cpu-kv-cache-space", type=float, default=1.0, help="GiB of KV cache on the CPU")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)


def worker_config(args: argparse.Namespace, role: str):
    from engine.cli import engine_kwargs
    from engine.config import CacheConfig, SchedulerConfig
    from engine.engine_core import EngineConfig
    from engine.worker_config import WorkerConfig

    kw = engine_kwargs(args)
    budget = kw["max_num_batched_tokens"] or 8192
    engine = EngineConfig(
        model=kw["model"],
        tokenizer=kw["tokenizer"],
        dtype=kw["dtype"],
        device=kw["device"],
        load_format=kw["load_format"],
        seed=kw["seed"],
        max_model_len=kw["max_model_len"],
        served_model_name=args.served_model_name,
        scheduler=SchedulerConfig(
            max_num_seqs=kw["max_num_seqs"],
            max_num_batched_tokens=budget,
            max_model_len=max(2, kw["max_model_len"] or budget),
            enable_chunked_prefill=kw["enable_chunked_prefill"],
            scheduling_policy=kw["scheduling_policy"],
        ),
        cache=CacheConfig(
            block_size=kw["block_size"],
            enable_prefix_caching=kw["enable_prefix_caching"],
            gpu_memory_utilization=kw["gpu_memory_utilization"],
            cpu_kv_cache_space=args.cpu_kv_cache_space,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
        ),
    )
    return WorkerConfig(
        engine=engine,
        worker_id=args.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}",
        kv_transport=args.kv_transport,
        kv_host=args.kv_host,
        local_prefill_threshold=args.local_prefill_threshold,
    )


def cmd_worker(args: argparse.Namespace) -> int:
    from engine.serving import run_worker

    config = worker_config(args, args.command)
    if args.command == "decode":
        from decode_worker import server as mod

        core = "decode_worker.core.DecodeCore"
    else:
        from prefill_worker import server as mod  # type: ignore[no-redef]

        core = "prefill_worker.core.PrefillCore"
    servicer = mod.DecodeServicer if args.command == "decode" else mod.PrefillServicer  # type: ignore[attr-defined]
    asyncio.run(
        run_worker(core, config, mod.SERVICE_NAME, mod.add_servicer, servicer, f"{args.host}:{args.port}")
    )
    return 0


def model_dir(model: str | None) -> str:
    from engine.bundled import bundled_model_dir, gguf_model_dir

    if model is None:
        return str(bundled_model_dir())
    return str(gguf_model_dir(model)) if Path(model).is_file() else model


def cmd_router(args: argparse.Namespace) -> int:
    from router.main import serve_router
    from router.server import RouterConfig

    directory = model_dir(args.model)
    config = RouterConfig(
        prefill=tuple(a for a in args.prefill.split(",") if a),
        decode=tuple(a for a in args.decode.split(",") if a),
        model_dir=directory,
        served_model_name=args.served_model_name or Path(directory).name,
        policy=args.policy,
        redis_url=args.redis_url,
        redis_timeout_s=args.redis_timeout_s,
        drain_timeout_s=args.drain_timeout_s,
        metrics_port=args.metrics_port or None,
    )
    asyncio.run(serve_router(config, f"{args.host}:{args.port}"))
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cmd_up(args: argparse.Namespace, passthrough: list[str]) -> int:
    """Start router + N prefill + M decode workers as processes; wait until healthy; stop all on Ctrl-C."""
    directory = model_dir(args.model)  # convert once here, not in every worker at the same time
    exe = [sys.executable, "-m", "engine.cli", "--log-level", args.log_level]
    model = ["--model", directory, "--served-model-name", args.served_model_name or Path(directory).name]
    prefill = [f"127.0.0.1:{free_port()}" for _ in range(args.prefill)]
    decode = [f"127.0.0.1:{free_port()}" for _ in range(args.decode)]
    procs: list[subprocess.Popen] = []
    try:
        for role, addrs in (("prefill", prefill), ("decode", decode)):
            for i, addr in enumerate(addrs):
                cmd = [
                    *exe,
                    role,
                    "--port",
                    addr.rsplit(":", 1)[1],
                    "--worker-id",
                    f"{role}-{i}",
                    "--kv-transport",
                    args.kv_transport,
                    *model,
                    *passthrough,
                ]
                procs.append(subprocess.Popen(cmd, start_new_session=True))
        router_addr = f"{args.host}:{args.port or free_port()}"
        procs.append(
            subprocess.Popen(
                [
                    *exe,
                    "router",
                    "--host",
                    args.host,
                    "--port",
                    router_addr.rsplit(":", 1)[1],
                    "--prefill",
                    ",".join(prefill),
                    "--decode",
                    ",".join(decode),
                    "--policy",
                    args.policy,
                    *(["--redis-url", args.redis_url] if args.redis_url else []),
                    *model,
                ],
                start_new_session=True,
            )
        )
        if not asyncio.run(_wait_healthy([*prefill, *decode, router_addr], procs, args.startup_timeout)):
            print("pdserve up: the cluster did not become healthy", file=sys.stderr)
            return 1
        print(
            f"pdserve ready: router at {router_addr} (prefill {','.join(prefill)}; decode {','.join(decode)})"
        )
        workers = [
            (role, addr) for role, addrs in (("prefill", prefill), ("decode", decode)) for addr in addrs
        ]
        listing = {
            "router": {"address": router_addr, "pid": procs[-1].pid},
            "workers": [{"role": r, "address": a, "pid": p.pid} for (r, a), p in zip(workers, procs)],
        }
        print("pdserve cluster: " + json.dumps(listing), flush=True)
        return _supervise(procs)
    finally:
        _stop_all(procs)


async def _wait_healthy(addrs: list[str], procs: list[subprocess.Popen], timeout: float) -> bool:
    from engine.grpc_common import check_health

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return False
        if all(await asyncio.gather(*(check_health(a) for a in addrs))):
            return True
        await asyncio.sleep(0.5)
    return False


def _supervise(procs: list[subprocess.Popen]) -> int:
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    try:
        while not stop["now"]:
            time.sleep(0.5)  # workers may die and come back; the router routes around them
    except KeyboardInterrupt:
        pass
    return 0


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
