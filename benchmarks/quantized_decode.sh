#!/usr/bin/env bash
# Llama-2-7B decoding at batch 1 by precision on one GPU (128-token prompt, 128 new tokens):
#   bf16-pure, int8, nf4 (bitsandbytes), int4, fp8, fp8-block (torchao), each decode step replayed
#   from a CUDA graph where the kernels allow it; then bf16-pure and int4 again in eager mode, side
#   by side, to show what the host's kernel launches cost.
# Usage: benchmarks/quantized_decode.sh OUT_DIR
set -euo pipefail
out=${1:?usage: benchmarks/quantized_decode.sh OUT_DIR}
fitbench=${FITBENCH:-fitbench}
steps=(--mode infer --batch-size 1 --new-tokens 128 --warmup-steps 2 --measure-steps 5 --timeout 240)

$fitbench run --models llama-2-7b --precision bf16-pure int8 nf4 int4 fp8 fp8-block "${steps[@]}" \
    --out "$out/decode" || true
$fitbench run --models llama-2-7b --precision bf16-pure int4 --no-cuda-graphs "${steps[@]}" \
    --out "$out/decode-eager" || true

for sweep in decode decode-eager; do
  $fitbench report "$out/$sweep" --markdown || true
  echo
done > "$out/summary.md"
cat "$out/summary.md"
