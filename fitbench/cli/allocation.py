"""What a SLURM job of a sweep runs in its allocation: ``python -m fitbench.cli.allocation DIR KEY``.

It reads the sweep saved in ``DIR`` (``sweep.json``), plans it on this node as ``fitbench run`` plans
on a workstation (the GPU found here, its calibration), and runs the configuration ``KEY``'s whole
life (``fitbench.launch.job.Job.run``: batch search, fallback ladder, within ``--timeout``): on one
node with ``fitbench.launch.local.LocalLauncher``, over several with
``fitbench.launch.slurm.nodes.NodesLauncher``. Its latest progress event is kept in
``DIR/progress/KEY.json`` for the sweep's process to show, and its row, as the sweep keeps it
(``fitbench.launch.local.sweep_row``) with the SLURM job it ran in, goes to ``DIR/rows/KEY.json``:
the job writes no other file of the sweep.
"""

from __future__ import annotations

import json
import os
import sys

from fitbench.config import SweepConfig, saved_options
from fitbench.launch.launcher import Event
from fitbench.launch.local import LocalLauncher, sweep_row
from fitbench.launch.slurm.nodes import NodesLauncher
from fitbench.launch.slurm.sweep import progress_file
from fitbench.results.store import SWEEP_FILE, ResultStore
from fitbench.sweep import plan_sweep
from fitbench.util.errors import UserError


def run_configuration(directory: str, key: str) -> int:
    """Run configuration ``key`` of the sweep saved in ``directory`` and write its row; 0 once written."""
    store = ResultStore(directory)
    sweep = store.load_sweep()
    if sweep is None:
        raise UserError(f"resume: {directory} holds no fitbench sweep (no {SWEEP_FILE}).")
    saved = SweepConfig.model_validate(dict(saved_options(sweep, str(store.directory / SWEEP_FILE))))
    config = saved.model_copy(update={"launcher": "local", "device": sweep["device"]})
    planned = plan_sweep(config, directory, "--resume", say=lambda text: print(text, flush=True))
    job = next((job for job in planned.jobs if job.spec.key == key), None)
    if job is None:
        raise UserError(f"resume: the sweep in {directory} has no configuration {key}.")
    nodes = config.nodes or 1
    launcher = (NodesLauncher(nodes, config.gpus // nodes, config.cpus_per_task) if nodes > 1 else LocalLauncher())
    progress = progress_file(store.directory, key)
    progress.parent.mkdir(parents=True, exist_ok=True)

    def keep(event: Event) -> None:
        tmp = progress.with_suffix(".tmp")
        tmp.write_text(json.dumps(event, default=str))
        os.replace(tmp, progress)

    row = job.run(launcher, store.directory / "logs", keep)
    job_id = (f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
              if "SLURM_ARRAY_JOB_ID" in os.environ else os.environ.get("SLURM_JOB_ID"))
    row = sweep_row(job, {**row, "slurm": {"job_id": job_id, "nodes": os.environ.get("SLURM_JOB_NODELIST")}},
                    sweep.get("command"), planned.calibration)
    path = store.write_job_row(row)
    print(f"{row['status']} {row['label']}: row written to {path}", flush=True)
    return 0


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
