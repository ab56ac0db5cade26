"""``fitbench run``: benchmark every configuration of a sweep, each in a fresh process."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from rich.markup import escape

from fitbench.cli.command import Command
from fitbench.cli.console import console, warn
from fitbench.cli.documents import write_documents
from fitbench.cli.options import quiet_option, sweep_options
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
    from fitbench.api import run_started, start_sweep
    from fitbench.cli.display import ClusterDisplay, ProgressDisplay

    def say(text: str) -> None:
        if not args.quiet:
            console.print(escape(text))

    given = {key: value for key, value in vars(args).items() if key not in NOT_SWEEP_OPTIONS}
    sweep = start_sweep(given, resume=args.resume, extend=args.extend, config_file=args.config,
                        command=shlex.join(["fitbench", *args.argv]), dry_run=args.dry_run, say=say, on_bad_line=warn,
                        on_warning=warn)
    if args.dry_run:
        return _dry_run(sweep.jobs, sweep.store, sweep.slurm, sweep.config, sweep.out)
    done = sweep.store.finished_keys()
    if not args.quiet:
        console.print(f"fitbench {__version__}: {len(sweep.jobs)} configuration(s) on {sweep.device}"
                      + (f", {sum(job.spec.key in done for job in sweep.jobs)} already finished" if done else "")
                      + (" as SLURM jobs" if sweep.slurm else "") + f"; results in {sweep.out}/")
    if sweep.slurm is not None:
        from fitbench.launch.slurm.jobs import SlurmCommandError

        try:
            run_started(sweep, cluster_display=ClusterDisplay(sweep.store))
        except SlurmCommandError as error:  # the cluster's, not the input's: one paragraph, exit 1
            console.print(f"fitbench: {escape(str(error))}", soft_wrap=True)
            sweep.store.unlock()
            return 1
    else:
        with ProgressDisplay(len(sweep.jobs), sweep.store, quiet=args.quiet) as display:
            run_started(sweep, display=display)
    return _summary(sweep.store, sweep.out, sweep.keys, sweep.config, args.quiet)


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


def _summary(store, out: str, keys: set[str], config, quiet: bool = False) -> int:
    """The rows of ``keys`` in ``store`` (the directory ``out``) as a table (not when ``quiet``), where
    they are, the analysis ``config`` asks for, and the exit status: 1 when one did not finish ok."""
    from fitbench.results.directories import SweepRows, Sweeps
    from fitbench.results.report import results_table, write_csv

    rows = [row for row in store.typed_rows() if row.key in keys]
    if not quiet:
        console.print(results_table(rows, gpu_hour_price=config.gpu_hour_price))
    csv_path = write_csv(list(store.typed_rows()), out, config.gpu_hour_price)
    console.print(f"rows: {' and '.join(map(str, store.row_files())) or 'none'}  table: {csv_path}")
    store.unlock()
    write_documents(Sweeps([SweepRows(Path(out), rows)]), ollama_url=config.ollama_url,
                    ollama_model=config.ollama_model, ollama_timeout=config.ollama_timeout,
                    gpu_hour_price=config.gpu_hour_price, analysis_directory=out)
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
