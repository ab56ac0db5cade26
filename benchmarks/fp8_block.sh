#!/usr/bin/env bash
# fp8-block inference on one GPU: the 120B preset (Mistral-Large-2's shape), which the seeds' FP8_BLOCK
# quantization ran out of memory with on one H200, and 1B twice in a row with one fitbench cache, the
# first run paying Triton's autotuning of torchao's block-wise matmul, the second reading it.
# Usage: benchmarks/fp8_block.sh OUT_DIR
set -euo pipefail
out=${1:?usage: benchmarks/fp8_block.sh OUT_DIR}
mkdir -p "$out"
export FITBENCH_CACHE_DIR=${FITBENCH_CACHE_DIR:-$out/cache}
fitbench run --models 120B --mode infer --precision fp8-block --batch-size 1 --seq-len 512 --new-tokens 16 \
  --warmup-steps 1 --measure-steps 2 --timeout 570 --out "$out/120b-fp8-block"
for run in cold warm; do
  fitbench run --models 1B --mode infer --precision fp8-block --batch-size 1 --seq-len 128 --new-tokens 8 \
    --warmup-steps 1 --measure-steps 1 --timeout 270 --out "$out/1b-fp8-block-$run"
done
python3 "$(dirname "$0")/memory_error.py" "$out" --markdown "$out/errors.md"
