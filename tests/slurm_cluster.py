"""A real SLURM cluster of two CPU nodes on this host, for tests: munged, slurmctld and two slurmd.

Nothing is installed or changed outside one temporary directory: the daemons run in the foreground
as this process's children (no systemd), each told its files by options and by a ``slurm.conf``
written there, which the SLURM commands find through ``SLURM_CONF``. The two nodes are two slurmd
of this host under node names of their own (``slurmd -N``), each on its own port; the first is
named as this host, so that a job's first host, as ``scontrol show hostnames`` gives it, resolves
to this host as a rendezvous endpoint does on a real cluster (SLURM itself renames a node called
``localhost``).

What the configuration chooses, and why:

- ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``: no cgroups, which a container or
  a CI machine may not delegate;
- ``SlurmdParameters=config_overrides``: each node declares ``CPUS_PER_NODE`` CPUs and some memory
  whatever this host has, so a job array can run tasks side by side on a machine of two cores;
- ``AccountingStorageType=accounting_storage/none``: ``sacct`` needs slurmdbd and a database, and
  answers "Slurm accounting storage is disabled" otherwise; ``MinJobAge`` keeps every finished job
  in slurmctld's memory for the session, where ``squeue --states=all`` reads its state and reason;
- ``SchedulerParameters=batch_sched_delay=0``: slurmctld schedules a batch job (the next task of an
  array held by its limit, too) at its next pass, every second, instead of up to 3 s later, its
  default; the tests' jobs and sweeps then wait on SLURM a quarter less;
- ``OverTimeLimit=0``, ``KillWait``: a job past its time limit is killed at once, within the
  controller's periodic check (every 30 s), so a one-minute limit ends a job in 60 to 90 s.

munged wants its key private and its socket's directory open to all (execute permission), so the
directory is made readable by all and the key kept in a private one inside it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "squeue", "scancel", "sinfo", "scontrol", "srun")
# SLURM sorts a node list by name: the first node is this host's name, which resolves here
HOST = socket.gethostname().split(".")[0]
NODES = (HOST, f"{HOST}-2")
PARTITION = "debug"
CPUS_PER_NODE = 4
MEMORY_MB = 2000
START_S = 60.0
STOP_S = 30.0
POLL_S = 0.2


def missing_programs() -> list[str]:
    """The daemons and commands the cluster needs that are not on PATH (Debian: slurm-wlm, munge)."""
    return [name for name in (*DAEMONS, *COMMANDS) if shutil.which(name) is None]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def slurm_conf(directory: Path, controller_port: int, node_ports: list[int]) -> str:
    """The cluster's ``slurm.conf``: every file the daemons write lies under ``directory``."""
    user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={HOST} NodeAddr=127.0.0.1 Port={port} "
        f"CPUs={CPUS_PER_NODE} RealMemory={MEMORY_MB} State=UNKNOWN"
        for name, port in zip(NODES, node_ports))
    return f"""\
ClusterName=fitbench
SlurmctldHost={HOST}(127.0.0.1)
SlurmctldPort={controller_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={directory}/run/munge.socket
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool/%n
SlurmctldPidFile={directory}/run/slurmctld.pid
SlurmdPidFile={directory}/run/slurmd-%n.pid
SlurmctldLogFile={directory}/log/slurmctld.log
SlurmdLogFile={directory}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=86400
OverTimeLimit=0
KillWait=2
MpiDefault=none
SwitchType=switch/none
{nodes}
PartitionName={PARTITION} Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    """A running cluster: ``environment`` holds the ``SLURM_CONF`` its commands need."""

    directory: Path
    daemons: list[subprocess.Popen] = field(default_factory=list)

    @property
    def environment(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.directory / "slurm.conf")}

    def command(self, *argv: str) -> str:
        """A SLURM command's output on this cluster; its error output in the exception if it fails."""
        done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **self.environment},
                              timeout=STOP_S)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def logs(self) -> str:
        """The daemons' logs, last lines of each, for a failure's message."""
        return "\n".join(f"== {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-20:])
                         for path in sorted((self.directory / "log").glob("*.log")))

    def start(self) -> None:
        """Write the configuration, start the daemons and wait until every node is idle."""
        for name in ("run", "state", "log", "spool", "munge"):
            (self.directory / name).mkdir()
        self.directory.chmod(0o755)
        (self.directory / "run").chmod(0o755)
        (self.directory / "munge").chmod(0o700)
        key = self.directory / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        ports = [_free_port() for _ in range(1 + len(NODES))]
        conf = self.directory / "slurm.conf"
        conf.write_text(slurm_conf(self.directory, ports[0], ports[1:]))
        self._start("munged", "--foreground", f"--key-file={key}", f"--socket={self.directory}/run/munge.socket",
                    f"--pid-file={self.directory}/run/munged.pid", f"--seed-file={self.directory}/munge/seed",
                    f"--log-file={self.directory}/log/munged.log")
        self._wait(lambda: (self.directory / "run" / "munge.socket").exists(), "munged to open its socket")
        self._start("slurmctld", "-D", "-i", "-f", str(conf))
        for name in NODES:
            self._start("slurmd", "-D", "-N", name, "-f", str(conf))
        self._wait(self._idle, "every node to be idle")

    @property
    def controller(self) -> subprocess.Popen:
        return next(daemon for daemon in reversed(self.daemons) if daemon.args[0] == "slurmctld")

    def pause_controller(self) -> None:
        """Stop slurmctld (SIGSTOP) where it stands: the commands wait for it, then time out."""
        self.controller.send_signal(signal.SIGSTOP)

    def resume_controller(self) -> None:
        self.controller.send_signal(signal.SIGCONT)

    def stop_controller(self) -> None:
        """End slurmctld (SIGTERM: it saves its state, as a restart by an administrator does)."""
        controller = self.controller
        controller.send_signal(signal.SIGTERM)
        controller.wait(timeout=STOP_S)
        self.daemons.remove(controller)

    def start_controller(self) -> None:
        """Start slurmctld again from its saved state, until it answers; the nodes and their jobs find it
        again. One started while the old one's port is still held exits at once: it is started again."""
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            self._start("slurmctld", "-D", "-f", str(self.directory / "slurm.conf"))
            controller = self.controller
            while controller.poll() is None and time.monotonic() < deadline:
                if self._answers():
                    return
                time.sleep(POLL_S)
            if controller.poll() is None:
                controller.kill()
                controller.wait()
            self.daemons.remove(controller)
            time.sleep(1)
        raise RuntimeError(f"slurmctld did not start again within {START_S:.0f} s\n{self.logs()}")

    def _answers(self) -> bool:
        try:
            self.command("squeue", "--noheader")
        except (RuntimeError, subprocess.TimeoutExpired):
            return False
        return True

    def _start(self, *argv: str) -> None:
        # what a daemon prints before its log file is open (a configuration it cannot read) joins the logs
        with (self.directory / "log" / f"{argv[0]}-{len(self.daemons)}-output.log").open("w") as output:
            self.daemons.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                                                 env={**os.environ, **self.environment}))

    def _idle(self) -> bool:
        try:
            states = self.command("sinfo", "--noheader", "--Node", "--format=%t").split()
        except RuntimeError:
            return False
        return len(states) == len(NODES) and set(states) == {"idle"}

    def _wait(self, ready, what: str, within: float = START_S) -> None:
        deadline = time.monotonic() + within
        while not ready():
            ended = [daemon.args[0] for daemon in self.daemons if daemon.poll() is not None]
            if ended or time.monotonic() > deadline:
                reason = f"{', '.join(ended)} exited" if ended else f"not within {within:.0f} s"
                raise RuntimeError(f"waiting for {what}: {reason}\n{self.logs()}")
            time.sleep(POLL_S)

    def stop(self) -> None:
        """Cancel every job, wait until none holds a node, end the daemons and whatever a job left."""
        if all(daemon.poll() is None for daemon in self.daemons):
            try:
                jobs = sorted(set(self.command("squeue", "--noheader", "--format=%A").split()))
                if jobs:
                    self.command("scancel", *jobs)
                self._wait(lambda: not self.command("squeue", "--noheader", "--states=RUNNING,COMPLETING,PENDING"),
                           "every job to end", within=STOP_S)
            except RuntimeError:
                pass
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGCONT)  # a test may have left it paused
                daemon.send_signal(signal.SIGTERM)
        for daemon in reversed(self.daemons):
            try:
                daemon.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        for pid in step_daemons(self.directory):
            os.kill(pid, signal.SIGKILL)


def step_daemons(directory: Path) -> list[int]:
    """slurmstepd processes of the cluster in ``directory``: each holds its node's log file open, and
    outlives slurmd by design (a slurmd restart leaves jobs running)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if not Path(f"/proc/{entry}/cmdline").read_bytes().startswith(b"slurmstepd"):
                continue
            targets = [os.readlink(fd) for fd in Path(f"/proc/{entry}/fd").iterdir()]
        except OSError:
            continue
        if any(target.startswith(str(directory)) for target in targets):
            found.append(int(entry))
    return found


def start_cluster() -> SlurmCluster:
    """A started cluster in a new temporary directory; ``stop_cluster`` ends it and removes the directory."""
    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="slurm-cluster-")))
    try:
        cluster.start()
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster


def stop_cluster(cluster: SlurmCluster) -> None:
    cluster.stop()
    shutil.rmtree(cluster.directory, ignore_errors=True)
