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
from fitbench.util.errors import UserError


def plan(model: str, mode: str = "train", *, gpu: str | None = None, gpu_memory: str | None = None,
         gpus: int | None = None, gpus_per_node: int | None = None, nodes: int | None = None,
         inter_node_bandwidth: str | None = None, precisions: list[str] | None = None,
         batch_sizes: list[int | str] | None = None, seq_len: int = 512, new_tokens: int = 128,
         strategies: list[str] | None = None):
    """The plan of ``model`` in ``mode``, as ``fitbench plan`` makes it, with its options and defaults, on
    the GPUs described (``gpu``, e.g. H100-80GB, or ``gpu_memory``, e.g. 80GB, with ``gpus``; or
    ``nodes`` of ``gpus_per_node``; none of them: the GPUs detected here): a
    ``fitbench.planning.planner.Plan``, whose ``chosen`` is the fastest candidate predicted to fit (None when
    none does). ``batch_sizes``: the batches to consider, by default batch 1 (what ``fitbench run``
    runs in ``infer``); ``["auto"]``: the largest batch predicted to fit."""
    from fitbench.config import merge_sources
    from fitbench.planning.calibration import load_calibration
    from fitbench.planning.planner import plan as make_plan

    shapes = merge_sources({}, {}, {"batch_size": batch_sizes or [1], "seq_len": [seq_len], "new_tokens": new_tokens,
                                    "models": [model], "mode": [mode],
                                    **({"precision": precisions} if precisions else {})})
    batch = plan_batches(shapes.batch_size)
    target = plan_target(gpu=gpu, gpu_memory=gpu_memory, gpus=gpus, gpus_per_node=gpus_per_node, nodes=nodes,
                         inter_node_bandwidth=inter_node_bandwidth)
    arch = plannable(model, mode, precisions, seq_len, new_tokens)
    return make_plan(arch, mode, target, seq_len=seq_len, new_tokens=new_tokens, batch_sizes=batch,
                     precisions=precisions, strategies=strategies, calibration=load_calibration(target.name))


def plannable(model: str, mode: str, precisions: list[str] | None, seq_len: int, new_tokens: int):
    """The architecture of ``model``, once ``mode`` can run it: a precision of the ladder can train
    where the mode trains (as ``fitbench run`` refuses them), and the context fits the model."""
    from fitbench.config import check_context
    from fitbench.models.registry import resolve
    from fitbench.precisions import TRAINING_MODES, entry

    if mode in TRAINING_MODES and precisions and all(entry(p).training_problem for p in precisions):
        raise UserError(f"precision: {entry(precisions[0]).training_problem}; or use --mode infer or forward with "
                        f"{precisions[0]}.")
    arch = resolve(model)
    check_context(arch, mode, seq_len, new_tokens)
    return arch


def plan_batches(batch_sizes: list[int | str]) -> list[int] | None:
    """The planner's batches of ``fitbench plan``'s ``--batch-size``: the sizes, or None (the largest
    predicted to fit) for ``auto``, which stands alone."""
    if "auto" in batch_sizes and len(batch_sizes) > 1:
        raise UserError("batch_size: auto finds the largest batch that fits; give it alone, or list batch sizes.")
    return None if list(batch_sizes) == ["auto"] else list(batch_sizes)


def plan_target(*, gpu: str | None = None, gpu_memory: str | None = None, gpus: int | None = None,
                gpus_per_node: int | None = None, nodes: int | None = None, inter_node_bandwidth: str | None = None):
    """The GPUs to plan for (``fitbench.sweep.gpu_target``), with ``gpus_per_node`` the size of a node and
    ``nodes`` their count, and the bandwidth between nodes where given."""
    from dataclasses import replace

    from fitbench.sweep import gpu_target

    if nodes is not None and gpus_per_node is None:
        raise UserError("nodes: --nodes counts nodes of --gpus-per-node GPUs; give --gpus-per-node too, or plan for "
                        "--gpus N.")
    if nodes is not None and gpus is not None:
        raise UserError(f"--nodes and --gpus contradict: --nodes {nodes} plans for {nodes} x "
                        f"--gpus-per-node GPUs; give one of them.")
    for option, value in (("--gpus-per-node", gpus_per_node), ("--nodes", nodes)):
        if value is not None and value < 1:
            raise UserError(f"{option[2:]}: {option} must be 1 or more, got {value}.")
    bandwidth = None
    if inter_node_bandwidth is not None:
        from fitbench.planning.nodes import parse_inter_node_bandwidth

        try:
            bandwidth = parse_inter_node_bandwidth(inter_node_bandwidth)
        except ValueError as error:
            raise UserError(f"inter-node-bandwidth: {error}.") from None
    count = nodes * gpus_per_node if nodes else gpus
    target = replace(gpu_target(gpu=gpu, gpu_memory=gpu_memory, gpus=count), inter_node_bandwidth=bandwidth)
    return replace(target, node_gpus=gpus_per_node) if gpus_per_node else target


def run(models: list[str], *, out: str | Path | None = None, **options: Any) -> list[Row]:
    """Benchmark every configuration of ``models`` x the other options (those of ``fitbench run``:
    ``mode``, ``precision``, ``batch_size``, ``seq_len``, ``device``, ``gpus``, ...), each in a fresh
    process, and return their rows. The rows are also written to ``out`` (default: a new temporary
    directory), which ``load`` and ``fitbench report`` read again."""
    from fitbench.util.version import __version__
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

    store = ResultStore(directory)
    if not store.path.exists():
        raise UserError(f"load: {directory} has no {store.path.name}. Pass the --out directory of a `fitbench run`.")
    return list(store.typed_rows())
