#!/usr/bin/env bash
# fitbench's native backend against transformers on the same shapes, in one run, with the ratios:
#   training, bf16 autocast, eager: the 1B preset at 8 x 2048 and CS336 xl at 4 x 1024, --backend native
#   and --backend hf;
#   decode at batch 1, Llama-2-7B shape (7B preset), bf16 weights, 128-token prompt, 128 new tokens:
#   native (its step replayed from a CUDA graph), hf eager, and transformers' static cache with its
#   forward compiled by generate (benchmarks/hf_static_decode.py).
# Usage: benchmarks/vs_transformers.sh OUT_DIR [--smoke]
#   --smoke: the tiny preset at small shapes on the CPU (a check that the pieces fit, in about a minute).
# FITBENCH: the fitbench command (default: python -m fitbench); PYTHON: the interpreter.
set -euo pipefail
out=${1:?usage: benchmarks/vs_transformers.sh OUT_DIR [--smoke]}
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python}
fitbench=${FITBENCH:-$python -m fitbench}

if [[ "${2:-}" == "--smoke" ]]; then
  train_shapes=("tiny 2 64")
  decode=(tiny 1 16 8)
  device=(--device cpu)
  steps=(--warmup-steps 1 --measure-steps 2)
  static_steps=(--warmup 1 --repeats 2 --device cpu)
else
  train_shapes=("1B 8 2048" "xl 4 1024")
  decode=(7B 1 128 128)
  device=()
  steps=(--warmup-steps 3 --measure-steps 10 --timeout 900)
  static_steps=(--warmup 2 --repeats 5 --device cuda)
fi

for shape in "${train_shapes[@]}"; do
  read -r model batch seq <<<"$shape"
  for backend in native hf; do
    $fitbench run --models "$model" --mode train --precision bf16 --backend "$backend" --batch-size "$batch" \
        --seq-len "$seq" --no-fallback "${steps[@]}" "${device[@]}" --out "$out/train/$model-$backend" || true
  done
done

read -r model batch seq new <<<"${decode[*]}"
for backend in native hf; do
  $fitbench run --models "$model" --mode infer --precision bf16-pure --backend "$backend" --batch-size "$batch" \
      --seq-len "$seq" --new-tokens "$new" --no-fallback "${steps[@]}" "${device[@]}" --out "$out/decode/$model-$backend" || true
done
$python "$here/hf_static_decode.py" --model "$model" --batch-size "$batch" --seq-len "$seq" --new-tokens "$new" \
    "${static_steps[@]}" "$out/hf-static.jsonl" || true

$python "$here/vs_transformers.py" "$out"
