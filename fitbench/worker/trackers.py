"""Peak memory of one run, three ways.

- **torch allocator**, per GPU: peak allocated (live tensors) and peak reserved (what the
  caching allocator took from the driver), since the worker started.
- **NVML**, per GPU: the largest memory the driver reported in use, sampled every 50 ms by a
  background thread. It counts what the allocator cannot see: the CUDA context, cuBLAS and
  NCCL workspaces. The process's own entry is used where NVML lists it; where a container hides
  the process id, the device's used memory minus what was in use when the worker started.
- **host**: peak resident set size of the worker process (``getrusage``), which on a CPU run is
  the memory of the run itself.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
from dataclasses import dataclass, field

import torch

SAMPLE_INTERVAL_S = 0.05


def host_peak_rss_bytes() -> int:
    """ru_maxrss is in KiB on Linux and bytes on macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


@dataclass
class NvmlSampler:
    """Polls NVML in a daemon thread; ``stop`` returns the peak bytes per device index."""

    device_indices: list[int]
    peaks: dict[int, int] = field(default_factory=dict)
    method: str = "unavailable"
    # per device index, read at ``stop``: the process's NVML figure less what the allocator holds then,
    # the CUDA context at the end (its loaded kernels only grow it)
    context_end: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handles: dict[int, object] = {}
        self._baseline: dict[int, int] = {}
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # no driver, no library: NVML figures are simply absent
            return
        self._nvml = pynvml
        for index in self.device_indices:
            handle = _nvml_handle(pynvml, index)
            self._handles[index] = handle
            self._baseline[index] = pynvml.nvmlDeviceGetMemoryInfo(handle).used
        self.method = "process"
        self._thread = threading.Thread(target=self._run, name="fitbench-nvml", daemon=True)
        self._thread.start()

    def _process_bytes(self, index: int) -> int:
        nvml, handle, pid = self._nvml, self._handles[index], os.getpid()
        for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == pid and process.usedGpuMemory is not None:
                return process.usedGpuMemory
        self.method = "device used minus baseline"
        return max(0, nvml.nvmlDeviceGetMemoryInfo(handle).used - self._baseline[index])

    def sample(self) -> None:
        for index in self._handles:
            used = self._process_bytes(index)
            self.peaks[index] = max(self.peaks.get(index, 0), used)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            self.sample()

    def stop(self) -> dict[int, int]:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.sample()
            for index in self._handles:  # the allocator maps and unmaps from the host: no sync needed
                self.context_end[index] = self._process_bytes(index) - torch.cuda.memory_reserved(index)
        return dict(self.peaks)


def _nvml_handle(nvml, torch_index: int):
    """NVML numbers GPUs in PCI order and ignores CUDA_VISIBLE_DEVICES; torch does not. Match by UUID."""
    uuid = str(getattr(torch.cuda.get_device_properties(torch_index), "uuid", ""))
    for nvml_index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(nvml_index)
        nvml_uuid = nvml.nvmlDeviceGetUUID(handle)
        nvml_uuid = nvml_uuid.decode() if isinstance(nvml_uuid, bytes) else nvml_uuid
        if uuid and nvml_uuid.removeprefix("GPU-") == uuid.removeprefix("GPU-"):
            return handle
    return nvml.nvmlDeviceGetHandleByIndex(torch_index)


def torch_peaks(device_indices: list[int]) -> dict[int, dict[str, int]]:
    return {
        index: {
            "peak_allocated": torch.cuda.max_memory_allocated(index),
            "peak_reserved": torch.cuda.max_memory_reserved(index),
        }
        for index in device_indices
    }


def allocator_settings() -> str:
    """The caching allocator's settings: as torch parsed them where it can say (2.13), else the
    variable it read them from (PYTORCH_ALLOC_CONF, or the older PYTORCH_CUDA_ALLOC_CONF)."""
    parsed = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if parsed is not None:
        return parsed()
    return os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""


def allocator_report(index: int) -> dict:
    """How the caching allocator ran: its settings as torch parsed them (expandable segments or not),
    the times it freed its cache and retried an allocation (``num_alloc_retries``: each one a
    synchronizing ``cudaFree`` under pressure), and the peak of ``inactive_split_bytes``: memory the
    allocator held in split blocks that no tensor used, the fragmentation between reserved and
    allocated (``torch.cuda.memory_stats``)."""
    stats = torch.cuda.memory_stats(index)
    return {
        "settings": allocator_settings(),
        "num_alloc_retries": stats.get("num_alloc_retries", 0),
        "peak_inactive_split_bytes": stats.get("inactive_split_bytes.all.peak", 0),
    }


def memory_report(device: torch.device, sampler: NvmlSampler | None, indices: list[int] | None = None) -> dict:
    """Per-GPU peaks (allocator and NVML) and the host's peak RSS, in bytes: of ``device``, or of the
    GPUs ``indices`` where one process drives several (the hf backend's pipeline stages)."""
    gpus = []
    if device.type == "cuda":
        indices = indices or [device.index if device.index is not None else torch.cuda.current_device()]
        nvml = sampler.stop() if sampler else {}
        for index, peaks in torch_peaks(indices).items():
            gpus.append({"index": index, **peaks, "nvml_peak_used": nvml.get(index),
                         "nvml_context_end": sampler.context_end.get(index) if sampler else None,
                         "allocator": allocator_report(index)})
    return {
        "gpus": gpus,
        "nvml_method": sampler.method if sampler else None,
        "host_peak_rss": host_peak_rss_bytes(),
    }
