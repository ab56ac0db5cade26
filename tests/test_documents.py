"""The documents made from rows (``fitbench.report``): the HTML page of one sweep and of several
loaded in headless Chromium, the Excel workbook read back with openpyxl, ``compare`` and its gate,
and bad input to each."""

import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import openpyxl
import pytest

from conftest import cli
from fitbench.report.compare import bootstrap_interval, compare_sweeps, parse_fail_on
from fitbench.report.excel import sample_rows, write_xlsx
from fitbench.report.figures import FIGURES
from fitbench.results.directories import read_sweep, read_sweeps
from fitbench.util.stats import quantile

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
GPU_SWEEP = RESULTS / "2026-11-27-h100x4-replicas" / "default"  # 4 x H100: train and decode, NVML timelines
# A report over committed GPU sweeps split across folders: 1B training over 1, 2 and 4 H100s and
# 13B decode over 1, 2 and 4 (one folder per run), the same 1B training over 1 and 2 H200s (whose
# keys repeat the H100 ones), the 4-GPU default job, and a row that fell back (its ladder).
ONE_TO_FOUR = RESULTS / "2026-11-27-h100x4-vs-one-gpu"
TWO_H200 = RESULTS / "2026-11-24-h200x2-data-parallel"
SEVERAL = [ONE_TO_FOUR / "weak" / name for name in ("1", "ddp-2", "ddp-4", "fsdp-2", "fsdp-4")] + [
    ONE_TO_FOUR / "decode" / name for name in ("1", "tp-2", "tp-4")] + [
    TWO_H200 / name for name in ("weak-1", "weak-ddp", "weak-fsdp")] + [
    GPU_SWEEP, RESULTS / "2026-11-22-h100-offload"]
SAME_TWICE = [(RESULTS / "2026-11-24-h200x2-data-parallel" / name, RESULTS / "2026-11-24-h200x2-data-parallel"
               / "planner-after" / name) for name in ("8b-fsdp", "20b-fsdp", "30b-planned")]

# Run first in the page: it records every error and console.error, and once the page has loaded and
# plotly has drawn, writes what it saw of each plot into the page, which --dump-dom prints.
PROBE = """<script>
window.probeErrors = [];
window.addEventListener("error", function (e) { probeErrors.push("error: " + e.message); });
window.addEventListener("unhandledrejection", function (e) { probeErrors.push("rejection: " + e.reason); });
(function () { var original = console.error; console.error = function () {
  probeErrors.push("console.error: " + Array.prototype.join.call(arguments, " ")); original.apply(console, arguments);
}; })();
window.addEventListener("load", function () { setTimeout(function () {
  var plots = Array.prototype.map.call(document.querySelectorAll(".js-plotly-plot"), function (plot) {
    var box = plot.getBoundingClientRect();
    return {id: plot.id, traces: plot.querySelectorAll(".scatterlayer .trace, .barlayer .trace").length,
            marks: plot.querySelectorAll(".scatterlayer path, .scatterlayer .point, .barlayer path").length,
            width: box.width, height: box.height};
  });
  var out = document.createElement("pre"); out.id = "probe";
  out.textContent = JSON.stringify({errors: probeErrors, plots: plots, rows: document.querySelectorAll("#rows tbody tr").length});
  document.body.appendChild(out);
}, 1000); });
</script>"""


def chromium() -> str:
    found = shutil.which("chromium")
    if not found:
        pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)")
    return found


