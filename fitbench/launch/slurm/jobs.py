"""Submitted jobs: submission through ``sbatch --parsable``, state through ``squeue`` and ``sacct``,
cancellation through ``scancel``.

A job's state is one of ``STATES``, SLURM's own names for where a job stands (``squeue``'s manual,
"JOB STATE CODES"); SLURM's other, passing states count as the one a row would show for them
(``STATE_OF``: a job still completing holds its nodes, RUNNING; a requeued one waits, PENDING; a
boot failure is its node's, NODE_FAIL; a deadline passed is a time limit, TIMEOUT). Each state comes
with SLURM's reason (``squeue``'s ``%r``: why a job waits or ended, ``TimeLimit``, ``Priority``), or
None where SLURM gives none.

``squeue`` answers for jobs that slurmctld still holds: pending and running ones, and finished
ones for ``MinJobAge`` seconds (300 by default). ``sacct`` answers for older ones where the cluster
keeps accounting (slurmdbd); where it does not, such a job has no known state.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fitbench.launch.slurm.sizing import NodeShape
from fitbench.util.errors import UserError, excerpt_words

State = Literal["PENDING", "RUNNING", "COMPLETED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "CANCELLED",
                "PREEMPTED", "FAILED"]
STATES: tuple[State, ...] = ("PENDING", "RUNNING", "COMPLETED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                             "CANCELLED", "PREEMPTED", "FAILED")
STATE_OF: dict[str, State] = {
    **{state: state for state in STATES},
    "CONFIGURING": "RUNNING", "COMPLETING": "RUNNING", "STAGE_OUT": "RUNNING", "SIGNALING": "RUNNING",
    "RESIZING": "RUNNING", "SUSPENDED": "RUNNING", "STOPPED": "RUNNING",
    "REQUEUED": "PENDING", "REQUEUE_FED": "PENDING", "REQUEUE_HOLD": "PENDING", "RESV_DEL_HOLD": "PENDING",
    "BOOT_FAIL": "NODE_FAIL", "DEADLINE": "TIMEOUT", "SPECIAL_EXIT": "FAILED", "REVOKED": "FAILED",
}
FINISHED: frozenset[State] = frozenset(STATES) - {"PENDING", "RUNNING"}
COMMAND_TIMEOUT_S = 60.0
# A controller too busy to answer (slurmctld paused, restarting, or past its MessageTimeout, 10 s by
# default: slurm.conf's manual) makes the commands print one of these; they are asked again, with
# backoff, for GIVE_UP_S. sbatch only on the first two: after a timeout a job may have been taken.
UNREACHABLE = ("Unable to contact slurm controller", "Connection refused", "Socket timed out",
               "Zero Bytes were transmitted", "Transport endpoint is not connected", "Connection timed out")
SUBMIT_UNREACHABLE = UNREACHABLE[:2]
GIVE_UP_S = 300.0
RETRY_FIRST_WAIT_S = 1.0
RETRY_MAX_WAIT_S = 30.0
# sacct's answer where the cluster keeps no accounting
NO_ACCOUNTING = "accounting storage is disabled"


class SlurmCommandError(UserError):
    """A SLURM command failed for a reason of the cluster's, not of the user's input: its message is
    one paragraph, the command and what it printed. Before anything is submitted it ends the run as
    bad input does (exit 2); while jobs are followed, ``fitbench run`` exits 1 and the jobs go on."""


@dataclass(frozen=True)
class JobStatus:
    """Where one job (or one task of an array, ``123_4``) stands: ``state`` one of ``STATES``,
    ``slurm_state`` as SLURM wrote it, ``reason`` SLURM's why, None where it gives none."""

    job_id: str
    state: State
    slurm_state: str
    reason: str | None

    @property
    def finished(self) -> bool:
        return self.state in FINISHED


def require_command(name: str) -> None:
    """A ``UserError`` unless SLURM's command ``name`` is on PATH."""
    if shutil.which(name) is None:
        raise UserError(f"launcher: {name} is not on PATH, and the slurm launcher submits and follows jobs "
                        f"with SLURM's commands (sbatch, squeue, sacct, scancel). Run fitbench on a login node "
                        f"of the cluster, or add SLURM's client commands to PATH; --dry-run prints the batch "
                        f"scripts without them.")


def check_partition(name: str) -> None:
    """A ``UserError`` unless the cluster has a partition ``name`` (as ``sinfo`` lists them)."""
    done = _run(["sinfo", "--noheader", "--format=%R"])
    if done.returncode != 0:
        raise SlurmCommandError(f"sinfo exited {done.returncode}: {' '.join(done.stderr.split())}")
    known = sorted(set(done.stdout.split()))
    if name not in known:
        raise UserError(f"partition: the cluster has no partition {name!r}; it has {', '.join(known) or 'none'} "
                        f"(`sinfo` lists them). Give one of those to --partition, or leave it out for the "
                        f"cluster's default.")


