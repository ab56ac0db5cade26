"""What a SLURM job asks of the cluster, checked before anything is submitted.

``SlurmOptions`` holds sbatch's options as plain typed fields; building one checks each field and
raises ``UserError`` with one paragraph naming the field and its fix. Formats are sbatch's (its
manual page, "--time", "--mem", "--nodes"): a time limit is ``minutes``, ``minutes:seconds``,
``hours:minutes:seconds``, ``days-hours``, ``days-hours:minutes`` or ``days-hours:minutes:seconds``
(or ``UNLIMITED``/``INFINITE``); a memory size is a whole number with an optional unit ``K``, ``M``
(the default), ``G`` or ``T``, per node, ``0`` meaning all of the node's memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fitbench.util.errors import UserError, excerpt

TIME_FORMATS = ("minutes", "minutes:seconds", "hours:minutes:seconds", "days-hours", "days-hours:minutes",
                "days-hours:minutes:seconds")
UNLIMITED_TIMES = ("UNLIMITED", "INFINITE")
# the leading field is any count; a field after it is below its unit's next one (hours < 24, minutes and seconds < 60)
_CLOCK = r"(?:[01]?\d|2[0-3])"
_SIXTY = r"[0-5]?\d"
TIME_PATTERN = re.compile(
    rf"\d+|\d+:{_SIXTY}|\d+:{_SIXTY}:{_SIXTY}|\d+-{_CLOCK}|\d+-{_CLOCK}:{_SIXTY}|\d+-{_CLOCK}:{_SIXTY}:{_SIXTY}")
MEMORY_PATTERN = re.compile(r"\d+[KMGTkmgt]?")
NAME_PATTERN = re.compile(r"[^\s'\"\\]+")

# sbatch options that a field, or the script itself, sets: given again among the extra arguments they
# would contradict it. Long name -> its short one, if any.
MANAGED_OPTIONS = {"--partition": "-p", "--account": "-A", "--time": "-t", "--nodes": "-N",
                   "--gpus-per-node": None, "--cpus-per-task": "-c", "--mem": None, "--ntasks": "-n",
                   "--ntasks-per-node": None, "--array": "-a", "--output": "-o", "--error": "-e",
                   "--job-name": "-J"}
FIELD_OF = {"--partition": "partition", "--account": "account", "--time": "time", "--nodes": "nodes",
            "--gpus-per-node": "gpus_per_node", "--cpus-per-task": "cpus_per_task", "--mem": "mem"}


@dataclass(frozen=True)
class SlurmOptions:
    """sbatch's options for a job: ``None`` leaves an option to the cluster's default.

    ``nodes``: nodes per job, each running one torchrun agent when above 1; ``gpus_per_node``: GPUs
    of each node (``--gpus-per-node``); ``mem``: memory per node; ``sbatch_args``: further options,
    each one command-line word as sbatch takes it (``--qos=high``, ``--constraint=a100``); ``setup``:
    shell lines the script runs before its program, as written (the user's own shell: ``module load``,
    a venv's ``activate``), one line each."""

    partition: str | None = None
    account: str | None = None
    time: str | None = None
    nodes: int = 1
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    sbatch_args: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for field, value in (("partition", self.partition), ("account", self.account)):
            if value is not None and not NAME_PATTERN.fullmatch(value):
                raise UserError(f"{field}: {excerpt(value)} is not a SLURM {field} name (one word, without "
                                f"spaces or quotes). Give the name as `sinfo` or `sacctmgr show associations` "
                                f"lists it, or leave --{field} out for the cluster's default.")
        if self.time is not None:
            time_problem(self.time)
        for field, value in (("nodes", self.nodes), ("gpus_per_node", self.gpus_per_node),
                             ("cpus_per_task", self.cpus_per_task)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                option = "--" + field.replace("_", "-")
                raise UserError(f"{field}: {excerpt(value)} is not a positive whole number. Give {option} 1 or "
                                f"more{'' if field == 'nodes' else f', or leave {option} out'}.")
        if self.mem is not None and not MEMORY_PATTERN.fullmatch(self.mem):
            raise UserError(f"mem: {excerpt(self.mem)} is not a memory size as sbatch takes it. Give a whole "
                            f"number with an optional unit K, M (the default), G or T, per node: --mem 256G; "
                            f"--mem 0 asks for all of each node's memory.")
        for argument in self.sbatch_args:
            sbatch_argument_problem(argument)
        for line in self.setup:
            if any(character in line for character in "\n\r\0"):
                raise UserError(f"setup: {excerpt(line)} is more than one line. Give each shell line its own "
                                f"--setup.")


def time_problem(value: str) -> None:
    """Raise ``UserError`` unless ``value`` is a time limit in one of sbatch's formats."""
    if TIME_PATTERN.fullmatch(value) or value.upper() in UNLIMITED_TIMES:
        return
    raise UserError(f"time: {excerpt(value)} is not a time limit as sbatch takes it. Write it as one of "
                    f"{', '.join(TIME_FORMATS)} (hours below 24 after days, minutes and seconds below 60 after "
                    f"the first field): --time 24:00:00 is a day, --time 1-12 a day and a half, --time 90 ninety "
                    f"minutes.")


def time_seconds(value: str) -> float:
    """A time limit in one of sbatch's formats (``time_problem``) in seconds; UNLIMITED is infinite.
    ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``: sbatch's manual, ``--time``."""
    if value.upper() in UNLIMITED_TIMES:
        return float("inf")
    days, _, clock = value.rpartition("-")
    fields = [int(field) for field in clock.split(":")]
    if days:
        fields += [0] * (3 - len(fields))
        return float(int(days) * 86400 + fields[0] * 3600 + fields[1] * 60 + fields[2])
    scale = {1: [60], 2: [60, 1], 3: [3600, 60, 1]}[len(fields)]
    return float(sum(field * unit for field, unit in zip(fields, scale)))


def sbatch_argument_problem(argument: str) -> None:
    """Raise ``UserError`` unless ``argument`` is one sbatch option that no field or the script sets."""
    if not argument.startswith("-") or any(character in argument for character in "\n\r\0"):
        raise UserError(f"sbatch_args: {excerpt(argument)} is not an sbatch option. Give each extra option as one "
                        f"word starting with a dash, its value after '=' (--sbatch-arg=--qos=high).")
    name = argument.split("=", 1)[0]
    for long, short in MANAGED_OPTIONS.items():
        if name == long or (short is not None and (name == short or (len(name) > 2 and name.startswith(short)))):
            field = FIELD_OF.get(long)
            fix = (f"give it as {long} (the {field} option) instead" if field else
                   "fitbench writes it into the batch script itself; edit the script of --dry-run instead")
            raise UserError(f"sbatch_args: {excerpt(argument)} sets sbatch's {long}, which the job's own options "
                            f"set too; {fix}.")
