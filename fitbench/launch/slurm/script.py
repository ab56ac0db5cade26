"""Batch scripts: one configuration as one job, a sweep as one job array.

A script is what a person reads and edits: ``#SBATCH`` lines from ``SlurmOptions``, the user's
``--setup`` lines as written (``setup_lines``), then the command that starts the job's ranks. Every other word that comes from input reaches the shell through
``shlex.quote`` (sbatch reads the ``#SBATCH`` lines with the same quoting); the only words left to
the shell are its own variables (``$SLURM_JOB_NODELIST``, ``$SLURM_ARRAY_TASK_ID``).

How a job's ranks start, by its size (``ranks_per_node`` is ``gpus_per_node`` where that is set):

- one rank: the program itself, ``python ARGS``;
- one node of G ranks: ``torchrun --standalone --nproc-per-node G``, as on a workstation
  (``fitbench.launch.launchers.Torchrun``);
- N nodes of G ranks: ``srun`` starts one task per node, each a torchrun agent with ``--nnodes N
  --nproc-per-node G``, meeting at a c10d rendezvous on the job's first node (the first host of
  ``scontrol show hostnames $SLURM_JOB_NODELIST``) on a port free there when the script starts; the
  batch script runs on that first node. ``--rdzv-id`` is the job's id, so two jobs never meet.
  Source: PyTorch's torchrun documentation, "Multi-node multi-worker" and "Rendezvous".

A fitbench job runs its program once, on the job's first node, and the program starts the job's
ranks itself, attempt by attempt (``ScriptJob.driver``: ``fitbench.launch.slurm.nodes``).

An array gives each configuration one task: ``--array=0-(n-1)%limit`` runs at most ``limit`` of
them at once, and a ``case`` on ``$SLURM_ARRAY_TASK_ID`` picks the task's command.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from fitbench.launch.slurm.options import SlurmOptions
from fitbench.util.errors import UserError

TORCHRUN = ("-m", "torch.distributed.run")
# where a driver's script exports the srun and torchrun lines of its attempts over several nodes
SRUN_VARIABLE = "FITBENCH_SRUN"
TORCHRUN_VARIABLE = "FITBENCH_TORCHRUN"
# a long command goes on over lines, one part of it per line
CONTINUED = " \\\n      "
# a port the kernel hands out as free on the first node, printed by the job's own Python
FREE_PORT = 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'


@dataclass(frozen=True)
class ScriptJob:
    """What the script runs and where it writes: ``arguments`` follow the Python interpreter in each
    rank (``-m fitbench.worker.worker ASSIGNMENT RESULT``, or a script and its arguments); ``output``
    is sbatch's ``--output`` pattern (``%j`` the job id; in an array ``%A`` its id, ``%a`` the task's);
    ``driver``: the program runs once, on the job's first node, and starts the ranks itself."""

    name: str
    output: str
    ranks_per_node: int | None = None
    python: str = sys.executable
    driver: bool = False


def sbatch_lines(options: SlurmOptions, job: ScriptJob) -> list[str]:
    """The ``#SBATCH`` lines of a job under ``options``, the job's own (name, output, tasks) first."""
    pairs = [("--job-name", job.name), ("--output", job.output), ("--nodes", options.nodes),
             ("--ntasks-per-node", 1), ("--partition", options.partition), ("--account", options.account),
             ("--time", options.time), ("--gpus-per-node", options.gpus_per_node),
             ("--cpus-per-task", options.cpus_per_task), ("--mem", options.mem)]
    lines = [f"#SBATCH {shlex.quote(f'{name}={value}')}" for name, value in pairs if value is not None]
    return lines + [f"#SBATCH {shlex.quote(argument)}" for argument in options.sbatch_args]


def ranks_per_node(options: SlurmOptions, job: ScriptJob) -> int:
    """Ranks on each node: the job's own count, else one per GPU, else one."""
    return job.ranks_per_node or options.gpus_per_node or 1


def rendezvous_lines(options: SlurmOptions, job: ScriptJob) -> list[str]:
    """The lines that find the rendezvous endpoint of a job of several nodes (none for one node)."""
    if options.nodes == 1 or job.driver:
        return []
    # sed reads the whole list: head would leave scontrol writing into a closed pipe, which pipefail ends
    return ['rendezvous_host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
            f"rendezvous_port=$({shlex.join([job.python, '-c', FREE_PORT])})"]


