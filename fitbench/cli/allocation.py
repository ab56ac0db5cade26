"""What a SLURM job of a sweep runs in its allocation: ``python -m fitbench.cli.allocation DIR KEY``.

It reads the sweep saved in ``DIR`` (``sweep.json``) and the configuration ``KEY`` as the login node
planned it (``DIR/planned/KEY.json``: ``fitbench.launch.slurm.planned``), without planning it again,
and runs its whole life (``fitbench.launch.job.Job.run``: batch search, fallback ladder, within
``--timeout``): on one node with ``fitbench.launch.local.LocalLauncher``, over several with
``fitbench.launch.slurm.nodes.NodesLauncher``. The GPU found here (and its calibration, measured on
the first run as on a workstation) is compared with the one planned for: where they differ, the row
keeps the planned configuration and its key, and says so (a warning, and ``slurm.planned_for``).
SLURM's SIGUSR1 or SIGUSR2 (``sbatch --signal=B:USR1@90``) or SIGTERM stops the attempt in flight, and
the row is written at once: ``timeout``, with the attempts done. Its latest progress event is kept in
``DIR/progress/KEY.json`` for the sweep's process to show, and its row, as the sweep keeps it
(``fitbench.launch.local.sweep_row``) with the SLURM job it ran in, goes to ``DIR/rows/KEY.json``:
the job writes no other file of the sweep.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from contextlib import contextmanager
from datetime import datetime, timezone

from fitbench.config import SweepConfig, saved_options
from fitbench.launch.launcher import Event
from fitbench.launch.local import LocalLauncher, sweep_row
from fitbench.launch.slurm import planned
from fitbench.launch.slurm.nodes import NodesLauncher
from fitbench.launch.slurm.sweep import progress_file
from fitbench.models.registry import resolve
from fitbench.planning.calibration import load_calibration
from fitbench.results.row import Row
from fitbench.results.store import SWEEP_FILE, ResultStore
from fitbench.spec import RunSpec
from fitbench.sweep import check_ranks, plan_jobs, refuse_unrunnable, resolve_device, run_target
from fitbench.util.errors import UserError


STOPPING_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)


def run_configuration(directory: str, key: str) -> int:
    """Run configuration ``key`` of the sweep saved in ``directory`` and write its row; 0 once written."""
    store = ResultStore(directory)
    sweep = store.load_sweep()
    if sweep is None:
        raise UserError(f"resume: {directory} holds no fitbench sweep (no {SWEEP_FILE}).")
    saved = SweepConfig.model_validate(dict(saved_options(sweep, str(store.directory / SWEEP_FILE))))
    config = saved.model_copy(update={"launcher": "local", "device": sweep["device"]})
    device = resolve_device(config.device)
    nodes = config.nodes or 1
    check_ranks(device, config.gpus // nodes)
    here, calibration = run_target(device, say=lambda text: print(text, flush=True), ranks=config.gpus)
    job, planned_for = _planned_job(store, key, config, device, here, calibration)
    differs = planned.difference(planned_for, here)
    launcher = (NodesLauncher(nodes, config.gpus // nodes, config.cpus_per_task) if nodes > 1 else LocalLauncher())
    progress = progress_file(store.directory, key)
    progress.parent.mkdir(parents=True, exist_ok=True)

    def keep(event: Event) -> None:
        tmp = progress.with_suffix(".tmp")
        tmp.write_text(json.dumps(event, default=str))
        os.replace(tmp, progress)

    try:
        with _signals_stop(job):
            row = job.run(launcher, store.directory / "logs", keep)
    except JobSignalled as stopped:
        row = _stopped_row(job, stopped)
    job_id = (f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
              if "SLURM_ARRAY_JOB_ID" in os.environ else os.environ.get("SLURM_JOB_ID"))
    slurm = {"job_id": job_id, "nodes": os.environ.get("SLURM_JOB_NODELIST")}
    if differs:
        row = {**row, "warnings": [*(row.get("warnings") or []), differs]}
        slurm.update(planned_for=planned.describe(planned_for), node_gpu=planned.describe(here))
    row = sweep_row(job, {**row, "slurm": slurm}, sweep.get("command"),
                    job.calibration.source if job.calibration else None)
    path = store.write_job_row(row)
    print(f"{row['status']} {row['label']}: row written to {path}", flush=True)
    return 0


class JobSignalled(KeyboardInterrupt):
    """SLURM signalled the job: SIGUSR1 or SIGUSR2 as ``sbatch --signal=B:USR1@SECONDS`` asks before the
    time limit, SIGTERM at the limit or on ``scancel``."""

    def __init__(self, signum: int):
        super().__init__(f"SLURM sent {signal.Signals(signum).name} to the job (sbatch --signal before its time "
                         f"limit, or the limit itself)")


@contextmanager
def _signals_stop(job):
    """While ``job`` runs, SIGUSR1, SIGUSR2 and SIGTERM end the attempt in flight (its worker and what it
    started) and raise ``JobSignalled``, once: the row is then written before SLURM's SIGKILL."""

    def stop(signum, frame):
        for caught in STOPPING_SIGNALS:
            signal.signal(caught, signal.SIG_IGN)
        raise JobSignalled(signum)

    previous = {caught: signal.signal(caught, stop) for caught in STOPPING_SIGNALS}
    try:
        yield
    finally:
        for caught, handler in previous.items():
            signal.signal(caught, handler)


def _stopped_row(job, stopped: JobSignalled) -> dict:
    """The row of ``job`` stopped by SLURM's signal: ``timeout``, with the attempts done before it."""
    attempts = getattr(stopped, "attempts", None)
    return Row(key=job.spec.key, label=job.spec.label, spec=job.spec.model_dump(), status="timeout",
               error=f"{stopped}: the attempt in flight was stopped and this row written. A longer --time, or a "
                     f"shorter --timeout, gives the configuration its whole life.",
               params=resolve(job.spec.model).total_params, attempts=attempts,
               finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds")).as_dict()


def _planned_job(store: ResultStore, key: str, config: SweepConfig, device: str, here, calibration):
    """The job of ``key`` as planned, with this node's calibration where its GPU is the one planned for
    (else the one stored here for the planned GPU), those this device cannot run refused; and the GPU
    it was planned for."""
    kept = planned.load_spec(store.directory, key)
    [unplanned] = plan_jobs([RunSpec.model_validate(kept["spec"])], config, None, None)
    target = planned.target_of(kept)
    if planned.difference(target, here) is not None and target is not None:
        calibration = load_calibration(target.name) if target.name else None
    job = planned.planned_job(kept, unplanned, calibration)
    return refuse_unrunnable([job], device)[0], target


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m fitbench.cli.allocation DIR KEY (the program of a sweep's SLURM job)", file=sys.stderr)
        return 2
    try:
        return run_configuration(*argv)
    except UserError as error:
        print(f"fitbench: {error}", file=sys.stderr)
        return UserError.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
