"""The ``fitbench`` command end to end: real worker processes, real files."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
import torch
from transformers import LlamaConfig

from fitbench.config import SweepConfig, expand, load_yaml, merge_sources
from fitbench.models.presets import PRESETS
from fitbench.models.registry import resolve
from fitbench.planning.calibration import TENSORS_ONLY
from fitbench.results.store import ResultStore
from fitbench.spec import Assignment, Layout, RunSpec
from fitbench.util.errors import UserError
from conftest import cli

SMALL_SHAPES = ["--batch-size", "1", "--seq-len", "16", "--new-tokens", "4", "--warmup-steps", "1",
                "--measure-steps", "2"]
# Without infer, --new-tokens would change nothing, and is refused.
NO_GENERATION_SHAPES = [word for word in SMALL_SHAPES if word not in ("--new-tokens", "4")]
ROW_FIELDS = {"key", "label", "spec", "status", "timing", "throughput", "memory", "environment", "command", "params",
              "non_embedding_params", "started_at", "finished_at", "exit_code", "calibration"}


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    """Each test runs in its own directory: nothing lands in the checkout, not even a core file."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FITBENCH_INJECT", raising=False)


def fitbench(*args: str, cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fitbench", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def rows_of(out: Path) -> list[dict]:
    return list(ResultStore(out).rows())


def write_local_model(directory: Path) -> Path:
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=256, max_position_embeddings=128).save_pretrained(directory)
    return directory


# ---- full runs ----------------------------------------------------------------------------------


def test_run_writes_jsonl_csv_and_table(tiny_sweep):
    out, args = tiny_sweep.out, tiny_sweep.args
    assert args[1:] == ["--models", "tiny", "--mode", "train", "infer", *SMALL_SHAPES, "--out", str(out)]
    stdout = "".join(line for line, _, _ in tiny_sweep.lines) + tiny_sweep.rest
    assert "Traceback" not in tiny_sweep.stderr

    rows = rows_of(out)
    assert [row["spec"]["mode"] for row in rows] == ["train", "infer"]
    tiny = resolve("tiny")
    for row in rows:
        assert ROW_FIELDS <= set(row), ROW_FIELDS - set(row)
        assert row["status"] == "ok", row.get("error")
        assert row["key"] == RunSpec(**row["spec"]).key
        assert row["spec"]["model"] == "tiny" and row["spec"]["device"] == "cpu"
        assert row["spec"]["batch_size"] == 1 and row["spec"]["seq_len"] == 16
        assert row["spec"]["warmup_steps"] == 1 and row["spec"]["measure_steps"] == 2
        assert row["spec"]["backend"] == "native" and row["spec"]["precision"] == "fp32"
        assert row["params"] == tiny.total_params
        assert row["non_embedding_params"] == tiny.non_embedding_params
        assert row["environment"]["torch"] == torch.__version__
        assert row["command"] == shlex.join(["fitbench", *args])
        assert row["calibration"] == TENSORS_ONLY and row["prediction"] is None  # no budget on a CPU: no plan
        assert row["memory"]["host_peak_rss"] > 0
        assert row["exit_code"] == 0
        assert Path(row["log"]).is_file()
    train, infer = rows
    assert train["timing"]["step"]["count"] == 2
    assert train["throughput"]["tokens_per_s"] == pytest.approx(16 / train["timing"]["step"]["median"])
    assert infer["spec"]["new_tokens"] == 4
    assert infer["decode"] == {"cuda_graphs": False, "reason": "CUDA graphs need a GPU; this run is on cpu"}
    assert infer["timing"]["token_latency"]["count"] == 2 * 3
    assert infer["throughput"]["decode_tokens_per_s"] == pytest.approx(1 / infer["timing"]["token_latency"]["median"])
    assert len({row["key"] for row in rows}) == 2

    table = pd.read_csv(out / "results.csv")
    assert len(table) == 2
    assert list(table["key"]) == [row["key"] for row in rows]
    assert list(table["status"]) == ["ok", "ok"]
    assert list(table["spec.model"]) == ["tiny", "tiny"]
    assert list(table["spec.mode"]) == ["train", "infer"]
    assert "timing.step.median" in table.columns
    assert not any(column.startswith("timing.samples") for column in table.columns)

    sweep = json.loads((out / "sweep.json").read_text())
    assert sweep["config"]["models"] == ["tiny"] and sweep["device"] == "cpu"

    assert "tiny" in stdout
    assert "fitbench results" in stdout
    # labels carry the backend in brackets; they must reach the terminal as written
    assert "tiny train fp32 1x16 [native]" in stdout
    assert "tiny infer fp32 1x16+4 [native]" in stdout


