"""The tables a person reads after a sweep (terminal, Markdown, CSV), on committed GPU results: each
row's layout and GPU count, each GPU's peak after its index, why every row that is not ok is not,
and a folder of several sweeps as one table with a folder column."""

import re
from pathlib import Path

import pandas as pd

from conftest import cli
from fitbench.results.directories import read_sweep
from fitbench.util.units import format_bytes

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
# Llama-2-70B decoding on 4 x H100 in three layouts, one folder each; then a folder of refusals.
MODEL_PARALLEL = RESULTS / "2026-11-27-h100x4-model-parallel"
LAYOUTS = {"1": "tp x 4", "2": "pipeline x 4", "12": "tp 2 x pipeline 2"}
REFUSED = MODEL_PARALLEL / "4"
# A benchmark's folder of sweeps: infer/<two>, train/<none: no rows>, weak/<five>.
TREE = RESULTS / "2026-11-27-h100x4-large-models"


def test_three_layouts_of_one_model_are_told_apart_in_the_terminal_and_markdown(capsys):
    folders = [str(MODEL_PARALLEL / name) for name in LAYOUTS]
    code, out, err = cli(["report", *folders], capsys)
    assert code == 0, err
    tables = re.split(r"^fitbench results: ", out, flags=re.M)[1:]
    assert len(tables) == 3
    for table, layout in zip(tables, LAYOUTS.values()):
        # stacked, where the width asks, at the " x " between two degrees
        assert "4 GPUs:" in table and all(part in table for part in re.split(r"(?<= x) (?=\w+ \d)", layout))
    code, markdown, err = cli(["report", *folders, "--markdown"], capsys)
    for layout in LAYOUTS.values():
        assert f"| {layout} | 4 |" in markdown


def test_each_gpu_peak_is_labelled_with_its_index(capsys):
    row = read_sweep(MODEL_PARALLEL / "12").rows[0]
    labelled = [f"{gpu['index']}: {format_bytes(gpu['nvml_peak_used'])}" for gpu in row.memory["gpus"]]
    code, out, err = cli(["report", str(MODEL_PARALLEL / "12")], capsys)
    assert all(label in out for label in labelled)
    code, markdown, err = cli(["report", str(MODEL_PARALLEL / "12"), "--markdown"], capsys)
    assert ", ".join(labelled) in markdown


def test_every_row_that_is_not_ok_says_why_under_the_table(tmp_path, capsys):
    rows = read_sweep(REFUSED).rows
    assert {row.status for row in rows} == {"refused"}
    code, out, err = cli(["report", str(REFUSED)], capsys)
    flat = " ".join(out.split())
    code, markdown, err = cli(["report", str(REFUSED), "--markdown"], capsys)
    for row in rows:
        assert row.error.startswith("refused before launch: ") and "it fits in nf4" in row.error
        assert f"{row.label}: {row.error}" in flat  # the whole refusal, wrapped to the width
        assert f"- {row.label}: {row.error}" in markdown
    copy = tmp_path / "refused"
    copy.mkdir()
    (copy / "results.jsonl").write_bytes((REFUSED / "results.jsonl").read_bytes())
    assert cli(["report", str(copy), "--csv"], capsys)[0] == 0
    table = pd.read_csv(copy / "results.csv")
    assert list(table.columns[:3]) == ["layout", "GPUs", "reason"]
    assert list(table["reason"]) == [row.error for row in rows] and list(table["layout"]) == ["single"] * len(rows)


def test_an_out_of_memory_reason_keeps_its_first_sentences():
    from fitbench.results.report import REASON_CHARS, reason

    row = next(row for row in read_sweep(RESULTS / "2026-11-22-h100-core" / "ladder-train").rows if row.status == "oom")
    first_line = row.error.splitlines()[0]
    assert len(first_line) > REASON_CHARS
    shown = reason(row)
    assert first_line.startswith(shown) and shown.endswith(".") and len(shown) <= REASON_CHARS
    assert "Tried to allocate" in shown


def test_a_folder_of_sweeps_is_one_table_with_a_folder_column(capsys):
    code, out, err = cli(["report", str(TREE)], capsys)
    assert code == 0, err  # it was refused: no results.jsonl of its own
    assert out.count("fitbench results: ") == 2  # one table per mode, not one per folder
    for place in ("infer/falcon-180b-x4", "infer/llama-2-70b-tp4", "weak/1", "weak/ddp-2", "weak/fsdp-4"):
        assert re.search(rf"^{re.escape(place)} ", out, flags=re.M), place
    assert "infer/falcon-180b-x4: falcon-180b infer bf16-pure 1x512+32 pipeline x 4 [hf]: refused before launch" in \
        " ".join(out.split())
    code, markdown, err = cli(["report", str(TREE), "--markdown"], capsys)
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| folder | model |") and len(lines) == 1 + 8


def test_long_names_wrap_at_their_hyphens_inside_160_columns(tmp_path):
    """A hub id and a folder far wider than their share of a 160-column terminal are broken between
    their parts (after a hyphen, slash or underscore), every line of the table within the width, and
    each name read back whole from its lines."""
    import io
    import json

    from rich.console import Console
    from rich.cells import cell_len

    from fitbench.results.directories import read_sweeps
    from fitbench.results.report import results_table

    model = "some-organization/Meta-Llama-3.1-405B-Instruct-FP8-dynamic-quantized-long-variant-name"
    folder = "a-very-long-folder-name-for-a-sweep-of-pipelines-and-tensor_parallel-layouts"
    (tmp_path / folder).mkdir()
    lines = [json.loads(line) for line in (MODEL_PARALLEL / "1" / "results.jsonl").read_text().splitlines()]
    for line in lines:
        line["spec"]["model"] = model
    lines[-1].update(status="oom", error="out of memory: " + "needs 130.8 GB on one GPU of 85.0 GB; " * 6)
    (tmp_path / folder / "results.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    [group] = read_sweeps([str(tmp_path)], "report").given()
    console = Console(width=160, file=io.StringIO(), color_system=None)
    console.print(results_table(group[0].rows, folder=lambda row: group[0].place, gpu_hour_price=2.5))
    text = console.file.getvalue()
    assert max(cell_len(line) for line in text.splitlines()) <= 160, text
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("folder"))
    starts = [word.start() for word in re.finditer(r"\S+", header)]
    columns = [header.index("model"), starts[starts.index(header.index("model")) + 1]]
    first_row = lines[lines.index(header) + 2:]
    first_row = first_row[:first_row.index(next(line for line in first_row if not line.strip()))]
    folder_parts = [line[:columns[0]].strip() for line in first_row if line[:columns[0]].strip()]
    model_parts = [line[columns[0]:columns[1]].strip() for line in first_row if line[columns[0]:columns[1]].strip()]
    assert "".join(folder_parts) == folder and "".join(model_parts) == model, text
    assert len(folder_parts) > 1 and all(part.endswith(("-", "_", "/")) for part in folder_parts[:-1])
    assert len(model_parts) > 1 and all(part.endswith(("-", "_", "/")) for part in model_parts[:-1])
    reason = lines[lines.index("not ok:") + 1:]
    assert len(reason) > 2 and all(line.startswith("  ") for line in reason)  # its wrapped lines indented too
