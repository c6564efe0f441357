"""Does the KV page layout limit the decode kernel? The same kernels on the same data, pages laid
out NHD (block_size, kv heads, head_dim: one kv head's 16 rows lie 2 KiB apart at Llama-3-8B) or HND
(kv heads, block_size, head_dim: one kv head's page is one 4 KiB run), A-B-A-B in one process.

    python3 -m bench.layout_probe --out-dir DIR

The kernels take strides, so both layouts run the same compiled code paths; outputs must agree bit
for bit. Writes one record per (op, shape, layout) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from bench.kernels import (
    MODELS,
    ROTATE_BYTES,
    copy_bandwidth,
    decode_fns,
    paged_set,
    prefill_fns,
    same_bytes_copy_us,
    time_sdpa,
    time_us,
)
from bench.record import record
from kernels.kv_cache_write import kv_cache_write_triton

DECODE = [("llama3-8b", 1, 32768), ("llama3-8b", 64, 4096), ("llama3-8b", 256, 1024), ("smollm2", 64, 4096),
          ("smollm2", 1, 32768)]  # fmt: skip
LAYOUTS = ("NHD", "HND")


def same_sets(batch: int, seq_len: int, heads, q_len: int, count: int) -> dict[str, list[dict]]:
    """count input sets per layout, the HND ones holding the same values as the NHD ones."""
    torch.manual_seed(0)
    nhd = [paged_set(batch, seq_len, heads, q_len) for _ in range(count)]
    hnd = []
    for s in nhd:
        c = torch.empty(s["cache"].shape[:2] + (s["cache"].shape[3], s["cache"].shape[2], s["cache"].shape[4]),
                        device="cuda", dtype=s["cache"].dtype).transpose(2, 3)  # fmt: skip
        c.copy_(s["cache"])
        hnd.append({**s, "cache": c})
    return {"NHD": nhd, "HND": hnd}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=2, help="A-B rounds per shape")
    args = parser.parse_args()
    copy = copy_bandwidth()["copy_"]
    print(f"copy ceiling {copy:.0f} GB/s")
    rows: list[tuple[str, str, list[float], float | None, float | None, bool]] = []
    for model, batch, seq_len in DECODE:
        heads = MODELS[model]
        per_set = 2 * batch * seq_len * heads[1] * heads[2] * 2 + 2 * batch * heads[0] * heads[2] * 2
        sets = same_sets(batch, seq_len, heads, 1, math.ceil(ROTATE_BYTES / per_set))
        outs = {lay: decode_fns(sets[lay][:1])[0]().clone() for lay in LAYOUTS}
        same = torch.equal(outs["NHD"], outs["HND"])
        times: dict[str, list[float]] = {lay: [] for lay in LAYOUTS}
        for _ in range(args.rounds):
            for lay in LAYOUTS:
                times[lay].append(time_us(decode_fns(sets[lay])))
        sdpa_t, sdpa_name, _ = time_sdpa(sets["NHD"], None)
        same_copy = same_bytes_copy_us(per_set, len(sets["NHD"]))
        for lay in LAYOUTS:
            t = min(times[lay])
            gbs = per_set / t / 1e3
            rows.append((f"decode {model} {batch}x{seq_len}", lay, times[lay], gbs / copy, t / sdpa_t, same))
            record(f"kernels_layout_decode_{model}_b{batch}x{seq_len}_{lay}", gbs, "GB/s", ceiling=copy,
                   ceiling_name="d2d copy", baseline=sdpa_t, baseline_name=f"SDPA {sdpa_name} (us)",
                   extra={"times_us": times[lay], "layout": lay, "bitwise_equal_across_layouts": same,
                          "same_bytes_copy_us": same_copy}, out_dir=args.out_dir)  # fmt: skip
        print(json.dumps({"shape": [model, batch, seq_len], "times": times, "sdpa": [sdpa_name, sdpa_t],
                          "same_bytes_copy_us": same_copy, "equal": same}), flush=True)  # fmt: skip
        del sets
    for model, batch, q_len, prefix in (("llama3-8b", 4, 1024, 3072), ("llama3-8b", 1, 4096, 0)):
        sets = same_sets(batch, q_len + prefix, MODELS[model], q_len, 1)
        outs = {lay: prefill_fns(sets[lay], prefix)[0]().clone() for lay in LAYOUTS}
        same = torch.equal(outs["NHD"], outs["HND"])
        times = {lay: [] for lay in LAYOUTS}
        for _ in range(args.rounds):
            for lay in LAYOUTS:
                times[lay].append(time_us(prefill_fns(sets[lay], prefix)))
        for lay in LAYOUTS:
            rows.append((f"prefill {model} {batch}x({prefix}+{q_len})", lay, times[lay], None, None, same))
            record(f"kernels_layout_prefill_{model}_b{batch}x{q_len}_prefix{prefix}_{lay}", min(times[lay]), "us",
                   extra={"times_us": times[lay], "layout": lay, "bitwise_equal_across_layouts": same},
                   out_dir=args.out_dir)  # fmt: skip
        print(
            json.dumps({"prefill": [model, batch, q_len, prefix], "times": times, "equal": same}), flush=True
        )
    # the KV-cache write of one 4096-token prefill step (per layer), Llama-3-8B heads
    num_kv, dim, tokens = 8, 128, 4096
    blocks = 1 << 14
    k = torch.randn(tokens, num_kv, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(blocks * 16, device="cuda")[:tokens].long()
    caches = {
        "NHD": torch.zeros(2, blocks, 16, num_kv, dim, device="cuda", dtype=torch.bfloat16),
        "HND": torch.zeros(2, blocks, num_kv, 16, dim, device="cuda", dtype=torch.bfloat16).transpose(2, 3),
    }
    times = {lay: [] for lay in LAYOUTS}
    for _ in range(args.rounds):
        for lay in LAYOUTS:
            c = caches[lay]
            times[lay].append(time_us([lambda c=c: kv_cache_write_triton(k, v, c, slots)]))
    same = torch.equal(caches["NHD"], caches["HND"])
    for lay in LAYOUTS:
        rows.append((f"kv write {tokens} tokens", lay, times[lay], None, None, same))
        record(f"kernels_layout_kv_write_{tokens}_{lay}", min(times[lay]), "us",
               extra={"times_us": times[lay], "layout": lay, "bitwise_equal_across_layouts": same},
               out_dir=args.out_dir)  # fmt: skip
    print(
        "\n| op | layout | times us (A-B rounds) | of copy | vs SDPA | equal |\n| --- | --- | --- | ---: | ---: | --- |"
    )
    for op, lay, ts, ratio, vs, same in rows:
        fmt = lambda x: "-" if x is None else f"{x:.3f}"
        print(f"| {op} | {lay} | {' / '.join(f'{t:.1f}' for t in ts)} | {fmt(ratio)} | {fmt(vs)} | {same} |")


if __name__ == "__main__":
    main()
