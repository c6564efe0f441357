"""Speculative decoding against plain decoding in the same run (engine/spec_decode.py).

    python -m bench.spec_decode [--model GGUF_OR_DIR] [--out-dir DIR] [--device cuda|cpu] [--quick]

On the bundled SmolLM2-135M-Instruct (real weights; --model names its GGUF file where the package is not
installed), greedy, fixed output lengths:
- batch 1, n-gram on an input-grounded prompt (repeat a given 290-token notice; see GROUNDED): decode
  tok/s with speculation over plain decoding's (goal >= 2.0x), with the acceptance rate and mean accepted
  length;
- batch 1, self_draft on chat prompts: the same, as measured;
- batch 1, draft_model on chat prompts: the same, with the bundled model's first DRAFT_LAYERS layers (its
  final norm and LM head too) written as a checkpoint of their own, the one draft here that shares the
  bundled tokenizer: a LayerSkip-style draft with its own KV cache;
  both also with "adaptive": False (always k drafted tokens): where the adaptive policy judges that drafting
  does not pay and drafts nothing, this still measures the acceptance rate and what drafting would cost
  (extra.fixed_k; for self_draft at 10, 20, 25 and 28 draft layers, extra.fixed_k_by_draft_layers);
- batch 64 and 256 of chat prompts, each method with adaptive draft lengths (the default): output tok/s
  over plain decoding's (goal >= 0.97x: speculation never costs throughput);
- the Llama-3-8B shape with dummy weights: the time of a verification step against k at batch 1, 16, 64
  and 256 (k + 1 tokens a row), over the time of a plain decode step: the curve the adaptive policy
  weighs (random weights accept nothing, so no speedup is reported from them).
Each comparison's two engines run side by side in this process, warmed by the timed generate itself first,
then timed in turn five times each (nine at the large batches; the median run kept); a first engine pays the
process's one-time costs untimed.
Records (CUDA only): bench/results/spec_*.json (or --out-dir); --device cpu is a smoke run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COMMAND = "python -m bench.spec_decode"
GOALS = {"ngram_b1": 2.0, "adaptive": 0.97}
REPEATS = 5  # timed generates per engine, alternating with the other engine; the median is reported
REPEATS_BIG = 9  # at batch 64 and 256, whose single runs spread widest (21k-43k tok/s at 256 on the H200)
MAX_MODEL_LEN = 2048
# The batch-1 n-gram prompt: the output is the given text, so all of it is grounded. On edit prompts
# ("fix only the spelling", "write numbers as digits") the bundled 135M model paraphrases and leaves the
# text within ~70 tokens, so most of a 256-token output would not be grounded in the input at all.
GROUNDED = [
    "Here is a notice. Repeat it word for word, then say nothing else.\n\n{text}",
    "Rewrite this notice, keeping every sentence, and fix only the spelling: {text}",
]
TEXT = (  # about 290 tokens: longer than the output, so the repeat never runs out of text
    "The city library opens at nine in the morning and closes at six in the evening. Visitors can borrow "
    "up to five books at a time, and each loan lasts three weeks. The reading room on the second floor is "
    "quiet, and the childrens corner on the first floor has games, puzzles and picture books. "
    "On Saturdays the library holds a story hour for young children at ten, and a chess club meets in the "
    "back room after lunch. Members can reserve a computer for one hour a day, and printing costs ten cents "
    "a page. Books that are returned late cost twenty cents a day, up to a limit of five dollars per book. "
    "The library also lends board games, musical instruments and tools, such as drills and ladders, to "
    "anyone with a card. A small cafe near the entrance sells coffee, tea and sandwiches, and its tables "
    "look out over the park. Every spring the friends of the library run a book sale in the main hall, and "
    "the money they raise pays for new books, longer opening hours and repairs to the old building. "
    "Volunteers help with the sale, shelve returned books and teach evening classes in reading and writing "
    "for adults who want to improve their skills."
)
CHATS = [
    "What is the capital of France?",
    "Give me three tips for learning to cook.",
    "Explain what a hash table is in two sentences.",
    "Write a short poem about the sea.",
    "How do plants make food from sunlight?",
    "List the planets of the solar system.",
    "What are the benefits of regular exercise?",
    "Describe a good morning routine.",
]
DRAFT_LAYERS = 10
SELF_DRAFT_DEPTHS = (DRAFT_LAYERS, 20, 25, 28)  # of the bundled model's 30 layers
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
    "self_draft": {"method": "self_draft", "num_speculative_tokens": 3, "num_draft_layers": DRAFT_LAYERS},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},  # "model": truncated_draft()'s
}


def truncated_draft(model_dir: Path, layers: int, out: Path) -> Path:
    """A checkpoint of `model_dir`'s first `layers` decoder layers, its embedding, final norm and LM head,
    with the same tokenizer files: a draft model that shares the target's tokenizer by construction."""
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    kept = {
        name: t
        for name, t in load_file(str(model_dir / "model.safetensors")).items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers
    }
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2))
    for f in model_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            shutil.copy(f, out / f.name)
    return out


