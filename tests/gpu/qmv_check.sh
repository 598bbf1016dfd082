#!/usr/bin/env bash
# The CUDA decode kernels on a GPU machine, in parts of under 10 minutes each:
#   tests: the small-row quantized matmul against MLX's kernels, with its residual, activation
#          and norm variants;
#   kernels: the gathered variant against MLX's, the code unpacking on the host, the head
#          norm + RoPE kernel against MLX's calls, and the tensor-core kernel against MLX's;
#   bench: the microbenchmark beside MLX's kernel (qwen3-4b and llama3-8b projections, each
#          product reading its own weight from memory), whole-model decode against mlx-lm
#          with the roofline share (qwen3-4b, llama3-8b, qwen2.5-0.5b at 4 bits);
#   ab:    qwen3-4b with the head norm + RoPE kernel off and the activation epilogue off, and
#          qwen3-4b and llama3-8b with the norm prologue off, the K loop unrolled 2 and 4 times,
#          then the undecided switches in interleaved rounds against the default (4 columns a
#          warp, two ops a code, the first chunk ahead of the norm, one-row products on the
#          tensor-core kernel), each product at 1-2 rows with the default and the old build,
#          and the residual epilogue off (beside bench's runs with the defaults);
#   batch: the batch step of 8 rows taken apart, and 8, 12 and 16 streams against mlx-lm, then
#          with the tensor-core kernel turned off;
#   attention: decode attention split over the keys (off by default) against MLX's: its tests,
#          passes chained as a step chains them (for each length of a warp's slice), a step's host share and decode with it on and
#          off in interleaved rounds, and one step's kernels under Nsight Compute with it on;
#   profile: the one-row products' stall reasons under Nsight Compute.
# Run from the repository root:
#   bash tests/gpu/qmv_check.sh [python] [tests|kernels|bench|ab|batch|attention|profile]
# (every part when the second argument is left out). Each command has its own time limit; a
# failing or timed-out step is reported and the script goes on to the next one. The exit
# status is the number of failed steps.
set -u
PY="${1:-python}"
PART="${2:-all}"
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

pytest_step() {
  local limit="$1" name="$2"
  shift 2
  step "$limit" "$name" "$PY" -m pytest "$@" -q --maxfail=3 --tb=short -p no:cacheprovider -rs
}

if [ "$PART" = "all" ] || [ "$PART" = "tests" ]; then
  # Limits from the H200: 261 s (before the activation and norm cases), 117 s and 42 s (each
  # case builds its kernel once).
  pytest_step 540 "small-row kernel tests" tests/engine/models/test_qmv_cuda.py
fi

if [ "$PART" = "all" ] || [ "$PART" = "kernels" ]; then
  pytest_step 150 "gathered kernel tests" tests/engine/models/test_gather_qmv_cuda.py
  pytest_step 90 "head norm + RoPE kernel tests" tests/engine/models/test_head_norm_rope_cuda.py
  pytest_step 240 "tensor-core kernel tests" tests/engine/models/test_qmv_mma_cuda.py
  pytest_step 90 "kernels emulated on the CPU, microbench tests" tests/engine/models/test_qmv_emulated.py tests/engine/test_bench_qmm.py
fi

if [ "$PART" = "all" ] || [ "$PART" = "bench" ]; then
  step 120 "microbench qwen3-4b" "$PY" -m engine.cli.bench_qmm --shape qwen3-4b --rows 1,2,4,8,16 --ours --mma --cold-mb 128
  step 150 "microbench llama3-8b" "$PY" -m engine.cli.bench_qmm --shape llama3-8b --rows 1,2,4,8,16 --ours --mma --cold-mb 128
  # Figures of these commands so far: docs/qmv.md, "Fewer instructions a code".
  for shape_limit in qwen3-4b:100 llama3-8b:110 qwen2.5-0.5b:70; do
    shape="${shape_limit%%:*}"
    step "${shape_limit##*:}" "decode $shape" "$PY" -m engine bench --shape "$shape" \
      --bits 4 -p 512 -g 128 --repeat 3 --vs mlx-lm --roofline
  done
fi

