"""The speed forecast's constants and the measured row each is solved from (``fitbench.planning.forecast``
and the precisions' decode formats, ``fitbench.precisions``): the table, the setter of each constant, and
the solver that finds the value at which a row's forecast equals its measured step. tests/test_forecast.py
solves each constant again from its row; ``out_of_sample.py`` refits them without the rows of one GPU or
one folder at a time."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import fitbench.planning.forecast as forecast
from fitbench import precisions

RESULTS = Path(__file__).parent / "results"

# (constant, its key, its field, (the folder under benchmarks/results and the spec fields of its row),
#  a range holding it)
SOURCES = [
    ("KERNEL_S", None, None, ("2026-11-24-h200-validation/matrix1-inference/3", {"model": "7B", "batch_size": 1}),
     1e-7, 1e-5),
    ("HOST_OP_S", "inference", None, ("2026-11-22-h100-quantized-decode/decode-eager", {"precision": "bf16-pure"}),
     1e-6, 1e-4),
    ("HF_HOST_OP_S", None, None, ("2026-11-24-h200-validation/matrix2-inference/2", {"model": "gpt2-xl"}), 1e-6, 1e-4),
    ("HOST_OP_S", "training", None, ("2026-11-24-h200-validation/matrix1-training/2", {"model": "small"}), 1e-6, 1e-4),
    ("CHECKPOINT_HOST_S", None, None, ("2026-11-24-h200-validation/matrix1-training/1",
                                       {"model": "small", "precision": "bf16"}), 0.0, 1e-2),
    ("MATMUL_EFFICIENCY", None, None, ("2026-11-24-h200-validation/matrix1-forward/3", {"model": "7B"}), 0.3, 1.2),
    ("COMPILED_TRAFFIC", None, None, ("2026-11-24-h200-validation/matrix2-training/3", {"batch_size": 8}), 0.0, 1.0),
    ("COMPILED_LAYER_KERNELS", None, None, ("2026-11-24-h200-compiled-decode/after/compiled", {"batch_size": 1}),
     0, 60),
    ("OFFLOAD_STREAM_BANDWIDTH", None, None, ("2026-11-22-h100-offload", {}), 1e9, 1e11),
    ("decode", ("int4", "eager"), "bytes_per_matmul_flop", ("2026-11-24-h200-decode-formats", {"precision": "int4"}),
     1e-5, 0.1),
    ("decode", ("fp8", "eager"), "extra_kernels", ("2026-11-24-h200-decode-formats", {"precision": "fp8"}),
     0, 30),
    ("decode", ("int8-weight-only", "eager"), "efficiency",
     ("2026-11-24-h200-decode-formats", {"precision": "int8-weight-only"}), 0.1, 2.0),
    ("decode", ("int8", "eager"), "extra_kernels",
     ("2026-11-24-h200-validation/matrix2-inference/4", {"precision": "int8"}), 0, 100),
    ("decode", ("int8-dynamic", "eager"), "extra_kernels", ("2026-11-23-h200-packed-build/heldout/5", {}),
     0, 300),
    ("decode", ("int4", "compiled"), "bytes_per_matmul_flop",
     ("2026-11-24-h200-regional-compile/int4", {"precision": "int4"}), 1e-5, 0.1),
    ("decode", ("int4", "compiled_more_tokens"), "bytes_per_matmul_flop",
     ("2026-11-24-h200-engine-profiles/decode-formats-1B", {"precision": "int4", "batch_size": 8}), 1e-6, 0.1),
    ("decode", ("int8-weight-only", "compiled"), "efficiency",
     ("2026-11-24-h200-regional-compile/int8wo", {"precision": "int8-weight-only"}), 0.1, 3.0),
    ("decode", ("int8-weight-only", "compiled_more_tokens"), "efficiency",
     ("2026-11-24-h200-engine-profiles/decode-formats-1B", {"precision": "int8-weight-only", "batch_size": 8}),
     0.001, 3.0),
    ("decode", ("fp8", "compiled"), "efficiency",
     ("2026-11-24-h200-regional-compile/fp8", {"precision": "fp8"}), 0.1, 3.0),
    ("decode", ("fp8", "compiled"), "extra_kernels",
     ("2026-11-24-h200-engine-profiles/decode-formats-1B", {"precision": "fp8", "batch_size": 1}), 0, 30),
    ("decode", ("fp8-weight-only", "compiled"), "efficiency",
     ("2026-11-24-h200-engine-profiles/fp8-weight-only", {"precision": "fp8-weight-only"}), 0.1, 3.0),
    ("decode", ("nf4", "eager"), "efficiency", ("2026-11-22-h100-quantized-decode/decode", {"precision": "nf4"}), 0.1, 2.0),
    ("decode", ("nf4", "compiled"), "efficiency",
     ("2026-12-05-preregistered/h200x1/70b-nf4-1", {"precision": "nf4"}), 0.01, 2.0),
    ("decode", ("nf4", "eager_more_tokens"), "extra_kernels",
     ("2026-11-24-h200-validation/matrix2-inference/4", {"precision": "nf4"}), 0, 30),
    ("FP8_TRAINING_OPS", None, None, ("2026-11-22-h100-quantized-training/7b-train", {"precision": "fp8"}), 0, 300),
]


def rows_under(directory: Path, **fields) -> Iterator[dict]:
    """The ok rows under ``directory`` whose spec has ``fields``, in the order of their files."""
    for path in sorted(directory.rglob("results.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row["status"] == "ok" and all(row["spec"].get(key) == value for key, value in fields.items()):
                yield row


def measured_row(directory: str, **fields) -> dict:
    """The first ok row of ``benchmarks/results/DIRECTORY`` whose spec has ``fields``."""
    for row in rows_under(RESULTS / directory, **fields):
        return row
    raise LookupError(f"no row {fields} in {directory}")


def value_of(name: str, key=None, field: str | None = None) -> float:
    """The constant's value today."""
    if name == "decode":
        precision, step = key
        return getattr(getattr(precisions.ENTRIES[precision].decode, step), field)
    value = getattr(forecast, name) if key is None else getattr(forecast, name)[key]
    return getattr(value, field) if field else value


