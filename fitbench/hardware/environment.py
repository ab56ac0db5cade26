"""Provenance of a run (``environment``): versions, driver, GPUs, CPU and host, so that a result
file says where it came from."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
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


def _git_bytes(*args: str, root: pathlib.Path | None = None, allowed: tuple[int, ...] = (0,)) -> bytes | None:
    """Output of a git command run in ``root``, by default the directory holding the package; None when
    git is missing or exits with a status not ``allowed``."""
    root = root or pathlib.Path(__file__).resolve().parents[2]  # fitbench/hardware/environment.py -> the checkout
    try:
        completed = subprocess.run(["git", *args], cwd=root, capture_output=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return completed.stdout if completed.returncode in allowed else None


def _git(*args: str, root: pathlib.Path | None = None) -> str | None:
    """``_git_bytes`` as text, stripped."""
    output = _git_bytes(*args, root=root)
    return None if output is None else output.decode(errors="replace").strip()


def _git_provenance(root: pathlib.Path | None = None) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout fitbench runs from (``root``), (None, None) if none.

    An installed copy in site-packages may sit inside some unrelated repository
    (a virtualenv in a project, say), so the commit only counts if git tracks
    this very package in it.
    """
    commit = _git("rev-parse", "HEAD", root=root)
    if not commit or _git("ls-files", "--error-unmatch", "fitbench/__init__.py", root=root) is None:
        return None, None
    status = _git("status", "--porcelain", root=root)
    return commit, (None if status is None else status != "")


# What a row's diff covers: the package's code and its pins, the code that produces the row. Results a
# sweep writes inside the checkout change while it runs and are not code.
CODE_PATHS = ("fitbench", "pyproject.toml")


def code_diff(root: pathlib.Path | None = None) -> bytes | None:
    """The checkout's changes to ``CODE_PATHS`` against its commit: ``git diff HEAD --binary``, then each
    file there that git neither tracks nor ignores as an addition (``git diff --no-index --binary
    /dev/null FILE``), in path order. Empty for unchanged code; None outside a checkout of fitbench
    (``_git_provenance``)."""
    commit, _ = _git_provenance(root)
    tracked = _git_bytes("diff", "HEAD", "--binary", "--", *CODE_PATHS, root=root) if commit else None
    if tracked is None:
        return None
    listed = _git("ls-files", "--others", "--exclude-standard", "--", *CODE_PATHS, root=root) or ""
    added = [_git_bytes("diff", "--no-index", "--binary", "/dev/null", path, root=root, allowed=(0, 1)) or b""
             for path in sorted(filter(None, listed.splitlines()))]
    return tracked + b"".join(added)


def diff_sha256(diff: bytes | None) -> str | None:
    """The SHA-256 of a ``code_diff``, as hex; None for unchanged code or no checkout."""
    return hashlib.sha256(diff).hexdigest() if diff else None


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
    diff = code_diff() if git_dirty else None
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return {
        "fitbench_version": __version__,
        "git_commit": git_commit,
        "git_dirty": git_dirty,
        # the code's changes, which a sweep saves as diffs/<this>.diff in its directory (fitbench.api)
        "git_diff_sha256": diff_sha256(diff),
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
