"""`pdserve gateway --router HOST:PORT --port 8000`: the OpenAI-compatible HTTP server.

engine/cli.py wires it with `add_gateway_parser(sub)`; `python -m gateway.cli ...` runs it alone.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_gateway_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway over a router")
    add_gateway_args(p)
    p.set_defaults(func=cmd_gateway)
    return p


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", default="127.0.0.1:50051", help="the router's gRPC address")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY") or None,
        help="require `Authorization: Bearer KEY` on /v1 (default: $PDSERVE_API_KEY; unset: open)",
    )
    p.add_argument(
        "--model", default=None, help="tokenizer directory for logprobs' token text (default: bundled)"
    )
    p.add_argument("--uvicorn-log-level", default="warning")


def cmd_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import GatewayConfig, create_app

    app = create_app(GatewayConfig(router=args.router, api_key=args.api_key, model_dir=args.model))
    print(f"pdserve gateway: http://{args.host}:{args.port}/v1 -> router {args.router}", flush=True)
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=5
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve gateway")
    add_gateway_args(parser)
    return cmd_gateway(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
