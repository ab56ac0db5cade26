"""What runs a job's attempts, and what a sweep tells as it goes: the interface between a job
(``fitbench.launch.job``), which decides what to try, and the machinery that runs it.

- ``Attempt``: one launch of a configuration: the worker's assignment, where its log and artifacts
  go, and how long it may take;
- ``Launcher``: runs an attempt to its end and returns its row: on this machine,
  ``fitbench.launch.local.LocalLauncher``; a launcher for a cluster's scheduler implements the same
  method.

What a sweep tells as it goes is ``fitbench.launch.sweep_display``.

``docs/architecture.md`` ("A launcher") says what a launcher must do with an attempt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from fitbench.results.row import Row
from fitbench.spec import Assignment

# A progress event of the worker: one JSON object of its stdout (``fitbench.worker.worker``).
Event = dict[str, Any]


@dataclass(frozen=True)
class Attempt:
    """One launch of a configuration. ``assignment``: what the worker runs (its spec and the planner's
    figures it acts on); ``log``: the file for the worker's stderr (and stdout lines that are not
    events); ``artifacts``: the directory for what the parent records beside it (the GPUs' timeline);
    ``timeout``: the seconds it may take before everything it started is ended and its row says
    ``timeout``; ``limit``: that bound in words, for the timeout's error."""

    assignment: Assignment
    log: Path
    artifacts: Path
    timeout: float
    limit: str


class Launcher(Protocol):
    def run(self, attempt: Attempt, on_event: Callable[[Event], None]) -> Row:
        """Run ``attempt`` to its end, passing each progress event of the worker to ``on_event``, and
        return its row: the worker's measurement, or the status of how it ended without one
        (``fitbench.results.row.Status``). Nothing it started outlives it; an interruption
        (``KeyboardInterrupt``) ends the attempt and goes on up."""
