"""A mixture-of-experts layer's FFN on the GPU: the fused kernels (kernels/fused_moe.py) against the expert loop
transformers runs, and against the copy bandwidth for the expert bytes the batch reads.

    python -m bench.moe [--shapes qwen3-30b-a3b mixtral-8x7b] [--tokens 1 8 64 512 4096] [--out-dir DIR] [--sweep]

Per shape (one layer of dummy bf16 experts, the router's choices drawn at random) and token count:
- fused: median CUDA-graph replay of fused_moe_triton (alignment, both GEMMs, the sum of the choices);
- loop: the same in transformers' way (for each chosen expert: gather its tokens, SwiGLU, down, index_add),
  eager, as it must be (its shapes depend on the choices);
- bytes: the chosen experts' weights (each read once) plus x and the output; GB/s of them, and the ratio to
  the device-to-device copy bandwidth measured in the same run.
- int4: the same layer with int4 experts (group 128), its us, its bytes' GB/s and their fraction of copy bandwidth:
  at decode's few pairs the GEMVs (kernels/fused_moe_gemv.py), and beside them the grouped kernels
  (int4_grouped_us); under GPTQ act order (x and the activations read through each expert's permutation), its us
  (int4_act_order_us), and with down's permutation folded into gate_up as a model loads it (int4_act_order_folded_us,
  x alone gathered); with experts as a Q4_K_M GGUF loads them (gate/up Q4_K, down Q6_K), its us (gguf_q4_k_q6_k_us);
- align_pairs alone, what a batch of more than SINGLE_PAIRS pairs pays before the kernels.
--sweep: also time each token count's layer (bf16 and int4) at other tiles (columns a program in each kernel, warps);
record moe_tiles_<shape> (the default's us and every tile's, per token count). --sweep-gemv: only the int4 layer, at
each of the GEMVs' tiles (GEMV_TILES) beside the grouped kernels; record moe_gemv_tiles_<shape>.
Records: moe_fused_<shape>_t<tokens> (us, baseline = the loop's us, ratio = loop / fused; extra: GB/s and
fraction of copy bandwidth, the int4 layer's us and GB/s).

--engine: the engine on dummy Qwen3-30B-A3B weights (bf16, CUDA graphs), batch-1 decode (128 prompt tokens,
256 generated, the median of 3 less a 1-token generate's time) against its roofline: the bytes a decode step
reads (every dense weight, the 8 chosen experts of each layer, the LM head) over the copy bandwidth. Record
moe_engine_decode_b1_qwen3-30b-a3b (tok/s, ceiling = the roofline's tok/s; extra: the GPU's busy fraction and top
kernels over steady batch-1 steps, bench.latency's profile); `--quantization awq`: dummy int4 experts and linears
(group 128), record moe_engine_decode_b1_qwen3-30b-a3b_awq.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernels import copy_bandwidth, time_us  # noqa: E402
from bench.latency import steady_decode  # noqa: E402
from bench.record import record  # noqa: E402
from kernels.fused_moe import (  # noqa: E402
    SINGLE_PAIRS,
    Int4Experts,
    Int8Experts,
    Tiles,
    align_pairs,
    block_m,
    down_order_folded,
    fused_moe_triton,
)
from kernels.fused_moe_gemv import GemvTiles  # noqa: E402

SHAPES = {  # hidden, expert intermediate features, experts, top k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}
COMMAND = "python -m bench.moe"


def transformers_loop(x, w13, w2, weights, ids) -> torch.Tensor:
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for expert in torch.unique(ids).tolist():
        token, choice = torch.where(ids == expert)
        gate_up = torch.nn.functional.linear(x[token], w13[expert])
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = torch.nn.functional.linear(act, w2[expert]) * weights[token, choice, None]
        out.index_add_(0, token, y.to(x.dtype))
    return out


def eager_us(fn, reps: int = 10) -> float:
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def engine_decode(copy_gbs: float, out_dir: Path | None, quantization: str | None = None) -> None:
    from engine import LLM, SamplingParams
    from engine.model_config import dummy_config

    name = "Qwen3-30B-A3B"
    config = dummy_config(name)
    llm = LLM(
        name, load_format="dummy", dtype="bfloat16", enable_prefix_caching=False, quantization=quantization
    )
    prompt = torch.randint(10, config.vocab_size - 10, (128,), generator=torch.Generator().manual_seed(0))

    def generate(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt.tolist()}], [params])
        return time.perf_counter() - t0

    generate(256)
    full = statistics.median(generate(256) for _ in range(3))
    one = statistics.median(generate(1) for _ in range(3))
    tok_s = 255 / (full - one)
    params = dict(llm.engine.runner.model.named_parameters())
    nbytes = {n: p.numel() * p.element_size() for n, p in params.items()}
    experts = sum(b for n, b in nbytes.items() if ".mlp.experts." in n)
    embed = sum(
        b for n, b in nbytes.items() if n.endswith("embed_tokens.weight")
    )  # one row a step, not the table
    step_bytes = (
        sum(nbytes.values()) - embed - experts + experts * config.num_experts_per_tok // config.num_experts
    )
    roofline = copy_gbs * 1e9 / step_bytes
    suffix = f"_{quantization}" if quantization else ""
    print(
        f"engine {name}{suffix} batch-1 decode {tok_s:.1f} tok/s; roofline {roofline:.0f} ({tok_s / roofline:.2f})"
    )
    steady = steady_decode(llm.engine, 1, config.vocab_size)  # the GPU's busy fraction and kernels a step
    kernels = {
        k: steady.get(k) for k in ("busy", "step_ms", "kernel_us_per_step", "kernels_per_step", "top_kernels")
    }
    print(json.dumps(kernels, indent=1))
    record(
        f"moe_engine_decode_b1_qwen3-30b-a3b{suffix}", tok_s, "tok/s", ceiling=roofline,
        ceiling_name="roofline: a decode step's weight bytes (8 of 128 experts a layer) / copy bandwidth",
        extra={"step_bytes": step_bytes, "copy_gb_s": copy_gbs, "steady_decode": kernels}, out_dir=out_dir,
        command=f"{COMMAND} --engine" + (f" --quantization {quantization}" if quantization else ""),
    )  # fmt: skip


def int4_like(w: torch.Tensor, group: int = 128) -> Int4Experts:
    """Random int4 experts of w's (E, N, K) shape (speed does not depend on the values)."""
    e, n, k = w.shape
    gen = torch.Generator(device="cuda").manual_seed(1)
    qweight = torch.randint(
        -(2**31), 2**31 - 1, (e, k // 8, n), device="cuda", generator=gen, dtype=torch.int32
    )
    scales = torch.full((e, k // group, n), 0.007, device="cuda", dtype=torch.float16)
    zeros = torch.full((e, k // group, n), 8, device="cuda", dtype=torch.uint8)
    return Int4Experts(qweight, scales, zeros, group)


def act_order_like(w: Int4Experts) -> Int4Experts:
    """The same experts under GPTQ act order: each expert's rows a random permutation of its input features."""
    e, _, k = w.shape
    gen = torch.Generator(device="cuda").manual_seed(3)
    perm = torch.stack([torch.randperm(k, device="cuda", generator=gen) for _ in range(e)]).int()
    return dataclasses.replace(w, perm=perm)


def gguf_k_like(w13: torch.Tensor, w2: torch.Tensor) -> tuple[Int4Experts, Int8Experts]:
    """Experts as a Q4_K_M GGUF loads them: gate/up Q4_K (int4, groups of 32, fp32 scales and offsets), down Q6_K
    (int8 rows, fp32 scales a 16)."""
    q4 = int4_like(w13, 32)
    q13 = Int4Experts(
        q4.qweight, q4.scales.float(), torch.full_like(q4.scales, -0.05, dtype=torch.float32), 32
    )
    e, n, k = w2.shape
    gen = torch.Generator(device="cuda").manual_seed(2)
    q8 = torch.randint(-32, 32, (e, n, k), device="cuda", generator=gen, dtype=torch.int8)
    return q13, Int8Experts(q8, torch.full((e, n, k // 16), 0.003, device="cuda"), 16)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 512, 4096])
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument(
        "--engine", action="store_true", help="the engine's batch-1 decode on Qwen3-30B-A3B instead"
    )
    p.add_argument("--sweep", action="store_true", help="also time other tiles per token count")
    p.add_argument(
        "--sweep-gemv",
        action="store_true",
        help="time only the int4 GEMVs' tiles (record moe_gemv_tiles_<shape>)",
    )
    p.add_argument("--quantization", choices=["awq"], default=None, help="--engine: dummy int4 (AWQ) weights")
    args = p.parse_args()
    copies = copy_bandwidth()
    copy_gbs = max(copies["copy_"], copies["mul_kernel"])
    print(f"copy bandwidth {copy_gbs:,.0f} GB/s")
    if args.engine:
        engine_decode(copy_gbs, args.out_dir, args.quantization)
        return
    print(
        f"{'shape':<16}{'tokens':>7}{'fused us':>11}{'loop us':>11}{'speed-up':>10}{'GB/s':>9}{'of copy':>9}"
        f"{'int4 us':>10}{'int4 GB/s':>11}{'grouped':>10}{'act ord':>10}{'folded':>10}{'Q4_K_M':>10}"
    )
    for shape in args.shapes:
        hidden, inter, experts, top_k = SHAPES[shape]
        gen = torch.Generator(device="cuda").manual_seed(0)
        w13 = (
            torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        )
        w2 = torch.randn(experts, hidden, inter, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        expert_bytes = (w13[0].numel() + w2[0].numel()) * 2
        q13, q2 = int4_like(w13), int4_like(w2)
        gguf_k = gguf_k_like(w13, w2)
        act_order = act_order_like(q13), act_order_like(q2)
        folded = down_order_folded(*act_order)  # as a model's layers load them
        int4_expert_bytes = expert_bytes // 4 + sum(  # nibbles, plus fp16 scales and uint8 zeros
            (q.scales[0].numel() * 3) for q in (q13, q2)
        )
        swept: dict[str, dict[str, float]] = {}
        for tokens in args.tokens:
            x = torch.randn(tokens, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
            probs = torch.softmax(torch.randn(tokens, experts, device="cuda", generator=gen), dim=-1)
            weights, ids = torch.topk(probs, top_k, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
            inputs = (x, w13, w2, weights, ids)
            if args.sweep_gemv:
                swept[f"t{tokens}"] = sweep_gemv(x, (q13, q2), weights, ids)
                print(shape, tokens, {k: round(v, 1) for k, v in swept[f"t{tokens}"].items()})
                continue
            fused = time_us([partial(fused_moe_triton, *inputs)], reps=20, min_calls=4)
            loop = eager_us(partial(transformers_loop, *inputs))
            int4 = time_us([partial(fused_moe_triton, x, q13, q2, weights, ids)], reps=20, min_calls=4)
            grouped = time_us(
                [partial(fused_moe_triton, x, q13, q2, weights, ids, gemv=None)], reps=20, min_calls=4
            )
            k_quants = time_us([partial(fused_moe_triton, x, *gguf_k, weights, ids)], reps=20, min_calls=4)
            ordered = time_us([partial(fused_moe_triton, x, *act_order, weights, ids)], reps=20, min_calls=4)
            ordered_folded = time_us(
                [partial(fused_moe_triton, x, *folded, weights, ids)], reps=20, min_calls=4
            )
            rows = block_m(ids.numel())
            align = time_us([partial(align_pairs, ids, experts + 1, rows)], reps=20, min_calls=4)
            chosen = torch.unique(ids).numel()
            moved = chosen * expert_bytes + 2 * x.numel() * 2
            int4_gbs = (chosen * int4_expert_bytes + 2 * x.numel() * 2) / int4 / 1e3
            gbs = moved / fused / 1e3
            print(
                f"{shape:<16}{tokens:>7}{fused:>11.1f}{loop:>11.1f}{loop / fused:>9.2f}x{gbs:>9,.0f}"
                f"{gbs / copy_gbs:>9.2f}{int4:>10.1f}{int4_gbs:>11,.0f}{grouped:>10.1f}{ordered:>10.1f}{ordered_folded:>10.1f}{k_quants:>10.1f}"
            )
            record(
                f"moe_fused_{shape}_t{tokens}", fused, "us", baseline=loop,
                baseline_name="transformers' expert loop, eager, us", ratio=loop / fused,
                extra={"gb_s": gbs, "copy_gb_s": copy_gbs, "of_copy": gbs / copy_gbs, "bytes": moved,
                       "int4_us": int4, "int4_gb_s": int4_gbs, "int4_of_copy": int4_gbs / copy_gbs,
                       "int4_grouped_us": grouped, "int4_act_order_us": ordered,
                       "int4_act_order_folded_us": ordered_folded, "gguf_q4_k_q6_k_us": k_quants,
                       "align_pairs_us": align,
                       "aligned": ids.numel() > SINGLE_PAIRS},
                out_dir=args.out_dir, command=COMMAND,
            )  # fmt: skip
            if args.sweep:
                swept[f"t{tokens}"] = sweep(x, (w13, w2), (q13, q2), weights, ids)
        if swept:
            best = {t: min(times, key=times.__getitem__) for t, times in swept.items()}
            print(f"{shape} tiles, fastest per token count: {best}")
            first = next(iter(swept.values()))
            kind, flag = ("gemv_tiles", "--sweep-gemv") if args.sweep_gemv else ("tiles", "--sweep")
            record(
                f"moe_{kind}_{shape}", first["default"], "us", baseline=None,
                extra={"us_by_tokens_and_tiles": swept, "fastest": best}, out_dir=args.out_dir,
                command=f"{COMMAND} {flag} --shapes {shape}",
            )  # fmt: skip


# prefill's tiles: (rows, columns, dense K tile, warps, stages)
PREFILL_TILES = [(64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 128, 64, 8, 4), (128, 64, 64, 4, 3),
                 (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (64, 256, 64, 8, 3)]  # fmt: skip


# the GEMVs' tiles: "gate_up_n/down_n/block_k/warps", "auto": by the grid as the default
GEMV_TILES = {
    f"{gu}/{dn}/{k or 'auto'}/{w or 'auto'}": GemvTiles(gu, dn, k, w)
    for gu, dn in ((16, 32), (32, 64), (8, 16))
    for k, w in ((128, 2), (256, 4), (128, 4), (256, 2), (None, None))
}


def sweep(x, dense, int4, weights, ids) -> dict[str, float]:
    """The layer's us at each tile config, bf16 and int4 experts: decode-sized batches {"bf16 gate_up_n/down_n/warps":
    us}, prefill's {"bf16 m128 n128 k64 w8 s3": us}."""
    out = {}
    prefill = ids.numel() > 256
    for kind, (w13, w2) in (("bf16", dense), ("int4", int4)):
        configs = (
            {f"{kind} m{m} n{n} k{k} w{w} s{st}": Tiles(n, n, w, block_m=m, block_k=k, stages=st)
             for m, n, k, w, st in PREFILL_TILES}
            if prefill
            else {f"{kind} {gu}/{dn}/{w}": Tiles(gu, dn, w) for gu in (16, 32, 64) for dn in (16, 32, 64) for w in (4, 8)}
        )  # fmt: skip
        for name, cfg in configs.items():
            out[name] = time_us(
                [partial(fused_moe_triton, x, w13, w2, weights, ids, cfg)], reps=5, min_calls=2
            )
        out[f"{kind} default"] = time_us(
            [partial(fused_moe_triton, x, w13, w2, weights, ids)], reps=10, min_calls=4
        )
    out["default"] = out["bf16 default"]
    return out


def sweep_gemv(x, int4, weights, ids) -> dict[str, float]:
    """The int4 layer's us at each GEMV tile config {"gate_up_n/down_n/block_k/warps": us}, its default's and the
    grouped kernels'."""
    q13, q2 = int4
    out = {
        name: time_us([partial(fused_moe_triton, x, q13, q2, weights, ids, gemv=tiles)], reps=5, min_calls=2)
        for name, tiles in GEMV_TILES.items()
    }
    out["default"] = time_us([partial(fused_moe_triton, x, q13, q2, weights, ids)], reps=10, min_calls=4)
    out["grouped"] = time_us(
        [partial(fused_moe_triton, x, q13, q2, weights, ids, gemv=None)], reps=10, min_calls=4
    )
    return out


if __name__ == "__main__":
    main()
