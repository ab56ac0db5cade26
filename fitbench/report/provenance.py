"""Where a sweep's rows came from, as (what, value) lines every report shows: the devices, the
versions, the commands, when it ran, the calibration the planner used, the directory. A command's
``--out`` and ``--resume`` directories are the machine's own paths, which say nothing to a reader of a
shared page: they read ``DIR`` (``shareable``)."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from fitbench.results.directories import SweepRows


def _joined(values: list[Any]) -> str:
    return "; ".join(dict.fromkeys(str(value) for value in values if value)) or "-"


def shareable(command: str | None) -> str | None:
    """``command`` with the directory of its ``--out`` or ``--resume`` written ``DIR``."""
    return None if command is None else re.sub(r"(--out|--resume)(=|\s+)\S+", r"\1\2DIR", command)


def provenance(sweep: SweepRows) -> list[tuple[str, str]]:
    rows = sweep.rows
    environments = [row.environment for row in rows if row.environment]
    devices = []
    for env in environments:
        names = Counter(gpu.get("name") for gpu in env.get("gpus") or [] if gpu.get("name"))
        devices.append(", ".join(f"{count} x {name}" for name, count in names.items())
                       or f"CPU: {env.get('cpu_model') or 'unknown'}")

    def versions(env: dict[str, Any]) -> str:
        return (f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), transformers {env.get('transformers')}, "
                f"driver {env.get('driver')}, Python {env.get('python')}")

    started = sorted(row.started_at for row in rows if row.started_at)
    finished = sorted(row.finished_at for row in rows if row.finished_at)
    return [
        ("devices", _joined(devices)),
        ("versions", _joined([versions(env) for env in environments])),
        ("fitbench", _joined([f"{env.get('fitbench_version')} (commit {env.get('git_commit') or 'none'}"
                              f"{', with changes' if env.get('git_dirty') else ''})" for env in environments])),
        ("commands", _joined([shareable(sweep.command)] + [shareable(row.command) for row in rows])),
        ("ran", f"{started[0]} to {finished[-1]}" if started and finished else "-"),
        ("host", _joined([env.get("hostname") for env in environments])),
        ("calibration", _joined([row.calibration for row in rows])),
        ("rows", f"{len(rows)} from {sweep.directory}" + (f"; {len(sweep.warnings)} damaged line(s), see the "
                                                           f"warnings" if sweep.warnings else "")),
    ]