def setter(name: str, key=None, field: str | None = None) -> Callable[[float], None]:
    """A setter of ``forecast.NAME`` (``[key]``, ``.field``); ``decode``: the ``field`` of a precision
    entry's decode format, ``key`` = (precision, which of its ``DecodeFormats``). It writes into the
    modules' objects: callers save and restore them (``saved``, ``restore``)."""
    def set_value(value: float) -> None:
        if name == "decode":
            precision, step = key
            facts = precisions.ENTRIES[precision]
            fmt = dataclasses.replace(getattr(facts.decode, step), **{field: value})
            precisions.ENTRIES[precision] = dataclasses.replace(
                facts, decode=dataclasses.replace(facts.decode, **{step: fmt}))
        elif key is None and field is None:
            setattr(forecast, name, value)
        elif field is None:
            getattr(forecast, name)[key] = value
        elif key is None:
            setattr(forecast, name, dataclasses.replace(getattr(forecast, name), **{field: value}))
        else:
            getattr(forecast, name)[key] = dataclasses.replace(getattr(forecast, name)[key], **{field: value})
    return set_value


def saved() -> dict:
    """The forecast's constants and the precisions' entries as they are, to ``restore``; the forecast's dict
    constants are replaced by copies, so that setters change the copies and not what other modules hold."""
    state = {"forecast": {name: value for name, value in vars(forecast).items() if name.isupper()},
             "entries": dict(precisions.ENTRIES)}
    for name, value in state["forecast"].items():
        if isinstance(value, dict):
            setattr(forecast, name, dict(value))
    return state


def restore(state: dict) -> None:
    """Put back what ``saved`` kept."""
    for name, value in state["forecast"].items():
        setattr(forecast, name, value)
    precisions.ENTRIES.clear()
    precisions.ENTRIES.update(state["entries"])


def solve(set_value: Callable[[float], None], row: dict, low: float, high: float,
          row_error: Callable[[dict], tuple[float, float] | None]) -> float:
    """The value in [low, high] at which the row's forecast equals its measured step, by bisection (the
    forecast is monotonic in each constant); ``row_error``: (measured, forecast) seconds of a row
    (``speed_error.row_error``)."""
    def gap(value: float) -> float:
        set_value(value)
        measured, forecast_s = row_error(row)
        return forecast_s - measured

    rising = gap(high) > gap(low)
    for _ in range(50):
        middle = (low + high) / 2
        if (gap(middle) > 0) == rising:
            high = middle
        else:
            low = middle
    return (low + high) / 2
