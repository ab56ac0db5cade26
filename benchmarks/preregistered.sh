#!/usr/bin/env bash
# Runs whose forecasts are written down first: each configuration below planned with `fitbench plan
# --preregister` (no GPU needed: a described GPU), the forecasts committed, then run on the GPUs and set
# beside them with `fitbench report --preregistered`.
#   plan:   OUT/forecasts/NAME.json for every configuration, planned for GPU (a name of `fitbench plan --gpu`)
#   run:    each configuration into OUT/NAME, the options of its plan, on this machine's GPUs
#   report: OUT/report.md, every registered forecast beside the row that ran it
# The configurations: 7B and 20B training over 4 GPUs; Llama-3.1-8B training at 8k and 32k tokens over 4
# GPUs (the planner's checkpointing) and their prefill on one; 13B decoding at batch 8, 32 and 64 under
# TP 2, TP 4 and 4 replicas; Llama-2-70B in nf4, int8 and fp8 over 4 GPUs (the planner's layout, and 4
# pipeline stages); Falcon-40B in nf4 on one GPU
# and Falcon-180B in nf4, int8 and fp8 over the fewest GPUs `fitbench plan --requirements` names (hf
# backend: transformers' quantized build, layer by layer).
# SET one: the configurations a machine of one GPU can run: Llama-3.1-8B training at 8k tokens and its
# prefill at 8k and 32k; 13B decoding at batch 8, 32 and 64; Llama-2-70B in nf4, int8 and fp8; Falcon-40B
# in nf4 on both backends and Falcon-180B in nf4 (hf); GPT-2 XL generating on both backends.
# The set one measures 3 generations (or steps) after 1 warm-up, where the set four measures 5 after 2: its
# 70B int8 decodes at a few tokens a second.
# ONLY="NAME ..." runs (or plans) only the configurations named; each run stops after TIMEOUT seconds (900).
# Usage: benchmarks/preregistered.sh OUT GPU [plan|run|report] [four|one]
set -euo pipefail
usage="usage: benchmarks/preregistered.sh OUT GPU [plan|run|report] [four|one]"
out=${1:?$usage}
gpu=${2:?$usage}
step=${3:-plan}
set=${4:-four}
fitbench=${FITBENCH:-fitbench}
short=(--warmup-steps 2 --measure-steps 5 --timeout "${TIMEOUT:-900}")
[ "$set" = one ] && short=(--warmup-steps 1 --measure-steps 3 --timeout "${TIMEOUT:-900}")

# the fewest GPUs of GPU that hold Falcon-180B in each precision, as --requirements gives them
fewest() {
  $fitbench plan --requirements --json --models falcon-180b --mode infer --precision "$1" --gpu "$gpu" \
    --seq-len 512 --new-tokens 128 | python -c "import json, sys; print(json.load(sys.stdin)[0]['min_gpus'] or 0)"
}

one_gpu_configurations() {
  echo "8b-train-8192-1 --models llama-3.1-8b --mode train --precision bf16-pure --batch-size 1 --seq-len 8192 --gpus 1"
  for seq in 8192 32768; do
    echo "8b-prefill-${seq} --models llama-3.1-8b --mode forward --precision bf16-pure --batch-size 1 --seq-len $seq"
  done
  for batch in 8 32 64; do
    echo "13b-decode-b${batch}-1 --models 13B --mode infer --precision bf16-pure --batch-size $batch --seq-len 512" \
         "--new-tokens 128 --gpus 1"
  done
  for precision in nf4 int8 fp8; do
    echo "70b-${precision}-1 --models llama-2-70b --mode infer --precision $precision --batch-size 1 --seq-len 512" \
         "--new-tokens 128 --gpus 1"
  done
  for backend in hf native; do
    echo "falcon40b-nf4-1-${backend} --models falcon-40b --mode infer --precision nf4 --batch-size 1 --seq-len 512" \
         "--new-tokens 128 --gpus 1 --backend $backend"
    echo "gpt2xl-bf16-1-${backend} --models gpt2-xl --mode infer --precision bf16-pure --batch-size 8 --seq-len 512" \
         "--new-tokens 128 --gpus 1 --backend $backend"
  done
  echo "falcon180b-nf4-1 --models falcon-180b --mode infer --precision nf4 --batch-size 1 --seq-len 512" \
       "--new-tokens 128 --gpus 1"
}

configurations() {
  [ "$set" = one ] && { one_gpu_configurations; return; }
  echo "7b-train-4 --models 7B --mode train --precision bf16-pure --batch-size 4 --seq-len 2048 --gpus 4"
  echo "20b-train-4 --models 20B --mode train --precision bf16-pure --batch-size 2 --seq-len 2048 --gpus 4"
  for seq in 8192 32768; do
    echo "8b-train-${seq} --models llama-3.1-8b --mode train --precision bf16-pure --batch-size 1 --seq-len $seq --gpus 4"
    echo "8b-prefill-${seq} --models llama-3.1-8b --mode forward --precision bf16-pure --batch-size 1 --seq-len $seq"
  done
  for batch in 8 32 64; do
    for layout in "tp 2" "tp 4" "replicas 4"; do
      read -r strategy count <<< "$layout"
      echo "13b-decode-b${batch}-${strategy}${count} --models 13B --mode infer --precision bf16-pure --batch-size $batch" \
           "--seq-len 512 --new-tokens 128 --gpus $count --strategy $strategy"
    done
  done
  for precision in nf4 int8 fp8; do
    echo "70b-${precision}-4 --models llama-2-70b --mode infer --precision $precision --batch-size 1 --seq-len 512" \
         "--new-tokens 128 --gpus 4"
    echo "70b-${precision}-pipeline4 --models llama-2-70b --mode infer --precision $precision --batch-size 1" \
         "--seq-len 512 --new-tokens 128 --gpus 4 --strategy pipeline"
  done
  echo "falcon40b-nf4-1 --models falcon-40b --mode infer --precision nf4 --batch-size 1 --seq-len 512 --new-tokens 128"
  for precision in nf4 int8 fp8; do
    count=$(fewest "$precision")
    [ "$count" = 0 ] && continue
    echo "falcon180b-${precision}-${count} --models falcon-180b --mode infer --precision $precision --batch-size 1" \
         "--seq-len 512 --new-tokens 128 --gpus $count"
  done
}

mkdir -p "$out/forecasts"
if [ "$step" = report ]; then
  : > "$out/report.md"
  for forecasts in "$out"/forecasts/*.json; do
    name=$(basename "$forecasts" .json)
    [ -s "$out/$name/results.jsonl" ] || { echo "$name: not run" >> "$out/report.md"; continue; }
    $fitbench report "$out/$name" --preregistered "$forecasts" --markdown >> "$out/report.md"
  done
  cat "$out/report.md"
  exit 0
fi
configurations | while read -r name options; do
  [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]] && continue
  read -r -a shape <<< "$options"
  if [ "$step" = plan ]; then
    [ -e "$out/forecasts/$name.json" ] && continue  # registered already: never rewritten
    $fitbench plan "${shape[@]}" --gpu "$gpu" --preregister "$out/forecasts/$name.json" > /dev/null
  elif [ ! -s "$out/$name/results.jsonl" ]; then
    $fitbench run "${shape[@]}" "${short[@]}" --out "$out/$name" || true
  fi
done
