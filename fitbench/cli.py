"""The ``fitbench`` command: parse, call a plain function, print. Commands live in ``COMMANDS``.

List options take space-separated values as users type them (``--models 1B 3B 7B``). Every
``run`` option is also a key of the YAML file given to ``--config``; the command line wins over
the file, the file over the defaults. Bad input ends in one paragraph on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from fitbench import __version__
from fitbench.errors import UserError, excerpt, excerpt_words
from fitbench.precisions import PRECISIONS
from fitbench.results.store import DISK_ERRORS
from fitbench.spec import MODES

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


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    S = argparse.SUPPRESS
    add = parser.add_argument
    add("--models", nargs="+", default=S, metavar="MODEL",
        help="presets (see `fitbench models`), local directories with a config.json, or hub ids")
    add("--mode", "--modes", dest="mode", nargs="+", choices=MODES, default=S, metavar="MODE",
        help="what a step does: train (forward, backward, AdamW), forward, forward-backward, infer "
             "(prefill + decode with a KV cache). Default: train infer")
    add("--pass-type", dest="pass_type", choices=("forward", "backward"), default=S,
        help="CS336 spelling: forward = --mode forward, backward = --mode forward-backward")
    add("--precision", nargs="+", choices=PRECISIONS, default=S, metavar="PRECISION",
        help="fp32, tf32, bf16/fp16 (autocast over fp32 weights), bf16-pure (bf16 weights and optimizer); "
             "quantized weights: int8 (LLM.int8), nf4, fp4 (bitsandbytes), int8-dynamic, int8-weight-only, int4, "
             "fp8, fp8-weight-only, fp8-block (torchao). Training: fp8 trains every weight with float8 matmuls; "
             "int8, nf4 and fp4 train low-rank adapters on the frozen quantized base (QLoRA); the other torchao "
             "ones do not train")
    add("--batch-size", dest="batch_size", nargs="+", type=_batch_size, default=S, metavar="N",
        help="sequences per step, or auto: the largest that runs, from the planner's prediction verified by "
             "probe runs (reported as max_batch)")
    add("--fallback", nargs="+", choices=PRECISIONS, default=S, metavar="PRECISION",
        help="on out-of-memory, retry with the next of these precisions, then activation checkpointing, then half "
             "the batch, and last, for infer and forward, with offload in the first floating-point one (default "
             "per mode: train bf16 bf16-pure; infer and forward bf16-pure int8 nf4); also the ladder the planner "
             "picks the first fitting precision from")
    add("--no-fallback", dest="no_fallback", action="store_true", default=S,
        help="record an out-of-memory as it is, without retrying")
    add("--offload", action="store_true", default=S,
        help="infer and forward with the decoder layers that do not fit on the GPU kept in host memory and "
             "streamed in for their forward (accelerate); on a CPU, the layers that do not fit in RAM go to disk. "
             "With --gpus N under FSDP: FSDP's CPU offload, each rank's shards, gradients and optimizer state "
             "in host memory")
    add("--seq-len", "--context-length", dest="seq_len", nargs="+", type=int, default=S, metavar="T",
        help="tokens per sequence; the prompt length in infer")
    add("--new-tokens", dest="new_tokens", type=int, default=S, metavar="N",
        help="tokens generated per sequence in infer (default 128 on a GPU, 32 on a CPU)")
    add("--backend", choices=("auto", "native", "hf"), default=S,
        help="native: fitbench's decoder (Llama-style models); hf: transformers (every family). Default auto")
    add("--compile", action="store_true", default=S, help="torch.compile the model; compile time is reported apart")
    add("--cuda-graphs", dest="cuda_graphs", action=argparse.BooleanOptionalAction, default=S,
        help="infer with the native backend on a GPU: replay each decode step from a CUDA graph captured in the "
             "first warm-up generation (default), or with --no-cuda-graphs launch its kernels one by one. The hf "
             "backend always decodes eagerly")
    add("--compile-decode", dest="compile_decode", action=argparse.BooleanOptionalAction, default=S,
        help="infer with the native backend on a GPU: compile the decode step and the prefill with inductor "
             "(once per shape, timed apart: the row's decode record) before the capture (default); "
             "--no-compile-decode captures the eager step. Where compiling fails the eager step runs and the "
             "decode record says why")
    add("--decode-tuning", dest="decode_tuning", action="store_true", default=S,
        help="with --compile-decode: tune the decode step's layer with inductor's coordinate descent (its "
             "compile only; a longer compile)")
    add("--activation-checkpointing", dest="activation_checkpointing", action="store_true", default=S,
        help="recompute each layer's activations in the backward pass (train, forward-backward)")
    add("--warmup-steps", dest="warmup_steps", type=int, default=S, metavar="N", help="untimed steps first (default 5)")
    add("--measure-steps", "--samples", dest="measure_steps", type=int, default=S, metavar="N",
        help="timed steps (generations in infer), default 10")
    add("--device", default=S, help="cpu, cuda or cuda:N (default: the first GPU if there is one, else cpu)")
    add("--gpus", type=int, default=S, metavar="N",
        help="run each configuration as one torchrun job of N ranks, one GPU each (on --device cpu, N CPU "
             "processes talking over gloo); default 1")
    add("--strategy", choices=("auto", "ddp", "fsdp", "tp", "pipeline", "replicas"), default=S,
        help="with --gpus N: ddp (a replica per GPU, gradients averaged), fsdp (weights, gradients and optimizer "
             "state sharded, FSDP2), tp (tensor parallelism: each layer's heads and MLP split over the GPUs, "
             "every mode, infer included), pipeline (consecutive decoder layers per GPU: the native backend "
             "trains and infers, one rank per stage; the hf backend runs infer and forward in one process over "
             "the GPUs), replicas (infer and forward: N independent copies, one per GPU, each with its own batch; "
             "tokens/s summed over them) or auto (default: among what fits and composes, the fastest forecast; "
             "without a plan, as on a CPU, DDP first)")
    add("--microbatches", type=int, default=S, metavar="N",
        help="with --strategy pipeline: microbatches of a training step, which must divide the batch (default: "
             "one per GPU)")
    add("--tp", type=int, default=S, metavar="N",
        help="2-D layouts: N tensor-parallel GPUs inside each FSDP group or pipeline stage, N dividing --gpus. "
             "--gpus 4 --strategy fsdp --tp 2: FSDP 2 x TP 2 (training); --gpus 4 --strategy pipeline --tp 2: "
             "2 stages of TP 2 (infer, forward); with --strategy tp, N is --gpus")
    add("--timeout", type=float, default=S, metavar="SECONDS",
        help="a configuration's whole life: its batch probes (--batch-size auto), fallback attempts and run "
             "together; past it the worker and all it started are killed and the row says timeout (default 3600)")
    add("--seed", type=int, default=S, help="seed of the random weights and tokens (default 0)")
    add("--out", default=S, metavar="DIR", help="results directory (default ./fitbench-results/<UTC time>)")
    add("--resume", metavar="DIR", default=None,
        help="continue the sweep in DIR: its saved settings apply, finished configurations are skipped; options "
             "that differ from the saved ones are refused (the difference is shown) unless --extend is given")
    add("--extend", action="store_true",
        help="with --resume: add the models, modes, precisions, batch sizes and sequence lengths given to the "
             "saved sweep (it becomes their product; what it had stays in it)")
    add("--config", metavar="FILE", default=None, help="YAML file with any of these options as keys")
    _add_analysis_options(parser, default=S)


def _add_plan_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--models", nargs="+", required=True, metavar="MODEL", help="presets, local directories or hub ids")
    add("--mode", "--modes", dest="mode", nargs="+", choices=MODES, default=["train"], help="default: train")
    add("--precision", nargs="+", choices=PRECISIONS, default=None, metavar="PRECISION",
        help="the precision ladder, in order of preference (default per mode: train bf16 bf16-pure; "
             "infer and forward bf16-pure int8 nf4)")
    add("--batch-size", dest="batch_size", nargs="+", type=_batch_size, default=[1], metavar="N",
        help="batch sizes, or auto for the largest predicted to fit (default 1)")
    add("--seq-len", "--context-length", dest="seq_len", type=int, default=512, metavar="T", help="default 512")
    add("--new-tokens", dest="new_tokens", type=int, default=128, metavar="N",
        help="generated tokens in infer (default 128)")
    add("--strategy", nargs="+", choices=("single", "ddp", "fsdp", "tp", "pipeline", "replicas"), default=None,
        help="limit the layouts considered (default: all that apply to the mode)")
    add("--gpus", type=int, default=None, help="how many GPUs to plan for (default: those detected)")
    add("--gpu-memory", dest="gpu_memory", default=None, metavar="SIZE", help="memory per GPU, e.g. 80GB or 79.2GiB")
    add("--gpu", default=None, metavar="NAME", help="a named GPU, e.g. H100-80GB, A100-40GB, L40S (sets memory and speed)")
    add("--trace", action="store_true", help="also trace the chosen plan on fake tensors (exact tensor peak)")
    add("--requirements", action="store_true", help="table of the fewest GPUs each model x precision needs")
    add("--json", action="store_true", help="machine-readable output, sizes in bytes")


def _batch_size(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {excerpt(text)}") from None


# ---- run ------------------------------------------------------------------------------------


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


def _warn(message: str) -> None:
    errors.print(f"fitbench: warning: {escape(message)}", soft_wrap=True)


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


def run(args: argparse.Namespace, cli_options: dict[str, Any]) -> int:
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
    device = resolve_device(config.device)
    check_ranks(device, config.gpus)
    specs = expand(config, device=device, default_models=default_models(device))
    check_output_directory(out, "--resume" if args.resume else "--out")
    target, calibration = run_target(device, say=lambda text: console.print(escape(text)), ranks=config.gpus)
    specs, predict, refusals = plan_specs(specs, config, target, calibration)
    refusals.update(hardware_refusals(specs, device))

    config = config.model_copy(update={"out": out})
    store = ResultStore(out, on_bad_line=_warn)
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
    write_documents(out, rows, ollama_url=config.ollama_url, ollama_model=config.ollama_model)
    failed = [row for row in rows if row["status"] != "ok"]
    if failed:
        listed = "; ".join(f"{escape(row.get('label') or row['key'])}: {escape(row['status'])}" for row in failed)
        console.print(f"{len(failed)} of {len(rows)} configuration(s) did not finish or gave invalid numbers "
                      f"({listed}); their rows say why (status, error) and the logs are in {out}/logs/.")
        return 1
    return 0


# ---- plan -----------------------------------------------------------------------------------

PLAN_EXAMPLES = """\
examples:
  fitbench plan --models llama-2-70b --mode infer --gpus 4 --gpu-memory 80GB
  fitbench plan --models 7B 13B --mode train --gpu H100-80GB --batch-size auto
  fitbench plan --models small --mode train --batch-size 4 --seq-len 512 --gpu H100-80GB --trace
  fitbench plan --models 7B 13B 70B --gpu-memory 80GB --requirements
