#!/usr/bin/env bash
# Several GPUs against one, side by side in one command on one host, bf16:
# 1. decode at batch 1, 13B (512-token prompt, 64 new tokens): one GPU, then TP 2 and TP GPUS, and TP GPUS
#    with --no-symmetric-memory (NCCL's all-reduces); with GPUS 4, Llama-2-70B under TP 4 both ways and as
#    2 pipeline stages x TP 2 (its bandwidth roofline is the reference: it does not fit one GPU);
# 2. sharded training over GPUS: 13B and 30B as the planner picks them, eager and with --compile, 30B under
#    FSDP in bf16-pure, and 13B as FSDP x TP 2, eager and compiled (their MFU is the figure: none fits one GPU);
# 3. weak scaling of training, the 1B preset at 8 x 2048 tokens per GPU (3 warm-up, 10 measured steps):
#    one GPU, then DDP and FSDP over 2 and GPUS, then one GPU again (as warm as the others);
# then summary.md: each row's tokens/s against its one-GPU baseline (decode: the ratio of tokens/s;
# training: tokens/s per GPU over the one GPU's tokens/s, the weak-scaling efficiency, and in brackets
# over the one GPU's run last).
# Usage: benchmarks/vs_one_gpu.sh OUT_DIR GPUS [decode|sharded|weak|all]   (GPUS 2 or 4; all by default)
set -euo pipefail
out=${1:?usage: benchmarks/vs_one_gpu.sh OUT_DIR GPUS}
gpus=${2:?usage: benchmarks/vs_one_gpu.sh OUT_DIR GPUS [decode|sharded|weak|all]}
part=${3:-all}
fitbench=${FITBENCH:-fitbench}
# a directory holds one sweep: each run its own; one that already holds a row is not run again and one
# begun without finishing is resumed, so a call cut short by a time limit is continued by the same command
run() {
  local dir=$1; shift
  [ -s "$out/$dir/results.jsonl" ] && return 0
  if [ -f "$out/$dir/sweep.json" ]; then $fitbench run --resume "$out/$dir" || true
  else $fitbench run "$@" --out "$out/$dir" || true; fi
}

decode=(--models 13B --mode infer --precision bf16-pure --batch-size 1 --seq-len 512 --new-tokens 64
        --warmup-steps 2 --measure-steps 5)
if [ "$part" = all ] || [ "$part" = decode ]; then
  run decode/1 "${decode[@]}"
  for n in 2 "$gpus"; do
    run "decode/tp-$n" "${decode[@]}" --gpus "$n" --strategy tp
  done
  # the same, each layer's all-reduces through NCCL instead of symmetric memory
  run "decode/tp-$gpus-nccl" "${decode[@]}" --gpus "$gpus" --strategy tp --no-symmetric-memory
  if [ "$gpus" -ge 4 ]; then
    decode70=(--models llama-2-70b --mode infer --precision bf16-pure --batch-size 1 --seq-len 512 --new-tokens 64
              --warmup-steps 2 --measure-steps 5 --gpus 4 --strategy tp)
    run decode-70b/tp-4 "${decode70[@]}"
    run decode-70b/tp-4-nccl "${decode70[@]}" --no-symmetric-memory
    # two pipeline stages of TP 2 each, every stage's decode step captured
    run decode-70b/pipeline-2-tp2 "${decode70[@]/%tp/pipeline}" --tp 2
  fi
fi

if [ "$part" = all ] || [ "$part" = sharded ]; then
  # the layout, precision, batch and checkpointing the planner picks over GPUS (auto_vs_best.sh's cases),
  # eager and under --compile; then 13B as FSDP x TP 2, eager and compiled
  sharded=(--mode train --seq-len 2048 --warmup-steps 3 --measure-steps 10 --gpus "$gpus" --timeout 1200)
  for model in 13B 30B; do
    run "sharded/$model" --models "$model" "${sharded[@]}"
    run "sharded/$model-compile" --models "$model" "${sharded[@]}" --compile
  done
  # 30B under FSDP in bf16-pure, checkpointing as the planner picks it: where bf16 with fp32 master weights
  # fits only as TP (4 x H200), the planner keeps bf16, and this row is the FSDP figure
  run sharded/30B-fsdp --models 30B "${sharded[@]}" --precision bf16-pure --strategy fsdp
  fsdp_tp=(--models 13B --precision bf16 --batch-size 2 "${sharded[@]}" --strategy fsdp --tp 2)
  run sharded/13B-fsdp-tp2 "${fsdp_tp[@]}"
  run sharded/13B-fsdp-tp2-compile "${fsdp_tp[@]}" --compile
fi

if [ "$part" = all ] || [ "$part" = weak ]; then
  weak=(--models 1B --mode train --precision bf16 --batch-size 8 --seq-len 2048 --warmup-steps 3 --measure-steps 10)
  run weak/1 "${weak[@]}"
  for n in 2 "$gpus"; do
    for strategy in ddp fsdp; do
      run "weak/$strategy-$n" "${weak[@]}" --gpus "$n" --strategy "$strategy"
    done
  done
  # one GPU again, after the others: the first ran on GPUs idle before it, whose clock runs higher
  # than that of GPUs warmed by the runs after it (benchmarks/results/2026-11-27-h100x4-ddp-clock)
  run weak/1-after "${weak[@]}"
fi

python - "$out" > "$out/summary.md" <<'PYTHON'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])

def row(directory):
    path = out / directory / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return rows[-1] if rows and rows[-1]["status"] == "ok" else None

print("| run | layout | tokens/s | per GPU | against one GPU | MFU |\n|---|---|---|---|---|---|")
for part, key, per_gpu in (("decode", "decode_tokens_per_s", False), ("decode-70b", "decode_tokens_per_s", False),
                           ("sharded", "tokens_per_s", True), ("weak", "tokens_per_s", True)):
    base = row(f"{part}/1")
    for directory in sorted(p.parent.relative_to(out) for p in (out / part).glob("*/results.jsonl")):
        r = row(directory)
        if r is None:
            print(f"| {directory} | | | | not ok | |")
            continue
        gpus = r["parallel"]["world_size"] if r.get("parallel") else 1
        tokens = r["throughput"][key]
        roofline = r["throughput"].get("decode_roofline_percent")
        if base is None:  # no one-GPU row: the share of the bandwidth roofline instead
            ratio = f"{roofline:.1f}% of roofline" if roofline is not None else ""
        else:
            ratio = f"{tokens / gpus / base['throughput'][key] if per_gpu else tokens / base['throughput'][key]:.3f}"
            after = row(f"{part}/1-after")
            if after is not None:
                ratio += f" ({tokens / gpus / after['throughput'][key]:.3f} against `1-after`)"
        mfu = r["throughput"].get("mfu")
        layout = r["parallel"]["strategy"] + f" x {gpus}" if r.get("parallel") else "one GPU"
        print(f"| {directory} | {layout} | {tokens:,.0f} | {tokens / gpus:,.0f} | {ratio} | "
              f"{'' if mfu is None else f'{100 * mfu:.1f}%'} |")
PYTHON
cat "$out/summary.md"
