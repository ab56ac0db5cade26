"""fitbench from Python: ``fitbench.plan``, ``fitbench.run`` and ``fitbench.load``, the commands
``fitbench plan``, ``fitbench run`` and ``fitbench report`` without a terminal. Options keep their
command-line meaning, spelled as Python names (``--batch-size`` is ``batch_size``); bad input raises
``fitbench.util.errors.UserError`` with the paragraph the command would print.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from fitbench.results.row import Row


def plan(model: str, mode: str = "train", *, gpu: str | None = None, gpu_memory: str | None = None,
         gpus: int | None = None, precisions: list[str] | None = None, batch_sizes: list[int] | None = None,
         seq_len: int = 512, new_tokens: int = 128, strategies: list[str] | None = None):
    """The plan of ``model`` in ``mode`` on the GPUs described (as ``fitbench plan``: ``gpu``, e.g.
    H100-80GB, or ``gpu_memory``, e.g. 80GB, with ``gpus``; none of them: the GPUs detected here):
    a ``fitbench.plan.planner.Plan``, whose ``chosen`` is the fastest candidate predicted to fit
    (None when none does). ``batch_sizes`` None: the largest batch predicted to fit."""
    from fitbench.config import check_context
    from fitbench.models.registry import resolve
    from fitbench.plan.calibration import load_calibration
    from fitbench.plan.planner import plan as make_plan
    from fitbench.sweep import gpu_target

    target = gpu_target(gpu=gpu, gpu_memory=gpu_memory, gpus=gpus)
    arch = resolve(model)
    check_context(arch, mode, seq_len, new_tokens)
    return make_plan(arch, mode, target, seq_len=seq_len, new_tokens=new_tokens, batch_sizes=batch_sizes,
                     precisions=precisions, strategies=strategies, calibration=load_calibration(target.name))


def run(models: list[str], *, out: str | Path | None = None, **options: Any) -> list[Row]:
    """Benchmark every configuration of ``models`` x the other options (those of ``fitbench run``:
    ``mode``, ``precision``, ``batch_size``, ``seq_len``, ``device``, ``gpus``, ...), each in a fresh
    process, and return their rows. The rows are also written to ``out`` (default: a new temporary
    directory), which ``load`` and ``fitbench report`` read again."""
    from fitbench import __version__
    from fitbench.config import merge_sources
    from fitbench.launch.local import LocalLauncher, run_sweep
    from fitbench.results.store import ResultStore
    from fitbench.sweep import plan_sweep

    config = merge_sources({}, {}, {"models": list(models), **options})
    directory = str(out) if out is not None else tempfile.mkdtemp(prefix="fitbench-")
    device, jobs, calibration = plan_sweep(config, directory, "out", say=lambda text: None)
    store = ResultStore(directory)
    store.lock()
    try:
        command = f"fitbench.run({list(models)!r}, {', '.join(f'{k}={v!r}' for k, v in options.items())})"
        store.save_sweep({"config": config.model_copy(update={"out": directory}).model_dump(), "device": device,
                          "command": command, "fitbench_version": __version__})
        rows = run_sweep(jobs, store, launcher=LocalLauncher(), command=command, calibration=calibration)
    finally:
        store.unlock()
    return [Row.model_validate(row) for row in rows]


def load(directory: str | Path) -> list[Row]:
    """The rows of a results directory (the ``--out`` of a ``fitbench run``, or ``out`` of ``run``)."""
    from fitbench.results.store import ResultStore
    from fitbench.util.errors import UserError

    store = ResultStore(directory)
    if not store.row_files():
        raise UserError(f"load: {directory} has no {store.path.name} (nor a SLURM sweep's rows/). Pass the --out "
                        f"directory of a `fitbench run`.")
    return list(store.typed_rows())