if [ "$PART" = "all" ] || [ "$PART" = "ab" ]; then
  step 100 "decode qwen3-4b, head norm + RoPE kernel off" env MLX_DESK_QK_ROPE=0 "$PY" -m engine bench \
    --shape qwen3-4b --bits 4 -p 512 -g 128 --repeat 3 --vs mlx-lm --roofline
  # The activation in the gate/up epilogue off, the norms in the products' prologues off (both
  # on by default).
  step 100 "decode qwen3-4b, activation epilogue off" env MLX_DESK_QMV_GLU=0 "$PY" -m engine bench \
    --shape qwen3-4b --bits 4 -p 512 -g 128 --repeat 3 --vs mlx-lm --roofline
  for shape_limit in qwen3-4b:100 llama3-8b:110; do
    shape="${shape_limit%%:*}"
    step "${shape_limit##*:}" "decode $shape, norm prologue off" env MLX_DESK_QMV_NORM=0 "$PY" -m engine bench \
      --shape "$shape" --bits 4 -p 512 -g 128 --repeat 3 --vs mlx-lm --roofline
  done
  # The products' K loop unrolled (left to the compiler by default; docs/qmv.md, "MLX's CUDA
  # graphs": a step's products read at a quarter to a third of the copy rate).
  for unroll in 2 4; do
    for shape_limit in qwen3-4b:100 llama3-8b:110; do
      shape="${shape_limit%%:*}"
      step "${shape_limit##*:}" "decode $shape, K loop unrolled $unroll" env MLX_DESK_QMV_UNROLL=$unroll "$PY" -m \
        engine bench --shape "$shape" --bits 4 -p 512 -g 128 --repeat 3 --roofline
    done
  done
  # The switches still undecided, in interleaved rounds (engine.cli.bench_switches: each
  # variant its own process, paired with the default run of the same round, since one
  # process's decode can differ from the next's by half on a shared machine): the old default
  # of 4 columns a warp with two logic ops a code, the first chunk loaded ahead of the norm on
  # top of the 8 columns, 8 columns with two ops, and one-row products on the tensor-core
  # kernel. Measured slower and left off (docs/qmv.md, "Registers" and "Memory waits"): the
  # prefetched K loop and the L2 prefetch during attention; launch bounds within the spread;
  # on an H100 in two rounds, the early load (0.86x) and one-row products on the tensor-core
  # kernel (0.82x), kept here for the H200.
  for shape in qwen3-4b llama3-8b; do
    step 570 "decode $shape, switches in rounds" "$PY" -m engine.cli.bench_switches --shape "$shape" --rounds 4 \
      --timeout 100 --variant MLX_DESK_QMV_COLUMNS=4 --variant MLX_DESK_QMV_EARLY_LOAD=1 \
      --variant MLX_DESK_QMV_ONE_OP_CODES=0 --variant MLX_DESK_QMV_MMA_ROWS=1-16
  done
  # Each product of both shapes at 1 and 2 rows, compiled as a step runs it, with the default
  # build and the old one (docs/qmv.md, "Eight columns and one-op codes on by default").
  for variant in X=0 MLX_DESK_QMV_COLUMNS=4 "MLX_DESK_QMV_COLUMNS=4 MLX_DESK_QMV_ONE_OP_CODES=0" \
      MLX_DESK_QMV_EARLY_LOAD=1; do
    for shape in qwen3-4b llama3-8b; do
      step 120 "products of $shape at 1-2 rows, $variant" env $variant "$PY" -m engine.cli.bench_qmm \
        --shape "$shape" --rows 1,2 --ours --cold-mb 128
    done
  done
  # 2, 3, 5 and 6-bit products (routed only with MLX_DESK_QMV_OTHER_BITS=1 until timed): ours
  # beside MLX's, and their tests.
  pytest_step 120 "other widths and float modes on the GPU" tests/engine/models/test_qmv_cuda.py \
    -k "other_widths or float_modes"
  for bits in 2 3 5 6; do
    step 120 "microbench qwen3-4b, $bits-bit" env MLX_DESK_QMV_OTHER_BITS=1 "$PY" -m engine.cli.bench_qmm \
      --shape qwen3-4b --bits "$bits" --group-size 64 --rows 1,2,4,8 --ours --cold-mb 128
  done
  for mode in mxfp4 mxfp8 nvfp4; do
    step 120 "microbench qwen3-4b, $mode" env MLX_DESK_QMV_FLOAT_MODES=1 "$PY" -m engine.cli.bench_qmm \
      --shape qwen3-4b --mode "$mode" --rows 1,2,4,8,16 --ours --cold-mb 128
  done
  for bits in 3 6; do
    for variant in MLX_DESK_QMV_OTHER_BITS=0 MLX_DESK_QMV_OTHER_BITS=1; do
      step 100 "decode qwen3-4b at $bits bits, $variant" env $variant "$PY" -m engine bench --shape qwen3-4b \
        --bits "$bits" -p 512 -g 128 --repeat 3 --roofline
    done
  done
  # The residual adds in the products' epilogue, turned off for the A/B (on by default).
  for shape_limit in qwen3-4b:100 llama3-8b:110; do
    shape="${shape_limit%%:*}"
    step "${shape_limit##*:}" "decode $shape, residual epilogue off" env MLX_DESK_QMV_RESIDUAL=0 "$PY" -m engine \
      bench --shape "$shape" --bits 4 -p 512 -g 128 --repeat 3 --vs mlx-lm --roofline
  done
