"""The plots of the HTML report, as plotly figures made from a report's rows.

Each function returns a figure, or None when the rows hold nothing it could plot (no row of
several GPUs, no fallback, no decode), so the page has no empty plot. Every figure is a function of
the rows alone; what a figure shows is said in ``FIGURES``, beside it on the page:

- size: tokens/s and MFU (``headline``; the prefill's in ``infer``) against the parameter count, a
  line only between rows that differ in the model alone (``varying``), else points; no plot
  without two sizes;
- memory: the measured peak of every GPU of every row (NVML's per-process figure, else the
  allocator's reserved peak: ``gpu_peak``) against the planner's prediction per GPU, with the line
  where they are equal; and the planner's terms of one row, chosen in the figure;
- timeline: the parent's NVML samples (``fitbench.monitor.nvml``) of one row's GPUs: memory used,
  utilization and power against seconds since the first sample, the measured window shaded where
  the row records it (``gpu_monitor.window``), else the process's start and end marked;
- decode: decode tokens/s against the batch (a line only between rows that differ in the batch
  alone; no plot without two batches), with the bandwidth roofline the row computed
  (``decode_roofline_tokens_per_s``: the tokens/s at which a step reads its bytes at the datasheet's
  bandwidth);
- ladder: each attempt of each row that fell back, coloured by how it ended, its change and error
  in its hover text;
- scaling: tokens/s per GPU (the row's tokens/s over its layout's world size) against the GPU
  count, one line per device, configuration (``configuration``: the row apart from its layout) and
  strategy (``fitbench.spec.Layout.strategy``), each line starting from the configuration's one-GPU
  rows where there are some, on a log axis so configurations of any speed share it. Flat is perfect
  weak scaling where each rank keeps its batch (ddp, fsdp, replicas); under tp and pipeline the
  batch is the job's, so the line shows strong scaling;
- serving: a serving benchmark's latency against load (``fitbench.report.serving_figure``);
- layouts: for each configuration run in more than one layout on one kind of device, one bar per
  row: the job's tokens/s (all its GPUs) as a percentage of the configuration's fastest row, so
  configurations of any speed share the axis; the figures themselves are on the bar.

Log axes are ticked at 1, 2 and 5 x 10^k, each tick labelled whole (``20B``), and every axis says
what it shows and its unit.

The rows of a report may come from several sweep directories and devices (``fitbench.results.directories``):
no line or bar group joins rows of two kinds of device (``device``), and where the rows plotted ran on
more than one, each name starts with its device.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from fitbench.monitor.nvml import read_timeline
from fitbench.report.serving_figure import latency_figure
from fitbench.results.directories import Sweeps
from fitbench.results.report import headline
from fitbench.results.row import Row
from fitbench.spec import Layout

GB = 1e9
# A timeline of a long run holds tens of thousands of samples per GPU; every k-th is drawn, so a page
# stays a few MB: at most this many points per GPU and figure.
TIMELINE_POINTS = 1500
STATUS_COLOURS = {"ok": "#2a9d3a", "oom": "#d62728", "refused": "#7f7f7f"}


def layout_label(row: Row) -> str:
    """The row's layout as ``fitbench.spec.Layout`` names it, ``one device`` for a single process."""
    return Layout.model_validate(row.spec.get("layout") or {}).label or "one device"


def world_size(row: Row) -> int:
    return Layout.model_validate(row.spec.get("layout") or {}).world_size


def configuration(row: Row) -> str:
    """What the row runs apart from its layout: its label (``fitbench.spec.RunSpec.label``) without
    the layout's part, so the rows of one configuration over 1, 2 and 4 GPUs share it."""
    if world_size(row) == 1:
        return row.label
    return row.label.replace(f" {layout_label(row)} ", " ", 1)


def device(row: Row) -> str:
    """The kind of device the row ran on: its GPUs' names (NVML's, without the vendor's prefix), the
    CPU, or ``unknown device`` for a row without an environment (one refused before it ran)."""
    environment = row.environment or {}
    names = sorted({str(gpu["name"]).removeprefix("NVIDIA ") for gpu in environment.get("gpus") or []
                    if gpu.get("name")})
    if names:
        return " + ".join(names)
    return "CPU" if environment else "unknown device"


