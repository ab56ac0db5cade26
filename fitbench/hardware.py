"""What hardware a run had, what it can do on paper, and what it does in practice.

Three kinds of facts live here:

* **Datasheet peaks** (``GPU_SPECS``). Every figure is the *dense* number from
  NVIDIA's datasheet or architecture whitepaper: for tensor-core kinds that is
  half of the "with sparsity" figure NVIDIA prints next to it (2:4 structured
  sparsity doubles the marketing number, and dense LLM matmuls never get it).
  ``fp32`` is the non-tensor-core CUDA-core rate; ``int8`` is in TOPS. Lookup is
  by the exact string ``torch.cuda.get_device_name()`` returns, never by prefix
  or substring, so ``"NVIDIA H200"`` cannot match a table entry such as
  ``"NVIDIA H20"`` (a much slower part). An unknown name gives ``None`` rather
  than a guess. Beside the datasheet's round memory, ``total_memory`` is what
  the device gives a process (``torch.cuda.get_device_properties().total_memory``,
  CUDA's ``totalGlobalMem``): the driver keeps some back, an amount that varies a
  little with the driver (A100-SXM4-80GB: 84,987,740,160 B under a CUDA 12.2
  driver, 85,100,068,864 B under 12.5), so each figure names where it was read.
  Model FLOP utilisation, computed elsewhere, is

      MFU = achieved FLOP/s / peak_flops(name, kind)

  so these numbers are the denominators and must never be optimistic.
* **Provenance** (``environment()``): versions, driver, GPUs, CPU and host, so
  a result file says where it came from.
* **Measured ceilings** (``measure_ceilings``): a large matmul per precision and
  a device-to-device copy, which give the throughput this particular machine
  and software stack actually reach. They are cached per device name and torch
  version because both change the answer.

The tables need no torch; detection, provenance and measurement import it where they run, so a
sweep's parent and ``fitbench plan`` start without torch's seconds of import.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING

import psutil

import fitbench
from fitbench.util.cache import cache_directory

if TYPE_CHECKING:
    import torch

_TERA = 1e12
_GIGA = 1e9
_MIB = 1024**2


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet numbers of one GPU model, dense (no 2:4 sparsity)."""

    name: str
    tflops: dict[str, float]
    bandwidth_gbs: float
    memory_gb: float
    source: str
    total_memory: float  # bytes a process gets, as torch reports them (module docstring)
    total_memory_source: str


_H100_DATASHEET = (
    "NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/"
)
_H200_DATASHEET = (
    "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/"
)
_A100_DATASHEET = (
    "NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/a100/"
)

# Hopper SXM5 compute, shared by H100 SXM and H200 (same GH100 die and clocks).
_HOPPER_SXM_TFLOPS = {
    "fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "int8": 1978.9,
}
# Hopper NVL (PCIe card, NVLink bridge) compute, shared by H100 NVL and H200 NVL.
_HOPPER_NVL_TFLOPS = {
    "fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5, "int8": 1670.5,
}
# Every A100 variant runs the same GA100 configuration; only memory differs.
# Ampere tensor cores have no FP8, so the key is absent rather than zero.
_A100_TFLOPS = {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0, "int8": 624.0}

