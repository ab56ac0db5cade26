"""A job's size, made to agree before it queues: its ranks (``--gpus``), nodes and GPUs per node, those
left out derived from the others, and the CPUs and memory each node's task asks where GPUs are asked.

On GPUs, ranks = nodes x GPUs per node (one rank per GPU, ``fitbench.launch.slurm.script``): with all
three given they must agree; with two, the third follows (``--gpus 16 --gpus-per-node 8``: 2 nodes);
with ``--gpus`` and neither of the others, one node of that many GPUs. On CPUs the ranks spread evenly
over the nodes and no GPU is asked. A size that cannot agree is a ``UserError`` (exit 2, nothing
submitted), where SLURM would queue the job and fail it later, or run it on fewer GPUs than meant.

Each node's task is one torchrun agent and its ranks, and SLURM gives a task one CPU unless asked
(sbatch's manual, ``--cpus-per-task``), and a node's default memory. So where GPUs are asked and
``--cpus-per-task`` or ``--mem`` is not, each is the node's share for the GPUs asked, from what
``sinfo`` lists of the partition's nodes (``NodeShape``): CPUs x asked / GPUs of a node, and memory
likewise (in MB, sbatch's default unit). Where ``sinfo`` cannot tell (no SLURM commands here, a node
without a GPU count in its GRES), a warning says so and the option is left to the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fitbench.util.errors import UserError


@dataclass(frozen=True)
class NodeShape:
    """A node of the partition as ``sinfo`` lists it: ``cpus`` (``%c``), ``memory_mb`` (``%m``), ``gpus``
    (the count of its GRES ``gpu``; None where it lists none)."""

    cpus: int
    memory_mb: int
    gpus: int | None


@dataclass(frozen=True)
class Size:
    """A job's size as submitted, and the warnings about what could not be derived."""

    gpus: int
    nodes: int
    gpus_per_node: int | None
    cpus_per_task: int | None
    mem: str | None
    warnings: tuple[str, ...] = ()


def size_job(*, on_gpus: bool, gpus: int | None, nodes: int | None, gpus_per_node: int | None,
             cpus_per_task: int | None, mem: str | None, node: Callable[[], NodeShape | None]) -> Size:
    """The job's size from the options given (None: left out); ``node`` reads the partition's node
    (None where it cannot be read), asked where GPUs are. Raises UserError."""
    if not on_gpus:
        return _size_on_cpus(gpus or 1, nodes or 1, gpus_per_node, cpus_per_task, mem)
    if gpus is not None and nodes is not None and gpus_per_node is not None and gpus != nodes * gpus_per_node:
        raise UserError(f"gpus: --gpus {gpus} ranks are not --nodes {nodes} x --gpus-per-node {gpus_per_node} = "
                        f"{nodes * gpus_per_node} GPUs, one rank each. Give --gpus {nodes * gpus_per_node}, or "
                        f"leave one of the three out and it follows from the others.")
    if gpus is not None and gpus_per_node is not None and gpus % gpus_per_node:
        raise UserError(f"gpus: --gpus {gpus} ranks do not fill whole nodes of --gpus-per-node {gpus_per_node}; give "
                        f"--gpus a multiple of {gpus_per_node}, or another --gpus-per-node.")
    if gpus is not None and nodes is not None and gpus % nodes:
        raise UserError(f"nodes: --gpus {gpus} ranks do not spread evenly over --nodes {nodes}; give --gpus a "
                        f"multiple of {nodes} (ranks per node x nodes), or fewer --nodes.")
    if gpus is None:
        nodes, gpus_per_node = nodes or 1, gpus_per_node or 1
        gpus = nodes * gpus_per_node
    elif gpus_per_node is None:
        nodes = nodes or 1
        gpus_per_node = gpus // nodes
    else:
        nodes = gpus // gpus_per_node
    warnings = []
    shape = node()
    if shape is not None and shape.gpus and gpus_per_node > shape.gpus:
        raise UserError(f"gpus-per-node: {gpus_per_node} GPUs asked of each node; the partition's nodes have "
                        f"{shape.gpus} (their GRES, as sinfo lists it). Give --gpus-per-node {shape.gpus} or fewer, "
                        f"with more --nodes.")
    if (cpus_per_task is None or mem is None) and (shape is None or not shape.gpus):
        why = "sinfo could not be asked" if shape is None else "the partition's nodes list no GPU count in GRES"
        warnings.append(f"--cpus-per-task and --mem were left to the cluster ({why}): a node's task, its torchrun "
                        f"agent and {gpus_per_node} rank(s), may get one CPU. Give --cpus-per-task and --mem.")
    elif shape is not None and shape.gpus:
        cpus_per_task = cpus_per_task or max(1, shape.cpus * gpus_per_node // shape.gpus)
        mem = mem or f"{shape.memory_mb * gpus_per_node // shape.gpus}M"
    return Size(gpus, nodes, gpus_per_node, cpus_per_task, mem, tuple(warnings))


def _size_on_cpus(ranks: int, nodes: int, gpus_per_node: int | None, cpus_per_task: int | None,
                  mem: str | None) -> Size:
    if gpus_per_node is not None:
        raise UserError(f"gpus-per-node: --gpus-per-node {gpus_per_node} asks GPUs of each node for a job of CPU "
                        f"processes (--device cpu). Leave --gpus-per-node out, or give --device cuda.")
    if ranks % nodes:
        raise UserError(f"nodes: --gpus {ranks} ranks do not spread evenly over --nodes {nodes}; give --gpus a "
                        f"multiple of {nodes} (ranks per node x nodes), or fewer --nodes.")
    return Size(ranks, nodes, None, cpus_per_task, mem)
