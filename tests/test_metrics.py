"""What a row says about a generation: the time to first token (``fitbench.run.loops.generate``), and
the peak MFU divides by (``fitbench.run.precision.peak_kind``), in the worker and in the planner.

Expected values are worked out here from the models' published shapes, never read back from the
code under test.
"""

import json
import time

import pytest
import torch

from fitbench.config import RunSpec
from fitbench.models.backends import NativeLM
from fitbench.models.native import build_native
from fitbench.models.registry import resolve
from fitbench.plan import speed
from fitbench.plan.memory import Parallelism
from fitbench.run import worker
from fitbench.run.loops import generate, random_tokens, read_generation
from fitbench.run.precision import PRECISIONS, peak_kind, policy
from fitbench.run.timing import DeviceClock, run_stages

CPU = torch.device("cpu")
TINY_PARAMS = 4_196_608

# Llama-2-7B config.json: untied embeddings, 4096 positions
V7, H7, L7, HEADS7, Q7, F7 = 32000, 4096, 32, 32, 128, 11008
P7 = L7 * (4 * H7 * H7 + 3 * H7 * F7 + 2 * H7) + 2 * V7 * H7 + H7
H100 = "NVIDIA H100 80GB HBM3"
H100_TFLOPS = {"bf16": 989.4e12, "int8": 1978.9e12, "fp8": 1978.9e12}


# ---- 1. time to first token --------------------------------------------------------------------


class SlowPrefill(NativeLM):
    """The native model with host work before each prefill's launch, as a long launch path has:
    ``delays`` seconds, one per prefill, in turn."""

    def __init__(self, module, delays: list[float]):
        super().__init__(module, torch.float32)
        self.delays = list(delays)
        self.prefills = 0

    def prefill(self, tokens, max_len):
        time.sleep(self.delays[self.prefills % len(self.delays)])
        self.prefills += 1
        return super().prefill(tokens, max_len)


class RecordingClock(DeviceClock):
    """The CPU clock, noting each synchronize and mark in order."""

    def __init__(self):
        super().__init__(CPU)
        self.calls: list[str] = []

    def mark(self):
        self.calls.append("mark")
        return super().mark()

    def synchronize(self):
        self.calls.append("synchronize")
        super().synchronize()


def test_each_generation_starts_from_an_idle_device_and_decodes_without_waiting():
    arch = resolve("tiny")
    lm = NativeLM(build_native(arch, CPU, torch.float32), torch.float32)
    clock = RecordingClock()
    run = generate(lm, random_tokens(arch.vocab_size, 2, 8, CPU, seed=1), 5, policy("fp32"), clock, CPU)
    for _ in range(2):
        clock.calls.clear()
        run()
        # a synchronize, then the first mark, the prefill's, and the four decode steps' with none between
        assert clock.calls == ["synchronize"] + ["mark"] * 6


def test_time_to_first_token_includes_the_prefills_host_work():
    arch, delay = resolve("tiny"), 0.1
    lm = SlowPrefill(build_native(arch, CPU, torch.float32), [delay])
    clock = DeviceClock(CPU)
    run = generate(lm, random_tokens(arch.vocab_size, 1, 8, CPU, seed=2), 4, policy("fp32"), clock, CPU)
    generations = [read_generation(marks, clock) for marks in run_stages(run, clock, warmup=1, repeats=3)]
    for generation in generations:
        assert generation.time_to_first_token >= delay
        assert all(latency < delay for latency in generation.token_latencies)  # steady-state decode only
        assert generation.end_to_end >= generation.time_to_first_token + sum(generation.token_latencies) * 0.99


def test_a_noisy_time_to_first_token_warns():
    arch = resolve("tiny")
    run_spec = RunSpec(model="tiny", backend="native", mode="infer", precision="fp32", batch_size=1, seq_len=8,
                       new_tokens=3, device="cpu", warmup_steps=1, measure_steps=4)
    built = worker.Built(SlowPrefill(build_native(arch, CPU, torch.float32), [0.0, 0.05]))
    timing, _, noisy, _ = worker._measure_generation(run_spec, arch, built, policy("fp32"), DeviceClock(CPU), CPU,
                                                     worker.Peaks(None, None, None), 4 * TINY_PARAMS)
    assert timing["time_to_first_token"]["cv_percent"] > 5
    assert "time to first token" in noisy


# ---- through the worker -----------------------------------------------------------------------


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
