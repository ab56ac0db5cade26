"""The fewest GPUs each of the users' models needs for inference, per precision, on 80 GB and 141 GB GPUs:
``fitbench plan --requirements`` for Falcon-40B, Llama-2-70B, CodeLlama-70B and Falcon-180B in bf16-pure,
int8, nf4 and fp8, at one sequence and at a serving batch, as Markdown tables (docs/requirements.md); the
Falcons on each backend, transformers' build (their default) and fitbench's own decoder (``--backend
native``). Nothing runs on a GPU: these are the planner's answers.

Usage: python benchmarks/users_requirements.py [--markdown FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

MODELS = ("falcon-40b", "llama-2-70b", "codellama-70b", "falcon-180b")
NATIVE_TOO = ("falcon-40b", "falcon-180b")  # families whose default backend is transformers'
PRECISIONS = ("bf16-pure", "int8", "nf4", "fp8")
GPUS = {"H100-80GB": "80 GB (H100)", "H200": "141 GB (H200)"}
# Falcon's context is 2,048 tokens: a 1,792-token prompt and 256 new tokens fill it
SHAPE = ("--seq-len", "1792", "--new-tokens", "256")
BATCHES = (1, 16)


def requirements(gpu: str, batch: int, models: tuple[str, ...] = MODELS, backend: str = "auto") -> list[dict]:
    """``fitbench plan --requirements --json`` of ``models`` in every precision on ``gpu`` at ``batch``, on
    ``backend``'s build; a model's row is named "MODEL (native)" on the native backend."""
    command = [sys.executable, "-m", "fitbench", "plan", "--requirements", "--json", "--mode", "infer",
               "--gpu", gpu, "--batch-size", str(batch), *SHAPE, "--models", *models, "--precision", *PRECISIONS,
               "--backend", backend]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    rows = json.loads(done.stdout)
    if backend == "native":
        rows = [{**row, "model": f"{row['model']} (native)"} for row in rows]
    return rows


def table(rows: list[dict]) -> str:
    """One row per model, one column per precision: the fewest GPUs and how, the peak per GPU; where that
    peak is inside the retry margin (``*``), the fewest GPUs clear of it too."""
    cells = {(row["model"], row["precision"]): row for row in rows}
    lines = ["| model | " + " | ".join(PRECISIONS) + " |", "|---|" + "---|" * len(PRECISIONS)]
    for model in dict.fromkeys(row["model"] for row in rows):
        out = []
        for precision in PRECISIONS:
            row = cells[(model, precision)]
            if row["min_gpus"] is None:
                out.append("no layout")
                continue
            layout = row["how"].split(", ")[1]
            margin = ""
            if not row.get("clear_of_retry_margin", True):
                clear, how = row.get("min_gpus_clear_of_retry_margin"), row.get("how_clear_of_retry_margin")
                margin = " *" + (f" (clear of it: {clear}, {how.split(', ')[1]})" if clear and how else "")
            out.append(f"{row['min_gpus']}: {layout}, {row['peak_per_gpu_bytes'] / 1e9:.1f} GB{margin}")
        lines.append(f"| {model} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", help="also write the tables to this file")
    args = parser.parse_args()
    parts = []
    for gpu, name in GPUS.items():
        for batch in BATCHES:
            rows = requirements(gpu, batch) + requirements(gpu, batch, NATIVE_TOO, "native")
            parts.append(f"### {name}, batch {batch}\n\n{table(rows)}\n")
    text = "\n".join(parts)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as file:
            file.write(text)


if __name__ == "__main__":
    main()
