"""The speed forecast's error out of sample: its constants refitted without the rows of one GPU (or one
result folder) at a time, and the error measured on the rows left out, beside the in-sample error.

Each constant of the forecast is the value at which one committed row's forecast equals its measured step
(``forecast_constants.SOURCES``). Held out: every row of one GPU model (``--by gpu``: the H100 rows, then
the H200 rows) or of one top-level folder of benchmarks/results (``--by folder``). A constant whose source
row is held out is solved again from each row not held out that ran as the source did (``ALIKE``: mode,
precision, backend, layout, compile and decode switches, whatever the model and batch) and has the source's
fields, where the constant can bring that row's forecast to its measured step, and takes their median;
where no such row exists it keeps its value and is named (it stays in sample). Then every held-out row is forecast with the refitted
constants. Rows are those ``speed_error.py`` counts (the same exclusions).

Error = (forecast - measured) / measured, as in ``speed_error.py``.

Usage: python benchmarks/out_of_sample.py [RESULTS_DIR] [--by gpu|folder] [--min-gpus N] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import forecast_constants as constants
import speed_error

from fitbench.results.store import ResultStore
from fitbench.spec import RunSpec


def group_of(row: dict, sweep: Path, root: Path, by: str) -> str:
    """The held-out group of a row: its GPU's name, or the top-level folder of ``root`` holding it."""
    if by == "gpu":
        return row["environment"]["gpus"][0]["name"]
    return sweep.relative_to(root).parts[0] if sweep != root else "."


def counted_rows(root: Path, min_gpus: int) -> list[tuple[dict, Path]]:
    """The rows ``speed_error.py`` counts: measured, ok, a speed of their configuration."""
    rows = []
    for sweep in sorted({path.parent for path in root.rglob("results.jsonl")}, key=str):
        for row in ResultStore(sweep).rows():
            if RunSpec.model_validate(row["spec"]).layout.world_size < min_gpus:
                continue
            if speed_error.row_error(row) is None or speed_error.not_a_speed(row, sweep):
                continue
            rows.append((row, sweep))
    return rows


def source_rows(root: Path) -> list[tuple[tuple, dict, Path]]:
    """Each constant's source row with its sweep directory: (source entry, row, sweep)."""
    found = []
    for entry in constants.SOURCES:
        directory, fields = entry[3]
        for sweep in sorted({path.parent for path in (root / directory).rglob("results.jsonl")}, key=str):
            row = next(constants.rows_under(sweep, **fields), None)
            if row is not None:
                found.append((entry, row, sweep))
                break
    return found


# What a row shares with a constant's source row to be solved for it too: how it ran, whatever its model,
# batch and sequence (the constants are meant to hold across them); a generation's decoding switches too
ALIKE = ("mode", "precision", "backend", "layout", "compile", "layer_offload", "fsdp_offload",
         "activation_checkpointing")
ALIKE_DECODING = ("cuda_graphs", "compile_decode")
# The source's fields that pick its row within its folder rather than say how it ran
PICKS_A_ROW = ("model", "batch_size", "seq_len", "new_tokens")


def alike(row: dict, source: dict) -> bool:
    """Whether ``row`` ran as the constant's ``source`` row did (``ALIKE``, read through ``RunSpec`` so that
    older rows' defaults compare as what they mean)."""
    spec, of = RunSpec.model_validate(row["spec"]), RunSpec.model_validate(source["spec"])
    keys = ALIKE + (ALIKE_DECODING if of.mode == "infer" else ())
    return all(getattr(spec, key) == getattr(of, key) for key in keys)


def refit(entry: tuple, source: dict, held_out: str, root: Path, by: str) -> tuple[float | None, int]:
    """The constant of ``entry`` solved from the rows outside ``held_out`` that ran as its ``source`` row
    did and have its fields, where the constant moves the row's forecast across its measured step (a
    root in the constant's range): their median and how many there were (None, 0 where none)."""
    name, key, field, (_, fields), low, high = entry
    fields = {key: value for key, value in fields.items() if key not in PICKS_A_ROW}
    set_value = constants.setter(name, key, field)
    values = []
    for sweep in sorted({path.parent for path in root.rglob("results.jsonl")}, key=str):
        for row in constants.rows_under(sweep, **fields):
            if group_of(row, sweep, root, by) == held_out or not alike(row, source) \
                    or speed_error.row_error(row) is None or speed_error.not_a_speed(row, sweep):
                continue
            state = constants.saved()
            try:
                ends = []
                for value in (low, high):
                    set_value(value)
                    measured, forecast = speed_error.row_error(row)
                    ends.append(forecast - measured)
                if ends[0] * ends[1] < 0:
                    values.append(constants.solve(set_value, row, low, high, speed_error.row_error))
            finally:
                constants.restore(state)
    return (statistics.median(values), len(values)) if values else (None, 0)


def errors(rows: list[tuple[dict, Path]]) -> list[float]:
    out = []
    for row, _ in rows:
        measured, forecast = speed_error.row_error(row)
        out.append((forecast - measured) / measured)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", nargs="?", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--by", choices=("gpu", "folder"), default="gpu", help="what is held out at a time")
    parser.add_argument("--min-gpus", type=int, default=1, metavar="N", help="only rows of at least N GPUs")
    parser.add_argument("--markdown", type=Path, help="also write the tables to this file")
    args = parser.parse_args()
    root = args.directory
    rows = counted_rows(root, args.min_gpus)
    sources = source_rows(root)
    groups = sorted({group_of(row, sweep, root, args.by) for row, sweep in rows})
    lines = [f"Held out by {args.by}: constants refitted without the held-out rows, error on those rows.", "",
             "| held out | rows | in sample | out of sample | constants refitted | kept (no other row) |",
             "|---|---|---|---|---|---|"]
    every_in, every_out = [], []
    for group in groups:
        held = [(row, sweep) for row, sweep in rows if group_of(row, sweep, root, args.by) == group]
        inside = errors(held)
        refitted, kept = [], []
        state = constants.saved()
        try:
            for entry, row, sweep in sources:
                if group_of(row, sweep, root, args.by) != group:
                    continue
                name, key, field = entry[:3]
                label = name + ("" if key is None else f"[{key}]") + ("" if field is None else f".{field}")
                value, count = refit(entry, row, group, root, args.by)
                if value is None:
                    kept.append(label)
                    continue
                constants.setter(name, key, field)(value)
                refitted.append(f"{label} {constants.value_of(name, key, field):.3g} from {count}")
            outside = errors(held)
        finally:
            constants.restore(state)
        every_in += inside
        every_out += outside
        lines.append(f"| {group} | {len(held)} | {speed_error.summary(inside)} | {speed_error.summary(outside)} | "
                     f"{'; '.join(refitted) or '-'} | {', '.join(kept) or '-'} |")
    lines += ["", f"- all held-out rows, in sample: {speed_error.summary(every_in)}",
              f"- all held-out rows, out of sample: {speed_error.summary(every_out)}"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