def _on_device(rows: list[Row]) -> Callable[[Row], str]:
    """A group name's prefix: the row's device where ``rows`` ran on more than one kind, else nothing."""
    several = len({device(row) for row in rows}) > 1
    return lambda row: f"{device(row)}: " if several else ""


def gpu_peak(gpu: dict[str, Any]) -> float | None:
    """One GPU's measured peak: NVML's per-process figure, else the allocator's reserved peak."""
    value = gpu.get("nvml_peak_used") or gpu.get("peak_reserved")
    return float(value) if value else None


def _ok(sweeps: Sweeps) -> list[Row]:
    return [row for row in sweeps.rows if row.status == "ok"]


def _grouped(rows: list[Row], key: Callable[[Row], str]) -> dict[str, list[Row]]:
    groups: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        groups[key(row)].append(row)
    return dict(sorted(groups.items()))


def _figure(fig: go.Figure, height: int = 420) -> go.Figure:
    fig.update_layout(height=height, margin=dict(l=60, r=20, t=40, b=50), template="plotly_white",
                      legend=dict(font=dict(size=11)))
    return fig


# Spec fields that do not make a configuration: how long it was measured, its seed, the device's index.
NOT_CONFIGURATION = ("device", "warmup_steps", "measure_steps", "seed")


def varying(sweeps: Sweeps, row: Row, plotted: str) -> tuple[str, str]:
    """The group of ``row`` in a plot whose x is its ``plotted`` spec field, and the group's name: the
    rows of one group differ in ``plotted`` alone (same device, directory and every other field of the
    configuration), so a line between them reads as what ``plotted`` does. The name is the row's label
    less its ``plotted`` part, with its directory where there are several."""
    fields = {name: value for name, value in row.spec.items() if name not in (plotted, *NOT_CONFIGURATION)}
    directory = sweeps.name(row) if sweeps.several else ""
    key = f"{device(row)}|{directory}|{json.dumps(fields, sort_keys=True, default=str)}"
    shown = str(row.spec.get(plotted))
    label = row.label.replace(f"{shown} ", "", 1) if plotted == "model" else re.sub(
        rf"(?<![\w.]){re.escape(shown)}(?=x\d)", "N", row.label, count=1)
    return key, label + (f" ({directory})" if directory else "")


def _lines(xs: list[float]) -> str:
    """A trace's mode: a line only where it joins two x values or more, else its points alone."""
    return "lines+markers" if len(set(xs)) > 1 else "markers"


def _log_ticks(values: list[float], text: Callable[[float], str]) -> dict:
    """Ticks of a log axis at 1, 2 and 5 x 10^k over the values' range, each labelled whole by ``text``
    (``20B``, not plotly's bare ``2`` of a minor tick), or at the values themselves where fewer than two
    such ticks fall in the range."""
    low, high = min(values) / 1.2, max(values) * 1.2
    ticks = [m * 10 ** e for e in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
             for m in (1, 2, 5) if low <= m * 10 ** e <= high]
    ticks = ticks if len(ticks) >= 2 else sorted(set(values))
    return dict(tickvals=ticks, ticktext=[text(tick) for tick in ticks])


