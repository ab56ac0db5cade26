"""Measuring a calibration (``fitbench.plan.calibration``) on the GPU at hand: ``tiny`` through the
real worker in each kind of step, and its tensors traced on fake ones."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from fitbench.launch.local import run_one
from fitbench.models.registry import resolve
from fitbench.plan.calibration import DEFAULT, Calibration
from fitbench.run.trace import trace_peak
from fitbench.spec import Assignment, RunSpec


def measure_calibration(device: str, scratch: Path) -> Calibration:
    """Run ``tiny`` training, generating and a forward pass on ``device`` through the real worker and read off the
    context (NVML minus reserved) and the workspaces (allocated peak minus the traced tensor peak)."""
    found = {}
    for mode, precision, batch, seq_len in (("train", "bf16", 4, 256), ("infer", "bf16-pure", 4, 256),
                                            ("forward", "bf16-pure", 4, 256)):
        spec = RunSpec(model="tiny", backend="native", mode=mode, precision=precision, batch_size=batch,
                       seq_len=seq_len, new_tokens=8, device=device, warmup_steps=2, measure_steps=3)
        row = run_one(Assignment(spec=spec), scratch / f"{mode}.log", timeout=600, on_event=lambda event: None)
        if row["status"] != "ok":
            raise RuntimeError(f"calibration run {spec.label} ended {row['status']}: {row.get('error')}")
        gpu = row["memory"]["gpus"][0]
        if not gpu.get("nvml_peak_used"):
            raise RuntimeError("NVML is unavailable, so the CUDA context cannot be measured")
        tensors = trace_peak(resolve("tiny"), mode, precision, batch, seq_len, new_tokens=8, device="cuda").peak_bytes
        found[mode] = (gpu["nvml_peak_used"] - gpu["peak_reserved"], gpu["peak_allocated"] - tensors)
    measured_at = time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())
    return Calibration(
        cuda_context_training=float(found["train"][0]), cuda_context_inference=float(found["infer"][0]),
        workspace_training=float(found["train"][1]), workspace_inference=float(found["infer"][1]),
        cuda_context_eager=float(found["forward"][0]), workspace_eager=float(found["forward"][1]),
        nccl_per_communicator=DEFAULT.nccl_per_communicator,
        source=f"measured on {torch.cuda.get_device_name(torch.device(device))} with torch {torch.__version__} "
               f"at {measured_at}",
        measured_at=measured_at,
    )
