"""fitbench from Python: ``fitbench.plan``, ``fitbench.run`` and ``fitbench.load``, the commands
``fitbench plan``, ``fitbench run`` and ``fitbench report`` without a terminal. Options keep their
command-line meaning, spelled as Python names (``--batch-size`` is ``batch_size``); bad input raises
``fitbench.util.errors.UserError`` with the paragraph the command would print.
"""

from __future__ import annotations

import tempfile
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from fitbench.results.row import Row
from fitbench.util.errors import UserError, excerpt


# Tokens an infer plan generates when none are given: as many as a sweep's on a GPU (fitbench.config.expand).
DEFAULT_NEW_TOKENS = 128


def plan(model: str, mode: str = "train", *, gpu: str | None = None, gpu_memory: str | None = None,
         gpus: int | None = None, gpus_per_node: int | None = None, nodes: int | None = None,
         inter_node_bandwidth: str | None = None, precisions: list[str] | None = None,
         batch_sizes: list[int | str] | None = None, seq_len: int = 512, new_tokens: int | None = None,
         strategies: list[str] | None = None, backend: str | None = None):
    """The plan of ``model`` in ``mode``, as ``fitbench plan`` makes it, with its options and defaults, on
    the GPUs described (``gpu``, e.g. H100-80GB, or ``gpu_memory``, e.g. 80GB, with ``gpus``; or
    ``nodes`` of ``gpus_per_node``; none of them: the GPUs detected here): a
    ``fitbench.planning.planner.Plan``, whose ``chosen`` is the fastest candidate predicted to fit (None when
    none does). ``batch_sizes``: the batches to consider, by default batch 1 (what ``fitbench run``
    runs in ``infer``); ``["auto"]``: the largest batch predicted to fit. ``new_tokens``: the tokens an
    ``infer`` plan generates (default ``DEFAULT_NEW_TOKENS``); given for another mode, a UserError
    (``fitbench.inert_options``). ``backend``: whose build is predicted, ``native`` (fitbench's decoder) or
    ``hf`` (transformers'); None or ``auto``: the family's own (``default_backend``)."""
    from fitbench.config import merge_sources
    from fitbench.inert_options import Asked, refuse_inert
    from fitbench.planning.calibration import load_calibration
    from fitbench.planning.planner import plan as make_plan

    refuse_inert(Asked({"mode": [mode], "new_tokens": new_tokens}, frozenset(
        {"mode", *(["new_tokens"] if new_tokens is not None else [])}), "plan"))
    new_tokens = DEFAULT_NEW_TOKENS if new_tokens is None else new_tokens
    shapes = merge_sources({}, {}, {"batch_size": batch_sizes or [1], "seq_len": [seq_len], "new_tokens": new_tokens,
                                    "models": [model], "mode": [mode],
                                    **({"precision": precisions} if precisions else {})})
    batch = plan_batches(shapes.batch_size)
    target = plan_target(gpu=gpu, gpu_memory=gpu_memory, gpus=gpus, gpus_per_node=gpus_per_node, nodes=nodes,
                         inter_node_bandwidth=inter_node_bandwidth)
    arch = plannable(model, mode, precisions, seq_len, new_tokens)
    if backend not in (None, "auto", "native", "hf"):
        raise UserError(f"backend: the planner predicts the native and hf builds, not {excerpt(str(backend))}; give "
                        f"native, hf or auto (the family's own).")
    return make_plan(arch, mode, target, seq_len=seq_len, new_tokens=new_tokens, batch_sizes=batch,
                     precisions=precisions, strategies=strategies, calibration=load_calibration(target.name),
                     backend=None if backend == "auto" else backend)


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


def run(models: list[str] | None = None, *, out: str | Path | None = None, resume: str | Path | None = None,
        extend: bool = False, config: str | Path | None = None, **options: Any) -> list[Row]:
    """Benchmark every configuration of ``models`` x the other options (those of ``fitbench run``:
    ``mode``, ``precision``, ``batch_size``, ``seq_len``, ``device``, ``gpus``, ``launcher``, ...), each
    in a fresh process, or as SLURM jobs with ``launcher="slurm"``, and return their rows, as
    ``fitbench run`` does: ``config``, a YAML file of options under those given; ``resume``, the
    directory of a sweep to finish (``extend``: adding the models, modes, precisions, batch sizes and
    sequence lengths given). The rows are also written to ``out`` (default: a new temporary directory),
    which ``load`` and ``fitbench report`` read again."""
    given = {**({"models": list(models)} if models is not None else {}), **options}
    if out is not None:
        given["out"] = str(out)
    elif resume is None:
        given["out"] = tempfile.mkdtemp(prefix="fitbench-")
    arguments = [repr(list(models))] if models is not None else []
    arguments += [f"{key}={value!r}" for key, value in (("out", out), ("resume", resume), ("config", config),
                                                          *options.items()) if value is not None]
    if extend:
        arguments.append("extend=True")
    sweep = start_sweep(given, resume=str(resume) if resume is not None else None, extend=extend,
                        config_file=str(config) if config is not None else None,
                        command=f"fitbench.run({', '.join(arguments)})", option_names=False)
    try:
        run_started(sweep)
    finally:
        sweep.store.unlock()
    return sweep.rows()