Without --gpus/--gpu-memory/--gpu the GPUs of this machine are used.
"""


# Bounds of what a plan can describe: beyond them a number is a typo, and sizes stop being finite floats.
GPU_MEMORY_MAX = 1e14
GPU_MEMORY_MIN = 1e9
GPUS_MAX = 65536


def gpu_target(args: argparse.Namespace):
    """The GPUs to plan for: described on the command line, else detected."""
    from fitbench import hardware
    from fitbench.plan.planner import GPU_ALIASES, GpuTarget
    from fitbench.units import parse_bytes

    for option, value in (("--gpu", args.gpu), ("--gpu-memory", args.gpu_memory)):
        if value is not None and not value.strip():
            raise UserError(f"{option[2:]}: {option} was given an empty value; give it like "
                            f"{'H100-80GB' if option == '--gpu' else '80GB'}, or leave it out.")
    if args.gpus is not None and not 0 < args.gpus <= GPUS_MAX:
        raise UserError(f"gpus: must be a number of GPUs from 1 to {GPUS_MAX:,}, got {excerpt(args.gpus)} (--gpus).")
    if args.gpu and args.gpu_memory:
        raise UserError(f"--gpu and --gpu-memory contradict: --gpu {excerpt(args.gpu)} sets the memory per GPU "
                        f"from its datasheet; give --gpu for a known GPU, or --gpu-memory to describe another.")
    name = None
    if args.gpu:
        name = GPU_ALIASES.get(args.gpu.upper(), args.gpu)
        if hardware.gpu_spec(name) is None:
            raise UserError(f"gpu: {excerpt(args.gpu)} is not a known GPU. Known: {', '.join(GPU_ALIASES)} (or an exact "
                            f"device name such as 'NVIDIA H100 80GB HBM3'); or describe it with --gpu-memory.")
    memory, source = None, None
    if args.gpu_memory:
        try:
            memory, source = parse_bytes(args.gpu_memory), "--gpu-memory"
        except ValueError:
            raise UserError(f"gpu-memory: {excerpt(args.gpu_memory)} is not a size; write it like 80GB or "
                            f"79.2GiB.") from None
        if not math.isfinite(memory) or not GPU_MEMORY_MIN <= memory <= GPU_MEMORY_MAX:
            raise UserError(f"gpu-memory: {excerpt(args.gpu_memory)} is not a GPU's memory; give a size from "
                            f"{GPU_MEMORY_MIN / 1e9:.0f} GB to {GPU_MEMORY_MAX / 1e12:.0f} TB with its unit, like 80GB "
                            f"or 79.2GiB (a bare number is bytes).")
    if name is None and memory is None and args.gpus is None:
        detected = hardware.detect_gpus()  # only then: detecting imports torch, seconds a described GPU never needs
        if not detected:
            raise UserError("gpus: no GPU is visible here; describe the hardware to plan for, e.g. "
                            "--gpus 4 --gpu-memory 80GB, or --gpu H100-80GB.")
        return GpuTarget(detected[0].name, len(detected), float(detected[0].total_memory), described=False,
                         memory_source="torch.cuda.get_device_properties().total_memory")
    if memory is None:
        if name is None:
            raise UserError("gpu-memory: with --gpus, say how much memory each GPU has (--gpu-memory 80GB) "
                            "or which GPU it is (--gpu H100-80GB).")
        spec = hardware.gpu_spec(name)
        memory, source = spec.total_memory, spec.total_memory_source
    return GpuTarget(name, 1 if args.gpus is None else args.gpus, memory, described=True, memory_source=source)


def _plan_text(result, trace) -> None:
    from fitbench.units import format_bytes

    target = result.target
    where = f"{target.count} x {format_bytes(target.memory)}" + (f" {target.name}" if target.name else "")
    console.print(f"[bold]{escape(result.model)}[/bold] {result.mode} on {where}"
                  f" ({'described' if target.described else 'detected'}); overheads: {escape(result.calibration)}")
    if target.memory_source:
        console.print(f"memory per GPU: {escape(target.memory_source)}")
    chosen = result.chosen
    if chosen is None and not result.rejected:
        console.print("[red]nothing to plan[/red]: no layout of these GPUs uses only the strategies named by "
                      "--strategy (single is one GPU; ddp and fsdp need two or more; tp and pipeline two or more); "
                      "name others or change --gpus.")
    elif chosen is None:
        console.print("[red]nothing fits[/red]: every candidate was rejected.")
    else:
        speed = chosen.speed
        console.print(f"chosen: [green]{escape(chosen.candidate.label)}[/green]: {format_bytes(chosen.predicted_peak)}"
                      f" per GPU, forecast {chosen.forecast_tokens_per_s:,.0f} tokens/s over its GPUs; roofline "
                      f"{speed.tokens_per_s:,.0f} tokens/s ({speed.bound}-bound, {speed.seconds * 1e3:.1f} ms per "
                      f"{'decode step' if result.mode == 'infer' else 'step'})")
        stage = f" on {chosen.memory.stage.label}, the largest" if chosen.memory.stage else ""
        table = Table(title_justify="left", title=f"per-GPU memory, peak at the {chosen.peak_moment}{stage}")
        for column in ("term", "bytes", "at peak", "formula / source"):
            table.add_column(column, justify="right" if column == "bytes" else "left")
        for term in chosen.memory.terms:
            alive = term.moments is None or chosen.peak_moment in term.moments
            table.add_row(term.name, format_bytes(term.bytes), "yes" if alive else "",
                          escape(term.formula))
        for term in chosen.overheads:
            table.add_row(term.name, format_bytes(term.bytes), "yes", escape(term.formula))
        table.add_row("[bold]predicted peak[/bold]", f"[bold]{format_bytes(chosen.predicted_peak)}[/bold]", "", "")
        console.print(table)
        if trace is not None:
            gap = 100 * (chosen.memory.peak_bytes - trace.peak_bytes) / trace.peak_bytes
            console.print(f"traced peak (fake tensors on {trace.device}): {format_bytes(trace.peak_bytes)} of tensors; "
                          f"analytic {format_bytes(chosen.memory.peak_bytes)} ({gap:+.1f}%)")
    for other in result.feasible[1:4]:
        edge = "" if other.clear else " (within the allocator-retry margin)"
        console.print(f"  also fits: {escape(other.candidate.label)}: {format_bytes(other.predicted_peak)}{edge}, "
                      f"forecast {other.forecast_tokens_per_s:,.0f} tokens/s")
    shown = result.rejected[:8]
    for rejected in shown:
        console.print(f"  rejected: {escape(rejected.reason)}")
    if len(result.rejected) > len(shown):
        console.print(f"  ... {len(result.rejected) - len(shown)} more rejected (--json lists all)")
    for note in result.notes:
        console.print(f"  note: {note}")
    console.print()


def plan(args: argparse.Namespace, cli_options: dict[str, Any]) -> int:
    """Predict per-GPU memory term by term and choose how to run each model; no GPU needed."""
    from fitbench.config import check_context, merge_sources
    from fitbench.models.registry import resolve
    from fitbench.plan.calibration import load_calibration
    from fitbench.plan.planner import fewest_gpus
    from fitbench.plan.planner import plan as make_plan
    from fitbench.precisions import TRAINING_MODES, training_problem

    shapes = merge_sources({}, {}, {"batch_size": args.batch_size, "seq_len": [args.seq_len],
                                    "new_tokens": args.new_tokens, "models": args.models})
    if "auto" in shapes.batch_size and len(shapes.batch_size) > 1:
        raise UserError("batch_size: auto finds the largest batch that fits; give it alone, or list batch sizes.")
    batch = None if shapes.batch_size == ["auto"] else shapes.batch_size
    seq_len, new_tokens = args.seq_len, args.new_tokens
    for mode in args.mode:  # as `run` refuses them: no precision of the ladder can train
        if mode in TRAINING_MODES and args.precision and all(training_problem(p) for p in args.precision):
            raise UserError(f"precision: {training_problem(args.precision[0])}; or use --mode infer or forward with "
                            f"{args.precision[0]}.")
    target = gpu_target(args)
    calibration = load_calibration(target.name)
    architectures = {name: resolve(name) for name in args.models}
    for name, arch in architectures.items():
        for mode in args.mode:
            check_context(arch, mode, seq_len, new_tokens)
    if args.requirements:
        return _requirements(args, target, calibration, seq_len, new_tokens, batch, fewest_gpus)
    results, outputs = [], []
    for name, arch in architectures.items():
        for mode in args.mode:
            result = make_plan(arch, mode, target, seq_len=seq_len, new_tokens=new_tokens, batch_sizes=batch,
                               precisions=args.precision, strategies=args.strategy, calibration=calibration)
            trace = None
            if args.trace and result.chosen and result.chosen.candidate.gpus == 1:
                from fitbench.models.architecture import default_backend
                from fitbench.run.trace import trace_peak

                chosen = result.chosen.candidate
                trace = trace_peak(arch, mode, chosen.precision, chosen.batch_size, seq_len, new_tokens=new_tokens,
                                   activation_checkpointing=chosen.activation_checkpointing,
                                   backend=default_backend(arch))
            results.append((result, trace))
            outputs.append({**result.as_dict(), "trace": trace.__dict__ if trace else None})
    if args.json:
        print(json.dumps(outputs if len(outputs) > 1 else outputs[0], indent=2, default=str))
    else:
        for result, trace in results:
            _plan_text(result, trace)
    return 0


def _requirements(args, target, calibration, seq_len, new_tokens, batch, fewest_gpus) -> int:
    from fitbench.models.registry import resolve
    from fitbench.plan.planner import DEFAULT_LADDER
    from fitbench.units import format_bytes

    rows = []
    for name in args.models:
        arch = resolve(name)
        for mode in args.mode:
            for precision in args.precision or DEFAULT_LADDER[mode]:
                need = fewest_gpus(arch, mode, precision, target.memory, seq_len=seq_len, new_tokens=new_tokens,
                                   batch_size=(batch or [1])[0], calibration=calibration, gpu_name=target.name)
                stage = need.memory.stage if need else None
                rows.append({"model": name, "mode": mode, "precision": precision,
                             "min_gpus": need.candidate.gpus if need else None,
                             "how": need.candidate.label if need else "more than 64",
                             "layout": need.candidate.layout.model_dump() if need else None,
                             "peak_per_gpu_bytes": need.predicted_peak if need else None,
                             "peak_stage": stage.label if stage else None})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title=f"GPUs of {format_bytes(target.memory)} needed (batch {(batch or [1])[0]}, seq {seq_len})",
                  title_justify="left")
    for column in ("model", "mode", "precision", "min GPUs", "how", "peak per GPU"):
        table.add_column(column)
    for row in rows:
        peak = format_bytes(row["peak_per_gpu_bytes"]) if row["peak_per_gpu_bytes"] else "-"
        if row["peak_stage"]:
            peak += f" ({row['peak_stage'].split(' (')[0]})"
        table.add_row(row["model"], row["mode"], row["precision"], str(row["min_gpus"] or "-"), escape(row["how"]),
                      peak)
    console.print(table)
    return 0


# ---- calibrate ------------------------------------------------------------------------------


def calibrate(args: argparse.Namespace, cli_options: dict[str, Any]) -> int:
    """Measure this GPU's CUDA context and cuBLAS workspace, and with several GPUs the all-reduce's and
    all-gather's bus bandwidth and latency, and store them for the planner."""
    from fitbench.launch.calibrate import measure_bus_bandwidth, measure_calibration, with_bus_bandwidth
    from fitbench.plan.calibration import save_calibration
    import os

    import torch

    from fitbench.sweep import bus_figures, calibration_figures, resolve_device

    device = resolve_device(args.device)
    if device == "cpu" and args.gpus is None:
        raise UserError("device: calibration measures GPU overheads; run it where a GPU is visible (on a CPU, "
                        "--gpus 2 or more measures the bus bandwidth of that many processes over gloo, to try it).")
    # on a CPU, one process per core at most
    low, high, what = (2, max(2, os.cpu_count() or 2), "CPU cores") if device == "cpu" else (
        1, torch.cuda.device_count(), "GPUs visible")
    gpus = high if args.gpus is None else args.gpus
    if not low <= gpus <= high:
        raise UserError(f"gpus: {excerpt(gpus)} to measure; give {low} to {high} (the {what}).")
    with tempfile.TemporaryDirectory(prefix="fitbench-calibrate-") as scratch:
        if device == "cpu":
            console.print(f"measuring the bus bandwidth of {gpus} CPU processes over gloo ...")
            bus = measure_bus_bandwidth(gpus, device, Path(scratch))
            console.print(f"{bus_figures(bus)}; nothing stored: the planner plans GPUs")
            return 0
        console.print(f"calibrating {device}: tiny training, generating and in a forward pass, in fresh processes ...")
        calibration = measure_calibration(device, Path(scratch))
        if gpus > 1:
            console.print(f"measuring all-reduce and all-gather over {gpus} GPUs, one process each ...")
            calibration = with_bus_bandwidth(calibration, measure_bus_bandwidth(gpus, device, Path(scratch)))
    path = save_calibration(torch.cuda.get_device_name(torch.device(device)), calibration)
    console.print(f"{calibration_figures(calibration)}; stored in {path}")
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
        from fitbench.sweep import resolve_device

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
    """Show the results of a finished (or interrupted) sweep again, as a table or as Markdown; with
    ``--csv``, also write its results.csv again from results.jsonl (committed results keep only the rows)."""
    from fitbench.results.report import markdown_report, results_table, write_csv
    from fitbench.results.store import ResultStore

    if not args.directory.strip():
        raise UserError("report: the directory was given as an empty path; pass the --out directory of a "
                        "`fitbench run`.")
    store = ResultStore(args.directory, on_bad_line=_warn)
    if store.directory.is_file():
        raise UserError(f"report: {excerpt(args.directory, 200)} is a file; pass the --out directory of a "
                        f"`fitbench run` (it holds {store.path.name}).")
    if not store.path.exists():
        raise UserError(f"report: {args.directory} has no {store.path.name}. Pass the --out directory of a "
                        f"`fitbench run`.")
    rows = list(store.rows())
    if args.markdown:
        print(markdown_report(rows), end="")
    else:
        console.print(results_table(rows, title=f"fitbench results: {args.directory}"))
    if args.csv:
        print(f"table: {write_csv(rows, store.directory)}", file=sys.stderr if args.markdown else sys.stdout)
    write_documents(args.directory, rows, args.html, args.xlsx, args.ollama_url, args.ollama_model)
    return 0


