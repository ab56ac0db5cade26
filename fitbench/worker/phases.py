"""The files a rank of a torchrun job leaves beside its result for the launcher: the phase it is in
(``PhaseLog``, read back with ``read_phase``) and, when it failed on its own, its own result.

Plain files and no torch, so that the launcher, which reads them while the job runs or after it
died, never imports torch.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fitbench.worker.ranks import Rank


def rank_result_path(result_path: Path, rank: int) -> Path:
    """Where a rank of a torchrun job that failed on its own writes its result (``result-rank1.json``):
    the other ranks wait in a collective it will never join, so no gathered result will come."""
    return result_path.with_name(f"{result_path.stem}-rank{rank}{result_path.suffix}")


def rank_phase_path(result_path: Path, rank: int) -> Path:
    """Where a rank of a torchrun job keeps the phase it is in (``result-rank1-phase.json``)."""
    return result_path.with_name(f"{result_path.stem}-rank{rank}-phase{result_path.suffix}")


@dataclass(frozen=True)
class Phase:
    """What a rank was doing: ``name``, whether that waits in collectives (``collective``: every rank
    must join them), and since when (``since``, seconds since the epoch)."""

    name: str
    collective: bool
    since: float


class PhaseLog:
    """This rank's phase: ``current``, and, for a job of several ranks, replaced in a file as it enters
    each (``rank_phase_path``). A few writes per run, none inside the timed steps."""

    def __init__(self, path: Path | None = None):
        self.path = path
        self.current: Phase | None = None

    @classmethod
    def of_rank(cls, result_path: Path, rank: Rank) -> PhaseLog:
        """The log of ``rank``; only a job of several keeps its file: a job of one has nobody to wait for."""
        return cls(rank_phase_path(result_path, rank.rank) if rank.world_size > 1 else None)

    def enter(self, name: str, *, collective: bool) -> None:
        self.current = Phase(name, collective, time.time())
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"name": name, "collective": collective, "since": self.current.since}))
        os.replace(tmp, self.path)

    def waited_out(self, timeout: timedelta) -> Phase | None:
        """The current phase when it waits in collectives and began at least ``timeout`` ago: a
        collective that fails now has waited out the process group's timeout for a rank that never
        came."""
        phase = self.current
        if phase is not None and phase.collective and time.time() - phase.since >= timeout.total_seconds():
            return phase
        return None


def read_phase(path: Path) -> Phase | None:
    """The phase a rank last entered, None when it recorded none (it never got that far) or the file
    is not one ``PhaseLog`` wrote."""
    try:
        fields = json.loads(path.read_text())
        return Phase(str(fields["name"]), bool(fields["collective"]), float(fields["since"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None