def test_seed_spelling_of_the_options(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["run", "--models", "tiny", "--samples", "2", "--context-length", "16", "--pass-type", "backward",
            "--batch-size", "1", "--warmup-steps", "1", "--out", str(out)]
    code, stdout, stderr = cli(argv, capsys)
    assert code == 0, stdout + stderr
    (row,) = rows_of(out)
    assert row["status"] == "ok", row.get("error")
    assert row["spec"]["mode"] == "forward-backward"
    assert row["spec"]["seq_len"] == 16
    assert row["spec"]["measure_steps"] == 2
    assert row["timing"]["step"]["count"] == 2
    assert row["throughput"]["tokens_per_step"] == 16
    assert row["command"] == shlex.join(["fitbench", *argv])


def test_yaml_config_with_the_seeds_layout_and_cli_override(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(
        "models:\n"
        "  sizes: [tiny]\n"
        "mode: forward\n"
        "batch_size: 2\n"
        "context_length: 16\n"
        "warmup-steps: 1\n"
        "samples: 2\n"
        "precision: fp32\n"
    )
    out = tmp_path / "out"
    code, stdout, stderr = cli(["run", "--config", str(config), "--batch-size", "1", "--out", str(out)], capsys)
    assert code == 0, stderr
    (row,) = rows_of(out)
    assert row["status"] == "ok", row.get("error")
    assert row["spec"]["model"] == "tiny"
    assert row["spec"]["mode"] == "forward"
    assert row["spec"]["batch_size"] == 1  # the command line wins over the file
    assert row["spec"]["seq_len"] == 16 and row["spec"]["warmup_steps"] == 1
    assert row["timing"]["step"]["count"] == 2
    assert row["throughput"]["flops_per_token"] == resolve("tiny").forward_flops_per_token(16)


def test_precedence_of_cli_file_and_defaults(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("models: {sizes: [tiny]}\nmode: forward\nbatch_size: 2\ncontext_length: 64\nsamples: 3\n")
    file = load_yaml(config)
    assert file["models"] == ["tiny"]

    merged = merge_sources({"warmup_steps": 7, "batch_size": [5]}, file, {"batch_size": [1]})
    assert merged.batch_size == [1] and merged.warmup_steps == 7
    assert merged.seq_len == [64] and merged.measure_steps == 3 and merged.mode == ["forward"]

    # an alias on the command line overrides the field in the file, and the reverse
    merged = merge_sources({}, file, {"pass_type": "backward", "seq_len": [16], "measure_steps": 2})
    assert merged.mode == ["forward-backward"]
    assert merged.seq_len == [16] and merged.measure_steps == 2
    merged = merge_sources({"seq_len": [128], "measure_steps": 10}, file, {})
    assert merged.seq_len == [64] and merged.measure_steps == 3

    specs = expand(merge_sources({}, file, {}), device="cpu", default_models=["small"])
    assert [(s.model, s.mode, s.batch_size, s.seq_len) for s in specs] == [("tiny", "forward", 2, 64)]


def test_default_sweep_on_a_cpu():
    specs = expand(SweepConfig(), device="cpu", default_models=["tiny", "small"])
    assert [(s.model, s.mode) for s in specs] == [("tiny", "train"), ("tiny", "infer"),
                                                 ("small", "train"), ("small", "infer")]
    assert all(s.precision == "fp32" and s.batch_size == 1 and s.seq_len == 128 for s in specs)
    assert all(s.new_tokens == 32 for s in specs)
    # the key ignores new_tokens outside infer, and tells every other field apart
    train, infer = specs[0], specs[1]
    assert train.key == train.model_copy(update={"new_tokens": 99}).key
    assert infer.key != infer.model_copy(update={"new_tokens": 99}).key
    assert len({s.key for s in specs}) == len(specs)


def test_cuda_graphs_option_file_key_and_label(tmp_path):
    from fitbench.cli import build_parser

    assert build_parser().parse_args(["run", "--no-cuda-graphs"]).cuda_graphs is False
    assert build_parser().parse_args(["run", "--cuda-graphs"]).cuda_graphs is True
    assert "cuda_graphs" not in vars(build_parser().parse_args(["run"]))  # the file or the default decides
    config = tmp_path / "config.yaml"
    config.write_text("models: [tiny]\nmode: infer\ncuda-graphs: false\n")
    assert merge_sources({}, load_yaml(config), {}).cuda_graphs is False
    assert merge_sources({}, load_yaml(config), {"cuda_graphs": True}).cuda_graphs is True
    assert SweepConfig().cuda_graphs is True

    fields = dict(model="7B", backend="native", precision="bf16-pure", batch_size=1, seq_len=128, new_tokens=128,
                  device="cuda:0", warmup_steps=5, measure_steps=10)
    infer, train = RunSpec(mode="infer", **fields), RunSpec(mode="train", **fields)
    # keys computed before the field existed: results of earlier sweeps keep matching their configurations
    assert (infer.key, train.key) == ("157593d2627d", "8c26ffea4e50")
    eager = infer.model_copy(update={"cuda_graphs": False})
    assert eager.key != infer.key
    assert eager.label == "7B infer bf16-pure 1x128+128 no-cuda-graphs [native]"
    # where graphs never run, turning them off changes nothing
    for same in (train, infer.model_copy(update={"backend": "hf"})):
        off = same.model_copy(update={"cuda_graphs": False})
        assert off.key == same.key and off.label == same.label
    specs = expand(merge_sources({}, load_yaml(config), {}), device="cpu", default_models=["tiny"])
    assert [s.cuda_graphs for s in specs] == [False]


def test_decode_tuning_option_file_key_label_and_worker(tmp_path):
    from fitbench.cli import build_parser
    from fitbench.models.backends import DECODE_TUNING
    from fitbench.precisions import policy
    from fitbench.worker.build import build

    assert build_parser().parse_args(["run", "--decode-tuning"]).decode_tuning is True
    assert "decode_tuning" not in vars(build_parser().parse_args(["run"]))
    config = tmp_path / "config.yaml"
    config.write_text("models: [tiny]\nmode: infer\ndecode-tuning: true\n")
    assert merge_sources({}, load_yaml(config), {}).decode_tuning is True
    assert SweepConfig().decode_tuning is False
    specs = expand(merge_sources({}, load_yaml(config), {}), device="cpu", default_models=["tiny"])
    assert [s.decode_tuning for s in specs] == [True]

    fields = dict(model="7B", backend="native", precision="bf16-pure", batch_size=1, seq_len=128, new_tokens=128,
                  device="cuda:0", warmup_steps=5, measure_steps=10)
    infer = RunSpec(mode="infer", **fields)
    assert infer.key == "157593d2627d"  # as before the field existed
    tuned = infer.model_copy(update={"decode_tuning": True})
    assert tuned.key != infer.key and tuned.label == "7B infer bf16-pure 1x128+128 decode-tuning [native]"
    # where no compiled decode step runs, tuning it changes nothing
    for same in (RunSpec(mode="train", **fields), infer.model_copy(update={"compile_decode": False}),
                 infer.model_copy(update={"backend": "hf"})):
        assert same.model_copy(update={"decode_tuning": True}).key == same.key
    # the worker hands inductor's options to the decode step's compile alone
    tiny = specs[0].model_copy(update={"batch_size": 1, "seq_len": 8, "new_tokens": 2})
    built = build(Assignment(spec=tiny), resolve("tiny"), policy(tiny.precision), torch.device("cpu"), tmp_path)
    assert built.lm.decode_options == DECODE_TUNING


def test_symmetric_memory_option_file_key_and_label(tmp_path):
    from fitbench.cli import build_parser

    assert build_parser().parse_args(["run", "--no-symmetric-memory"]).symmetric_memory is False
    assert SweepConfig().symmetric_memory is True
    config = tmp_path / "config.yaml"
    config.write_text("models: [tiny]\nsymmetric-memory: false\n")
    assert merge_sources({}, load_yaml(config), {}).symmetric_memory is False
    fields = dict(model="7B", backend="native", precision="bf16-pure", batch_size=1, seq_len=128, new_tokens=128,
                  device="cuda:0", warmup_steps=5, measure_steps=10)
    tp = RunSpec(mode="infer", layout=Layout(tp=2), **fields)
    nccl = tp.model_copy(update={"symmetric_memory": False})
    assert nccl.key != tp.key and nccl.label == "7B infer bf16-pure 1x128+128 no-symmetric-memory tp x 2 [native]"
    assert tp.label == "7B infer bf16-pure 1x128+128 tp x 2 [native]"
    # where no tensor-parallel compiled generation runs on GPUs, the choice changes nothing
    for same in (RunSpec(mode="infer", **fields), tp.model_copy(update={"compile_decode": False}),
                 tp.model_copy(update={"device": "cpu"}), RunSpec(mode="train", layout=Layout(tp=2), **fields)):
        assert same.model_copy(update={"symmetric_memory": False}).key == same.key
        assert "symmetric" not in same.model_copy(update={"symmetric_memory": False}).label


def test_injected_crash_is_recorded_and_the_sweep_goes_on(tmp_path, capsys, monkeypatch):
    other = str(write_local_model(tmp_path / "other"))
    out = tmp_path / "out"
    monkeypatch.setenv("FITBENCH_INJECT", "crash:tiny")
    code, stdout, stderr = cli(["run", "--models", "tiny", other, "--mode", "infer", *SMALL_SHAPES,
                                "--out", str(out)], capsys)
    assert code == 1, stderr  # configurations ran, and some did not finish ok
    rows = rows_of(out)
    assert [(row["spec"]["model"], row["spec"]["mode"]) for row in rows] == [("tiny", "infer"), (other, "infer")]
    crashed, ok = rows
    assert crashed["status"] == "crashed"
    assert "SIGABRT" in crashed["error"]
    assert "FITBENCH_INJECT" in crashed["error"]  # the tail of the worker's log comes along
    assert crashed["exit_code"] == -signal.SIGABRT
    assert "timing" not in crashed
    assert ok["status"] == "ok", ok.get("error")
    assert ok["params"] == resolve(other).total_params
    assert "crashed" in stdout
    assert "1 of 2 configuration(s) did not finish" in stdout
    printed = " ".join(stdout.split())
    assert "(tiny infer fp32 1x16+4 [native]: crashed)" in printed
    table = pd.read_csv(out / "results.csv")
    assert list(table["status"]) == ["crashed", "ok"]


def test_what_is_predicted_not_to_fit_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    # The injected memory limit makes this CPU a device of that size, for the planner and the worker
    # alike: tiny infer bf16-pure fits at batch 1, to the byte, and not at batch 2.
    from fitbench.planning.memory import estimate_memory

    def peak(precision: str, batch: int, resident: int | None = None) -> float:
        return estimate_memory(resolve("tiny"), "infer", precision, batch, 16, new_tokens=4,
                               resident_layers=resident).peak_bytes

    budget = int(peak("bf16-pure", 1)) + 1
    assert peak("bf16-pure", 2) > budget
    monkeypatch.setenv("FITBENCH_INJECT", f"mem-limit:{budget}")
    out = tmp_path / "out"
    code, stdout, stderr = cli(["run", "--models", "tiny", "--mode", "infer", "--precision", "bf16-pure",
                                "--batch-size", "2", "1", "--seq-len", "16", "--new-tokens", "4", "--warmup-steps",
                                "1", "--measure-steps", "1", "--out", str(out)], capsys)
    assert code == 1, stderr
    refused, fitting = rows_of(out)
    assert refused["spec"]["batch_size"] == 2 and fitting["spec"]["batch_size"] == 1
    assert refused["status"] == "refused" and "timing" not in refused
    assert list((out / "logs").glob(f"{refused['key']}*")) == []  # no worker started for it
    prediction = refused["prediction"]
    assert not prediction["fits"] and prediction["predicted_peak_bytes"] == peak("bf16-pure", 2)
    need = f"{peak('bf16-pure', 2) / 1e6:.0f} MB"
    assert refused["error"].startswith(f"refused before launch: tiny infer in bf16-pure at batch 2 x 16 tokens is "
                                       f"predicted to need {need} on one GPU of {budget / 1e6:.0f} MB; it fits ")
    # Every alternative is predicted to fit within the budget, and the reason names each.
    alternatives = {a["change"]: a for a in prediction["alternatives"]}
    assert alternatives["at batch 1"]["predicted_peak_bytes"] == peak("bf16-pure", 1) <= budget
    for change, alternative in alternatives.items():
        assert alternative["predicted_peak_bytes"] <= budget, change
        assert change in refused["error"]
    (offload,) = [a for name, a in alternatives.items() if name.startswith("with --offload")]
    resident = offload["candidate"]["resident_layers"]
    assert peak("bf16-pure", 2, resident) <= budget < peak("bf16-pure", 2, resident + 1)
    # The fitting one ran as planned, its prediction beside what was measured.
    assert fitting["status"] == "ok", fitting.get("error")
    assert fitting["prediction"]["fits"] and fitting["prediction"]["predicted_peak_bytes"] == peak("bf16-pure", 1)
    # Every row says which calibration its prediction used: on a CPU, none.
    assert refused["calibration"] == fitting["calibration"] == prediction["calibration"] == TENSORS_ONLY
    printed = " ".join(stdout.split())
    assert f"refused {refused['label']}: refused before launch" in printed
    assert "1 of 2 configuration(s) did not finish" in printed


def test_timeout_kills_the_worker(tmp_path, capsys):
    out = tmp_path / "out"
    started = time.monotonic()
    code, stdout, stderr = cli(["run", "--models", "tiny", "--mode", "forward", *NO_GENERATION_SHAPES, "--timeout",
                                "0.3", "--out", str(out)], capsys)
    assert code == 1, stderr
    (row,) = rows_of(out)
    assert row["status"] == "timeout"
    assert "timeout" in row["error"]
    assert row["exit_code"] == -signal.SIGKILL
    assert time.monotonic() - started < 60


# ---- resume -------------------------------------------------------------------------------------


def test_resume_after_the_sweep_is_killed(tmp_path, capsys):
    out = tmp_path / "out"
    # two configurations: the kill lands after the first row, so the second is what --resume runs
    args = ["run", "--models", "tiny", "--mode", "forward", "infer", *SMALL_SHAPES, "--out", str(out)]
    parent = subprocess.Popen([sys.executable, "-m", "fitbench", *args], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "TMPDIR": str(tmp_path)})
    workers: set[psutil.Process] = set()
    try:
        deadline = time.monotonic() + 240
        while not rows_of(out):
            assert parent.poll() is None, "the sweep ended before it could be interrupted"
            assert time.monotonic() < deadline, "no row within the deadline"
            try:
                workers.update(psutil.Process(parent.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.05)
        try:
            workers.update(psutil.Process(parent.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        # the worker dies with its parent (tests/test_processes.py); let it end, then make sure
        _, alive = psutil.wait_procs(list(workers), timeout=60)
        for process in alive:
            process.kill()
    before = rows_of(out)
    assert len(before) == 1
    assert all(row["status"] == "ok" for row in before)

    # a kill in the middle of a write leaves a partial last line
    with (out / "results.jsonl").open("a") as handle:
        handle.write('{"key": "cut-short", "status": "ok", "spec": {"mod')

    code, stdout, stderr = cli(["run", "--resume", str(out)], capsys)
    assert code == 0, stderr
    assert f"{len(before)} already finished" in stdout

    after = rows_of(out)
    assert len(after) == 2
    keys = [row["key"] for row in after]
    assert len(set(keys)) == 2
    assert sorted(row["spec"]["mode"] for row in after) == ["forward", "infer"]
    assert all(row["status"] == "ok" for row in after), [row.get("error") for row in after]
    for old in before:
        (new,) = [row for row in after if row["key"] == old["key"]]
        assert new["started_at"] == old["started_at"]
        assert new["timing"] == old["timing"]
    # the saved settings applied: the same shapes as the first run
    assert all(row["spec"]["seq_len"] == 16 and row["spec"]["measure_steps"] == 2 for row in after)
    assert len(pd.read_csv(out / "results.csv")) == 2

    # resuming a finished sweep runs nothing
    code, stdout, _ = cli(["run", "--resume", str(out)], capsys)
    assert code == 0
    assert "2 already finished" in stdout
    assert len(rows_of(out)) == 2


def stored_row(key: str, **fields) -> dict:
    """A row as the store keeps it: a key, a status and the spec fields every report reads."""
    return {"key": key, "status": "ok", "label": key,
            "spec": {"model": "tiny", "mode": "train", "precision": "fp32", "batch_size": 1, "seq_len": 16}, **fields}


def test_result_store_skips_a_truncated_last_line(tmp_path):
    store = ResultStore(tmp_path / "store")
    assert list(store.rows()) == [] and store.finished_keys() == set()
    store.append(stored_row("a", value=1))
    with store.path.open("a") as handle:
        handle.write('{"key": "b", "val')
    assert [row["key"] for row in store.rows()] == ["a"]
    store.append(stored_row("c", value=[1, 2]))
    assert [row["key"] for row in store.rows()] == ["a", "c"]
    assert store.finished_keys() == {"a", "c"}
    lines = store.path.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2]) == stored_row("c", value=[1, 2])
    assert store.load_sweep() is None
    store.save_sweep({"config": {"models": ["tiny"]}})
    assert store.load_sweep() == {"config": {"models": ["tiny"]}}


# ---- bad input ------------------------------------------------------------------------------------


def check_user_error(code: int, stderr: str, *fields: str) -> None:
    assert code == 2
    assert "Traceback" not in stderr
    message = stderr.strip()
    assert message and len(message.splitlines()) == 1, message
    for field in fields:
        assert field in message, (field, message)


@pytest.mark.parametrize("argv, fields", [
    (["--models", "llama2-7b"], ["models", "llama2-7b", "llama-2-7b"]),
    (["--models", "tiny", "--batch-size", "0"], ["batch_size", "--batch-size"]),
    (["--models", "tiny", "--batch-size", "-4"], ["batch_size"]),
    (["--models", "tiny", "--seq-len", "5000"], ["seq_len", "5000", "1024"]),
    (["--models", "tiny", "--mode", "infer", "--seq-len", "1020", "--new-tokens", "8"], ["seq_len", "new_tokens"]),
    (["--models", "tiny", "--precision", "bf17"], ["--precision", "bf17"]),
    (["--models", "tiny", "--mode", "fly"], ["--mode", "fly"]),
    (["--models", "tiny", "--batch-size", "two"], ["--batch-size", "two"]),
    (["--models", "tiny", "--measure-steps", "0"], ["measure_steps"]),
    (["--models", "tiny", "--new-tokens", "1"], ["new_tokens"]),
    (["--models", "tiny", "--device", "tpu"], ["device", "tpu"]),
    # offload: inference only (the default modes include train), floating-point weights, native, no compile
    (["--models", "tiny", "--offload"], ["offload:", "--mode infer or forward", "train"]),
    (["--models", "tiny", "--mode", "infer", "--precision", "int8", "--offload"], ["offload:", "int8", "bf16-pure"]),
    (["--models", "tiny", "--mode", "infer", "--backend", "hf", "--offload"], ["offload:", "--backend native"]),
    (["--models", "gpt2", "--mode", "infer", "--offload"], ["offload:", "--backend native"]),
    (["--models", "tiny", "--mode", "forward", "--compile", "--offload"], ["offload:", "--compile"]),
])
def test_bad_options(argv, fields, tmp_path, capsys):
    code, stdout, stderr = cli(["run", *argv, "--out", str(tmp_path / "out")], capsys)
    check_user_error(code, stderr, *fields)
    assert not (tmp_path / "out" / "results.jsonl").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU that this machine lacks")
def test_cuda_on_a_machine_without_a_gpu(tmp_path, capsys):
    code, _, stderr = cli(["run", "--models", "tiny", "--device", "cuda", "--out", str(tmp_path / "out")], capsys)
    check_user_error(code, stderr, "device", "cuda", "--device cpu")


@pytest.mark.parametrize("text, fields", [
    ("models: [tiny\nmode: forward\n", ["config", "not valid YAML", "line"]),
    ("models: [tiny]\nbatchsize: 2\n", ["batchsize", "unknown field"]),
    ("models: {names: [tiny]}\n", ["config", "sizes"]),
    ("- tiny\n- small\n", ["config", "mapping"]),
    ("models: [tiny]\nprecision: bf17\n", ["precision", "bf17"]),
    ("models: [tiny]\npass_type: [backward]\n", ["pass_type"]),
])
def test_bad_config_files(text, fields, tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(text)
    code, _, stderr = cli(["run", "--config", str(config), "--out", str(tmp_path / "out")], capsys)
    check_user_error(code, stderr, *fields)


def test_missing_config_file(tmp_path, capsys):
    code, _, stderr = cli(["run", "--config", str(tmp_path / "nowhere.yaml")], capsys)
    check_user_error(code, stderr, "config", "nowhere.yaml")


def test_resume_of_a_directory_without_a_sweep(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, _, stderr = cli(["run", "--resume", str(tmp_path / "empty")], capsys)
    check_user_error(code, stderr, "resume", "sweep.json")


def test_bad_input_in_a_real_process(tmp_path):
    # both at once: each takes seconds of CPU to start (torch), then says one line
    runs = [subprocess.Popen([sys.executable, "-m", "fitbench", "run", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=tmp_path)
            for args in (["--models", "llama2-7b"], ["--precision", "bf17"])]
    (model_out, model_err), (precision_out, precision_err) = (run.communicate(timeout=300) for run in runs)
    check_user_error(runs[0].returncode, model_err, "llama-2-7b")
    assert model_out == ""
    check_user_error(runs[1].returncode, precision_err, "--precision")
    assert not (tmp_path / "fitbench-results").exists()


def test_user_errors_are_raised_not_printed():
    with pytest.raises(UserError) as error:
        expand(SweepConfig(models=["tiny"], seq_len=[2048]), device="cpu", default_models=[])
    assert str(error.value).startswith("seq_len:")


# ---- the other commands ---------------------------------------------------------------------------


def test_models_lists_every_preset(capsys):
    code, stdout, _ = cli(["models"], capsys)
    assert code == 0
    for arch in PRESETS:
        assert f" {arch.name} " in stdout, arch.name
        assert f"{arch.total_params:,}" in stdout

    code, stdout, _ = cli(["models", "--json"], capsys)
    assert code == 0
    listed = json.loads(stdout)
    assert [entry["name"] for entry in listed] == [arch.name for arch in PRESETS]
    for entry in listed:
        arch = resolve(entry["name"])
        assert entry["total_params"] == arch.total_params
        assert entry["non_embedding_params"] == arch.non_embedding_params
        assert (entry["layers"], entry["hidden"], entry["vocab"]) == (arch.num_layers, arch.hidden_size,
                                                                      arch.vocab_size)
        assert entry["source"]

    code, stdout, _ = cli(["models", "--sources"], capsys)
    assert code == 0
    assert "meta-llama/Llama-2-7b-hf config.json" in stdout


def test_env_json(capsys):
    code, stdout, _ = cli(["env", "--json"], capsys)
    assert code == 0
    info = json.loads(stdout)
    assert info["torch"] == torch.__version__
    assert info["cpu_count"] == os.cpu_count()
    assert isinstance(info["gpus"], list)
    assert len(info["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_help(tmp_path, capsys):
    done = fitbench("--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for command in ("run", "models", "env"):
        assert command in done.stdout

    code, stdout, stderr = cli(["run", "--help"], capsys)
    assert code == 0
    for option in ("--models", "--mode", "--pass-type", "--precision", "--batch-size", "--context-length",
                   "--samples", "--resume", "--config", "--fallback", "--no-fallback", "--offload", "examples:"):
        assert option in stdout, option

    code, stdout, _ = cli(["--version"], capsys)
    assert code == 0 and "fitbench" in stdout


def test_plan_for_nodes_answers_in_nodes_and_prints_its_sbatch_lines(capsys):
    code, printed, errors = cli(["plan", "--models", "llama-2-70b", "--mode", "infer", "--gpu", "H100-80GB",
                                 "--gpus-per-node", "2", "--requirements"], capsys)
    assert code == 0, errors
    assert "min nodes" in printed and "#SBATCH --gpus-per-node=2" in printed and "#SBATCH --nodes=" in printed
    code, printed, errors = cli(["plan", "--models", "llama-2-70b", "--mode", "infer", "--gpu", "H100-80GB",
                                 "--gpus-per-node", "4", "--nodes", "2"], capsys)
    assert code == 0, errors
    assert "on 8 x" in printed and "#SBATCH --nodes=" in printed
    code, _, errors = cli(["plan", "--models", "7B", "--gpu", "H100-80GB", "--nodes", "2"], capsys)
    assert code == 2 and "--gpus-per-node" in errors


@pytest.mark.parametrize("options, mode, expected, label", [
    ({"checkpointed_layers": 2}, "train", (True, 2), " recompute 2 layers [native]"),
    ({"checkpointed_layers": 2, "activation_checkpointing": True}, "train", (True, 2), " recompute 2 layers"),
    ({"checkpointed_layers": 4}, "train", (True, None), " recompute [native]"),  # tiny's 4 layers: every one
    ({"checkpointed_layers": 40}, "forward-backward", (True, None), " recompute [native]"),
    ({"activation_checkpointing": True}, "train", (True, None), " recompute [native]"),
    ({"checkpointed_layers": 1, "gpus": 2, "strategy": "pipeline", "batch_size": [2]}, "train", (True, 1),
     " recompute 1 layer per stage pipeline x 2"),
    ({"checkpointed_layers": 2, "gpus": 2, "strategy": "pipeline", "batch_size": [2]}, "train", (True, None),
     " recompute pipeline x 2"),
])
def test_checkpointed_layers_expand_into_the_spec(options, mode, expected, label):
    """--checkpointed-layers N implies checkpointing in the training modes, counts per pipeline stage,
    and a count that covers every stage's layers is every layer: one configuration, one key and label."""
    [spec] = expand(SweepConfig(models=["tiny"], mode=[mode], **options), device="cpu", default_models=[])
    assert (spec.activation_checkpointing, spec.checkpointed_layers) == expected
    assert label in spec.label
    every = spec.model_copy(update={"checkpointed_layers": None})
    assert (spec.key == every.key) == (spec.checkpointed_layers is None)


def test_a_spec_counts_checkpointed_layers_only_with_checkpointing():
    fields = dict(model="tiny", backend="native", mode="train", precision="fp32", batch_size=1, seq_len=8,
                  new_tokens=2, device="cpu", warmup_steps=0, measure_steps=1)
    with pytest.raises(ValueError, match="activation_checkpointing is off"):
        RunSpec(**fields, checkpointed_layers=2)
    with pytest.raises(ValueError):
        RunSpec(**fields, activation_checkpointing=True, checkpointed_layers=0)
    assert RunSpec(**fields, activation_checkpointing=True).key == \
        RunSpec(**fields, activation_checkpointing=True, checkpointed_layers=None).key
