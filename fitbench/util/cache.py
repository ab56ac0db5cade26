"""Where fitbench keeps what it measured once and reads again: ceilings, calibrations, what the installed
transformers does (its cache layout, its operators per layer), Triton's kernels."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def cache_directory() -> Path:
    """fitbench's cache: $FITBENCH_CACHE_DIR, else $XDG_CACHE_HOME/fitbench, else ~/.cache/fitbench."""
    override = os.environ.get("FITBENCH_CACHE_DIR")
    if override:
        return Path(override)
    xdg_cache = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg_cache) if xdg_cache else Path.home() / ".cache") / "fitbench"


def installed_versions(*packages: str) -> str:
    """"transformers 5.25.0, torch 2.13.0": the installed versions of ``packages``, the key under which
    what they were seen to do is kept."""
    def installed(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "none"

    return ", ".join(f"{package} {installed(package)}" for package in packages)


def remembered(file_name: str, versions: str, key: str, measure: Callable[[], dict]) -> dict:
    """``measure()``'s answer for ``key`` under ``versions``, read from ``file_name`` in the cache
    directory when an earlier run kept it there, else measured and kept. The file maps versions to keys
    to answers, so an upgrade measures again and a downgrade finds its answers still there; a damaged
    file or an unwritable directory costs a measurement, nothing else."""
    path = cache_directory() / file_name
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    stored = stored if isinstance(stored, dict) else {}
    known = stored.get(versions)
    if isinstance(known, dict) and isinstance(known.get(key), dict):
        return known[key]
    answer = measure()
    if not isinstance(known, dict):
        stored[versions] = known = {}
    known[key] = answer
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # written beside and renamed over: planners in parallel never read half a file
        scratch = path.with_name(f"{path.name}.{os.getpid()}")
        scratch.write_text(json.dumps(stored, indent=1))
        os.replace(scratch, path)
    except OSError:
        pass
    return answer
