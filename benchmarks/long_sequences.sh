#!/usr/bin/env bash
# Planner validation, checkpointed training of long sequences with large vocabularies: where the
# loss's n x V tensors are largest beside everything else, and where a whole-logits loss made the
# caching allocator reserve 9.4 GB beyond its allocations (Llama-3.1-8B, 2 x 4096, on an H200).
# Usage: benchmarks/long_sequences.sh OUT_DIR   (then: python benchmarks/memory_error.py OUT_DIR)
set -euo pipefail
out=${1:?usage: benchmarks/long_sequences.sh OUT_DIR}
fitbench=${FITBENCH:-fitbench}
quick=(--warmup-steps 1 --measure-steps 3 --timeout 400)

# each run its own directory under OUT_DIR (a directory holds one sweep)
n=0
run() { n=$((n + 1)); $fitbench run "$@" "${quick[@]}" --out "$out/$n" || true; }

run --models llama-3.1-8b --mode train --precision bf16-pure --batch-size 2 1 --seq-len 4096 --activation-checkpointing
run --models llama-3.1-8b --mode train --precision bf16-pure --batch-size 1 --seq-len 8192 --activation-checkpointing
run --models 3B --mode train --precision bf16-pure --batch-size 2 --seq-len 4096 --activation-checkpointing
run --models qwen2.5-7b --mode train --precision bf16 --batch-size 1 --seq-len 4096 --activation-checkpointing
