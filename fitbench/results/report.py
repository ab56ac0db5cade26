"""Result rows as a terminal table and as CSV.

Rows keep raw samples; this module only chooses what to show. Per metric:
training-style modes show the median step time and tokens/s of the step; ``infer`` shows the
median per-token decode latency and decode tokens/s, with the prefill MFU. Beside the measured
time is the planner's roofline time (``fitbench.plan.speed``), a lower bound whose gap shows. Memory is the peak per
GPU that the process held (NVML: allocator reserved plus CUDA context), or the host's peak RSS on a
CPU, beside the planner's prediction and its error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import pandas as pd
from rich.table import Table

from fitbench.units import format_bytes, format_count, format_seconds

CSV_FILE = "results.csv"


def headline(row: dict[str, Any]) -> dict[str, Any]:
    """The few numbers a person compares first, whatever the mode."""
    spec, timing, throughput = row["spec"], row.get("timing") or {}, row.get("throughput") or {}
    infer = spec["mode"] == "infer"
    time_stats = (timing.get("token_latency") if infer else timing.get("step")) or {}
    gpus = (row.get("memory") or {}).get("gpus") or []
    if gpus:
        memory = ", ".join(format_bytes(g.get("nvml_peak_used") or g["peak_reserved"]) for g in gpus)
    elif row.get("memory"):
        memory = format_bytes(row["memory"]["host_peak_rss"]) + " host"
    else:
        memory = ""
    measured_peak = measured_gpu_peak(row)
    predicted = (row.get("prediction") or {}).get("predicted_peak_bytes")
    error = 100 * (predicted - measured_peak) / measured_peak if predicted and measured_peak else None
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
        "roofline_time": (row.get("prediction") or {}).get("step_time_estimate_s"),
        "measured_peak": measured_peak,
        "predicted_peak": predicted,
        "prediction_error": error,
    }


def measured_gpu_peak(row: dict[str, Any]) -> float | None:
    """What the GPU gave the process at its peak: NVML's per-process figure (allocator reserved plus
    CUDA context), or, without NVML, the reserved peak plus the context the prediction assumed."""
    gpus = (row.get("memory") or {}).get("gpus") or []
    if not gpus:
        return None
    if gpus[0].get("nvml_peak_used"):
        return float(gpus[0]["nvml_peak_used"])
    context = next((t["bytes"] for t in (row.get("prediction") or {}).get("terms", []) if t["name"] == "CUDA context"), 0)
    return float(gpus[0]["peak_reserved"]) + context


def quality_summary(quality: dict[str, Any] | None) -> str:
    """A quantized row's quality against bf16 in one line (``fitbench.run.quality`` defines each figure)."""
    if not quality:
        return "-"
    matmul = quality["matmul_error"]
    parts = []
    if matmul["count"]:
        parts.append(f"matmul error {_percent(matmul['mean'])} mean, {_percent(matmul['worst'])} worst "
                     f"({matmul['worst_matmul']})")
    parts.append(f"top-1 {_percent(quality['top1_agreement'])}, KL {quality['kl_divergence']:.2g} nats")
    perplexity = quality.get("perplexity")
    if isinstance(perplexity, dict):
        parts.append(f"perplexity {perplexity['bf16']:.2f} -> {perplexity['quantized']:.2f}")
    elif perplexity:
        parts.append(f"perplexity {perplexity}")
    return "; ".join(parts)


def results_table(rows: Iterable[dict[str, Any]], title: str = "fitbench results") -> Table:
    table = Table(title=title, title_justify="left")
    for column, justify in (("model", "left"), ("params", "right"), ("mode", "left"), ("precision", "left"),
                            ("batch×seq", "right"), ("median ± CV", "right"), ("roofline", "right"),
                            ("tokens/s", "right"),
                            ("MFU", "right"), ("peak memory", "right"), ("predicted (error)", "right"),
                            ("status", "left")):
        table.add_column(column, justify=justify)
    for row in rows:
        spec, head = row["spec"], headline(row)
        shape = f"{spec['batch_size']}×{spec['seq_len']}" + (f"+{spec['new_tokens']}" if spec["mode"] == "infer" else "")
        if spec.get("activation_checkpointing"):
            shape += " rc"
        if spec.get("offload"):
            shape += " off"
        timing = f"{format_seconds(head['time'])} ± {head['cv']:.1f}%" if head["time"] is not None else "-"
        if spec["mode"] == "infer" and head["time"] is not None:
            timing += "/tok"
        mfu = f"{100 * head['mfu']:.1f}%" if head["mfu"] is not None else "-"
        if head["roofline"] is not None:
            mfu += f" ({head['roofline']:.0f}% BW)"
        status = row["status"] if row["status"] == "ok" else f"[red]{row['status']}[/red]"
        table.add_row(
            spec["model"], format_count(row.get("params")), spec["mode"], spec["precision"], shape, timing,
            format_seconds(head["roofline_time"]),
            f"{head['tokens_per_s']:,.0f}" if head["tokens_per_s"] else "-", mfu, head["memory"],
            _prediction(head), status,
        )
    return table


