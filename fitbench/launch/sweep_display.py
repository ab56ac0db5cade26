"""What a sweep tells as it goes: ``SweepDisplay``, whose methods ``fitbench.launch.local.run_sweep`` and
the SLURM sweep (``fitbench.launch.slurm.sweep``) call at each step of a job's life. Each does nothing
here; a display (``fitbench.cli.display``) overrides those it shows."""

from __future__ import annotations

from typing import Any

from fitbench.launch.job import Job
from fitbench.launch.launcher import Event


class SweepDisplay:
    """What a sweep tells as it goes."""

    def started(self, job: Job, index: int, total: int) -> None:
        """``job``, the ``index``-th of ``total``, starts."""

    def event(self, event: Event) -> None:
        """A progress event of the worker in flight."""

    def finished(self, row: dict[str, Any]) -> None:
        """A job's row was appended to the results."""

    def skipped(self, job: Job) -> None:
        """``job`` already has a row (a resumed sweep) and does not run."""

    def submitted(self, job: Job, job_id: str) -> None:
        """``job`` was submitted to a cluster's scheduler as job ``job_id``."""

    def job_state(self, job: Job, job_id: str, state: str, reason: str | None, progress: Event | None) -> None:
        """The scheduler's job ``job_id`` of ``job`` is now in ``state`` (``PENDING``, ``RUNNING``) for
        ``reason`` (the scheduler's, None where it gives none), its latest progress event ``progress``."""
