"""A sweep as SLURM jobs, from the sweep's own process: its batch scripts, their submission, and
following the jobs until each configuration has a row.

Each configuration is one job that runs its whole life (batch search, fallback ladder) inside its
allocation: the job's program is ``python -m fitbench.cli.allocation DIR KEY``, which runs the
configuration as this process planned it (kept in ``DIR/planned/<key>.json``:
``fitbench.launch.slurm.planned``) and writes its row to ``DIR/rows/<key>.json``
(``fitbench.results.store``). A configuration the plan refuses gets its row here, and no job.
A sweep of one configuration is one job; of several, one job array (``--max-concurrent`` at once).

What was submitted is kept in ``DIR/slurm.json`` (``SUBMITTED_FILE``: the job id of each
configuration's latest job), written by the sweep's process alone. The process may exit at any time:
the jobs go on, and ``fitbench run --resume DIR`` (``run_on_slurm`` again) follows those still
pending or running, writes the rows of those that ended without one (``fitbench.launch.slurm.states``),
and submits only the configurations that have no row, or one that ``--resume`` runs again.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fitbench.launch.job import Job
from fitbench.launch.sweep_display import SweepDisplay
from fitbench.launch.local import LocalLauncher, sweep_row
from fitbench.launch.slurm.jobs import JobStatus, queued_scripts, statuses, submit
from fitbench.launch.slurm import planned
from fitbench.launch.slurm.options import SlurmOptions
from fitbench.launch.slurm.script import ScriptJob, array_script, batch_script
from fitbench.launch.slurm.states import gone, stopped_row
from fitbench.results.store import JOB_ROWS, ResultStore
from fitbench.util.jsonfile import read_json

SUBMITTED_FILE = "slurm.json"
SCRIPTS = "slurm"
PROGRESS = "progress"
ALLOCATION_PROGRAM = ("-m", "fitbench.cli.allocation")
# a task's line: "  3) exec ... -m fitbench.cli.allocation DIR KEY ;;" in an array, "exec ..." alone
ALLOCATION_LINE = re.compile(r"^\s*(?:(\d+)\)\s)?.*fitbench\.cli\.allocation\s+(.*?)(?:;;)?\s*$")
# Following jobs asks squeue every POLL_S at first, then every tenth of the time followed so far, at
# most every MAX_POLL_S: a sweep followed for a day asks about 1,500 times, not 86,400.
POLL_S = 1.0
POLL_SLOWDOWN = 10.0
MAX_POLL_S = 60.0


@dataclass(frozen=True)
class Script:
    """A batch script of the sweep: its text, where it is written, and the configurations it runs
    (``jobs``, as planned), in the order of its array's tasks."""

    path: Path
    text: str
    jobs: tuple[Job, ...]

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(job.spec.key for job in self.jobs)


def scripts(jobs: list[Job], options: SlurmOptions, store: ResultStore, max_concurrent: int | None) -> Script:
    """The batch script that runs ``jobs`` (one job, or one array for several) in ``store``'s directory."""
    directory = store.directory.resolve()
    logs = directory / "logs"
    name = job_name(store)
    tasks = [[*ALLOCATION_PROGRAM, str(directory), job.spec.key] for job in jobs]
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    if len(jobs) == 1:
        text = batch_script(options, ScriptJob(name, str(logs / "slurm-%j.out"), driver=True), tasks[0])
    else:
        text = array_script(options, ScriptJob(name, str(logs / "slurm-%A_%a.out"), driver=True), tasks,
                            limit=min(max_concurrent or len(jobs), len(jobs)))
    # which configuration each task runs, for the person who reads the script
    named = "".join(f"# {index}: {' '.join(job.spec.label.split())} ({job.spec.key})\n" for index, job in enumerate(jobs))
    text = text.replace("set -euo pipefail\n", "set -euo pipefail\n" + named, 1)
    return Script(directory / SCRIPTS / f"{stamp}-{len(jobs)}.sh", text, tuple(jobs))