def _si(value: float) -> str:
    """A count as a reader says it: 20B, 1.5M, 300."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def size_figure(sweeps: Sweeps) -> go.Figure | None:
    rows = [row for row in _ok(sweeps) if row.params and headline(row)["tokens_per_s"]]
    if len({row.params for row in rows}) < 2:
        return None
    fig = make_subplots(rows=1, cols=2, subplot_titles=("tokens/s", "MFU (%; of the prefill in infer)"))
    groups: dict[str, tuple[str, list[Row]]] = {}
    for row in rows:
        key, name = varying(sweeps, row, "model")
        groups.setdefault(key, (name, []))[1].append(row)
    for index, (name, group) in enumerate(sorted(groups.values(), key=lambda item: item[0])):
        group = sorted(group, key=lambda row: row.params)
        heads = [headline(row) for row in group]
        params = [row.params for row in group]
        labels = [sweeps.label(row) for row in group]
        colour = _COLOURS[index % len(_COLOURS)]
        fig.add_trace(go.Scatter(x=params, y=[h["tokens_per_s"] for h in heads], name=name, text=labels,
                                 mode=_lines(params), legendgroup=name, line=dict(color=colour)), 1, 1)
        fig.add_trace(go.Scatter(x=params, y=[100 * h["mfu"] if h["mfu"] is not None else None for h in heads],
                                 name=name, text=labels, mode=_lines(params), legendgroup=name, showlegend=False,
                                 line=dict(color=colour)), 1, 2)
    fig.update_xaxes(type="log", title_text="parameters (log scale)",
                     **_log_ticks([row.params for row in rows], _si))
    fig.update_yaxes(type="log", title_text="tokens/s (log scale)",
                     **_log_ticks([headline(row)["tokens_per_s"] for row in rows], _si), row=1, col=1)
    fig.update_yaxes(title_text="MFU (%)", row=1, col=2)
    return _figure(fig)


def memory_figure(sweeps: Sweeps) -> go.Figure | None:
    points = []
    for row in sweeps.rows:
        predicted = (row.prediction or {}).get("predicted_peak_bytes")
        for index, gpu in enumerate((row.memory or {}).get("gpus") or []):
            if predicted and gpu_peak(gpu):
                points.append((predicted / GB, gpu_peak(gpu) / GB,
                               f"{sweeps.label(row)}, rank {gpu.get('rank', index)}"))
    if not points:
        return None
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[p[0] for p in points], y=[p[1] for p in points], text=[p[2] for p in points],
                             mode="markers", name="one GPU of a row", marker=dict(size=9)))
    top = max(max(p[0], p[1]) for p in points) * 1.05
    fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", name="measured = predicted",
                             line=dict(dash="dash", color="#888")))
    fig.update_xaxes(title_text="predicted peak per GPU (GB)")
    fig.update_yaxes(title_text="measured peak (GB)")
    return _figure(fig)


def _chooser(fig: go.Figure, names: list[str], traces_per_choice: list[int],
             shapes: list[list[dict]] | None = None) -> None:
    """A drop-down over ``names`` that shows the traces of one choice (the first shown at first)."""
    buttons, start = [], 0
    total = sum(traces_per_choice)
    for choice, (name, count) in enumerate(zip(names, traces_per_choice)):
        visible = [start <= trace < start + count for trace in range(total)]
        layout = {"shapes": shapes[choice]} if shapes is not None else {}
        buttons.append(dict(label=name[:60], method="update", args=[{"visible": visible}, layout]))
        start += count
    for trace, visible in zip(fig.data, buttons[0]["args"][0]["visible"]):
        trace.visible = visible
    if shapes is not None:
        fig.update_layout(shapes=shapes[0])
    fig.update_layout(updatemenus=[dict(buttons=buttons, x=0, xanchor="left", y=1.18, yanchor="top")])


def terms_figure(sweeps: Sweeps) -> go.Figure | None:
    rows = [row for row in sweeps.rows if (row.prediction or {}).get("terms")]
    if not rows:
        return None
    fig = go.Figure()
    for row in rows:
        terms = [term for term in row.prediction["terms"] if term.get("bytes")]
        fig.add_trace(go.Bar(x=[term["bytes"] / GB for term in terms], y=[term["name"] for term in terms],
                             orientation="h", name=sweeps.label(row),
                             marker=dict(color=["#1f77b4" if term.get("at_peak", True) else "#c7c7c7"
                                                for term in terms])))
    _chooser(fig, [sweeps.label(row) for row in rows], [1] * len(rows))
    fig.update_xaxes(title_text="GB per GPU (grey: not alive at the peak)")
    fig.update_yaxes(autorange="reversed", title_text="memory term")
    return _figure(fig, height=max(420, 22 * max(len(row.prediction["terms"]) for row in rows)))


def timeline_figure(sweeps: Sweeps) -> go.Figure | None:
    chosen = [(row, path) for row in sweeps.rows if (path := sweeps.timeline(row)) is not None]
    timelines = []
    for row, path in chosen:
        timeline = read_timeline(path)
        if timeline.samples:
            timelines.append((row, timeline))
    if not timelines:
        return None
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=("memory used (GB)", "utilization (%)", "power (W)"))
    counts, shapes = [], []
    for row, timeline in timelines:
        start = timeline.samples[0].t
        by_gpu: dict[int, list] = defaultdict(list)
        for sample in timeline.samples:
            by_gpu[sample.gpu].append(sample)
        for gpu, samples in sorted(by_gpu.items()):
            samples = samples[::max(1, len(samples) // TIMELINE_POINTS)]
            seconds = [sample.t - start for sample in samples]
            for panel, (column, scale) in enumerate((("memory_used_bytes", 1 / GB), ("utilization_percent", 1),
                                                     ("power_w", 1)), start=1):
                values = [None if getattr(s, column) is None else getattr(s, column) * scale for s in samples]
                fig.add_trace(go.Scatter(x=seconds, y=values, mode="lines", name=f"GPU {gpu}", legendgroup=f"{gpu}",
                                         showlegend=panel == 1, line=dict(color=_COLOURS[gpu % len(_COLOURS)])),
                              panel, 1)
        counts.append(3 * len(by_gpu))
        shapes.append(_marks(row, timeline, start))
    _chooser(fig, [sweeps.label(row) for row, _ in timelines], counts, shapes)
    fig.update_xaxes(title_text="seconds since the first sample", row=3, col=1)
    for panel, title in enumerate(("GB", "%", "W"), start=1):
        fig.update_yaxes(title_text=title, row=panel, col=1)
    return _figure(fig, height=640)


def _marks(row: Row, timeline, start: float) -> list[dict]:
    """The measured window shaded where the row records it, else the process's start and end as lines."""
    every_panel = dict(xref="x", yref="paper", y0=0, y1=1)
    window = (row.gpu_monitor or {}).get("window")
    if window:
        return [dict(type="rect", x0=window[0] - start, x1=window[1] - start, fillcolor="#ffd54f", opacity=0.25,
                     line=dict(width=0), **every_panel)]
    header = timeline.header or {}
    marks = []
    if isinstance(header.get("started_unix_s"), (int, float)) and isinstance(header.get("started_monotonic_s"),
                                                                             (int, float)):
        offset = header["started_monotonic_s"] - header["started_unix_s"] - start
        for field in ("started_at", "finished_at"):
            if getattr(row, field):
                try:
                    moment = datetime.fromisoformat(getattr(row, field)).timestamp() + offset
                except ValueError:
                    continue
                marks.append(dict(type="line", x0=moment, x1=moment, line=dict(dash="dot", color="#555"),
                                  **every_panel))
    return marks