def _prediction(head: dict[str, Any]) -> str:
    if head["predicted_peak"] is None:
        return "-"
    error = f" ({head['prediction_error']:+.1f}%)" if head["prediction_error"] is not None else ""
    return format_bytes(head["predicted_peak"]) + error


def flat_frame(rows: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """One column per scalar field (``spec.model``, ``throughput.mfu``, ``memory.gpus``...);
    raw samples stay in the JSONL only."""
    trimmed = []
    for row in rows:
        row = dict(row)
        if isinstance(row.get("timing"), dict):
            row["timing"] = {k: v for k, v in row["timing"].items() if k != "samples"}
        trimmed.append(row)
    return pd.json_normalize(trimmed, sep=".")


def write_csv(rows: Iterable[dict[str, Any]], directory: str | Path) -> Path:
    path = Path(directory) / CSV_FILE
    flat_frame(rows).to_csv(path, index=False)
    return path


def _percent(value: float | None, scale: float = 100.0) -> str:
    return f"{scale * value:.1f}%" if value is not None else "-"


def markdown_report(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of the rows, with the command and environment they came from."""
    if not rows:
        return "(no results)\n"
    lines = []
    env = next((row["environment"] for row in rows if row.get("environment")), {})
    commands = sorted({row.get("command", "") for row in rows})
    lines.append(f"Command: `{'`, `'.join(commands)}`  ")
    if env:
        gpus = ", ".join(g["name"] for g in env.get("gpus", [])) or env.get("cpu_model", "cpu")
        lines.append(f"Device: {gpus}; torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), transformers "
                     f"{env.get('transformers')}, driver {env.get('driver')}; fitbench {env.get('fitbench_version')} "
                     f"({env.get('git_commit') or 'no commit'}); {env.get('time_utc')}")
    lines.append("")
    columns = ("model", "params", "mode", "precision", "batch×seq", "median ± CV", "roofline", "tokens/s",
               "MFU (datasheet)",
               "MFU (measured peak)", "decode % of BW roofline", "weights vs bf16", "quality vs bf16",
               "measured peak (NVML)", "predicted peak", "error", "status")
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for row in rows:
        spec, head, throughput = row["spec"], headline(row), row.get("throughput") or {}
        infer = spec["mode"] == "infer"
        shape = f"{spec['batch_size']}×{spec['seq_len']}" + (f"+{spec['new_tokens']}" if infer else "")
        if spec.get("activation_checkpointing"):
            shape += " recompute"
        timing = (f"{format_seconds(head['time'])}{'/token' if infer else ''} ± {head['cv']:.1f}%"
                  if head["time"] is not None else "-")
        mfu = throughput.get("prefill_mfu" if infer else "mfu")
        cells = (
            spec["model"], format_count(row.get("params")), spec["mode"], spec["precision"], shape, timing,
            format_seconds(head["roofline_time"]),
            f"{head['tokens_per_s']:,.0f}" if head["tokens_per_s"] else "-",
            _percent(mfu) + (" (prefill)" if infer and mfu else ""),
            _percent(throughput.get("prefill_mfu_measured_peak" if infer else "mfu_measured_peak")),
            _percent(throughput.get("decode_roofline_percent"), 1.0),
            _percent((row.get("weights") or {}).get("relative_to_bf16")),
            quality_summary(row.get("quality")),
            format_bytes(head["measured_peak"]), format_bytes(head["predicted_peak"]),
            f"{head['prediction_error']:+.1f}%" if head["prediction_error"] is not None else "-",
            row["status"],
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