# ---- report documents: HTML, Excel, analysis through Ollama, compare ---------------------------


def _add_analysis_options(parser: argparse.ArgumentParser, default: Any = None) -> None:
    parser.add_argument("--ollama-url", dest="ollama_url", default=default, metavar="URL",
                        help="an Ollama server that writes a short analysis of the rows into analysis.md and the "
                             "HTML report, e.g. http://localhost:11434 (default with --ollama-model)")
    parser.add_argument("--ollama-model", dest="ollama_model", default=default, metavar="MODEL",
                        help="the model it runs, e.g. gpt-oss-20b; a server or model that does not answer is a "
                             "warning, and the report is written without an analysis")


def write_documents(directory: str, rows: list[dict[str, Any]], html: str | None = None, xlsx: str | None = None,
                    ollama_url: str | None = None, ollama_model: str | None = None) -> None:
    """The analysis, HTML report and workbook of the sweep in ``directory`` that the options ask for."""
    from fitbench.report.analysis import analyse, check_url, write_analysis

    text = None
    if ollama_url is not None or ollama_model is not None:
        if not ollama_model:
            raise UserError("ollama-model: --ollama-url needs --ollama-model, the model that writes the analysis "
                            "(e.g. gpt-oss-20b).")
        url = check_url(ollama_url if ollama_url is not None else "http://localhost:11434")
        console.print(f"asking {escape(ollama_model)} at {escape(url)} for an analysis ...")
        analysis = analyse(rows, url, ollama_model)
        if analysis.warning:
            _warn(analysis.warning)
        else:
            text = analysis.text
            console.print(f"analysis: {write_analysis(analysis, directory, ollama_model)}")
    if html:
        from fitbench.report.html import write_html

        console.print(f"html: {write_html(directory, html, text)}")
    if xlsx:
        from fitbench.report.excel import write_xlsx

        console.print(f"xlsx: {write_xlsx(directory, xlsx)}")


