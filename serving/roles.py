"""`pdserve prefill|decode|router|up`: one role per process, or a whole local cluster."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from kvtransfer import TRANSPORTS
from serving.logs import identify
from serving.supervisor import Child, StopSignals, Supervisor
from serving.tls import KV_SECRET_ENV, TLSConfig, add_kv_secret_arg, add_tls_args, kv_secret

METRICS_COMPAT = ("vllm",)  # serving/metrics_compat.py
METRICS_COMPAT_HELP = (
    "also export every series under vLLM's vllm: prefix, with the names older vLLM guides use"
)


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address the gRPC server listens on")
    p.add_argument("--port", type=int, default=0, help="the gRPC port (default 0: a free one)")
    p.add_argument(
        "--worker-id", default=None, help="the worker's name to the router (default: role-host-pid)"
    )
    p.add_argument(
        "--kv-transport",
        default="tcp",
        choices=TRANSPORTS,
        help="how prompts' KV blocks reach decode workers",
    )
    p.add_argument("--kv-host", default="127.0.0.1", help="address the KV receiver listens on (decode)")
    p.add_argument(
        "--local-prefill-threshold",
        type=int,
        default=0,
        help="decode: prompts up to this many tokens are prefilled locally, not transferred",
    )
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds to finish the requests in flight before ending them",
    )
    p.add_argument(
        "--metrics-port", type=int, default=None, help="serve the worker's Prometheus /metrics here (0: off)"
    )
    p.add_argument("--metrics-compat", choices=METRICS_COMPAT, default=None, help=METRICS_COMPAT_HELP)
    add_tls_args(p)
    add_kv_secret_arg(p)


def kv_auth(args: argparse.Namespace, tls: TLSConfig):
    """The KV channel's credentials: the gRPC certificates when there is a CA (mutual TLS), the secret."""
    from kvtransfer.auth import PeerAuth

    files = (tls.cert, tls.key, tls.ca) if tls.ca else (None, None, None)
    return PeerAuth(kv_secret(args), *(str(Path(f).resolve()) if f else None for f in files))


def worker_config(args: argparse.Namespace, role: str):
    from engine.args import engine_config, engine_kwargs
    from serving.worker_config import WorkerConfig

    kwargs = engine_kwargs(args)
    if role == "prefill":  # a prefill worker samples one token per prompt: nothing to speculate
        kwargs["speculative_config"] = None
    return WorkerConfig(
        engine=engine_config(**kwargs),
        worker_id=args.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}",
        kv_transport=args.kv_transport,
        kv_host=args.kv_host,
        local_prefill_threshold=args.local_prefill_threshold,
        kv_auth=kv_auth(args, TLSConfig.from_args(args)),
    )


def cmd_worker(args: argparse.Namespace) -> int:
    import functools

    from serving.worker import run_worker

    tls = TLSConfig.from_args(args)
    tls.check_listen(args.host, f"the {args.command} worker's gRPC")
    config = worker_config(args, args.command)
    if args.command == "decode":
        tls.check_listen(args.kv_host, "the KV receiver", authenticated=config.kv_auth.authenticates)
        from decode_worker import server as mod

        core = "decode_worker.core.DecodeCore"
    else:
        from prefill_worker import server as mod  # type: ignore[no-redef]

        core = "prefill_worker.core.PrefillCore"
    servicer = (
        functools.partial(mod.DecodeServicer, tls=tls)  # type: ignore[attr-defined]
        if args.command == "decode"
        else mod.PrefillServicer  # type: ignore[attr-defined]
    )
    address = f"{args.host}:{args.port}"
    identify(args.command, address)
    asyncio.run(
        run_worker(
            core,
            config,
            mod.SERVICE_NAME,
            mod.add_servicer,
            servicer,
            address,
            args.drain_timeout_s,
            args.metrics_port or None,
            args.metrics_compat,
            tls,
        )  # fmt: skip
    )
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    from engine.bundled import model_dir
    from router.main import serve_router
    from router.server import RouterConfig
    from serving.chat_template import read_chat_template

    tls = TLSConfig.from_args(args)
    tls.check_listen(args.host, "the router's gRPC")
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
        metrics_compat=args.metrics_compat,
        speculate_ttl_s=args.speculate_ttl_s,
        tls=tls,
        log_prompts=args.log_prompts,
        chat_template=None if args.chat_template is None else read_chat_template(args.chat_template)[0],
    )
    identify("router", f"{args.host}:{args.port}")
    asyncio.run(serve_router(config, f"{args.host}:{args.port}"))
    return 0


