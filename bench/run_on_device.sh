#!/bin/bash
# Everything the GPU machine is for, in bounded steps: tests/gpu, then the kernel, KV-transfer and TTFT
# benchmarks. Records and logs go to $OUT (default ./device-out), packed into one results.tgz as well,
# since the device tool returns only a few files per call. Run from the repo root:
#   bash bench/run_on_device.sh          the default steps (about 15 minutes: more than one device call)
#   STEPS="bench_kv bench_disagg" bash bench/run_on_device.sh    only those steps
# Default steps: tests_kernels_kv bench_kernels bench_kv tests_engine_disagg tests_rest bench_disagg. Run only
# when named: bench_latency bench_throughput tests_kv_memory bench_kv_memory; tests_quant bench_quant sweep_mma
# kernels_quant kernels_quant_b128 rope_quant regs_quant prefetch_quant chunked_quant sweep_wgmma batched_quant (int4
# weights);
# tests_moe bench_moe sweep_moe sweep_moe_gemv bench_moe_engine bench_moe_engine_awq[_pdl_off] (mixtures of experts: their GPU
# tests, the layer's kernels and tiles, the engine on Qwen3-30B-A3B, bf16 and int4); profile (Nsight Compute's counters for
# bench/profile_kernels.py); and on a machine with 2 GPUs tests_tp bench_tp
# The wheels in .whl/ are installed first when present. While bench_disagg runs, nvidia-smi logs the SM
# clock every 20 ms to clocks.csv, and every process writes stage timestamps (engine/trace.py) to d/trace.
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/device-out}
STEPS=${STEPS:-tests_kernels_kv bench_kernels bench_kv tests_engine_disagg tests_rest bench_disagg}
mkdir -p "$OUT/k" "$OUT/kv" "$OUT/d" "$OUT/lat" "$OUT/tp"
if ls .whl/*.whl >/dev/null 2>&1; then  # grpcio-health-checking / -reflection, see tests/gpu/README.md
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
unset TRITON_INTERPRET
XDIST=""
python3 -c "import xdist" 2>/dev/null && XDIST="-n 8"
wanted() { [[ " $STEPS " == *" $1 "* ]]; }
step() {  # step NAME SECONDS COMMAND...: bounded, logged, timed; skipped unless in $STEPS
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$OUT/steps.txt"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
step tests_kernels_kv 200 python3 -m pytest tests/gpu/test_kernels_gpu.py tests/gpu/test_kvtransfer_gpu.py -q $XDIST -rfE -p no:cacheprovider
step bench_kernels 320 python3 -m bench.kernels --out-dir "$OUT/k" --sweep "${SWEEP_S:-35}"
# TRACE_KV=1: the sender's stage marks (kvtransfer/cuda_ipc.py); they cost time, so not for records
[ -n "${TRACE_KV:-}" ] && export PDSERVE_TRACE="$OUT/kv/trace"
step bench_kv 240 python3 bench/kvtransfer.py --out "$OUT/kv" --ablate --sweep --tcp-reps 1
unset PDSERVE_TRACE
[ -n "${TRACE_KV:-}" ] && wanted bench_kv && python3 -m bench.trace_report "$OUT/kv/trace" > "$OUT/kv/trace_report.txt" 2>&1
step tests_engine_disagg 200 python3 -m pytest tests/gpu/test_engine_gpu.py tests/gpu/test_disagg_gpu.py -q ${XDIST/8/4} -rfE -p no:cacheprovider
# the other device tests: CUDA graphs, the decode step's small ops, the fused kernels, the sampler, speculation
step tests_rest 300 python3 -m pytest tests/gpu/test_cuda_graph_gpu.py tests/gpu/test_decode_ops_gpu.py \
  tests/gpu/test_fused_gpu.py tests/gpu/test_sampler_gpu.py tests/gpu/test_spec_decode_gpu.py -q ${XDIST/8/4} -rfE \
  -p no:cacheprovider
if wanted bench_disagg; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,utilization.gpu,power.draw --format=csv -lms 20 > "$OUT/d/clocks.csv" 2>&1 &
  SMI=$!
  step bench_disagg 420 python3 -m bench.disagg --out-dir "$OUT/d" --runs "${RUNS:-7}" --trace "$OUT/d/trace" --gap-ms ${GAP_MS:-0 50}
  kill $SMI 2>/dev/null
  python3 -m bench.trace_report "$OUT/d/trace" > "$OUT/d/trace_report.txt" 2>&1
fi
# mixtures of experts: the fused MoE layer against transformers' expert loop, then the engine (not in the default STEPS)
mkdir -p "$OUT/moe"
step tests_moe 240 python3 -m pytest tests/gpu/test_engine_gpu.py tests/gpu/test_quant_gpu.py tests/gpu/test_kernels_gpu.py \
  tests/gpu/test_cuda_graph_gpu.py tests/gpu/test_fused_gpu.py -q ${XDIST/8/6} -rfE -p no:cacheprovider -k "moe or mixtral or route"
step bench_moe 200 python3 -m bench.moe --out-dir "$OUT/moe"
step sweep_moe 300 python3 -m bench.moe --shapes qwen3-30b-a3b --tokens 1 8 64 --sweep --out-dir "$OUT/moe/sweep"
step sweep_moe_gemv 200 python3 -m bench.moe --tokens 1 8 --sweep-gemv --out-dir "$OUT/moe/sweep"
step bench_moe_engine 300 python3 -m bench.moe --engine --out-dir "$OUT/moe"
step bench_moe_engine_awq 300 python3 -m bench.moe --engine --quantization awq --out-dir "$OUT/moe"
# the same with every kernel launched plainly, so that each kernel's time a step is its own (with PDL a kernel's span
# includes its wait for the one before); its record goes to moe/pdl_off, for the main record's extra.pdl_off
step bench_moe_engine_awq_pdl_off 300 env PDSERVE_PDL=0 python3 -m bench.moe --engine --quantization awq \
  --out-dir "$OUT/moe/pdl_off"
# int4 weights: tests, then the W4A16 GEMM and the int4 engine against bf16 (not in the default STEPS)
mkdir -p "$OUT/q"
step tests_quant 420 python3 -m pytest tests/gpu/test_quant_gpu.py -q ${XDIST/8/4} -rfE -p no:cacheprovider
step bench_quant 560 python3 -m bench.quant_int4 --out-dir "$OUT/q"
# the tensor-core kernel's configs GEMM by GEMM (what kernels/w4a16_mma.config picks from), and a decode step's time
step sweep_mma 300 python3 -m bench.quant_int4 --sweep-mma --out-dir "$OUT/q"
step kernels_quant 300 python3 -m bench.quant_int4 --kernels --out-dir "$OUT/q"
step kernels_quant_b128 400 python3 -m bench.quant_int4 --kernels --batch 128 --out-dir "$OUT/q"
step rope_quant 200 python3 -m bench.quant_int4 --rope --out-dir "$OUT/q"
step regs_quant 300 python3 -m bench.quant_int4 --sweep-regs --out-dir "$OUT/q"
# the tensor-core kernel asking L2 for its words 1-3 steps ahead (PDSERVE_W4A16_PREFETCH), layer and engine
step prefetch_quant 560 python3 -m bench.quant_int4 --sweep-prefetch --out-dir "$OUT/q"
step chunked_quant 240 python3 -m bench.quant_int4 --chunked --out-dir "$OUT/q"
step sweep_wgmma 340 python3 -m bench.quant_int4 --sweep-wgmma --out-dir "$OUT/q"
step batched_quant 500 python3 -m bench.quant_int4 --batched --out-dir "$OUT/q"
# batch-1 decode against the roofline and transformers compiled, GPU busy, start-up (BENCHMARKS.md, Engine)
step bench_latency 560 python3 -m bench.latency --out-dir "$OUT/lat"
# offline throughput, 256 and 1000 prompts, greedy and sampled, against the workload roofline and transformers
mkdir -p "$OUT/thr"
step bench_throughput 300 python3 -m bench.throughput --out-dir "$OUT/thr"
# hardware counters of the kernels that miss their goals (W4A16 GEMM, one-row GEMV, fp8 decode attention):
# what bounds each, per Nsight Compute (--clock-control none: the clocks stay as they are); ncu.csv
step profile 400 ncu --clock-control none -k 'regex:^_' --section SpeedOfLight --section SchedulerStats \
  --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis --csv --page details \
  --log-file "$OUT/ncu.csv" python3 -m bench.profile_kernels
# tensor parallelism on 2 GPUs: TP 2 against TP 1 and transformers, then decode speed and all-reduce time
step tests_tp 400 python3 -m pytest tests/gpu/test_tp_gpu.py -q -rfE -p no:cacheprovider
step bench_tp 420 python3 -m bench.tp --out-dir "$OUT/tp"
# fp8 KV decode, swap round trip, preemption throughput by mode (about 5 minutes; not in the default STEPS)
mkdir -p "$OUT/kvm"
step tests_kv_memory 300 python3 -m pytest tests/gpu/test_kv_memory_gpu.py -q $XDIST -rfE -p no:cacheprovider
step bench_kv_memory 480 python3 -m bench.kv_memory --out-dir "$OUT/kvm"
tar czf "$OUT/results.tgz" -C "$OUT" k kv d lat thr tp q kvm moe steps.txt $(cd "$OUT" && ls *.txt)
