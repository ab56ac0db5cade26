"""A report over several sweep directories (``fitbench report DIR [DIR ...]``, ``fitbench.results.directories.Sweeps``):
each row keeps its directory (its provenance, its NVML timeline, its name in the table), a
configuration found in two directories is kept twice and labelled, rows of two kinds of GPU never
share a scaling line, and bad input among the directories is one paragraph. The page of several
directories in Chromium is tested in ``test_documents.py``."""

import json
import re
import shutil

import openpyxl
import pytest

from conftest import cli
from fitbench.report.excel import write_xlsx
from fitbench.report.figures import device, layouts_figure, scaling_figure
from fitbench.results.directories import read_sweep, read_sweeps
from fitbench.results.report import headline
from test_documents import GPU_SWEEP, ONE_TO_FOUR, RESULTS, TWO_H200, _one_paragraph

TP4 = RESULTS / "2026-11-27-h100x4-replicas" / "1b-tp4"
H100_ONE, H100_DDP2, H100_DDP4 = (ONE_TO_FOUR / "weak" / name for name in ("1", "ddp-2", "ddp-4"))
H200_ONE, H200_DDP2 = TWO_H200 / "weak-1", TWO_H200 / "weak-ddp"
WEAK = [H100_ONE, H100_DDP2, H100_DDP4, H200_ONE, H200_DDP2]


def test_each_row_is_read_with_its_own_directory():
    sweeps = read_sweeps([TP4, GPU_SWEEP])
    assert sweeps.names == ["1b-tp4", "default"] and sweeps.several
    assert [sweeps.name(row) for row in sweeps.rows] == ["1b-tp4"] + ["default"] * 4
    for row in sweeps.rows:
        directory = TP4 if sweeps.name(row) == "1b-tp4" else GPU_SWEEP
        assert sweeps.timeline(row).is_relative_to(directory)  # not the first directory's
    first = read_sweep(TP4)
    assert all(first.timeline(row) is None for row in read_sweep(GPU_SWEEP).rows)
    assert not sweeps.repeated and sweeps.warnings == []


def test_a_configuration_in_two_directories_is_kept_in_both_and_labelled(tmp_path):
    sweeps = read_sweeps([H100_ONE, H200_ONE])
    h100, h200 = sweeps.rows
    assert h100.key == h200.key and sweeps.repeated == {h100.key: ["1", "weak-1"]}
    assert (sweeps.label(h100), sweeps.label(h200)) == (f"{h100.label} [1]", f"{h200.label} [weak-1]")
    assert sweeps.warnings == [f"'{h100.label}' is in 2 directories (1, weak-1); each row is kept, labelled by its "
                               f"directory"]
    book = openpyxl.load_workbook(write_xlsx(read_sweeps([H100_ONE, H200_ONE]), tmp_path / "two.xlsx"))
    lines = list(book["train"].iter_rows(values_only=True))
    assert lines[0][:2] == ("directory", "configuration") and [line[:2] for line in lines[1:]] == [
        ("1", h100.label), ("weak-1", h200.label)]
    key = lines[0].index("key")
    assert [line[key] for line in lines[1:]] == [h100.key, h200.key]
    samples = list(book["samples"].iter_rows(min_row=2, values_only=True))
    assert {line[0] for line in samples} == {"1", "weak-1"}
    assert len(samples) == sum(len(values) for row in sweeps.rows for values in row.timing["samples"].values())
    assert [line[:2] for line in book["provenance"].iter_rows(values_only=True)][:2] == [("directory", "what"),
                                                                                        ("1", "devices")]
    assert "is in 2 directories" in next(book["warnings"].iter_rows(min_row=2, values_only=True))[0]


