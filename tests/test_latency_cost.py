"""Latency percentiles, energy per token and the cost of a million tokens, each recomputed by hand from
the row's own fields, and shown in the terminal table, Markdown, the HTML page and the workbook."""

import json
from pathlib import Path

import numpy as np
import openpyxl
import pytest

from conftest import cli
from fitbench.results.directories import read_sweep
from fitbench.results.report import cost_per_million_tokens, energy_per_token, latency_percentiles

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
TP_PP = RESULTS / "2026-11-27-h100x4-model-parallel" / "12"  # Llama-2-70B decoding on 4 x H100
PRICE = 2.5  # dollars per GPU-hour


def test_percentiles_are_those_of_the_raw_samples():
    for row in read_sweep(TP_PP).rows:
        found = latency_percentiles(row)
        for kind, name in (("ttft", "time_to_first_token"), ("token", "token_latency")):
            samples = row.timing["samples"][name]
            assert [found[kind][p] for p in (50, 90, 99)] == pytest.approx(np.percentile(samples, [50, 90, 99]))
        assert found["token"][50] == pytest.approx(row.timing["token_latency"]["median"])


def test_the_cost_of_a_million_tokens_by_hand():
    row = read_sweep(TP_PP).rows[0]
    rate = row.throughput["decode_tokens_per_s"]
    assert cost_per_million_tokens(row, PRICE) == pytest.approx(PRICE * 4 / 3600 / rate * 1e6)
    assert cost_per_million_tokens(row, None) is None


def test_energy_per_token_is_the_monitor_s(tmp_path, capsys):
    """No committed row measured its window's tokens; one that did shows the monitor's joules per token."""
    line = json.loads((TP_PP / "results.jsonl").read_text().splitlines()[0])
    line["gpu_monitor"].update(tokens=4 * 32, energy_per_token_j=line["gpu_monitor"]["energy_j"] / (4 * 32))
    (tmp_path / "results.jsonl").write_text(json.dumps(line) + "\n")
    row = read_sweep(tmp_path).rows[0]
    assert energy_per_token(row) == pytest.approx(line["gpu_monitor"]["energy_j"] / 128)
    code, markdown, err = cli(["report", str(tmp_path), "--markdown"], capsys)
    assert f"| {energy_per_token(row):.3g} J |" in markdown


def test_every_table_and_document_shows_them(tmp_path, capsys):
    rows = read_sweep(TP_PP).rows
    cost = f"${cost_per_million_tokens(rows[0], PRICE):,.2f}"
    code, out, err = cli(["report", str(TP_PP), "--gpu-hour-price", str(PRICE)], capsys)
    assert code == 0 and cost in out and "$ per M" in out
    code, markdown, err = cli(["report", str(TP_PP), "--gpu-hour-price", "$2.50", "--markdown"], capsys)
    assert "TTFT p50 / p90 / p99" in markdown and "$ per M tokens at $2.5/GPU-hour" in markdown and cost in markdown
    code, out, err = cli(["report", str(TP_PP), "--gpu-hour-price", "2.5", "--html", str(tmp_path / "r.html"),
                          "--xlsx", str(tmp_path / "r.xlsx")], capsys)
    assert code == 0, err
    page = (tmp_path / "r.html").read_text()
    assert "per-token latency p99 (ms)" in page and "cost per million tokens ($)" in page
    sheet = openpyxl.load_workbook(tmp_path / "r.xlsx")["infer"]
    header = [cell.value for cell in sheet[1]]
    values = dict(zip(header, next(sheet.iter_rows(min_row=2, values_only=True))))
    assert values["cost per million tokens ($)"] == pytest.approx(cost_per_million_tokens(rows[0], PRICE))
    assert values["time to first token p90 (ms)"] == pytest.approx(
        1e3 * np.percentile(rows[0].timing["samples"]["time_to_first_token"], 90))
    assert cli(["report", str(TP_PP), "--gpu-hour-price", "cheap"], capsys)[0] == 2
