"""How a configuration's processes start on this machine: one worker process, or one torchrun job of N
ranks.

A worker command turns the worker's two files (its assignment and where its result goes) into the
command line that starts the job; ``fitbench.launch.local.run_one`` runs that command, follows it, and
ends everything it started. Every rank of a torchrun job runs ``fitbench.worker.worker``; rank 0 writes the
job's one result (``fitbench.worker.ranks.gather_json``).

torchrun (``torch.distributed.run``) on one node: ``--standalone`` makes a rendezvous on a free port of
localhost, ``--nproc-per-node N`` starts N ranks, each told RANK, LOCAL_RANK, WORLD_SIZE and
LOCAL_WORLD_SIZE; ``--max-restarts 0``: a rank that fails ends the job (torchrun stops the others)
instead of restarting it, since a benchmark that restarted would measure something else. Source:
PyTorch's torchrun documentation, "Single-node multi-worker" and "--max-restarts".
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from fitbench.spec import Layout


class WorkerCommand(Protocol):
    def command(self, assignment: Path, result: Path) -> list[str]:
        """The command line that runs the worker on ``assignment`` and writes ``result``."""


@dataclass(frozen=True)
class LocalProcess:
    """The worker as one plain process."""

    def command(self, assignment: Path, result: Path) -> list[str]:
        return [sys.executable, "-m", "fitbench.worker.worker", str(assignment), str(result)]


@dataclass(frozen=True)
class Torchrun:
    """The worker as ``ranks`` processes of one torchrun job on this node."""

    ranks: int

    def command(self, assignment: Path, result: Path) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.ranks}",
                "--max-restarts=0", "-m", "fitbench.worker.worker", str(assignment), str(result)]


def worker_command(layout: Layout, backend: str = "native") -> WorkerCommand:
    """torchrun for a layout of several ranks, a plain process for one, for the hf backend's pipeline
    stages, which one process drives over every GPU of the job (``fitbench.worker.hf_pipeline``), and
    for the vllm backend, whose engines start their own processes (``fitbench.worker.vllm_backend``)."""
    if layout.world_size == 1 or backend == "vllm" or (backend == "hf" and layout.pp == layout.world_size):
        return LocalProcess()
    return Torchrun(layout.world_size)