def decode_figure(sweeps: Sweeps) -> go.Figure | None:
    rows = [row for row in _ok(sweeps) if row.spec["mode"] == "infer"
            and (row.throughput or {}).get("decode_tokens_per_s")]
    if len({row.spec["batch_size"] for row in rows}) < 2:
        return None
    fig = go.Figure()
    groups: dict[str, tuple[str, list[Row]]] = {}
    for row in rows:
        key, name = varying(sweeps, row, "batch_size")
        groups.setdefault(key, (name, []))[1].append(row)
    for index, (name, group) in enumerate(sorted(groups.values(), key=lambda item: item[0])):
        group = sorted(group, key=lambda row: row.spec["batch_size"])
        batches = [row.spec["batch_size"] for row in group]
        colour = _COLOURS[index % len(_COLOURS)]
        fig.add_trace(go.Scatter(x=batches, y=[row.throughput["decode_tokens_per_s"] for row in group],
                                 mode=_lines(batches), name=name, text=[sweeps.label(row) for row in group],
                                 line=dict(color=colour)))
        roofline = [row.throughput.get("decode_roofline_tokens_per_s") for row in group]
        if any(roofline):
            fig.add_trace(go.Scatter(x=batches, y=roofline, mode=_lines(batches), name=f"{name}: bandwidth roofline",
                                     line=dict(color=colour, dash="dash"), marker=dict(symbol="line-ew-open", size=14)))
    rates = [value for row in rows for value in (row.throughput["decode_tokens_per_s"],
                                                 row.throughput.get("decode_roofline_tokens_per_s")) if value]
    fig.update_xaxes(type="log", title_text="batch (sequences, log scale)",
                     **_log_ticks([row.spec["batch_size"] for row in rows], _si))
    fig.update_yaxes(type="log", title_text="decode tokens/s (log scale)", **_log_ticks(rates, _si))
    return _figure(fig)


