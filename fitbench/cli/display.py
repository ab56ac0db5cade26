"""What the long commands show while they work. ``fitbench run``: a live progress bar in a terminal,
one line per configuration elsewhere (a live display outside a terminal shows nothing until the end),
and each finished row in a sentence; results.csv is rewritten after each row. ``fitbench report`` and
``fitbench compare``: their stages as a bar on standard error, in a terminal only. ``--quiet`` shows
none of it. The time left is ``fitbench.results.terminal.SweepClock``'s."""

from __future__ import annotations

import time
from typing import Any, Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Column

from fitbench.cli.console import console, errors
from fitbench.launch.job import Job
from fitbench.launch.launcher import Event
from fitbench.launch.sweep_display import SweepDisplay
from fitbench.results.report import write_csv
from fitbench.results.row import Row
from fitbench.results.store import ResultStore
from fitbench.results.terminal import EtaColumn, SweepClock


class ProgressDisplay(SweepDisplay):
    """The sweep of ``total`` configurations writing to ``store``; used as a context manager around it."""

    def __init__(self, total: int, store: ResultStore, quiet: bool = False):
        self.store = store
        self.quiet = quiet
        self.clock = SweepClock(total)
        figure = Column(no_wrap=True)  # at 80 columns the label wraps; counts and times stay whole
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=20),
                                 MofNCompleteColumn(table_column=figure), TimeElapsedColumn(table_column=figure),
                                 EtaColumn(self.clock), console=console, transient=True,
                                 disable=quiet or not console.is_terminal)
        self.sweep_task = self.progress.add_task("sweep", total=total, eta=True)
        self.run_task = self.progress.add_task("", total=None)

    def __enter__(self) -> ProgressDisplay:
        self.progress.__enter__()
        return self

    def __exit__(self, *exception) -> None:
        self.progress.__exit__(*exception)

    def started(self, job: Job, index: int, total: int) -> None:
        self.clock.start()
        self.progress.update(self.run_task, description=f"{escape(job.spec.label)}: starting", completed=0,
                             total=None)

    def event(self, event: Event) -> None:
        label = self.progress.tasks[self.run_task].description.split(":")[0]
        phase = event.get("phase", "")
        if "of" in event:
            self.progress.update(self.run_task, description=f"{label}: {phase} {event['step']}/{event['of']}",
                                 completed=event["step"], total=event["of"])
        else:
            self.progress.update(self.run_task, description=f"{label}: {phase}", total=None)

    def finished(self, row: dict[str, Any]) -> None:
        typed = Row.model_validate(row)
        self.clock.finish(measured=typed.status != "refused")
        if self.quiet:
            pass
        elif console.is_terminal:
            self.progress.console.print(describe_row(typed))
        else:
            console.print(f"{escape(f'[{self.clock.summary()}]')} {describe_row(typed)}", soft_wrap=True)
        self.progress.advance(self.sweep_task)
        write_csv(list(self.store.typed_rows()), self.store.directory)

    def skipped(self, job: Job) -> None:
        self.clock.skip()
        self.progress.advance(self.sweep_task)


class ClusterDisplay(SweepDisplay):
    """A sweep of SLURM jobs writing to ``store``: a line per job submitted, per change of its state
    (with its progress while it runs), and per row."""

    def __init__(self, store: ResultStore):
        self.store = store

    def submitted(self, job: Job, job_id: str) -> None:
        console.print(f"submitted {escape(job.spec.label)}: SLURM job {escape(job_id)}", soft_wrap=True)

    def job_state(self, job: Job, job_id: str, state: str, reason: str | None, progress: Event | None) -> None:
        why = f" ({reason})" if reason else ""
        step = ""
        if progress:
            step = f": {progress.get('phase', '')}" + (f" {progress['step']}/{progress['of']}"
                                                        if "of" in progress and "step" in progress else "")
        console.print(f"{state.lower()} {escape(job.spec.label)} [{escape(job_id)}]{escape(why)}{escape(step)}",
                      soft_wrap=True)

    def finished(self, row: dict[str, Any]) -> None:
        console.print(describe_row(Row.model_validate(row)), soft_wrap=True)
        write_csv(list(self.store.typed_rows()), self.store.directory)


class StepsDisplay:
    """The stages of a report or a comparison (``fitbench.results.terminal.Steps``) as a bar with the
    count, the elapsed time and the time left, on ``console`` (standard error: standard output may be
    a report piped on) and only where it is a terminal; ``quiet`` shows nothing. Each stage's time
    left is ``SweepClock``'s, every step of it counting as one configuration. A context manager."""

    def __init__(self, quiet: bool = False, console: Console = errors, now: Callable[[], float] = time.monotonic):
        self._now = now
        self.clock = SweepClock(0, now)
        self.eta = EtaColumn(self.clock)
        figure = Column(no_wrap=True)
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(bar_width=20),
                                 MofNCompleteColumn(table_column=figure), TimeElapsedColumn(table_column=figure),
                                 self.eta, console=console, transient=True, disable=quiet or not console.is_terminal)
        self.task = self.progress.add_task("", total=None, eta=True, visible=False)

    def __enter__(self) -> StepsDisplay:
        self.progress.__enter__()
        return self

    def __exit__(self, *exception) -> None:
        self.progress.__exit__(*exception)

    def begin(self, what: str, total: int) -> None:
        self.clock = self.eta.clock = SweepClock(total, self._now)
        self.clock.start()
        self.progress.reset(self.task, description=escape(what), total=total, completed=0, visible=True)

    def advance(self) -> None:
        self.clock.finish()
        self.clock.start()
        self.progress.advance(self.task)


def _label(row: Row) -> str:
    """The configuration as asked for, and what finally ran when a fallback or the batch search changed it."""
    from fitbench.spec import RunSpec

    ran = RunSpec.model_validate(row.spec).label
    return row.label if ran == row.label else f"{row.label} (ran as {ran})"


def describe_row(row: Row) -> str:
    """A finished row in one line: its status, what ran, and its headline figures or its error's first line."""
    from fitbench.results.report import headline, quality_summary
    from fitbench.util.units import format_bytes, format_seconds

    if row.status != "ok":
        first_line = (row.error or "").strip().splitlines()[:1]
        return f"[red]{row.status}[/red] {escape(_label(row))}: {escape(first_line[0]) if first_line else ''}"
    head = headline(row)
    per = "/token" if row.spec["mode"] == "infer" else "/step"
    warn = f" [yellow]({escape('; '.join(row.warnings))})[/yellow]" if row.warnings else ""
    quality = row.quality
    cost = (f", weights {100 * row.weights['relative_to_bf16']:.0f}% of bf16; {escape(quality_summary(quality))}"
            if quality else "")
    offload = row.offload
    if offload:
        layers = offload["resident_layers"] + offload["offloaded_layers"]
        where = "host memory" if offload["tier"] == "cpu" else "disk"
        cost += (f", {offload['offloaded_layers']} of {layers} layers ({format_bytes(offload['offloaded_bytes'])}) "
                 f"offloaded to {where}")
    return (f"[green]ok[/green] {escape(_label(row))}: {format_seconds(head['time'])}{per} ± {head['cv']:.1f}%, "
            f"{head['tokens_per_s']:,.0f} tokens/s{cost}{warn}")


