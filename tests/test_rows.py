"""The typed row (``fitbench.results.row``): every new row carries its schema version and validates;
rows from before versions, and rows of a newer version, still read."""

import json
import re
import shutil

import pytest
from pydantic import ValidationError

from conftest import cli
from fitbench.launch.local import _read_result
from fitbench.results.row import SCHEMA_VERSION, Row, version
from fitbench.results.store import ResultStore
from test_report import committed_rows


def lines_of(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_new_row_carries_the_version_and_validates(tiny_sweep):
    rows = lines_of(tiny_sweep.out / "results.jsonl")
    assert rows and all(row["schema_version"] == SCHEMA_VERSION for row in rows)
    for row in rows:
        assert Row.model_validate(row).as_dict() == row  # every field declared, of its declared kind
    with pytest.raises(ValidationError, match="tokens_per_second"):  # a misspelled field fails where it is built
        Row(key="k", label="k", spec={}, status="ok", tokens_per_second=1.0)
    with pytest.raises(ValidationError, match="status"):
        Row(key="k", label="k", spec={}, status="finished")


def test_rows_from_before_versions_read_as_version_0(tiny_sweep, tmp_path, capsys):
    """Most committed GPU runs were written before rows had a version; so is a copy of the CPU sweep
    with the field taken out: both read without a word, `report` shows them and `--resume` counts
    them as finished. The committed runs written since carry the version."""
    committed = committed_rows()
    old = [row for row in committed if "schema_version" not in row]
    assert old and all(version(row) == 0 for row in old)
    assert all(version(row) == SCHEMA_VERSION for row in committed if "schema_version" in row)
    for row in old:
        Row.model_validate({**row, "schema_version": SCHEMA_VERSION})  # version 0 has version 1's fields

    out = tmp_path / "old"
    out.mkdir()
    shutil.copy(tiny_sweep.out / "sweep.json", out / "sweep.json")
    rows = lines_of(tiny_sweep.out / "results.jsonl")
    (out / "results.jsonl").write_text("".join(json.dumps({k: v for k, v in row.items() if k != "schema_version"})
                                               + "\n" for row in rows))
    warnings = []
    assert len(list(ResultStore(out, on_bad_line=warnings.append).rows())) == len(rows) and not warnings
    code, stdout, stderr = cli(["report", str(out)], capsys)
    assert code == 0 and "tiny" in stdout and not stderr
    code, stdout, stderr = cli(["run", "--resume", str(out)], capsys)
    assert code == 0 and f"{len(rows)} already finished" in stdout and not stderr


def test_a_row_of_a_newer_version_is_read_with_a_warning_naming_its_line(tiny_sweep, tmp_path, capsys):
    out = tmp_path / "newer"
    out.mkdir()
    first, *rest = lines_of(tiny_sweep.out / "results.jsonl")
    newer = {**first, "schema_version": SCHEMA_VERSION + 1, "field_of_the_future": {"a": 1}}
    (out / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in [*rest, newer]))
    warnings = []
    rows = list(ResultStore(out, on_bad_line=warnings.append).rows())
    assert [row["key"] for row in rows] == [row["key"] for row in [*rest, newer]]
    [warning] = warnings
    assert re.search(rf": line {len(rest) + 1} has schema version {SCHEMA_VERSION + 1}, newer", warning)
    assert not warning.endswith("skipped")
    code, stdout, stderr = cli(["report", str(out)], capsys)
    assert code == 0 and "Traceback" not in stderr and f"line {len(rest) + 1} has schema version" in stderr


def test_a_worker_result_off_the_schema_is_a_protocol_error(tmp_path):
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"status": "ok", "loss": ["low", 2.0]}))
    payload, problem = _read_result(path)
    assert payload is None and problem.startswith("the worker's result file has `loss.0`")
    path.write_text(json.dumps({"status": "ok", "tokens_per_second": 3.0}))
    assert "`tokens_per_second`" in _read_result(path)[1]
    path.write_text(json.dumps({"status": "ok", "loss": [1.5, float("nan")]}))
    payload, problem = _read_result(path)
    assert problem is None and payload["loss"][0] == 1.5  # a NaN loss is a finding, not a broken file


def test_a_row_the_type_does_not_fit_is_typed_with_what_it_left_out_named():
    """The renderers read ``Row``; a row read from a file is typed whatever it holds: an unknown
    status is kept as written, a field of the wrong kind or a field never declared is left out, and
    each is named (the store's warning quotes them); a null is blank without a word."""
    from fitbench.results.row import typed_row

    base = committed_rows()[0]
    row, problems = typed_row({**base, "status": "paused", "exit_code": "none", "attempts": ["text"],
                               "loss": [1.0, None], "colour": "red"})
    assert row.status == "paused" and row.exit_code is None and row.attempts is None and row.loss == [1.0]
    assert row.spec == base["spec"] and row.timing == base.get("timing")
    assert [problem.split(" is ")[0] for problem in problems] == ["`status`", "`exit_code`", "`attempts[0]`",
                                                                  "`colour`"]
    newer, problems = typed_row({**base, "schema_version": SCHEMA_VERSION + 1, "colour": "red"})
    assert not problems and newer.schema_version == SCHEMA_VERSION + 1  # the store says the row is newer
    old, problems = typed_row({key: value for key, value in base.items() if key not in ("schema_version", "label")})
    assert not problems and old.schema_version == 0 and old.label == base["key"]
