"""The devices this process sees: GPUs as torch reports them, the NVIDIA driver, the CPU.

Detection imports torch only where a GPU could be there (``no_gpu_device``), so a sweep's parent and
``fitbench plan`` on a machine without one start without torch's seconds of import.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuInfo:
    """One visible CUDA device as torch reports it."""

    index: int
    name: str
    total_memory: int
    compute_capability: tuple[int, int]


# The device files through which a GPU reaches torch on Linux: NVIDIA's driver (/dev/nvidia0, ...),
# WSL2's paravirtualized GPU (/dev/dxg) and AMD's ROCm (/dev/kfd).
GPU_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/dxg", "/dev/kfd")


def no_gpu_device() -> bool:
    """True on Linux when none of ``GPU_DEVICE_FILES`` exists: no GPU can reach torch, which then need
    not be imported (seconds) to say so. False elsewhere, or when one exists: ask torch."""
    import glob

    return sys.platform.startswith("linux") and not any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES)


def detect_gpus() -> list[GpuInfo]:
    """All CUDA devices visible to this process; empty without CUDA."""
    if no_gpu_device():
        return []
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(
            GpuInfo(
                index=index,
                name=props.name,
                total_memory=int(props.total_memory),
                compute_capability=(props.major, props.minor),
            )
        )
    return gpus


def driver_version() -> str | None:
    """NVIDIA driver version from NVML, or ``None`` when NVML is unavailable."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # NVML raises its own error types, or the library is absent
        return None
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass  # the version is already read; a failed shutdown changes nothing
    # Older nvidia-ml-py releases return bytes.
    return version.decode() if isinstance(version, bytes) else str(version)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s ``model name`` on Linux, ``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass  # not Linux: fall through to the portable, less precise answer
    return platform.processor()


def cpu_device_name() -> str:
    """Stable name for this CPU as a measurement device: ``cpu: <model> x<logical cores>``."""
    return f"cpu: {cpu_model() or platform.machine()} x{os.cpu_count()}"
