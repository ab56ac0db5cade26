"""What a person reads: the results table at any terminal width, model names, sweep progress and
the CSV. Rows come from the committed GPU runs in benchmarks/results and from a real CPU run."""

import io
import json
import math
import re
import shutil
from functools import reduce
from pathlib import Path

import pandas as pd
import pytest
from rich.cells import cell_len
from rich.console import Console

from fitbench.results.report import headline, results_table, short_names, table_cells, write_csv
from fitbench.results.row import Row, typed_row
from fitbench.results.schema import check_row
from fitbench.results.store import ResultStore
from fitbench.results.terminal import EtaColumn, SweepClock
from fitbench.util.units import format_bytes, format_count, format_seconds

ROOT = Path(__file__).parent.parent
# the widest shows every column of every committed row, each row's layout included
WIDTHS = (60, 80, 180)


def committed_rows() -> list[dict]:
    """Every row of the committed H100 runs: every mode, ok, oom and refused, offload, auto batch."""
    rows = []
    for path in sorted((ROOT / "benchmarks/results").rglob("results.jsonl")):
        rows += ResultStore(path.parent).rows()
    return rows


def typed(rows: list[dict]) -> list:
    """Rows built here as dicts, typed as the store types what it reads (the renderers read ``Row``)."""
    return [typed_row(row)[0] for row in rows]


def render(rows: list[dict], width: int) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(results_table(typed(rows)))
    return console.file.getvalue()


def figures(row: dict) -> dict[str, list[str]]:
    """Each column's figures for ``row``, read from the row's own fields (not through the table's code)."""
    spec, throughput = row["spec"], row.get("throughput") or {}
    infer = spec["mode"] == "infer"
    stats = (row.get("timing") or {}).get("token_latency" if infer else "step") or {}
    gpus = (row.get("memory") or {}).get("gpus") or []
    memory = [format_bytes(g.get("nvml_peak_used") or g["peak_reserved"]) for g in gpus]
    if not gpus and row.get("memory"):
        memory = [format_bytes(row["memory"]["host_peak_rss"])]
    tokens = throughput.get("decode_tokens_per_s" if infer else "tokens_per_s")
    found = {
        "params": [format_count(row.get("params"))],
        "batch×seq": [f"{spec['batch_size']}×{spec['seq_len']}" + (f"+{spec['new_tokens']}" if infer else "")],
        "median ± CV" if not infer else "per token ± CV":
            [format_seconds(stats["median"]), f"{stats['cv_percent']:.1f}%"] if stats else [],
        "tokens/s": [f"{tokens:,.0f}"] if tokens and tokens >= 10 else [],
        "peak memory": memory,
    }
    prediction = row.get("prediction") or {}
    if prediction.get("step_time_estimate_s"):
        found["roofline"] = [format_seconds(prediction["step_time_estimate_s"])]
    if prediction.get("predicted_peak_bytes"):
        found["predicted (error)"] = [format_bytes(prediction["predicted_peak_bytes"])]
    if prediction.get("step_time_forecast_s") and stats:
        error = (prediction["step_time_forecast_s"] - stats["median"]) / stats["median"]
        found["forecast"] = [format_seconds(prediction["step_time_forecast_s"]), f"({100 * error:+.1f}%)"]
    if infer:
        if throughput.get("decode_roofline_percent") is not None:
            found["% of BW roofline"] = [f"{throughput['decode_roofline_percent']:.0f}%"]
        if throughput.get("prefill_mfu") is not None:
            found["prefill MFU"] = [f"{100 * throughput['prefill_mfu']:.1f}%"]
    elif throughput.get("mfu") is not None:
        found["MFU"] = [f"{100 * throughput['mfu']:.1f}%"]
    return found


def sections(text: str) -> dict[str, tuple[str, list[str]]]:
    """The rendered text per table, by mode: (the table, the names of the columns it leaves out)."""
    found = {}
    for part in re.split(r"^(?=fitbench results · )", text, flags=re.M):
        if not part.strip():
            continue
        title = part.splitlines()[0].strip()
        note = " ".join(line.strip() for line in part.splitlines())
        left_out = re.search(r"not shown at \d+ columns: (.*?); every figure is in results\.csv", note)
        found[title.split(" · ")[-1]] = (part, left_out.group(1).split(", ") if left_out else [])
    return found


def whole(figure: str, text: str) -> bool:
    """``figure`` appears with nothing of a number glued to either side: not cut, not part of another."""
    return re.search(r"(?<![\d.,])" + re.escape(figure) + r"(?!\d|[.,]\d)", text) is not None


