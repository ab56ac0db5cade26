"""How far a sweep (or any long command) has come, for the live display and for logs.

A sweep of large models runs for hours, often with its output in a log file rather than a
terminal; either way a person wants how many configurations are done, for how long it has run,
and about how long is left. The report of a large sweep and a comparison take minutes; they tell
their steps through ``Steps`` and are timed by the same ``SweepClock``.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

from rich.progress import ProgressColumn, Task
from rich.table import Column
from rich.text import Text


class SweepClock:
    """Configurations done out of the sweep's total, time since this invocation started, and the
    time left estimated from the configurations measured so far: their mean duration for each one
    still to run, less what the running one has already spent. Configurations finished by an
    earlier invocation and refusals (no process ran) count as done but not in the mean."""

    def __init__(self, total: int, now: Callable[[], float] = time.monotonic):
        self.total = total
        self.done = 0
        self._now = now
        self._started = now()
        self._running_since: float | None = None
        self._durations: list[float] = []

    def start(self) -> None:
        self._running_since = self._now()

    def finish(self, measured: bool = True) -> None:
        if measured and self._running_since is not None:
            self._durations.append(self._now() - self._running_since)
        self._running_since = None
        self.done += 1

    def skip(self) -> None:
        self.done += 1

    @property
    def elapsed(self) -> float:
        return self._now() - self._started

    @property
    def remaining(self) -> float | None:
        """Seconds left, None until a configuration has been measured."""
        left = self.total - self.done
        if left <= 0:
            return 0.0
        if not self._durations:
            return None
        mean = sum(self._durations) / len(self._durations)
        if self._running_since is None:
            return mean * left
        return max(0.0, mean - (self._now() - self._running_since)) + mean * (left - 1)

    def eta(self) -> str:
        remaining = self.remaining
        if remaining is None:
            return "time left: estimating"
        return "done" if self.done >= self.total else f"about {clock_time(remaining)} left"

    def summary(self) -> str:
        return f"{self.done}/{self.total} done, {clock_time(self.elapsed)} elapsed, {self.eta()}"


def clock_time(seconds: float) -> str:
    """h:mm:ss, as rich's elapsed column writes it."""
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class EtaColumn(ProgressColumn):
    """The sweep's estimated time left, on the task added with ``eta=True``."""

    def __init__(self, clock: SweepClock):
        super().__init__(table_column=Column(no_wrap=True))  # the label beside it wraps first
        self.clock = clock

    def render(self, task: Task) -> Text:
        return Text(self.clock.eta() if task.fields.get("eta") else "", style="progress.remaining")


class Steps(Protocol):
    """What a long computation tells as it goes (``fitbench.report``): a stage of ``total`` equal
    steps begins (``begin``), and each step ends (``advance``). A display shows the stage's progress
    and its time left (``SweepClock``); ``NO_STEPS`` shows nothing."""

    def begin(self, what: str, total: int) -> None: ...

    def advance(self) -> None: ...


class _NoSteps:
    def begin(self, what: str, total: int) -> None:
        pass

    def advance(self) -> None:
        pass


NO_STEPS: Steps = _NoSteps()
