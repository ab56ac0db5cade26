"""The launcher inside a SLURM allocation of several nodes: each attempt's ranks start on every node.

An attempt runs as one job step: ``srun`` starts one task per node, each a torchrun agent inside the
node's GPU sampler (``fitbench.launch.slurm.sampler``, which writes the node's NVML timeline beside
the attempt's artifacts and the row merges)
(``fitbench.launch.slurm.script.agent_options``) with ``--nproc-per-node`` ranks, meeting at a c10d
rendezvous on the allocation's first node (the first host of ``scontrol show hostnames
$SLURM_JOB_NODELIST``, where the job's own process runs) on a port free there when the attempt
starts; ``--rdzv-id`` is new per attempt, so two attempts never meet. Source: PyTorch's torchrun
documentation, "Multi-node multi-worker" and "Rendezvous".

The batch script exports the ``srun`` and torchrun parts of that command line
(``FITBENCH_SRUN``, ``FITBENCH_TORCHRUN``: ``fitbench.launch.slurm.script.launcher_lines``), where a
person reads and may edit them (another ``--cpus-per-task``, ``--mpi``, a torchrun option); each attempt
starts its ranks with them, adding the rendezvous endpoint and id and the worker.

The ranks of other nodes cannot see this node's processes: they run without
``FITBENCH_PARENT_PID`` (``fitbench.util.processes.tie_to_parent``) and end with their agent, which
``srun`` ends when the attempt's step ends. The attempt's scratch directory (the assignment, the
ranks' results and phase files) lies in the sweep's directory, which every node of a cluster sees.
"""

from __future__ import annotations

import os
import secrets
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fitbench.launch.launcher import Attempt, Event
from fitbench.launch.local import run_one
from fitbench.launch.slurm.sampler import merge_nodes
from fitbench.launch.slurm.script import SRUN_VARIABLE, TORCHRUN_VARIABLE, srun_line, torchrun_line
from fitbench.results.row import Row
from fitbench.util.processes import PARENT_VARIABLE


@dataclass(frozen=True)
class AgentsOnNodes:
    """The worker as ``nodes`` torchrun agents of ``ranks_per_node`` ranks each, one per node, started
    by ``srun``, meeting at ``endpoint`` (host:port) under ``rendezvous_id``; each node's first
    ``sampled_gpus`` GPUs sampled into ``samples`` while its agent runs."""

    nodes: int
    ranks_per_node: int
    endpoint: str
    rendezvous_id: str
    samples: Path
    sampled_gpus: int
    cpus_per_task: int | None = None

    def command(self, assignment: Path, result: Path) -> list[str]:
        srun = _given(SRUN_VARIABLE) or srun_line(self.nodes, self.cpus_per_task)
        torchrun = _given(TORCHRUN_VARIABLE) or torchrun_line(self.nodes, self.ranks_per_node)
        return [*srun, "env", "-u", PARENT_VARIABLE, sys.executable, "-m", "fitbench.launch.slurm.sampler",
                str(self.samples), str(self.sampled_gpus), "--", *torchrun, f"--rdzv-endpoint={self.endpoint}",
                f"--rdzv-id={self.rendezvous_id}", "-m", "fitbench.worker.worker", str(assignment), str(result)]


def srun_tasks(nodes: int, cpus_per_task: int | None = None) -> list[str]:
    """The start of a command that ``srun`` runs as one task on each of ``nodes`` nodes, without
    ``FITBENCH_PARENT_PID``, whose process other nodes cannot see."""
    return [*srun_line(nodes, cpus_per_task), "env", "-u", PARENT_VARIABLE]


def _given(variable: str) -> list[str]:
    """The command line the batch script exports in ``variable`` (as a person may have edited it), as words."""
    return shlex.split(os.environ.get(variable, ""))


@dataclass(frozen=True)
class NodesLauncher:
    """Each attempt as one job step over the allocation's ``nodes`` nodes, ``ranks_per_node`` ranks each."""

    nodes: int
    ranks_per_node: int
    cpus_per_task: int | None = None

    def run(self, attempt: Attempt, on_event: Callable[[Event], None]) -> Row:
        gpus = self.ranks_per_node if attempt.assignment.spec.device.startswith("cuda") else 0
        agents = AgentsOnNodes(self.nodes, self.ranks_per_node, f"{first_host()}:{free_port()}",
                               f"{os.environ.get('SLURM_JOB_ID', 'job')}-{secrets.token_hex(4)}", attempt.artifacts,
                               gpus, self.cpus_per_task)
        row = run_one(attempt.assignment, attempt.log, attempt.timeout, on_event, limit=attempt.limit,
                      artifacts=attempt.artifacts, worker=agents, scratch_in=attempt.artifacts, sample=False)
        return row.model_copy(update={"gpu_monitor": merge_nodes(attempt.artifacts, allocation_hosts())})


def allocation_hosts() -> list[str]:
    """The allocation's nodes in SLURM's order, the first where the job's own process runs."""
    done = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], capture_output=True,
                          text=True, check=True, stdin=subprocess.DEVNULL, timeout=60)
    return done.stdout.split()


def first_host() -> str:
    """The first host of the allocation, where the job's own process runs."""
    return allocation_hosts()[0]


def free_port() -> int:
    """A port the kernel hands out as free on this node."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
