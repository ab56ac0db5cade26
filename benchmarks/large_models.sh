#!/usr/bin/env bash
# The seeds' large models on one node of 4 or 8 GPUs of an H200's size (141 GB each):
# 1. weak scaling of training, the 1B preset bf16 at 8 x 2048 tokens per GPU: one GPU, then DDP and FSDP
#    over 2 and 4 GPUs, and FSDP over 8 with GPUS 8;
# 2. Llama-2-70B bf16 inference under TP 4, batch 1 and 16: TTFT, decode tokens/s, per-GPU peak;
# 3. Falcon-180B inference over 4 GPUs in the layout and precision the planner picks (bf16-pure first,
#    fp8 on out-of-memory);
# 4. training: 13B as FSDP 2 x TP 2; Llama-3.1-70B under FSDP over 4 GPUs (and over 8 with GPUS 8), its
#    precision, batch and activation checkpointing left to the planner;
# 5. with GPUS 8: Llama-3.1-405B fp8 inference over 8 in the planner's layout, and Falcon-180B bf16-pure over
#    8 pipeline stages (fitbench refuses Falcon under tensor parallelism: transformers has no
#    tensor-parallel plan for it).
# The same configurations planned without a GPU: benchmarks/large_models_plan.sh.
# Usage: benchmarks/large_models.sh OUT_DIR GPUS   (then: python benchmarks/memory_error.py OUT_DIR/<part>)
set -euo pipefail
out=${1:?usage: benchmarks/large_models.sh OUT_DIR GPUS}
gpus=${2:?usage: benchmarks/large_models.sh OUT_DIR GPUS}
if [ "$gpus" != 4 ] && [ "$gpus" != 8 ]; then
  echo "GPUS is 4 or 8, not $gpus" >&2
  exit 2
fi
fitbench=${FITBENCH:-fitbench}
# models of 70B and more take minutes to build (and to quantize) before their first step
steps=(--warmup-steps 2 --measure-steps 5 --timeout 1800)

# a directory holds one sweep: each run its own, under the part it belongs to
run() { local dir=$1; shift; $fitbench run "$@" --out "$out/$dir" || true; }

weak=(--models 1B --mode train --precision bf16 --batch-size 8 --seq-len 2048
      --warmup-steps 3 --measure-steps 10 --timeout 1200)
run weak/1 "${weak[@]}"
for n in 2 4; do
  run "weak/ddp-$n" "${weak[@]}" --gpus "$n" --strategy ddp
  run "weak/fsdp-$n" "${weak[@]}" --gpus "$n" --strategy fsdp
done
if [ "$gpus" -ge 8 ]; then
  run weak/fsdp-8 "${weak[@]}" --gpus 8 --strategy fsdp
fi

infer=(--mode infer --seq-len 512 --new-tokens 32 "${steps[@]}")
run infer/llama-2-70b-tp4 --models llama-2-70b --precision bf16-pure --batch-size 1 16 "${infer[@]}" \
    --gpus 4 --strategy tp
run infer/falcon-180b-x4 --models falcon-180b --fallback bf16-pure fp8 --batch-size 1 "${infer[@]}" --gpus 4

train=(--mode train --seq-len 2048 "${steps[@]}")
run train/13b-fsdp2-tp2 --models 13B --precision bf16 --batch-size 2 "${train[@]}" --gpus 4 --strategy fsdp --tp 2
run train/llama-3.1-70b-fsdp4 --models llama-3.1-70b --batch-size auto "${train[@]}" --gpus 4 --strategy fsdp

if [ "$gpus" -ge 8 ]; then
  run train/llama-3.1-70b-fsdp8 --models llama-3.1-70b --batch-size auto "${train[@]}" --gpus 8 --strategy fsdp
  run infer/llama-3.1-405b-fp8-x8 --models llama-3.1-405b --precision fp8 --batch-size 1 "${infer[@]}" --gpus 8
  run infer/falcon-180b-pp8 --models falcon-180b --precision bf16-pure --batch-size 1 "${infer[@]}" \
      --gpus 8 --strategy pipeline
fi
