"""The columns of a row in the HTML table and the workbook: a header with its unit and the value,
a plain number in that unit (or text), None where the row has none.

The figures are ``fitbench.results.report.headline``'s (the median step time, or per-token decode
latency in ``infer``; tokens/s; MFU, the prefill's in ``infer``; the measured and predicted peak and
their error) and the latency percentiles, energy per token and cost of ``fitbench.results.report``,
scaled to the unit in the header: ms are 1e-3 s, GB are 1e9 bytes, % are 100 x a fraction. The
measurements come first, then what the row is (model, mode, precision, layout, shape), so the first
screen of a page shows figures; each number is shown to the digits its column names (``digits``). The measured peak is the largest GPU's
(``headline`` gives the first GPU's; every rank's is in the memory plot and the row). Quantization
columns: the method is the precision of a quantized row, the library holds its tensors
(``fitbench.precisions``, the entry's ``library``), weights vs bf16 is the bytes the built weights took
over those of the same model in bf16 (``weights.relative_to_bf16``), and the quality figures are
``fitbench.worker.quality``'s against the bf16 model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from fitbench.precisions import entry
from fitbench.report.figures import GB, gpu_peak, layout_label, world_size
from fitbench.results.directories import Sweeps
from fitbench.results.report import (PERCENTILES, cost_per_million_tokens, energy_per_token, headline,
                                     latency_percentiles)
from fitbench.results.row import Row

Value = float | int | str | None


@dataclass(frozen=True)
class Column:
    header: str
    value: Callable[[Row, dict[str, Any]], Value]  # (row, its headline) -> value
    digits: str | None = None  # how a number is shown (a format spec: ".3g"); None: as it is
    in_html: bool = True  # the HTML table shows the figures people compare; the workbook every column


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale


def largest_peak(row: Row) -> float | None:
    peaks = [peak for gpu in (row.memory or {}).get("gpus") or [] if (peak := gpu_peak(gpu))]
    if peaks:
        return max(peaks) / GB
    host = (row.memory or {}).get("host_peak_rss")
    return None if host is None else host / GB


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _quality(row: Row, *path: str) -> Any:
    value: Any = row.quality or {}
    for step in path:
        value = value.get(step) if isinstance(value, dict) else None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _last_line(text: str | None) -> str | None:
    lines = (text or "").strip().splitlines()
    return lines[-1][:300] if lines else None


COLUMNS = (
    # What a reader compares first, with units, so the first screen of the page holds measurements; then
    # what the row is.
    Column("configuration", lambda row, head: row.label),
    Column("status", lambda row, head: row.status),
    Column("tokens/s", lambda row, head: head["tokens_per_s"], ",.0f"),
    Column("median time (ms, per step or decoded token)", lambda row, head: _ms(head["time"]), ".3g"),
    Column("measured peak, largest GPU (GB)", lambda row, head: largest_peak(row), ".1f"),
    Column("CV (%)", lambda row, head: head["cv"], ".1f"),
    *(Column(f"{what} p{p} (ms)", lambda row, head, kind=kind, p=p: _ms(head["percentiles"].get(kind, {}).get(p)),
             ".3g", in_html=p != 50)
      for kind, what in (("token", "per-token latency"), ("ttft", "time to first token"), ("step", "step time"))
      for p in PERCENTILES),
    Column("MFU (%; prefill in infer)", lambda row, head: _scaled(head["mfu"], 100), ".1f"),
    Column("decode bandwidth roofline (%)", lambda row, head: head["roofline"], ".0f"),
    Column("energy per token (J)", lambda row, head: energy_per_token(row), ".3g"),
    Column("cost per million tokens ($)", lambda row, head: head["cost"], ",.2f"),
    Column("predicted peak per GPU (GB)", lambda row, head: _scaled(head["predicted_peak"], 1 / GB), ".1f"),
    Column("prediction error (%)", lambda row, head: head["prediction_error"], "+.1f"),
    Column("forecast time (ms)", lambda row, head: _ms(head["forecast_time"]), ".3g"),
    Column("forecast error (%)", lambda row, head: head["forecast_error"], "+.1f"),
    Column("roofline time (ms)", lambda row, head: _ms(head["roofline_time"]), ".3g", in_html=False),
    Column("model", lambda row, head: row.spec["model"]),
    Column("mode", lambda row, head: row.spec["mode"]),
    Column("precision", lambda row, head: row.spec["precision"]),
    Column("layout", lambda row, head: layout_label(row)),
    Column("GPUs", lambda row, head: world_size(row)),
    Column("batch", lambda row, head: row.spec["batch_size"]),
    Column("sequence (tokens)", lambda row, head: row.spec["seq_len"]),
    Column("new tokens", lambda row, head: row.spec.get("new_tokens") if row.spec["mode"] == "infer" else None,
           in_html=False),
    Column("parameters", lambda row, head: row.params),
    Column("key", lambda row, head: row.key, in_html=False),
    Column("quantization method", lambda row, head: row.spec["precision"]
           if entry(row.spec["precision"]).library else None, in_html=False),
    Column("quantization library", lambda row, head: entry(row.spec["precision"]).library, in_html=False),
    Column("weights vs bf16 (ratio)", lambda row, head: (row.weights or {}).get("relative_to_bf16"), ".3g"),
    Column("weight bytes (GB)", lambda row, head: _scaled((row.weights or {}).get("bytes"), 1 / GB), ".1f",
           in_html=False),
    Column("matmul error, mean (%)", lambda row, head: _scaled(_quality(row, "matmul_error", "mean"), 100), ".3g",
           in_html=False),
    Column("matmul error, worst (%)", lambda row, head: _scaled(_quality(row, "matmul_error", "worst"), 100), ".3g",
           in_html=False),
    Column("top-1 agreement with bf16 (%)", lambda row, head: _scaled(_quality(row, "top1_agreement"), 100), ".1f",
           in_html=False),
    Column("KL divergence from bf16 (nats)", lambda row, head: _quality(row, "kl_divergence"), ".3g", in_html=False),
    Column("perplexity, bf16", lambda row, head: _quality(row, "perplexity", "bf16"), ".2f", in_html=False),
    Column("perplexity, quantized", lambda row, head: _quality(row, "perplexity", "quantized"), ".2f", in_html=False),
    Column("error", lambda row, head: _last_line(row.error)),
)


def row_values(row: Row, html: bool = False, directory: str | None = None,
               gpu_hour_price: float | None = None) -> list[Value]:
    """``row``'s values in ``COLUMNS`` order (only the HTML table's with ``html``), after the name of
    the directory it was read from where one is given (a report of several sweeps); the cost column
    at ``gpu_hour_price`` per GPU-hour (``cost_per_million_tokens``), blank without one."""
    head = {**headline(row), "percentiles": latency_percentiles(row),
            "cost": cost_per_million_tokens(row, gpu_hour_price)}
    return ([directory] if directory is not None else []) + [column.value(row, head) for column in COLUMNS
                                                              if column.in_html or not html]


def formats(html: bool = False, directory: bool = False) -> list[str | None]:
    """Each column's format spec (``Column.digits``), in ``headers``' order."""
    return ([None] if directory else []) + [column.digits for column in COLUMNS if column.in_html or not html]


def headers(html: bool = False, directory: bool = False) -> list[str]:
    return (["directory"] if directory else []) + [column.header for column in COLUMNS if column.in_html or not html]


def rows_table(sweeps: Sweeps, rows: list[Row], html: bool = False,
               gpu_hour_price: float | None = None) -> tuple[list[str], list[list[Value]]]:
    """The header and values of ``rows`` of ``sweeps``, with the directory of each first where the
    report reads several."""
    return headers(html, sweeps.several), [row_values(row, html, sweeps.name(row) if sweeps.several else None,
                                                      gpu_hour_price) for row in rows]
