"""fp8 KV cache accuracy on the bundled SmolLM2-135M-Instruct, and what other 8-bit encodings of K and V keep.

    python -m bench.kv_accuracy [--out-dir DIR] [--prompts N] [--encodings fp8 bf16 ...]

First the engine (CPU, fp32 model) with an fp8 cache, scales 1.0 and calibrated, against its fp32 cache:
- perplexity on the shipped held-out text (engine/quantize/data/heldout.txt) in 512-token pieces, every
  query attending to K and V as the cache holds them; again at other uniform scales (SPREAD), since which
  values round which way moves with the scale, and perplexity with it;
- greedy agreement over QUESTIONS (tests/test_kv_fp8_engine.py takes the first 10): the share of chat prompts
  whose first 16 tokens are equal, and the mean |logprob difference| of the chosen tokens before the first
  difference.
Then transformers (fp32) with each token's K (after RoPE) and V rounded once, as a cache in each encoding
would hold them (ENCODINGS), for the share of prompts equal and the mean KL(fp32 || encoded) of the
next-token distribution along the fp32 outputs (teacher-forced). "fp8" is the engine's encoding, so its
share checks the simulation against the engine's; the others say what another 8-bit format would keep.
Records: kv_fp8_agreement_smollm2 (share of prompts, scales 1.0; baseline = bf16-rounded K and V's share)
and kv_fp8_ppl_smollm2 (perplexity, scales 1.0; baseline = the fp32 cache's), in bench/results/ or --out-dir.
CPU only, about 4 minutes on 2 cores.

    python3 -m bench.kv_accuracy --gpu [--model SmolLM2-135M-Instruct.Q4_1.gguf] [--out-dir DIR]

The engine on the GPU instead, as served: the model in bf16 (and in fp32), its fp8 cache with scales 1.0 and
calibrated against its own dtype's cache, greedy over the same prompts, each engine in a process of its own;
beside them, how many prompts the bf16 model and cache keep against the fp32 ones. Record
kv_fp8_agreement_gpu_smollm2 (the first 10 prompts equal, bf16 model, scales 1.0; baseline = the bf16 model's
against the fp32 model's). About 3 minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COMMAND = "python -m bench.kv_accuracy"
TOKENS = 16
SPREAD = (0.5, 0.8, 1.1, 1.37)  # other uniform scales, for how far perplexity moves with the rounding
QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain what a black hole is in one paragraph.",
    "Write a haiku about autumn leaves.",
    "How do I reverse a list in Python?",
    "What are the primary colors?",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "What is the difference between weather and climate?",
    "Suggest a name for a friendly robot.",
    "Name three animals that live in the ocean.",
    "What is photosynthesis?",
    "How many days are in a leap year?",
    "Write a short poem about the sea.",
    "What does a computer's CPU do?",
    "Give me a recipe for pancakes.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water?",
    "Explain gravity to a child.",
    "List three benefits of exercise.",
    "What is the largest planet in our solar system?",
    "How do airplanes stay in the air?",
    "What is a prime number?",
    "Describe a sunset in two sentences.",
    "What is machine learning?",
    "How can I improve my handwriting?",
    "Why do leaves change color in the fall?",
    "What is the tallest mountain in the world?",
    "Tell me a fun fact about cats.",
    "How do I make a cup of tea?",
    "What causes rain?",
    "Explain what DNA is.",
    "What are the benefits of reading books?",
    "How do I write a good email?",
    "What is the speed of light?",
    "Suggest three hobbies for a rainy day.",
    "What is the meaning of the word 'serendipity'?",
    "How does a rainbow form?",
    "What should I pack for a beach trip?",
    "Explain the water cycle.",
    "What is an atom?",
    "How do bees make honey?",
    "Give me a tip for learning a new language.",
    "What is the capital of Japan?",
    "Why do we need sleep?",
    "What is the difference between a virus and bacteria?",
    "Write a limerick about a dog.",
    "How does the internet work?",
    "What is democracy?",
    "How do I start running?",
]


def _fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    from kernels.kv_quant import dequantize, quantize

    s = torch.as_tensor(scale, dtype=torch.float32)
    return dequantize(quantize(x, s), s, x.dtype)


def _token_scale(x: torch.Tensor, top: float) -> torch.Tensor:
    """One scale per token and head (x's last dimension is head_dim): its largest |x| maps to `top`."""
    return x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / top


def _fp8_token_search(x: torch.Tensor, steps: int = 32) -> torch.Tensor:
    """e4m3 with a per-token scale chosen among `steps` points of one binade for the least squared error."""
    from kernels.kv_quant import FP8_MAX

    mult = 2 ** (torch.arange(steps, dtype=torch.float32) / steps)  # [1, 2)
    scale = _token_scale(x, FP8_MAX).unsqueeze(-2) * mult[:, None]  # (..., steps, 1)
    y = _fp8(x.unsqueeze(-2) / scale, 1.0) * scale
    best = ((y - x.unsqueeze(-2)) ** 2).sum(-1).argmin(-1)  # (...,)
    return torch.gather(y, -2, best[..., None, None].expand(*best.shape, 1, x.shape[-1])).squeeze(-2)


def _fp8_token(x: torch.Tensor) -> torch.Tensor:
    from kernels.kv_quant import FP8_MAX

    s = _token_scale(x, FP8_MAX)
    return _fp8(x / s, 1.0) * s


def _int8_token(x: torch.Tensor) -> torch.Tensor:
    s = _token_scale(x, 127.0)
    return (x / s).round().clamp(-127, 127) * s


ENCODINGS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "fp8": lambda x: _fp8(x, 1.0),  # the engine's: e4m3, one scale per layer (1.0 by default)
    "bf16": lambda x: x.to(torch.bfloat16).to(x.dtype),
    "fp8_token": _fp8_token,
    "fp8_token_search": _fp8_token_search,
    "int8_token": _int8_token,
}


