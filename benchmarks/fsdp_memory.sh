#!/usr/bin/env bash
# FSDP training near a GPU's capacity on one node of GPUS GPUs (4 by default), bf16: the rows whose
# per-GPU peak was under-predicted while the worker kept the whole model's build blocks cached after
# sharding it (30B checkpointed 4 x 512, 13B 4 x 1024 with and without checkpointing, 1B 8 x 2048),
# each in its own directory; then the planner's error per row.
# Usage: benchmarks/fsdp_memory.sh OUT_DIR [GPUS]   (then: python benchmarks/memory_error.py OUT_DIR)
set -euo pipefail
out=${1:?usage: benchmarks/fsdp_memory.sh OUT_DIR [GPUS]}
gpus=${2:-4}
fitbench=${FITBENCH:-fitbench}
common=(--mode train --gpus "$gpus" --strategy fsdp --warmup-steps 2 --measure-steps 5)

run() { local dir=$1; shift; [ -s "$out/$dir/results.jsonl" ] || $fitbench run "$@" "${common[@]}" --out "$out/$dir" || true; }

run 30b-checkpointed --models 30B --precision bf16-pure --batch-size 4 --seq-len 512 --activation-checkpointing
run 13b-checkpointed --models 13B --precision bf16-pure --batch-size 4 --seq-len 1024 --activation-checkpointing
run 13b --models 13B --precision bf16-pure --batch-size 4 --seq-len 1024
run 1b --models 1B --precision bf16 --batch-size 8 --seq-len 2048
