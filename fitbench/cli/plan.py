"""``fitbench plan``: predict per-GPU memory term by term and choose how to run each model; no GPU needed."""

from __future__ import annotations

import argparse
import json
import sys

from rich.markup import escape
from rich.table import Table

from fitbench.cli.command import Command
from fitbench.api import DEFAULT_NEW_TOKENS
from fitbench.cli.console import console, warn
from fitbench.cli.options import plan_options

PLAN_EXAMPLES = """\
examples:
  fitbench plan --models llama-2-70b --mode infer --gpus 4 --gpu-memory 80GB
  fitbench plan --models 7B 13B --mode train --gpu H100-80GB --batch-size auto
  fitbench plan --models small --mode train --batch-size 4 --seq-len 512 --gpu H100-80GB --trace
  fitbench plan --models 7B 13B 70B --gpu-memory 80GB --requirements
  fitbench plan --models 7B --mode infer --gpu H100-80GB --preregister forecasts.json
  fitbench plan --models falcon-40b --mode infer --precision nf4 --gpu-memory 80GB --backend native
Without --gpus/--gpu-memory/--gpu the GPUs of this machine are used.
"""


def _plan_text(result, trace, ladder, margin, gpu_memory) -> None:
    from fitbench.planning.explain import grouped_rejections, marketed_memory_note, why_chosen
    from fitbench.util.units import format_bytes

    target = result.target
    where = f"{target.count} x {format_bytes(target.memory)}" + (f" {target.name}" if target.name else "")
    console.print(f"[bold]{escape(result.model)}[/bold] {result.mode} ({result.backend} build) on {where}"
                  f" ({'described' if target.described else 'detected'}); overheads: {escape(result.calibration)}")
    if target.memory_source:
        console.print(f"memory per GPU: {escape(target.memory_source)}")
    marketed = marketed_memory_note(gpu_memory, target.memory)
    if marketed:
        console.print(f"note: {escape(marketed)}")
    if result.inter_node_link:
        console.print(f"nodes of {target.node_gpus} GPUs; between nodes: {escape(result.inter_node_link)}")
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
        console.print(escape(why_chosen(result, ladder, margin)))
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
    reasons = grouped_rejections(result.rejected)
    for reason in reasons[:8]:
        console.print(f"  rejected: {escape(reason)}")
    if len(reasons) > 8:
        console.print(f"  ... {len(reasons) - 8} more reasons (--json lists every candidate)")
    for note in result.notes:
        console.print(f"  note: {note}")
    console.print()


def plan(args: argparse.Namespace) -> int:
    """Predict per-GPU memory term by term and choose how to run each model; no GPU needed."""
    from fitbench.api import plan as plan_model
    from fitbench.api import plan_batches, plan_target
    from fitbench.config import merge_sources
    from fitbench.inert_options import Asked, refuse_inert

    # The values first, as `run` checks them, then what they change.
    shapes = merge_sources({}, {}, {"batch_size": args.batch_size, "seq_len": [args.seq_len],
                                    "new_tokens": args.new_tokens or DEFAULT_NEW_TOKENS, "models": args.models})
    options = vars(args)
    refuse_inert(Asked(options, frozenset(name for name, value in options.items() if value not in (None, False)),
                       "plan"))
    where = {"gpu": args.gpu, "gpu_memory": args.gpu_memory, "gpus": args.gpus, "gpus_per_node": args.gpus_per_node,
             "nodes": args.nodes, "inter_node_bandwidth": args.inter_node_bandwidth}
    if args.requirements:
        return _requirements(args, plan_target(**where), plan_batches(shapes.batch_size))
    results, outputs = [], []
    for name in args.models:
        for mode in args.mode:
            result = plan_model(name, mode, **where, precisions=args.precision, batch_sizes=args.batch_size,
                                seq_len=args.seq_len, new_tokens=args.new_tokens if mode == "infer" else None,
                                strategies=args.strategy, backend=args.backend)
            trace = None
            if args.trace and result.chosen and result.chosen.candidate.gpus > 1:
                warn(f"trace: --trace traces a plan of one GPU on fake tensors, and the plan chosen for "
                     f"{result.model} {mode} uses {result.chosen.candidate.gpus}; it is not traced.")
            if args.trace and result.chosen and result.chosen.candidate.gpus == 1:
                from fitbench.models.registry import resolve
                from fitbench.worker.trace import trace_peak

                arch, chosen = resolve(name), result.chosen.candidate
                trace = trace_peak(arch, mode, chosen.precision, chosen.batch_size, args.seq_len,
                                   new_tokens=args.new_tokens or DEFAULT_NEW_TOKENS,
                                   activation_checkpointing=chosen.activation_checkpointing,
                                   checkpointed_layers=chosen.checkpointed_layers, backend=result.backend)
            results.append((result, trace))
            outputs.append({**result.as_dict(), "trace": trace.__dict__ if trace else None})
    if args.preregister:
        registered = _preregister(args, [result for result, _ in results])
        print(f"registered {registered} forecast(s) in {args.preregister}", file=sys.stderr)
    if args.json:
        print(json.dumps(outputs, indent=2, default=str))
    else:
        from fitbench.planning.calibration import load_calibration
        from fitbench.planning.planner import retry_margin
        from fitbench.precisions import DEFAULT_LADDER

        for result, trace in results:
            margin = retry_margin(load_calibration(result.target.name))
            _plan_text(result, trace, args.precision or DEFAULT_LADDER[result.mode], margin, args.gpu_memory)
            if args.gpus_per_node and result.chosen is not None:
                console.print("\n".join(sbatch_lines_for(result.model, result.chosen.candidate.gpus,
                                                          args.gpus_per_node)) + "\n", markup=False, highlight=False)
    return 1 if any(result.chosen is None for result, _ in results) else 0


