#!/usr/bin/env bash
# The planner's choice against the best layout measured, on one node, bf16-pure, for 8 model x mode cases:
# 1B and 7B generating at batch 1 and 16, 13B and 30B training, Llama-2-70B generating at batch 1, a 13B
# forward pass. Per case: `fitbench plan --json` lists the choice and every layout it finds fitting; the
# choice runs with the strategy left to the planner (`--gpus GPUS`), each alternative with its explicit
# --strategy/--tp/--gpus (and --activation-checkpointing, or --checkpointed-layers N for the first N layers,
# where the plan has it), each into its own
# directory; then summary.md: per case the chosen layout and its tokens/s, the best measured layout and
# its tokens/s, their ratio and whether the choice is within 10% of the best.
# Usage: benchmarks/auto_vs_best.sh OUT_DIR [GPUS] [run|dry-run|summary]   (GPUS 4 by default)
# ALTERNATIVES=N runs N of the fitting layouts the plan lists where a device's time is short, every one by
# default: a sample, not the plan's own ranking (that would measure the choice against the layouts the
# planner already likes best). The order is a shuffle seeded by SAMPLE_SEED (0 by default), the same on
# every call, so a directory already holding a row is not run again and a later call with a larger N (or
# one after a command cut short) adds the next of the same order; CASES="13b-train 30b-train" runs only the cases named; summary only
# writes summary.md from the rows there.
# dry-run plans and prints the run commands without running them (no GPU needed: set FITBENCH_GPU to a
# described GPU, e.g. H100-80GB; otherwise the plan uses this machine's GPUs).
set -euo pipefail
out=${1:?usage: benchmarks/auto_vs_best.sh OUT_DIR [GPUS] [dry-run]}
gpus=${2:-4}
mode=${3:-run}
fitbench=${FITBENCH:-fitbench}
described=()
[ -n "${FITBENCH_GPU:-}" ] && described=(--gpu "$FITBENCH_GPU")
short=(--warmup-steps 2 --measure-steps 5)

# name | model | mode | batch | sequence | new tokens
cases="1b-infer-b1 1B infer 1 512 32
1b-infer-b16 1B infer 16 512 32
7b-infer-b1 7B infer 1 512 32
7b-infer-b16 7B infer 16 512 32
13b-train 13B train 4 1024 0
30b-train 30B train 4 512 0
70b-infer-b1 llama-2-70b infer 1 512 32
13b-forward 13B forward 8 1024 0"

mkdir -p "$out"
[ "$mode" = summary ] && cases=""
while read -r name model task batch seq new; do
  [ -z "$name" ] && continue
  [ -n "${CASES:-}" ] && [[ " $CASES " != *" $name "* ]] && continue
  shape=(--models "$model" --mode "$task" --precision bf16-pure --batch-size "$batch" --seq-len "$seq")
  [ "$new" != 0 ] && shape+=(--new-tokens "$new")
  mkdir -p "$out/$name"
  $fitbench plan "${shape[@]}" --gpus "$gpus" "${described[@]}" --json > "$out/$name/plan.json"
  # one line per layout: directory, then its run options (the choice first, its strategy left to the planner)
  python - "$out/$name/plan.json" "$gpus" "${ALTERNATIVES:-}" "${SAMPLE_SEED:-0}" > "$out/$name/layouts.txt" <<'PYTHON'
import json, random, sys

(plan,), gpus = json.load(open(sys.argv[1])), sys.argv[2]  # one model and mode: a list of one plan
limit = int(sys.argv[3]) if sys.argv[3] else None
seed = int(sys.argv[4])

