"""Collectives of a job over several nodes: the link between nodes, and which of a layout's groups cross it.

**Where ranks sit.** A job of ``W`` ranks on nodes of ``G`` GPUs takes ``n = ceil(W / G)`` nodes and
``k = W / n`` ranks on each, consecutive ranks together (the slurm launcher spreads ``--gpus`` evenly
over ``--nodes``, one torchrun agent per node), so a layout plans only where ``n`` divides ``W``. The
device meshes put tensor parallelism innermost (``fitbench.worker.tensor_parallel``: ``(pp, tp)``,
``(dp_shard, tp)``), so a tensor-parallel group is ``tp`` consecutive ranks, inside one node where
``tp`` divides ``k``, and the outer dimension (data parallelism or pipeline stages, of stride ``tp``)
has ``m = k / tp`` members on each of the ``n`` nodes. Of a pipeline's ``p - 1`` stage boundaries,
``n - 1`` cross from one node to the next.

**The link between nodes** is taken per GPU: a cluster node gives each GPU its own network port (a
"rail"): NVIDIA DGX H100 eight 400 Gb/s ConnectX-7 InfiniBand NDR ports for eight GPUs, DGX A100
eight 200 Gb/s ConnectX-6 HDR ports (NVIDIA DGX H100 and DGX A100 user guides, "Network ports"). In
bytes per second and direction: NDR 400 Gb/s = 50 GB/s, HDR 200 Gb/s = 25 GB/s, 100 Gb/s Ethernet
(RoCE) 12.5 GB/s; where several GPUs share a port, each gets its share (``--inter-node-bandwidth``).
Its latency per message is the one measured over NVLink (``NVLINK_LATENCY_S``: a launch and the
copies into and out of NCCL's buffers) plus two network steps of NCCL's ring, LL protocol, 2.7 us
each (NCCL ``src/graph/tuning.cc``, ``hwLat[NCCL_HW_NET]``), the steps a ring all-reduce over two
nodes takes across them. ``fitbench calibrate`` measures both over nodes where it runs on several
(``fitbench.launch.calibrate.measure_across_nodes``); ``--inter-node-bandwidth`` gives the bandwidth.

**A group across nodes** runs each collective in two levels, the 2D all-reduce of Mikami et al.
2018 ("Massively Distributed SGD: ImageNet/ResNet-50 Training in a Flash", arXiv:1811.05233): with
``m`` members on each of ``n`` nodes and a message of ``S`` bytes,

    all-reduce        t = RS_intra(S, m) + AR_inter(S / m, n) + AG_intra(S, m)
    all-gather        t = AG_inter(S / m, n) + AG_intra(S, m)
    reduce-scatter    t = RS_intra(S, m) + RS_inter(S / m, n)
    send / recv       t = latency_inter + S / B_inter        (a stage boundary between nodes)

each term a collective of ``fitbench.planning.collectives`` over its level's link (latency plus ring
bytes over bus bandwidth): the ``m`` members of a node each exchange their ``1 / m`` of the message
with their peers on the other nodes at once, each over its own port. The levels are taken one after
the other (NCCL pipelines them in chunks), so a collective across nodes is not forecast faster than
it runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fitbench.planning.calibration import Calibration
from fitbench.planning.collectives import NVLINK_LATENCY_S, BusBandwidth
from fitbench.spec import Layout

# Per GPU, bytes/s in each direction (the module docstring's sources).
FABRICS = {
    "ndr": (50e9, "InfiniBand NDR, 400 Gb/s per GPU"),
    "hdr": (25e9, "InfiniBand HDR, 200 Gb/s per GPU"),
    "100gbe": (12.5e9, "100 Gb/s Ethernet, one port per GPU"),
}
# The fabric a GPU's nodes are built with by default: DGX A100 is HDR; Hopper's (DGX H100, H200) NDR.
DEFAULT_FABRIC = {"NVIDIA A100-SXM4-80GB": "hdr", "NVIDIA A100-SXM4-40GB": "hdr", "NVIDIA A100 80GB PCIe": "hdr",
                  "NVIDIA A100-PCIE-40GB": "hdr"}
INTER_NODE_LATENCY_S = NVLINK_LATENCY_S + 2 * 2.7e-6
# Bytes per second per unit a figure may carry; b is a bit, B a byte.
RATE_UNITS = {"Gb/s": 1e9 / 8, "Gbit/s": 1e9 / 8, "Tb/s": 1e12 / 8, "GB/s": 1e9, "MB/s": 1e6, "TB/s": 1e12}


def parse_inter_node_bandwidth(text: str) -> float:
    """Bytes/s per GPU from a fabric's name (``FABRICS``) or a figure with its unit: ``400Gb/s`` (bits),
    ``50GB/s`` (bytes). Raises ValueError saying what is accepted."""
    cleaned = str(text).strip().replace(" ", "")
    if cleaned.lower() in FABRICS:
        return FABRICS[cleaned.lower()][0]
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]+/s)", cleaned)
    if match and match.group(2) in RATE_UNITS and float(match.group(1)) > 0:
        return float(match.group(1)) * RATE_UNITS[match.group(2)]
    raise ValueError(f"{text!r} is not a bandwidth between nodes; give a fabric ({', '.join(FABRICS)}) or a "
                     f"positive figure per GPU with its unit: 400Gb/s (bits) or 50GB/s (bytes)")


def inter_node_link(gpu_name: str, calibration: Calibration | None = None,
                    bandwidth: float | None = None) -> BusBandwidth:
    """The link between nodes, one GPU's port: ``bandwidth`` (bytes/s, ``--inter-node-bandwidth``) where
    given; else what ``calibration`` measured over nodes; else the GPU's default fabric
    (``DEFAULT_FABRIC``, NDR where none is named), at ``INTER_NODE_LATENCY_S`` a message."""
    measured = calibration is not None and calibration.inter_node_all_reduce_bus_bandwidth
    latency = INTER_NODE_LATENCY_S
    if bandwidth is not None:
        if measured:
            latency = calibration.inter_node_all_reduce_latency_s or latency
        return BusBandwidth(bandwidth, bandwidth, f"--inter-node-bandwidth {bandwidth / 1e9:.3g} GB/s per GPU, "
                                                  f"{latency * 1e6:.3g} us a message", latency, latency)
    if measured:
        return BusBandwidth(calibration.inter_node_all_reduce_bus_bandwidth,
                            calibration.inter_node_all_gather_bus_bandwidth,
                            calibration.inter_node_source or "measured over nodes",
                            calibration.inter_node_all_reduce_latency_s or latency,
                            calibration.inter_node_all_gather_latency_s or latency)
    rate, fabric = FABRICS[DEFAULT_FABRIC.get(gpu_name, "ndr")]
    return BusBandwidth(rate, rate, f"default: {fabric}, {rate / 1e9:.3g} GB/s, {latency * 1e6:.3g} us a message",
                        latency, latency)


@dataclass(frozen=True)
class Nodes:
    """A job over several nodes: ``count`` nodes of ``ranks`` ranks each, and ``link`` between them."""

    count: int
    ranks: int
    link: BusBandwidth


def job_nodes(world: int, node_gpus: int, link: BusBandwidth) -> Nodes | None:
    """The nodes ``world`` ranks take on nodes of ``node_gpus`` GPUs; None where one node holds them."""
    if world <= node_gpus:
        return None
    count = -(-world // node_gpus)
    return Nodes(count, world // count, link)


def placement_problem(layout: Layout, node_gpus: int) -> str | None:
    """Why ``layout`` cannot run on nodes of ``node_gpus`` GPUs, or None: its ranks must spread evenly
    over the nodes they take, and a tensor-parallel group stay inside one node."""
    world = layout.world_size
    if layout.tp > node_gpus:
        return f"tensor parallel {layout.tp} spans more than the {node_gpus} GPUs of one node"
    if world <= node_gpus:
        return None
    count = -(-world // node_gpus)
    if world % count:
        return (f"{world} GPUs do not spread evenly over the {count} nodes of {node_gpus} they take; "
                f"a count that fills each node alike does")
    if (world // count) % layout.tp:
        return (f"tensor parallel {layout.tp} would straddle nodes of {world // count} ranks; its degree must "
                f"divide the ranks of a node")
    return None


@dataclass(frozen=True)
class AcrossNodes:
    """A group of ``per_node`` ranks on each of ``nodes`` nodes: each collective in two levels (the
    module docstring), ``intra`` inside a node and ``inter`` between them. It answers as a
    ``BusBandwidth`` does; ``ranks``, the group's size, is ``per_node x nodes``."""

    intra: BusBandwidth
    inter: BusBandwidth
    per_node: int
    nodes: int

    def all_reduce_s(self, size: float, ranks: int, messages: int = 1) -> float:
        return (self.intra.reduce_scatter_s(size, self.per_node, messages)
                + self.inter.all_reduce_s(size / self.per_node, self.nodes, messages)
                + self.intra.all_gather_s(size, self.per_node, messages))

    def all_gather_s(self, size: float, ranks: int, messages: int = 1) -> float:
        return (self.inter.all_gather_s(size / self.per_node, self.nodes, messages)
                + self.intra.all_gather_s(size, self.per_node, messages))

    def reduce_scatter_s(self, size: float, ranks: int, messages: int = 1) -> float:
        return (self.intra.reduce_scatter_s(size, self.per_node, messages)
                + self.inter.reduce_scatter_s(size / self.per_node, self.nodes, messages))


