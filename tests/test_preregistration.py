"""Forecasts registered before a run (``fitbench plan --preregister``) and set beside what ran (``fitbench report
--preregistered``): the file, the pairing with the row that ran each configuration, both errors by hand."""

import json

import pytest

from conftest import cli
from fitbench.results.preregistration import CONFIGURATION, paired, read_registrations, registration
from fitbench.util.errors import UserError

CONFIG = {"model": "7B", "mode": "infer", "precision": "bf16-pure", "batch_size": 8, "seq_len": 512, "new_tokens": 32,
          "activation_checkpointing": False, "checkpointed_layers": None, "compile": False,
          "layout": {"dp_replicate": 1, "dp_shard": 1, "tp": 2, "pp": 1, "replicas": 1}, "backend": "native"}


def row(status="ok", peaks=(40e9, 42e9), tokens_per_s=1000.0, **spec) -> dict:
    """A row of CONFIG (infer: its decode's tokens/s is ``tokens_per_s``, its prefill's ten times that)."""
    layout = {key: value for key, value in CONFIG["layout"].items() if key != "replicas"}  # an older row's
    spec = {**CONFIG, "layout": layout, **spec}
    throughput = ({"decode_tokens_per_s": tokens_per_s, "prefill_tokens_per_s": 10 * tokens_per_s}
                  if spec["mode"] == "infer" else {"tokens_per_s": tokens_per_s})
    return {"status": status, "spec": spec, "memory": {"gpus": [{"nvml_peak_used": peak} for peak in peaks]},
            "throughput": throughput}


def test_a_registration_is_paired_with_the_row_that_ran_it_and_its_errors_are_by_hand():
    entry = registration(CONFIG, "NVIDIA H100 80GB HBM3", 2, 43.5e9, 1150.0, "fitbench plan ...")
    rows = [row(precision="int8"), row(status="oom"), row(), row(tokens_per_s=5.0)]
    (pair,) = paired([entry], rows)
    assert pair.row is rows[2]  # the first ok row of that configuration; a missing replicas degree counts as 1
    assert pair.measured_peak_bytes == 42e9  # the largest GPU's
    assert pair.peak_error == pytest.approx((43.5e9 - 42e9) / 42e9)
    assert pair.speed_error == pytest.approx((1150 - 1000) / 1000)
    (unmatched,) = paired([entry], [row(batch_size=4)])
    assert unmatched.row is None and unmatched.peak_error is None and unmatched.speed_error is None


def test_a_mode_that_generates_nothing_pairs_whatever_its_new_tokens():
    entry = registration({**CONFIG, "mode": "forward", "new_tokens": 128}, None, 2, 1e9, 1.0, "")
    assert paired([entry], [row(mode="forward", new_tokens=7)])[0].row is not None
    with pytest.raises(ValueError, match="missing: layout"):
        registration({key: CONFIG[key] for key in CONFIGURATION if key != "layout"}, None, 1, 1.0, 1.0, "")


def test_a_registration_pairs_only_a_row_of_its_backend_and_an_older_one_without_it_either():
    entry = registration(CONFIG, None, 2, 1e9, 1.0, "")
    assert paired([entry], [row(backend="hf")])[0].row is None
    older = {**entry, "configuration": {key: value for key, value in entry["configuration"].items() if key != "backend"}}
    assert paired([older], [row(backend="hf")])[0].row is not None


def test_plan_registers_its_choice_and_report_sets_it_beside_the_run(tmp_path, capsys):
    registered = tmp_path / "forecasts.json"
    shape = ["--mode", "forward", "--seq-len", "16"]
    code, _, err = cli(["plan", "--models", "tiny", *shape, "--precision", "fp32", "--gpu", "H100-80GB",
                        "--preregister", str(registered)], capsys)
    assert code == 0 and "registered 1 forecast(s)" in err
    (entry,) = read_registrations(registered)
    configuration = entry["configuration"]
    assert (configuration["model"], configuration["precision"], configuration["mode"]) == ("tiny", "fp32", "forward")
    assert configuration["backend"] == "native"  # the family's own, auto
    assert entry["gpu"] == "NVIDIA H100 80GB HBM3" and entry["predicted_peak_bytes"] > 0
    # a registration is never rewritten
    code, _, err = cli(["plan", "--models", "tiny", *shape, "--gpu", "H100-80GB", "--preregister", str(registered)],
                       capsys)
    assert code == 2 and "exists already" in err
    out = tmp_path / "ran"
    code, _, err = cli(["run", "--models", "tiny", *shape, "--precision", "fp32", "--batch-size",
                        str(configuration["batch_size"]), "--device", "cpu", "--warmup-steps", "0", "--measure-steps",
                        "1", "--out", str(out)], capsys)
    assert code == 0, err
    (ran,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    code, shown, err = cli(["report", str(out), "--preregistered", str(registered), "--markdown"], capsys)
    assert code == 0, err
    line = next(line for line in shown.splitlines() if line.startswith("| tiny forward fp32"))
    by_hand = (entry["forecast_tokens_per_s"] - ran["throughput"]["tokens_per_s"]) / ran["throughput"]["tokens_per_s"]
    assert f"{by_hand:+.1%}" in line and line.rstrip(" |").endswith("ran")


def test_bad_registration_files_are_one_paragraph(tmp_path, capsys):
    (tmp_path / "x.json").write_text("{")
    for name in ("x.json", "none.json"):
        with pytest.raises(UserError, match="preregistered: .*Give the file"):
            read_registrations(tmp_path / name)
    code, _, err = cli(["plan", "--models", "tiny", "--requirements", "--gpu", "H100-80GB", "--preregister",
                        str(tmp_path / "r.json")], capsys)
    assert code == 2 and "preregister:" in err and not (tmp_path / "r.json").exists()