def browse(page: Path, tmp_path: Path) -> dict:
    """What the probe saw of ``page`` in headless Chromium, and a screenshot of it beside the copy."""
    probed = tmp_path / f"probed-{page.name}"
    probed.write_text(page.read_text().replace("<head>", "<head>" + PROBE, 1))
    flags = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--virtual-time-budget=20000", "--window-size=1400,4000"]
    done = subprocess.run(flags + ["--dump-dom", probed.as_uri()], capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="probe">(.*?)</pre>', done.stdout, re.S)
    assert found, done.stderr[-2000:]
    screenshot = tmp_path / f"{page.stem}.png"
    subprocess.run(flags + [f"--screenshot={screenshot}", page.as_uri()], capture_output=True, timeout=120, check=True)
    assert screenshot.stat().st_size > 10_000
    return json.loads(html.unescape(found.group(1)))


def check_page(directories: Path | list[Path], page: Path, tmp_path: Path) -> dict:
    sweeps = read_sweeps(directories)
    seen = browse(page, tmp_path)
    assert seen["errors"] == []
    assert seen["rows"] == len(sweeps.rows)
    expected = {f"plot-{plot.name}" for plot in FIGURES if plot.make(sweeps) is not None}
    assert {plot["id"] for plot in seen["plots"]} == expected
    for plot in seen["plots"]:
        assert plot["traces"] > 0 and plot["marks"] > 0 and plot["width"] > 300 and plot["height"] > 200, plot
    return {plot["id"] for plot in seen["plots"]}


@pytest.mark.slow
def test_the_report_of_gpu_sweeps_in_several_folders_loads_in_chromium_with_every_plot_drawn(tmp_path, capsys):
    code, out, err = cli(["report", *map(str, SEVERAL), "--html", str(tmp_path / "gpu.html"), "--quiet"], capsys)
    assert code == 0, err
    text = (tmp_path / "gpu.html").read_text()
    assert "<script src=" not in text and "<link " not in text  # nothing fetched when viewed
    assert "4 x NVIDIA H100 80GB HBM3" in text and "fitbench run --gpus 4" in text  # provenance
    assert text.count("<details>") == len(SEVERAL)  # one provenance per directory
    plots = check_page(SEVERAL, tmp_path / "gpu.html", tmp_path)
    # each plot with data; the decode rows all ran at batch 1, and a plot of one x value is left out; the sweeps
    # hold no serving benchmark (tests/test_serve_bench.py has one)
    assert plots == {f"plot-{plot.name}" for plot in FIGURES} - {"plot-decode", "plot-serving"}


@pytest.mark.slow
def test_the_report_of_a_cpu_sweep_loads_in_chromium(tiny_sweep, tmp_path, capsys):
    code, out, err = cli(["report", str(tiny_sweep.out), "--html", str(tmp_path / "cpu.html")], capsys)
    assert code == 0, err
    check_page(tiny_sweep.out, tmp_path / "cpu.html", tmp_path)


def test_the_workbook_holds_every_row_and_every_sample(tmp_path):
    sweep = read_sweeps(GPU_SWEEP)
    book = openpyxl.load_workbook(write_xlsx(sweep, tmp_path / "gpu.xlsx"))
    assert book.sheetnames == ["provenance", "train", "infer", "samples"]
    keys = []
    for mode in ("train", "infer"):
        sheet = book[mode]
        header = [cell.value for cell in sheet[1]]
        # the header and the configuration column stay in view; a filter on every column; formats and colours
        assert sheet.freeze_panes == "B2" and sheet.auto_filter.ref == sheet.dimensions
        first = {header_cell.value: cell for header_cell, cell in zip(sheet[1], sheet[2])}
        assert first["tokens/s"].number_format == "#,##0" and first["CV (%)"].number_format == "0.0"
        assert first["status"].fill.fgColor.rgb.endswith("C6EFCE" if first["status"].value == "ok" else "FFC7CE")
        assert {"tokens/s", "MFU (%; prefill in infer)", "quantization method", "quantization library", "weights vs bf16 (ratio)",
                "top-1 agreement with bf16 (%)"} <= set(header)
        for line in sheet.iter_rows(min_row=2, values_only=True):
            values = dict(zip(header, line))
            row = next(row for row in sweep.rows if row.key == values["key"])
            keys.append(values["key"])
            assert values["mode"] == mode and values["tokens/s"] == pytest.approx(
                row.throughput["tokens_per_s" if mode == "train" else "decode_tokens_per_s"])
            assert isinstance(values["parameters"], int) and isinstance(values["median time (ms, per step or "
                                                                               "decoded token)"], float)
    assert sorted(keys) == sorted(row.key for row in sweep.rows)
    samples = [list(line) for line in book["samples"].iter_rows(min_row=2, values_only=True)]
    expected = sample_rows(sweep)
    assert [line[:4] for line in samples] == [line[:4] for line in expected]
    # Excel keeps 15 significant digits of a number (openpyxl writes them so)
    assert [line[4] for line in samples] == pytest.approx([line[4] for line in expected], rel=1e-14)
    assert len(samples) == sum(len(values) for row in sweep.rows for values in row.timing["samples"].values())


def test_the_bootstrap_interval_recomputed_by_hand():
    """Two resamples of three: each draws A's indices then B's, as ``bootstrap_interval`` does in one chunk."""
    import numpy as np

    a, b = [1.0, 2.0, 3.0], [2.0, 3.0, 4.0]
    generator = np.random.default_rng(0)
    picks_a = generator.integers(0, 3, size=(50, 3)).tolist()
    picks_b = generator.integers(0, 3, size=(50, 3)).tolist()
    changes = sorted(100 * (sum(b[i] for i in pb) / 3) / (sum(a[i] for i in pa) / 3) - 100
                     for pa, pb in zip(picks_a, picks_b))
    assert bootstrap_interval(a, b, resamples=50) == pytest.approx(
        (quantile(tuple(changes), 0.025), quantile(tuple(changes), 0.975)))


def _slowed(source: Path, target: Path, factor: float) -> Path:
    """A copy of the sweep in ``source`` whose every raw time sample and time statistic is ``factor`` x."""
    target.mkdir(parents=True)
    lines = []
    for line in (source / "results.jsonl").read_text().splitlines():
        row = json.loads(line)
        timing = row.get("timing") or {}
        for name, values in (timing.get("samples") or {}).items():
            timing["samples"][name] = [value * factor for value in values]
        for name in ("step", "token_latency"):
            for figure in ("mean", "median"):
                if figure in (timing.get(name) or {}):
                    timing[name][figure] *= factor
        lines.append(json.dumps(row))
    (target / "results.jsonl").write_text("\n".join(lines) + "\n")
    return target


def test_an_injected_ten_percent_slowdown_fails_the_gate(tmp_path, capsys):
    a = SAME_TWICE[0][0]
    b = _slowed(a, tmp_path / "slower", 1.10)
    code, out, err = cli(["compare", str(a), str(b), "--fail-on", "mean:5%"], capsys)
    assert code == 1, err
    assert "+10.0%" in out and "slower" in out and "beyond mean:5%" in out and "failed by" in out
    comparison = compare_sweeps(a, b, fail_on="mean:5%")
    time, rate, memory = comparison.rows[0].changes
    assert time.ratio().startswith("1.100 [")
    row = read_sweep(a).rows[0]
    samples = row.timing["samples"]["step"]
    assert time.before == pytest.approx(sum(samples) / len(samples)) and time.percent == pytest.approx(10.0)
    assert time.low_percent > 5  # the whole interval is slower
    assert rate.low_percent == pytest.approx(100 * (1 / (1 + time.high_percent / 100) - 1))
    assert memory.percent == 0 and memory.verdict == "unchanged"
    # the same change without a gate, or a gate it does not cross, passes
    assert cli(["compare", str(a), str(b)], capsys)[0] == 0
    assert cli(["compare", str(a), str(b), "--fail-on", "mean:15%"], capsys)[0] == 0


def test_two_runs_of_the_same_configuration_pass_the_gate(tmp_path, capsys):
    for a, b in SAME_TWICE:
        code, out, err = cli(["compare", str(a), str(b), "--fail-on", "mean:5%", "--html", str(tmp_path / "c.html")],
                             capsys)
        assert code == 0, out + err
        assert "Gate mean:5%: passed" in out
    assert "Changes, B against A" in (tmp_path / "c.html").read_text()


def test_configurations_on_one_side_or_no_longer_ok_are_listed_and_gate(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    rows = (GPU_SWEEP / "results.jsonl").read_text().splitlines()
    a.mkdir(), b.mkdir()
    (a / "results.jsonl").write_text("\n".join(rows[:3]) + "\n")
    crashed = json.loads(rows[0]) | {"status": "crashed", "error": "killed"}
    (b / "results.jsonl").write_text("\n".join([json.dumps(crashed), rows[1], rows[3]]) + "\n")
    comparison = compare_sweeps(a, b, fail_on="mean:5%")
    labels = [json.loads(line)["label"] for line in rows]
    assert comparison.only_a == [labels[2]] and comparison.only_b == [labels[3]]
    assert comparison.regressed == [labels[0]] and comparison.failed
    assert not compare_sweeps(a, b).failed  # without a gate nothing fails


@pytest.mark.parametrize("text, gate", [("mean:5%", ("mean", 5.0)), ("memory: 2.5", ("memory", 2.5))])
def test_fail_on_reads_a_figure_and_a_percent(text, gate):
    assert (parse_fail_on(text).figure, parse_fail_on(text).percent) == gate


def _one_paragraph(code: int, err: str) -> None:
    assert code == 2 and err.startswith("fitbench: ") and err.strip().count("\n") == 0 and "Traceback" not in err


def test_bad_input_is_one_paragraph_and_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    _one_paragraph(*cli(["report", str(tmp_path / "empty"), "--html", str(tmp_path / "x.html")], capsys)[::2])
    _one_paragraph(*cli(["compare", str(tmp_path / "empty"), str(GPU_SWEEP)], capsys)[::2])
    _one_paragraph(*cli(["compare", str(GPU_SWEEP), str(GPU_SWEEP), "--fail-on", "fast"], capsys)[::2])
    blocked = tmp_path / "file"
    blocked.write_text("")
    _one_paragraph(*cli(["report", str(GPU_SWEEP), "--xlsx", str(blocked / "x.xlsx")], capsys)[::2])
    _one_paragraph(*cli(["report", str(GPU_SWEEP), "--ollama-url", "localhost:11434", "--ollama-model", "m"],
                        capsys)[::2])
    _one_paragraph(*cli(["run", "--models", "tiny", "--device", "cpu", "--ollama-url", "http://", "--ollama-model",
                         "m", "--out", str(tmp_path / "out")], capsys)[::2])
    assert not (tmp_path / "out" / "results.jsonl").exists()


def test_damaged_rows_are_warned_about_and_shown_in_the_documents(tmp_path, capsys):
    directory = tmp_path / "damaged"
    directory.mkdir()
    rows = (GPU_SWEEP / "results.jsonl").read_text().splitlines()
    damaged = json.loads(rows[1])
    damaged["throughput"]["tokens_per_s"] = "fast"
    (directory / "results.jsonl").write_text("\n".join([rows[0], "{not json", json.dumps(damaged)]) + "\n")
    code, out, err = cli(["report", str(directory), "--html", str(tmp_path / "d.html"), "--xlsx",
                          str(tmp_path / "d.xlsx")], capsys)
    assert code == 0
    assert "line 2 is not valid JSON" in err and "line 3 has `throughput.tokens_per_s`" in err
    page = (tmp_path / "d.html").read_text()
    assert 'id="warnings"' in page and "line 2 is not valid JSON" in page and damaged["label"] in page
    warnings = [line[0] for line in openpyxl.load_workbook(tmp_path / "d.xlsx")["warnings"].iter_rows(
        min_row=2, values_only=True)]
    assert len(warnings) == 2 and "line 3" in warnings[1]


def test_a_missing_report_library_is_one_paragraph_naming_the_extra(monkeypatch):
    from fitbench.cli.documents import report_module
    from fitbench.util.errors import UserError

    monkeypatch.setitem(sys.modules, "openpyxl", None)  # import openpyxl now fails as if not installed
    monkeypatch.delitem(sys.modules, "fitbench.report.excel", raising=False)
    with pytest.raises(UserError, match=r"^xlsx: needs openpyxl, .*pip install 'fitbench\[report\]'"):
        report_module("excel", "xlsx")


def test_showing_rows_without_documents_imports_no_report_library():
    """`fitbench report DIR` (and a run's summary) without --html, --xlsx or --ollama-*: nothing of
    fitbench.report is imported, so a fitbench without the report extra shows its rows."""
    directory = RESULTS / "2026-11-27-h100x4-replicas/1b-tp4"
    code = ("import sys; from fitbench.cli import main; status = main(['report', sys.argv[1]]); "
            "loaded = [m for m in sys.modules if m.startswith(('fitbench.report', 'plotly', 'openpyxl', 'ollama'))]; "
            "print(loaded); sys.exit(status or bool(loaded))")
    done = subprocess.run([sys.executable, "-c", code, str(directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
