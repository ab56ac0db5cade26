"""What the long commands show while they work (issue 29 item 5): in a terminal a bar with the time
left, recomputed here by hand; outside one, text without a control character; with --quiet only
what the command's help names. In process, on committed rows and the session's tiny CPU sweep."""

import io
import re
import shutil
from pathlib import Path

from rich.console import Console

from conftest import cli
from fitbench.cli.display import StepsDisplay

ROOT = Path(__file__).parent.parent
ONE_ROW = ROOT / "benchmarks/results/2026-11-22-h100-core/7b-infer"
# Anything a terminal acts on: escape sequences, carriage returns, the cursor's bells and backspaces.
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def test_a_stage_shows_its_time_left_by_the_sweep_clocks_formula():
    """Steps of 10 s and 20 s measured, 5 s into the third of four: the mean (15 s) less what the
    running step has spent (5 s), plus the mean for the one still queued: 10 + 15 = 25 s."""
    now = [0.0]
    console = Console(width=120, file=io.StringIO(), force_terminal=True, color_system=None)
    with StepsDisplay(console=console, now=lambda: now[0]) as steps:
        steps.begin("plots", 4)
        for seconds in (10, 20):
            now[0] += seconds
            steps.advance()
        now[0] += 5
        assert str(steps.eta.render(steps.progress.tasks[0])) == "about 0:00:25 left"
        steps.begin("workbook sheets", 2)  # a new stage starts its own estimate
        assert str(steps.eta.render(steps.progress.tasks[0])) == "time left: estimating"
    assert StepsDisplay(quiet=True, console=console).progress.disable


def test_report_and_compare_outside_a_terminal_print_no_control_character(tmp_path, capsys):
    code, out, err = cli(["report", str(ONE_ROW), "--xlsx", str(tmp_path / "r.xlsx")], capsys)
    assert code == 0 and "fitbench results" in out and f"xlsx: {tmp_path / 'r.xlsx'}" in out
    code, compared, err_compared = cli(["compare", str(ONE_ROW), str(ONE_ROW)], capsys)
    assert code == 0 and "within noise" in compared
    for text in (out, err, compared, err_compared):
        assert not CONTROL.search(text), repr(CONTROL.search(text))


def test_quiet_prints_only_the_essentials(tiny_sweep, tmp_path, capsys):
    code, out, err = cli(["report", str(ONE_ROW), "--quiet", "--xlsx", str(tmp_path / "r.xlsx")], capsys)
    assert (code, out, err) == (0, f"xlsx: {tmp_path / 'r.xlsx'}\n", "")
    code, out, err = cli(["compare", str(ONE_ROW), str(ONE_ROW), "-q", "--fail-on", "mean:5%"], capsys)
    assert (code, err) == (0, "") and out.splitlines() == ["1 configuration(s) compared, 1 within noise",
                                                           "Gate mean:5%: passed"]
    finished = tmp_path / "finished"
    shutil.copytree(tiny_sweep.out, finished)
    code, out, err = cli(["run", "--resume", str(finished), "--quiet"], capsys)
    assert (code, err) == (0, "")
    # one line, which the console may fold at its width
    assert " ".join(out.split()) == f"rows: {finished / 'results.jsonl'} table: {finished / 'results.csv'}"
    assert not CONTROL.search(out)
