"""``fitbench compare`` as a CI gate: several gates each checked, a comparison of nothing failing,
a configuration lost from B failing, one table row per configuration with B/A worked out by hand,
rows paired across an option that differs, and two trees of sweeps paired folder by folder."""

import json
import shutil
from pathlib import Path

import pytest

from conftest import cli
from fitbench.report.compare import compare_sweeps, time_samples
from fitbench.report.columns import largest_peak
from fitbench.results.directories import read_sweep

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
FSDP_8B = RESULTS / "2026-11-24-h200x2-data-parallel" / "8b-fsdp"  # one training row, 2 x H200
# Llama-2-70B decoding on 4 x H100 under TP x 4 and pipeline x 4: the same configurations, two layouts.
TP4, PP4 = (RESULTS / "2026-11-27-h100x4-model-parallel" / name for name in ("1", "2"))


def changed(source: Path, target: Path, time: float = 1.0, memory: float = 1.0, keep: slice = slice(None)) -> Path:
    """A copy of the sweep in ``source`` (its rows ``keep``) whose raw time samples and time statistics
    are ``time`` x and whose GPU peaks are ``memory`` x."""
    target.mkdir(parents=True)
    lines = []
    for line in (source / "results.jsonl").read_text().splitlines()[keep]:
        row = json.loads(line)
        timing = row.get("timing") or {}
        for name, values in (timing.get("samples") or {}).items():
            timing["samples"][name] = [value * time for value in values]
        for stats in timing.values():
            for figure in ("mean", "median"):
                if isinstance(stats, dict) and figure in stats:
                    stats[figure] *= time
        for gpu in (row.get("memory") or {}).get("gpus") or []:
            for figure in ("nvml_peak_used", "peak_reserved"):
                if gpu.get(figure):
                    gpu[figure] = int(gpu[figure] * memory)
        lines.append(json.dumps(row))
    (target / "results.jsonl").write_text("\n".join(lines) + "\n")
    return target


@pytest.mark.parametrize("gates, failing", [(["mean:5%", "memory:1%"], "memory:1%"),
                                            (["memory:1%", "mean:5%"], "memory:1%")])
def test_every_gate_is_checked_and_reported_whatever_its_place(tmp_path, gates, failing):
    """A peak 2% larger at the same speed: the memory gate fails whether it is given first or last."""
    b = changed(FSDP_8B, tmp_path / "b", memory=1.02)
    comparison = compare_sweeps(FSDP_8B, b, fail_on=gates)
    results = {result.gate.text: result for result in comparison.gate_results()}
    assert set(results) == set(gates) and comparison.failed
    assert not results["mean:5%"].failures and results[failing].failures
    verdict = comparison.verdict()
    assert "Gate mean:5%: passed" in verdict and any(line.startswith("Gate memory:1%: failed by") for line in verdict)


def test_several_gates_on_the_command_line_each_fail_on_their_own(tmp_path, capsys):
    slower = changed(FSDP_8B, tmp_path / "slower", time=1.10)
    code, out, err = cli(["compare", str(FSDP_8B), str(slower), "--fail-on", "mean:5%", "--fail-on", "memory:1%"],
                         capsys)
    assert code == 1, err
    assert "Gate memory:1%: passed" in out and "Gate mean:5%: failed by" in out


def test_a_comparison_of_nothing_fails_and_says_what_differs(capsys):
    """The same configurations in two layouts share no key: no gate needed for it to fail."""
    code, out, err = cli(["compare", str(TP4), str(PP4)], capsys)
    assert code == 1, err
    assert "0 configuration(s) compared" in out and "nothing was compared" in out
    assert "--match-across layout" in out


def test_a_configuration_ok_in_a_and_missing_from_b_fails_a_gate(tmp_path, capsys):
    b = changed(TP4, tmp_path / "b", keep=slice(0, 1))
    lost = read_sweep(TP4).rows[1].label
    code, out, err = cli(["compare", str(TP4), str(b), "--fail-on", "mean:5%"], capsys)
    assert code == 1, err
    assert f"{lost} (missing from B)" in out and f"only in A: {lost}" in out
    assert cli(["compare", str(TP4), str(b)], capsys)[0] == 0  # without a gate it is listed, not failed