def name_and_options(candidate):
    strategy, *inner = candidate["strategy"].split("+")
    tp, ckpt = candidate["layout"]["tp"], candidate["activation_checkpointing"]
    options = [] if strategy == "single" else ["--gpus", str(candidate["gpus"])]
    if strategy == "single":
        name = "single-1"
    elif inner:  # a 2-D layout: the outer strategy with tensor parallelism inside (fsdp+tp, tp+pipeline)
        outer = inner[0] if strategy == "tp" else strategy
        options += ["--strategy", outer, "--tp", str(tp)]
        name = f"{outer}-{candidate['gpus']}-tp{tp}"
    else:
        options += ["--strategy", strategy]
        name = f"{strategy}-{candidate['gpus']}"
    options += checkpointing(candidate)
    if ckpt:
        layers = candidate.get("checkpointed_layers")
        name += "-checkpointed" + (f"-{layers}" if layers else "")
    return name, options

def checkpointing(candidate):
    """The run options of the candidate's activation checkpointing: every layer, or the first N of each stage."""
    if not candidate["activation_checkpointing"]:
        return []
    layers = candidate.get("checkpointed_layers")  # absent from plans made before it existed: every layer
    return ["--checkpointed-layers", str(layers)] if layers else ["--activation-checkpointing"]

if plan["chosen"] is None:
    sys.exit(0)
chosen = plan["chosen"]["candidate"]
choice_options = ["--gpus", gpus] + checkpointing(chosen)
print("choice", *choice_options)
alternatives = [a["candidate"] for a in plan["feasible"] if a["candidate"] != chosen]
random.Random(seed).shuffle(alternatives)  # a sample when limited, the same for every call of one seed
print("#", len(alternatives), "alternatives listed")
for candidate in alternatives[:limit]:
    name, options = name_and_options(candidate)
    print(name, *options)
PYTHON
  while read -r directory options; do
    [ "$directory" = "#" ] && continue
    read -r -a layout <<< "$options"
    command=($fitbench run "${shape[@]}" "${layout[@]}" "${short[@]}" --out "$out/$name/$directory")
    if [ "$mode" = dry-run ]; then
      echo "${command[*]}"
    elif [ ! -s "$out/$name/$directory/results.jsonl" ]; then  # none yet, or cut short before its row
      rm -rf "${out:?}/$name/$directory"
      "${command[@]}" || true
    fi
  done < "$out/$name/layouts.txt"
done <<< "$cases"
[ "$mode" = dry-run ] && exit 0

python - "$out" > "$out/summary.md" <<'PYTHON'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])

def tokens_per_s(directory):
    path = directory / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if not rows or rows[-1]["status"] != "ok":
        return None, None
    row = rows[-1]
    key = "decode_tokens_per_s" if row["spec"]["mode"] == "infer" else "tokens_per_s"
    return row["throughput"][key], row["label"]

print("| case | chosen layout | tokens/s | best measured layout | tokens/s | chosen / best | within 10% | "
      "alternatives measured / listed |")
print("|---|---|---|---|---|---|---|---|")
within = cases = 0
for case in sorted(p for p in out.iterdir() if (p / "layouts.txt").exists()):
    measured = {d.name: tokens_per_s(d) for d in case.iterdir() if d.is_dir()}
    listed = next((int(line.split()[1]) for line in (case / "layouts.txt").read_text().splitlines()
                   if line.startswith("#")), 0)
    coverage = f"{sum(name != 'choice' for name in measured)} / {listed}"
    chosen, chosen_label = measured.pop("choice", (None, None))
    ok = {name: value for name, value in measured.items() if value[0] is not None}
    best_name = max(ok, key=lambda name: ok[name][0], default=None)
    best, best_label = ok[best_name] if best_name else (None, None)
    if chosen is not None and (best is None or chosen >= best):
        best, best_label = chosen, f"the choice ({chosen_label})"
    cases += 1
    if chosen is None or best is None:
        print(f"| {case.name} | {chosen_label or 'not ok'} | | {best_label or '-'} | | | no | {coverage} |")
        continue
    ratio = chosen / best
    within += ratio >= 0.9
    print(f"| {case.name} | {chosen_label} | {chosen:,.0f} | {best_label} | {best:,.0f} | {ratio:.3f} | "
          f"{'yes' if ratio >= 0.9 else 'no'} | {coverage} |")
print(f"\nThe choice within 10% of the best measured layout in {within} of {cases} cases.")
PYTHON
cat "$out/summary.md"