def chat_prompts(llm: Any, texts: list[str]) -> list[list[int]]:
    tok = llm.tokenizer
    return [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True),
            add_special_tokens=False,
        )
        for t in texts
    ]


def timed_generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    import torch

    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafts = sum(o.metrics.spec_decode_num_drafts for o in outs if o.metrics)
    draft_tokens = sum(o.metrics.spec_decode_num_draft_tokens for o in outs if o.metrics)
    accepted = sum(o.metrics.spec_decode_num_accepted_tokens for o in outs if o.metrics)
    return {
        "tok_s": tokens / wall,
        "wall_s": wall,
        "tokens": tokens,
        "outputs": [o.outputs[0].token_ids for o in outs],
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
        "num_drafts": drafts,
    }


def free_device_memory() -> None:
    """Let the next engine size its KV cache on a free GPU, not beside the last one's."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compare(
    make: Any, spec: dict | None, prompts: list[list[int]], max_tokens: int, repeats: int = REPEATS
) -> dict[str, Any]:
    """Plain and speculative decoding of the same prompts on two engines side by side (each with a KV
    cache for the largest batch at max_model_len, see main), each warmed by the same generate first (every
    batch size, context length and kernel shape the timed one meets), then timed in turn, `repeats` times
    each, so that the machine's drift falls on both alike; each side's median run is kept. Greedy outputs are
    compared token by token: in fp32 they are equal (tests/); in bf16 a verification step computes a row's
    k + 1 positions in other kernel shapes than k + 1 decode steps, so a near-tie can break the other way and
    the two continuations part there."""
    engines = {label: make(config) for label, config in (("plain", None), ("spec", spec))}
    for llm in engines.values():
        timed_generate(llm, prompts, max_tokens)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in engines}
    for _ in range(repeats):
        for label, llm in engines.items():
            runs[label].append(timed_generate(llm, prompts, max_tokens))
    out: dict[str, Any] = {}
    for label, done in runs.items():
        out[label] = sorted(done, key=lambda r: r["tok_s"])[len(done) // 2]  # the median run
        out[label]["tok_s_runs"] = [r["tok_s"] for r in done]
    del engines, runs
    free_device_memory()
    plain, spec_out = out["plain"].pop("outputs"), out["spec"].pop("outputs")
    out["same_output"] = plain == spec_out
    agree = [
        next((i for i, (a, b) in enumerate(zip(p, q)) if a != b), min(len(p), len(q)))
        for p, q in zip(plain, spec_out)
    ]
    out["rows_equal"] = sum(p == q for p, q in zip(plain, spec_out)) / len(plain)
    out["first_difference_min"] = min(agree)
    out["tokens_before_first_difference_mean"] = sum(agree) / len(agree)
    out["ratio"] = out["spec"]["tok_s"] / out["plain"]["tok_s"]
    return out


def verify_cost(device: str, batches: list[int], ks: list[int]) -> dict[str, Any]:
    """Seconds of one step of `b` rows each running k + 1 tokens (k = 0: a plain decode step, its graph
    where there is one) on the Llama-3-8B shape, median of 10 after a warm-up."""
    import statistics

    import torch

    from engine import LLM, SamplingParams
    from engine.scheduler import ScheduledSeq, SchedulerOutput

    llm = LLM("Llama-3-8B", load_format="dummy", dtype="bfloat16", device=device, enable_prefix_caching=False)
    runner = llm.engine.runner
    greedy = SamplingParams(temperature=0, max_tokens=1)
    context, bs = 512, runner.block_size
    table = list(range(-(-(context + max(ks) + 1) // bs)))
    out: dict[str, Any] = {}
    for b in batches:
        for k in ks:
            items = [
                ScheduledSeq(f"r{i}", [1] * (k + 1), context, table, True, greedy, None, num_draft=k)
                for i in range(b)
            ]
            plan = SchedulerOutput(items, b * (k + 1), [])
            runner.run(plan)
            times = []
            for _ in range(10):
                if device == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                runner.run(plan)
                times.append(time.perf_counter() - t)
            out[f"b{b}_k{k}"] = statistics.median(times)
        base = out[f"b{b}_k0"]
        print(
            f"verify cost b{b}: " + ", ".join(f"k{k} {out[f'b{b}_k{k}'] / base:.2f}x" for k in ks), flush=True
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", default=None, help="the bundled model's GGUF file or directory (default: the package's)"
    )
    p.add_argument("--device", default=None)
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="small batches and lengths (a smoke run)")
    args = p.parse_args()
    import torch

    from engine import LLM

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "bfloat16" if device == "cuda" else "float32"
    out_len = 32 if args.quick else 256
    big = [4, 8] if args.quick else [64, 256]

    # each engine's KV blocks: the largest batch at max_model_len (12 GiB of SmolLM2's at 256), so that two
    # engines fit side by side
    blocks = max(big) * MAX_MODEL_LEN // 16

    def make(spec: dict | None) -> Any:
        return LLM(
            args.model, dtype=dtype, device=device, max_model_len=MAX_MODEL_LEN, speculative_config=spec,
            num_gpu_blocks_override=blocks,
        )  # fmt: skip

    from engine.bundled import model_dir

    draft_dir = Path(tempfile.mkdtemp(prefix="pdserve-draft-"))
    methods = {
        **METHODS,
        "draft_model": {
            **METHODS["draft_model"],
            "model": str(truncated_draft(Path(model_dir(args.model)), DRAFT_LAYERS, draft_dir)),
        },
    }
    try:
        results = run_all(make, methods, device, out_len, big, args.quick)
    finally:
        shutil.rmtree(draft_dir, ignore_errors=True)
    print(json.dumps(results, indent=1))
    if device == "cuda" and not args.quick:
        write_records(results, big, args.out_dir)


def run_all(
    make: Any, methods: dict[str, dict], device: str, out_len: int, big: list[int], quick: bool
) -> dict[str, Any]:
    """Every comparison: batch 1 for each method, then each method at each large batch, then (CUDA, full
    run) the verify-cost curve."""
    probe = make(None)
    grounded = chat_prompts(probe, [g.format(text=TEXT) for g in GROUNDED])
    chats = chat_prompts(probe, CHATS)
    # the process's first engine pays one-time costs (kernel compiles, allocator growth) that a later
    # one does not: the probe pays them here, untimed
    timed_generate(probe, grounded[:1], out_len)
    timed_generate(probe, [chats[i % len(chats)] for i in range(big[0])], out_len // 2)
    del probe
    free_device_memory()
    results: dict[str, Any] = {}
    results["ngram_b1"] = compare(make, methods["ngram"], grounded[:1], out_len)
    results["self_draft_b1"] = compare(make, methods["self_draft"], chats[:1], out_len)
    results["draft_model_b1"] = compare(make, methods["draft_model"], chats[:1], out_len)
    results["draft_model_b1_fixed_k"] = compare(
        make, {**methods["draft_model"], "adaptive": False}, chats[:1], out_len
    )
    for layers in SELF_DRAFT_DEPTHS:  # an early exit that was never trained for it: acceptance by depth
        spec = {**methods["self_draft"], "num_draft_layers": layers, "adaptive": False}
        results[f"self_draft_b1_fixed_k_{layers}"] = compare(make, spec, chats[:1], out_len)
    for b in big:
        batch = [chats[i % len(chats)] for i in range(b)]
        for name, spec in methods.items():
            results[f"adaptive_b{b}_{name}"] = compare(make, spec, batch, out_len // 2, REPEATS_BIG)
    if device == "cuda" and not quick:
        results["verify_cost"] = verify_cost(device, [1, 16, 64, 256], [0, 1, 2, 4, 8])
    return results


def write_records(results: dict[str, Any], big: list[int], out_dir: Path | None) -> None:
    from bench.record import record

    def spec_record(name: str, r: dict[str, Any], goal: str | None, **more: Any) -> None:
        record(
            name, r["spec"]["tok_s"], "tok/s", baseline=r["plain"]["tok_s"],
            baseline_name="plain decoding, same prompts, same run (tok/s)", ratio=r["ratio"], goal=goal,
            out_dir=out_dir, command=COMMAND,
            extra={"acceptance_rate": r["spec"]["acceptance_rate"],
                   "mean_accepted_length": r["spec"]["mean_accepted_length"], "same_output": r["same_output"], **r,
                   **more},
        )  # fmt: skip

    def fixed_k(r: dict[str, Any]) -> dict[str, Any]:
        """The same method with every step drafting k tokens: its speedup, acceptance and accepted length."""
        return {"ratio": r["ratio"], "tok_s": r["spec"]["tok_s"], "same_output": r["same_output"],
                "acceptance_rate": r["spec"]["acceptance_rate"],
                "mean_accepted_length": r["spec"]["mean_accepted_length"]}  # fmt: skip

    spec_record("spec_ngram_b1_smollm2", results["ngram_b1"], f">= {GOALS['ngram_b1']}x plain")
    spec_record(
        "spec_self_draft_b1_smollm2",
        results["self_draft_b1"],
        None,
        fixed_k_by_draft_layers={
            n: fixed_k(results[f"self_draft_b1_fixed_k_{n}"]) for n in SELF_DRAFT_DEPTHS
        },
    )
    spec_record(
        "spec_draft_model_b1_smollm2",
        results["draft_model_b1"],
        None,
        fixed_k=fixed_k(results["draft_model_b1_fixed_k"]),
    )
    for b in big:
        for name in METHODS:
            spec_record(
                f"spec_adaptive_b{b}_smollm2_{name}",
                results[f"adaptive_b{b}_{name}"],
                f">= {GOALS['adaptive']}x plain",
            )
    cost = results["verify_cost"]
    record(
        "spec_verify_cost_llama3-8b", cost["b1_k4"] / cost["b1_k0"], "x plain step", ratio=cost["b1_k4"] / cost["b1_k0"],
        baseline=1.0, baseline_name="a plain decode step of the same batch", out_dir=out_dir, command=COMMAND,
        extra={"seconds": cost, "note": "value: batch 1, k = 4; every batch and k in extra.seconds"},
    )  # fmt: skip


if __name__ == "__main__":
    main()
