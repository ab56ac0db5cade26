"""``fitbench run``: benchmark every configuration of a sweep, each in a fresh process."""

from __future__ import annotations

import argparse
import shlex
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Column

from fitbench import __version__
from fitbench.cli.command import Command
from fitbench.cli.console import console, warn
from fitbench.cli.options import sweep_options
from fitbench.errors import UserError, excerpt

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
NOT_SWEEP_OPTIONS = ("command", "function", "argv", "resume", "extend", "config")


def _label(row: dict[str, Any]) -> str:
    """The configuration as asked for, and what finally ran when a fallback or the batch search changed it."""
    from fitbench.spec import RunSpec

    ran = RunSpec.model_validate(row["spec"]).label if "spec" in row else row["label"]
    return row["label"] if ran == row["label"] else f"{row['label']} (ran as {ran})"


def _describe_row(row: dict[str, Any]) -> str:
    from fitbench.results.report import headline, quality_summary
    from fitbench.units import format_bytes, format_seconds

    if row["status"] != "ok":
        first_line = (row.get("error") or "").strip().splitlines()[:1]
        return f"[red]{row['status']}[/red] {escape(_label(row))}: {escape(first_line[0]) if first_line else ''}"
    head = headline(row)
    per = "/token" if row["spec"]["mode"] == "infer" else "/step"
    warn = f" [yellow]({escape('; '.join(row['warnings']))})[/yellow]" if row.get("warnings") else ""
    quality = row.get("quality")
    cost = (f", weights {100 * row['weights']['relative_to_bf16']:.0f}% of bf16; {escape(quality_summary(quality))}"
            if quality else "")
    offload = row.get("offload")
    if offload:
        layers = offload["resident_layers"] + offload["offloaded_layers"]
        where = "host memory" if offload["tier"] == "cpu" else "disk"
        cost += (f", {offload['offloaded_layers']} of {layers} layers ({format_bytes(offload['offloaded_bytes'])}) "
                 f"offloaded to {where}")
    return (f"[green]ok[/green] {escape(_label(row))}: {format_seconds(head['time'])}{per} ± {head['cv']:.1f}%, "
            f"{head['tokens_per_s']:,.0f} tokens/s{cost}{warn}")



def check_output_directory(out: str, option: str) -> None:
    """A UserError unless ``out`` is, or can be made, a directory this process can write in; checked
    before anything runs, by writing there."""
    path = Path(out)
    try:
        if path.exists() and not path.is_dir():
            raise UserError(f"out: {excerpt(out, 200)} ({option}) is an existing file, not a directory. Give a "
                            f"directory, or a path that does not exist yet.")
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise UserError(f"out: cannot write in {excerpt(out, 200)} ({option}): {error.strerror}. Give a directory "
                        f"you can write to.") from None


