#!/usr/bin/env bash
# Planner validation, second matrix: configurations benchmarks/memory_validation.sh never had.
# Other families on the transformers backend (Falcon-40B, GPT-2 XL), Qwen2.5-7B (q/k/v biases,
# 152k vocabulary), --compile training at two shapes, checkpointed training at 4096 and 8192 tokens
# per step, int8 / nf4 / fp8 inference, nf4 adapter training, --batch-size auto, and a run left to
# the planner that no single GPU of 141 GB holds (30B full training: refused before launch).
# Usage: benchmarks/memory_validation_more.sh OUT_DIR [all|training|inference]
#        (then: python benchmarks/memory_error.py OUT_DIR); a part runs its lines only.
set -euo pipefail
out=${1:?usage: benchmarks/memory_validation_more.sh OUT_DIR [all|training|inference]}
part=${2:-all}
fitbench=${FITBENCH:-fitbench}
quick=(--warmup-steps 1 --measure-steps 3 --timeout 400)

# each run its own directory under OUT_DIR (a directory holds one sweep)
n=0
run() { n=$((n + 1)); $fitbench run "$@" "${quick[@]}" --out "$out/$n" || true; }
section() { [[ $part == all || $part == "$1" ]]; }

if section training; then
# other families, transformers backend
run --models gpt2-xl --backend hf --mode train --precision bf16 --batch-size 4 --seq-len 1024
run --models qwen2.5-7b --mode train --precision bf16-pure --batch-size 2 --seq-len 1024 --activation-checkpointing
# torch.compile training at two shapes
run --models 1B --mode train --precision bf16 --batch-size 4 8 --seq-len 2048 --compile
# checkpointed training at 4096 and 8192 tokens per step (128k vocabulary)
run --models llama-3.1-8b --mode train --precision bf16-pure --batch-size 1 2 --seq-len 4096 --activation-checkpointing
# adapters on an nf4 base
run --models 7B --mode train --precision nf4 --batch-size 4 --seq-len 512
# the largest batch, probed from the prediction
run --models 7B --mode train --precision bf16-pure --batch-size auto --seq-len 512
# left to the planner, and too large for one GPU: must be refused before launch, with alternatives
run --models 30B --mode train --batch-size 1 --seq-len 512
fi
if section inference; then
# other families, transformers backend
run --models falcon-40b --backend hf --mode infer --precision bf16-pure --batch-size 1 --seq-len 512 --new-tokens 16
run --models gpt2-xl --backend hf --mode infer --precision bf16-pure --batch-size 8 --seq-len 512 --new-tokens 32
run --models qwen2.5-7b --mode infer --precision bf16-pure --batch-size 4 --seq-len 1024 --new-tokens 32
# quantized inference
run --models 7B --mode infer --precision int8 nf4 --batch-size 4 --seq-len 512 --new-tokens 32
run --models llama-3.1-8b --mode infer --precision fp8 --batch-size 4 --seq-len 512 --new-tokens 32
fi
