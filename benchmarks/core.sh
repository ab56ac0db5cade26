#!/usr/bin/env bash
# The three sweeps of the core benchmark, run on one GPU:
#   CS336 sizes, forward + backward, bf16 autocast, 4 x 512 tokens;
#   the 1B and 7B ladder presets training (bf16 autocast, default 4 x 512);
#   7B decoding at batch 1 with bf16 weights (default 128-token prompt, 128 new tokens).
# Usage: benchmarks/core.sh OUT_DIR   (one sub-directory per sweep, plus summary.md)
set -euo pipefail
out=${1:?usage: benchmarks/core.sh OUT_DIR}
fitbench=${FITBENCH:-fitbench}

$fitbench env --measure
$fitbench run --models small medium large xl 2.7B --mode forward-backward --precision bf16 \
    --batch-size 4 --context-length 512 --out "$out/cs336-forward-backward"
$fitbench run --models 1B 7B --mode train --precision bf16 --out "$out/ladder-train"
$fitbench run --models 7B --mode infer --batch-size 1 --precision bf16-pure --out "$out/7b-infer"

{
  for sweep in cs336-forward-backward ladder-train 7b-infer; do
    $fitbench report "$out/$sweep" --markdown
    echo
  done
} > "$out/summary.md"
cat "$out/summary.md"
