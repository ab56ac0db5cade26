"""Measuring a calibration (``fitbench.plan.calibration``) on the GPU at hand: ``tiny`` through the
real worker in each kind of step, and its tensors traced on fake ones; on several GPUs, the bus
bandwidth of all-reduce and all-gather."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from fitbench.launch.local import run_one
from fitbench.models.registry import resolve
from fitbench.plan.calibration import DEFAULT, Calibration
from fitbench.plan.speed import BusBandwidth
from fitbench.processes import PARENT_VARIABLE, TOKEN_VARIABLE, kill_tree
from fitbench.run.trace import trace_peak
from fitbench.spec import Assignment, RunSpec

MIB = 1024**2
# Per backend: message size, warm-up and timed operations. NCCL's bus bandwidth on NVLink levels off
# from a few hundred MB (nccl-tests' curves); gloo on a CPU only has to exercise the code path.
COLLECTIVE_RUNS = {"nccl": (256 * MIB, 5, 20), "gloo": (4 * MIB, 2, 5)}


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


def measure_bus_bandwidth(ranks: int, device: str, scratch: Path, timeout_s: float = 300.0) -> BusBandwidth:
    """All-reduce and all-gather bus bandwidth over ``ranks`` processes, one per GPU with NCCL
    (``device`` cuda), or CPU processes over gloo (``device`` cpu, to exercise the path). The ranks run
    ``fitbench.run.collectives``; bus bandwidth is nccl-tests' (``doc/PERFORMANCE.md``):
    ``2 (g - 1) / g x S / t`` for an all-reduce of S bytes taking t seconds, ``(g - 1) / g x S / t`` for
    an all-gather into S bytes. Every rank has ended when this returns, by itself or killed at
    ``timeout_s`` or on the first that fails."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    message_bytes, warmup, iterations = COLLECTIVE_RUNS[backend]
    token = secrets.token_hex(8)
    environment = {**os.environ, TOKEN_VARIABLE: token, PARENT_VARIABLE: str(os.getpid())}
    logs = [scratch / f"rank{rank}.log" for rank in range(ranks)]
    processes = []
    try:
        for rank, log in enumerate(logs):
            with log.open("w") as stderr:
                processes.append(subprocess.Popen(
                    [sys.executable, "-m", "fitbench.run.collectives", "--rank", str(rank), "--world", str(ranks),
                     "--backend", backend, "--scratch", str(scratch), "--message-bytes", str(message_bytes),
                     "--warmup", str(warmup), "--iterations", str(iterations), "--timeout", str(timeout_s)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, env=environment,
                    start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in processes) and all(p.returncode in (None, 0) for p in processes):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the bus-bandwidth measurement over {ranks} ranks did not end in {timeout_s:.0f} s")
            time.sleep(0.1)
    finally:
        for process in processes:
            kill_tree(process.pid, token)
            process.wait()
    failed = [(rank, p.returncode) for rank, p in enumerate(processes) if p.returncode != 0]
    if failed:
        rank, code = failed[0]
        tail = " | ".join(logs[rank].read_text(errors="replace").strip().splitlines()[-3:])
        raise RuntimeError(f"rank {rank} of the bus-bandwidth measurement ended with exit status {code}: {tail}")
    timed = json.loads((scratch / "collectives.json").read_text())
    size, g = timed["message_bytes"], timed["world"]
    all_reduce = 2 * (g - 1) / g * size / timed["all_reduce_s"]
    all_gather = (g - 1) / g * size / timed["all_gather_s"]
    what = f"{g} x {torch.cuda.get_device_name(0)}" if backend == "nccl" else f"{g} CPU processes"
    measured_at = time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())
    return BusBandwidth(all_reduce, all_gather, f"measured on {what} with {backend}, {size / MIB:.0f} MiB messages, "
                                                f"torch {torch.__version__} at {measured_at}")


def with_bus_bandwidth(calibration: Calibration, bus: BusBandwidth) -> Calibration:
    return replace(calibration, all_reduce_bus_bandwidth=bus.all_reduce, all_gather_bus_bandwidth=bus.all_gather,
                   collectives_source=bus.source)