@dataclass
class StartedSweep:
    """A sweep ready to run: its options, results directory and store (locked), the device, the
    planned jobs, the calibration, the command that started it, and its SLURM options (None: local)."""

    config: Any
    out: str
    store: Any
    device: str
    jobs: list
    calibration: Any
    command: str
    slurm: Any

    @property
    def keys(self) -> set[str]:
        return {job.spec.key for job in self.jobs}

    def rows(self) -> list[Row]:
        """The rows of the sweep's configurations, in the order they were written."""
        return [row for row in self.store.typed_rows() if row.key in self.keys]


def start_sweep(given: dict[str, Any], *, resume: str | None, extend: bool, config_file: str | None, command: str,
                option_names: bool = True, dry_run: bool = False, say: Callable[[str], None] | None = None,
                on_bad_line: Callable[[str], None] | None = None,
                on_warning: Callable[[str], None] | None = None) -> StartedSweep:
    """Everything ``fitbench run`` and ``run`` do before the first launch: the options (``given`` over the
    ``config_file``'s over a resumed sweep's: ``sweep_options``), the cluster's commands where the
    launcher is SLURM (not for a ``dry_run``), the plan (``fitbench.sweep.plan_sweep``, which tells
    ``say``), the results directory locked, and the options saved in it for ``--resume``.
    ``option_names``: errors name the command line's options (``--out``) rather than ``out``; a SLURM
    job's sizes derived or doubtful (``fitbench.sweep.sized_config``) are told to ``on_warning`` (by default
    as Python warnings)."""
    from fitbench.config import asked_of
    from fitbench.inert_options import inert_warnings
    from fitbench.results.store import SWEEP_FILE, ResultStore
    from fitbench.sweep import plan_sweep, sized_config, slurm_options
    from fitbench.util.version import __version__

    config, out = sweep_options(given, resume=resume, extend=extend, config_file=config_file)
    config, warnings_found = sized_config(config)
    for warning in warnings_found:
        (on_warning or (lambda text: warnings.warn(text, stacklevel=3)))(warning)
    slurm = slurm_options(config)
    if dry_run and slurm is None:
        raise UserError("dry-run: --dry-run prints the batch scripts of SLURM jobs; give it with --launcher slurm.")
    if slurm is not None and not dry_run:
        from fitbench.launch.slurm.jobs import check_partition, require_command

        for name in ("sbatch", "squeue", "sinfo"):
            require_command(name)
        if slurm.partition is not None:
            check_partition(slurm.partition)
    out_option = ("--resume" if resume else "--out") if option_names else ("resume" if resume else "out")
    device, jobs, calibration = plan_sweep(config, out, out_option, say=say or (lambda text: None))
    asked = asked_of(config, backends=frozenset(job.spec.backend for job in jobs), device_type=device.split(":")[0])
    for warning in inert_warnings(asked):
        (on_warning or (lambda text: warnings.warn(text, stacklevel=3)))(warning)
    store = ResultStore(out, on_bad_line=on_bad_line)
    store.lock()  # until the sweep's caller unlocks it; a failed run's lock goes with its store, or with the process
    if not resume and (store.directory / SWEEP_FILE).exists():
        shown = excerpt(out, 200)
        raise UserError(f"out: {shown} already holds a sweep ({SWEEP_FILE}); a new one would replace it. "
                        f"`fitbench run --resume {shown}` finishes it (--extend adds to it), or give "
                        f"another --out.")
    config = config.model_copy(update={"out": out})
    store.save_sweep({"config": config.model_dump(), "device": device, "command": command,
                      "fitbench_version": __version__})
    save_code_diff(store.directory)
    return StartedSweep(config, out, store, device, jobs, calibration, command, slurm)