fi

if [ "$PART" = "all" ] || [ "$PART" = "batch" ]; then
  # Batch steps: where an 8-row step's time goes, then streams against mlx-lm's BatchGenerator
  # (the tensor-core kernel takes 8-16 rows, the row kernel 2-7; docs/qmv.md).
  step 170 "batch step of 8 rows" "$PY" -m engine bench --shape qwen3-4b --bits 4 -p 512 -g 32 --repeat 2 \
    --vs mlx-lm --step --rows 8
  step 300 "8, 12 and 16 streams" "$PY" -m engine bench --shape qwen3-4b --bits 4 -p 512 -g 128 \
    --concurrent 8,12,16 --vs mlx-lm
  step 200 "8, 12 and 16 streams, tensor-core kernel off" env MLX_DESK_QMV_MMA=0 "$PY" -m engine bench \
    --shape qwen3-4b --bits 4 -p 512 -g 128 --concurrent 8,12,16
fi
if [ "$PART" = "all" ] || [ "$PART" = "attention" ]; then
  # docs/qmv.md, "MLX's CUDA graphs": MLX's one-pass kernel took 20 us a layer of a step.
  pytest_step 150 "decode attention tests, and the quantized cache's (shared source)" \
    tests/engine/models/test_decode_attention_cuda.py tests/engine/models/test_quantized_attention_cuda.py
  step 120 "decode attention microbench, chained passes" "$PY" -m engine.cli.bench_decode_attention \
    --shape qwen3-4b --keys 520,2000,6000 --rows 1,4 --chain --ours --keys-per-warp 8,16,32,64
  # A step's host share with it on and off (it runs inside the compiled step: docs/qmv.md,
  # "Attention inside the compiled step"), then whole decode in interleaved rounds.
  for on in 0 1; do
    step 70 "one step of qwen3-4b, split decode attention $on" env MLX_DESK_DECODE_ATTENTION=$on \
      "$PY" -m engine bench --shape qwen3-4b --bits 4 -p 512 -g 32 --step
  done
  for shape_limit in qwen3-4b:330 llama3-8b:380; do
    shape="${shape_limit%%:*}"
    step "${shape_limit##*:}" "decode $shape, split decode attention in rounds" "$PY" -m engine.cli.bench_switches \
      --shape "$shape" --rounds 4 --timeout 80 --variant MLX_DESK_DECODE_ATTENTION=1
  done
  if command -v ncu > /dev/null; then
    step 250 "kernels of a step, split decode attention on" env MLX_DESK_DECODE_ATTENTION=1 bash -c \
      "ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --page raw \
      $PY -m engine bench --shape qwen3-4b --bits 4 -p 512 -g 8 > /tmp/kernels.csv && \
      $PY tests/gpu/kernel_times.py /tmp/kernels.csv"
  fi
fi
if [ "$PART" = "all" ] || [ "$PART" = "profile" ]; then
  # Why a one-row product waits (docs/qmv.md, "Registers": issuing on 44-63% of cycles at
  # 22-35% of DRAM peak): its warps' stall reasons and the schedulers' state, for gate/up,
  # the output product and the head of qwen3-4b's decode, default build and one op a code.
  if command -v ncu > /dev/null; then
    for variant in MLX_DESK_QMV=1 MLX_DESK_QMV_ONE_OP_CODES=1; do
      step 200 "stall reasons of qwen3-4b's products, $variant" env $variant ncu --clock-control none \
        --cache-control none --section WarpStateStats --section SchedulerStats --section Occupancy \
        --kernel-name regex:quantized_matmul_rows --launch-skip 300 --launch-count 3 \
        "$PY" -m engine bench --shape qwen3-4b --bits 4 -p 512 -g 4
    done
  fi
fi
echo
echo "qmv_check: $failed step(s) failed"
exit "$failed"
