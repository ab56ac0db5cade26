#!/usr/bin/env bash
# The users' size ladder decoding on one GPU with the precision left to the planner: the first rung
# of the default inference ladder (bf16-pure, int8, nf4) predicted to fit; an out-of-memory would
# walk the rest of the ladder. Batch 1, 128-token prompt, 32 new tokens.
# Usage: benchmarks/ladder_infer.sh OUT_DIR
set -euo pipefail
out=${1:?usage: benchmarks/ladder_infer.sh OUT_DIR}
fitbench=${FITBENCH:-fitbench}

$fitbench run --models 1B 3B 7B 11B 13B 15B 20B 30B 65B 120B --mode infer --batch-size 1 --new-tokens 32 \
    --warmup-steps 1 --measure-steps 3 --timeout 300 --out "$out" || true
$fitbench report "$out" --markdown > "$out/summary.md" || true
cat "$out/summary.md"
