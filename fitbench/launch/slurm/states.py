"""The row of a SLURM job that ended without writing its own: its state, as a row's status.

A job writes its configuration's row itself as its last act (``fitbench.cli.allocation``). One that
SLURM ended first (its time limit, a node, a person, a job of higher priority) has none; the sweep's
process writes one for it from SLURM's state and reason (``STATUS_OF``):

- ``TIMEOUT`` (the ``--time`` limit): ``timeout``, as a configuration past its ``--timeout``;
- ``OUT_OF_MEMORY`` (the ``--mem`` limit of a node): ``oom``;
- ``CANCELLED`` (``scancel``), ``PREEMPTED``, ``NODE_FAIL``: ``cancelled``, ``preempted``,
  ``node_failed``, which ``--resume`` runs again (``fitbench.results.row.RERUN_STATUSES``);
- ``FAILED``, or ``COMPLETED`` without a row: ``crashed``, the job's output names the cause;
- a job SLURM no longer knows: ``cancelled`` (``JobStatus`` ``GONE``): an array's task cancelled
  before it started leaves no record in ``squeue``, and neither does a job that ended longer ago than
  slurmctld keeps jobs (``MinJobAge``) on a cluster without accounting (``sacct``).

The row keeps SLURM's words in ``slurm`` (the job's id, its state as SLURM wrote it, its reason) and
the last lines of the job's output in ``error``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fitbench.launch.job import Job
from fitbench.launch.slurm.jobs import JobStatus
from fitbench.models.registry import resolve
from fitbench.results.row import RERUN_STATUSES, Row, Status

OUTPUT_TAIL_LINES = 10
STATUS_OF: dict[str, Status] = {"GONE": "cancelled", "TIMEOUT": "timeout", "OUT_OF_MEMORY": "oom", "CANCELLED": "cancelled",
                                  "PREEMPTED": "preempted", "NODE_FAIL": "node_failed", "FAILED": "crashed",
                                  "COMPLETED": "crashed"}
# the status of a job SLURM no longer knows
GONE = "GONE"
WHY = {"GONE": "is no longer known to SLURM (cancelled before it started, or ended longer ago than slurmctld "
               "keeps jobs, with no accounting to ask)","TIMEOUT": "reached its time limit (--time)", "OUT_OF_MEMORY": "ran out of its memory (--mem)",
       "CANCELLED": "was cancelled", "PREEMPTED": "was preempted by a job of higher priority",
       "NODE_FAIL": "lost a node", "FAILED": "failed", "COMPLETED": "completed"}


def stopped_row(job: Job, status: JobStatus, output: Path, *, command: str, finished_at: str) -> dict[str, Any]:
    """The row of ``job``, whose SLURM job ended in ``status`` without writing one; ``output`` is the
    job's output file (sbatch's ``--output``)."""
    spec = job.spec
    kind = GONE if status.slurm_state == GONE else status.state
    state = "" if kind == GONE else f" ({status.slurm_state})"
    reason = f" (SLURM's reason: {status.reason})" if status.reason else ""
    again = " `fitbench run --resume` runs it again." if STATUS_OF[kind] in RERUN_STATUSES else ""
    error = (f"SLURM job {status.job_id} {WHY[kind]}{state}{reason} before the configuration's row was written."
             f"{again} Its output: {output}")
    tail = _tail(output)
    return Row(key=spec.key, label=spec.label, spec=spec.model_dump(), status=STATUS_OF[kind],
               error=error + ("\n" + tail if tail else ""), params=resolve(spec.model).total_params,
               finished_at=finished_at, log=str(output), command=command,
               slurm={"job_id": status.job_id, "state": status.slurm_state, "reason": status.reason}).as_dict()


def gone(job_id: str) -> JobStatus:
    """The status of job ``job_id`` once SLURM no longer knows it."""
    return JobStatus(job_id, "CANCELLED", GONE, None)


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-OUTPUT_TAIL_LINES:]).strip()
