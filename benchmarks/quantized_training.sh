#!/usr/bin/env bash
# Training with quantized weights on one GPU, predicted vs measured memory in every row:
#   Llama-2-7B shape (7B preset), 4 x 512 tokens: bf16-pure full training beside adapters on an
#   nf4, fp4 and int8 base, and fp8 (float8) full training;
#   Llama-2-70B, adapters on an nf4 base, 1 x 512 tokens with activation checkpointing: a model
#   whose full training needs several GPUs, on one;
#   the same bf16-pure and fp8 training under torch.compile, which fuses float8's casts;
#   --batch-size auto for 7B training in bf16-pure: the planner's prediction, confirmed by probes.
# Usage: benchmarks/quantized_training.sh OUT_DIR
set -euo pipefail
out=${1:?usage: benchmarks/quantized_training.sh OUT_DIR}
fitbench=${FITBENCH:-fitbench}
steps=(--warmup-steps 2 --measure-steps 5 --timeout 300)

$fitbench run --models 7B --mode train --precision bf16-pure nf4 fp4 int8 fp8 --batch-size 4 --seq-len 512 \
    "${steps[@]}" --out "$out/7b-train" || true
$fitbench run --models 7B --mode train --precision bf16-pure fp8 --compile --batch-size 4 --seq-len 512 \
    "${steps[@]}" --out "$out/7b-train-compiled" || true
$fitbench run --models llama-2-70b --mode train --precision nf4 --batch-size 1 --seq-len 512 \
    --activation-checkpointing "${steps[@]}" --out "$out/70b-adapters" || true
$fitbench run --models 7B --mode train --precision bf16-pure --batch-size auto --seq-len 512 \
    --warmup-steps 1 --measure-steps 3 --timeout 300 --out "$out/7b-auto-batch" || true

for sweep in 7b-train 7b-train-compiled 70b-adapters 7b-auto-batch; do
  $fitbench report "$out/$sweep" --markdown || true
  echo
done > "$out/summary.md"
cat "$out/summary.md"
