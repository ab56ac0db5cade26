"""The worker's progress: one JSON object per line on stdout, which the parent shows as a live line.
Only rank 0 of a torchrun job reports progress: one progress line per job."""

from __future__ import annotations

import json

REPORTS_PROGRESS = {"on": True}


def emit(**event) -> None:
    if REPORTS_PROGRESS["on"]:
        print(json.dumps(event), flush=True)


def step_done(phase: str, i: int, n: int) -> None:
    """``run_stages``' ``on_step``: step ``i`` of ``n`` of ``phase`` (warm-up or measure) is done."""
    emit(phase=phase, step=i, of=n)