def launch_command(options: SlurmOptions, job: ScriptJob, arguments: Sequence[str]) -> str:
    """The shell command that starts every rank of one configuration inside the allocation."""
    ranks, nodes = ranks_per_node(options, job), options.nodes
    if job.driver or (nodes == 1 and ranks == 1):
        return shlex.join([job.python, *arguments])
    if nodes == 1:
        return shlex.join([job.python, *TORCHRUN, "--standalone", f"--nproc-per-node={ranks}", "--max-restarts=0",
                           *arguments])
    srun = srun_line(nodes, options.cpus_per_task)
    return CONTINUED.join([shlex.join(srun), shlex.join([job.python, *TORCHRUN, *agent_options(nodes, ranks)]),
                           '--rdzv-endpoint="$rendezvous_host:$rendezvous_port" --rdzv-id="$SLURM_JOB_ID"',
                           shlex.join(arguments)])


def srun_line(nodes: int, cpus_per_task: int | None = None) -> list[str]:
    """``srun`` running one task on each of ``nodes`` nodes."""
    srun = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1"]
    # "The number of cpus per task specified for salloc or sbatch is not automatically inherited by
    # srun" (srun's manual page, --cpus-per-task, SLURM 22.05)
    if cpus_per_task is not None:
        srun.append(f"--cpus-per-task={cpus_per_task}")
    return srun


def torchrun_line(nodes: int, ranks_per_node: int, python: str = sys.executable) -> list[str]:
    """One node's torchrun agent of ``ranks_per_node`` ranks, but for its rendezvous endpoint and id."""
    return [python, "-m", "torch.distributed.run", *agent_options(nodes, ranks_per_node)]


def agent_options(nodes: int, ranks: int) -> list[str]:
    """torchrun's options for one agent of a job of ``nodes`` nodes of ``ranks`` ranks each, but for its
    rendezvous endpoint and id: ``--max-restarts=0`` as on one node (``fitbench.launch.launchers``)."""
    return [f"--nnodes={nodes}", f"--nproc-per-node={ranks}", "--rdzv-backend=c10d", "--max-restarts=0"]


def setup_lines(options: SlurmOptions) -> list[str]:
    """The user's ``--setup`` lines as written, under ``set -eo pipefail`` (a line that fails ends the
    job) but before ``set -u``, which module and venv scripts that read unset variables do not survive."""
    if not options.setup:
        return []
    return ["set -eo pipefail", "# --setup", *options.setup]


def launcher_lines(options: SlurmOptions, job: ScriptJob) -> list[str]:
    """For a driver over several nodes, the ``srun`` and torchrun lines each attempt starts its ranks
    with (``fitbench.launch.slurm.nodes``), exported for it to read, where a person may edit them."""
    if not job.driver or options.nodes == 1:
        return []
    ranks = ranks_per_node(options, job)
    return ["# each attempt's ranks: srun starts one torchrun agent per node; fitbench adds the rendezvous "
            "endpoint, its id and the worker",
            f"export {SRUN_VARIABLE}={shlex.quote(shlex.join(srun_line(options.nodes, options.cpus_per_task)))}",
            f"export {TORCHRUN_VARIABLE}={shlex.quote(shlex.join(torchrun_line(options.nodes, ranks, job.python)))}"]


def _script(options: SlurmOptions, job: ScriptJob, array: list[str], body: list[str]) -> str:
    lines = ["#!/bin/bash", *sbatch_lines(options, job), *array, *setup_lines(options), "set -euo pipefail",
             *rendezvous_lines(options, job), *launcher_lines(options, job), *body]
    return "\n".join(lines) + "\n"


def batch_script(options: SlurmOptions, job: ScriptJob, arguments: Sequence[str]) -> str:
    """The batch script of one configuration: its ranks run ``python ARGUMENTS``."""
    return _script(options, job, [], ["exec " + launch_command(options, job, arguments)])


def array_script(options: SlurmOptions, job: ScriptJob, tasks: Sequence[Sequence[str]], limit: int) -> str:
    """The batch script of a job array: task ``i`` runs ``python tasks[i]``, at most ``limit`` at once."""
    if not tasks:
        raise ValueError("a job array needs at least one task")
    if limit < 1:
        raise UserError(f"array limit: {limit} tasks at once would run none. Give 1 or more, or leave it out to "
                        f"run the whole sweep at once.")
    branches = [f"  {index}) exec {launch_command(options, job, arguments)} ;;" for index, arguments in enumerate(tasks)]
    return _script(options, job, [f"#SBATCH --array=0-{len(tasks) - 1}%{limit}"],
                   ['case "$SLURM_ARRAY_TASK_ID" in', *branches,
                    '  *) echo "no configuration for array task $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;', "esac"])