def partition_gpus(partition: str | None) -> list[tuple[str | None, int]]:
    """The GPUs of the nodes of ``partition`` (None: the cluster's default), as ``sinfo`` lists their
    GRES (``parse_gres``)."""
    done = _run(["sinfo", "--noheader", "--format=%P|%G"])
    if done.returncode != 0:
        raise SlurmCommandError(f"sinfo exited {done.returncode}: {' '.join(done.stderr.split())}")
    return parse_gres(done.stdout, partition)


def partition_node(partition: str | None) -> NodeShape | None:
    """The smallest node of ``partition`` (None: the default one) as ``sinfo`` lists it: its CPUs, memory
    and GPUs (``NodeShape``); None where ``sinfo`` is not here or cannot answer."""
    try:
        done = _run(["sinfo", "--noheader", "--format=%P|%c|%m|%G"], patient=False)
    except (UserError, SlurmCommandError):
        return None
    shapes = []
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        fields = line.strip().split("|")
        if len(fields) != 4 or not fields[1].rstrip("+").isdigit() or not fields[2].rstrip("+").isdigit():
            continue
        counts = [count for _, count in parse_gres(f"{fields[0]}|{fields[3]}", partition)]
        if fields[0].rstrip("*") == partition if partition is not None else fields[0].endswith("*"):
            shapes.append(NodeShape(int(fields[1].rstrip("+")), int(fields[2].rstrip("+")), min(counts, default=None)))
    if not shapes:
        return None
    gpus = [shape.gpus for shape in shapes if shape.gpus]
    return NodeShape(min(shape.cpus for shape in shapes), min(shape.memory_mb for shape in shapes),
                     min(gpus) if len(gpus) == len(shapes) else None)


def parse_gres(text: str, partition: str | None) -> list[tuple[str | None, int]]:
    """Lines of ``PARTITION|GRES`` (``sinfo``'s ``%P|%G``: ``gpu*|gpu:h100:8(S:0-1),nvme:1``) -> the GPUs
    of ``partition``'s nodes (None: the default partition, the one ``sinfo`` marks ``*``): one (type,
    count per node) for each kind of node, the type None where the GRES names none; empty where the
    nodes have no GPU."""
    found: dict[tuple[str | None, int], None] = {}
    for line in text.splitlines():
        name, _, gres = line.strip().partition("|")
        ours = name.rstrip("*") == partition if partition is not None else name.endswith("*")
        if not ours:
            continue
        for entry in gres.split(","):
            fields = entry.split("(")[0].split(":")
            if fields[0] == "gpu" and len(fields) in (2, 3) and fields[-1].isdigit():
                found[(fields[1] if len(fields) == 3 else None, int(fields[-1]))] = None
    return list(found)


def _run(argv: list[str], *, cwd: Path | None = None, busy: tuple[str, ...] = UNREACHABLE,
         patient: bool = True) -> subprocess.CompletedProcess:
    """``argv`` run once, and again while SLURM's controller does not answer (an error of ``busy``, or,
    but for sbatch, whose job may have been taken, no answer within ``COMMAND_TIMEOUT_S``), after 1, 2,
    4 ... s, at most ``RETRY_MAX_WAIT_S`` apart, for ``GIVE_UP_S`` in all (once where not ``patient``);
    then a ``SlurmCommandError`` of one paragraph. Any other answer, failed or not, is returned."""
    require_command(argv[0])
    deadline, wait = time.monotonic() + GIVE_UP_S, RETRY_FIRST_WAIT_S
    while True:
        try:
            done = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, stdin=subprocess.DEVNULL,
                                  timeout=COMMAND_TIMEOUT_S)
            if done.returncode == 0 or not any(sign in done.stderr for sign in busy):
                return done
            said = " ".join(done.stderr.split())
        except subprocess.TimeoutExpired:
            said = f"no answer within {COMMAND_TIMEOUT_S:.0f} s"
            if argv[0] == "sbatch":
                raise SlurmCommandError(f"sbatch: SLURM's controller did not answer within {COMMAND_TIMEOUT_S:.0f} s, "
                                        f"and the job may have been taken: `squeue --me` shows it. Where it is not "
                                        f"there, `fitbench run --resume` with the sweep's directory submits it again.")
        if not patient or time.monotonic() + wait > deadline:
            raise SlurmCommandError(
                f"{argv[0]}: SLURM's controller did not answer{f' for {GIVE_UP_S / 60:.0f} minutes' if patient else ''}"
                f" ({excerpt_words(said)}). Jobs already submitted go on without this process: once `sinfo` answers, "
                f"`fitbench run --resume` with the sweep's directory follows them again and collects their rows.")
        time.sleep(wait)
        wait = min(2 * wait, RETRY_MAX_WAIT_S)


