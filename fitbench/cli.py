"""The ``fitbench`` command: parse, call a plain function, print. Commands live in ``COMMANDS``.

List options take space-separated values as users type them (``--models 1B 3B 7B``). Every
``run`` option is also a key of the YAML file given to ``--config``; the command line wins over
the file, the file over the defaults. Bad input ends in one paragraph on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from fitbench import __version__
from fitbench.errors import UserError
from fitbench.run.loops import MODES
from fitbench.run.precision import PRECISIONS

# Outside a terminal (CI logs, pipes) rich would wrap tables at 80 columns.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
errors = Console(stderr=True, highlight=False)


RUN_EXAMPLES = """\
examples:
  fitbench run                                   the default job for the hardware found
  fitbench run --models 1B 3B 7B --samples 5     three sizes, train and infer, 5 measured steps
  fitbench run --models small medium large xl 2.7B --mode forward-backward \\
               --precision bf16 --batch-size 4 --context-length 512
  fitbench run --models 7B --mode infer --batch-size 1 --precision bf16-pure --new-tokens 256
  fitbench run --config config.yaml --out runs/today
  fitbench run --resume runs/today               finish a sweep that was interrupted

defaults: on a GPU, batch 4 x 512 tokens with bf16 autocast for training-style modes and batch 1
with a 128-token prompt and bf16 weights for infer; on a CPU, 1 x 128 tokens in fp32.
Results: <out>/results.jsonl (one row per configuration, written as it finishes) and results.csv.
"""


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    S = argparse.SUPPRESS
    add = parser.add_argument
    add("--models", nargs="+", default=S, metavar="MODEL",
        help="presets (see `fitbench models`), local directories with a config.json, or hub ids")
    add("--mode", "--modes", dest="mode", nargs="+", choices=MODES, default=S,
        help="what a step does: train (forward, backward, AdamW), forward, forward-backward, infer "
             "(prefill + decode with a KV cache). Default: train infer")
    add("--pass-type", dest="pass_type", choices=("forward", "backward"), default=S,
        help="CS336 spelling: forward = --mode forward, backward = --mode forward-backward")
    add("--precision", nargs="+", choices=PRECISIONS, default=S,
        help="fp32, tf32, bf16/fp16 (autocast over fp32 weights), bf16-pure (bf16 weights and optimizer)")
    add("--batch-size", dest="batch_size", nargs="+", type=int, default=S, metavar="N", help="sequences per step")
    add("--seq-len", "--context-length", dest="seq_len", nargs="+", type=int, default=S, metavar="T",
        help="tokens per sequence; the prompt length in infer")
    add("--new-tokens", dest="new_tokens", type=int, default=S, metavar="N",
        help="tokens generated per sequence in infer (default 128 on a GPU, 32 on a CPU)")
    add("--backend", choices=("auto", "native", "hf"), default=S,
        help="native: fitbench's decoder (Llama-style models); hf: transformers (every family). Default auto")
    add("--compile", action="store_true", default=S, help="torch.compile the model; compile time is reported apart")
    add("--activation-checkpointing", dest="activation_checkpointing", action="store_true", default=S,
        help="recompute each layer's activations in the backward pass (train, forward-backward)")
    add("--warmup-steps", dest="warmup_steps", type=int, default=S, metavar="N", help="untimed steps first (default 5)")
    add("--measure-steps", "--samples", dest="measure_steps", type=int, default=S, metavar="N",
        help="timed steps (generations in infer), default 10")
    add("--device", default=S, help="cpu, cuda or cuda:N (default: the first GPU if there is one, else cpu)")
    add("--timeout", type=float, default=S, metavar="SECONDS", help="per configuration (default 3600)")
    add("--seed", type=int, default=S, help="seed of the random weights and tokens (default 0)")
    add("--out", default=S, metavar="DIR", help="results directory (default ./fitbench-results/<UTC time>)")
    add("--resume", metavar="DIR", default=None,
        help="continue the sweep in DIR: its saved settings apply, finished configurations are skipped")
    add("--config", metavar="FILE", default=None, help="YAML file with any of these options as keys")


# ---- run ------------------------------------------------------------------------------------


def resolve_device(requested: str) -> str:
    """'auto' -> the first GPU if torch sees one, else cpu; a GPU that is not there is a UserError."""
    import torch

    if requested == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if requested == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise UserError(
            f"device: {requested!r} was asked for, but torch {torch.__version__} sees no CUDA GPU (no driver, or a "
            f"CPU-only build). Use --device cpu, or run where a GPU is visible."
        )
    index = int(requested.split(":")[1]) if ":" in requested else 0
    if index >= torch.cuda.device_count():
        raise UserError(f"device: {requested!r} does not exist; this machine has {torch.cuda.device_count()} GPU(s), "
                        f"cuda:0 to cuda:{torch.cuda.device_count() - 1}.")
    return f"cuda:{index}"


def default_models(device: str) -> list[str]:
    """The main job's models. CPU: ``tiny`` and ``small``. GPU: the ladder's sizes whose mixed-precision
    training state (16 bytes per parameter: fp32 weights and gradients, AdamW's two moments) takes at
    most 70% of the GPU, leaving the rest for activations; at most three sizes."""
    if device == "cpu":
        return ["tiny", "small"]
    import torch

    from fitbench.models.presets import SIZE_LADDER
    from fitbench.models.registry import resolve

    memory = torch.cuda.get_device_properties(torch.device(device)).total_memory
    fitting = [name for name in SIZE_LADDER if 16 * resolve(name).total_params <= 0.7 * memory]
    return fitting[:3] or ["tiny"]


def _describe_row(row: dict[str, Any]) -> str:
    from fitbench.results.report import headline
    from fitbench.units import format_seconds

    if row["status"] != "ok":
        first_line = (row.get("error") or "").strip().splitlines()[:1]
        return f"[red]{row['status']}[/red] {escape(row['label'])}: {escape(first_line[0]) if first_line else ''}"
    head = headline(row)
    per = "/token" if row["spec"]["mode"] == "infer" else "/step"
    warn = f" [yellow]({'; '.join(row['warnings'])})[/yellow]" if row.get("warnings") else ""
    return (f"[green]ok[/green] {escape(row['label'])}: {format_seconds(head['time'])}{per} ± {head['cv']:.1f}%, "
            f"{head['tokens_per_s']:,.0f} tokens/s{warn}")


def run(args: argparse.Namespace, cli_options: dict[str, Any]) -> int:
    """Benchmark every configuration of the sweep, each in a fresh process."""
    from fitbench.config import expand, load_yaml, merge_sources
    from fitbench.launch.local import SweepCallbacks, run_sweep
    from fitbench.results.report import results_table, write_csv
    from fitbench.results.store import ResultStore

    saved: dict[str, Any] = {}
    if args.resume:
        store = ResultStore(args.resume)
        sweep = store.load_sweep()
        if sweep is None:
            raise UserError(f"resume: {args.resume} holds no fitbench sweep (no sweep.json). Pass the --out directory "
                            f"of an earlier run.")
        saved = {key: value for key, value in sweep["config"].items() if value is not None}
    file_options = load_yaml(args.config) if args.config else {}
    config = merge_sources(saved, file_options, cli_options)
    device = resolve_device(config.device)
    specs = expand(config, device=device, default_models=default_models(device))

    out = args.resume or config.out or str(Path("fitbench-results") / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"))
    config = config.model_copy(update={"out": out})
    store = ResultStore(out)
    command = shlex.join(["fitbench", *args.argv])
    store.save_sweep({"config": config.model_dump(), "device": device, "command": command,
                      "fitbench_version": __version__})

    done = store.finished_keys()
    console.print(f"fitbench {__version__}: {len(specs)} configuration(s) on {device}"
                  + (f", {sum(s.key in done for s in specs)} already finished" if done else "")
                  + f"; results in {out}/")
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=True)
    with progress:
        sweep_task = progress.add_task("sweep", total=len(specs))
        run_task = progress.add_task("", total=None)

        def on_start(spec, index, total):
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
            progress.console.print(_describe_row(row))
            progress.advance(sweep_task)
            write_csv(list(store.rows()), out)

        callbacks = SweepCallbacks(on_start=on_start, on_event=on_event, on_finish=on_finish,
                                   on_skip=lambda spec: progress.advance(sweep_task))
        run_sweep(specs, store, timeout=config.timeout, command=command, callbacks=callbacks)

    keys = {spec.key for spec in specs}
    rows = [row for row in store.rows() if row.get("key") in keys]
    console.print(results_table(rows))
    csv_path = write_csv(list(store.rows()), out)
    console.print(f"rows: {store.path}  table: {csv_path}")
    failed = sum(row["status"] != "ok" for row in rows)
    if failed:
        console.print(f"{failed} of {len(rows)} configuration(s) did not finish; their rows say why "
                      f"(status, error) and the logs are in {out}/logs/.")
    return 0


# ---- models ---------------------------------------------------------------------------------


def models(args: argparse.Namespace, cli_options: dict[str, Any]) -> int:
    """List every preset with its exact parameter counts and shape."""
    from fitbench.models.presets import PRESETS
    from fitbench.units import format_count

    summaries = [arch.summary() for arch in PRESETS]
    if args.json:
        print(json.dumps(summaries, indent=2))
        return 0
    table = Table(title="fitbench presets (counts computed from the architecture)", title_justify="left")
    columns = ("name", "params", "non-emb", "layers", "hidden", "heads/kv", "ffn", "vocab", "context", "family",
               "follows")
    for column in columns:
        table.add_column(column, justify="left" if column in ("name", "family", "follows") else "right")
    for s in summaries:
        table.add_row(s["name"], f"{s['total_params']:,}", format_count(s["non_embedding_params"]), str(s["layers"]),
                      str(s["hidden"]), f"{s['heads']}/{s['kv_heads']}", str(s["ffn"]), str(s["vocab"]),
                      str(s["max_context"]), s["family"] + (" tied" if s["tied"] else ""), s["follows"])
    console.print(table)
    if args.sources:
        for s in summaries:
            console.print(f"{s['name']}: {s['source']}")
    else:
        console.print("Sources of every number: fitbench models --sources")
    return 0


# ---- env ------------------------------------------------------------------------------------


def env(args: argparse.Namespace, cli_options: dict[str, Any]) -> int:
    """Show versions, GPUs with their datasheet peaks, and the stored measured ceilings."""
    from fitbench import hardware

    if args.measure:
        device = resolve_device(args.device)
        console.print(f"measuring matmul and copy ceilings on {device} ...")
        ceilings = hardware.measure_ceilings(device)
        path = hardware.save_ceilings(ceilings)
        console.print(f"stored in {path}")
    info = hardware.environment()
    device_names = [gpu["name"] for gpu in info["gpus"]] or [hardware.cpu_device_name()]
    info["datasheet_peaks"] = {name: (hardware.gpu_spec(name).__dict__ if hardware.gpu_spec(name) else None)
                               for name in device_names}
    info["measured_ceilings"] = {name: (c.__dict__ if (c := hardware.load_ceilings(name)) else None)
                                 for name in device_names}
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    for key in ("fitbench_version", "git_commit", "python", "torch", "transformers", "accelerate", "torch_cuda",
                "driver", "cpu_model", "cpu_count", "hostname"):
        console.print(f"{key:18s} {info[key]}")
    for gpu in info["gpus"]:
        console.print(f"gpu {gpu['index']:<14d} {gpu['name']}, {gpu['total_memory'] / 1e9:.1f} GB, "
                      f"compute capability {gpu['compute_capability'][0]}.{gpu['compute_capability'][1]}")
    for name in device_names:
        peak = info["datasheet_peaks"][name]
        if peak:
            console.print(f"datasheet {name}: bf16 {peak['tflops']['bf16']} TFLOP/s, "
                          f"{peak['bandwidth_gbs']} GB/s ({peak['source']})")
        elif name.startswith("cpu"):
            console.print(f"datasheet {name}: none for CPUs; MFU uses a measured ceiling")
        else:
            console.print(f"datasheet {name}: not in the table; MFU uses a measured ceiling")
        ceiling = info["measured_ceilings"][name]
        if ceiling:
            flops = ", ".join(f"{k} {v / 1e12:.1f}" for k, v in ceiling["matmul_flops"].items())
            console.print(f"measured  {name}: {flops} TFLOP/s; copy {ceiling['bandwidth'] / 1e9:.0f} GB/s "
                          f"({ceiling['measured_at']})")
        else:
            console.print(f"measured  {name}: none yet (fitbench env --measure)")
    return 0


# ---- report ---------------------------------------------------------------------------------


def report(args: argparse.Namespace, cli_options: dict[str, Any]) -> int:
    """Show the results of a finished (or interrupted) sweep again, as a table or as Markdown."""
    from fitbench.results.report import markdown_report, results_table
    from fitbench.results.store import ResultStore

    store = ResultStore(args.directory)
    if not store.path.exists():
        raise UserError(f"report: {args.directory} has no {store.path.name}. Pass the --out directory of a "
                        f"`fitbench run`.")
    rows = list(store.rows())
    if args.markdown:
        print(markdown_report(rows), end="")
    else:
        console.print(results_table(rows, title=f"fitbench results: {args.directory}"))
    return 0


# ---- entry point ----------------------------------------------------------------------------

Command = Callable[[argparse.Namespace, dict[str, Any]], int]
COMMANDS: dict[str, tuple[Command, str]] = {
    "run": (run, "benchmark models: train, forward, forward-backward, infer"),
    "models": (models, "list the presets with exact parameter counts"),
    "report": (report, "show a results directory again, as a table or Markdown"),
    "env": (env, "versions, GPUs, peak FLOP/s; --measure stores this machine's ceilings"),
}


class _Parser(argparse.ArgumentParser):
    """Bad flags end like any other bad input: one paragraph on stderr, exit code 2."""

    def error(self, message: str):
        self.exit(UserError.exit_code, f"{self.prog}: {message}. `{self.prog} --help` lists the options.\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fitbench", description="Which models fit on these GPUs, how to run them, and how fast they go.",
    )
    parser.add_argument("--version", action="version", version=f"fitbench {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (function, summary) in COMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=function.__doc__,
                                  epilog=RUN_EXAMPLES if name == "run" else None,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.set_defaults(function=function)
        if name == "run":
            _add_run_options(sub)
        elif name == "models":
            sub.add_argument("--json", action="store_true", help="machine-readable output")
            sub.add_argument("--sources", action="store_true", help="print where each preset's numbers come from")
        elif name == "report":
            sub.add_argument("directory", metavar="DIR", help="the --out directory of a fitbench run")
            sub.add_argument("--markdown", action="store_true", help="print a Markdown table with provenance")
        elif name == "env":
            sub.add_argument("--json", action="store_true", help="machine-readable output")
            sub.add_argument("--measure", action="store_true",
                             help="measure the matmul and copy ceilings of the device and store them for MFU")
            sub.add_argument("--device", default="auto", help="device to measure (default: first GPU, else cpu)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["run", *argv])
    args.argv = argv
    options = {key: value for key, value in vars(args).items()
               if key not in ("command", "function", "resume", "config", "json", "sources", "measure", "argv",
                               "directory", "markdown")}
    if args.command == "env":
        options = {}
    try:
        return args.function(args, options)
    except UserError as error:
        errors.print(f"fitbench: {error}", soft_wrap=True)
        return UserError.exit_code
    except KeyboardInterrupt:
        errors.print("fitbench: interrupted; finished rows are saved, `fitbench run --resume <out>` goes on.")
        return 130