def test_one_row_per_configuration_with_its_ratios_worked_out_by_hand(tmp_path):
    b = changed(TP4, tmp_path / "b", time=1.25, memory=0.9)
    comparison = compare_sweeps(TP4, b, fail_on="mean:5%")
    header, rows = comparison.table()
    assert len(rows) == len(read_sweep(TP4).rows) == 2
    assert header[:4] == ["configuration", "mean time A", "mean time B", "time B/A [95% CI]"]
    for row_a, row_b, cells in zip(read_sweep(TP4).rows, read_sweep(b).rows, rows):
        samples_a, samples_b = time_samples(row_a), time_samples(row_b)
        ratio = (sum(samples_b) / len(samples_b)) / (sum(samples_a) / len(samples_a))
        assert cells[3].startswith(f"{ratio:.3f} [") and cells[4] == "slower"
        assert cells[10] == f"{largest_peak(row_b) / largest_peak(row_a):.3f}"
        assert cells[1].endswith(" ms") and cells[-1] == "beyond mean:5%"
    lines = comparison.lines()
    assert len(lines) == 2 + 2 + 2  # header, rule, a line per configuration, the summary and the gate


def test_rows_are_paired_across_an_option_that_differs(capsys):
    """Pipeline x 4 against TP x 4: the same two configurations, B/A worked out by hand."""
    comparison = compare_sweeps(TP4, PP4, match_across=["layout"])
    assert len(comparison.rows) == 2 and not comparison.only_a and not comparison.failed
    for row, row_a, row_b in zip(comparison.rows, read_sweep(TP4).rows, read_sweep(PP4).rows):
        assert row.label.endswith("(layout tp x 4 -> pipeline x 4)")
        time = row.change("time")
        samples_a, samples_b = time_samples(row_a), time_samples(row_b)
        assert time.after / time.before == pytest.approx(
            (sum(samples_b) / len(samples_b)) / (sum(samples_a) / len(samples_a)))
    code, out, err = cli(["compare", str(TP4), str(PP4), "--match-across", "layout", "--fail-on", "mean:10%"], capsys)
    assert code == 1 and "Gate mean:10%: failed by" in out  # pipeline decodes 2.5 x slower


def test_matching_across_an_option_both_rows_of_a_side_share_is_bad_input(capsys):
    """Matching across the batch, A's two rows (batch 1 and 8) have one key: which would B's meet?"""
    code, out, err = cli(["compare", str(TP4), str(TP4), "--match-across", "batch-size"], capsys)
    assert code == 2 and "match-across" in err and err.strip().count("\n") == 0
    code, out, err = cli(["compare", str(TP4), str(TP4), "--match-across", "colour"], capsys)
    assert code == 2 and "precision" in err


def test_two_trees_of_sweeps_are_paired_folder_by_folder(tmp_path, capsys):
    for tree, factor in (("before", 1.0), ("after", 1.10)):
        shutil.copytree(TP4, tmp_path / tree / "tp", ignore=shutil.ignore_patterns("artifacts", "logs"))
        changed(PP4, tmp_path / tree / "pipeline", time=factor)
    comparison = compare_sweeps(tmp_path / "before", tmp_path / "after", fail_on="mean:5%")
    assert [row.label.split(":")[0] for row in comparison.rows] == ["pipeline", "pipeline", "tp", "tp"]
    assert [row.change("time").verdict for row in comparison.rows] == ["slower"] * 2 + ["within noise"] * 2
    assert comparison.failed
    # a tree against one sweep shares no folder: nothing compared, and said why
    code, out, err = cli(["compare", str(tmp_path / "before"), str(TP4)], capsys)
    assert code == 1 and "share none" in out


def test_the_comparison_page_holds_every_gate_and_one_row_per_configuration(tmp_path, capsys):
    b = changed(TP4, tmp_path / "b", time=1.25)
    code, out, err = cli(["compare", str(TP4), str(b), "--fail-on", "mean:5%", "--fail-on", "memory:1%",
                          "--html", str(tmp_path / "c.html")], capsys)
    assert code == 1, err
    page = (tmp_path / "c.html").read_text()
    assert "Gate mean:5%: failed by" in page and "Gate memory:1%: passed" in page
    table = page.split('id="changes"')[1].split("</section>")[0]
    assert table.count("<tr>") == 1 + 2 and "time B/A [95% CI]" in table  # the header and a row per configuration
