"""Time of one collective over g ranks: a fixed latency per message plus the bytes each rank moves over
the bus bandwidth.

nccl-tests (NVIDIA, ``doc/PERFORMANCE.md``) times an operation as "roughly overhead + size / bw" and
defines its bus bandwidth B from the ring algorithm's traffic per rank, so that B is comparable across
collectives and rank counts. For a message of S bytes over g ranks:

    all-reduce        t = latency + 2 (g - 1) / g x S / B    (a reduce-scatter, then an all-gather)
    all-gather        t = latency +     (g - 1) / g x S / B    (S: the gathered tensor)
    reduce-scatter    t = latency +     (g - 1) / g x S / B    (S: the whole tensor before scattering)
    send / recv       t = latency +                 S / B

A reduce-scatter moves an all-gather's bytes the other way round the same ring, and a send is one step
of it, so both are taken at the all-gather's bandwidth and latency. ``fitbench calibrate --gpus N``
measures both constants of the all-reduce and the all-gather (``fitbench.launch.calibrate``); without a
measurement the defaults below apply, by interconnect.
"""

from __future__ import annotations

from dataclasses import dataclass

from fitbench.planning.calibration import Calibration

# GPU-to-GPU bandwidth per direction, bytes/s, the bus bandwidth assumed where none was measured.
# NVLink 4 (H100/H200 SXM): 900 GB/s both directions (NVIDIA H100 and H200 Tensor Core GPU
# datasheets); NVLink 3 (A100 SXM): 600 GB/s (A100 datasheet); H100 NVL and H200 NVL bridges
# 600 and 900 GB/s (datasheets). GPUs without an entry talk over PCIe (``PCIE_BANDWIDTH``, Gen4
# x16, 32 GB/s per direction; Gen5 would be 64 GB/s): L40S, L4, the PCIe H100 and A100 cards.
LINK_BANDWIDTH = {
    "NVIDIA H100 80GB HBM3": 450e9,
    "NVIDIA H200": 450e9,
    "NVIDIA A100-SXM4-80GB": 300e9,
    "NVIDIA A100-SXM4-40GB": 300e9,
    "NVIDIA H100 NVL": 300e9,
    "NVIDIA H200 NVL": 450e9,
}
PCIE_BANDWIDTH = 32e9

# Seconds per message of a small collective inside a step, where none was measured. Over NVLink: the
# median of the latencies at which each committed tensor-parallel decode row at batch 1 (whose step is
# latency-bound, each all-reduce a few kB) is forecast as measured, one value for all of them
# (tests/test_forecast.py solves them again): the native 13B and Llama-2-70B rows of
# ``benchmarks/results/2026-11-24-h200x2-model-parallel`` (TP 2), ``2026-11-27-h100x4-vs-one-gpu`` and
# ``2026-11-27-h100x4-tp-compiled-decode`` (TP 2 and 4). It is above NCCL's own model of its kernels
# (ring, LL protocol: 6.6 us plus 0.6 us per NVLink step, 2 (g - 1) steps for an all-reduce; NCCL
# ``src/graph/tuning.cc``, ``baseLat`` and ``hwLat``), which leaves out the launch and the copies into
# and out of NCCL's buffers. Over PCIe, NCCL's model puts a step at 1.0 us: 6 x 0.4 us more over the
# 6 steps of an all-reduce of 4 ranks.
NVLINK_LATENCY_S = 18e-6
PCIE_LATENCY_S = NVLINK_LATENCY_S + 6 * 0.4e-6
# Seconds per symmetric-memory one-shot all-reduce of a decode step (``fitbench.spec.ONE_SHOT_BYTES`` or
# less) over NVLink: 80 in a row captured in a CUDA graph, 10.0 us each on 4 H100s and 8.8 on 2 at
# 10 kB (``benchmarks/tp_allreduce.py``, ``benchmarks/results/2026-11-27-h100x4-tp-decode-profile``),
# where NCCL's took 21.7 and 15.5.
ONE_SHOT_LATENCY_S = 10e-6


@dataclass(frozen=True)
class BusBandwidth:
    """The collectives' constants: bus bandwidths (bytes/s) and latencies (seconds per message) of the
    all-reduce and the all-gather, and where they come from (the module docstring has the formulas)."""

    all_reduce: float
    all_gather: float
    source: str
    all_reduce_latency: float
    all_gather_latency: float

    def all_reduce_s(self, size: float, ranks: int, messages: int = 1) -> float:
        """``messages`` all-reduces of ``size`` bytes in all over ``ranks`` ranks; nothing on one rank."""
        if ranks <= 1:
            return 0.0
        return messages * self.all_reduce_latency + 2 * (ranks - 1) / ranks * size / self.all_reduce

    def all_gather_s(self, size: float, ranks: int, messages: int = 1) -> float:
        """``messages`` all-gathers into ``size`` bytes in all (the gathered tensors) over ``ranks`` ranks."""
        if ranks <= 1:
            return 0.0
        return messages * self.all_gather_latency + (ranks - 1) / ranks * size / self.all_gather

    def reduce_scatter_s(self, size: float, ranks: int, messages: int = 1) -> float:
        """``messages`` reduce-scatters of ``size`` bytes in all (the tensors before scattering)."""
        return self.all_gather_s(size, ranks, messages)

    def send_recv_s(self, size: float, messages: int = 1) -> float:
        """``messages`` sends of ``size`` bytes in all from one rank to the next."""
        return messages * self.all_gather_latency + size / self.all_gather


def bus_bandwidth(gpu_name: str, calibration: Calibration | None = None) -> BusBandwidth:
    """What ``calibration`` measured where it holds a measurement (its latencies, where it predates them,
    the interconnect's default), else the datasheet's link bandwidth in one direction (``LINK_BANDWIDTH``;
    PCIe Gen4 for GPUs without an NVLink figure) and the interconnect's default latency."""
    nvlink = gpu_name in LINK_BANDWIDTH
    latency = NVLINK_LATENCY_S if nvlink else PCIE_LATENCY_S
    if calibration is not None and calibration.all_reduce_bus_bandwidth and calibration.all_gather_bus_bandwidth:
        return BusBandwidth(calibration.all_reduce_bus_bandwidth, calibration.all_gather_bus_bandwidth,
                            calibration.collectives_source or "measured",
                            calibration.all_reduce_latency_s or latency, calibration.all_gather_latency_s or latency)
    if nvlink:
        link = LINK_BANDWIDTH[gpu_name]
        return BusBandwidth(link, link, f"datasheet NVLink, {link / 1e9:.0f} GB/s in each direction, "
                                        f"{latency * 1e6:.0f} us a message", latency, latency)
    return BusBandwidth(PCIE_BANDWIDTH, PCIE_BANDWIDTH, f"PCIe Gen4 x16, {PCIE_BANDWIDTH / 1e9:.0f} GB/s in each "
                                                        f"direction, {latency * 1e6:.1f} us a message (no NVLink "
                                                        f"figure for {gpu_name})", latency, latency)
