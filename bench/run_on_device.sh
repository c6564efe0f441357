#!/bin/bash
# Everything the GPU machine is for, in one bounded call: tests/gpu, then the kernel, KV-transfer and TTFT
# benchmarks. Records and logs go to $OUT (default ./device-out), packed into one results.tgz as well,
# since the device tool returns only a few files per call. Run from the repo root:
#   bash bench/run_on_device.sh            (the wheels in .whl/ are installed first when present)
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT/k" "$OUT/kv" "$OUT/d"
if ls .whl/*.whl >/dev/null 2>&1; then  # grpcio-health-checking / -reflection, see tests/gpu/README.md
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
unset TRITON_INTERPRET
step() {  # step NAME SECONDS COMMAND...: bounded, logged, timed
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$OUT/steps.txt"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
step tests_kernels_kv 200 python3 -m pytest tests/gpu/test_kernels_gpu.py tests/gpu/test_kvtransfer_gpu.py -q -n 8 -rfE -p no:cacheprovider
step bench_kernels 200 python3 -m bench.kernels --out-dir "$OUT/k" --sweep "${SWEEP_S:-35}"
step bench_kv 120 python3 bench/kvtransfer.py --out "$OUT/kv" --ablate --sweep --tcp-reps 1
step tests_engine_disagg 200 python3 -m pytest tests/gpu/test_engine_gpu.py tests/gpu/test_disagg_gpu.py -q -n 4 -rfE -p no:cacheprovider
step bench_disagg 200 python3 -m bench.disagg --out-dir "$OUT/d" --runs 7
tar czf "$OUT/results.tgz" -C "$OUT" k kv d steps.txt
