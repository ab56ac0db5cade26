"""``fitbench run``: benchmark every configuration of a sweep, each in a fresh process."""

from __future__ import annotations

import argparse
import shlex
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.markup import escape

from fitbench.cli.command import Command
from fitbench.cli.console import console, warn
from fitbench.cli.documents import write_documents
from fitbench.cli.options import quiet_option, sweep_options
from fitbench.util.errors import UserError, excerpt
from fitbench.util.version import __version__

RUN_EXAMPLES = """\
examples:
  fitbench run                                   the default job for the hardware found
  fitbench run --models 1B 3B 7B --samples 5     three sizes, train and infer, 5 measured steps
  fitbench run --models small medium large xl 2.7B --mode forward-backward \\
               --precision bf16 --batch-size 4 --context-length 512
  fitbench run --models 7B --mode infer --batch-size 1 --precision bf16-pure --new-tokens 256
  fitbench run --models 65B --mode infer --offload --new-tokens 16 --warmup-steps 1 --measure-steps 2
                                                 layers the GPU has no room for stream from host memory
  fitbench run --config config.yaml --out runs/today
  fitbench run --resume runs/today               finish a sweep that was interrupted

defaults: on a GPU, batch 4 x 512 tokens with bf16 autocast for training-style modes and batch 1
with a 128-token prompt and bf16 weights for infer; on a CPU, 1 x 128 tokens in fp32.
Results: <out>/results.jsonl (one row per configuration, written as it finishes) and results.csv.
One sweep at a time per --out directory: a second one exits 2 naming the PID that holds it.

exit status: 0 every configuration ok; 1 one or more did not finish ok (their rows say why; the
summary lists them); 2 bad input, nothing ran; 130 interrupted (Ctrl-C, SIGTERM, SIGHUP: the row in
flight says interrupted, --resume runs it again).
"""



# What the parsed arguments hold beside the sweep's options (``sweep_options``, each a key of SweepConfig).
NOT_SWEEP_OPTIONS = ("command", "function", "argv", "resume", "extend", "config", "dry_run", "quiet")


def run(args: argparse.Namespace) -> int:
    """Benchmark every configuration of the sweep, each in a fresh process."""
    from fitbench.launch.local import LocalLauncher, run_sweep
    from fitbench.results.store import ResultStore
    from fitbench.sweep import plan_sweep

    from fitbench.cli.display import ProgressDisplay

    from fitbench.sweep import slurm_options

    config, out = sweep_config(args)
    options = slurm_options(config)
    if args.dry_run and options is None:
        raise UserError("dry-run: --dry-run prints the batch scripts of SLURM jobs; give it with --launcher slurm.")
    if options is not None and not args.dry_run:
        from fitbench.launch.slurm.jobs import check_partition, require_command

        for name in ("sbatch", "squeue", "sinfo"):
            require_command(name)
        if options.partition is not None:
            check_partition(options.partition)

    def say(text: str) -> None:
        if not args.quiet:
            console.print(escape(text))

    device, jobs, calibration = plan_sweep(config, out, "--resume" if args.resume else "--out", say=say)

    store = ResultStore(out, on_bad_line=warn)
    store.lock()  # until this run returns; a failed run's lock goes with its store, or with the process
    command = _start_sweep(store, out, config.model_copy(update={"out": out}), device, args)
    if args.dry_run:
        return _dry_run(jobs, store, options, config, out)
    done = store.finished_keys()
    if not args.quiet:
        console.print(f"fitbench {__version__}: {len(jobs)} configuration(s) on {device}"
                      + (f", {sum(job.spec.key in done for job in jobs)} already finished" if done else "")
                      + (" as SLURM jobs" if options else "") + f"; results in {out}/")
    if options is not None:
        from fitbench.cli.display import ClusterDisplay
        from fitbench.launch.slurm.sweep import run_on_slurm

        run_on_slurm(jobs, store, options, max_concurrent=config.max_concurrent, command=command,
                     display=ClusterDisplay(store))
    else:
        with ProgressDisplay(len(jobs), store, quiet=args.quiet) as display:
            run_sweep(jobs, store, launcher=LocalLauncher(), display=display, command=command,
                      calibration=calibration)
    return _summary(store, out, {job.spec.key for job in jobs}, config, args.quiet)


