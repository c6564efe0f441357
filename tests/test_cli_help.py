"""Every flag of every `pdserve` subcommand says what it does in `--help`."""

from __future__ import annotations

import argparse

from serving.cli import build_parser


def _parsers(parser: argparse.ArgumentParser, name: str = "pdserve"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_flag_of_every_subcommand_has_a_help_text():
    parsers = dict(_parsers(build_parser()))
    assert {"pdserve up", "pdserve serve", "pdserve decode", "pdserve gateway"} <= parsers.keys()
    bare = [
        f"{name} {'/'.join(action.option_strings) or action.dest}"
        for name, parser in parsers.items()
        for action in parser._actions
        if action.help != argparse.SUPPRESS and not (action.help or "").strip()
    ]
    assert not bare, "flags without a help text:\n" + "\n".join(bare)


def test_serve_takes_vllm_server_flags():
    parser = build_parser()
    args = parser.parse_args(
        ["serve", "some/model", "--port", "8001", "--api-key", "k", "--max-num-seqs", "8", "--enforce-eager"]
        + ["--no-enable-prefix-caching", "--prefill", "0", "--served-model-name", "m", "--dtype", "float32"]
    )
    assert (args.model_tag, args.port, args.api_key, args.prefill, args.served_model_name) == (
        "some/model", 8001, "k", 0, "m",
    )  # fmt: skip
    from serving.serve import _argv

    workers = _argv(args.worker_flags, args)
    assert workers == [
        "--dtype", "float32", "--max-num-seqs", "8", "--no-enable-prefix-caching", "--enforce-eager",
    ]  # fmt: skip
    assert _argv(args.gateway_flags, args) == []
