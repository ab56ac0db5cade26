"""The calibration's overheads from several runs of one kind of step: the largest context, since a
sampled NVML peak can only read short of it."""

import pytest

from fitbench.launch.calibrate import CALIBRATION_RUNS, overheads_of_runs

MB = 1e6


def gpu(nvml: float, reserved: float, allocated: float) -> dict:
    return {"nvml_peak_used": nvml, "peak_reserved": reserved, "peak_allocated": allocated}


def test_largest_context_over_runs_by_hand():
    # the 1B generation's ranks on one host: 3035 - 2240 = 795 MB, and one rank's sample short at 2972 MB
    runs = [gpu(2972 * MB, 2240 * MB, 2181 * MB), gpu(3035 * MB, 2240 * MB, 2181 * MB),
            gpu(3014 * MB, 2240 * MB, 2181 * MB)]
    context, workspace = overheads_of_runs(runs, tensors=2114 * MB)
    assert context == pytest.approx(795 * MB)
    assert workspace == pytest.approx(67 * MB)  # 2181 - 2114


def test_one_short_run_alone_reads_short():
    context, _ = overheads_of_runs([gpu(2972 * MB, 2240 * MB, 2181 * MB)], tensors=0.0)
    assert context == pytest.approx(732 * MB)


def test_no_runs_is_an_error():
    with pytest.raises(ValueError):
        overheads_of_runs([], tensors=0.0)


def test_several_runs_by_default():
    assert CALIBRATION_RUNS >= 3
