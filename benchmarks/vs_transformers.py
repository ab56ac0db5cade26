"""The side-by-side table of ``benchmarks/vs_transformers.sh``: fitbench's native backend against
transformers on the same shapes, from the rows of one run.

Training: the median step of ``fitbench run --backend native`` and ``--backend hf`` at the same
model, precision and shape; ratio = hf step / native step (above 1: fitbench is faster). Decode:
decode tokens/s of native (CUDA graph of its step), hf eager, and transformers with its static cache
and compiled forward (``benchmarks/hf_static_decode.py``); ratio = native / the other.

Usage: python benchmarks/vs_transformers.py OUT   (writes OUT/summary.md and prints it)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _rows(*paths: Path) -> list[dict]:
    return [json.loads(line) for path in paths if path.is_file()
            for line in path.read_text().splitlines() if line.strip()]


def _sweeps(folder: Path) -> list[dict]:
    """The rows of every sweep under ``folder`` (one per model and backend)."""
    return _rows(*sorted(folder.glob("*/results.jsonl")))


def _shape(row: dict) -> str:
    spec = row["spec"]
    return f"{spec['model']} {spec['mode']} {spec['precision']} {spec['batch_size']}x{spec['seq_len']}"


def _ratio(numerator: float | None, denominator: float | None) -> str:
    return f"{numerator / denominator:.2f}x" if numerator and denominator else "-"


def training_lines(rows: list[dict]) -> list[str]:
    steps: dict[str, dict[str, float | None]] = {}
    for row in rows:
        step = row["timing"]["step"]["median"] if row.get("status") == "ok" else 0.0
        steps.setdefault(_shape(row), {})[row["spec"]["backend"]] = step
    lines = ["| training (eager) | transformers step | fitbench native step | fitbench speed-up |", "|---|---|---|---|"]
    for shape, by_backend in steps.items():
        hf, native = by_backend.get("hf"), by_backend.get("native")
        shown = ["-" if s is None else f"{s * 1e3:.1f} ms" if s else "failed" for s in (hf, native)]
        lines.append(f"| {shape} | {shown[0]} | {shown[1]} | {_ratio(hf, native)} |")
    return lines


def decode_lines(rows: list[dict], static: list[dict]) -> list[str]:
    lines = ["| decode | fitbench native tok/s | transformers eager tok/s | native / eager | transformers static "
             "+ compile tok/s | native / static |", "|---|---|---|---|---|---|"]
    shapes: dict[str, dict[str, float | None]] = {}
    for row in rows:
        rate = row["throughput"]["decode_tokens_per_s"] if row.get("status") == "ok" else 0.0
        spec = row["spec"]
        key = f"{spec['model']} batch {spec['batch_size']}, {spec['seq_len']}+{spec['new_tokens']}"
        shapes.setdefault(key, {})[spec["backend"]] = rate
    for entry in static:
        key = f"{entry['model']} batch {entry['batch_size']}, {entry['seq_len']}+{entry['new_tokens']}"
        compiled = "" if entry["compiled"] else " (not compiled: " + entry["reason"] + ")"
        shapes.setdefault(key, {})["static"] = entry["decode_tokens_per_s"]
        shapes[key]["static_note"] = compiled
    for key, rates in shapes.items():
        native, hf, static = rates.get("native"), rates.get("hf"), rates.get("static")
        shown = ["-" if r is None else f"{r:.1f}" if r else "failed" for r in (native, hf, static)]
        lines.append(f"| {key} | {shown[0]} | {shown[1]} | {_ratio(native, hf)} | {shown[2]}{rates.get('static_note', '')}"
                     f" | {_ratio(native, static)} |")
    return lines


def summary(out: Path) -> str:
    train, decode = _sweeps(out / "train"), _sweeps(out / "decode")
    device = next((row.get("device_name") for row in train + decode), None)
    parts = [f"# fitbench native against transformers ({device or 'no rows'})", "",
             *training_lines(train), "", *decode_lines(decode, _rows(out / "hf-static.jsonl"))]
    return "\n".join(parts) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python benchmarks/vs_transformers.py OUT", file=sys.stderr)
        return 2
    out = Path(argv[0])
    text = summary(out)
    (out / "summary.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