def run(args: argparse.Namespace) -> int:
    """Benchmark every configuration of the sweep, each in a fresh process."""
    from fitbench.config import expand, fallback_ladder, load_yaml, merge_sources, resumed_config, saved_options
    from fitbench.launch.fallback import FallbackPolicy
    from fitbench.launch.local import SweepCallbacks, run_sweep
    from fitbench.launch.orders import assign
    from fitbench.plan.calibration import TENSORS_ONLY
    from fitbench.results.report import results_table, write_csv
    from fitbench.results.store import SWEEP_FILE, ResultStore
    from fitbench.results.terminal import EtaColumn, SweepClock
    from fitbench.sweep import (check_ranks, default_models, hardware_refusals, plan_specs, predicted_max_batch,
                                resolve_device, run_target)

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
    out = args.resume or config.out or str(Path("fitbench-results") / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"))
    device = resolve_device(config.device)
    check_ranks(device, config.gpus)
    specs = expand(config, device=device, default_models=default_models(device))
    check_output_directory(out, "--resume" if args.resume else "--out")
    target, calibration = run_target(device, say=lambda text: console.print(escape(text)), ranks=config.gpus)
    specs, predict, refusals = plan_specs(specs, config, target, calibration)
    refusals.update(hardware_refusals(specs, device))

    config = config.model_copy(update={"out": out})
    store = ResultStore(out, on_bad_line=warn)
    store.lock()  # until this run returns; a failed run's lock goes with its store, or with the process
    if not args.resume and (store.directory / SWEEP_FILE).exists():
        raise UserError(f"out: {excerpt(out, 200)} already holds a sweep ({SWEEP_FILE}); a new one would replace it. "
                        f"`fitbench run --resume {excerpt(out, 200)}` finishes it (--extend adds to it), or give "
                        f"another --out.")
    command = shlex.join(["fitbench", *args.argv])
    store.save_sweep({"config": config.model_dump(), "device": device, "command": command,
                      "fitbench_version": __version__})

    done = store.finished_keys()
    console.print(f"fitbench {__version__}: {len(specs)} configuration(s) on {device}"
                  + (f", {sum(s.key in done for s in specs)} already finished" if done else "")
                  + f"; results in {out}/")
    # Outside a terminal a live display shows nothing until the end: one line per configuration instead.
    clock = SweepClock(len(specs))
    figure = Column(no_wrap=True)  # at 80 columns the label wraps; counts and times stay whole
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=20),
                        MofNCompleteColumn(table_column=figure), TimeElapsedColumn(table_column=figure),
                        EtaColumn(clock), console=console, transient=True, disable=not console.is_terminal)
    with progress:
        sweep_task = progress.add_task("sweep", total=len(specs), eta=True)
        run_task = progress.add_task("", total=None)

        def on_start(spec, index, total):
            clock.start()
            progress.update(run_task, description=f"{escape(spec.label)}: starting", completed=0, total=None)

        def on_event(event):
            label = progress.tasks[run_task].description.split(":")[0]
            phase = event.get("phase", "")
            if "of" in event:
                progress.update(run_task, description=f"{label}: {phase} {event['step']}/{event['of']}",
                                completed=event["step"], total=event["of"])
            else:
                progress.update(run_task, description=f"{label}: {phase}", total=None)

        def on_finish(row):
            clock.finish(measured=row["status"] != "refused")
            if console.is_terminal:
                progress.console.print(_describe_row(row))
            else:
                console.print(f"{escape(f'[{clock.summary()}]')} {_describe_row(row)}", soft_wrap=True)
            progress.advance(sweep_task)
            write_csv(list(store.rows()), out)

        def on_skip(spec):
            clock.skip()
            progress.advance(sweep_task)

        callbacks = SweepCallbacks(on_start=on_start, on_event=on_event, on_finish=on_finish, on_skip=on_skip)
        run_sweep(specs, store, timeout=config.timeout, command=command, callbacks=callbacks,
                  predict=predict, refusals=refusals, calibration=calibration.source if calibration else TENSORS_ONLY,
                  fallback=lambda spec: FallbackPolicy(tuple(fallback_ladder(config, spec.mode)),
                                                       enabled=not config.no_fallback, gpus_at_hand=config.gpus),
                  predicted_batch=lambda spec: predicted_max_batch(spec, device),
                  assign=lambda spec: assign(spec, target, calibration))

    keys = {spec.key for spec in specs}
    rows = [row for row in store.rows() if row.get("key") in keys]
    console.print(results_table(rows))
    csv_path = write_csv(list(store.rows()), out)
    console.print(f"rows: {store.path}  table: {csv_path}")
    store.unlock()
    failed = [row for row in rows if row["status"] != "ok"]
    if failed:
        listed = "; ".join(f"{escape(row.get('label') or row['key'])}: {escape(row['status'])}" for row in failed)
        console.print(f"{len(failed)} of {len(rows)} configuration(s) did not finish or gave invalid numbers "
                      f"({listed}); their rows say why (status, error) and the logs are in {out}/logs/.")
        return 1
    return 0


COMMAND = Command("run", "benchmark models: train, forward, forward-backward, infer", run, (sweep_options,),
                  RUN_EXAMPLES)