def save_code_diff(directory: Path) -> str | None:
    """The code's changes against its commit (``fitbench.hardware.environment.code_diff``) saved in a
    sweep's ``directory`` as ``diffs/<SHA-256>.diff``, the file a row's ``environment.git_diff_sha256``
    names; that hash, None for unchanged code (or no checkout), which saves nothing. A file of that name
    holds that diff already (a resumed sweep on the same code): it is left as it is."""
    from fitbench.hardware.environment import code_diff, diff_sha256

    diff = code_diff()
    sha256 = diff_sha256(diff)
    if sha256 is not None:
        path = Path(directory) / "diffs" / f"{sha256}.diff"
        path.parent.mkdir(exist_ok=True)
        if not path.exists():
            path.write_bytes(diff)
    return sha256


def run_started(sweep: StartedSweep, display=None, cluster_display=None) -> None:
    """Run ``sweep``'s jobs not yet finished: one after the other here (``fitbench.launch.local.run_sweep``,
    showing them on ``display``), or submitted as SLURM jobs and followed
    (``fitbench.launch.slurm.sweep.run_on_slurm``, on ``cluster_display``)."""
    if sweep.slurm is not None:
        from fitbench.launch.slurm.sweep import run_on_slurm

        run_on_slurm(sweep.jobs, sweep.store, sweep.slurm, max_concurrent=sweep.config.max_concurrent,
                     command=sweep.command, **({"display": cluster_display} if cluster_display else {}))
        return
    from fitbench.launch.local import LocalLauncher, run_sweep

    run_sweep(sweep.jobs, sweep.store, launcher=LocalLauncher(), command=sweep.command,
              calibration=sweep.calibration, **({"display": display} if display else {}))


def sweep_options(given: dict[str, Any], *, resume: str | None = None, extend: bool = False,
                  config_file: str | None = None):
    """The sweep's options (``fitbench.config.SweepConfig``), ``given`` over the ``config_file``'s over a
    resumed sweep's, and its results directory (by default ``fitbench-results/<UTC time>``)."""
    from fitbench.config import load_yaml, merge_sources, resumed_config, saved_options
    from fitbench.results.store import SWEEP_FILE, ResultStore

    for option, value in (("--resume", resume), ("--config", config_file)):
        if value is not None and not value.strip():
            what = "directory of a sweep" if option == "--resume" else "YAML file"
            raise UserError(f"{option[2:]}: {option} was given an empty path; give the {what}, or leave {option} out.")
    saved: dict[str, Any] = {}
    if resume:
        if "out" in given:
            raise UserError(f"--resume and --out contradict: --resume {resume} writes to the directory it "
                            f"resumes. Give --resume alone, or --out alone for a new sweep.")
        store = ResultStore(resume)
        sweep = store.load_sweep()
        if sweep is None:
            raise UserError(f"resume: {resume} holds no fitbench sweep (no sweep.json). Pass the --out directory "
                            f"of an earlier run.")
        saved = _fixable_in_place(saved_options(sweep, str(store.directory / SWEEP_FILE)), store, given)
    elif extend:
        raise UserError("--extend adds to a saved sweep; give it with --resume DIR.")
    file_options = load_yaml(config_file) if config_file else {}
    config = merge_sources(saved, file_options, given)
    if resume:
        config = resumed_config(saved, config, extend=extend)
    if config.ollama_url and not config.ollama_model:
        raise UserError("ollama-model: --ollama-url needs --ollama-model, the model that writes the analysis.")
    out = resume or config.out or str(Path("fitbench-results") / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"))
    return config, out


def _fixable_in_place(saved, store, given: dict[str, Any]):
    """``saved`` with the cluster options given now in place of its own, where the sweep never got a job
    submitted nor a row (sbatch refused it, or it was a --dry-run): the same folder is fixed and run."""
    from fitbench.config import Source
    from fitbench.launch.slurm.sweep import SUBMITTED_FILE
    from fitbench.sweep import SLURM_FIELDS

    if (store.directory / SUBMITTED_FILE).exists() or store.row_files():
        return saved
    cluster = {field: value for field, value in given.items() if field in SLURM_FIELDS}
    return Source({**saved, **cluster}, kind=saved.kind, name=saved.name, keys=saved.keys) if cluster else saved


def load(directory: str | Path) -> list[Row]:
    """The rows of a results directory (the ``--out`` of a ``fitbench run``, or ``out`` of ``run``)."""
    from fitbench.results.store import ResultStore

    store = ResultStore(directory)
    if not store.row_files():
        raise UserError(f"load: {directory} has no {store.path.name} (nor a SLURM sweep's rows/). Pass the --out "
                        f"directory of a `fitbench run`.")
    return list(store.typed_rows())