@dataclass(frozen=True)
class LayoutLinks:
    """The links each dimension of a layout's collectives travel: ``tensor`` (always inside a node),
    ``data`` (a ``BusBandwidth`` inside one node, ``AcrossNodes`` over several) and the pipeline's stage
    boundaries, ``boundaries_across`` of them between nodes over ``inter``, the rest over ``intra``."""

    intra: BusBandwidth
    data: BusBandwidth | AcrossNodes
    inter: BusBandwidth | None = None
    boundaries_across: int = 0

    @property
    def tensor(self) -> BusBandwidth:
        """Tensor parallelism's link: a tensor-parallel group stays inside a node (``placement_problem``)."""
        return self.intra

    def sends_s(self, size: float, stages: int, directions: int) -> float:
        """The sends on a pipeline's critical path: one microbatch's activations, ``size`` bytes, through
        each of the ``stages - 1`` boundaries, and in training (``directions`` 2) its gradient back;
        those between nodes over the link between them."""
        across = directions * self.boundaries_across
        inside = directions * (stages - 1) - across
        between = self.inter.send_recv_s(across * size, messages=across) if across else 0.0
        return self.intra.send_recv_s(inside * size, messages=inside) + between


def layout_links(layout: Layout, intra: BusBandwidth, nodes: Nodes | None) -> LayoutLinks:
    """Which link each of ``layout``'s collectives takes on ``nodes`` (None: one node, every one over
    ``intra``): the outer dimension spans the nodes, ``k / tp`` of its ranks on each."""
    if nodes is None:
        return LayoutLinks(intra, intra)
    per_node = nodes.ranks // layout.tp
    return LayoutLinks(intra, AcrossNodes(intra, nodes.link, per_node, nodes.count), nodes.link,
                       nodes.count - 1 if layout.pp > 1 else 0)
