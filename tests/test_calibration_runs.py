"""The calibration's overheads from a row's memory report: the context the larger of its sampled NVML
peak less the reserved peak and its reading as the step ended, since a sampled peak can only read short."""

import pytest

from fitbench.launch.calibrate import overheads, traced_tensor_peaks
from fitbench.models.registry import resolve
from fitbench.worker.trace import trace_peak
from fitbench.spec import RunSpec

MB = 1e6


def gpu(nvml: float, reserved: float, allocated: float, context_end: float | None = None) -> dict:
    return {"nvml_peak_used": nvml, "peak_reserved": reserved, "peak_allocated": allocated,
            "nvml_context_end": context_end}


def test_a_sampled_peak_that_read_short_gives_way_to_the_end_reading():
    # the 1B generation's rank whose sample read 2972 MB beside 2240 MB reserved: 732 MB; at the end, 795 MB
    context, workspace = overheads(gpu(2972 * MB, 2240 * MB, 2181 * MB, context_end=795 * MB), tensors=2114 * MB)
    assert context == pytest.approx(795 * MB)
    assert workspace == pytest.approx(67 * MB)  # 2181 - 2114


def test_the_larger_reading_wins_either_way():
    context, _ = overheads(gpu(3035 * MB, 2240 * MB, 2181 * MB, context_end=780 * MB), tensors=0.0)
    assert context == pytest.approx(795 * MB)  # 3035 - 2240


def test_rows_without_the_end_reading_use_the_sampled_peak():
    context, _ = overheads(gpu(2972 * MB, 2240 * MB, 2181 * MB), tensors=0.0)
    assert context == pytest.approx(732 * MB)


def test_calibration_traces_its_tensor_peaks_in_a_child_process_with_the_same_figures():
    """The traces a calibration subtracts (``traced_tensor_peaks``) run in a process of their own, which
    ends with them (on a GPU its CUDA context goes with it), and find what tracing here finds."""
    specs = [RunSpec(model="tiny", backend="native", mode=mode, precision="fp32", batch_size=2, seq_len=16,
                     new_tokens=4, device="cpu", warmup_steps=1, measure_steps=1) for mode in ("train", "infer")]
    here = {spec.mode: trace_peak(resolve("tiny"), spec.mode, spec.precision, spec.batch_size, spec.seq_len,
                                  new_tokens=spec.new_tokens, device="cpu").peak_bytes for spec in specs}
    assert traced_tensor_peaks(specs, "cpu") == here and all(peak > 0 for peak in here.values())
