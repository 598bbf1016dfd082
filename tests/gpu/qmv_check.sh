#!/usr/bin/env bash
# The small-row quantized matmul kernel on a CUDA machine, in one run of under 8 minutes:
#   1. its tests against mx.quantized_matmul (every mode, dtype and shape class);
#   2. the microbenchmark beside MLX's kernel (qwen3-4b and llama3-8b projections);
#   3. whole-model decode with the kernel on (the default), against mlx-lm, with the
#      roofline share, for qwen3-4b, llama3-8b and qwen2.5-0.5b at 4 bits.
# Run from the repository root: bash tests/gpu/qmv_check.sh [python]  (limits add up to 7m35s)
# Each command has its own time limit; a failing or timed-out step is reported and the
# script goes on to the next one. The exit status is the number of failed steps.
set -u
PY="${1:-python}"
export PYTHONPATH="${PYTHONPATH:-$PWD}"
failed=0

step() {
  local limit="$1" name="$2"
  shift 2
  echo
  echo "=== $name (limit ${limit}s)"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  echo "=== $name: exit $rc in $((SECONDS - start))s"
  if [ "$rc" -ne 0 ]; then failed=$((failed + 1)); fi
}

"$PY" -c "import sys, mlx.core as mx; print('mlx', mx.__version__, mx.default_device()); sys.exit(not mx.cuda.is_available())" ||
  { echo "qmv_check: needs MLX's CUDA build on a GPU machine"; exit 1; }

step 90 "kernel tests" "$PY" -m pytest tests/engine/models/test_qmv_cuda.py tests/engine/test_bench_qmm.py -q --maxfail=3 --tb=short -p no:cacheprovider -rs
step 55 "microbench qwen3-4b" "$PY" -m engine.cli.bench_qmm --shape qwen3-4b --ours
step 55 "microbench llama3-8b" "$PY" -m engine.cli.bench_qmm --shape llama3-8b --ours
# Today's engine without the kernel, for comparison: qwen3-4b 212.7 tok/s, llama3-8b 174.6,
# qwen2.5-0.5b 262 (the same command with MLX_DESK_QMV=0).
for shape_limit in qwen3-4b:85 llama3-8b:100 qwen2.5-0.5b:70; do
  shape="${shape_limit%%:*}"
  step "${shape_limit##*:}" "decode $shape, kernel on" env MLX_DESK_QMV=1 "$PY" -m engine bench --shape "$shape" \
    --bits 4 -p 512 -g 128 --repeat 3 --vs mlx-lm --roofline
done
echo
echo "qmv_check: $failed step(s) failed"
exit "$failed"