def check_table(rows: list[dict], width: int) -> str:
    text = render(rows, width)
    assert "…" not in text
    assert max(cell_len(line) for line in text.splitlines()) <= width
    tables = sections(text)
    assert set(tables) == {row["spec"]["mode"] for row in rows}
    for row in rows:
        table, left_out = tables[row["spec"]["mode"]]
        assert row["status"] in table
        for column, shown in figures(row).items():
            if column in left_out:
                continue
            for figure in shown:
                assert whole(figure, table), (width, column, figure, row["label"])
    return text


@pytest.mark.parametrize("width", WIDTHS)
def test_every_figure_is_whole_or_its_column_is_named_as_left_out(width):
    rows = committed_rows()
    assert {row["status"] for row in rows} >= {"ok", "oom", "refused"}
    text = check_table(rows, width)
    tables = sections(text)
    for mode, (table, left_out) in tables.items():
        # what a person compares first survives any of these widths
        for column in ("model", "precision", "status", "tokens/s", "per token" if mode == "infer" else "median"):
            assert column in table and column not in left_out
        assert (left_out == []) == (width == 180), left_out


def test_a_narrow_table_stacks_the_spread_under_its_figure():
    row = next(row for row in committed_rows() if row["spec"]["mode"] == "train" and row["status"] == "ok")
    wide, narrow = render([row], 180), render([row], 60)
    median = format_seconds(row["timing"]["step"]["median"])
    spread = f"± {row['timing']['step']['cv_percent']:.1f}%"
    assert f"{median} {spread}" in wide
    lines = narrow.splitlines()
    line = next(i for i, text in enumerate(lines) if median in text)
    assert spread in lines[line + 1] and spread not in lines[line]


def test_a_narrow_table_stacks_a_hyphenated_precision_at_its_hyphens():
    row = next(row for row in committed_rows() if row["spec"]["precision"].count("-") == 2)
    precision = row["spec"]["precision"]
    first, second, third = precision.split("-")
    assert precision in render([row], 180)
    lines = render([row], 40).splitlines()
    line = next(i for i, text in enumerate(lines) if f"{first}-" in text)
    column = lines[line].index(f"{first}-")
    assert precision not in "".join(lines)
    assert [text[column:].split()[0] for text in lines[line:line + 3]] == [f"{first}-", f"{second}-", third]


@pytest.mark.parametrize("names, shown", [
    (["../models/tiny-llama-a", "../models/tiny-llama-b"], ["tiny-llama-a", "tiny-llama-b"]),
    (["/data/run1/ckpt", "/data/run2/ckpt"], ["run1/ckpt", "run2/ckpt"]),
    (["/a/x/ckpt", "/b/x/ckpt", "/b/y/ckpt"], ["a/x/ckpt", "b/x/ckpt", "y/ckpt"]),
    (["../models/tiny", "tiny"], ["models/tiny", "tiny"]),  # a path is not mistaken for the preset
    (["x/a/b/c", "a/b/c/"], ["x/a/b/c", "a/b/c"]),  # one path is the other's tail: the shorter stays whole
    (["/ckpt", "/a/ckpt"], ["/ckpt", "a/ckpt"]),
    (["./m/a", "./m/a/"], ["a", "a"]),  # one directory spelled twice is one model
    (["meta-llama/Llama-2-7b-hf", "7B"], ["meta-llama/Llama-2-7b-hf", "7B"]),  # hub ids and presets stay whole
])
def test_model_paths_shortened_to_what_tells_them_apart(names, shown):
    assert [short_names(names)[name] for name in names] == shown


def test_the_table_shows_short_model_names():
    base = next(row for row in committed_rows() if row["spec"]["mode"] == "infer" and row["status"] == "ok")
    paths = ["../models/tiny-llama-a", "../models/tiny-llama-b", "/scratch/old/final", "/scratch/new/final"]
    rows = [{**base, "spec": {**base["spec"], "model": path}} for path in paths]
    for width in WIDTHS:
        text = check_table(rows, width)
        assert "../models" not in text and "scratch" not in text
        for name in ("tiny-llama-a", "tiny-llama-b", "old/final", "new/final"):
            assert re.search(rf"^{name} ", text, flags=re.M), (width, name)


def test_csv_keeps_nested_fields_as_json(tmp_path):
    rows = committed_rows()
    table = pd.read_csv(write_csv(typed(rows), tmp_path))
    checked = 0
    for field in ("memory.gpus", "environment.gpus", "warnings", "prediction.terms", "attempts"):
        assert field in table.columns
        for row, cell in zip(rows, table[field]):
            value = row
            for key in field.split("."):
                value = (value or {}).get(key)
            if isinstance(cell, str):
                assert json.loads(cell) == json.loads(json.dumps(value)), field
                checked += 1
            else:
                assert value is None, field
    assert checked > 100
    text = (tmp_path / "results.csv").read_text()
    assert "{'" not in text and "['" not in text and "None" not in text