def _preregister(args: argparse.Namespace, results: list) -> int:
    """Write the chosen configuration of each plan with its forecasts to ``--preregister``'s file
    (``fitbench.results.preregistration``); how many were written (a plan that chose nothing has none)."""
    from fitbench.results.preregistration import registration, write_registrations

    registrations = []
    for result in results:
        if result.chosen is None:
            continue
        candidate = result.chosen.candidate
        configuration = {"model": result.model, "mode": result.mode, "precision": candidate.precision,
                         "batch_size": candidate.batch_size, "seq_len": args.seq_len, "new_tokens": args.new_tokens,
                         "activation_checkpointing": candidate.activation_checkpointing,
                         "checkpointed_layers": candidate.checkpointed_layers, "compile": candidate.compiled,
                         "layout": candidate.layout.model_dump(), "backend": result.backend}
        registrations.append(registration(configuration, result.target.name, candidate.gpus,
                                          result.chosen.predicted_peak, result.chosen.forecast_tokens_per_s,
                                          "fitbench " + " ".join(getattr(args, "argv", []) or [])))
    write_registrations(args.preregister, registrations)
    return len(registrations)


def nodes_for(gpus: int, gpus_per_node: int) -> int:
    """Nodes of ``gpus_per_node`` GPUs that hold ``gpus`` GPUs."""
    return -(-gpus // gpus_per_node)


def sbatch_lines_for(model: str, gpus: int, gpus_per_node: int) -> list[str]:
    """The ``#SBATCH`` lines of a job of ``gpus`` GPUs on nodes of ``gpus_per_node``, the same count
    used on each (the planner plans only such counts: ``fitbench.planning.nodes.placement_problem``), as the
    slurm launcher writes them (``fitbench.launch.slurm.script.sbatch_lines``)."""
    from fitbench.launch.slurm.options import SlurmOptions
    from fitbench.launch.slurm.script import ScriptJob, sbatch_lines

    nodes = nodes_for(gpus, gpus_per_node)
    options = SlurmOptions(nodes=nodes, gpus_per_node=gpus // nodes)
    return [f"# {model}: {gpus} GPU(s) over {nodes} node(s), {gpus // nodes} of {gpus_per_node} on each",
            *sbatch_lines(options, ScriptJob(f"fitbench-{model}", "fitbench-%j.out"))]


def _requirements(args, target, batch) -> int:
    from fitbench.api import plannable
    from fitbench.planning.calibration import load_calibration
    from fitbench.planning.explain import requirements_note
    from fitbench.planning.planner import MOST_GPUS, fewest_gpus, retry_margin, unsplittable
    from fitbench.precisions import DEFAULT_LADDER
    from fitbench.util.units import format_bytes

    seq_len, new_tokens = args.seq_len, args.new_tokens or DEFAULT_NEW_TOKENS
    calibration = load_calibration(target.name)
    backend = None if args.backend in (None, "auto") else args.backend
    architectures = {(name, mode): plannable(name, mode, args.precision, seq_len, new_tokens)
                     for name in args.models for mode in args.mode}
    rows = []
    for name in args.models:
        for mode in args.mode:
            arch = architectures[name, mode]
            for precision in args.precision or DEFAULT_LADDER[mode]:
                need = fewest_gpus(arch, mode, precision, target.memory, seq_len=seq_len, new_tokens=new_tokens,
                                   batch_size=(batch or [1])[0], calibration=calibration, gpu_name=target.name,
                                   node_gpus=target.node_gpus, inter_node_bandwidth=target.inter_node_bandwidth,
                                   backend=backend)
                clear = need if need is None or need.clear else fewest_gpus(
                    arch, mode, precision, target.memory, seq_len=seq_len, new_tokens=new_tokens,
                    batch_size=(batch or [1])[0], calibration=calibration, gpu_name=target.name,
                    node_gpus=target.node_gpus, inter_node_bandwidth=target.inter_node_bandwidth, clear_only=True,
                    backend=backend)
                stage = need.memory.stage if need else None
                rows.append({"model": name, "mode": mode, "precision": precision,
                             "min_gpus": need.candidate.gpus if need else None,
                             "how": need.candidate.label if need else
                             (unsplittable(arch, mode, precision, MOST_GPUS, target.node_gpus) or
                              f"more than {MOST_GPUS}"),
                             "layout": need.candidate.layout.model_dump() if need else None,
                             "peak_per_gpu_bytes": need.predicted_peak if need else None,
                             "clear_of_retry_margin": need.clear if need else None,
                             # where it fits only inside the margin: the fewest on which `plan` keeps it
                             "min_gpus_clear_of_retry_margin": clear.candidate.gpus if clear else None,
                             "how_clear_of_retry_margin": clear.candidate.label if clear else None,
                             "peak_stage": stage.label if stage else None})
                if args.gpus_per_node and need:
                    nodes = nodes_for(need.candidate.gpus, args.gpus_per_node)
                    rows[-1].update(min_nodes=nodes, gpus_per_node_used=need.candidate.gpus // nodes,
                                    sbatch=sbatch_lines_for(name, need.candidate.gpus, args.gpus_per_node)[1:])
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title=f"GPUs of {format_bytes(target.memory)} needed (batch {(batch or [1])[0]}, seq {seq_len})",
                  title_justify="left")
    nodes = ["min nodes", "GPUs used per node"] if args.gpus_per_node else []
    edge = any(row["clear_of_retry_margin"] is False for row in rows)
    for column in ("model", "mode", "precision", *nodes, "min GPUs", "how", "peak per GPU",
                   *(["min GPUs clear of margin"] if edge else [])):
        table.add_column(column)
    for row in rows:
        peak = format_bytes(row["peak_per_gpu_bytes"]) if row["peak_per_gpu_bytes"] else "-"
        if row["peak_stage"]:
            peak += f" ({row['peak_stage'].split(' (')[0]})"
        if row["clear_of_retry_margin"] is False:
            peak += " *"
        counted = ([str(row["min_nodes"]), f"{row['gpus_per_node_used']} of {args.gpus_per_node}"]
                   if row.get("min_nodes") else ["-", "-"]) if nodes else []
        clear = ([str(row["min_gpus_clear_of_retry_margin"] or f"more than {MOST_GPUS}")
                  if row["clear_of_retry_margin"] is False else ""] if edge else [])
        table.add_row(row["model"], row["mode"], row["precision"], *counted, str(row["min_gpus"] or "-"),
                      escape(row["how"]), peak, *clear)
    console.print(table)
    note = requirements_note(rows, retry_margin(calibration), target.memory, args.gpu_memory)
    if note:
        console.print(escape(note))
    for row in rows:
        if row.get("sbatch"):
            console.print("\n".join([f"# {row['model']} {row['mode']} {row['precision']}: {row['min_gpus']} GPU(s)",
                                     *row["sbatch"]]), markup=False, highlight=False)
    return 0


COMMAND = Command("plan", "predict per-GPU memory and choose precision, sharding and batch (no GPU needed)", plan,
                  (plan_options,), PLAN_EXAMPLES)
