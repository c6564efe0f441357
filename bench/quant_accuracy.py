"""Int4 accuracy on the bundled SmolLM2-135M-Instruct: perplexity and greedy agreement, dense vs RTN, AWQ, GPTQ.

    python -m bench.quant_accuracy [--out-dir DIR] [--group-size G] [--methods rtn awq gptq gptq_lm_head]
        [--work-dir DIR]

The dense model is the bundled GGUF dequantized to fp32 (engine/bundled.py). Each method quantizes it with
`pdserve quantize`'s pipeline (engine/quantize/) on the shipped calibration text and the engine serves
the checkpoint it writes (CPU, fp32 activations). Group size: 64 by default, since 128 does not divide
SmolLM2's hidden size of 576 and the AWQ and GPTQ formats need whole groups. Reported per model:
- perplexity on the shipped held-out text (engine/quantize/data/heldout.txt), 512-token pieces;
- greedy agreement with the dense model on the chat prompts of bench/spec_decode.py (48 tokens each): the
  share of prompts whose whole output matches, and of tokens before the first difference.
Records: quant_ppl_<method>_smollm2 (perplexity, baseline = the dense model's), in bench/results/ or --out-dir;
gptq_lm_head is GPTQ with the (tied) LM head quantized too, the embedding dense.
CPU is enough (about 15 minutes on 2 cores); on a GPU host pass --device cuda.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COMMAND = "python -m bench.quant_accuracy"
MAX_TOKENS = 48
METHODS = {
    "rtn": ("rtn", False),
    "awq": ("awq", False),
    "gptq": ("gptq", False),
    "gptq_lm_head": ("gptq", True),
}


def chat_outputs(llm: Any) -> list[list[int]]:
    from bench.spec_decode import CHATS, chat_prompts
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in chat_prompts(llm, CHATS)], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(dense: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    same_prefix = 0.0
    for a, b in zip(dense, other, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same_prefix += n / max(len(a), 1)
    return {
        "prompts_equal": sum(a == b for a, b in zip(dense, other)) / len(dense),
        "tokens_before_first_difference": same_prefix / len(dense),
    }


def evaluate(model_path: str, device: str) -> dict[str, Any]:
    from engine import LLM
    from engine.quantize.calibration import HELDOUT_TEXT, perplexity

    llm = LLM(model_path, device=device, dtype="float32", cpu_kv_cache_space=0.1, max_model_len=1024)
    ids = llm.tokenizer.encode(HELDOUT_TEXT.read_text(), add_special_tokens=False)
    t = time.perf_counter()
    ppl = perplexity(llm.engine.runner.model, ids)
    return {"ppl": ppl, "tokens": len(ids), "ppl_s": time.perf_counter() - t, "outputs": chat_outputs(llm)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument(
        "--group-size", type=int, default=None,
        help="default: the largest of 128, 64, 32 dividing the model's sizes (64 for SmolLM2's 576 hidden)",
    )  # fmt: skip
    p.add_argument(
        "--methods",
        nargs="+",
        default=["rtn", "awq", "gptq", "gptq_lm_head"],
        choices=list(METHODS),
        help="gptq_lm_head: GPTQ with the LM head quantized too (lm_head=true)",
    )
    p.add_argument(
        "--work-dir", type=Path, default=None, help="where the checkpoints go (default: a temp dir)"
    )
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from bench.record import record
    from engine.bundled import bundled_model_dir
    from engine.model_config import ModelConfig
    from engine.quantize import QuantizeConfig, quantize
    from engine.quantize.pipeline import largest_group

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="quant-accuracy-"))
    config = ModelConfig.from_dir(bundled_model_dir())
    group = args.group_size or largest_group({config.hidden_size, config.intermediate_size})
    dense = evaluate(str(bundled_model_dir()), args.device)
    rows = [("dense (dequantized GGUF)", dense["ppl"], 1.0, 1.0, 1.0, 0.0)]
    ppl: dict[str, float] = {}
    for method in args.methods:
        t = time.perf_counter()
        how, lm_head = METHODS[method]
        out = quantize(
            QuantizeConfig(
                None, str(work / method), method=how, group_size=group, device=args.device, lm_head=lm_head
            )
        )
        seconds = time.perf_counter() - t
        result = evaluate(str(out), args.device)
        agree = agreement(dense["outputs"], result["outputs"])
        ppl[method] = result["ppl"]
        goal = "<= rtn's perplexity" if method in ("awq", "gptq") else None
        record(
            f"quant_ppl_{method}_smollm2", result["ppl"], "perplexity",
            baseline=dense["ppl"], baseline_name="dense model (the bundled GGUF dequantized, fp32)",
            goal=goal, out_dir=args.out_dir, command=COMMAND,
            extra={"group_size": group, "heldout_tokens": result["tokens"], "quantize_s": seconds,
                   "chat_prompts": len(dense["outputs"]), "max_tokens": MAX_TOKENS, **agree,
                   **({"rtn_ppl": ppl["rtn"], "met": result["ppl"] <= ppl["rtn"]} if "rtn" in ppl and goal else {}),
                   **({"gptq_ppl": ppl["gptq"]} if method == "gptq_lm_head" and "gptq" in ppl else {})},
        )  # fmt: skip
        rows.append((method, result["ppl"], result["ppl"] / dense["ppl"], agree["prompts_equal"],
                     agree["tokens_before_first_difference"], seconds))  # fmt: skip
    print(
        f"\n{'model':26s} {'ppl':>8s} {'vs dense':>9s} {'chats equal':>12s} {'tokens agree':>13s} {'quantize s':>11s}"
    )
    for name, value, ratio, equal, tokens, seconds in rows:
        print(f"{name:26s} {value:8.3f} {ratio:9.4f} {equal:12.2f} {tokens:13.2f} {seconds:11.0f}")


if __name__ == "__main__":
    main()