def job_name(store: ResultStore) -> str:
    """The name of the sweep's jobs (sbatch's ``--job-name``), by which ``adopted`` finds a script of
    the sweep that a person submitted."""
    return f"fitbench-{store.directory.resolve().name}"


def script_keys(text: str, directory: Path) -> dict[str | None, str]:
    """The configuration each task of a batch script runs in ``directory`` (the key after
    ``fitbench.cli.allocation DIR``), by array task (``i) ...`` of its ``case``; None for a script of
    one job); a line for another directory is not this sweep's."""
    keys: dict[str | None, str] = {}
    for line in text.splitlines():
        found = ALLOCATION_LINE.search(line)
        if found is None or line.lstrip().startswith("#"):
            continue
        try:
            words = shlex.split(found.group(2))
        except ValueError:
            continue
        if len(words) >= 2 and Path(words[0]).resolve() == directory.resolve():
            keys[found.group(1)] = words[1]
    return keys


def adopted(store: ResultStore, keys: set[str]) -> dict[str, str]:
    """Pending and running jobs of this sweep that a person submitted (its script, edited or not, through
    ``sbatch``), by the configuration of ``keys`` each runs: their ids."""
    found: dict[str, str] = {}
    texts: dict[Path, str] = {}
    for job_id, task, script in queued_scripts(job_name(store)):
        if script not in texts:
            try:
                texts[script] = script.read_text(errors="replace")
            except OSError:
                texts[script] = ""
        key = script_keys(texts[script], store.directory).get(task)
        if key in keys:
            found[key] = job_id
    return found


def write_script(script: Script) -> None:
    """Write the script, and each of its configurations as planned, which its job reads."""
    for job in script.jobs:
        planned.save(script.path.parent.parent, job)
    script.path.parent.mkdir(parents=True, exist_ok=True)
    (script.path.parent.parent / "logs").mkdir(parents=True, exist_ok=True)
    script.path.write_text(script.text)


def output_file(store: ResultStore, job_id: str) -> Path:
    """The output of job ``job_id`` (``123``, or an array's task ``123_4``)."""
    return store.directory.resolve() / "logs" / f"slurm-{job_id}.out"


def submitted(store: ResultStore) -> dict[str, str]:
    """Each configuration's latest job id, by key, as ``SUBMITTED_FILE`` keeps them."""
    path = store.directory / SUBMITTED_FILE
    if not path.is_file():
        return {}
    saved = read_json(path, limit=100_000_000, field="resume",
                      fix=f"{SUBMITTED_FILE} is damaged; delete it, and `fitbench run --resume` submits again "
                          f"what has no row")
    jobs = saved.get("jobs") if isinstance(saved, dict) else None
    return {str(key): str(value) for key, value in jobs.items()} if isinstance(jobs, dict) else {}


def _save_submitted(store: ResultStore, jobs: dict[str, str]) -> None:
    tmp = store.directory / (SUBMITTED_FILE + ".tmp")
    tmp.write_text(json.dumps({"jobs": jobs}, indent=1))
    os.replace(tmp, store.directory / SUBMITTED_FILE)


