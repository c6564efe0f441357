"""`pdserve serve [MODEL]`: the whole stack on one host in one command, as `vllm serve MODEL` is: `pdserve
up`'s router and workers plus the OpenAI gateway, under one supervisor (serving/supervisor.py).

Its flags are the ones `pdserve gateway`, `pdserve up` and the workers define, taken from their parsers
(one definition per flag): vLLM's names, `--host`/`--port` for the HTTP endpoint. The engine flags go to
every worker. `--prefill 0` is aggregated serving: the router sends each request to a decode worker alone,
which prefills it (router/aggregated.py). SIGTERM or Ctrl-C drains the gateway first, then the cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

from gateway.tenants import SALT_SECRET_ENV
from serving.supervisor import Child
from serving.tls import TLSConfig

# flags of the other parsers that `serve` does not take (it sets them itself) or takes from another
_GATEWAY_SKIP = {"router", "model"}  # the router it starts, the served model's directory
_UP_SKIP = {"host", "port", "model", "served_model_name"}  # the gateway's; the engine parser's
_ENGINE_SHARED = {"model", "served_model_name"}  # `up` passes these to the workers itself


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`serve`, with the flags of `up` (registered before it), `gateway` and the engine."""
    from engine.args import add_engine_args
    from gateway.cli import add_gateway_args
    from serving.roles import add_worker_args

    p = subparsers.add_parser(
        "serve",
        help="serve a model behind the OpenAI API in one command (gateway, router and workers), as "
        "`vllm serve MODEL`",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="HF model dir, GGUF file or dummy shape (default: bundled SmolLM2); the same as --model",
    )
    p.add_argument(
        "--router-port", type=int, default=0, help="the router's gRPC port on 127.0.0.1 (default: a free one)"
    )
    gateway, engine, worker = (argparse.ArgumentParser(add_help=False) for _ in range(3))
    add_gateway_args(gateway)
    add_engine_args(engine)
    add_worker_args(worker)
    up = subparsers.choices["up"]
    gateway_flags = _take(p, gateway, _GATEWAY_SKIP)
    _take(p, up, _UP_SKIP)
    worker_flags = _take(p, engine, set()) + _take(p, worker, set(), only={"local_prefill_threshold"})
    p.set_defaults(
        func=cmd_serve,
        gateway_flags=[
            a
            for a in gateway_flags
            if a.dest not in {"host", "port", "api_key", "cache_salt_secret", "drain_timeout_s"}
        ],
        worker_flags=[a for a in worker_flags if a.dest not in _ENGINE_SHARED],
    )
    return p


def _take(
    dst: argparse.ArgumentParser, src: argparse.ArgumentParser, skip: set[str], only: set[str] | None = None
) -> list[argparse.Action]:
    """Add `src`'s flags to `dst` as they are defined there, except those in `skip` (by dest), those not in
    `only` and those `dst` has already; returns the ones added."""
    taken = []
    for action in src._actions:
        if (
            not action.option_strings
            or isinstance(action, argparse._HelpAction)
            or action.dest in skip
            or (only is not None and action.dest not in only)
            or any(o in dst._option_string_actions for o in action.option_strings)
        ):
            continue
        dst._add_action(copy.copy(action))
        taken.append(action)
    return taken


def _argv(actions: list[argparse.Action], args: argparse.Namespace) -> list[str]:
    """The command-line flags that give `args`' values for `actions` (those left at their defaults: none)."""
    out: list[str] = []
    for action in actions:
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif isinstance(action, argparse._StoreTrueAction):
            out.append(flag)
        elif isinstance(action, argparse._StoreAction) and action.nargs is None:
            out += [flag, str(value)]
        else:
            raise TypeError(f"pdserve serve cannot pass on {flag} ({type(action).__name__})")
    return out


def cmd_serve(args: argparse.Namespace) -> int:
    from engine.bundled import model_dir
    from serving.roles import cluster_children, supervise

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag} and --model {args.model}")
    directory = model_dir(args.model_tag or args.model)  # converted once, here
    name = args.served_model_name or Path(directory).name
    up = argparse.Namespace(**{**vars(args), "host": "127.0.0.1", "port": args.router_port})
    up.model, up.served_model_name = directory, name
    children = cluster_children(up, _argv(args.worker_flags, args))
    if args.api_key:  # the gateway reads its secrets from its environment: out of `ps`
        os.environ["PDSERVE_API_KEY"] = args.api_key
    if args.cache_salt_secret:
        os.environ[SALT_SECRET_ENV] = args.cache_salt_secret
    children.append(_gateway(args, children[-1].address, directory))
    ready = f"pdserve serve: {name} at http://{args.host}:{args.port}/v1 (OpenAI API)"
    healthy = _healthy(TLSConfig.from_args(args))
    return supervise(children, args.drain_timeout_s, args.startup_timeout, "serve", healthy, ready)


def _gateway(args: argparse.Namespace, router: str, directory: str) -> Child:
    from serving.roles import pdserve_command

    cmd = [*pdserve_command(args), "gateway", "--router", router]
    cmd += ["--host", args.host, "--port", str(args.port), "--model", directory]
    cmd += ["--drain-timeout-s", f"{args.drain_timeout_s:g}", *_argv(args.gateway_flags, args)]
    return Child("gateway", f"{args.host}:{args.port}", cmd)


def _healthy(tls: TLSConfig) -> Callable[[Child], Awaitable[bool]]:
    """The gateway: its /health answers 200 (the router behind it serving); the others: gRPC health."""
    from serving.roles import grpc_healthy

    grpc_ok = grpc_healthy(tls)

    async def healthy(child: Child) -> bool:
        if child.role != "gateway":
            return await grpc_ok(child)
        host, port = child.address.rsplit(":", 1)
        host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
        host = f"[{host}]" if ":" in host else host
        return await asyncio.to_thread(_http_ok, f"http://{host}:{port}/health")

    return healthy


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False
