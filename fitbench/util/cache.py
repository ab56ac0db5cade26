"""Where fitbench keeps what it measured once and reads again: ceilings, calibrations, transformers'
cache layouts, Triton's kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_directory() -> Path:
    """fitbench's cache: $FITBENCH_CACHE_DIR, else $XDG_CACHE_HOME/fitbench, else ~/.cache/fitbench."""
    override = os.environ.get("FITBENCH_CACHE_DIR")
    if override:
        return Path(override)
    xdg_cache = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg_cache) if xdg_cache else Path.home() / ".cache") / "fitbench"
