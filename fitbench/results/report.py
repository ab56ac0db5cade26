"""Result rows (``fitbench.results.row.Row``, read through ``fitbench.results.store``) as a terminal
table, CSV and Markdown.

Rows keep raw samples; this module only chooses what to show. Every table names each row's layout
(``fitbench.spec.Layout.label``: ``tp x 4``, ``tp 2 x pipeline 2``, ``single``) and its GPU count
(the layout's world size; on a CPU, its processes), labels each GPU's peak with the GPU's index
(``0: 37.8 GB``), and lists under it why each row that is not ``ok`` is not (``reason``). Rows of
several sweeps of one tree may share a table, with a folder column first. Per metric:
training-style modes show the median step time and tokens/s of the step; ``infer`` shows the
median per-token decode latency and decode tokens/s, with the prefill MFU. Beside the measured
time is the planner's roofline time (``fitbench.planning.speed``), a lower bound whose gap shows. Memory is the peak per
GPU that the process held (NVML: allocator reserved plus CUDA context), or the host's peak RSS on a
CPU, beside the planner's prediction and its error; the step's forecast (``fitbench.planning.forecast``) is
beside it with its error the same way, (forecast - measured) / measured.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import pandas as pd
from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from fitbench.results.row import Row
from fitbench.spec import Layout
from fitbench.util.stats import quantile
from fitbench.util.units import format_bytes, format_count, format_seconds

CSV_FILE = "results.csv"
# The modes whose headline time is a per-token latency: a decode step's, or a served request's
# inter-token latency (fitbench.serving.bench).
PER_TOKEN_MODES = frozenset({"infer", "serve"})


def headline(row: Row) -> dict[str, Any]:
    """The few numbers a person compares first, whatever the mode."""
    spec, timing, throughput = row.spec, row.timing or {}, row.throughput or {}
    infer = spec["mode"] in PER_TOKEN_MODES
    time_stats = (timing.get("token_latency") if infer else timing.get("step")) or {}
    memory = ", ".join(_memory_parts(row))
    measured_peak = measured_gpu_peak(row)
    predicted = (row.prediction or {}).get("predicted_peak_bytes")
    error = 100 * (predicted - measured_peak) / measured_peak if predicted and measured_peak else None
    forecast = (row.prediction or {}).get("step_time_forecast_s")
    measured_time = time_stats.get("median")
    mfu = throughput.get("prefill_mfu" if infer else "mfu")
    if mfu is None:
        mfu = throughput.get("prefill_mfu_measured_peak" if infer else "mfu_measured_peak")
    return {
        "time": time_stats.get("median"),
        "cv": time_stats.get("cv_percent"),
        "tokens_per_s": throughput.get("decode_tokens_per_s" if infer else "tokens_per_s"),
        "mfu": mfu,
        "roofline": throughput.get("decode_roofline_percent"),
        "memory": memory,
        "roofline_time": (row.prediction or {}).get("step_time_estimate_s"),
        "measured_peak": measured_peak,
        "predicted_peak": predicted,
        "prediction_error": error,
        "forecast_time": forecast,
        "forecast_error": 100 * (forecast - measured_time) / measured_time if forecast and measured_time else None,
    }


PERCENTILES = (50, 90, 99)


def latency_percentiles(row: Row) -> dict[str, dict[int, float]]:
    """The p50, p90 and p99 of a row's raw latency samples (``timing.samples``), the percentiles vLLM's
    and MLPerf's inference reports give: in ``infer``, of the time to first token (``ttft``: one per
    generation) and of the per-token decode latency (``token``: one per decoded token after the first);
    in the other modes, of the step time (``step``). Quantiles interpolate linearly between order
    statistics (``fitbench.util.stats.quantile``, numpy's default); a kind without samples is left out."""
    samples = (row.timing or {}).get("samples") or {}
    names = ({"ttft": "time_to_first_token", "token": "token_latency"} if row.spec["mode"] == "infer"
             else {"step": "step"})
    found = {}
    for kind, name in names.items():
        values = tuple(sorted(float(v) for v in samples.get(name) or [] if isinstance(v, (int, float))
                              and not isinstance(v, bool)))
        if values:
            found[kind] = {p: quantile(values, p / 100) for p in PERCENTILES}
    return found


def energy_per_token(row: Row) -> float | None:
    """Joules per token: the job's GPU energy over its measured window divided by the tokens of that
    window, summed over its GPUs (``gpu_monitor.energy_per_token_j``, ``fitbench.monitor.nvml``)."""
    value = (row.gpu_monitor or {}).get("energy_per_token_j")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def cost_per_million_tokens(row: Row, gpu_hour_price: float | None) -> float | None:
    """What a million tokens cost at ``gpu_hour_price`` per GPU-hour: price x GPUs / 3600 s / tokens/s
    x 1e6, with the row's headline tokens/s (decode tokens/s in infer, summed over data-parallel ranks)
    and its GPUs (the layout's world size). None without a price or a rate."""
    rate = headline(row)["tokens_per_s"]
    if gpu_hour_price is None or not rate:
        return None
    return gpu_hour_price * _degrees(row).world_size / 3600 / rate * 1e6


def measured_gpu_peak(row: Row) -> float | None:
    """What the GPU that needed most gave its process at the peak, max over the row's GPUs of NVML's
    per-process figure (allocator reserved plus CUDA context), or, without NVML, of the reserved
    peak plus the context the prediction assumed. The largest, because the planner's per-GPU
    prediction is that of the rank that needs most (a pipeline's fullest stage; the rank that gathers
    the job), the one that decides whether a configuration fits."""
    terms = (row.prediction or {}).get("terms") or []
    context = next((t.get("bytes") or 0 for t in terms if t.get("name") == "CUDA context"), 0)
    peaks = [float(gpu["nvml_peak_used"]) if gpu.get("nvml_peak_used")
             else float(gpu["peak_reserved"]) + context if gpu.get("peak_reserved") is not None else None
             for gpu in (row.memory or {}).get("gpus") or []]
    known = [peak for peak in peaks if peak is not None]
    return max(known) if known else None


def layout_name(row: Row) -> str:
    """The row's layout as ``fitbench.spec.Layout`` names it (``tp 2 x pipeline 2``), ``single`` for one process
    (``Layout.strategy``'s word)."""
    return _degrees(row).label or "single"


def device_count(row: Row) -> str:
    """The GPUs the row ran on, the layout's world size; on a CPU, its processes (``2 cpu``)."""
    size = _degrees(row).world_size
    return f"{size} cpu" if str(row.spec.get("device", "")).startswith("cpu") else str(size)


def _degrees(row: Row) -> Layout:
    try:
        return Layout.model_validate(row.spec.get("layout") or {})
    except ValueError:  # a damaged layout reads as one device, as the store reads a damaged field blank
        return Layout()


REASON_CHARS = 300  # past this, a reason keeps its whole sentences only


def reason(row: Row) -> str:
    """Why a row is not ``ok``: the first line of its error (the worker's exception, the refusal's
    paragraph, the timeout), kept to its whole sentences within ``REASON_CHARS`` where it is longer
    (an out-of-memory's advice on fragmentation), or its status where it has no error."""
    first = next((line.strip() for line in (row.error or "").splitlines() if line.strip()), "")
    if len(first) > REASON_CHARS:
        end = first.rfind(". ", 0, REASON_CHARS)
        first = first[:end + 1] if end > 0 else first
    return first or f"no error recorded (status {row.status})"


def reasons(rows: Iterable[Row], label: Callable[[Row], str] | None = None) -> list[str]:
    """One line per row that is not ``ok``: its label (or ``label(row)``), status and ``reason`` (the status
    once where the reason starts with it: ``refused before launch: ...``)."""
    lines = []
    for row in rows:
        if row.status != "ok":
            why = reason(row)
            lines.append(f"{label(row) if label else row.label}: "
                         + (why if why.startswith(row.status) else f"{row.status}: {why}"))
    return lines


def quality_summary(quality: dict[str, Any] | None) -> str:
    """A quantized row's quality against bf16 in one line (``fitbench.worker.quality`` defines each figure)."""
    if not quality:
        return "-"
    matmul = quality.get("matmul_error") or {}
    parts = []
    if matmul.get("count"):
        parts.append(f"matmul error {_percent(matmul.get('mean'))} mean, {_percent(matmul.get('worst'))} worst "
                     f"({matmul.get('worst_matmul') or '-'})")
    kl = quality.get("kl_divergence")
    parts.append(f"top-1 {_percent(quality.get('top1_agreement'))}, KL {'-' if kl is None else f'{kl:.2g}'} nats")
    perplexity = quality.get("perplexity")
    if isinstance(perplexity, dict):
        parts.append(f"perplexity {_fixed(perplexity.get('bf16'))} -> {_fixed(perplexity.get('quantized'))}")
    elif perplexity:
        parts.append(f"perplexity {perplexity}")
    return "; ".join(parts)


MODEL_NAME_CAP = 40  # wider model names wrap inside their column rather than push figures out


def short_names(names: Iterable[str]) -> dict[str, str]:
    """Each model name as the table shows it: a local path becomes its shortest run of trailing
    components that no other name ends with (``../models/tiny-llama-a`` -> ``tiny-llama-a``; two
    directories called ``ckpt`` keep the parent that differs); presets and hub ids stay whole."""
    names = list(dict.fromkeys(names))
    paths = {name: Path(name).parts for name in names if _is_path(name)}
    shown = {name: name for name in names if name not in paths}
    for name, parts in paths.items():
        others = [other_parts for other_parts in paths.values() if other_parts != parts]
        for count in range(1, len(parts) + 1):
            tail = str(Path(*parts[-count:]))
            if count == len(parts) or (tail not in names and all(other[-count:] != parts[-count:] for other in others)):
                shown[name] = tail
                break
    return shown


def _is_path(name: str) -> bool:
    """A local directory, as ``fitbench.models.registry`` tells it from a hub id (``org/name``):
    one that exists here, or one that cannot be a hub id (a leading . / ~, or more than one /)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or ("/" in name and _exists(name))


def _exists(name: str) -> bool:
    try:
        return Path(name).exists()
    except (OSError, ValueError):  # a name too long for a path, or with a NUL
        return False


@dataclass(frozen=True)
class _Column:
    """One column of the terminal table. A cell is a few parts (a figure and its spread, one memory
    figure per GPU) shown on one line when the table fits, else one under the other; ``keep`` ranks
    the columns (0 first) for which are left out when even stacked cells do not fit."""

    header: tuple[str, ...]
    cell: Callable[[Row, dict[str, Any]], tuple[str, ...]]
    keep: int
    justify: str = "right"
    words: bool = False  # text that may wrap at a narrow width; figures never do
    separator: str = " "  # between the parts of a cell on one line

    @property
    def name(self) -> str:
        return " ".join(self.header)


def _time_cell(row: Row, head: dict[str, Any]) -> tuple[str, ...]:
    if head["time"] is None:
        return ("-",)
    return (format_seconds(head["time"]),) + ((f"± {head['cv']:.1f}%",) if head["cv"] is not None else ())


def _memory_parts(row: Row) -> tuple[str, ...]:
    """Each GPU's peak labelled with its index where there are several (``0: 37.8 GB``), or the host's
    peak RSS on a CPU."""
    memory = row.memory or {}
    gpus = memory.get("gpus") or []
    if len(gpus) == 1:
        return (format_bytes(gpus[0].get("nvml_peak_used") or gpus[0].get("peak_reserved")),)
    if gpus:
        return tuple(f"{position if g.get('index') is None else g['index']}: "
                     f"{format_bytes(g.get('nvml_peak_used') or g.get('peak_reserved'))}" for position, g in enumerate(gpus))
    if memory.get("host_peak_rss") is not None:
        return (format_bytes(memory["host_peak_rss"]) + " host",)
    return ()


def _layout_parts(row: Row) -> tuple[str, ...]:
    """The ranks and the layout, in parts a narrow table stacks: ``1 GPU``; ``4 GPUs:``, ``tp x 4``;
    ``4 GPUs:``, ``tp 2 x``, ``pipeline 2`` (processes on a CPU)."""
    count = device_count(row)
    ranks = count.split()[0]
    unit = ("process" if ranks == "1" else "processes") if count.endswith("cpu") else ("GPU" if ranks == "1" else "GPUs")
    if ranks == "1":
        return (f"1 {unit}",)
    return (f"{ranks} {unit}:",) + tuple(re.split(r"(?<= x) (?=\w+ \d)", layout_name(row)))


def _prediction_cell(row: Row, head: dict[str, Any]) -> tuple[str, ...]:
    if head["predicted_peak"] is None:
        return ("-",)
    error = (f"({head['prediction_error']:+.1f}%)",) if head["prediction_error"] is not None else ()
    return (format_bytes(head["predicted_peak"]),) + error


def _forecast_cell(row: Row, head: dict[str, Any]) -> tuple[str, ...]:
    if head["forecast_time"] is None:
        return ("-",)
    error = (f"({head['forecast_error']:+.1f}%)",) if head["forecast_error"] is not None else ()
    return (format_seconds(head["forecast_time"]),) + error


def _shape(spec: dict[str, Any]) -> str:
    shape = f"{spec['batch_size']}×{spec['seq_len']}" + (_new_tokens(spec) if spec["mode"] in PER_TOKEN_MODES else "")
    return shape + _recompute(spec, " rc") + (" off" if spec.get("offload") else "")


def _recompute(spec: dict[str, Any], word: str) -> str:
    """``word`` where every layer recomputes, ``word`` and the count where the first N do (per stage)."""
    if not spec.get("activation_checkpointing"):
        return ""
    layers = spec.get("checkpointed_layers")
    return word + (f" {layers}" if layers else "")


def _new_tokens(spec: dict[str, Any]) -> str:
    return f"+{spec.get('new_tokens') or '?'}"


def _fixed(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _rate(value: float | None) -> str:
    """Tokens/s: whole above 10, two significant figures below (an offloaded 65B decodes 0.14, not 0)."""
    if not value:
        return "-"
    return f"{value:,.0f}" if value >= 10 else f"{value:.2g}"


def _share(value: float | None, scale: float = 100.0, decimals: int = 1) -> tuple[str, ...]:
    return (f"{scale * value:.{decimals}f}%",) if value is not None else ("-",)


def _hyphenated(name: str) -> tuple[str, ...]:
    """``name`` in parts that end at its hyphens ("int8-", "weight-", "only"), which a narrow table
    stacks, so that a long precision or model name costs the width of its longest part, not its own."""
    return tuple(re.split(r"(?<=-)(?=.)", name))


def _breaks(name: str) -> tuple[str, ...]:
    """``name`` in parts that end where a line may end inside it: after a hyphen, slash or underscore
    ("meta-", "llama/", "Llama-"), so that a name wider than its column wraps there, never mid-word."""
    return tuple(re.split(r"(?<=[-/_])(?=.)", name))


def _packed(parts: tuple[str, ...], width: int) -> str:
    """``parts`` joined, a line ending between two parts wherever the next would pass ``width`` cells
    (a part wider than that alone on its line, which the table then folds)."""
    lines = [""]
    for part in parts:
        if lines[-1] and cell_len(lines[-1] + part) > width:
            lines.append("")
        lines[-1] += part
    return "\n".join(lines)


_COMMON = {
    "model": _Column(("model",), lambda row, head: _hyphenated(head["model"]), 0, "left", words=True, separator=""),
    "params": _Column(("params",), lambda row, head: (format_count(row.params),), 8),
    "precision": _Column(("precision",), lambda row, head: _hyphenated(row.spec["precision"]), 2, "left",
                         separator=""),
    "shape": _Column(("batch×seq",), lambda row, head: (_shape(row.spec),), 4),
    "layout": _Column(("layout",), lambda row, head: _layout_parts(row), 3, "left"),
    "tokens/s": _Column(("tokens/s",), lambda row, head: (_rate(head["tokens_per_s"]),), 2),
    "memory": _Column(("peak", "memory"), lambda row, head: _memory_parts(row) or ("-",), 3, separator=", "),
    "predicted": _Column(("predicted", "(error)"), _prediction_cell, 6),
    "forecast": _Column(("forecast",), _forecast_cell, 7),
    "roofline": _Column(("roofline",), lambda row, head: (format_seconds(head["roofline_time"]),), 9),
    "status": _Column(("status",), lambda row, head: (row.status,), 0, "left", words=True),
}
# What a person compares first differs per mode: a training step's time, tokens/s and MFU; a decode
# step's latency, decode tokens/s and how close it comes to the bandwidth roofline.
_TRAINING_COLUMNS = (
    _COMMON["model"], _COMMON["params"], _COMMON["precision"], _COMMON["shape"], _COMMON["layout"],
    _Column(("median", "± CV"), _time_cell, 1), _COMMON["roofline"], _COMMON["tokens/s"],
    _Column(("MFU",), lambda row, head: _share(head["mfu"]), 5), _COMMON["memory"], _COMMON["predicted"],
    _COMMON["forecast"], _COMMON["status"],
)
_INFER_COLUMNS = (
    _COMMON["model"], _COMMON["params"], _COMMON["precision"], _COMMON["shape"], _COMMON["layout"],
    _Column(("per token", "± CV"), _time_cell, 1), _COMMON["roofline"], _COMMON["tokens/s"],
    _Column(("% of BW", "roofline"), lambda row, head: _share(head["roofline"], 1.0, 0), 5),
    _Column(("prefill", "MFU"), lambda row, head: _share(head["mfu"]), 7), _COMMON["memory"],
    _COMMON["predicted"], _COMMON["forecast"], _COMMON["status"],
)


_FOLDER = _Column(("folder",), lambda row, head: (head["folder"],), 0, "left", words=True)
_COST = _Column(("$ per M", "tokens"), lambda row, head: ("-",), 6)


def _dollars(value: float | None) -> str:
    return "-" if value is None else f"${value:,.2f}" if value >= 0.1 else f"${value:.3g}"


class ResultsTable:
    """The rows as terminal tables, one per mode (its name in the title, not a column), laid out for the
    width they are printed at (``_layout``): cells on one line where that fits, a figure's spread
    stacked under it where not, and columns left out, named under the table, when even that is too
    wide. A figure is shown whole or not at all; rich would otherwise cut it ("64… ms ± 93…"). Under
    each table, why each of its rows that is not ok is not (``reasons``). With ``folder``, the rows of
    several sweeps share the tables, the folder of each (``folder(row)``) first."""

    def __init__(self, rows: Iterable[Row], title: str = "fitbench results",
                 folder: Callable[[Row], str] | None = None, gpu_hour_price: float | None = None):
        self.rows = list(rows)
        self.title = title
        self.folder = folder
        self.gpu_hour_price = gpu_hour_price

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        names = short_names(row.spec["model"] for row in self.rows)
        by_mode: dict[str, list[Row]] = {}
        for row in self.rows:
            by_mode.setdefault(row.spec["mode"], []).append(row)
        if not by_mode:
            yield Text(f"{self.title}: no rows")
        for index, (mode, rows) in enumerate(by_mode.items()):
            if index:
                yield Text()
            yield self._table(mode, rows, names, options.max_width)
            label = (lambda row: f"{self.folder(row)}: {row.label}") if self.folder else None
            failed = reasons(rows, label)
            if failed:
                yield Text("not ok:", style="red")
                for line in failed:
                    yield Padding(Text(line), (0, 0, 0, 2), expand=False)  # wrapped lines indented as the first

    def _table(self, mode: str, rows: list[Row], names: dict[str, str], width: int) -> Table:
        columns = list(_INFER_COLUMNS if mode in PER_TOKEN_MODES else _TRAINING_COLUMNS)
        cells = [table_cells(row, names[row.spec["model"]]) for row in rows]
        if self.folder:
            columns.insert(0, _FOLDER)
            cells = [[(self.folder(row),)] + row_cells for row, row_cells in zip(rows, cells)]
        if self.gpu_hour_price is not None:  # before the status, which stays last
            columns.insert(len(columns) - 1, _COST)
            cells = [row_cells[:-1] + [(_dollars(cost_per_million_tokens(row, self.gpu_hour_price)),)] + row_cells[-1:]
                     for row, row_cells in zip(rows, cells)]
        words_cap = max(10, min(MODEL_NAME_CAP, width // 4))
        shown, stacked, widths = _layout(columns, cells, width, words_cap)
        table = Table(title=f"{self.title} · {mode}", title_justify="left", box=box.SIMPLE_HEAD,
                      show_edge=False, pad_edge=False)
        for c in shown:
            column = columns[c]
            table.add_column("\n".join(column.header) if c in stacked else column.name, justify=column.justify,
                             no_wrap=not column.words, overflow="fold", max_width=widths[c] if column.words else None,
                             min_width=None if column.words else widths[c])
        # a row taller than a figure and its spread reads as one row only with room between rows
        table.leading = int(any(len(row_cells[c]) > 2 for row_cells in cells for c in stacked))
        for row, row_cells in zip(rows, cells):
            status_style = "" if row.status == "ok" else "red"
            table.add_row(*(Text(_cell_text(columns[c], row_cells[c], c in stacked, widths[c]),
                                 style=status_style if columns[c].name == "status" else "") for c in shown))
        left_out = [columns[c].name for c in range(len(columns)) if c not in shown]
        if left_out:
            table.caption = (f"not shown at {width} columns: {', '.join(left_out)}; every figure is in "
                             f"results.csv and `fitbench report --markdown DIR`")
            table.caption_justify = "left"
        return table


def _cell_text(column: _Column, parts: tuple[str, ...], stacked: bool, width: int) -> str:
    """A cell's text in a column ``width`` wide: stacked, its parts a line each, those of a name
    (``separator`` "") packed; inline, on one line, a name (``words``) wrapping where ``_breaks`` allows."""
    if stacked:
        return _packed(parts, width) if column.separator == "" else "\n".join(parts)
    text = column.separator.join(parts)
    return _packed(_breaks(text), width) if column.words else text


def table_cells(row: Row, model: str) -> list[tuple[str, ...]]:
    """The cells of ``row`` in its mode's table, each a few parts, with ``model`` for its name."""
    head = {**headline(row), "model": model}
    return [column.cell(row, head) for column in (_INFER_COLUMNS if row.spec["mode"] in PER_TOKEN_MODES
                                                  else _TRAINING_COLUMNS)]


def _layout(columns: list[_Column], cells: list[list[tuple[str, ...]]], width: int,
            words_cap: int) -> tuple[list[int], set[int], list[int]]:
    """Which columns to show, which of them to stack, and their widths, for a table ``width`` wide.
    Stacking comes first (the widest saving first), then columns go, empty or least compared first; then a
    column left out comes back if what went made room, and a stack that is no longer needed unfolds.
    SIMPLE_HEAD without edges spends three cells between columns (padding, rule, padding)."""
    def natural(c: int, stacked: bool) -> int:
        return _width(columns[c], [row_cells[c] for row_cells in cells], stacked, words_cap)

    inline = [natural(c, False) for c in range(len(columns))]
    stack = [natural(c, True) for c in range(len(columns))]
    shown, stacked = list(range(len(columns))), set()

    def rank(c: int) -> tuple[bool, int, int]:
        """The largest is left out first: a column without a single figure, then the least compared."""
        return all(row_cells[c] == ("-",) for row_cells in cells), columns[c].keep, c

    def total(shown: list[int], stacked: set[int]) -> int:
        return sum(stack[c] if c in stacked else inline[c] for c in shown) + 3 * (len(shown) - 1)

    while shown and total(shown, stacked) > width:
        savings = {c: inline[c] - stack[c] for c in shown if c not in stacked and inline[c] > stack[c]}
        if savings:
            stacked.add(max(savings, key=savings.__getitem__))
        else:
            shown.remove(max(shown, key=rank))
    for c in sorted(set(range(len(columns))) - set(shown), key=rank, reverse=True):
        for with_stack in (stacked, stacked | {c}):
            if total(sorted(shown + [c]), with_stack) <= width:
                shown, stacked = sorted(shown + [c]), with_stack
                break
    for c in sorted(stacked, key=lambda c: (inline[c] - stack[c], c)):
        if total(shown, stacked - {c}) <= width:
            stacked = stacked - {c}
    widths = [stack[c] if c in stacked else inline[c] for c in range(len(columns))]
    # The width left over goes to the stacked names (model, folder), in order, so they take fewer lines.
    spare = width - total(shown, stacked)
    for c in shown:
        if c in stacked and columns[c].words and spare > 0:
            grown = min(inline[c], widths[c] + spare)
            spare -= grown - widths[c]
            widths[c] = grown
    return shown, stacked, widths


def _width(column: _Column, cells: list[tuple[str, ...]], stacked: bool, words_cap: int) -> int:
    lines = list(column.header) if stacked else [column.name]
    for parts in cells:
        lines += list(parts) if stacked else [column.separator.join(parts)]
    natural = max(cell_len(line) for line in lines)
    if column.words:
        return min(natural, max(words_cap, max(cell_len(line) for line in column.header)))
    return natural


def results_table(rows: Iterable[Row], title: str = "fitbench results",
                  folder: Callable[[Row], str] | None = None, gpu_hour_price: float | None = None) -> ResultsTable:
    return ResultsTable(rows, title, folder, gpu_hour_price)


def flat_frame(rows: Iterable[Row], gpu_hour_price: float | None = None) -> pd.DataFrame:
    """One column per field (``spec.model``, ``throughput.mfu``...), after the row's ``layout``, its
    ``GPUs``, given ``gpu_hour_price`` the cost of a million tokens (``cost_per_million_tokens``, in
    dollars, under a name that gives the price) and, for a row that is not ok, its ``reason``
    (``layout_name``, ``device_count``, ``reason``); what stays nested (the list ``memory.gpus``, an empty
    dict) is a JSON cell, which any CSV reader's user can parse back, as a Python repr is not. Raw samples
    stay in the JSONL only."""
    trimmed = []
    for row in rows:
        fields = row.as_dict()
        if isinstance(fields.get("timing"), dict):
            fields["timing"] = {k: v for k, v in fields["timing"].items() if k != "samples"}
        cost = ({cost_column(gpu_hour_price): cost_per_million_tokens(row, gpu_hour_price)}
                if gpu_hour_price is not None else {})
        trimmed.append({"layout": layout_name(row), "GPUs": device_count(row), **cost,
                        "reason": None if row.status == "ok" else reason(row), **fields})
    frame = pd.json_normalize(trimmed, sep=".")
    return frame.map(_json_cell)


def _json_cell(value: Any) -> Any:
    return json.dumps(value, default=str) if isinstance(value, (dict, list, tuple)) else value


def cost_column(gpu_hour_price: float) -> str:
    """The name of the cost column of the CSV, with the price it was computed at."""
    return f"cost_per_million_tokens_usd_at_{gpu_hour_price:g}_per_gpu_hour"


def write_csv(rows: Iterable[Row], directory: str | Path, gpu_hour_price: float | None = None) -> Path:
    path = Path(directory) / CSV_FILE
    flat_frame(rows, gpu_hour_price).to_csv(path, index=False)
    return path


def _percent(value: float | None, scale: float = 100.0) -> str:
    return f"{scale * value:.1f}%" if value is not None else "-"


def _percentiles(values: dict[int, float] | None) -> str:
    return "-" if not values else " / ".join(format_seconds(values[p]) for p in PERCENTILES)


def markdown_report(rows: list[Row], folder: Callable[[Row], str] | None = None,
                    gpu_hour_price: float | None = None) -> str:
    """A Markdown table of the rows (after the folder of each, ``folder(row)``, where given), with the
    command and environment they came from, and under it why each row that is not ok is not. The
    latency percentiles (``latency_percentiles``), energy per token and, given ``gpu_hour_price``, the
    cost of a million tokens (``cost_per_million_tokens``) have their columns."""
    if not rows:
        return "(no results)\n"
    lines = []
    env = next((row.environment for row in rows if row.environment), {})
    commands = sorted({row.command for row in rows if row.command})
    lines.append(f"Command: `{'`, `'.join(commands)}`  " if commands else "Command: -  ")
    if env:
        gpus = ", ".join(g["name"] for g in env.get("gpus") or [] if g.get("name")) or env.get("cpu_model") or "cpu"
        lines.append(f"Device: {gpus}; torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), transformers "
                     f"{env.get('transformers')}, driver {env.get('driver')}; fitbench {env.get('fitbench_version')} "
                     f"({env.get('git_commit') or 'no commit'}); {env.get('time_utc')}")
    lines.append("")
    columns = (("folder",) if folder else ()) + (
        "model", "params", "mode", "precision", "batch×seq", "layout", "GPUs", "median ± CV", "roofline", "tokens/s",
        "p50 / p90 / p99 (step or token)", "TTFT p50 / p90 / p99", "energy per token",
        "MFU (datasheet)", "MFU (measured peak)", "decode % of BW roofline", "weights vs bf16", "quality vs bf16",
        "peak per GPU (NVML)", "predicted peak", "error", "forecast", "forecast error") + (
        (f"$ per M tokens at ${gpu_hour_price:g}/GPU-hour",) if gpu_hour_price is not None else ()) + ("status",)
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for row in rows:
        spec, head, throughput = row.spec, headline(row), row.throughput or {}
        infer = spec["mode"] in PER_TOKEN_MODES
        shape = f"{spec['batch_size']}×{spec['seq_len']}" + (_new_tokens(spec) if infer else "")
        shape += _recompute(spec, " recompute")
        timing = "-" if head["time"] is None else (
            format_seconds(head["time"]) + ("/token" if infer else "")
            + (f" ± {head['cv']:.1f}%" if head["cv"] is not None else ""))
        mfu = throughput.get("prefill_mfu" if infer else "mfu")
        spread = latency_percentiles(row)
        energy = energy_per_token(row)
        cells = ((folder(row),) if folder else ()) + (
            spec["model"], format_count(row.params), spec["mode"], spec["precision"], shape, layout_name(row),
            device_count(row), timing,
            format_seconds(head["roofline_time"]),
            f"{head['tokens_per_s']:,.0f}" if head["tokens_per_s"] else "-",
            _percentiles(spread.get("token" if infer else "step")), _percentiles(spread.get("ttft")),
            "-" if energy is None else f"{energy:.3g} J",
            _percent(mfu) + (" (prefill)" if infer and mfu else ""),
            _percent(throughput.get("prefill_mfu_measured_peak" if infer else "mfu_measured_peak")),
            _percent(throughput.get("decode_roofline_percent"), 1.0),
            _percent((row.weights or {}).get("relative_to_bf16")),
            quality_summary(row.quality),
            ", ".join(_memory_parts(row)) or "-", format_bytes(head["predicted_peak"]),
            f"{head['prediction_error']:+.1f}%" if head["prediction_error"] is not None else "-",
            format_seconds(head["forecast_time"]),
            f"{head['forecast_error']:+.1f}%" if head["forecast_error"] is not None else "-",
        ) + ((_dollars(cost_per_million_tokens(row, gpu_hour_price)),) if gpu_hour_price is not None else ()) + (
            row.status,)
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    failed = reasons(rows, (lambda row: f"{folder(row)}: {row.label}") if folder else None)
    if failed:
        lines += ["", "Not ok:", ""] + [f"- {line}" for line in failed]
    return "\n".join(lines) + "\n"
