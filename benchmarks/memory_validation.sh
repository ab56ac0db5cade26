#!/usr/bin/env bash
# Planner validation: predicted vs measured per-GPU peak over a matrix of configurations on one GPU,
# small to 13B; train, forward-backward, forward and infer; fp32, bf16 autocast and bf16 weights;
# activation checkpointing on and off; several batch x sequence shapes; a 128k-vocabulary model.
# Usage: benchmarks/memory_validation.sh OUT_DIR [all|training|forward|inference]
#        (then: python benchmarks/memory_error.py OUT_DIR); a part runs its lines only, with the
#        planner-picked lines under "inference".
set -euo pipefail
out=${1:?usage: benchmarks/memory_validation.sh OUT_DIR [all|training|forward|inference]}
part=${2:-all}
fitbench=${FITBENCH:-fitbench}
quick=(--warmup-steps 1 --measure-steps 2 --timeout 300)

# each run its own directory under OUT_DIR (a directory holds one sweep)
n=0
run() { n=$((n + 1)); $fitbench run "$@" "${quick[@]}" --out "$out/$n" || true; }
section() { [[ $part == all || $part == "$1" ]]; }

if section training; then
# training: precision and checkpointing fixed, so every row is a prediction to check
run --models small --mode train --precision bf16 fp32 --batch-size 4 --seq-len 512 --activation-checkpointing
run --models small medium --mode train --precision bf16 --batch-size 8 --seq-len 1024
run --models 1B --mode train --precision bf16 --batch-size 4 8 --seq-len 512
run --models 1B --mode train --precision fp32 --batch-size 2 --seq-len 512
run --models large xl --mode train --precision bf16 --batch-size 4 --seq-len 512 --activation-checkpointing
run --models 2.7B --mode train --precision bf16 --batch-size 4 --seq-len 512
run --models 3B --mode train --precision bf16-pure --batch-size 4 --seq-len 1024
run --models llama-3.1-8b --mode train --precision bf16-pure --batch-size 1 --seq-len 1024 --activation-checkpointing
run --models 7B --mode forward-backward --precision bf16-pure --batch-size 2 --seq-len 512 --activation-checkpointing
fi
if section forward; then
run --models small --mode forward --precision fp32 --batch-size 8 --seq-len 512
run --models 1B --mode forward --precision bf16 --batch-size 8 --seq-len 1024
run --models 7B 13B --mode forward --precision bf16-pure --batch-size 2 --seq-len 1024
run --models llama-3.1-8b --mode forward --precision bf16-pure --batch-size 4 --seq-len 1024
fi
if section inference; then
run --models small --mode infer --precision fp32 --batch-size 8 --seq-len 128 --new-tokens 32
run --models 1B --mode infer --precision bf16-pure --batch-size 16 --seq-len 512 --new-tokens 32
run --models 7B 13B --mode infer --precision bf16-pure --batch-size 1 8 --seq-len 512 --new-tokens 32
run --models 7B --mode infer --precision bf16 --batch-size 4 --seq-len 256 --new-tokens 32
run --models llama-3.1-8b --mode infer --precision bf16-pure --batch-size 4 --seq-len 1024 --new-tokens 32
# planner-picked: precision and checkpointing left open, so the planner chooses them
run --models 1B 7B --mode train --batch-size 4 --seq-len 512
fi
