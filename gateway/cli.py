"""`pdserve gateway --router HOST:PORT --port 8000`: the OpenAI-compatible HTTP server.

serving/cli.py wires it with `add_gateway_parser(sub)`; `python -m gateway.cli ...` runs it alone.
SIGTERM or Ctrl-C drains it (gateway/drain.py) and it exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from gateway.defaults import DEFAULT_MAX_REQUEST_BYTES
from gateway.tenants import SALT_SECRET_ENV
from serving.logs import LogSetup, add_log_format_arg, current, identify, make_handler, setup_logging
from serving.tls import TLSConfig, add_tls_args

_AFTER_DRAIN_S = 5.0  # uvicorn's own graceful shutdown, once the drain is over: nothing should be left


def add_gateway_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway over a router")
    add_gateway_args(p)
    p.set_defaults(func=cmd_gateway)
    return p


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", default="127.0.0.1:50051", help="the router's gRPC address")
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP server listens on")
    p.add_argument("--port", type=int, default=8000, help="the HTTP port (default: 8000)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY") or None,
        help="require `Authorization: Bearer KEY` on /v1 (default: $PDSERVE_API_KEY; unset: open)",
    )
    add_tenant_args(p)
    p.add_argument(
        "--model", default=None, help="tokenizer directory for logprobs' token text (default: bundled)"
    )
    add_serving_args(p)
    add_tool_args(p)
    p.add_argument(
        "--uvicorn-log-level", default="warning", help="uvicorn's own log level (default: warning)"
    )
    add_metrics_compat_arg(p)
    add_tls_args(p)  # for its channel to the router


def add_tool_args(p: argparse.ArgumentParser) -> None:
    from gateway.reasoning import PARSERS as REASONING_PARSERS
    from gateway.tools import PARSERS

    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto" (the default where a request gives tools): the model may call tools, and '
        "--tool-call-parser picks the calls out of its text (named and required tool choices need neither)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        default=None,
        help="how the model writes tool calls: hermes (<tool_call> blocks), llama3_json, mistral ([TOOL_CALLS] "
        "and a JSON array) or pythonic ([f(a=1), g()])",
    )
    p.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='a request with tool_choice "none" renders no tools into the chat template (default: it does)',
    )
    p.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        default=None,
        help="chat template variables, a JSON object, that a request's chat_template_kwargs override (say "
        "'{\"enable_thinking\": false}')",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split a reasoning model's thinking (<think> ... </think>) off chat answers into `reasoning`: "
        "deepseek_r1 or qwen3",
    )


def _json_object(text: str) -> str:
    """The flag's text where it is a JSON object (kept as text, so that `pdserve serve` passes it on as is)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return text


def add_tenant_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-keys-file",
        default=None,
        help="API keys and their tenants, one `KEY TENANT` a line (reread on SIGHUP): each tenant gets its "
        "own prefix cache (a cache_salt derived from it) and its own rate limits",
    )
    p.add_argument(
        "--cache-salt-secret",
        default=None,
        help=f"the key tenants' cache salts are derived with (default: ${SALT_SECRET_ENV}, else random at "
        "start; gateways that share a cluster should share it)",
    )
    p.add_argument(
        "--rate-limit-requests-per-s",
        type=float,
        default=None,
        help="each tenant's requests per second (default: no limit); over it: 429 with Retry-After",
    )
    p.add_argument(
        "--rate-limit-tokens-per-s",
        type=float,
        default=None,
        help="each tenant's prompt and completion tokens per second (default: no limit)",
    )


def add_metrics_compat_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics-compat",
        choices=("vllm",),
        default=None,
        help="/metrics also under vLLM's vllm: prefix (as the router's and workers' flag)",
    )


def add_serving_args(p: argparse.ArgumentParser) -> None:
    """Flags about serving HTTP requests (`pdserve serve` takes them from here, with the rest)."""
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies get 413 without being read (default: 4 MiB)",
    )
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM, how long requests in flight may finish before they are stopped (default: 30)",
    )


def _log_access() -> None:
    access = logging.getLogger("pdserve.access")
    if not access.handlers:
        access.addHandler(make_handler(sys.stdout, "%(asctime)s %(name)s: %(message)s"))
    access.setLevel(logging.INFO)
    access.propagate = False


def cmd_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import GatewayConfig, create_app
    from gateway.drain import DrainingServer

    config = GatewayConfig(
        router=args.router,
        api_key=args.api_key,
        model_dir=args.model,
        max_request_bytes=args.max_request_bytes,
        drain_timeout_s=args.drain_timeout_s,
        metrics_compat=getattr(args, "metrics_compat", None),
        tls=TLSConfig.from_args(args),
        api_keys_file=args.api_keys_file,
        cache_salt_secret=args.cache_salt_secret,
        rate_limit_requests_per_s=args.rate_limit_requests_per_s,
        rate_limit_tokens_per_s=args.rate_limit_tokens_per_s,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        default_chat_template_kwargs=json.loads(args.default_chat_template_kwargs or "{}"),
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
    )
    identify("gateway", f"{args.host}:{args.port}")
    app = create_app(config)
    _log_access()
    print(f"pdserve gateway: http://{args.host}:{args.port}/v1 -> router {args.router}", flush=True)
    server_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        log_config=None if current().format == "json" else uvicorn.config.LOGGING_CONFIG,  # json: the root's
        access_log=False,  # pdserve.access writes one line per request, with its final status
        timeout_graceful_shutdown=int(_AFTER_DRAIN_S),
    )
    DrainingServer(server_config, app.state.gateway.drain, config.drain_timeout_s).run()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve gateway")
    add_gateway_args(parser)
    add_log_format_arg(parser)
    args = parser.parse_args(argv)
    setup_logging(LogSetup(args.log_format))
    return cmd_gateway(args)


if __name__ == "__main__":
    sys.exit(main())
