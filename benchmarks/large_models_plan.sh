#!/usr/bin/env bash
# The configurations of benchmarks/large_models.sh planned for 4 and 8 H200s, without a GPU: each
# plan as JSON (sizes in bytes) and as the terminal's table, OUT_DIR/<item>-x<GPUs>.json and .txt.
# A plan for N GPUs weighs every layout of N GPUs or fewer; where the run fixes the layout (--strategy,
# --tp), the plan is limited to that strategy and the layout run is among its candidates.
# Usage: benchmarks/large_models_plan.sh OUT_DIR
set -euo pipefail
out=${1:?usage: benchmarks/large_models_plan.sh OUT_DIR}
fitbench=${FITBENCH:-fitbench}
mkdir -p "$out"

plan() {
  local name=$1; shift
  $fitbench plan "$@" --gpu H200 --json > "$out/$name.json" || true
  $fitbench plan "$@" --gpu H200 > "$out/$name.txt" 2>&1 || true
}

weak=(--models 1B --mode train --precision bf16 --batch-size 8 --seq-len 2048)
plan weak-x1 "${weak[@]}" --gpus 1 --strategy single
for n in 2 4; do
  plan "weak-ddp-x$n" "${weak[@]}" --gpus "$n" --strategy ddp
  plan "weak-fsdp-x$n" "${weak[@]}" --gpus "$n" --strategy fsdp
done
plan weak-fsdp-x8 "${weak[@]}" --gpus 8 --strategy fsdp

infer=(--mode infer --seq-len 512 --new-tokens 32)
for batch in 1 16; do
  plan "llama-2-70b-tp-b$batch-x4" --models llama-2-70b --precision bf16-pure --batch-size "$batch" "${infer[@]}" \
      --gpus 4 --strategy tp
done
for n in 4 8; do
  plan "falcon-180b-x$n" --models falcon-180b --precision bf16-pure fp8 --batch-size 1 "${infer[@]}" --gpus "$n"
done

train=(--mode train --seq-len 2048)
plan 13b-fsdp-tp-x4 --models 13B --precision bf16 --batch-size 2 "${train[@]}" --gpus 4 --strategy fsdp tp
for n in 4 8; do
  plan "llama-3.1-70b-fsdp-x$n" --models llama-3.1-70b --batch-size auto "${train[@]}" --gpus "$n" --strategy fsdp
done

plan llama-3.1-405b-fp8-x8 --models llama-3.1-405b --precision fp8 --batch-size 1 "${infer[@]}" --gpus 8
# what the issue asks (tensor parallelism) and what the run launches for Falcon (pipeline stages)
plan falcon-180b-bf16-tp-x8 --models falcon-180b --precision bf16-pure --batch-size 1 "${infer[@]}" --gpus 8 \
    --strategy tp
plan falcon-180b-bf16-pp-x8 --models falcon-180b --precision bf16-pure --batch-size 1 "${infer[@]}" --gpus 8 \
    --strategy pipeline
