"""A fresh process per configuration, with a timeout, and every outcome recorded as a row.

The parent blocks on the child's progress pipe and its exit (it never spins), and turns any ending
into a result row:

- ``ok``: the worker measured and wrote its result;
- ``invalid``: the worker measured to the end, but a loss, logits or quality figure is not finite
  (``fitbench.worker.sanity``): a finished, failed row, whose memory held, so no fallback follows;
- ``oom``: the worker caught an out-of-memory (a GPU's, or a CPU allocator's), or the kernel killed
  it for lack of host memory: SIGKILL, not sent by fitbench, with the kernel's OOM-kill count
  risen meanwhile (``fitbench.util.host``) or the worker's peak resident memory at ``OOM_RSS_SHARE``
  of the host memory available when it started (on a CPU, FITBENCH_INJECT's mem-limit stands for
  that); the fallback ladder starts from it;
- ``error``: the worker caught another exception and said so, or its result file is damaged
  (a protocol error);
- ``crashed``: the worker died without a result (a signal, an abort, a non-zero exit);
- ``timeout``: the configuration outlived ``--timeout`` (which bounds its batch probes and
  fallback attempts too) and was killed, or a rank of its job waited in a collective past the
  process group's timeout (``fitbench.worker.worker``); a worker that exited by itself with its result
  written is never killed;
- ``interrupted``: SIGINT, SIGTERM or SIGHUP ended the sweep while it ran; ``--resume`` runs it again.

A torchrun job that ends without its result (a rank failed or hung, or the job was killed) keeps in
the row's ``rank_phases`` the phase each rank was last in (``fitbench.worker.ranks.PhaseLog``) and
whether it wrote a result of its own, and its error names the ranks that did not finish: a rank
stopped outside any collective while the others waited in one until a timeout is the rank that
hung, and is named first.

Nothing a worker starts outlives it, whatever ends it (``fitbench.util.processes``), and each run's
scratch directory, with any layers offloaded to disk, is removed.
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from pydantic import ValidationError

from fitbench.launch.commands import WorkerCommand, worker_command
from fitbench.launch.job import Job
from fitbench.launch.launcher import Attempt, Event, Launcher
from fitbench.launch.sweep_display import SweepDisplay
from fitbench.models.registry import resolve
from fitbench.monitor.nvml import GpuMonitor, job_gpus
from fitbench.results.row import WORKER_STATUSES, Measurement, Row
from fitbench.results.store import ResultStore
from fitbench.worker.phases import rank_phase_path, rank_result_path, read_phase
from fitbench.spec import Assignment, RunSpec
from fitbench.util.cache import cache_directory
from fitbench.util.host import HostMemory, host_memory, oom_kills
from fitbench.util.processes import PARENT_VARIABLE, TOKEN_VARIABLE, kill_tree

ERROR_TAIL_LINES = 15
OOM_RSS_SHARE = 0.9
MAX_LINE_BYTES = 1 << 20  # a progress event is a few hundred bytes
PROTOCOL_ERRORS_KEPT = 5
READ_BYTES = 1 << 16
DRAIN_READS = 64  # after the exit, at most this many reads: a process the worker started may write on
POLL_S = 0.5
WAIT_SLICE_S = 3600.0  # one wait at most this long (far longer ones overflow select's timeout)
CAUGHT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _tail(path: Path, lines: int) -> str:
    if not path.exists():
        return ""
    with path.open(encoding="utf-8", errors="replace") as handle:
        return "".join(deque(handle, maxlen=lines)).strip()


# torch reads the allocator's settings from either variable (PYTORCH_ALLOC_CONF is the newer name).
ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def worker_environment() -> dict[str, str]:
    """The parent's environment, unbuffered, with the CUDA allocator's expandable segments unless the
    user configured the allocator (a non-empty setting in either variable): segments grow in 2 MiB
    pages instead of caching whole blocks, so reserved memory tracks the allocated peak (the
    planner's page-rounding term) instead of fragmenting (measured: 42.6 GB reserved for 32.0 GB
    allocated without it on 2.7B). An empty variable counts as unset. Each row records the settings
    its worker ran with (``fitbench.worker.trackers``).

    Triton's compiled kernels and autotuning results are kept in fitbench's cache
    (``cache_directory()/triton``) unless the user chose a Triton cache: torchao's
    fp8-block matmul autotunes 48 configurations at each new (N, K, M bucket), about 20 s each on an
    H200, and Triton keeps no autotuning result by default, so every run of a configuration paid it
    again; its second run now reads what its first chose."""
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not any(environment.get(name, "").strip() for name in ALLOCATOR_VARIABLES):
        for name in ALLOCATOR_VARIABLES:
            environment.pop(name, None)
        environment["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if not environment.get("TRITON_CACHE_DIR", "").strip():
        environment["TRITON_CACHE_DIR"] = str(cache_directory() / "triton")
        environment.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    return environment


def run_one(assignment: Assignment, log_path: Path, timeout: float, on_event: Callable[[Event], None], *,
            limit: str | None = None, artifacts: Path | None = None, worker: WorkerCommand | None = None,
            scratch_in: Path | None = None, sample: bool = True) -> Row:
    """Run the assignment's configuration in a child process (a torchrun job for several ranks) for at
    most ``timeout`` seconds (``limit`` names that bound in a timeout's error); return the row that
    describes what happened. However this ends (the worker's exit, the timeout, an exception such as
    an interruption), nothing the worker started outlives it and its scratch directory is removed.
    On GPUs, the parent samples every GPU of the job on this node (``fitbench.monitor.nvml``) into
    ``artifacts`` (the attempt's directory; the log's own when None), and the row gets the summary per
    GPU. ``worker``: the command that starts the ranks (default ``worker_command``, on this machine);
    ``scratch_in``: where the scratch directory goes (default the system's temporary directory), a
    directory every node sees for ranks on several; ``sample`` False: the ranks' GPUs are sampled
    where they run, not here (``fitbench.launch.slurm.sampler``)."""
    spec = assignment.spec
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started, started_at = time.monotonic(), _now()
    token = secrets.token_hex(8)
    kills_before, budget = oom_kills(), _host_budget(spec)
    if scratch_in is not None:
        scratch_in.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fitbench-", dir=scratch_in, ignore_cleanup_errors=True) as scratch:
        spec_path, result_path = Path(scratch) / "spec.json", Path(scratch) / "result.json"
        spec_path.write_text(assignment.model_dump_json())
        monitor = _monitor(spec, artifacts or log_path.parent) if sample else None
        with log_path.open("w") as log, monitor or nullcontext():
            process = subprocess.Popen(
                (worker or worker_command(spec.layout, spec.backend)).command(spec_path, result_path),
                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                env={**worker_environment(), TOKEN_VARIABLE: token, PARENT_VARIABLE: str(os.getpid())},
            )
            progress = _Progress(on_event, log)
            try:
                timed_out = _follow(process, started + timeout, progress)
            finally:
                kill_tree(process.pid, token)
                peak_rss = _reap(process)
                process.stdout.close()
            progress.finish()
        payload, problem = _read_result(result_path)
        phases: list[dict[str, Any]] = []
        if payload is None and problem is None and spec.layout.world_size > 1:
            payload, problem = _first_failed_rank(result_path, spec.layout.world_size)
            phases = _rank_phases(result_path, spec.layout.world_size)

    code, tail = process.returncode, _tail(log_path, ERROR_TAIL_LINES)
    killed = timed_out and not (code == 0 and payload is not None)
    held_up, hung = _who_held_up(phases, killed)
    row: dict[str, Any] = {"rank_phases": phases} if phases else {}
    waited = f"; {held_up}" if held_up else ""
    if killed:
        row.update(status="timeout", error=f"killed when {limit or f'the {timeout:g} s timeout (--timeout)'} ran out"
                                           f"{waited}\n" + tail)
    elif payload is not None:
        row.update(payload)
        if payload["status"] != "ok":
            error = payload.get("error") or tail
            row["error"] = f"{held_up}\n{error}" if hung else f"{error}\n{held_up}" if held_up else error
    elif problem is not None:
        row.update(status="error", error=f"protocol error: {problem}\n" + tail)
    elif code == -signal.SIGKILL and (oom_kills() > kills_before or peak_rss >= OOM_RSS_SHARE * budget.available):
        evidence = ("the kernel counted an out-of-memory kill meanwhile" if oom_kills() > kills_before else
                    f"its peak resident memory, {peak_rss / 1e9:.2f} GB, reached {OOM_RSS_SHARE:.0%} of the "
                    f"{budget.available / 1e9:.2f} GB available when it started ({budget.source})")
        row.update(status="oom", error=f"worker killed by SIGKILL, out of host memory: {evidence}\n" + tail)
    else:
        cause = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        row.update(status="crashed", error=f"worker died ({cause}) without a result{waited}\n" + tail)
    if progress.problems:
        row["protocol_errors"] = progress.problems
        row["warnings"] = [*(row.get("warnings") or []),
                           f"protocol error: the worker's stdout broke the progress protocol "
                           f"{progress.problem_count} time(s), e.g. {progress.problems[0]} (see protocol_errors)"]
    if monitor is not None:
        row["gpu_monitor"] = {**monitor.summary(), "timeline": str(monitor.path)}
    arch = resolve(spec.model)
    return Row(key=spec.key, label=spec.label, spec=spec.model_dump(), **row,
               params=arch.total_params, non_embedding_params=arch.non_embedding_params,
               exit_code=code, started_at=started_at, finished_at=_now(),
               wall_s=time.monotonic() - started, log=str(log_path))


@dataclass(frozen=True)
class LocalLauncher:
    """Each attempt as a fresh process (a torchrun job for several ranks) on this machine (``run_one``)."""

    def run(self, attempt: Attempt, on_event: Callable[[Event], None]) -> Row:
        return run_one(attempt.assignment, attempt.log, attempt.timeout, on_event, limit=attempt.limit,
                       artifacts=attempt.artifacts)


def _host_budget(spec: RunSpec) -> HostMemory:
    """The host memory a worker may take: FITBENCH_INJECT's mem-limit for a CPU worker (the budget the
    planner and the worker use there), else what the host has available."""
    from fitbench.util.inject import injected_memory_limit

    limit = injected_memory_limit() if spec.device == "cpu" else None
    return HostMemory(limit, "FITBENCH_INJECT mem-limit") if limit else host_memory()


def _follow(process: subprocess.Popen, deadline: float, progress: _Progress) -> bool:
    """Show the worker's progress until it exits (False) or ``deadline`` (``time.monotonic``) passes
    (True). The exit is watched on its own (a pidfd), not as the end of stdout: a process the worker
    started may hold stdout open after the worker is gone. Where there is no pidfd, the exit is
    polled every ``POLL_S``."""
    stdout = process.stdout.fileno()
    os.set_blocking(stdout, False)
    try:
        exit_fd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):
        exit_fd = None
    with selectors.DefaultSelector() as selector:
        selector.register(stdout, selectors.EVENT_READ)
        if exit_fd is not None:
            selector.register(exit_fd, selectors.EVENT_READ)
        try:
            while not _exited(process.pid):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return not _exited(process.pid)
                for key, _ in selector.select(min(remaining, WAIT_SLICE_S if exit_fd is not None else POLL_S)):
                    if key.fd == stdout and not _read_into(stdout, progress):
                        selector.unregister(stdout)
            for _ in range(DRAIN_READS):  # what the worker wrote before it exited
                if not _read_into(stdout, progress):
                    break
            return False
        finally:
            if exit_fd is not None:
                os.close(exit_fd)


def _read_into(fd: int, progress: _Progress) -> bool:
    """Feed what ``fd`` has to ``progress``; False at its end or when nothing is waiting."""
    try:
        chunk = os.read(fd, READ_BYTES)
    except BlockingIOError:
        return False
    progress.feed(chunk)
    return bool(chunk)


def _exited(pid: int) -> bool:
    """Whether the child ``pid`` has exited, leaving it unreaped (its PID stays ours until ``_reap``)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _reap(process: subprocess.Popen) -> int:
    """Wait for the child, set its return code, and return its peak resident memory in bytes."""
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # bytes on macOS, KiB on Linux


def _monitor(spec: RunSpec, directory: Path) -> GpuMonitor | None:
    """The sampler of the job's GPUs, rank k's GPU k-th from the spec's device (``cuda:N``: the N-th
    visible one); none for a CPU job."""
    if not spec.device.startswith("cuda"):
        return None
    directory.mkdir(parents=True, exist_ok=True)
    first = int(spec.device.partition(":")[2] or 0)
    return GpuMonitor(job_gpus(spec.layout.world_size, first=first), directory)


def _first_failed_rank(result_path: Path, ranks: int) -> tuple[dict[str, Any] | None, str | None]:
    """The result of the rank that failed first, by when it wrote it: a rank that fails alone writes
    its own (``fitbench.worker.ranks.rank_result_path``), and the others' failures that follow (a peer
    gone from a collective) are consequences."""
    written = [(path.stat().st_mtime_ns, rank, path) for rank in range(ranks)
               if (path := rank_result_path(result_path, rank)).exists()]
    if not written:
        return None, None
    _, rank, path = min(written)
    payload, problem = _read_result(path)
    if payload is not None:
        payload = {**payload, "error": f"rank {rank}: {payload.get('error')}"}
    return payload, problem


def _rank_phases(result_path: Path, ranks: int) -> list[dict[str, Any]]:
    """Each rank of the job: the phase it last entered, whether that phase waits in collectives, how
    long it had been in it when the job ended, and the status of the result it wrote of its own
    (None: it wrote none, it did not finish)."""
    now = time.time()
    phases = []
    for rank in range(ranks):
        phase = read_phase(rank_phase_path(result_path, rank))
        result, _ = _read_result(rank_result_path(result_path, rank))
        phases.append({"rank": rank, "phase": phase.name if phase else None,
                       "in_collective": bool(phase and phase.collective),
                       "seconds": round(now - phase.since, 1) if phase else None,
                       "status": result["status"] if result else None})
    return phases


def _who_held_up(phases: list[dict[str, Any]], killed: bool) -> tuple[str, bool]:
    """``phases`` (``_rank_phases``) in a sentence, and whether it names ranks that hung: those that
    stopped outside any collective, without a result, while others waited for them in one, when
    the waiting ended the job (``killed`` by the timeout, or a collective's own timeout). A rank that
    died there instead is said to have stopped: the error of the rank that waited says which."""
    unfinished = [entry for entry in phases if entry["status"] is None]
    outside = [entry for entry in unfinished if not entry["in_collective"]]
    waiting = [entry for entry in phases if entry["in_collective"]]
    if outside and waiting:
        hung = killed or any(entry["status"] == "timeout" for entry in waiting)
        them = "it" if len(outside) == 1 else "them"
        return (f"{_ranks(outside)} {'hung' if hung else 'stopped'} outside any collective while {_ranks(waiting)} "
                f"waited for {them} in one ({_where(outside + waiting)})", hung)
    if not unfinished:
        return "", False
    if all(entry["in_collective"] for entry in unfinished):
        return (f"{_ranks(unfinished)} did not finish, in phases whose collectives every rank must join "
                f"({_where(unfinished)})", False)
    return f"{_ranks(unfinished)} did not finish ({_where(unfinished)})", False


def _where(entries: list[dict[str, Any]]) -> str:
    return "; ".join(f"rank {entry['rank']}: " + (f"{entry['phase']}, entered {entry['seconds']:g} s before the end"
                                                  if entry["phase"] else "no phase recorded, still starting")
                     for entry in sorted(entries, key=lambda entry: entry["rank"]))


def _ranks(entries: list[dict[str, Any]]) -> str:
    numbers = sorted(str(entry["rank"]) for entry in entries)
    return f"rank {numbers[0]}" if len(numbers) == 1 else f"ranks {', '.join(numbers[:-1])} and {numbers[-1]}"


def _read_result(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The worker's result (``fitbench.results.row.Measurement``), or None and what is wrong with it
    (None and None: it wrote none)."""
    if not path.exists():
        return None, None
    try:
        payload = json.loads(path.read_bytes())
    except (ValueError, RecursionError):
        return None, "the worker's result file is not JSON"
    if not isinstance(payload, dict) or payload.get("status") not in WORKER_STATUSES:
        return None, f"the worker's result file is not an object with a status of {', '.join(WORKER_STATUSES)}"
    try:
        return Measurement.model_validate(payload).as_dict(), None
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return None, f"the worker's result file has `{where}`: {first['msg']} ({error.error_count()} problem(s))"


class _Progress:
    """The worker's stdout: one JSON object per line, each shown by ``on_event``; other text goes to the
    log. What breaks that protocol (JSON that is not an object, bytes that are not UTF-8, a line over
    ``MAX_LINE_BYTES``, an event the parent cannot show) is noted in ``problems`` (the first few, with
    a short excerpt), never raised: the sweep goes on."""

    def __init__(self, on_event: Callable[[dict[str, Any]], None], log):
        self.on_event, self.log = on_event, log
        self.pending = bytearray()
        self.skipping = False  # inside a line too long to keep
        self.lines = 0
        self.problems: list[str] = []
        self.problem_count = 0

    def feed(self, chunk: bytes) -> None:
        self.pending += chunk
        while (end := self.pending.find(b"\n")) >= 0:
            line = bytes(self.pending[:end])
            del self.pending[:end + 1]
            if self.skipping:
                self.skipping = False
            else:
                self._line(line)
        if len(self.pending) > MAX_LINE_BYTES:
            if not self.skipping:
                self.lines += 1
                self._problem(f"a line longer than {MAX_LINE_BYTES >> 20} MiB")
            self.skipping = True
            self.pending.clear()

    def finish(self) -> None:
        if self.pending and not self.skipping:
            self._line(bytes(self.pending))
        self.pending.clear()

    def _line(self, line: bytes) -> None:
        self.lines += 1
        try:
            text = line.decode()
        except UnicodeDecodeError:
            self._problem("bytes that are not UTF-8")
            self._log(line.decode(errors="replace"))
            return
        try:
            event = json.loads(text)
        except (ValueError, RecursionError):
            self._log(text)  # a library's own print: kept with the worker's stderr
            return
        if not isinstance(event, dict):
            self._problem(f"JSON that is not an object: {_excerpt(text)}")
            return
        try:
            self.on_event(event)
        except Exception as error:  # the parent's display must not end the sweep
            self._problem(f"an event the parent could not show ({type(error).__name__}): {_excerpt(text)}")

    def _problem(self, what: str) -> None:
        self.problem_count += 1
        if len(self.problems) < PROTOCOL_ERRORS_KEPT:
            self.problems.append(f"stdout line {self.lines}: {what}")

    def _log(self, text: str) -> None:
        self.log.write(text + "\n")
        self.log.flush()


def _excerpt(text: str, length: int = 60) -> str:
    return repr(text if len(text) <= length else text[:length] + "...")


class SweepInterrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a closed terminal, an ended ssh session) ended the sweep, as Ctrl-C does."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


@contextmanager
def _signals_interrupt():
    """While the sweep runs, SIGTERM and SIGHUP raise ``SweepInterrupted`` in the main thread, so the
    worker in flight ends with everything it started, its scratch directory is removed and its row
    says ``interrupted``. Further signals are ignored meanwhile, so that cleanup finishes. After a
    hangup the terminal is gone: standard output and error then go to /dev/null, so the last words
    cannot fail."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        for caught in CAUGHT_SIGNALS:
            signal.signal(caught, signal.SIG_IGN)
        if signum == signal.SIGHUP:
            _detach_from_terminal()
        raise SweepInterrupted(signum)

    previous = {caught: signal.signal(caught, interrupt) for caught in CAUGHT_SIGNALS}
    try:
        yield
    finally:
        for caught, handler in previous.items():
            signal.signal(caught, handler)


def _detach_from_terminal() -> None:
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        if os.isatty(fd):
            os.dup2(null, fd)
    os.close(null)


def run_sweep(jobs: list[Job], store: ResultStore, *, launcher: Launcher, display: SweepDisplay = SweepDisplay(),
              command: str, calibration: str | None = None) -> list[dict[str, Any]]:
    """Run every job without a row in ``store`` (``Job.run``, each attempt by ``launcher``); append each
    row the moment it exists, with the planner's prediction for the configuration that finally ran
    beside what was measured, the ``command`` and the ``calibration`` (its source) the predictions
    used. ``display`` is told as the sweep goes."""
    finished = store.finished_keys()
    rows = []
    with _signals_interrupt():
        for index, job in enumerate(jobs):
            if job.spec.key in finished:
                display.skipped(job)
                continue
            display.started(job, index, len(jobs))
            rows.append(_one_of_sweep(job, store, launcher, display, command, calibration))
            finished.add(job.spec.key)
    return rows


def sweep_row(job: Job, row: dict[str, Any], command: str, calibration: str | None) -> dict[str, Any]:
    """``row``, what ``job`` ran to, as the sweep keeps it: with the planner's prediction for the
    configuration that finally ran, the ``command`` and the ``calibration`` (its source)."""
    prediction = job.prediction_for(RunSpec.model_validate(row["spec"]))
    # the planner's warnings about the configuration that ran join the worker's
    warned = [*(row.get("warnings") or []), *((prediction or {}).get("warnings") or [])]
    return Row.model_validate({**row, "command": command, "calibration": calibration, "prediction": prediction,
                               "warnings": warned or None}).as_dict()


def _one_of_sweep(job: Job, store: ResultStore, launcher: Launcher, display: SweepDisplay, command: str,
                  calibration: str | None) -> dict[str, Any]:
    """Run one job of ``run_sweep`` and append its row; an interruption appends an ``interrupted`` row
    (``--resume`` runs it again) and goes on up."""
    spec, started_at = job.spec, _now()
    try:
        row = job.run(launcher, store.directory / "logs", display.event)
    except KeyboardInterrupt as interruption:
        store.append(Row(key=spec.key, label=spec.label, spec=spec.model_dump(), status="interrupted",
                         error=f"{str(interruption) or 'interrupted by SIGINT'}: the worker and everything it "
                               f"started were ended; `fitbench run --resume {store.directory}` runs it again",
                         params=resolve(spec.model).total_params, started_at=started_at,
                         finished_at=_now(), command=command).as_dict())
        raise
    row = sweep_row(job, row, command, calibration)
    store.append(row)
    display.finished(row)
    return row
