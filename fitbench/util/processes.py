"""A worker's process tree ends with the worker, and the worker ends with its parent.

Two ways to find what a worker started, because either alone misses some: the parent links in
``/proc`` (a descendant in its own session, which ``killpg`` misses, is still a descendant; one
whose parent already died is not, it was handed to init), and a token in the environment that the
worker and everything it starts inherit (found wherever the process now hangs in the tree). The
worker makes itself a child subreaper, so while it lives its orphaned descendants stay its own.

The worker side (``tie_to_parent``): a parent-death signal on Linux (``PR_SET_PDEATHSIG``) and, as
the fallback where there is none or it raced the parent's death, a thread that polls the parent's
PID. A worker whose parent died ends its tree, removes its scratch directory (the parent can no
longer) and exits.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

TOKEN_VARIABLE = "FITBENCH_RUN_TOKEN"
PARENT_VARIABLE = "FITBENCH_PARENT_PID"
PARENT_POLL_S = 0.5
# prctl(2) options
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _proc_files(name: str) -> Iterator[tuple[int, bytes]]:
    """(PID, contents of ``/proc/<PID>/<name>``) of every process whose file this user can read;
    nothing where there is no ``/proc``."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            yield int(entry), Path(f"/proc/{entry}/{name}").read_bytes()
        except OSError:
            continue  # the process ended meanwhile, or is another user's


def _parents() -> dict[int, int]:
    """PID -> parent PID of every process ``/proc`` shows (empty where there is no ``/proc``)."""
    # the command name, in parentheses, may itself hold spaces and parentheses
    return {pid: int(stat[stat.rfind(b")") + 2:].split()[1]) for pid, stat in _proc_files("stat")}


def descendants(roots: set[int]) -> set[int]:
    """Every process below ``roots`` by parent links, the roots excluded."""
    children: dict[int, list[int]] = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    found, frontier = set(), list(roots)
    while frontier:
        for child in children.get(frontier.pop(), ()):
            if child not in found and child not in roots:
                found.add(child)
                frontier.append(child)
    return found


def carrying(token: str) -> set[int]:
    """Processes whose environment holds ``TOKEN_VARIABLE=token``, or a token derived from it
    (``token.rank1``: ``rank_token``) (those of other users are unreadable, and not ours)."""
    needle = f"{TOKEN_VARIABLE}={token}".encode()
    derived = needle + b"."
    return {pid for pid, environment in _proc_files("environ")
            if any(variable == needle or variable.startswith(derived) for variable in environment.split(b"\0"))}


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(root: int | None, token: str | None = None) -> set[int]:
    """SIGKILL ``root``, every descendant and every process carrying ``token``; returns their PIDs.

    Each one found is stopped first, and the search repeats until it finds none new, so a process
    cannot start another between being found and being killed. This process is spared (a worker
    ends its own tree before it exits). ``root``'s process group is killed too, for systems without
    ``/proc``."""
    me, seen = os.getpid(), set()
    while True:
        found = ({root} if root is not None else set()) | (carrying(token) if token else set())
        found |= descendants(found | seen)
        new = found - seen - {me}
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        seen |= new
    for pid in seen:
        _signal(pid, signal.SIGKILL)
    if root is not None and root != me:
        try:
            os.killpg(root, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return seen


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def rank_token() -> None:
    """Give this rank of a torchrun job a token of its own, derived from the job's (``token.rank1``), for
    what it starts from now on: ``end_own_tree`` then ends what this rank started and spares torchrun's
    agent and the other ranks, which carry the job's token; the parent's search still finds all."""
    token, rank = os.environ.get(TOKEN_VARIABLE), os.environ.get("RANK")
    if token and rank is not None:
        os.environ[TOKEN_VARIABLE] = f"{token}.rank{rank}"


def end_own_tree() -> None:
    """Kill everything this process started, wherever it now runs (its own sessions included). A rank
    (``rank_token``) searches by its own token, which the processes it started carry and it does not."""
    kill_tree(os.getpid(), os.environ.get(TOKEN_VARIABLE))


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists and has not exited (a zombie, exited but not yet reaped, has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        # /proc/PID/stat: "PID (COMMAND) STATE ...", where COMMAND may itself hold spaces and parentheses
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def tie_to_parent(scratch: Path) -> None:
    """Make this worker die with the parent named by ``PARENT_VARIABLE`` (nothing when it is unset: a
    worker started by hand), and with its direct parent (torchrun's agent, for a rank). On the parent's death, by any signal, or on a SIGTERM: end this
    process's tree, remove ``scratch`` and exit 128 + SIGTERM. The scratch directory goes whoever
    sent the SIGTERM: the parent-death signal arrives before ``getppid`` shows the new parent, and a
    living parent's own cleanup does not mind it gone."""
    named = os.environ.get(PARENT_VARIABLE)
    if not named:
        return
    parent = int(named)
    ending = threading.Lock()

    rank = "RANK" in os.environ  # torchrun's: the scratch directory is the job's, shared by its ranks

    def abandon() -> None:
        if not ending.acquire(blocking=False):
            return  # the signal handler or the watch thread is already at it, and exits
        end_own_tree()
        # torchrun ends the other ranks when one fails, while the sweep's parent lives: it still has to
        # read the failed rank's result from the scratch directory, and removes it itself
        if not (rank and _alive(parent)):
            shutil.rmtree(scratch, ignore_errors=True)
        os._exit(128 + signal.SIGTERM)

    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGTERM, lambda signum, frame: abandon())
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    # Under torchrun the direct parent is torchrun's agent, itself the named parent's child: the
    # signal covers the agent's death, the watch the named parent's.
    direct = os.getppid()
    if direct == 1 or not _alive(parent):  # a parent died before the signal was armed
        abandon()

    def watch() -> None:
        while os.getppid() == direct and _alive(parent):
            time.sleep(PARENT_POLL_S)
        abandon()

    threading.Thread(target=watch, name="fitbench-parent-watch", daemon=True).start()