def compare(
    want: list[list[int]], got: list[list[int]], want_lps: list[list[float]], got_lps: list[list[float]]
) -> dict[str, float]:
    """Share of prompts equal (all, and the first 10), and mean |logprob diff| before the first difference."""
    equal = [a == b for a, b in zip(want, got, strict=True)]
    deltas = []
    for a, b, la, lb in zip(want, got, want_lps, got_lps, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        deltas += [abs(la[i] - lb[i]) for i in range(n)]
    return {
        "prompts_equal": sum(equal) / len(equal),
        "first_10_equal": sum(equal[:10]),
        "mean_abs_logprob_diff": sum(deltas) / max(len(deltas), 1),
    }


def engine_run(questions: list[str], spread: tuple[float, ...] = (), **kw: Any) -> dict[str, Any]:
    """Greedy outputs with their logprobs and held-out perplexity; `spread`: the perplexity again with every
    layer's K and V scale set to each of these (an fp8 cache's rounding moves with its scale)."""
    from engine import LLM, SamplingParams
    from engine.kv_scales import set_kv_scales
    from engine.quantize.calibration import HELDOUT_TEXT, perplexity

    llm = LLM(dtype="float32", device="cpu", max_model_len=512, cpu_kv_cache_space=0.2, **kw)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, logprobs=0)
    outs = llm.chat([[{"role": "user", "content": q}] for q in questions], params)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    lps = []
    for o in outs:
        assert o.outputs[0].logprobs is not None
        lps.append([step[t] for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
    text = llm.tokenizer.encode(HELDOUT_TEXT.read_text(), add_special_tokens=False)
    runner = llm.engine.runner
    ppl = perplexity(runner.model, text, kv_dtype=runner.kv_cache.dtype)
    by_scale = {}
    for scale in spread:
        set_kv_scales(runner.model, torch.full((runner.model.config.num_hidden_layers, 2), scale))
        by_scale[str(scale)] = perplexity(runner.model, text, kv_dtype=runner.kv_cache.dtype)
    return {"ids": ids, "lps": lps, "ppl": ppl, "heldout_tokens": len(text), "ppl_by_scale": by_scale}


@contextmanager
def encoded_kv(model: Any, encode: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """transformers' Llama with every K (after RoPE) and V rounded by `encode` as it is computed, so the
    cache holds and every later query reads the rounded values, as a KV cache in that encoding would.
    `encode` sees one head's vector in the last dimension."""
    import transformers.models.llama.modeling_llama as llama

    rope = llama.apply_rotary_pos_emb
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def encode_v(_module: Any, _inputs: Any, out: torch.Tensor) -> torch.Tensor:  # (..., kv_heads * head_dim)
        return encode(out.unflatten(-1, (-1, head_dim))).flatten(-2)

    def rope_then_encode(q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        q, k = rope(q, k, *args, **kwargs)
        return q, encode(k)

    hooks = [layer.self_attn.v_proj.register_forward_hook(encode_v) for layer in model.model.layers]
    llama.apply_rotary_pos_emb = rope_then_encode
    try:
        yield
    finally:
        llama.apply_rotary_pos_emb = rope
        for h in hooks:
            h.remove()


@torch.no_grad()
def simulate(questions: list[str], encodings: list[str]) -> dict[str, dict[str, float]]:
    from transformers import AutoModelForCausalLM

    from engine.bundled import bundled_model_dir
    from engine.tokenizer import Tokenizer

    path = bundled_model_dir()
    tok = Tokenizer.from_dir(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    prompts = [  # as LLM.chat encodes them
        torch.tensor([tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), False)])
        for q in questions
    ]

    def greedy() -> list[list[int]]:
        outs = [model.generate(p, max_new_tokens=TOKENS, do_sample=False) for p in prompts]
        return [o[0, p.shape[1] :].tolist() for o, p in zip(outs, prompts)]

    def log_probs(seqs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [model(s, use_cache=False).logits[0].log_softmax(-1) for s in seqs]

    want = greedy()
    seqs = [torch.cat([p, torch.tensor([w])], 1) for p, w in zip(prompts, want)]
    ref = log_probs(seqs)
    result = {}
    for name in encodings:
        with encoded_kv(model, ENCODINGS[name]):
            got = greedy()
            lps = log_probs(seqs)
        kl = [
            (r.exp() * (r - g)).sum(-1)[p.shape[1] - 1 :] for r, g, p in zip(ref, lps, prompts)
        ]  # the output positions
        equal = [a == b for a, b in zip(want, got)]
        result[name] = {
            "prompts_equal": sum(equal) / len(equal),
            "first_10_equal": sum(equal[:10]),
            "mean_kl": torch.cat(kl).mean().item(),
        }
        print(f"simulated {name:18s} {result[name]}", flush=True)
    return result


GPU_RUNS = [
    (dtype, kv, cal) for dtype in ("bfloat16", "float32") for kv, cal in (("auto", 0), ("fp8", 0), ("fp8", 1))
]


def gpu_part(
    model: str | None, dtype: str, kv: str, calibrated: bool, questions: list[str]
) -> list[list[int]]:
    """One engine on the GPU (a child process): each prompt's greedy tokens."""
    from engine import LLM, SamplingParams

    llm = LLM(model, device="cuda", dtype=dtype, max_model_len=512, gpu_memory_utilization=0.3,
              enable_prefix_caching=False, kv_cache_dtype=kv, calculate_kv_scales=calibrated)  # fmt: skip
    outs = llm.chat(
        [[{"role": "user", "content": q}] for q in questions],
        SamplingParams(temperature=0, max_tokens=TOKENS),
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(want: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    """Prompts whose tokens are equal (the first 10, and all) and, for the first 10, the tokens before the first
    difference (TOKENS where none of the shorter's positions differs)."""
    equal = [a == b for a, b in zip(want, got, strict=True)]
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), TOKENS) for a, b in zip(want, got)]
    return {"first_10_equal": sum(equal[:10]), "prompts_equal": sum(equal) / len(equal),
            "tokens_before_first_difference_first_10": first[:10]}  # fmt: skip


def gpu_agreement(model: str | None, questions: list[str], out_dir: Path | None) -> None:
    import subprocess
    import tempfile

    from bench.record import record

    ids: dict[tuple[str, str, int], list[list[int]]] = {}
    for dtype, kv, cal in GPU_RUNS:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, "-m", "bench.kv_accuracy", "--part", dtype, kv, str(cal), "--json", f.name,
                   "--prompts", str(len(questions))] + (["--model", model] if model else [])  # fmt: skip
            subprocess.run(cmd, check=True, timeout=600, cwd=Path(__file__).resolve().parent.parent)
            ids[(dtype, kv, cal)] = json.loads(Path(f.name).read_text())
    cases = {
        f"{dtype} model, fp8 {'calibrated' if cal else 'scales 1.0'}": agreement(ids[(dtype, "auto", 0)], got)
        for (dtype, kv, cal), got in ids.items()
        if kv == "fp8"
    }
    base = agreement(ids[("float32", "auto", 0)], ids[("bfloat16", "auto", 0)])
    for name, row in [*cases.items(), ("bf16 model and cache against fp32", base)]:
        print(f"{name:40s} first 10: {row['first_10_equal']:2d}  all: {row['prompts_equal']:.2f}", flush=True)
    record(
        "kv_fp8_agreement_gpu_smollm2", cases["bfloat16 model, fp8 scales 1.0"]["first_10_equal"],
        "of the first 10 chat prompts", baseline=base["first_10_equal"],
        baseline_name="the bf16 model and cache against the fp32 ones (first 10 equal)",
        goal="the first 16 greedy tokens equal on >= 9 of the first 10 prompts", out_dir=out_dir,
        command=COMMAND + " --gpu",
        extra={"prompts": len(questions), "tokens": TOKENS, "against_the_model_dtype_cache": cases,
               "bf16_against_fp32": base},
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--prompts", type=int, default=len(QUESTIONS), help=f"the first N of {len(QUESTIONS)}")
    p.add_argument("--encodings", nargs="+", default=list(ENCODINGS), choices=list(ENCODINGS))
    p.add_argument("--gpu", action="store_true", help="the engine on the GPU, bf16 and fp32 models")
    p.add_argument("--model", default=None, help="with --gpu: the model (default: the bundled one)")
    p.add_argument("--part", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    from bench.record import record

    questions = QUESTIONS[: args.prompts]
    if args.part:
        dtype, kv, cal = args.part
        args.json.write_text(json.dumps(gpu_part(args.model, dtype, kv, cal == "1", questions)))
        return
    if args.gpu:
        gpu_agreement(args.model, questions, args.out_dir)
        return
    full = engine_run(questions)
    engine: dict[str, dict[str, Any]] = {}
    runs: dict[str, dict[str, Any]] = {
        "scales_1": {"spread": SPREAD},
        "calibrated": {"calculate_kv_scales": True},
    }
    for name, kw in runs.items():
        run = engine_run(questions, kv_cache_dtype="fp8", **kw)
        engine[name] = {"ppl": run["ppl"], **compare(full["ids"], run["ids"], full["lps"], run["lps"])}
        engine[name] |= {"ppl_by_scale": run["ppl_by_scale"]} if run["ppl_by_scale"] else {}
        print(f"engine fp8 {name:10s} {engine[name]}", flush=True)
    sim = simulate(questions, [e for e in args.encodings if e != "bf16"] + ["bf16"])
    common = {"prompts": len(questions), "tokens": TOKENS, "engine_fp8": engine, "simulated": sim}
    record(
        "kv_fp8_agreement_smollm2", engine["scales_1"]["prompts_equal"], "share of chat prompts",
        baseline=sim["bf16"]["prompts_equal"], baseline_name="K and V rounded to bf16 (simulated)",
        goal="the first 16 greedy tokens equal on >= 9 of the first 10 prompts",
        out_dir=args.out_dir, command=COMMAND, extra=common,
    )  # fmt: skip
    record(
        "kv_fp8_ppl_smollm2", engine["scales_1"]["ppl"], "perplexity",
        baseline=full["ppl"], baseline_name="the engine with an fp32 KV cache",
        out_dir=args.out_dir, command=COMMAND,
        extra={"heldout_tokens": full["heldout_tokens"], "calibrated_ppl": engine["calibrated"]["ppl"],
               "ppl_by_uniform_scale": engine["scales_1"]["ppl_by_scale"]},
    )  # fmt: skip
    print(
        f"\nperplexity: fp32 cache {full['ppl']:.4f}; fp8 at uniform scales {engine['scales_1']['ppl_by_scale']}"
    )
    print(f"{'KV cache':30s} {'prompts equal':>14s} {'first 10':>9s} {'ppl / KL':>12s}")
    for name, row in engine.items():
        print(
            f"{'engine fp8 ' + name:30s} {row['prompts_equal']:14.2f} {row['first_10_equal']:9d} {row['ppl']:12.4f}"
        )
    for name, row in sim.items():
        print(
            f"{'simulated ' + name:30s} {row['prompts_equal']:14.2f} {row['first_10_equal']:9d} {row['mean_kl']:12.2e}"
        )


if __name__ == "__main__":
    main()
