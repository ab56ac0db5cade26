"""The HTML page a person shares: its first screen at 1400 px in headless Chromium holds measured
figures (read from the page's table order and the cells' places, not by eye), numbers to the digits
their column names, the command wrapped without the machine's paths, and plots that do not mislead:
a line only between rows that differ in the plotted variable alone, no plot of one x value, log ticks
labelled whole, every axis titled."""

import html
import json
import re
import subprocess
from pathlib import Path

import pytest

from conftest import cli
from fitbench.report.figures import decode_figure, size_figure
from fitbench.results.directories import read_sweeps

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
MULTI_GPU = RESULTS / "2026-11-27-h100x4-large-models"  # 4 x H100: Llama-2-70B under TP, 1B over 1 to 4 GPUs
SCREEN = (1400, 900)
FIGURES_FIRST = ("tokens/s", "median time (ms, per step or decoded token)", "measured peak, largest GPU (GB)")

# Run in the page once it has loaded: where the rows table's header cells and first row sit.
PROBE = """<script>
window.addEventListener("load", function () { setTimeout(function () {
  var table = document.querySelector("#rows table");
  var cells = function (row) { return Array.prototype.map.call(row.cells, function (cell) {
    var box = cell.getBoundingClientRect();
    return {text: cell.textContent, right: box.right, bottom: box.bottom};
  }); };
  var first = document.querySelector("body > section");
  var out = document.createElement("pre"); out.id = "probe";
  out.textContent = JSON.stringify({first: first && first.id, header: cells(table.tHead.rows[0]),
                                    row: cells(table.tBodies[0].rows[0])});
  document.body.appendChild(out);
}, 500); });
</script>"""


def chromium() -> str:
    import shutil

    found = shutil.which("chromium")
    if not found:
        pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium)")
    return found


@pytest.mark.slow
def test_the_first_screen_of_a_multi_gpu_report_holds_measured_figures(tmp_path, capsys):
    page = tmp_path / "report.html"
    code, out, err = cli(["report", str(MULTI_GPU), "--html", str(page), "--quiet"], capsys)
    assert code == 0, err
    probed = tmp_path / "probed.html"
    probed.write_text(page.read_text().replace("<head>", "<head>" + PROBE, 1))
    flags = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--virtual-time-budget=20000", f"--window-size={SCREEN[0]},{SCREEN[1]}"]
    done = subprocess.run(flags + ["--dump-dom", probed.as_uri()], capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="probe">(.*?)</pre>', done.stdout, re.S)
    assert found, done.stderr[-2000:]
    seen = json.loads(html.unescape(found.group(1)))
    assert seen["first"] == "rows"  # the table of measurements is the page's first section
    header = [cell["text"] for cell in seen["header"]]
    for name in FIGURES_FIRST:
        column = header.index(name)
        assert column < header.index("model") < header.index("layout")  # figures before what the row is
        for cell in (seen["header"][column], seen["row"][column]):
            assert cell["right"] <= SCREEN[0] and cell["bottom"] <= SCREEN[1], (name, cell)
    subprocess.run(flags + [f"--screenshot={tmp_path / 'first-screen.png'}", page.as_uri()], capture_output=True,
                   timeout=120, check=True)
    assert (tmp_path / "first-screen.png").stat().st_size > 10_000


def test_numbers_have_their_column_s_digits_and_the_command_no_machine_path(tmp_path, capsys):
    page = tmp_path / "report.html"
    assert cli(["report", str(MULTI_GPU / "infer" / "llama-2-70b-tp4"), "--html", str(page), "--quiet"],
               capsys)[0] == 0
    text = page.read_text()
    row = read_sweeps(MULTI_GPU / "infer" / "llama-2-70b-tp4").rows[0]
    median_ms = 1e3 * row.timing["token_latency"]["median"]
    assert f">{median_ms:.3g}</td>" in text and f">{row.timing['token_latency']['cv_percent']:.1f}</td>" in text
    assert "--out benchmarks/results" in row.command and "--out DIR" in text
    assert "--out benchmarks/results" not in text.split('id="provenance"')[1]
    assert 'table class="facts"' in text and "overflow-wrap: anywhere" in text


def _traces(figure):
    return [trace for trace in figure.data if trace.name and "roofline" not in trace.name]


def test_rows_that_differ_in_more_than_the_plotted_variable_are_not_joined():
    """Every committed GPU row: no size line joins rows of two batches, sequences, backends or folders,
    and a line has two x values at least; the same for the decode plot's batch."""
    sweeps = read_sweeps(RESULTS)
    size = size_figure(sweeps)
    by_label = {sweeps.label(row): row for row in sweeps.rows}
    for trace in _traces(size):
        rows = [by_label[text] for text in trace.text]
        if "lines" in trace.mode:
            assert len(set(trace.x)) >= 2
            fields = [{k: v for k, v in row.spec.items() if k not in ("model", "device", "warmup_steps",
                                                                        "measure_steps", "seed")} for row in rows]
            assert all(field == fields[0] for field in fields), trace.name
            assert len({sweeps.name(row) for row in rows}) == 1
    for trace in _traces(decode_figure(sweeps)):
        if "lines" in trace.mode:
            assert len(set(trace.x)) >= 2


def test_no_plot_of_one_x_value_and_log_ticks_labelled_whole():
    one_size = read_sweeps(MULTI_GPU / "weak" / "ddp-2")  # a single 1B row
    assert size_figure(one_size) is None and decode_figure(one_size) is None
    figure = size_figure(read_sweeps(MULTI_GPU))
    layout = figure.layout
    assert list(layout.xaxis.ticktext) and all(re.fullmatch(r"[\d.]+[kMBT]?", text) for text in layout.xaxis.ticktext)
    assert any(text.endswith("B") for text in layout.xaxis.ticktext)  # 1B and 70B: named, not a bare 2
    for axis in (layout.xaxis, layout.yaxis, layout.xaxis2, layout.yaxis2):
        assert axis.title.text