def run_on_slurm(jobs: list[Job], store: ResultStore, options: SlurmOptions, *, max_concurrent: int | None,
                 command: str, display: SweepDisplay = SweepDisplay()) -> None:
    """Bring every job of ``jobs`` to a row in ``store``: follow those already submitted, write the rows
    of those that ended without one, submit the rest, and follow every job until it has its row."""
    known = submitted(store)
    finished = store.finished_keys()
    wanted = [job for job in jobs if job.spec.key not in finished]
    # a script of the sweep submitted by hand runs its configurations: followed, not submitted again
    by_hand = adopted(store, {job.spec.key for job in wanted})
    if by_hand:
        known.update(by_hand)
        _save_submitted(store, known)
    for job in jobs:
        if job.spec.key in finished:
            display.skipped(job)
        elif job.refusal is not None:
            _record_refused(store, job, command, display)
    wanted = [job for job in wanted if job.refusal is None]
    found = statuses([known[job.spec.key] for job in wanted if job.spec.key in known])
    recorded = {(row.get("slurm") or {}).get("job_id") for row in store.rows()}
    to_submit = []
    for job in wanted:
        status = found.get(known.get(job.spec.key, ""))
        if status is None:
            to_submit.append(job)
        elif status.finished:
            if status.job_id not in recorded and not _job_row(store, job).exists():
                _record_stopped(store, job, status, command, display)
            if job.spec.key not in store.finished_keys():
                to_submit.append(job)
    if to_submit:
        script = scripts(to_submit, options, store, max_concurrent)
        write_script(script)
        job_id = submit(script.path, cwd=store.directory)
        ids = [job_id] if len(to_submit) == 1 else [f"{job_id}_{index}" for index in range(len(to_submit))]
        known.update(zip(script.keys, ids))
        _save_submitted(store, known)
        for index, job in enumerate(to_submit):
            display.submitted(job, ids[index])
    _follow([job for job in wanted if job.spec.key not in store.finished_keys()], store, known, command, display)


def _job_row(store: ResultStore, job: Job) -> Path:
    return store.directory / JOB_ROWS / f"{job.spec.key}.json"


def _record_refused(store: ResultStore, job: Job, command: str, display: SweepDisplay) -> None:
    row = sweep_row(job, job.run(LocalLauncher(), store.directory / "logs", lambda event: None), command, None)
    store.append(row)
    display.finished(row)


def _record_stopped(store: ResultStore, job: Job, status: JobStatus, command: str, display: SweepDisplay) -> None:
    row = stopped_row(job, status, output_file(store, status.job_id), command=command,
                      finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    store.append(row)
    display.finished(row)


def _follow(jobs: list[Job], store: ResultStore, known: dict[str, str], command: str, display: SweepDisplay) -> None:
    """Poll the jobs of ``jobs`` (``poll_interval`` apart) until each has a row: tell ``display`` each change of
    state (with the configuration's progress while it runs), and write the row of one that ended
    without its own."""
    waiting = {job.spec.key: job for job in jobs}
    shown: dict[str, tuple[str, str | None, Any]] = {}
    unknown: set[str] = set()
    started = time.monotonic()
    while waiting:
        found = statuses([known[key] for key in waiting])
        for key, job in list(waiting.items()):
            if _job_row(store, job).exists():
                row = next((row for row in store.rows() if row.get("key") == key), None)
                if row is not None:
                    display.finished(row)
                del waiting[key]
                continue
            status = found.get(known[key])
            if status is None and key not in unknown:
                unknown.add(key)  # asked once more before it counts as gone
                continue
            status = status or gone(known[key])
            unknown.discard(key)
            if status.finished:
                time.sleep(POLL_S)  # a row written as the job ended is read before one is made for it
                if not _job_row(store, job).exists():
                    _record_stopped(store, job, status, command, display)
                    del waiting[key]
                continue
            progress = _progress(store, key) if status.state == "RUNNING" else None
            now = (status.state, status.reason, progress)
            if shown.get(key) != now:
                shown[key] = now
                display.job_state(job, status.job_id, status.state, status.reason, progress)
        if waiting:
            time.sleep(poll_interval(time.monotonic() - started))


def poll_interval(followed_s: float) -> float:
    """Seconds until the next ``squeue`` of a sweep followed for ``followed_s``: ``POLL_S``, then a
    ``POLL_SLOWDOWN``-th of the time followed, at most ``MAX_POLL_S``."""
    return min(MAX_POLL_S, max(POLL_S, followed_s / POLL_SLOWDOWN))


def progress_file(directory: Path, key: str) -> Path:
    """Where the job of configuration ``key`` keeps its latest progress event."""
    return directory / PROGRESS / f"{key}.json"


def _progress(store: ResultStore, key: str) -> dict[str, Any] | None:
    try:
        event = json.loads(progress_file(store.directory, key).read_text())
    except (OSError, ValueError):
        return None
    return event if isinstance(event, dict) else None

