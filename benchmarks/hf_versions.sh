#!/usr/bin/env bash
# The hf backend's memory rows under the transformers that is installed: the validation matrices' hf
# rows (Falcon-40B bf16 weights, GPT-2 XL decode and training) and the rows where transformers'
# versions keep different caches: autocast decode (a DynamicCache of fp32 keys beside values whose
# width depends on the version) and autocast forward passes (the cache transformers grows unasked).
# Run it once per transformers version, each into its own directory, and compare with
# python benchmarks/memory_error.py OUT_DIR.
# Usage: benchmarks/hf_versions.sh OUT_DIR   (uses the first two visible GPUs for Falcon-40B's stages)
set -euo pipefail
out=${1:?usage: benchmarks/hf_versions.sh OUT_DIR}
fitbench=${FITBENCH:-fitbench}
python -c "import torch, transformers; print('transformers', transformers.__version__, 'torch', torch.__version__)" \
    > "$(mkdir -p "$out" && echo "$out")/versions.txt"
quick=(--backend hf --warmup-steps 1 --measure-steps 2 --timeout 600)
n=0
run() { n=$((n + 1)); $fitbench run "$@" "${quick[@]}" --out "$out/$n" || true; }
run --models falcon-40b --mode infer --precision bf16-pure --batch-size 1 --seq-len 512 --new-tokens 16 \
    --gpus 2 --strategy pipeline
run --models gpt2-xl --mode infer --precision bf16-pure --batch-size 8 --seq-len 512 --new-tokens 32
run --models gpt2-xl --mode train --precision bf16 --batch-size 4 --seq-len 1024
run --models 1B --mode infer --precision bf16 --batch-size 4 --seq-len 512 --new-tokens 32
run --models qwen2.5-7b --mode infer --precision bf16 --batch-size 2 --seq-len 1024 --new-tokens 32
run --models mistral-7b --mode forward --precision bf16 --batch-size 2 --seq-len 1024
run --models gpt2-xl --mode forward --precision bf16 --batch-size 8 --seq-len 1024
