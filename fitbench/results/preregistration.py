"""Forecasts registered before anything runs, and what ran against them.

``fitbench plan --preregister FILE`` writes, for each model and mode it plans, the configuration it chose
(model, mode, precision, layout, batch, sequence, checkpointing, compile, backend), the GPU it planned for, its
predicted peak per GPU and its forecast tokens/s, with when and by which fitbench (``registration``).
``fitbench report DIR --preregistered FILE`` pairs each registered configuration with the row that ran it
(``paired``) and shows both figures beside their errors, a configuration that did not run as such. The
row's own forecast, made when it ran (``row["prediction"]``), stays in the row; the registered one is
only in the file, made earlier, before the run could inform it.

Errors are (forecast - measured) / measured: measured peak = the largest NVML peak over the row's GPUs,
measured tokens/s = the row's ``throughput.tokens_per_s`` (every GPU's together), in ``infer`` its decode's
``throughput.decode_tokens_per_s``: the planner's forecast of a generation is of its decode steps
(``fitbench.planning.planner.forecast_tokens_per_s``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fitbench.util.errors import UserError, excerpt
from fitbench.util.version import __version__

# The fields of a row's spec that name the configuration a registration forecasts
CONFIGURATION = ("model", "mode", "precision", "batch_size", "seq_len", "new_tokens", "activation_checkpointing",
                 "checkpointed_layers", "compile", "layout", "backend")


def registration(configuration: dict[str, Any], gpu: str | None, gpus: int, predicted_peak_bytes: float,
                 forecast_tokens_per_s: float, command: str) -> dict[str, Any]:
    """One registered forecast: ``configuration`` (``CONFIGURATION``'s fields, the layout as a dict), the GPU
    planned for and how many, the predicted peak per GPU and the forecast tokens/s over them, with the time
    and fitbench's version."""
    missing = [field for field in CONFIGURATION if field not in configuration]
    if missing:
        raise ValueError(f"a registration names every field of the configuration; missing: {', '.join(missing)}")
    return {"configuration": {field: configuration[field] for field in CONFIGURATION}, "gpu": gpu, "gpus": gpus,
            "predicted_peak_bytes": predicted_peak_bytes, "forecast_tokens_per_s": forecast_tokens_per_s,
            "registered_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "fitbench": __version__,
            "command": command}


def write_registrations(path: str | Path, registrations: list[dict[str, Any]]) -> Path:
    """``registrations`` as a JSON list in ``path``, which must not exist yet: a registration is not
    rewritten after the fact."""
    path = Path(path)
    if path.exists():
        raise UserError(f"preregister: {excerpt(str(path))} exists already, and a registration is not overwritten. "
                        f"Give a new file name.")
    path.write_text(json.dumps(registrations, indent=2) + "\n")
    return path


def read_registrations(path: str | Path) -> list[dict[str, Any]]:
    """The registrations ``write_registrations`` wrote; a UserError naming what is wrong otherwise."""
    try:
        registrations = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"preregistered: {excerpt(str(path))} does not exist. Give the file `fitbench plan "
                        f"--preregister FILE` wrote.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"preregistered: {excerpt(str(path))} is not JSON ({error}). Give the file `fitbench plan "
                        f"--preregister FILE` wrote.") from None
    if not isinstance(registrations, list) or not all(isinstance(entry, dict) and "configuration" in entry
                                                      for entry in registrations):
        raise UserError(f"preregistered: {excerpt(str(path))} holds no list of registrations. Give the file "
                        f"`fitbench plan --preregister FILE` wrote.")
    return registrations


def _configuration_of(row: dict[str, Any]) -> dict[str, Any]:
    spec = row.get("spec") or {}
    layout = {key: value for key, value in (spec.get("layout") or {}).items()}
    return {**{field: spec.get(field) for field in CONFIGURATION}, "layout": layout}


def _same(registered: dict[str, Any], ran: dict[str, Any]) -> bool:
    """Whether a row ran the registered configuration; a layout's degrees left out count as 1, the new
    tokens of a mode that generates none do not count, and a registration written before registrations
    named their backend matches a row of either."""
    for field in CONFIGURATION:
        if field == "backend" and field not in registered:
            continue
        if field == "layout":
            degrees = set(registered["layout"]) | set(ran["layout"])
            if any(registered["layout"].get(key, 1) != ran["layout"].get(key, 1) for key in degrees):
                return False
        elif field == "new_tokens" and registered["mode"] != "infer":
            continue
        elif registered[field] != ran[field]:
            return False
    return True


@dataclass(frozen=True)
class Paired:
    """A registration and the row that ran its configuration (None: none did)."""

    registration: dict[str, Any]
    row: dict[str, Any] | None

    @property
    def measured_peak_bytes(self) -> float | None:
        gpus = ((self.row or {}).get("memory") or {}).get("gpus") or []
        peaks = [gpu.get("nvml_peak_used") for gpu in gpus if gpu.get("nvml_peak_used")]
        return max(peaks) if peaks else None

    @property
    def measured_tokens_per_s(self) -> float | None:
        throughput = (self.row or {}).get("throughput") or {}
        if self.registration["configuration"]["mode"] == "infer":
            return throughput.get("decode_tokens_per_s")
        return throughput.get("tokens_per_s")

    @property
    def peak_error(self) -> float | None:
        """(predicted - measured) / measured peak per GPU."""
        measured = self.measured_peak_bytes
        return None if not measured else (self.registration["predicted_peak_bytes"] - measured) / measured

    @property
    def speed_error(self) -> float | None:
        """(forecast - measured) / measured tokens/s."""
        measured = self.measured_tokens_per_s
        return None if not measured else (self.registration["forecast_tokens_per_s"] - measured) / measured


def paired(registrations: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[Paired]:
    """Each registration with the first ok row that ran its configuration, in the registrations' order."""
    ok = [row for row in rows if row.get("status") == "ok"]
    return [Paired(entry, next((row for row in ok if _same(entry["configuration"], _configuration_of(row))), None))
            for entry in registrations]
