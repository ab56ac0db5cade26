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


def test_run_and_its_yaml_file_price_the_rows_and_report_keeps_the_price(tmp_path, capsys):
    """`fitbench run --gpu-hour-price` (or the file's gpu_hour_price) prices its table and results.csv, and
    saves the price with the sweep, so that `fitbench report`'s page and workbook show the same cost; each
    cost recomputed by hand from the row's decode tokens/s and its one CPU process."""
    import csv

    out = tmp_path / "priced"
    config = tmp_path / "sweep.yaml"
    config.write_text(f"models: [tiny]\nmode: infer\ngpu_hour_price: {PRICE}\n")
    code, stdout, err = cli(["run", "--config", str(config), "--device", "cpu", "--batch-size", "1", "--seq-len", "8",
                             "--new-tokens", "4", "--warmup-steps", "0", "--measure-steps", "2", "--out", str(out)],
                            capsys)
    assert code == 0, err
    [row] = read_sweep(out).rows
    by_hand = PRICE * 1 / 3600 / row.throughput["decode_tokens_per_s"] * 1e6
    assert cost_per_million_tokens(row, PRICE) == pytest.approx(by_hand)
    assert f"${by_hand:,.2f}" in stdout and "$ per M" in stdout
    [line] = csv.DictReader((out / "results.csv").open())
    assert float(line[f"cost_per_million_tokens_usd_at_{PRICE:g}_per_gpu_hour"]) == pytest.approx(by_hand)
    code, out_text, err = cli(["report", str(out), "--xlsx", str(tmp_path / "r.xlsx"), "--html",
                               str(tmp_path / "r.html")], capsys)
    assert code == 0 and f"${by_hand:,.2f}" in out_text, err
    assert "cost per million tokens ($)" in (tmp_path / "r.html").read_text()
    sheet = openpyxl.load_workbook(tmp_path / "r.xlsx")["infer"]
    header = [cell.value for cell in sheet[1]]
    column = next(i for i, name in enumerate(header) if name and "cost" in name)
    assert sheet.cell(2, column + 1).value == pytest.approx(by_hand)
    code, again, err = cli(["report", str(out), "--gpu-hour-price", "5"], capsys)
    assert f"${2 * by_hand:,.2f}" in again  # given, the price of the report wins
    code, _, err = cli(["run", "--resume", str(out), "--gpu-hour-price", "5"], capsys)
    assert code == 0, err  # a price changes no measurement: a resume may give another


def test_a_price_that_is_not_a_number_is_refused(tmp_path, capsys):
    config = tmp_path / "sweep.yaml"
    config.write_text("models: [tiny]\ngpu_hour_price: '2.49 dollars'\n")
    code, _, err = cli(["run", "--config", str(config), "--device", "cpu", "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "gpu_hour_price" in err and "price in dollars" in err, err
    code, _, err = cli(["run", "--models", "tiny", "--gpu-hour-price", "-1", "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "--gpu-hour-price" in err and "non-negative" in err, err
