"""The one-row-to-16-row W4A16 kernel (kernels/w4a16_mma.py) compiled for Hopper on a machine with no GPU: its
registers, spills and the shape of its K loop, for reading the machine code a change makes before spending device
time on it. Not a benchmark: nothing runs, nothing is timed.

    python3 -m bench.sass --gemm qkv --rows 1                 # config()'s pick for Llama-3-8B's qkv at one row
    python3 -m bench.sass --gemm down --rows 8 --kw unroll=1 --out-dir /tmp/sass   # a named config; keeps the SASS
    python3 -m bench.sass --moe               # the MoE decode GEMVs for every kind, the act-order grouped kernels too

`w4a16_mma` is called as the engine calls it (on CPU tensors, its launch caught instead of run), and what it would
launch is compiled by Triton for sm_90 with the arguments' 16-byte alignment, as a launch on a GPU specializes it.
The loop's skeleton lists, in order, its global loads (with their widths), its MMAs, its register-to-register moves
and its branches: a move at the end of the loop from a register that a load of the same iteration writes waits for
that load, so the load is not ahead of its use after all. The device's Triton is the one that counts: with another
version here the SASS differs in its details (`TRITON_VERSION` of the device image: 3.6).

`wgmma_operand_hazards` reads any kernel's SASS for the hazard that warpgroup MMAs with a register operand invite
(tests/gpu runs it on every variant of kernels/w4a16_wgmma.py that it compiles).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_DTYPES = {
    "int8": "i8",
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    "int32": "i32",
    "uint8": "u8",
    "int64": "i64",
}


def _value(text: str) -> Any:
    """A --kw value: true / false, an int, else the string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        return text


def compile_gemm(gemm: str, rows: int, **kw: Any) -> Any:
    """Triton's compiled kernel for w4a16_mma on one Llama-3-8B GEMM (gate_up ending in SwiGLU) at `rows` rows."""
    import torch

    import kernels.w4a16_mma as mma
    from bench.quant_int4 import LAYER, int4_layer

    saved = (mma.applies, mma.num_sms)
    mma.applies, mma.num_sms = (lambda x, w: True), (lambda device: 132)  # type: ignore[assignment]
    try:
        w = int4_layer("cpu", 0, fragments=True)[gemm]
        x = torch.zeros(rows, LAYER[gemm][0], dtype=torch.bfloat16)
        return compile_caught(
            mma, "_w4a16_mma_kernel", lambda: mma.w4a16_mma(x, w, pdl=True, swiglu=gemm == "gate_up", **kw)
        )
    finally:
        mma.applies, mma.num_sms = saved