_SPECS = (
    GpuSpec(
        name="NVIDIA H100 80GB HBM3",
        tflops=dict(_HOPPER_SXM_TFLOPS),
        bandwidth_gbs=3350.0,
        memory_gb=80.0,
        source=_H100_DATASHEET + " (H100 SXM)",
        total_memory=85017493504,
        total_memory_source=(
            "torch.cuda.get_device_properties(0).total_memory, torch 2.11.0+cu130, driver 580.159.04 "
            "(benchmarks/results/2026-11-22-h100-memory/results.jsonl, environment.gpus[].total_memory)"
        ),
    ),
    GpuSpec(
        name="NVIDIA H100 PCIe",
        tflops={
            "fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0, "int8": 1513.0,
        },
        bandwidth_gbs=2000.0,
        memory_gb=80.0,
        source=_H100_DATASHEET + " (H100 PCIe)",
        total_memory=80.0 * _GIGA,
        total_memory_source="the datasheet's 80 GB: no published total_memory or nvidia-smi figure found",
    ),
    GpuSpec(
        name="NVIDIA H100 NVL",
        tflops=dict(_HOPPER_NVL_TFLOPS),
        bandwidth_gbs=3900.0,
        memory_gb=94.0,
        source=_H100_DATASHEET + " (H100 NVL)",
        total_memory=94.0 * _GIGA,
        total_memory_source="the datasheet's 94 GB: no published total_memory or nvidia-smi figure found",
    ),
    GpuSpec(
        name="NVIDIA H200",
        tflops=dict(_HOPPER_SXM_TFLOPS),
        bandwidth_gbs=4800.0,
        memory_gb=141.0,
        source=_H200_DATASHEET + " (H200 SXM)",
        total_memory=150109880320,
        total_memory_source=(
            "torch.cuda.get_device_properties(0).total_memory on an H200 SXM, torch 2.11.0+cu130, driver "
            "580.159.04, 2026-11-23 (143,155.9 MiB; nvidia-smi says 143,771 MiB)"
        ),
    ),
    GpuSpec(
        name="NVIDIA H200 NVL",
        tflops=dict(_HOPPER_NVL_TFLOPS),
        bandwidth_gbs=4800.0,
        memory_gb=141.0,
        source=_H200_DATASHEET + " (H200 NVL)",
        total_memory=141.0 * _GIGA,
        total_memory_source="the datasheet's 141 GB: no published total_memory or nvidia-smi figure found",
    ),
    GpuSpec(
        name="NVIDIA A100-SXM4-80GB",
        tflops=dict(_A100_TFLOPS),
        bandwidth_gbs=2039.0,
        memory_gb=80.0,
        source=_A100_DATASHEET + " (A100 80GB SXM)",
        total_memory=84987740160,
        total_memory_source=(
            "CUDA deviceQuery's Total amount of global memory (totalGlobalMem), CUDA 12.2 driver, "
            "github.com/maximilianmbeck/vlstm_cuda README.md"
        ),
    ),
    GpuSpec(
        name="NVIDIA A100-SXM4-40GB",
        tflops=dict(_A100_TFLOPS),
        bandwidth_gbs=1555.0,
        memory_gb=40.0,
        source=_A100_DATASHEET + " (A100 40GB SXM)",
        total_memory=42298834944,
        total_memory_source=(
            "CUDA deviceQuery's Total amount of global memory (totalGlobalMem), CUDA 12.2 driver, "
            "github.com/bottlerocket-os/bottlerocket/pull/3873"
        ),
    ),
    GpuSpec(
        name="NVIDIA A100 80GB PCIe",
        tflops=dict(_A100_TFLOPS),
        bandwidth_gbs=1935.0,
        memory_gb=80.0,
        source=_A100_DATASHEET + " (A100 80GB PCIe)",
        total_memory=81049 * _MIB,
        total_memory_source=(
            "mixbench's Total global mem: 81049 MB (totalGlobalMem in MiB), CUDA 12.3 driver, "
            "github.com/ekondis/mixbench/issues/47"
        ),
    ),
    GpuSpec(
        name="NVIDIA A100-PCIE-40GB",
        tflops=dict(_A100_TFLOPS),
        bandwidth_gbs=1555.0,
        memory_gb=40.0,
        source=_A100_DATASHEET + " (A100 40GB PCIe)",
        total_memory=40.0 * _GIGA,
        total_memory_source="the datasheet's 40 GB: no published total_memory or nvidia-smi figure found",
    ),
    GpuSpec(
        name="NVIDIA L40S",
        tflops={
            "fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05, "fp8": 733.0, "int8": 733.0,
        },
        bandwidth_gbs=864.0,
        memory_gb=48.0,
        source="NVIDIA L40S GPU datasheet, https://www.nvidia.com/en-us/data-center/l40s/",
        total_memory=46068 * _MIB,
        total_memory_source=(
            "nvidia-smi memory.total 46068 MiB (github.com/modal-labs/modal-client/pull/2797, "
            "github.com/akash-network/provider-configs/pull/99); no published torch figure found, and nvidia-"
            "smi's total is above what a process gets (H100: 81,559 against 81,079 MiB)"
        ),
    ),
    GpuSpec(
        name="NVIDIA L4",
        tflops={
            "fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5, "int8": 242.5,
        },
        bandwidth_gbs=300.0,
        memory_gb=24.0,
        source="NVIDIA L4 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/l4/",
        total_memory=23034 * _MIB,
        total_memory_source=(
            "nvidia-smi memory.total 23034 MiB (github.com/modal-labs/modal-client/pull/2797); no published "
            "torch figure found, and nvidia-smi's total is above what a process gets (H100: 81,559 against "
            "81,079 MiB)"
        ),
    ),
    # GeForce cards: NVIDIA halves tensor throughput with FP32 accumulation on
    # consumer parts, and training/inference kernels accumulate in FP32, so the
    # FP32-accumulate column is the honest peak.
    GpuSpec(
        name="NVIDIA GeForce RTX 4090",
        tflops={
            "fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3, "int8": 660.6,
        },
        bandwidth_gbs=1008.0,
        memory_gb=24.0,
        source=(
            "NVIDIA Ada Lovelace GPU architecture whitepaper (RTX 4090, FP32 accumulate), "
            "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"
        ),
        total_memory=24.0 * _GIGA,
        total_memory_source="the datasheet's 24 GB: no published total_memory or nvidia-smi figure found",
    ),
    GpuSpec(
        name="NVIDIA GeForce RTX 3090",
        tflops={"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0, "int8": 284.0},
        bandwidth_gbs=936.0,
        memory_gb=24.0,
        source=(
            "NVIDIA Ampere GA102 GPU architecture whitepaper (RTX 3090, FP32 accumulate), "
            "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf"
        ),
        total_memory=24.0 * _GIGA,
        total_memory_source="the datasheet's 24 GB: no published total_memory or nvidia-smi figure found",
    ),
)

GPU_SPECS: dict[str, GpuSpec] = {spec.name: spec for spec in _SPECS}


def gpu_spec(name: str) -> GpuSpec | None:
    """The datasheet entry whose name equals ``name`` exactly, else ``None``."""
    return GPU_SPECS.get(name)


def peak_flops(name: str, kind: str) -> float | None:
    """Dense peak in FLOP/s (ops/s for int8): datasheet TFLOP/s x 1e12.

    ``None`` when the GPU is not in the table or the datasheet gives no figure
    for ``kind`` (e.g. fp8 on Ampere).
    """
    spec = gpu_spec(name)
    if spec is None or kind not in spec.tflops:
        return None
    return spec.tflops[kind] * _TERA


def peak_bandwidth(name: str) -> float | None:
    """Datasheet memory bandwidth in bytes/s: GB/s x 1e9 (decimal gigabytes)."""
    spec = gpu_spec(name)
    if spec is None:
        return None
    return spec.bandwidth_gbs * _GIGA


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


def _package_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_version() -> str:
    """The running torch's version, ``torch.__version__``: read from the installed package's metadata
    (the same string for a wheel) while torch is not imported yet, so that asking imports nothing."""
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__
    version = _package_version("torch")
    if version is None:
        import torch

        return torch.__version__
    return version


def _git(*args: str) -> str | None:
    """Output of a git command run in the directory holding the package."""
    source_root = pathlib.Path(fitbench.__file__).resolve().parent.parent
    try:
        completed = subprocess.run(
            ["git", *args],
            cwd=source_root,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return completed.stdout.strip()


def _git_provenance() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout fitbench runs from, (None, None) if none.

    An installed copy in site-packages may sit inside some unrelated repository
    (a virtualenv in a project, say), so the commit only counts if git tracks
    this very package in it.
    """
    commit = _git("rev-parse", "HEAD")
    if not commit or _git("ls-files", "--error-unmatch", "fitbench/__init__.py") is None:
        return None, None
    status = _git("status", "--porcelain")
    return commit, (None if status is None else status != "")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass  # not Linux: fall through to the portable, less precise answer
    return platform.processor()


def _cudnn_version() -> int | None:
    import torch

    try:
        return torch.backends.cudnn.version()
    except RuntimeError:
        return None


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def environment() -> dict:
    """Provenance of a run, as a JSON-serialisable dict."""
    import torch

    git_commit, git_dirty = _git_provenance()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return {
        "fitbench_version": fitbench.__version__,
        "git_commit": git_commit,
        "git_dirty": git_dirty,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _package_version("transformers"),
        "accelerate": _package_version("accelerate"),
        "torch_cuda": torch.version.cuda,
        "cudnn": _cudnn_version(),
        "driver": driver_version(),
        "gpus": [
            {**dataclasses.asdict(gpu), "compute_capability": list(gpu.compute_capability)}
            for gpu in detect_gpus()
        ],
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity_count": None if affinity is None else len(affinity),
        "host_memory_bytes": psutil.virtual_memory().total,
        "hostname": socket.gethostname(),
        # the node's name where SLURM started this process (a node may be named apart from its host)
        "slurm_node": os.environ.get("SLURMD_NODENAME"),
        "platform": platform.platform(),
        "time_utc": _utc_now(),
    }


def cpu_device_name() -> str:
    """Stable name for this CPU as a measurement device: ``cpu: <model> x<logical cores>``."""
    return f"cpu: {_cpu_model() or platform.machine()} x{os.cpu_count()}"


@dataclass(frozen=True)
class Ceilings:
    """Throughput one device actually reached under one torch version."""

    device_name: str
    torch_version: str
    matmul_flops: dict[str, float]
    bandwidth: float
    measured_at: str
    method: str


_DTYPES = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # torch attributes
_CUDA_KINDS = ("bf16", "fp16", "tf32", "fp32")
_CPU_KINDS = ("fp32", "bf16")
_CUDA_MATMUL_SIZE = 8192
_CPU_MATMUL_SIZE = 1024
_CUDA_COPY_BYTES = 1024 * _MIB
_CPU_COPY_BYTES = 256 * _MIB


def _median_seconds(
    operation: Callable[[], object], device: torch.device, repeats: int, warmup: int
) -> float:
    """Median wall time of one call of ``operation`` over ``repeats`` timed calls.

    On CUDA each call gets its own start/end event pair, so host-side launch gaps
    between calls are excluded and one slow call cannot skew the median.
    """
    import torch

    for _ in range(warmup):
        operation()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        pairs = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeats)
        ]
        for start, end in pairs:
            start.record()
            operation()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) / 1e3 for start, end in pairs]
    else:
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            operation()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def _matmul_flops(kind: str, size: int, device: torch.device, repeats: int, warmup: int) -> float:
    """FLOP/s of an ``size``^3 matmul: 2 * size^3 / median seconds."""
    import torch

    dtype = getattr(torch, _DTYPES[kind])
    left = torch.randn(size, size, device=device, dtype=dtype)
    right = torch.randn(size, size, device=device, dtype=dtype)
    # A preallocated output keeps the allocator out of the timed region.
    out = torch.empty(size, size, device=device, dtype=dtype)
    seconds = _median_seconds(lambda: torch.mm(left, right, out=out), device, repeats, warmup)
    return 2 * size**3 / seconds


def _cuda_matmul_flops(
    kind: str, size: int, device: torch.device, repeats: int, warmup: int
) -> float:
    """Like ``_matmul_flops``, with TF32 on only for the ``tf32`` kind and restored after."""
    import torch

    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = kind == "tf32"
    try:
        return _matmul_flops(kind, size, device, repeats, warmup)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def _copy_bandwidth(nbytes: int, device: torch.device, repeats: int, warmup: int) -> float:
    """Bytes/s of ``dst.copy_(src)``: 2 * nbytes (read + write) / median seconds."""
    import torch

    # Filled, not torch.empty: untouched host pages can map to the shared zero
    # page and make reads look faster than memory is.
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    destination = torch.empty_like(source)
    seconds = _median_seconds(lambda: destination.copy_(source), device, repeats, warmup)
    return 2 * nbytes / seconds


def measure_ceilings(
    device: str, *, size: int | None = None, repeats: int = 10, warmup: int = 3
) -> Ceilings:
    """Measure matmul FLOP/s per precision and copy bandwidth on ``device``.

    ``device`` is ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. Matmuls are
    ``size x size x size`` (default 8192 on CUDA, 1024 on CPU) of random
    normal data, counted as 2 * size^3 FLOPs. CUDA measures bf16, fp16, tf32
    and fp32 (TF32 disabled); CPU measures fp32 and bf16. Bandwidth copies a
    1 GiB (CUDA) or 256 MiB (CPU) buffer and counts bytes read plus written.
    Each figure uses the median of ``repeats`` timed calls after ``warmup``
    untimed ones.
    """
    import torch

    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats=} {warmup=}")
    target = torch.device(device)
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} requested but CUDA is not available")
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        size = size or _CUDA_MATMUL_SIZE
        copy_bytes = _CUDA_COPY_BYTES
        # Events record on the current device's stream, so make it the target.
        with torch.cuda.device(target):
            matmul = {
                kind: _cuda_matmul_flops(kind, size, target, repeats, warmup) for kind in _CUDA_KINDS
            }
            bandwidth = _copy_bandwidth(copy_bytes, target, repeats, warmup)
        device_name = torch.cuda.get_device_name(target)
        timer = "CUDA events"
    elif target.type == "cpu":
        size = size or _CPU_MATMUL_SIZE
        copy_bytes = _CPU_COPY_BYTES
        matmul = {kind: _matmul_flops(kind, size, target, repeats, warmup) for kind in _CPU_KINDS}
        bandwidth = _copy_bandwidth(copy_bytes, target, repeats, warmup)
        device_name = cpu_device_name()
        timer = f"perf_counter, {torch.get_num_threads()} threads"
    else:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    method = (
        f"matmul {size}x{size}x{size} (2*n^3 FLOPs) for {', '.join(matmul)}; "
        f"copy_ of {copy_bytes // _MIB} MiB (2*nbytes); "
        f"median of {repeats} after {warmup} warm-up; {timer}"
    )
    return Ceilings(
        device_name=device_name,
        torch_version=torch.__version__,
        matmul_flops=matmul,
        bandwidth=bandwidth,
        measured_at=_utc_now(),
        method=method,
    )


def ceilings_path() -> pathlib.Path:
    """``ceilings.json`` in ``cache_directory()``."""
    return cache_directory() / "ceilings.json"


def _ceilings_key(device_name: str, torch_version: str) -> str:
    return f"{device_name}|torch {torch_version}"


def _read_ceilings_file(path: pathlib.Path) -> dict:
    with open(path, encoding="utf-8") as handle:
        entries = json.load(handle)
    if not isinstance(entries, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return entries


def save_ceilings(ceilings: Ceilings) -> pathlib.Path:
    """Add ``ceilings`` to the cache file, keeping other entries; returns the path.

    The file is replaced atomically so a concurrent reader never sees half of it.
    """
    path = ceilings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        entries = _read_ceilings_file(path)
    except (OSError, ValueError):
        entries = {}  # missing or corrupt: nothing worth keeping
    entries[_ceilings_key(ceilings.device_name, ceilings.torch_version)] = dataclasses.asdict(ceilings)
    handle = tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", dir=path.parent, prefix=".ceilings-", suffix=".tmp", delete=False
    )
    try:
        with handle:
            json.dump(entries, handle, indent=2, sort_keys=True)
        os.replace(handle.name, path)
    except BaseException:
        os.unlink(handle.name)
        raise
    return path


def load_ceilings(device_name: str) -> Ceilings | None:
    """Cached ceilings of ``device_name`` under the running torch version, else ``None``.

    A missing, unreadable or malformed file or entry gives ``None``.
    """
    try:
        entry = _read_ceilings_file(ceilings_path())[_ceilings_key(device_name, torch_version())]
        ceilings = Ceilings(
            device_name=str(entry["device_name"]),
            torch_version=str(entry["torch_version"]),
            matmul_flops={str(kind): float(value) for kind, value in entry["matmul_flops"].items()},
            bandwidth=float(entry["bandwidth"]),
            measured_at=str(entry["measured_at"]),
            method=str(entry["method"]),
        )
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    numbers = [ceilings.bandwidth, *ceilings.matmul_flops.values()]
    if not all(math.isfinite(number) and number > 0 for number in numbers):
        return None
    return ceilings