def test_report_writes_the_csv_again_from_the_rows(tmp_path, capsys):
    """Committed results keep results.jsonl only: ``fitbench report DIR --csv`` writes the
    results.csv that ``fitbench run`` wrote beside it, one line per row."""
    from fitbench.cli import main

    folder = tmp_path / "7b-infer"
    shutil.copytree(ROOT / "benchmarks/results/2026-11-22-h100-core/7b-infer", folder)
    assert not (folder / "results.csv").exists()
    assert main(["report", str(folder), "--csv"]) == 0
    assert f"table: {folder / 'results.csv'}" in capsys.readouterr().out
    rows = list(ResultStore(folder).typed_rows())
    table = pd.read_csv(folder / "results.csv")
    assert list(table["key"]) == [row.key for row in rows] and len(rows) >= 1
    assert table.equals(pd.read_csv(write_csv(rows, tmp_path)))

    # with --markdown on stdout, the path goes to stderr so the Markdown stays whole
    assert main(["report", str(folder), "--markdown", "--csv"]) == 0
    out, err = capsys.readouterr()
    assert "table:" not in out and "results.csv" in err


def test_sweep_clock_estimates_from_what_was_measured():
    now = [100.0]
    clock = SweepClock(6, now=lambda: now[0])
    clock.skip()  # finished by an earlier invocation: done, but no duration
    assert clock.remaining is None and "1/6 done" in clock.summary()
    clock.start()
    now[0] += 30
    clock.finish()
    clock.start()
    now[0] += 2
    clock.finish(measured=False)  # refused before launch: no process ran
    clock.start()
    now[0] += 90
    clock.finish()
    assert clock.remaining == pytest.approx(60 * 2)  # two left at the mean of 30 s and 90 s
    clock.start()
    now[0] += 45
    assert clock.remaining == pytest.approx(15 + 60)  # the running one has spent 45 of its 60
    now[0] += 100
    assert clock.remaining == pytest.approx(60)  # overdue: at least the one still queued
    assert clock.summary() == "4/6 done, 0:04:27 elapsed, about 0:01:00 left"
    clock.finish()
    clock.start()
    clock.finish()
    assert clock.remaining == 0 and clock.summary().endswith("done")


def test_output_that_is_not_a_terminal_gets_a_line_per_configuration(tiny_sweep):
    """The sweep's output piped: each configuration's line arrives as it finishes, with the count,
    the elapsed time and the time left; the final tables are then readable at any width."""
    out, rest = tiny_sweep.out, tiny_sweep.rest
    first, running, rows_then = tiny_sweep.lines[-1]
    # printed when the first row was written, while the second configuration still had to run
    assert running is None and rows_then == 1
    assert re.match(r"\[1/2 done, \d+:\d\d:\d\d elapsed, about \d+:\d\d:\d\d left\] ok tiny train fp32 1x16 "
                    r"\[native\]: [\d.]+ \S+/step ± [\d.]+%, [\d,.]+ tokens/s", first), first
    progress = [line for line in rest.splitlines() if line.startswith("[2/2")]
    assert len(progress) == 1 and re.match(r"\[2/2 done, \d+:\d\d:\d\d elapsed, done\] ok tiny infer fp32 1x16\+4 "
                                           r"\[native\]: ", progress[0]), progress
    assert re.search(r"^fitbench results · train *$", rest, flags=re.M)
    assert re.search(r"^fitbench results · infer *$", rest, flags=re.M)

    rows = list(ResultStore(out).rows())
    assert [row["status"] for row in rows] == ["ok", "ok"]
    for width in WIDTHS:
        check_table(rows, width)
    table = pd.read_csv(out / "results.csv")
    assert [json.loads(cell) for cell in table["environment.gpus"]] == [row["environment"]["gpus"] for row in rows]


def test_memory_of_several_gpus_is_one_figure_per_gpu():
    base = next(row for row in committed_rows() if row["spec"]["mode"] == "train" and row["status"] == "ok")
    gpu = base["memory"]["gpus"][0]
    gpus = [{**gpu, "index": index, "nvml_peak_used": gpu["nvml_peak_used"] + index * 1.3e9} for index in range(4)]
    row = {**base, "memory": {**base["memory"], "gpus": gpus}}
    for width in WIDTHS:
        check_table([row, base], width)
    # where the table has room for every column inline, the figures share one line, each after its GPU's index
    assert ", ".join(f"{g['index']}: {format_bytes(g['nvml_peak_used'])}" for g in gpus) in check_table([row, base], 220)