def _dry_run(jobs, store, options, config, out: str) -> int:
    """Write and print the batch script of the sweep's configurations without a row; submit nothing."""
    from fitbench.launch.slurm.sweep import scripts, write_script

    done = store.finished_keys()
    if all(job.spec.key in done for job in jobs):
        console.print(f"every configuration of {out} has its row; nothing to submit.")
        store.unlock()
        return 0
    script = scripts([job for job in jobs if job.spec.key not in done], options, store, config.max_concurrent)
    write_script(script)
    console.print(f"# {script.path}: {len(script.keys)} configuration(s); nothing was submitted", markup=False,
                  highlight=False)
    console.print(script.text, markup=False, highlight=False, end="", soft_wrap=True)
    console.print(f"# submit it with `fitbench run --resume {out}` (which follows the jobs and collects their rows), "
                  f"or edit it and `sbatch` it yourself; the rows go to {out}/rows/", markup=False, highlight=False,
                  soft_wrap=True)
    store.unlock()
    return 0


def sweep_config(args: argparse.Namespace):
    """The sweep's options (``fitbench.config.SweepConfig``), the command line's over the ``--config``
    file's over a resumed sweep's, and its results directory."""
    from fitbench.config import load_yaml, merge_sources, resumed_config, saved_options
    from fitbench.results.store import SWEEP_FILE, ResultStore

    for option, value in (("--resume", args.resume), ("--config", args.config)):
        if value is not None and not value.strip():
            what = "directory of a sweep" if option == "--resume" else "YAML file"
            raise UserError(f"{option[2:]}: {option} was given an empty path; give the {what}, or leave {option} out.")
    cli_options = {key: value for key, value in vars(args).items() if key not in NOT_SWEEP_OPTIONS}
    saved: dict[str, Any] = {}
    if args.resume:
        if "out" in cli_options:
            raise UserError(f"--resume and --out contradict: --resume {args.resume} writes to the directory it "
                            f"resumes. Give --resume alone, or --out alone for a new sweep.")
        store = ResultStore(args.resume)
        sweep = store.load_sweep()
        if sweep is None:
            raise UserError(f"resume: {args.resume} holds no fitbench sweep (no sweep.json). Pass the --out directory "
                            f"of an earlier run.")
        saved = saved_options(sweep, str(store.directory / SWEEP_FILE))
    elif args.extend:
        raise UserError("--extend adds to a saved sweep; give it with --resume DIR.")
    file_options = load_yaml(args.config) if args.config else {}
    config = merge_sources(saved, file_options, cli_options)
    if args.resume:
        config = resumed_config(saved, config, extend=args.extend)
    if config.ollama_url and not config.ollama_model:
        raise UserError("ollama-model: --ollama-url needs --ollama-model, the model that writes the analysis.")
    out = args.resume or config.out or str(Path("fitbench-results") / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"))
    return config, out


def _start_sweep(store, out: str, config, device: str, args: argparse.Namespace) -> str:
    """Save the sweep's options in ``store``, the directory ``out`` (for ``--resume``), and return its
    command line; a new sweep never replaces one already there."""
    from fitbench.results.store import SWEEP_FILE

    if not args.resume and (store.directory / SWEEP_FILE).exists():
        raise UserError(f"out: {excerpt(out, 200)} already holds a sweep ({SWEEP_FILE}); a new one would replace it. "
                        f"`fitbench run --resume {excerpt(out, 200)}` finishes it (--extend adds to it), or give "
                        f"another --out.")
    command = shlex.join(["fitbench", *args.argv])
    store.save_sweep({"config": config.model_dump(), "device": device, "command": command,
                      "fitbench_version": __version__})
    return command


def _summary(store, out: str, keys: set[str], config, quiet: bool = False) -> int:
    """The rows of ``keys`` in ``store`` (the directory ``out``) as a table (not when ``quiet``), where
    they are, the analysis ``config`` asks for, and the exit status: 1 when one did not finish ok."""
    from fitbench.results.directories import SweepRows, Sweeps
    from fitbench.results.report import results_table, write_csv

    rows = [row for row in store.typed_rows() if row.key in keys]
    if not quiet:
        console.print(results_table(rows))
    csv_path = write_csv(list(store.typed_rows()), out)
    console.print(f"rows: {store.path}  table: {csv_path}")
    store.unlock()
    write_documents(Sweeps([SweepRows(Path(out), rows)]), ollama_url=config.ollama_url,
                    ollama_model=config.ollama_model, ollama_timeout=config.ollama_timeout)
    failed = [row for row in rows if row.status != "ok"]
    if failed:
        listed = "; ".join(f"{escape(row.label)}: {escape(row.status)}" for row in failed)
        console.print(f"{len(failed)} of {len(rows)} configuration(s) did not finish or gave invalid numbers "
                      f"({listed}); their rows say why (status, error) and the logs are in {out}/logs/.")
        return 1
    return 0


COMMAND = Command("run", "benchmark models: train, forward, forward-backward, infer", run,
                  (sweep_options, quiet_option("no progress and no table: only where the rows are, the "
                                               "configurations that did not finish ok, and warnings")), RUN_EXAMPLES)