def submit(script: Path, *, cwd: Path | None = None) -> str:
    """Submit the batch script at ``script`` from ``cwd``; its job id (an array's id for an array).
    A script that sbatch refuses (an unknown partition or account, a limit the partition does not
    allow) is the user's input: ``UserError`` with sbatch's own words."""
    done = _run(["sbatch", "--parsable", str(script)], cwd=cwd, busy=SUBMIT_UNREACHABLE)
    if done.returncode != 0:
        said = excerpt_words(" ".join(done.stderr.split()) or f"exit status {done.returncode}")
        raise UserError(f"sbatch refused the job of {script}: {said}. Check its "
                        f"#SBATCH lines against what `sinfo` lists (partitions, their time limits) and your "
                        f"accounts, then fix the option it names.")
    # --parsable: "ID" or "ID;CLUSTER"
    return done.stdout.strip().split(";")[0]


def parse_states(text: str) -> dict[str, JobStatus]:
    """Lines of ``ID|STATE|REASON`` (as ``squeue``'s ``%i|%T|%r`` and sacct's ``--parsable2`` write them)
    -> status per id. sacct's job steps (``123.batch``, ``123.0``) are left out, its ``CANCELLED by
    UID`` is CANCELLED, and a state SLURM adds that ``STATE_OF`` does not know counts as FAILED."""
    statuses = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) < 3 or "." in fields[0] or not fields[1].split():
            continue
        job_id, slurm_state, reason = fields[0], fields[1].split()[0], fields[2].strip()
        statuses[job_id] = JobStatus(job_id, STATE_OF.get(slurm_state, "FAILED"), slurm_state,
                                     None if reason in ("", "None") else reason)
    return statuses


def statuses(job_ids: Iterable[str]) -> dict[str, JobStatus]:
    """The status of each job in ``job_ids`` that SLURM still knows; an array's id stands for every
    task of it, each under its own id (``123_0``, ``123_1``)."""
    wanted = sorted(set(job_ids))
    if not wanted:
        return {}
    found = _squeue(wanted)
    missing = [job_id for job_id in wanted if not any(_of_job(key, job_id) for key in found)]
    return {**found, **_sacct(missing)} if missing else found


def _of_job(key: str, job_id: str) -> bool:
    return key == job_id or key.startswith(job_id + "_")


def _squeue(job_ids: list[str]) -> dict[str, JobStatus]:
    done = _run(["squeue", "--noheader", "--array", "--states=all", f"--jobs={','.join(job_ids)}",
                 "--format=%i|%T|%r"])
    if done.returncode == 0:
        return parse_states(done.stdout)
    # squeue refuses the whole list when one id is unknown to slurmctld (finished past MinJobAge)
    if "Invalid job id" in done.stderr:
        return {} if len(job_ids) == 1 else {key: status for job_id in job_ids
                                            for key, status in _squeue([job_id]).items()}
    raise SlurmCommandError(f"squeue exited {done.returncode}: {' '.join(done.stderr.split())}")


def _sacct(job_ids: list[str]) -> dict[str, JobStatus]:
    done = _run(["sacct", "--noheader", "--parsable2", f"--jobs={','.join(job_ids)}", "--format=JobID,State,Reason"])
    if NO_ACCOUNTING in done.stderr + done.stdout:
        return {}
    if done.returncode != 0:
        raise SlurmCommandError(f"sacct exited {done.returncode}: {' '.join(done.stderr.split())}")
    return parse_states(done.stdout)


def queued_scripts(name: str) -> list[tuple[str, str | None, Path]]:
    """This user's pending and running jobs named ``name``: (id, array task or None, the batch script's
    path), each task of an array apart (``squeue --me --array``: ``%i``, ``%K``, ``%o`` the command, in
    ``%Z`` the directory it was submitted from)."""
    done = _run(["squeue", "--me", "--noheader", "--array", f"--name={name}", "--states=PENDING,RUNNING",
                 "--format=%i|%K|%Z|%o"])
    if done.returncode != 0:
        raise SlurmCommandError(f"squeue exited {done.returncode}: {' '.join(done.stderr.split())}")
    found = []
    for line in done.stdout.splitlines():
        fields = line.strip().split("|", 3)
        if len(fields) == 4 and fields[0]:
            task = fields[1] if fields[1].isdigit() else None
            found.append((fields[0], task, Path(fields[2]) / fields[3]))
    return found


def cancel(job_ids: Iterable[str]) -> None:
    """Cancel the jobs (an array's id cancels every task of it); a job already finished is left as it is."""
    wanted = sorted(set(job_ids))
    if not wanted:
        return
    done = _run(["scancel", *wanted])
    if done.returncode != 0 and "already completing or completed" not in done.stderr:
        raise SlurmCommandError(f"scancel exited {done.returncode}: {' '.join(done.stderr.split())}")