def compare(args: argparse.Namespace, cli_options: dict[str, Any]) -> int:
    """Compare sweep B with sweep A configuration by configuration: the change of the mean time with a
    bootstrap confidence interval, tokens/s and peak memory; with --fail-on, exit 1 when a change
    crosses the gate, for CI."""
    from fitbench.report.compare import compare_sweeps
    from fitbench.report.html import write_comparison_html

    comparison = compare_sweeps(args.a, args.b, fail_on=args.fail_on)
    for side, sweep in (("A", comparison.a), ("B", comparison.b)):
        for warning in sweep.warnings:
            _warn(f"{side}: {warning}")
    for line in comparison.lines():
        console.print(escape(line), soft_wrap=True)
    if args.html:
        console.print(f"html: {write_comparison_html(comparison, args.html)}")
    return 1 if comparison.failed else 0


# ---- entry point ----------------------------------------------------------------------------

Command = Callable[[argparse.Namespace, dict[str, Any]], int]
COMMANDS: dict[str, tuple[Command, str]] = {
    "run": (run, "benchmark models: train, forward, forward-backward, infer"),
    "models": (models, "list the presets with exact parameter counts"),
    "plan": (plan, "predict per-GPU memory and choose precision, sharding and batch (no GPU needed)"),
    "calibrate": (calibrate, "measure this GPU's constant overheads for the planner"),
    "report": (report, "show a results directory again, as a table or Markdown"),
    "compare": (compare, "compare two results directories; --fail-on gates on a regression"),
    "env": (env, "versions, GPUs, peak FLOP/s; --measure stores this machine's ceilings"),
}


