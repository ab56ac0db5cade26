"""The host's launch time per operator (fitbench.worker.host_speed), by hand on a clock the test drives,
and as a worker's row records it."""

import math

import torch

from conftest import cli
from fitbench.results.store import ResultStore
from fitbench.worker import host_speed


def test_the_figure_is_the_median_repeat_over_its_operators(monkeypatch):
    # a clock read twice per repeat: the repeats take 10, 30 and 20 ms, so the median is 20 ms over 10 ops
    readings = iter([0.0, 0.010, 1.0, 1.030, 2.0, 2.020])
    monkeypatch.setattr(host_speed.time, "perf_counter", lambda: next(readings))
    assert math.isclose(host_speed.host_launch_seconds(torch.device("cpu"), ops=10, repeats=3), 0.020 / 10)


def test_a_real_launch_takes_between_a_nanosecond_and_a_millisecond():
    figures = [host_speed.host_launch_seconds(torch.device("cpu"), ops=200, repeats=3) for _ in range(2)]
    assert all(1e-9 < figure < 1e-3 for figure in figures)


def test_a_cpu_run_records_it_in_its_environment(tmp_path, capsys):
    code, _, err = cli(["run", "--models", "tiny", "--device", "cpu", "--mode", "infer", "--batch-size", "1",
                        "--seq-len", "16", "--new-tokens", "2", "--warmup-steps", "0", "--measure-steps", "1",
                        "--out", str(tmp_path)], capsys)
    assert code == 0, err
    (row,) = ResultStore(tmp_path).typed_rows()
    assert 1e-9 < row.environment["host_launch_s"] < 1e-3
