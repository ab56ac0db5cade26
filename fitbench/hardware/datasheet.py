"""Datasheet peaks of the GPUs fitbench knows: the denominators of MFU and of the bandwidth roofline.

Every figure is the *dense* number from NVIDIA's datasheet or architecture whitepaper: for tensor-core
kinds that is half of the "with sparsity" figure NVIDIA prints next to it (2:4 structured sparsity
doubles the marketing number, and dense LLM matmuls never get it). ``fp32`` is the non-tensor-core
CUDA-core rate; ``int8`` is in TOPS. Lookup is by the exact string ``torch.cuda.get_device_name()``
returns, never by prefix or substring, so ``"NVIDIA H200"`` cannot match a table entry such as
``"NVIDIA H20"`` (a much slower part). An unknown name gives ``None`` rather than a guess. Beside the
datasheet's round memory, ``total_memory`` is what the device gives a process
(``torch.cuda.get_device_properties().total_memory``, CUDA's ``totalGlobalMem``): the driver keeps
some back, an amount that varies a little with the driver (A100-SXM4-80GB: 84,987,740,160 B under a
CUDA 12.2 driver, 85,100,068,864 B under 12.5), so each figure names where it was read. Model FLOP
utilisation, computed elsewhere, is

    MFU = achieved FLOP/s / peak_flops(name, kind)

so these numbers are the denominators and must never be optimistic. Plain data: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

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