def test_scaling_lines_are_per_device_and_strategy():
    sweeps = read_sweeps(WEAK)
    lines = {trace.name: trace for trace in scaling_figure(sweeps).data}
    assert sorted(lines) == ["H100 80GB HBM3: 1B train bf16 8x2048 [native]: ddp",
                             "H200: 1B train bf16 8x2048 [native]: ddp"]
    h100 = lines["H100 80GB HBM3: 1B train bf16 8x2048 [native]: ddp"]
    rows = [read_sweep(directory).rows[0] for directory in (H100_ONE, H100_DDP2, H100_DDP4)]
    assert list(h100.x) == [1, 2, 4]
    assert list(h100.y) == pytest.approx([headline(row)["tokens_per_s"] / gpus for row, gpus in zip(rows, (1, 2, 4))])
    assert list(lines["H200: 1B train bf16 8x2048 [native]: ddp"].x) == [1, 2]
    assert {device(row) for row in sweeps.rows} == {"H100 80GB HBM3", "H200"}


def test_layouts_are_compared_per_configuration_and_device():
    bars = layouts_figure(read_sweeps(WEAK)).data
    assert [bar.name for bar in bars] == ["H100 80GB HBM3: 1B train bf16 8x2048 [native]",
                                          "H200: 1B train bf16 8x2048 [native]"]
    assert list(bars[0].y[1]) == ["one device [1]", "ddp x 2 [ddp-2]", "ddp x 4 [ddp-4]"]
    assert max(bars[0].x) == 100 and bars[0].x[0] == pytest.approx(100 / 3.79, rel=0.01)  # 63,388 of 240,285
    assert bars[0].text[2] == "240,285 tokens/s, 60,071 per GPU"
    assert layouts_figure(read_sweeps(GPU_SWEEP)) is None  # one layout per configuration: nothing to compare


def test_the_command_shows_each_directory_and_writes_one_page(tmp_path, capsys):
    code, out, err = cli(["report", str(H100_ONE), str(H200_ONE)], capsys)
    assert code == 0 and f"fitbench results: {H100_ONE}" in out and f"fitbench results: {H200_ONE}" in out
    code, out, err = cli(["report", str(H100_ONE), str(H200_ONE), "--markdown"], capsys)
    assert code == 0 and out.count("## ") == 2 and out.count("Command: ") == 2 and "NVIDIA H200" in out
    code, out, err = cli(["report", str(H100_ONE), str(H200_ONE), "--html", str(tmp_path / "two.html"), "--quiet"],
                         capsys)
    page = (tmp_path / "two.html").read_text()
    assert code == 0 and page.count("<details>") == 2 and "is in 2 directories (1, weak-1)" in page
    assert "fitbench report: 1, weak-1" in page and "<th class=\"text\">directory</th>" in page


def test_bad_input_among_several_directories_is_one_paragraph(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    page = tmp_path / "page.html"
    _one_paragraph(*cli(["report", str(H100_ONE), str(tmp_path / "empty"), "--html", str(page)], capsys)[::2])
    _one_paragraph(*cli(["report", str(H100_ONE), f"{H100_ONE}/../1", "--html", str(page)], capsys)[::2])
    assert not page.exists()
    code, out, err = cli(["report", str(H100_ONE), str(tmp_path / "empty")], capsys)
    assert "given twice" not in err and "has no results.jsonl" in err


def test_damaged_rows_of_one_directory_are_warned_about_by_its_name(tmp_path, capsys):
    damaged = tmp_path / "damaged"
    shutil.copytree(H200_ONE, damaged)
    row = json.loads((damaged / "results.jsonl").read_text())
    (damaged / "results.jsonl").write_text(json.dumps(row) + "\n{not json\n")
    code, out, err = cli(["report", str(H100_ONE), str(damaged), "--html", str(tmp_path / "d.html")], capsys)
    assert code == 0 and f"{damaged / 'results.jsonl'}: line 2 is not valid JSON" in err
    page = (tmp_path / "d.html").read_text()
    assert "line 2 is not valid JSON" in page and "is in 2 directories (1, damaged)" in page


def test_the_results_page_names_every_option_of_report(capsys):
    code, out, err = cli(["report", "--help"], capsys)
    options = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", out)) - {"--help", "--out"}
    assert code == 0 and {"--html", "--xlsx", "--ollama-timeout", "--quiet"} <= options
    page = (RESULTS.parents[1] / "docs" / "results.md").read_text()
    assert "fitbench report DIR [DIR ...]" in page and "DIR [DIR ...]" in out
    assert [option for option in sorted(options) if f"`{option}" not in page and f" {option}" not in page] == []
