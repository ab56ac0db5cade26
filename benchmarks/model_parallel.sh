#!/usr/bin/env bash
# Tensor and pipeline parallelism on one node of GPUS GPUs (2 by default), with the one-GPU baselines:
# 1. Llama-2-70B bf16 inference, TP and PP, batch 1 and 8: per-GPU predicted vs measured peak, decode
#    tokens/s and % of the bandwidth roofline;
# 2. the 120B preset (Mistral-Large-2's shape) in fp8 and fp8-block over the GPUs' pipeline stages, each
#    stage quantized on its own GPU, and on one GPU;
# 3. 13B bf16 decode at batch 1, one GPU against TP;
# 4. training of 13B with TP and with PP (the planner's batch left to the flags below);
# 5. the hf backend: Falcon-40B over stages, 13B under transformers' TP plan; with 4 GPUs or more,
#    FSDP x TP training and TP x pipeline inference.
# Usage: benchmarks/model_parallel.sh OUT_DIR [GPUS]   (then: python benchmarks/memory_error.py OUT_DIR)
# ONLY="5 6 12" runs only the runs of those numbers (each run's directory is its number, counted in the
# order below), where a device's time is short; a directory already holding rows is not run again.
set -euo pipefail
out=${1:?usage: benchmarks/model_parallel.sh OUT_DIR [GPUS]}
gpus=${2:-2}
fitbench=${FITBENCH:-fitbench}
steps=(--warmup-steps 2 --measure-steps 5 --timeout 900)

# each run its own directory (a directory holds one sweep)
n=0
run() {
  n=$((n + 1))
  [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $n "* ]] && return 0
  [ -s "$out/$n/results.jsonl" ] && return 0
  $fitbench run "$@" "${steps[@]}" --out "$out/$n" || true
}

infer=(--mode infer --seq-len 512 --new-tokens 32)
run --models llama-2-70b --precision bf16-pure --batch-size 1 8 "${infer[@]}" --gpus "$gpus" --strategy tp
run --models llama-2-70b --precision bf16-pure --batch-size 1 8 "${infer[@]}" --gpus "$gpus" --strategy pipeline
run --models 120B --precision fp8 fp8-block --batch-size 1 "${infer[@]}" --gpus "$gpus" --strategy pipeline
run --models 120B --precision fp8 fp8-block --batch-size 1 "${infer[@]}"
run --models 13B --precision bf16-pure --batch-size 1 --mode infer --seq-len 512 --new-tokens 64
run --models 13B --precision bf16-pure --batch-size 1 --mode infer --seq-len 512 --new-tokens 64 --gpus "$gpus" --strategy tp
run --models 13B --mode train --precision bf16-pure --batch-size 4 --seq-len 1024 --activation-checkpointing --gpus "$gpus" --strategy tp
run --models 13B --mode train --precision bf16-pure --batch-size 4 --seq-len 1024 --activation-checkpointing --gpus "$gpus" --strategy pipeline --microbatches 4
# the hf backend over the GPUs: Falcon-40B (no native decoder, no tensor-parallel plan) over stages, and a
# Llama under transformers' own tensor-parallel plan
run --models falcon-40b --backend hf --precision bf16-pure --batch-size 1 8 "${infer[@]}" --gpus "$gpus" --strategy pipeline
run --models 13B --backend hf --precision bf16-pure --batch-size 1 "${infer[@]}" --gpus "$gpus" --strategy tp
# 2-D layouts on four GPUs or more: FSDP x TP training, TP x pipeline stages inference
if [ "$gpus" -ge 4 ]; then
  run --models 13B --mode train --precision bf16 --batch-size 2 --seq-len 2048 --gpus "$gpus" --strategy fsdp --tp 2
  run --models llama-2-70b --precision bf16-pure --batch-size 1 8 "${infer[@]}" --gpus "$gpus" --strategy pipeline --tp 2
fi
