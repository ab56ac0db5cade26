#!/usr/bin/env bash
# Data parallelism on one node, against one GPU: weak scaling of the 1B preset (bf16, 8 x 2048 tokens per
# GPU, train) with DDP and with FSDP; models that do not fit on one GPU for full training, sharded with
# FSDP (20B bf16-pure, llama-3.1-8b at 4096 tokens); 30B training left to the planner. Every GPU's NVML
# timeline lands in OUT_DIR/*/artifacts/.
# Usage: benchmarks/data_parallel.sh OUT_DIR [GPUS]   (then: python benchmarks/memory_error.py OUT_DIR/sharded)
set -euo pipefail
out=${1:?usage: benchmarks/data_parallel.sh OUT_DIR [GPUS]}
gpus=${2:-2}
fitbench=${FITBENCH:-fitbench}
steps=(--warmup-steps 3 --measure-steps 10 --timeout 1200)

# a directory holds one sweep: each run its own, under the part it belongs to
weak=(--models 1B --mode train --precision bf16 --batch-size 8 --seq-len 2048 "${steps[@]}")
$fitbench run "${weak[@]}" --out "$out/weak/1" || true
$fitbench run "${weak[@]}" --gpus "$gpus" --strategy ddp --out "$out/weak/ddp" || true
$fitbench run "${weak[@]}" --gpus "$gpus" --strategy fsdp --out "$out/weak/fsdp" || true

sharded=(--mode train --gpus "$gpus" --strategy fsdp "${steps[@]}")
$fitbench run --models 20B --precision bf16-pure --batch-size 1 --seq-len 2048 "${sharded[@]}" --out "$out/sharded/20b" || true
$fitbench run --models llama-3.1-8b --precision bf16 --batch-size 1 --seq-len 4096 --activation-checkpointing \
    "${sharded[@]}" --out "$out/sharded/8b" || true

$fitbench run --models 30B --mode train --gpus "$gpus" "${steps[@]}" --out "$out/planned" || true