def test_the_memory_error_is_against_the_gpu_that_needed_most():
    """The planner predicts the per-GPU peak of the rank that needs most, so the error is against the
    largest measured figure, whichever rank it was (here the third), with or without NVML."""
    base = next(Row.model_validate(row) for row in committed_rows()
                if row["spec"]["mode"] == "train" and row["status"] == "ok" and row.get("prediction"))
    predicted = base.prediction["predicted_peak_bytes"]
    figures = [0.90 * predicted, 0.95 * predicted, 0.98 * predicted, 0.92 * predicted]
    gpus = [{"index": i, "rank": i, "nvml_peak_used": figure, "peak_reserved": figure - 1e9}
            for i, figure in enumerate(figures)]
    row = base.model_copy(update={"memory": {**base.memory, "gpus": gpus}})
    assert headline(row)["measured_peak"] == 0.98 * predicted
    assert math.isclose(headline(row)["prediction_error"], 100 * (1 / 0.98 - 1))
    context = next(t["bytes"] for t in base.prediction["terms"] if t["name"] == "CUDA context")
    without_nvml = row.model_copy(update={"memory": {"gpus": [{**g, "nvml_peak_used": None} for g in gpus]}})
    assert headline(without_nvml)["measured_peak"] == 0.98 * predicted - 1e9 + context


def test_the_forecast_and_its_signed_error_stand_beside_the_memory_prediction():
    rows = [row for row in committed_rows() if row["status"] == "ok" and row.get("prediction")][:12]
    assert {row["spec"]["mode"] for row in rows} >= {"train", "infer"}
    forecast = []
    for index, row in enumerate(rows):
        timing = row["timing"]["token_latency" if row["spec"]["mode"] == "infer" else "step"]
        forecast.append({**row, "prediction": {**row["prediction"],
                                               "step_time_forecast_s": timing["median"] * (0.8 + 0.05 * index)}})
    for width in WIDTHS:
        check_table(forecast, width)
    wide = render(forecast, 180)
    for mode in ("train", "infer"):
        header = next(line for line in sections(wide)[mode][0].splitlines() if "predicted" in line)
        assert header.index("predicted (error)") < header.index("forecast") < header.index("status")
    assert "(-20.0%)" in wide and "(+15.0%)" in wide


def test_the_live_display_shows_the_time_left_on_the_sweep_only():
    from rich.progress import Progress

    now = [0.0]
    clock = SweepClock(3, now=lambda: now[0])
    console = Console(width=120, file=io.StringIO(), force_terminal=True, color_system=None)
    with Progress(EtaColumn(clock), console=console, auto_refresh=False) as progress:
        sweep = progress.add_task("sweep", total=3, eta=True)
        run = progress.add_task("", total=None)
        clock.start()
        now[0] += 20
        clock.finish()
        clock.start()
        now[0] += 5
        progress.refresh()
        columns = progress.columns[0]
        assert str(columns(progress.tasks[sweep])) == "about 0:00:35 left"
        assert str(columns(progress.tasks[run])) == ""


# ---- damaged rows ---------------------------------------------------------------------------------

MISSING = object()  # the key left out


def fields_of(value, path: tuple = ()):
    """(path, value) of every field below ``value``: each key of an object, the first item of a list."""
    items = value.items() if isinstance(value, dict) else enumerate(value[:1]) if isinstance(value, list) else ()
    for key, inner in items:
        yield path + (key,), inner
        yield from fields_of(inner, path + (key,))


def damages(value) -> list:
    """What an editor, a merge or a script might leave in place of ``value``: other kinds, non-finite
    and huge numbers, null; for an object's key also nothing at all."""
    if isinstance(value, dict):
        kinds = [[1, 2], "text"]
    elif isinstance(value, list):
        kinds = [{"a": 1}, "text"]
    elif isinstance(value, bool):
        kinds = ["yes", 7]
    elif isinstance(value, (int, float)):
        kinds = ["12", math.nan, -math.inf, True, 10**400, [1]]
    elif isinstance(value, str):
        kinds = [7, ["text"]]
    else:  # null: what it stood for is unknown; only the readers' surviving it is checked
        kinds = ["text", math.nan, {"a": 1}]
    return kinds + [None]