def ladder_figure(sweeps: Sweeps) -> go.Figure | None:
    rows = [row for row in sweeps.rows if len(row.attempts or []) > 1]
    if not rows:
        return None
    fig = go.Figure()
    for status in sorted({attempt.get("status") or "?" for row in rows for attempt in row.attempts}):
        points = [(number, sweeps.label(row), f"{attempt.get('change')}: {(attempt.get('error') or status)[:200]}")
                  for row in rows for number, attempt in enumerate(row.attempts, start=1)
                  if (attempt.get("status") or "?") == status]
        fig.add_trace(go.Scatter(x=[p[0] for p in points], y=[p[1] for p in points], text=[p[2] for p in points],
                                 mode="markers", name=status, hovertemplate="%{y}<br>attempt %{x}: %{text}",
                                 marker=dict(size=14, symbol="square", color=STATUS_COLOURS.get(status, "#ff7f0e"))))
    fig.update_xaxes(title_text="attempt (1: the first try)", dtick=1)
    fig.update_yaxes(title_text="configuration")
    return _figure(fig, height=max(300, 40 * len(rows) + 120))


def _rated(sweeps: Sweeps) -> list[Row]:
    return [row for row in _ok(sweeps) if headline(row)["tokens_per_s"]]


def _per_gpu(row: Row) -> float:
    return headline(row)["tokens_per_s"] / world_size(row)


def _source(sweeps: Sweeps, row: Row) -> str:
    """A row's hover text: its label, layout and, in a report of several directories, its directory."""
    return f"{sweeps.label(row)} ({layout_label(row)})" + (f", from {sweeps.name(row)}" if sweeps.several else "")


def scaling_figure(sweeps: Sweeps) -> go.Figure | None:
    rows = _rated(sweeps)
    if not any(world_size(row) > 1 for row in rows):
        return None
    fig = go.Figure()
    on = _on_device(rows)
    groups = _grouped(rows, lambda row: f"{on(row)}{configuration(row)}")
    strategies: dict[str, int] = {}
    for index, (name, group) in enumerate(groups.items()):
        one_gpu = [row for row in group if world_size(row) == 1]
        spread = _grouped([row for row in group if world_size(row) > 1],
                          lambda row: Layout.model_validate(row.spec.get("layout") or {}).strategy)
        for strategy, several in spread.items():
            line = sorted(one_gpu + several, key=world_size)
            style = strategies.setdefault(strategy, len(strategies))
            fig.add_trace(go.Scatter(
                x=[world_size(row) for row in line], y=[_per_gpu(row) for row in line], mode="lines+markers",
                name=f"{name}: {strategy}", text=[_source(sweeps, row) for row in line],
                marker=dict(size=11, symbol=_SYMBOLS[style % len(_SYMBOLS)]),
                line=dict(color=_COLOURS[index % len(_COLOURS)], dash=_DASHES[style % len(_DASHES)])))
    fig.update_xaxes(title_text="GPUs", dtick=1)
    fig.update_yaxes(title_text="tokens/s per GPU (log scale)", type="log",
                     **_log_ticks([_per_gpu(row) for row in rows], _si))
    return _figure(fig)


