"""benchmarks/ddp_overlap.py: its exposed-communication arithmetic, and one real torchrun job of two CPU
ranks over gloo on the tiny preset, whose rows are recomputed from the samples they keep."""

import functools
import importlib.util
import inspect
import json
import math
import statistics
import sys

import pytest
from torch.nn.parallel import DistributedDataParallel

from test_parallel import REPO, WORLD, torchrun

SCRIPT = REPO / "benchmarks" / "ddp_overlap.py"
BATCH, SEQ_LEN = 2, 32


@functools.cache
def script():
    spec = importlib.util.spec_from_file_location("ddp_overlap", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_exposed_communication_runs_from_the_last_compute_kernel_to_the_end_of_the_last_all_reduce():
    kernels = [("gemm", 0, 100), ("ncclDevKernel_AllReduce_Sum_f32", 50, 150), ("mul", 100, 120),
               ("ncclDevKernel_AllReduce_Sum_f32", 130, 200), ("fused_adam", 210, 260)]  # microseconds
    summary = script().communication_summary(kernels)
    assert math.isclose(summary["exposed_communication_ms"], 0.080)  # 120 us to 200 us: AdamW waits for it
    assert math.isclose(summary["nccl_ms"], 0.170) and summary["nccl_kernels"] == 2
    assert math.isclose(summary["compute_ms"], 0.170) and summary["compute_kernels"] == 3
    assert script().communication_summary(kernels[:1])["exposed_communication_ms"] == 0  # one GPU: no NCCL


@pytest.mark.slow
def test_every_variant_is_timed_against_one_gpu_on_cpu_ranks(tmp_path):
    """Every variant has a row; those gloo can run have a positive step time and an efficiency of their
    tokens/s per GPU over one-gpu's, each recomputed from the samples of every rank that the row keeps."""
    out = tmp_path / "out.json"
    done, _ = torchrun(tmp_path, str(out), "--model", "tiny", "--batch-size", str(BATCH), "--seq-len", str(SEQ_LEN),
                       "--steps", "2", "--warmup", "1", "--baseline-again", script=SCRIPT, timeout=120)
    assert done.returncode == 0 and out.exists(), done.stdout[-3000:]
    result = json.loads(out.read_text())
    rows = {row["variant"]: row for row in result["variants"]}
    assert list(rows) == [variant.name for variant in script().VARIANTS] + ["one-gpu-again"]
    assert result["environment"]["world_size"] == WORLD and result["environment"]["backend"] == "gloo"
    # NCCL's options and bf16 compression (its hook refuses gloo), cuBLASLt, and the copy option torch
    # 2.13 added
    not_here = {"high-priority-stream", "nccl-8-ctas", "bf16-compress", "sm-carveout-8", "sm-carveout-16",
                "sm-carveout-8-bucket-400", "one-gpu-cublaslt", "cublaslt", "sm-carveout-8-cublaslt",
                "sm-carveout-16-cublaslt"}
    if "batched_grad_copy" not in inspect.signature(DistributedDataParallel).parameters:
        not_here.add("batched-grad-copy")
    assert {name for name, row in rows.items() if "step_s" not in row} == not_here
    assert all(rows[name].get("skipped") or rows[name].get("error") for name in not_here)
    one_gpu = rows["one-gpu"]
    assert one_gpu["step_s"] == statistics.median(one_gpu["rank_step_s"][0])
    for name, row in rows.items():
        if name in not_here:
            continue
        samples = row["rank_step_s"]
        assert len(samples) == WORLD and all(len(seconds) == 2 and min(seconds) > 0 for seconds in samples)
        if name == "one-gpu-again":  # rank 0's, as the first baseline's
            assert row["step_s"] == statistics.median(samples[0]) and row["buckets_bytes"] is None
        elif name != "one-gpu":
            assert row["step_s"] == statistics.median(max(step) for step in zip(*samples))
            if name != "fsdp":  # FSDP has no buckets
                assert sum(row["buckets_bytes"]) == sum(rows["current"]["buckets_bytes"]) > 0
        assert math.isclose(row["tokens_per_s_per_gpu"], BATCH * SEQ_LEN / row["step_s"])
        assert math.isclose(row["efficiency"], row["tokens_per_s_per_gpu"] / one_gpu["tokens_per_s_per_gpu"])
        assert all(math.isfinite(loss) for loss in row["loss"])
        assert row["power_w"] == row["sm_clock_mhz"] == [None] * WORLD  # CPU ranks: no NVML figures
    assert one_gpu["buckets_bytes"] is None and rows["fsdp"]["buckets_bytes"] is None