def named(path: tuple) -> str:
    """A field as the store's warnings name it: ``memory.gpus[0].peak_reserved``."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".")


def changed(row: dict, path: tuple, value) -> dict:
    """``row`` with the field at ``path`` set to ``value``; MISSING removes it; BLANK: what a reader
    must show for a damaged field (removed, or an empty object where a list holds objects)."""
    row = json.loads(json.dumps(row))
    parent = row
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    if value is BLANK:
        value = {} if isinstance(parent, list) and isinstance(parent[last], dict) else MISSING
    if value is MISSING:
        del parent[last]
    else:
        parent[last] = value
    return row


BLANK = object()


def test_every_field_damaged_is_skipped_or_shown_blank_with_a_warning(tiny_sweep, tmp_path, capsys, monkeypatch):
    """Each field of real rows (a tiny CPU sweep's, and the committed GPU runs' for what only a GPU
    writes), damaged one at a time in every way ``damages`` lists: nothing reading the rows fails,
    and each damaged row is either skipped or read with exactly the damaged field blank, with a
    warning naming its line and the field, or shows what the undamaged row shows."""
    from fitbench.cli import main
    from fitbench.results import store as store_module
    from fitbench.results.report import markdown_report

    sources = list(ResultStore(tiny_sweep.out).rows()) + committed_rows()
    for row in sources:  # undamaged, every row reads without a word
        assert check_row(json.loads(json.dumps(row)))[1:] == (None, []), row["label"]
    first = {}
    for index, row in enumerate(sources):
        for path, value in fields_of(row):
            if path not in first or (first[path][1] is None and value is not None):
                first[path] = (index, value)
    cases = [(sources[index], path, damage) for path, (index, value) in first.items()
             for damage in damages(value) + ([MISSING] if isinstance(path[-1], str) else [])]
    assert len(first) > 200 and len(cases) > 1000  # the fields really come from the rows

    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(tiny_sweep.out / "sweep.json", out / "sweep.json")
    (out / "results.jsonl").write_text("".join(json.dumps(changed(row, path, damage)) + "\n"
                                               for row, path, damage in cases))
    monkeypatch.setattr(store_module, "WARNINGS_MAX", len(cases))
    warnings: dict[int, str] = {}
    store = ResultStore(out, on_bad_line=lambda message: warnings.setdefault(
        int(re.search(r": line (\d+) ", message).group(1)), message))
    rows = list(store.rows())
    skipped = {line for line, message in warnings.items() if message.endswith("; skipped")}
    read = [case for line, case in enumerate(cases, start=1) if line not in skipped]
    assert len(rows) == len(read) and skipped

    def shown(row: dict) -> tuple[str, list]:
        """All the Markdown report and the terminal table show of ``row``."""
        row = typed_row(row)[0]
        return markdown_report([row]), table_cells(row, row.spec["model"])

    lines = [line for line in range(1, len(cases) + 1) if line not in skipped]
    for line, read_row, (row, path, damage) in zip(lines, rows, read):
        case = (line, named(path), damage)
        warning = warnings.get(line)
        if damage is None or damage is MISSING:
            assert warning is None, case
            assert shown(read_row) == shown(changed(row, path, BLANK)), case
        elif warning is not None:
            assert f"`{named(path)}` is " in warning and warning.endswith("shown blank"), (case, warning)
            assert shown(read_row) == shown(changed(row, path, BLANK)), case
        elif reduce(lambda value, part: value[part], path, row) is not None:
            assert shown(read_row) == shown(row), case  # a field no report reads
    for line in skipped:
        _, path, _ = cases[line - 1]
        assert "without a valid" in warnings[line] and named(path).split("[")[0] in warnings[line], warnings[line]

    # A row read without a warning shows what its undamaged row shows (above); those read with fields
    # blank lay out like any other at a narrow width, and every row goes into the CSV.
    blanked = [read_row for line, read_row in zip(lines, rows) if line in warnings]
    text = render(blanked, 80)
    assert len(blanked) > 200 and "…" not in text and max(cell_len(line) for line in text.splitlines()) <= 80
    assert len(pd.read_csv(write_csv(typed(rows), tmp_path))) == len(rows)

    capsys.readouterr()
    # the table itself was rendered above; these are the commands around it
    for argv in (["report", str(out), "--markdown"], ["run", "--resume", str(out)]):
        code = main(argv)
        stdout, stderr = capsys.readouterr()
        assert code in (0, 1) and "Traceback" not in stderr, (argv, stderr[-2000:])
        assert f"line {min(skipped)} " in stderr and "shown blank" in stderr, argv
    assert "2 already finished" in stdout  # --resume ran nothing again
