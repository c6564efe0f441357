"""`pdserve quantize`: write an int4 checkpoint (AWQ or GPTQ layout) of a model, dense or a mixture of experts
(engine/quantize/)."""

from __future__ import annotations

import argparse


def add_quantize_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "quantize",
        help="quantize a model to int4 (rtn, awq or gptq) and write a checkpoint vLLM and transformers load",
    )
    p.add_argument("--model", default=None, help="HF model dir or GGUF file (default: bundled SmolLM2)")
    p.add_argument("--out", required=True, help="the directory to write the checkpoint to")
    p.add_argument(
        "--method", default="awq", choices=["rtn", "awq", "gptq"], help="how to quantize (default: awq)"
    )
    p.add_argument(
        "--group-size", type=int, default=128, help="input features per scale and zero (default: 128)"
    )
    p.add_argument(
        "--format",
        default=None,
        choices=["awq", "gptq"],
        help="the checkpoint's layout (default: awq for --method awq, gptq otherwise)",
    )
    p.add_argument("--sym", action="store_true", help="symmetric: every zero point 8 (GPTQ sym=true)")
    p.add_argument(
        "--desc-act",
        action="store_true",
        help="GPTQ act order: columns by decreasing activation",
    )
    p.add_argument(
        "--lm-head",
        action="store_true",
        help="quantize the LM head too (GPTQ format, lm_head=true; the embedding stays dense, so this saves "
        "memory on an untied model and adds the head's int4 tensors to a tied one)",
    )
    p.add_argument(
        "--calibration",
        default=None,
        help="a text file to calibrate on (default: the shipped calibration text)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per calibration sequence (default: 512; 64 for gptq, whose Hessian needs many first positions)",
    )
    p.add_argument(
        "--calibration-tokens",
        type=int,
        default=None,
        help="calibrate on this many tokens (default: the whole text)",
    )
    p.add_argument("--device", default="cpu", help="where to run the calibration (default: cpu)")
    p.set_defaults(func=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> int:
    from engine.quantize import QuantizeConfig, quantize

    cfg = QuantizeConfig(
        model=args.model, out=args.out, method=args.method, group_size=args.group_size, format=args.format,
        sym=args.sym, desc_act=args.desc_act, calibration=args.calibration, seq_len=args.seq_len,
        max_tokens=args.calibration_tokens, device=args.device, lm_head=args.lm_head,
    )  # fmt: skip
    out = quantize(cfg)
    print(f"pdserve quantize: {cfg.method} checkpoint ({cfg.fmt} layout, group {cfg.group_size}) in {out}")
    return 0
