"""What the readers of a results row rely on, checked once where rows are read.

A row outlives the code that wrote it and passes through people's editors, merges and scripts. The
terminal table, the Markdown report, the CSV and ``--resume`` read it only through ``check_row``:
a row without an identity (``key``, ``status`` and the spec's model, mode, precision and shape) is
no row; any other field those readers read that is not of its kind (an object that is a list, a
number that is text, NaN or infinite, a flag that is a string) is dropped, so it shows blank, and
named. Fields left out or null are blank without a word: rows written before a field existed lack
it. Fields no reader reads pass through as they are (the CSV writes them as JSON).
"""

from __future__ import annotations

import math
from typing import Any

from fitbench.util.errors import excerpt

# A kind is float (a finite number, int or float), int (a whole number), str, bool, a dict of the
# fields of an object, a one-item list (every item of that kind), or a tuple of alternatives.
Kind = Any

# The spec fields that tell one configuration from another in every report.
IDENTITY = {"model": str, "mode": str, "precision": str, "batch_size": int, "seq_len": int}

_STATISTICS = {"median": float, "cv_percent": float}
_THROUGHPUT = ("tokens_per_s", "decode_tokens_per_s", "mfu", "mfu_measured_peak", "prefill_mfu",
               "prefill_mfu_measured_peak", "decode_roofline_percent")
_ENVIRONMENT = ("torch", "torch_cuda", "transformers", "driver", "fitbench_version", "git_commit", "time_utc",
                "cpu_model")

# Every field below the identity that fitbench.results.report, the sweep's summary (fitbench.cli.run),
# the CSV and the store (the schema version) read, with its kind.
READ: dict[str, Kind] = {
    "schema_version": int,
    "label": str,
    "error": str,
    "command": str,
    "params": float,
    "warnings": [str],
    "spec": {"new_tokens": int, "activation_checkpointing": bool, "checkpointed_layers": int, "offload": bool,
             "device": str, "layout": {name: int for name in ("dp_replicate", "dp_shard", "tp", "pp", "replicas")}},
    "timing": {"step": _STATISTICS, "token_latency": _STATISTICS,
               "samples": {"step": [float], "token_latency": [float], "time_to_first_token": [float]}},
    "gpu_monitor": {"energy_per_token_j": float},
    "throughput": {name: float for name in _THROUGHPUT},
    "prediction": {"predicted_peak_bytes": float, "step_time_estimate_s": float, "step_time_forecast_s": float,
                   "terms": [{"name": str, "bytes": float}]},
    "memory": {"gpus": [{"index": int, "nvml_peak_used": float, "peak_reserved": float}], "host_peak_rss": float},
    "weights": {"relative_to_bf16": float},
    "quality": {"matmul_error": {"count": int, "mean": float, "worst": float, "worst_matmul": str},
                "top1_agreement": float, "kl_divergence": float,
                "perplexity": ({"bf16": float, "quantized": float}, str, float)},
    "offload": {"tier": str, "resident_layers": int, "offloaded_layers": int, "offloaded_bytes": float},
    "environment": {"gpus": [{"name": str}], **{name: str for name in _ENVIRONMENT}},
}

# Counts, sizes and indices fitbench writes are 64-bit.
WHOLE_MAX = 2**63 - 1
_NAMES = {float: "a finite number", int: "a whole number", str: "text", bool: "true or false"}


def check_row(value: Any) -> tuple[dict[str, Any] | None, str | None, list[str]]:
    """(the row with its damaged fields dropped, None, what was dropped), or (None, why it is no row, [])."""
    if not isinstance(value, dict):
        return None, f"holds {excerpt(value, 30)}, not a row", []
    missing = [field for field, kind in (("key", str), ("status", str), ("spec", dict))
               if not isinstance(value.get(field), kind)]
    if not missing:
        missing = [f"spec.{field}" for field, kind in IDENTITY.items() if _wrong(value["spec"].get(field), kind)]
    if missing:
        return None, f"is a row without a valid {', '.join(missing)}", []
    dropped: list[str] = []
    return _checked(value, READ, "", dropped), None, dropped


def _wrong(value: Any, kind: type) -> str | None:
    """What is wrong with a scalar ``value`` of ``kind``, None when nothing."""
    if kind is bool:
        right = isinstance(value, bool)
    else:
        right = isinstance(value, (int, float) if kind is float else kind) and not isinstance(value, bool)
    if not right:
        return f"not {_NAMES[kind]}"
    if kind is int and not -WHOLE_MAX <= value <= WHOLE_MAX:
        return "too large for a count"
    if kind is float:
        try:
            if not math.isfinite(value):
                return "not a finite number"
        except OverflowError:  # an integer of hundreds of digits
            return "too large for a number"
    return None


def _matches(value: Any, kind: Kind) -> bool:
    if isinstance(kind, dict):
        return isinstance(value, dict)
    if isinstance(kind, list):
        return isinstance(value, list)
    return _wrong(value, kind) is None


_DROP = object()


def _checked(value: Any, kind: Kind, path: str, dropped: list[str]) -> Any:
    """``value`` with what is not of ``kind`` dropped (``_DROP`` for all of it), each noted in ``dropped``."""
    if value is None:
        return None
    if isinstance(kind, tuple):
        kind = next((alternative for alternative in kind if _matches(value, alternative)), kind[0])
    if isinstance(kind, dict):
        if not isinstance(value, dict):
            dropped.append(f"`{path}` is {excerpt(value, 24)}, not an object")
            return _DROP
        fields = dict(value)
        for field, inner in kind.items():
            if field in fields:
                checked = _checked(fields[field], inner, f"{path}.{field}" if path else field, dropped)
                if checked is _DROP:
                    del fields[field]
                else:
                    fields[field] = checked
        return fields
    if isinstance(kind, list):
        if not isinstance(value, list):
            dropped.append(f"`{path}` is {excerpt(value, 24)}, not a list")
            return _DROP
        items = []
        for index, item in enumerate(value):
            checked = _checked(item, kind[0], f"{path}[{index}]", dropped)
            if isinstance(kind[0], dict):  # an object keeps its place (the GPU's index), blank
                items.append({} if checked is _DROP or checked is None else checked)
            elif checked is not _DROP and checked is not None:
                items.append(checked)
        return items
    problem = _wrong(value, kind)
    if problem:
        dropped.append(f"`{path}` is {excerpt(value, 24)}, {problem}")
        return _DROP
    return value