# A value that starts with a minus: argparse takes only -5 and -2.5 for values, and calls -inf, -1e3 or
# -80GB an unknown option, so the option's own check (and its message) never sees them. No fitbench
# option is spelled like a number.
_NEGATIVE_VALUE = re.compile(r"-(\.?\d|inf|nan)", re.IGNORECASE)


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {excerpt(text)}") from None


def _real(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {excerpt(text)}") from None


class _Parser(argparse.ArgumentParser):
    """Bad flags end like any other bad input: one paragraph on stderr, exit code 2, quoting the
    input short (argparse's own messages repeat it whole)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("type", int, _whole)
        self.register("type", float, _real)

    def error(self, message: str):
        message = excerpt_words(message)
        self.exit(UserError.exit_code, f"{self.prog}: {message}. `{self.prog} --help` lists the options.\n")

    def _parse_optional(self, arg_string: str):
        if _NEGATIVE_VALUE.match(arg_string) and arg_string not in self._option_string_actions:
            return None  # a value, for the option before it
        return super()._parse_optional(arg_string)


# Two spellings of one option: argparse keeps the last one given, so both together say two things.
_SPELLINGS = (("--seq-len", "--context-length"), ("--measure-steps", "--samples"), ("--mode", "--modes"))
# A switch and its negation: argparse keeps the last one given.
_OPPOSITES = (("--cuda-graphs", "--no-cuda-graphs"), ("--compile-decode", "--no-compile-decode"))


def _one_spelling(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    for first, second in _SPELLINGS:
        if first in given and second in given:
            parser.error(f"{first} and {second} are one option given twice; give only one of them")
    for first, second in _OPPOSITES:
        if first in given and second in given:
            parser.error(f"{first} and {second} contradict; give one of them")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fitbench", description="Which models fit on these GPUs, how to run them, and how fast they go.",
    )
    parser.add_argument("--version", action="version", version=f"fitbench {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (function, summary) in COMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=function.__doc__,
                                  epilog={"run": RUN_EXAMPLES, "plan": PLAN_EXAMPLES}.get(name),
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.set_defaults(function=function)
        if name == "run":
            _add_run_options(sub)
        elif name == "models":
            sub.add_argument("--json", action="store_true", help="machine-readable output")
            sub.add_argument("--sources", action="store_true", help="print where each preset's numbers come from")
        elif name == "plan":
            _add_plan_options(sub)
        elif name == "calibrate":
            sub.add_argument("--device", default="auto", help="GPU to measure (default: the first)")
            sub.add_argument("--gpus", type=int, default=None,
                             help="GPUs for the all-reduce's and all-gather's bus bandwidth and latency (default: all visible; on "
                                  "--device cpu, that many processes over gloo)")
        elif name == "report":
            sub.add_argument("directory", metavar="DIR", help="the --out directory of a fitbench run")
            sub.add_argument("--markdown", action="store_true", help="print a Markdown table with provenance")
            sub.add_argument("--csv", action="store_true",
                             help="also write DIR/results.csv from the rows, as `fitbench run` writes it")
            sub.add_argument("--html", metavar="FILE", help="write a self-contained HTML report with plots")
            sub.add_argument("--xlsx", metavar="FILE", help="write an Excel workbook: a sheet per mode, provenance, samples")
            _add_analysis_options(sub)
        elif name == "compare":
            sub.add_argument("a", metavar="A", help="the --out directory of the run compared against (before)")
            sub.add_argument("b", metavar="B", help="the --out directory of the run compared (after)")
            sub.add_argument("--fail-on", dest="fail_on", metavar="FIGURE:PERCENT",
                             help="exit 1 when a configuration got worse by more than PERCENT: mean:5%% (the mean time, "
                                  "slower beyond its noise), memory:5%% (peak memory); or is no longer ok")
            sub.add_argument("--html", metavar="FILE", help="write the comparison as a self-contained HTML page")
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
    _one_spelling(parser, argv)
    options = {key: value for key, value in vars(args).items()
               if key not in ("command", "function", "resume", "extend", "config", "json", "sources", "measure",
                               "argv", "directory", "markdown", "csv", "html", "xlsx", "a", "b", "fail_on")}
    if args.command != "run":
        options = {}
    try:
        return args.function(args, options)
    except UserError as error:
        errors.print(f"fitbench: {escape(str(error))}", soft_wrap=True)
        return UserError.exit_code
    except OSError as error:
        if error.errno not in DISK_ERRORS:
            raise
        errors.print(f"fitbench: out: writing {escape(str(error.filename or 'a file'))} failed: {error.strerror}. "
                     f"Rows already written are intact; make room and `fitbench run --resume <its --out directory>` "
                     f"finishes the sweep.", soft_wrap=True)
        return UserError.exit_code
    except KeyboardInterrupt as interruption:
        try:
            errors.print(f"fitbench: {str(interruption) or 'interrupted by SIGINT'}; finished rows are saved, "
                         f"`fitbench run --resume <out>` goes on.")
        except OSError:  # the terminal went with a hangup
            pass
        return 130