def layouts_figure(sweeps: Sweeps) -> go.Figure | None:
    rows = _rated(sweeps)
    on = _on_device(rows)
    groups = {name: group for name, group in _grouped(rows, lambda row: f"{on(row)}{configuration(row)}").items()
              if len({layout_label(row) for row in group}) > 1}
    if not groups:
        return None
    fig = go.Figure()
    for index, (name, group) in enumerate(groups.items()):
        group = sorted(group, key=lambda row: (world_size(row), layout_label(row)))
        bars = _distinct([layout_label(row) + (f" [{sweeps.name(row)}]" if sweeps.several else "") for row in group])
        best = max(headline(row)["tokens_per_s"] for row in group)
        fig.add_trace(go.Bar(
            y=[[name] * len(group), bars], x=[100 * headline(row)["tokens_per_s"] / best for row in group],
            orientation="h", name=name, textposition="auto", hovertext=[_source(sweeps, row) for row in group],
            text=[f"{headline(row)['tokens_per_s']:,.0f} tokens/s, {_per_gpu(row):,.0f} per GPU" for row in group],
            marker=dict(color=_COLOURS[index % len(_COLOURS)])))
    fig.update_xaxes(title_text="tokens/s of the job, % of the configuration's fastest layout", range=[0, 100])
    fig.update_yaxes(autorange="reversed", title_text="configuration and layout")
    return _figure(fig, height=max(300, 30 * sum(len(group) for group in groups.values()) + 120))


def _distinct(names: list[str]) -> list[str]:
    """``names`` with a repeated one numbered (``tp x 2 (2)``), so no two bars of a group share a place."""
    seen: dict[str, int] = defaultdict(int)
    shown = []
    for name in names:
        seen[name] += 1
        shown.append(name if seen[name] == 1 else f"{name} ({seen[name]})")
    return shown


_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
            "#17becf")
_SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "star")
_DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")


@dataclass(frozen=True)
class Plot:
    """One plot of the page: its anchor, title, what it shows, and the function that makes it."""

    name: str
    title: str
    caption: str
    make: Callable[[Sweeps], go.Figure | None]


FIGURES = (
    Plot("size", "Throughput against model size", "tokens/s and MFU per row; a line joins only rows that differ in "
         "the model alone (same device, directory, mode, precision, layout, batch, sequence and backend), else each "
         "row is a point. MFU against the datasheet's dense peak; in infer, the prefill's.", size_figure),
    Plot("memory", "Predicted against measured peak memory", "every GPU of every row: the measured peak (NVML per "
         "process, else the allocator's reserved peak) against the planner's prediction per GPU.", memory_figure),
    Plot("terms", "The planner's memory terms", "one row's predicted peak per GPU term by term; choose the row "
         "above the plot.", terms_figure),
    Plot("timeline", "GPU timelines", "the parent's NVML samples of one row's GPUs (choose the row above the plot); "
         "the measured window is shaded where the row records it, else dotted lines mark the process's start "
         "and end.", timeline_figure),
    Plot("decode", "Decode throughput against batch", "decode tokens/s per batch, a line joining only rows that "
         "differ in the batch alone; dashed: the bandwidth roofline (the tokens/s at which each step reads its bytes "
         "at the datasheet's memory bandwidth).", decode_figure),
    Plot("ladder", "The fallback ladder", "each attempt of the rows that fell back, coloured by how it ended; the "
         "change and the error are in its hover text.", ladder_figure),
    Plot("scaling", "Scaling over GPUs", "tokens/s per GPU against the GPU count, one line per device, "
         "configuration and strategy, from the configuration's one-GPU rows where there are some. Under ddp, fsdp "
         "and replicas each rank keeps its batch (weak scaling: flat is perfect); under tp and pipeline the batch "
         "is the job's (strong scaling). Log axis.", scaling_figure),
    Plot("layouts", "The layouts compared", "each configuration run in more than one layout on one kind of device: "
         "the job's tokens/s per layout as a percentage of the fastest; its tokens/s and tokens/s per GPU on the "
         "bar.", layouts_figure),
    Plot("serving", "Serving latency against load", "the points of each serving benchmark (fitbench serve-bench) "
         "by the output tokens/s they reached: time to first token and inter-token latency, p50 solid and p99 "
         "dotted; x marks a point with failed requests. Log axis.", latency_figure),
)
