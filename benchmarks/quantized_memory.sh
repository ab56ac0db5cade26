#!/usr/bin/env bash
# Planner validation of quantized inference at shapes the matrices never had: LLM.int8 with few and
# with nearly all outlier columns (1B, 2048 hidden: few; 7B and 13B: nearly all), 4-bit at other
# widths and batches, torchao int4 and float8 builds.
# Usage: benchmarks/quantized_memory.sh OUT_DIR   (then: python benchmarks/memory_error.py OUT_DIR)
set -euo pipefail
out=${1:?usage: benchmarks/quantized_memory.sh OUT_DIR}
fitbench=${FITBENCH:-fitbench}
quick=(--mode infer --warmup-steps 1 --measure-steps 3 --timeout 400)

# each run its own directory under OUT_DIR (a directory holds one sweep)
n=0
run() { n=$((n + 1)); $fitbench run "$@" "${quick[@]}" --out "$out/$n" || true; }

run --models 1B --precision int8 --batch-size 8 --seq-len 256 --new-tokens 32
run --models 13B --precision int8 --batch-size 2 --seq-len 1024 --new-tokens 32
run --models 7B --precision int8 --batch-size 1 --seq-len 128 --new-tokens 64
run --models 3B --precision nf4 --batch-size 8 --seq-len 512 --new-tokens 32
run --models 7B --precision int4 --batch-size 4 --seq-len 512 --new-tokens 32
run --models 13B --precision fp8 --batch-size 2 --seq-len 1024 --new-tokens 32