_HANDED_OUT: set[int] = set()


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel takes outgoing connections' local ports from (Linux; its default elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port nothing is bound to now, for a child to listen on, and not handed out before by this process.
    It lies below the ephemeral range: a port found there (as binding port 0 finds one) can be taken as the
    local end of some outgoing connection before the child binds it."""
    low = _ephemeral_ports()[0]
    start = max(1024, low - 20000)
    for _ in range(1000):
        port = random.randrange(start, low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port found in {start}-{low - 1}")


def cmd_up(args: argparse.Namespace, passthrough: list[str]) -> int:
    """Start router + N prefill + M decode workers as processes; wait until healthy; keep them running
    (serving/supervisor.py) until SIGTERM/SIGINT, then drain them all."""
    children = cluster_children(args, passthrough)
    healthy = grpc_healthy(TLSConfig.from_args(args))
    return supervise(children, args.drain_timeout_s, args.startup_timeout, "up", healthy)


def supervise(
    children: list[Child],
    drain_timeout_s: float,
    startup_timeout: float,
    command: str,
    healthy: Callable[[Child], Awaitable[bool]] | None = None,
    ready: str | None = None,
) -> int:
    """Run `children` (workers, the router, then anything else) under one Supervisor: once each is healthy
    (`healthy`; by default the gRPC health service at its address), list them and print `ready`; then keep
    them running until SIGTERM/SIGINT and drain them. `pdserve up`'s and `pdserve serve`'s body."""
    signals = StopSignals().install()
    identify(command)
    supervisor = Supervisor(children, drain_timeout_s)
    try:
        supervisor.start_all()
        check = healthy or grpc_healthy(TLSConfig())
        if not asyncio.run(_wait_healthy(children, check, supervisor, signals, startup_timeout)):
            if signals.stopping:
                return supervisor.drain(signals)
            print(f"pdserve {command}: the cluster did not become healthy", file=sys.stderr)
            return 1
        _announce(children)
        if ready:
            print(ready, flush=True)
        supervisor.run(signals)
        return supervisor.drain(signals)
    finally:
        supervisor.kill_all()


def _announce(children: list[Child]) -> None:
    """The ready line and the `pdserve cluster: {json}` line that tools read (every pid and address)."""
    router = next(c for c in children if c.role == "router")
    workers = [c for c in children if c.role in ("prefill", "decode")]
    prefill = ",".join(c.address for c in workers if c.role == "prefill")
    decode = ",".join(c.address for c in workers if c.role == "decode")
    print(f"pdserve ready: router at {router.address} (prefill {prefill}; decode {decode})")
    listing: dict = {
        "router": {"address": router.address, "pid": router.pid, "metrics_port": router.metrics_port},
        "workers": [
            {"role": c.role, "address": c.address, "pid": c.pid, "metrics_port": c.metrics_port}
            for c in workers
        ],
    }
    listing.update({c.role: {"address": c.address, "pid": c.pid} for c in children if c.role == "gateway"})
    print("pdserve cluster: " + json.dumps(listing), flush=True)


def cluster_children(args: argparse.Namespace, passthrough: list[str]) -> list[Child]:
    """Every worker, then the router; each with the command line it is started (and restarted) with."""
    from engine.bundled import model_dir
    from serving.chat_template import chat_template_argv
    from serving.gpus import assign_gpus, cpu_threads, role_sizes, visible_gpus

    template = chat_template_argv(args.chat_template)  # read and checked before anything starts
    directory = model_dir(args.model)  # convert once here, not in every worker at the same time
    exe = pdserve_command(args)
    tls = TLSConfig.from_args(args)
    tls.check_listen(args.host, "the router's gRPC")  # before any child starts
    if args.kv_secret:  # the workers read it from their environment: out of `ps`
        os.environ[KV_SECRET_ENV] = args.kv_secret
    model = ["--model", directory, "--served-model-name", args.served_model_name or Path(directory).name]
    drain = ["--drain-timeout-s", f"{args.drain_timeout_s:g}"]
    tp, on_cpu = role_sizes(args, passthrough)
    roles = [
        role for role, count in (("prefill", args.prefill), ("decode", args.decode)) for _ in range(count)
    ]
    gpus = assign_gpus([] if on_cpu else visible_gpus(), [(r, tp[r]) for r in roles], args.kv_transport)
    threads = cpu_threads(sum(tp[r] for r in roles)) if all(g is None for g in gpus) else None
    children: list[Child] = []
    for role, devices in zip(roles, gpus):
        port = free_port()
        i = sum(c.role == role for c in children)
        cmd = [*exe, role, "--port", str(port), "--worker-id", f"{role}-{i}"]
        cmd += ["--kv-transport", args.kv_transport, *model, *drain, *tls.argv(), *passthrough]
        cmd += ["--tensor-parallel-size", str(tp[role])]
        metrics = free_port() if args.metrics else None
        cmd += ["--metrics-port", str(metrics)] if metrics else []
        cmd += _compat(args)
        env = {"CUDA_VISIBLE_DEVICES": devices} if devices is not None else None
        if threads is not None:  # no GPUs: the engines share the cores
            env = {"OMP_NUM_THREADS": threads}
        children.append(Child(role, f"127.0.0.1:{port}", cmd, metrics_port=metrics, env=env))
    port = args.port or free_port()
    prefill = ",".join(c.address for c in children if c.role == "prefill")
    decode = ",".join(c.address for c in children if c.role == "decode")
    cmd = [*exe, "router", "--host", args.host, "--port", str(port), "--prefill", prefill]
    cmd += ["--decode", decode, "--policy", args.policy, *drain, *model]
    cmd += ["--redis-url", args.redis_url] if args.redis_url else []
    cmd += ["--speculate-ttl-s", f"{args.speculate_ttl_s:g}", *tls.argv()]
    cmd += ["--log-prompts"] if args.log_prompts else []
    cmd += template
    metrics = free_port() if args.metrics else None
    cmd += ["--metrics-port", str(metrics)] if metrics else []
    cmd += _compat(args)
    children.append(Child("router", f"{args.host}:{port}", cmd, metrics_port=metrics))
    return children


def pdserve_command(args: argparse.Namespace) -> list[str]:
    """`pdserve` as a child process is started, with this process's log level and format."""
    return [
        sys.executable,
        "-m",
        "serving.cli",
        "--log-level",
        args.log_level,
        "--log-format",
        args.log_format,
    ]


def _compat(args: argparse.Namespace) -> list[str]:
    return ["--metrics-compat", args.metrics_compat] if args.metrics_compat else []


def grpc_healthy(tls: TLSConfig) -> Callable[[Child], Awaitable[bool]]:
    """A child is healthy when its gRPC health service answers SERVING (over `tls`)."""
    from serving.grpc_common import check_health

    async def healthy(child: Child) -> bool:
        return await check_health(child.address, tls=tls)

    return healthy


async def _wait_healthy(
    children: list[Child],
    healthy: Callable[[Child], Awaitable[bool]],
    supervisor: Supervisor,
    signals: StopSignals,
    timeout: float,
) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not signals.stopping:
        if supervisor.any_exited():
            return False
        if await _all_healthy(children, healthy):
            return True
        await asyncio.sleep(0.5)
    return False


async def _all_healthy(children: list[Child], healthy: Callable[[Child], Awaitable[bool]]) -> bool:
    """In their order, up to the first that is not: `serve`'s gateway is asked once the cluster serves."""
    for child in children:
        if not await healthy(child):
            return False
    return True
