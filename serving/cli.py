"""The `pdserve` command: offline generation, every served role (router, prefill, decode, gateway), `up`,
`serve` and `health`."""

from __future__ import annotations

import argparse
import sys

from engine.args import add_engine_args, engine_kwargs
from engine.sampling_params import SamplingParams
from kvtransfer import TRANSPORTS
from serving.chat_template import CHAT_TEMPLATE_HELP
from serving.logs import LogSetup, add_log_format_arg, setup_logging
from serving.roles import METRICS_COMPAT, METRICS_COMPAT_HELP
from serving.tls import TLSConfig, add_kv_secret_arg, add_tls_args

LOG_PROMPTS_HELP = "log each prompt's text at DEBUG (with --log-level DEBUG); never logged otherwise"


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.sampling_seed
    )
    engine = llm.engine
    if args.chat and engine.tokenizer is not None:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        prompt: str | list[int] = engine.tokenizer.encode(
            engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True),
            add_special_tokens=False,
        )
    else:
        prompt = args.prompt
    rid = engine.add_request(prompt, params)
    shown = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != rid:
                continue
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
    sys.stdout.write("\n")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    import asyncio

    from serving.grpc_common import check_health

    tls = TLSConfig.from_args(args)

    async def check_all() -> list[bool]:
        return await asyncio.gather(*(check_health(a, args.timeout, tls) for a in args.address))

    failing = [a for a, ok in zip(args.address, asyncio.run(check_all()), strict=True) if not ok]
    for address in failing:
        print(f"pdserve health: {address} is not serving", file=sys.stderr)
    return 1 if failing else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="pdserve: disaggregated LLM inference")
    parser.add_argument(
        "--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR, for every process started"
    )
    add_log_format_arg(parser)
    sub = parser.add_subparsers(dest="command", required=True, help="what to run")
    gen = sub.add_parser("generate", help="stream the model's answer to one prompt to the terminal")
    gen.add_argument("prompt", help="the prompt, or the user message with --chat")
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap the prompt in the model's chat template (default on)",
    )
    gen.add_argument("--system", default=None, help="a system message for the chat template")
    gen.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass")
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    from serving.roles import add_worker_args, cmd_router, cmd_worker

    for role in ("prefill", "decode"):
        w = sub.add_parser(role, help=f"run a {role} worker (gRPC)")
        add_engine_args(w)
        add_worker_args(w)
        w.set_defaults(func=cmd_worker)
    r = sub.add_parser("router", help="run the router (gRPC)")
    r.add_argument("--host", default="127.0.0.1", help="address the gRPC server listens on")
    r.add_argument("--port", type=int, default=50051, help="the gRPC port (default: 50051)")
    r.add_argument("--prefill", required=True, help="prefill worker addresses, comma separated")
    r.add_argument("--decode", required=True, help="decode worker addresses, comma separated")
    r.add_argument("--model", default=None, help="for the tokenizer and chat template (default: bundled)")
    r.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: its directory's)"
    )
    r.add_argument("--policy", default="prefix_aware", help="prefix_aware, least_loaded, round_robin, random")
    r.add_argument(
        "--redis-url", default=None, help="share the prefix index through Redis (default: in memory)"
    )
    r.add_argument(
        "--redis-timeout-s",
        type=float,
        default=0.05,
        help="seconds per Redis call; a request whose index lookup fails or times out is routed by load",
    )
    r.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, how long requests in flight may take to finish before they are ended",
    )
    r.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here (0: off)")
    r.add_argument("--metrics-compat", choices=METRICS_COMPAT, default=None, help=METRICS_COMPAT_HELP)
    r.add_argument(
        "--speculate-ttl-s",
        type=float,
        default=5.0,
        help="seconds a routing decision marks a prompt's blocks as held before the worker's events confirm "
        "them (0: only the workers' events)",
    )
    r.add_argument("--log-prompts", action="store_true", help=LOG_PROMPTS_HELP)
    r.add_argument("--chat-template", default=None, help=CHAT_TEMPLATE_HELP)
    add_tls_args(r)
    r.set_defaults(func=cmd_router)
    up = sub.add_parser(
        "up",
        help="start router + prefill and decode workers locally, in one command; "
        "other flags go to the workers",
    )
    up.add_argument(
        "--prefill",
        type=int,
        default=1,
        help="prefill workers (default: 1; 0: aggregated, each decode worker prefills its own requests)",
    )
    up.add_argument("--decode", type=int, default=1, help="decode workers (default: 1)")
    for role in ("prefill", "decode"):
        up.add_argument(
            f"--{role}-tp",
            type=int,
            default=None,
            help=f"tensor parallel size of each {role} worker, a GPU per rank, the GPUs handed out in order "
            "(default: the workers' --tensor-parallel-size, else 1)",
        )
    up.add_argument("--host", default="127.0.0.1", help="address the router listens on")
    up.add_argument("--port", type=int, default=50051, help="the router's gRPC port (default: 50051)")
    up.add_argument(
        "--model", default=None, help="HF model dir, GGUF file or dummy shape (default: bundled SmolLM2)"
    )
    up.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: its directory's)"
    )
    up.add_argument(
        "--kv-transport",
        default="tcp",
        choices=TRANSPORTS,
        help="how prompts' KV blocks reach decode workers",
    )
    up.add_argument(
        "--policy",
        default="prefix_aware",
        help="the router's policy: prefix_aware, least_loaded, round_robin, random",
    )
    up.add_argument(
        "--redis-url", default=None, help="share the router's prefix index through Redis (default: in memory)"
    )
    up.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds for every process to become healthy"
    )
    up.add_argument(
        "--metrics",
        action="store_true",
        help="the router and each worker serve Prometheus /metrics on a free port of their own (listed at "
        "start-up)",
    )
    up.add_argument("--metrics-compat", choices=METRICS_COMPAT, default=None, help=METRICS_COMPAT_HELP)
    up.add_argument(
        "--speculate-ttl-s",
        type=float,
        default=5.0,
        help="the router's --speculate-ttl-s (see pdserve router)",
    )
    up.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds the router and workers get to finish what they hold",
    )
    up.add_argument(
        "--log-prompts", action="store_true", help="the router's --log-prompts: " + LOG_PROMPTS_HELP
    )
    up.add_argument(
        "--chat-template", default=None, help="the router's --chat-template: " + CHAT_TEMPLATE_HELP
    )
    add_tls_args(up)
    add_kv_secret_arg(up)
    up.set_defaults(func=None)

    h = sub.add_parser(
        "health",
        help="exit 0 when every address answers SERVING on the gRPC health service (compose health checks)",
    )
    h.add_argument("address", nargs="+", help="host:port of a router, prefill or decode worker")
    h.add_argument("--timeout", type=float, default=3.0, help="seconds per address")
    add_tls_args(h)
    h.set_defaults(func=cmd_health)

    from gateway.cli import add_gateway_parser

    add_gateway_parser(sub)

    from serving.serve import add_serve_parser

    add_serve_parser(sub)  # after `up` and `gateway`: it takes their flags

    from serving.quantize_cli import add_quantize_parser

    add_quantize_parser(sub)

    from serving.bench_cli import add_bench_args, cmd_bench

    b = sub.add_parser("bench", help="benchmark an OpenAI-compatible server (vLLM `bench serve`'s flags)")
    add_bench_args(b)
    b.set_defaults(func=cmd_bench)
    for command in sub.choices.values():  # also after the command, as `pdserve router --log-format json`
        if "--log-format" not in command._option_string_actions:
            add_log_format_arg(command, argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "up":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    setup_logging(LogSetup(args.log_format, args.log_level))
    try:
        if args.command == "up":
            from serving.roles import cmd_up

            return cmd_up(args, extra)
        return args.func(args)
    except ValueError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
