"""A fresh process per configuration, with a timeout, and every outcome recorded as a row.

The parent blocks on the child's progress pipe and then on ``wait`` (it never spins), kills the
child's whole process group when the timeout fires, and turns any ending into a result row:

- ``ok``: the worker measured and wrote its result;
- ``invalid``: the worker measured to the end, but a loss, logits or quality figure is not finite
  (``fitbench.run.sanity``): a finished, failed row, whose memory held, so no fallback follows;
- ``oom`` / ``error``: the worker caught an out-of-memory or another exception and said so;
- ``crashed``: the worker died without a result (a signal, an abort, a non-zero exit);
- ``timeout``: the run outlived ``--timeout`` and was killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from fitbench.config import RunSpec
from fitbench.launch.fallback import RAN_TO_THE_END, FallbackPolicy, run_with_fallback, search_max_batch
from fitbench.models.registry import resolve
from fitbench.results.store import ResultStore

ERROR_TAIL_LINES = 15


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _tail(path: Path, lines: int) -> str:
    if not path.exists():
        return ""
    with path.open(encoding="utf-8", errors="replace") as handle:
        return "".join(deque(handle, maxlen=lines)).strip()


@dataclass
class SweepCallbacks:
    on_start: Callable[[RunSpec, int, int], None] = lambda spec, index, total: None
    on_event: Callable[[dict[str, Any]], None] = lambda event: None
    on_finish: Callable[[dict[str, Any]], None] = lambda row: None
    on_skip: Callable[[RunSpec], None] = lambda spec: None


@dataclass
class _Child:
    process: subprocess.Popen
    timed_out: threading.Event = field(default_factory=threading.Event)

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def expire(self) -> None:
        self.timed_out.set()
        self.kill()


# torch reads the allocator's settings from either variable (PYTORCH_ALLOC_CONF is the newer name).
ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def worker_environment() -> dict[str, str]:
    """The parent's environment, unbuffered, with the CUDA allocator's expandable segments unless the
    user configured the allocator (a non-empty setting in either variable): segments grow in 2 MiB
    pages instead of caching whole blocks, so reserved memory tracks the allocated peak (the
    planner's page-rounding term) instead of fragmenting (measured: 42.6 GB reserved for 32.0 GB
    allocated without it on 2.7B). An empty variable counts as unset. Each row records the settings
    its worker ran with (``fitbench.run.trackers``)."""
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not any(environment.get(name, "").strip() for name in ALLOCATOR_VARIABLES):
        for name in ALLOCATOR_VARIABLES:
            environment.pop(name, None)
        environment["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return environment


def run_one(spec: RunSpec, log_path: Path, timeout: float,
            on_event: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Run ``spec`` in a child process; return the row that describes what happened."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started, started_at = time.monotonic(), _now()
    with tempfile.TemporaryDirectory(prefix="fitbench-") as scratch:
        spec_path, result_path = Path(scratch) / "spec.json", Path(scratch) / "result.json"
        spec_path.write_text(spec.model_dump_json())
        with log_path.open("w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "fitbench.run.worker", str(spec_path), str(result_path)],
                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True,
                start_new_session=True, env=worker_environment(),
            )
            child = _Child(process)
            timer = threading.Timer(timeout, child.expire)
            timer.start()
            try:
                for line in process.stdout:
                    try:
                        on_event(json.loads(line))
                    except json.JSONDecodeError:
                        log.write(line)
                process.wait()
            except BaseException:
                child.kill()
                process.wait()
                raise
            finally:
                timer.cancel()
        payload = json.loads(result_path.read_text()) if result_path.exists() else None

    row: dict[str, Any] = {"key": spec.key, "label": spec.label, "spec": spec.model_dump()}
    if child.timed_out.is_set():
        row.update(status="timeout", error=f"killed after the {timeout:g} s timeout (--timeout)\n"
                                            + _tail(log_path, ERROR_TAIL_LINES))
    elif payload is not None:
        row.update(payload)
        if payload["status"] != "ok":
            row["error"] = payload.get("error") or _tail(log_path, ERROR_TAIL_LINES)
    else:
        code = process.returncode
        cause = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        row.update(status="crashed", error=f"worker died ({cause}) without a result\n" + _tail(log_path, ERROR_TAIL_LINES))
    arch = resolve(spec.model)
    row.update(
        params=arch.total_params, non_embedding_params=arch.non_embedding_params,
        exit_code=process.returncode, started_at=started_at, finished_at=_now(),
        wall_s=time.monotonic() - started, log=str(log_path),
    )
    return row


def _run_planned(spec: RunSpec, logs: Path, timeout: float, on_event, policy: FallbackPolicy,
                 predicted_batch: Callable[[RunSpec], int]) -> dict[str, Any]:
    """One configuration of the sweep: the batch search if asked for, then the run with its fallbacks;
    the row keeps the configuration's own key and label, whatever finally ran (``spec`` says that)."""
    attempt = iter(range(1, 1000))

    def run(candidate: RunSpec) -> dict[str, Any]:
        return run_one(candidate, logs / f"{spec.key}-{next(attempt)}.log", timeout, on_event)

    search: dict[str, Any] = {}
    to_run = spec
    if spec.auto_batch:
        predicted = predicted_batch(spec)
        found, probes = search_max_batch(spec, predicted, lambda probe: run(probe)["status"] in RAN_TO_THE_END)
        search = {"predicted_batch": predicted, "max_batch": found, "batch_probes": probes}
        to_run = spec.model_copy(update={"batch_size": max(found, 1), "auto_batch": False})
    row = run_with_fallback(to_run, policy, run)
    row.update(search, key=spec.key, label=spec.label)
    return row


def run_sweep(specs: list[RunSpec], store: ResultStore, *, timeout: float, command: str,
              callbacks: SweepCallbacks = SweepCallbacks(),
              predict: Callable[[RunSpec], dict[str, Any] | None] = lambda spec: None,
              refusals: dict[str, str] | None = None, calibration: str | None = None,
              fallback: Callable[[RunSpec], FallbackPolicy] = lambda spec: FallbackPolicy((), enabled=False),
              predicted_batch: Callable[[RunSpec], int] = lambda spec: 1) -> list[dict[str, Any]]:
    """Run every spec without a row in ``store``; append each row the moment it exists, with the
    planner's prediction (``predict``) for the configuration that finally ran beside what was
    measured, and the ``calibration`` (its source) the predictions used. A spec in ``refusals`` is
    not launched: its row says why this hardware cannot run it or the planner predicts it won't fit.
    An out-of-memory walks the ``fallback`` ladder; an ``auto_batch`` spec first finds its batch by
    probing from ``predicted_batch`` (``fitbench.launch.fallback``)."""
    finished = store.finished_keys()
    rows = []
    for index, spec in enumerate(specs):
        if spec.key in finished:
            callbacks.on_skip(spec)
            continue
        callbacks.on_start(spec, index, len(specs))
        if spec.key in (refusals or {}):
            row = {"key": spec.key, "label": spec.label, "spec": spec.model_dump(), "status": "refused",
                   "error": refusals[spec.key], "params": resolve(spec.model).total_params,
                   "started_at": _now(), "finished_at": _now()}
        else:
            row = _run_planned(spec, store.directory / "logs", timeout, callbacks.on_event, fallback(spec),
                               predicted_batch)
        row["command"] = command
        row["calibration"] = calibration
        row["prediction"] = predict(RunSpec.model_validate(row["spec"]))
        store.append(row)
        finished.add(spec.key)
        rows.append(row)
        callbacks.on_finish(row)
    return rows