def compile_caught(module: Any, name: str, call: Any, others: tuple[str, ...] = ()) -> Any:
    """The kernel `module.name` compiled by Triton for sm_90 as `call` would launch it (on CPU tensors: the launch is
    caught, not run), with the arguments' 16-byte alignment, as a launch on a GPU specializes it. `others`: the
    module's kernels that `call` launches too, their launches caught and dropped."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    caught: dict[str, Any] = {}

    class Catch:  # stands in for the kernel: keeps the launch's arguments
        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **kwargs: Any) -> None:
                caught.update(args=args, kwargs=kwargs)

            return launch

    class Drop:
        def __getitem__(self, grid: Any) -> Any:
            return lambda *args, **kwargs: None

    kernel = getattr(module, name)
    saved = {other: getattr(module, other) for other in others}
    setattr(module, name, Catch())
    for other in others:
        setattr(module, other, Drop())
    try:
        call()
    finally:
        setattr(module, name, kernel)
        for other, real in saved.items():
            setattr(module, other, real)
    args, kwargs = caught["args"], dict(caught["kwargs"])
    names = kernel.arg_names
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, (arg_name, a) in enumerate(zip(names, args)):
        if isinstance(a, torch.Tensor):
            signature[arg_name] = "*" + _DTYPES[str(a.dtype).removeprefix("torch.")]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(a, bool):
            signature[arg_name] = "i1"
        elif isinstance(a, int):
            signature[arg_name] = "i32"
            if a % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[arg_name] = "fp32"
    options = {"num_warps": kwargs.pop("num_warps")}
    for option in ("maxnreg", "num_stages"):
        if option in kwargs:
            options[option] = kwargs.pop(option)
    kwargs.pop("launch_pdl", None)
    constexprs = {}
    for arg_name in names[len(args) :]:
        signature[arg_name] = "constexpr"
        constexprs[(names.index(arg_name),)] = kwargs[arg_name]
    gluon = type(kernel).__name__ == "GluonJITFunction"
    source = GluonASTSource if gluon else ASTSource
    src = source(kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_moe_kernels() -> dict[str, str]:
    """kernels/fused_moe_gemv.py's two kernels at Qwen3-30B-A3B's shape, one decode token, for each kind of stack
    and activation dtype (gate_up routing its pairs itself too, bf16), and kernels/fused_moe.py's grouped kernels
    for each kind at 64 and 4096 tokens (bf16), the act-order gather too:
    {"kind dtype kernel": register usage}. A kernel that does not compile raises."""
    import torch

    import kernels.fused_moe as grouped
    import kernels.fused_moe_gemv as gemv
    from kernels.fused_moe import Int4Experts, Int8Experts
    from kernels.moe_route import Routing

    hidden, inter, experts, top_k = 2048, 768, 128, 8

    def int4(n: int, k: int, offsets: bool, act_order: bool = False) -> Int4Experts:
        group = 32 if offsets else 128
        scales = torch.zeros(experts, k // group, n, dtype=torch.float32 if offsets else torch.float16)
        zeros = torch.zeros_like(scales) if offsets else torch.zeros(scales.shape, dtype=torch.uint8)
        perm = torch.zeros(experts, k, dtype=torch.int32) if act_order else None
        return Int4Experts(torch.zeros(experts, k // 8, n, dtype=torch.int32), scales, zeros, group, perm)

    def int8(n: int, k: int) -> Int8Experts:
        return Int8Experts(torch.zeros(experts, n, k, dtype=torch.int8), torch.zeros(experts, n, k // 16), 16)

    kinds: dict[str, tuple[Int4Experts | Int8Experts, Int4Experts | Int8Experts]] = {
        "int4": (int4(2 * inter, hidden, False), int4(hidden, inter, False)),
        "q4_k": (int4(2 * inter, hidden, True), int4(hidden, inter, True)),
        "q6_k": (int8(2 * inter, hidden), int8(hidden, inter)),
        "gptq_act": (int4(2 * inter, hidden, False, True), int4(hidden, inter, False, True)),
    }
    ids, weights = torch.zeros(top_k, dtype=torch.int32), torch.zeros(top_k)
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, (w13, w2) in kinds.items():
            for dtype in (torch.bfloat16, torch.float32):
                x, act = torch.zeros(1, hidden, dtype=dtype), torch.zeros(top_k, inter, dtype=dtype)
                calls = {
                    "_gate_up_gemv_kernel": partial(gemv.gate_up_gemv, x, w13, ids, top_k, gemv.GEMV_TILES),
                    "_down_gemv_kernel": partial(gemv.down_gemv, act, w2, weights, ids, gemv.GEMV_TILES),
                }
                # gate_up routing its pairs itself (Qwen3's top 8 of 128, rounded)
                if dtype == torch.bfloat16:
                    logits = torch.zeros(1, experts, dtype=dtype)
                    routing = Routing(logits, top_k, True, torch.bfloat16, 0, experts)
                    calls["routed _gate_up_gemv_kernel"] = partial(
                        gemv.gate_up_gemv, x, w13, ids, top_k, gemv.GEMV_TILES, routing, weights
                    )  # fmt: skip
                for name, call in calls.items():
                    compiled = compile_caught(gemv, name.split()[-1], call)
                    dt = str(dtype).removeprefix("torch.")
                    out[f"{kind} {dt} {name}"] = sass_of(compiled.asm["cubin"], Path(tmp))[1]
        launched = ("_gather_by_perm_kernel", "_gate_up_kernel", "_down_kernel", "_sum_choices_kernel")
        for kind, (w13, w2) in kinds.items():
            act_order = kind == "gptq_act"
            for tokens in (64,) if act_order else (64, 4096):  # decode-sized tiles, and prefill's tallest
                ids = torch.arange(tokens * top_k, dtype=torch.int32).view(tokens, top_k) % experts
                x, weights = torch.zeros(tokens, hidden, dtype=torch.bfloat16), torch.zeros(tokens, top_k)
                call = partial(grouped.fused_moe_triton, x, w13, w2, weights, ids, gemv=None)
                for name in launched[0 if act_order else 1 : 3]:
                    others = tuple(other for other in launched if other != name)
                    compiled = compile_caught(grouped, name, call, others)
                    rows = "" if act_order else f" t{tokens}"
                    out[f"{kind} bfloat16{rows} {name}"] = sass_of(compiled.asm["cubin"], Path(tmp))[1]
    return out


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass_of(cubin: bytes, work: Path) -> tuple[str, str]:
    """(SASS, resource usage) of a cubin, by the nvdisasm and cuobjdump that come with Triton."""
    path = work / "kernel.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run(
        [_tool("nvdisasm"), "-c", str(path)], capture_output=True, text=True, check=True
    ).stdout
    usage = subprocess.run(
        [_tool("cuobjdump"), "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return sass, " ".join(line.strip() for line in usage.splitlines() if "REG:" in line)


def loop_skeleton(sass: str) -> list[str]:
    """The innermost loop's loads, MMAs (runs of them counted), moves and branches, in order: the first block
    that a backward branch returns to."""
    lines = [re.sub(r"/\*[0-9a-f]+\*/", "", line).strip() for line in sass.splitlines()]
    labels = {line[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\.L_x_\d+:", line)}
    loop = None
    for i, line in enumerate(lines):
        target = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if target and labels.get(target.group(1), i) < i:
            loop = (labels[target.group(1)], i)
            break
    if loop is None:
        return ["(no backward branch)"]
    out: list[str] = []
    mmas = 0
    for line in lines[loop[0] : loop[1] + 1]:
        if "MMA" in line:
            mmas += 1
            continue
        if re.search(r"\bLDG|\bLDS|\bCCTL|\bBRA|\bBAR|IMAD\.MOV\.U32 R\d+, RZ, RZ, R\d+|\bMOV R", line):
            if mmas:
                out.append(f"  {mmas} MMA")
                mmas = 0
            out.append("  " + line.rstrip(" ;"))
    if mmas:
        out.append(f"  {mmas} MMA")
    return out


# opcodes whose first register operand is read, not written (stores, barriers, branches, MMAs: their accumulator)
_NO_DEST = ("ST", "RED", "ATOM", "BAR", "BRA", "SYNCS", "WARPGROUP", "UTMA", "MEMBAR", "FENCE", "NOP", "EXIT", "HGMMA",
            "WARPSYNC", "DEPBAR", "CCTL", "ERRBAR", "RET", "CALL", "BSYNC", "BSSY")  # fmt: skip


def _written(line: str) -> set[str]:
    """The general registers an instruction writes: its first operand, 2 or 4 of them for 64- and 128-bit ops."""
    m = re.match(r"(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_.]*)\s+(R\d+)\b", line)
    if m is None or m.group(1).startswith(_NO_DEST):
        return set()
    width = 4 if ".128" in m.group(1) else 2 if ".64" in m.group(1) or ".WIDE" in m.group(1) else 1
    first = int(m.group(2)[1:])
    return {f"R{first + i}" for i in range(width)}


def wgmma_operand_hazards(sass: str) -> list[str]:
    """Where the loop around a kernel's warpgroup MMAs writes a register that an MMA still in flight reads as its A
    operand (wgmma reads it asynchronously, until a `wgmma.wait_group` leaves fewer groups in flight than were
    committed after the MMA's own): each as "MMA | writer". The loop is followed round once, so an A operand made in
    one iteration and read by an MMA still in flight from the one before counts."""
    lines = [re.sub(r"/\*[0-9a-f]+\*/", "", line).strip() for line in sass.splitlines()]
    lines = [line for line in lines if line]
    labels = {line[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\.L_x_\d+:", line)}
    found: list[str] = []
    for i, line in enumerate(lines):
        target = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if not target or labels.get(target.group(1), i) >= i:
            continue
        loop = lines[labels[target.group(1)] : i + 1]
        if not any("HGMMA" in x for x in loop):
            continue
        twice = loop + loop
        for a, mma in enumerate(loop):
            reads = re.search(r"HGMMA\.\S+ R\d+, (R\d+),", mma)
            if reads is None:  # A from shared memory
                continue
            first = int(reads.group(1)[1:])
            a_regs = {f"R{first + r}" for r in range(4)}
            commit = next(c for c in range(a, len(twice)) if "HGMMA" in twice[c] and "gsb0" in twice[c])
            after = 0  # groups committed after the MMA's own
            for other in twice[commit + 1 :]:
                if "HGMMA" in other and "gsb0" in other:
                    after += 1
                dep = re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", other)
                if dep and after >= int(dep.group(1), 16):
                    break
                if _written(other) & a_regs:
                    found.append(f"{mma.rstrip(' ;')} | {other.rstrip(' ;')}")
                    break
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gemm", choices=("qkv", "o", "gate_up", "down"), default="qkv")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--kw", nargs="*", default=[], help="w4a16_mma keywords, key=value (warps=8 unroll=1 ...)")
    p.add_argument("--out-dir", type=Path, default=None, help="where the SASS and PTX are kept")
    p.add_argument(
        "--moe",
        action="store_true",
        help="compile the MoE decode GEMVs and act-order grouped kernels instead",
    )
    args = p.parse_args()
    if args.moe:
        for variant, usage in compile_moe_kernels().items():
            print(f"{variant}: {usage}")
        return
    kw = {k: _value(v) for k, v in (item.split("=", 1) for item in args.kw)}
    compiled = compile_gemm(args.gemm, args.rows, **kw)
    with tempfile.TemporaryDirectory() as tmp:
        sass, usage = sass_of(compiled.asm["cubin"], Path(tmp))
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        stem = f"{args.gemm}_m{args.rows}"
        (args.out_dir / f"{stem}.sass").write_text(sass)
        (args.out_dir / f"{stem}.ptx").write_text(compiled.asm["ptx"])
    named = " " + " ".join(args.kw) if args.kw else ""
    print(f"{args.gemm} at {args.rows} rows{named}: {usage}")
    print("K loop:")
    print("\n".join(loop_skeleton(sass)))


if __name__ == "__main__":
    main()
