"""Host memory as this process may use it, and whether the kernel killed something for lack of it.

**Available** is the smallest of ``/proc/meminfo``'s ``MemAvailable`` (what the kernel can hand
out without swapping) and, for each memory cgroup this process is in and each above it, its limit
less its usage (cgroup v2 ``memory.max`` - ``memory.current``, v1 ``memory.limit_in_bytes`` -
``memory.usage_in_bytes``): a container's limit binds before the machine's memory does.

**OOM kills** are counted by the kernel system-wide (``/proc/vmstat`` ``oom_kill``) and per cgroup
(v2 ``memory.events``, v1 ``memory.oom_control``); a count that rose while a worker ran, before it
died of SIGKILL, says who killed it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # cgroups write "max" (v2) or a page-rounded 2**63 (v1) for no limit


@dataclass(frozen=True)
class HostMemory:
    available: float  # bytes
    source: str  # where the figure was read


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _keyed(path: Path, key: str) -> int | None:
    """The number after ``key`` in a file of ``key value`` lines (memory.events, vmstat, meminfo)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(" ")
        if name.rstrip(":") == key:
            digits = value.split()[0] if value.split() else ""
            return int(digits) if digits.isdigit() else None
    return None


def memory_cgroups() -> list[tuple[Path, int]]:
    """(directory, cgroup version) of each memory cgroup holding this process, innermost first, up to
    the mount's root (which, in a cgroup namespace, is the process's own group)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            version, mount = 2, CGROUP_ROOT if (CGROUP_ROOT / "cgroup.controllers").exists() else CGROUP_ROOT / "unified"
        elif "memory" in controllers.split(","):
            version, mount = 1, CGROUP_ROOT / "memory"
        else:
            continue
        here = mount / path.lstrip("/")
        while True:
            if here.is_dir():
                found.append((here, version))
            if here == mount or mount not in here.parents:
                break
            here = here.parent
    return found


def host_memory() -> HostMemory:
    """The memory a new process on this host may still take (module docstring)."""
    meminfo = _keyed(Path("/proc/meminfo"), "MemAvailable")
    best = HostMemory(float(meminfo * 1024), "/proc/meminfo MemAvailable") if meminfo is not None else None
    for directory, version in memory_cgroups():
        limit_file, usage_file = (("memory.max", "memory.current") if version == 2
                                  else ("memory.limit_in_bytes", "memory.usage_in_bytes"))
        limit, usage = _read_int(directory / limit_file), _read_int(directory / usage_file)
        if limit is None or usage is None or limit >= UNLIMITED:
            continue
        room = float(max(limit - usage, 0))
        if best is None or room < best.available:
            best = HostMemory(room, f"cgroup {directory / limit_file} less {usage_file}")
    if best is None:
        pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        best = HostMemory(float(pages), "sysconf free pages")
    return best


def oom_kills() -> int:
    """Out-of-memory kills the kernel has counted, system-wide and in this process's memory cgroups."""
    total = _keyed(Path("/proc/vmstat"), "oom_kill") or 0
    for directory, version in memory_cgroups():
        counter = directory / ("memory.events" if version == 2 else "memory.oom_control")
        total += _keyed(counter, "oom_kill") or 0
    return total
