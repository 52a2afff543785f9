#!/usr/bin/env bash
# The GPU checks in one run (docs/benchmarks.md, "On a GPU"): the step against fused AdamW at GPT-2 small's
# and 350M's shapes, each method in a fresh process, then the CUDA tests (replicas bit-identical for every
# kernels x selection x wire, sparsity 0 = dense AdamS, exact resume). Every result is written to $OUT
# (default: runs/gpu) as it comes, so a run cut short keeps what it measured.
#
#   bash benchmarks/gpu_checks.sh                      # ~7 min on an H200
#   BASELINE=/path/to/an/older/checkout bash benchmarks/gpu_checks.sh   # its core timed the same way first
#
# BASELINE: a checkout of another commit; this script's gpu_bench.py is copied into it and run there, so
# both cores are timed by the same benchmark in the same session.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-runs/gpu}")
SHAPE=${SHAPE:-gpt2}
BIG=${BIG:-gpt2-350m}
STEPS=${STEPS:-15}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
bench() {  # bench NAME DIR ARGS...: gpu_bench.py of the core in DIR, its report into $OUT/NAME.txt
  local name=$1 dir=$2
  shift 2
  (cd "$dir" && PYTHONPATH=. timeout 300 python3 benchmarks/gpu_bench.py --steps "$STEPS" --json "$OUT/$name.json" "$@") \
    >"$OUT/$name.txt" 2>&1 || echo "FAILED (exit $?)" >>"$OUT/$name.txt"
  tail -n 14 "$OUT/$name.txt"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
if [ -n "${BASELINE:-}" ]; then
  cp benchmarks/gpu_bench.py "$BASELINE/benchmarks/gpu_bench.py"
  bench baseline_small "$BASELINE" --shape "$SHAPE" --methods "SCAPE 99%"  # against this run's DDP + AdamW
  bench baseline_big "$BASELINE" --shape "$BIG" --methods "SCAPE 99%"
fi
bench small . --shape "$SHAPE" --methods "DDP + AdamW" "SCAPE 99%" "SCAPE 99% groups"
bench big . --shape "$BIG" --methods "DDP + AdamW" "SCAPE 99%"
# the CUDA tests: two launches at once (two ranks each, sharing the GPU over gloo)
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k replicas >"$OUT/cuda_replicas.txt" 2>&1 &
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "not replicas" >"$OUT/cuda_exact.txt" 2>&1
wait
tail -n 25 "$OUT/cuda_replicas.txt" "$OUT/cuda_exact.txt"
