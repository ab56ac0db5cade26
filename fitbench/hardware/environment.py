"""Provenance of a run (``environment``): versions, driver, GPUs, CPU and host, so that a result
file says where it came from."""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import pathlib
import platform
import socket
import subprocess
import sys
from datetime import datetime, timezone

import psutil

from fitbench.hardware.devices import cpu_model, detect_gpus, driver_version
from fitbench.util.version import __version__


@functools.cache
def package_version(distribution: str) -> str | None:
    """The installed ``distribution``'s version from its metadata; None where it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_version() -> str:
    """The running torch's version, ``torch.__version__``: read from the installed package's metadata
    (the same string for a wheel) while torch is not imported yet, so that asking imports nothing."""
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__
    version = package_version("torch")
    if version is None:
        import torch

        return torch.__version__
    return version


def _git(*args: str) -> str | None:
    """Output of a git command run in the directory holding the package."""
    source_root = pathlib.Path(__file__).resolve().parents[2]  # fitbench/hardware/environment.py -> the checkout
    try:
        completed = subprocess.run(
            ["git", *args],
            cwd=source_root,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return completed.stdout.strip()


def _git_provenance() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout fitbench runs from, (None, None) if none.

    An installed copy in site-packages may sit inside some unrelated repository
    (a virtualenv in a project, say), so the commit only counts if git tracks
    this very package in it.
    """
    commit = _git("rev-parse", "HEAD")
    if not commit or _git("ls-files", "--error-unmatch", "fitbench/__init__.py") is None:
        return None, None
    status = _git("status", "--porcelain")
    return commit, (None if status is None else status != "")


def _cudnn_version() -> int | None:
    import torch

    try:
        return torch.backends.cudnn.version()
    except RuntimeError:
        return None


def utc_now() -> str:
    """Now, in UTC, to the second, as ISO 8601."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def environment() -> dict:
    """Provenance of a run, as a JSON-serialisable dict."""
    import torch

    git_commit, git_dirty = _git_provenance()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return {
        "fitbench_version": __version__,
        "git_commit": git_commit,
        "git_dirty": git_dirty,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "accelerate": package_version("accelerate"),
        "torch_cuda": torch.version.cuda,
        "cudnn": _cudnn_version(),
        "driver": driver_version(),
        "gpus": [
            {**dataclasses.asdict(gpu), "compute_capability": list(gpu.compute_capability)}
            for gpu in detect_gpus()
        ],
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity_count": None if affinity is None else len(affinity),
        "host_memory_bytes": psutil.virtual_memory().total,
        "hostname": socket.gethostname(),
        # the node's name where SLURM started this process (a node may be named apart from its host)
        "slurm_node": os.environ.get("SLURMD_NODENAME"),
        "platform": platform.platform(),
        "time_utc": utc_now(),
    }
