"""The peak MFU divides by (``fitbench.run.precision.peak_kind``), in the worker and in the planner.

Expected values are worked out here from the models' published shapes, never read back from the
code under test.
"""

import json

import pytest

from fitbench.config import RunSpec
from fitbench.models.registry import resolve
from fitbench.plan import speed
from fitbench.plan.memory import Parallelism
from fitbench.run import worker
from fitbench.run.precision import PRECISIONS, peak_kind

# Llama-2-7B config.json: untied embeddings, 4096 positions
V7, H7, L7, HEADS7, Q7, F7 = 32000, 4096, 32, 32, 128, 11008
P7 = L7 * (4 * H7 * H7 + 3 * H7 * F7 + 2 * H7) + 2 * V7 * H7 + H7
H100 = "NVIDIA H100 80GB HBM3"
H100_TFLOPS = {"bf16": 989.4e12, "int8": 1978.9e12, "fp8": 1978.9e12}


def run_worker(run: RunSpec, tmp_path) -> dict:
    spec_path, result_path = tmp_path / "spec.json", tmp_path / "result.json"
    spec_path.write_text(run.model_dump_json())
    assert worker.main([str(spec_path), str(result_path)]) == worker.EXIT_OK
    return json.loads(result_path.read_text())


def test_the_worker_divides_int8_by_the_int8_peak(tmp_path):
    result = run_worker(RunSpec(model="tiny", backend="native", mode="infer", precision="int8", batch_size=1,
                                seq_len=8, new_tokens=3, device="cpu", warmup_steps=1, measure_steps=2), tmp_path)
    assert result["peak_kind"] == "int8"


# ---- 4. the peak MFU divides by -----------------------------------------------------------------

INFERENCE_KIND = {"fp32": "fp32", "tf32": "tf32", "bf16": "bf16", "fp16": "fp16", "bf16-pure": "bf16",
                  "int8": "int8", "int8-dynamic": "int8", "fp8": "fp8", "fp8-block": "fp8",
                  "int4": "bf16", "nf4": "bf16", "fp4": "bf16"}
TRAINING_KIND = {"fp32": "fp32", "tf32": "tf32", "bf16": "bf16", "fp16": "fp16", "bf16-pure": "bf16",
                 "fp8": "fp8", "int8": "bf16", "nf4": "bf16", "fp4": "bf16"}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_peak_kind_of_every_precision_and_mode(precision):
    for mode in ("forward", "infer"):
        assert peak_kind(precision, mode) == INFERENCE_KIND[precision]
    for mode in ("train", "forward-backward"):
        if precision in TRAINING_KIND:
            assert peak_kind(precision, mode) == TRAINING_KIND[precision]
        else:
            with pytest.raises(ValueError, match="no backward pass"):
                peak_kind(precision, mode)


def test_the_planner_divides_by_the_same_peak():
    arch, batch = resolve("7B"), 8
    n7 = P7 - V7 * H7
    for precision, kind in (("int8", "int8"), ("int8-dynamic", "int8"), ("fp8", "fp8"), ("nf4", "bf16"),
                            ("int4", "bf16")):
        step = speed.estimate_step_time(arch, "infer", precision, batch, 128, new_tokens=16,
                                        parallelism=Parallelism(), gpu_name=H100)
        assert step.compute_s == pytest.approx(2 * batch * n7 / H100_TFLOPS[kind], rel=1e-12)
    tokens = batch * 128
    fp8 = speed.estimate_step_time(arch, "train", "fp8", batch, 128, new_tokens=1, parallelism=Parallelism(),
                                   gpu_name=H100)
    assert fp8.compute_s == pytest.approx(tokens * 3 * (2 * n7 + 4 * L7 * HEADS7 * Q7 * 128) / H100_TFLOPS["fp8"],
                                          rel=1e-12)
    assert not hasattr(speed, "PRECISION_KIND")
