"""One rank's view of a torchrun job: who it is, which device it drives, its process group.

torchrun (``python -m torch.distributed.run``) starts one process per rank and tells each who it
is through four environment variables: RANK (0 .. WORLD_SIZE - 1, over every node), LOCAL_RANK
(0 .. LOCAL_WORLD_SIZE - 1, on this node), WORLD_SIZE and LOCAL_WORLD_SIZE, beside MASTER_ADDR and
MASTER_PORT, where the process group meets. A rank drives ``cuda:LOCAL_RANK``: RANK counts the
GPUs of every node, so on a second node it names a GPU that does not exist there.

A process started without torchrun is a job of one, and runs with no process group at all, as
``fitbench run`` on one device always has.

A failing rank ends the job, not just itself: when one rank exits, torchrun's agent stops the
others (SIGTERM, then SIGKILL), and gloo fails a collective at once when a peer's connection
closes. A rank that hangs instead leaves the others waiting in their next collective, which ends
after the process group's ``timeout`` with an error (gloo raises it; NCCL's watchdog ends the
process: TORCH_NCCL_ASYNC_ERROR_HANDLING's default, 3, tears it down), and then the agent stops the
hung one. The rank entry point should be wrapped in
``torch.distributed.elastic.multiprocessing.errors.record``: a rank's exception then lands in that
rank's ``error.json`` (``--log-dir DIR``: ``DIR/<run id>/attempt_0/<local rank>/error.json``, with
the message and a timestamp in seconds) and in torchrun's summary.

So that a job that ends without every rank's result says which rank held it up, each rank of a job
of several keeps the phase it last entered in a file beside its result (``fitbench.worker.phases``), which the
launcher reads when the job ends: a rank that stopped outside any collective while the others wait
in one is the one they waited for.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

ENVIRONMENT = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


class RankEnvironmentError(ValueError):
    """torchrun's environment is incomplete or inconsistent."""


@dataclass(frozen=True)
class Rank:
    """This process's place in the job. ``launched``: started by torchrun, so it joins a process group
    even as the only rank (DDP and FSDP need one); a plain process is rank 0 of 1 and needs none."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    launched: bool

    def __post_init__(self):
        if self.world_size < 1 or self.local_world_size < 1:
            raise RankEnvironmentError(f"WORLD_SIZE ({self.world_size}) and LOCAL_WORLD_SIZE "
                                       f"({self.local_world_size}) must be at least 1")
        if self.local_world_size > self.world_size:
            raise RankEnvironmentError(f"LOCAL_WORLD_SIZE ({self.local_world_size}) exceeds WORLD_SIZE "
                                       f"({self.world_size}): a node cannot hold more ranks than the job")
        if not 0 <= self.rank < self.world_size:
            raise RankEnvironmentError(f"RANK {self.rank} is outside 0 .. WORLD_SIZE - 1 = {self.world_size - 1}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise RankEnvironmentError(f"LOCAL_RANK {self.local_rank} is outside 0 .. LOCAL_WORLD_SIZE - 1 = "
                                       f"{self.local_world_size - 1}")

    @property
    def main(self) -> bool:
        """Rank 0, which writes the job's one result row."""
        return self.rank == 0

    @classmethod
    def from_environment(cls, device: str | torch.device,
                         environ: Mapping[str, str] | None = None) -> Rank:
        """This process's rank from torchrun's variables in ``environ`` (the process's own environment by
        default). ``device`` is the run's device (``cpu``, ``cuda``, ``cuda:N``); under torchrun a GPU
        rank drives ``cuda:LOCAL_RANK`` whatever index it names (the launcher picks the GPUs with
        CUDA_VISIBLE_DEVICES), and without torchrun the device is kept as given. Reads, never
        touches a device."""
        environ = os.environ if environ is None else environ
        device = torch.device(device)
        present = [name for name in ENVIRONMENT if name in environ]
        if not present:
            return cls(rank=0, local_rank=0, world_size=1, local_world_size=1, device=device, launched=False)
        missing = [name for name in ENVIRONMENT if name not in environ]
        if missing:
            raise RankEnvironmentError(f"the environment sets {', '.join(present)} but not {', '.join(missing)}; "
                                       f"torchrun sets all four: start the job with torchrun, or unset them")
        values = {name.lower(): _integer(name, environ[name]) for name in ENVIRONMENT}
        if device.type == "cuda":
            device = torch.device("cuda", values["local_rank"])
        return cls(**values, device=device, launched=True)


def _integer(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise RankEnvironmentError(f"{name}={text[:20]!r} is not an integer; torchrun sets it to one") from None


@contextlib.contextmanager
def process_group(rank: Rank, timeout: timedelta, host_only: bool = False) -> Iterator[None]:
    """The job's process group for the duration of the block: NCCL between GPUs, gloo between CPU
    processes, and gloo too where the ranks exchange only host objects (``host_only``: replicas, whose
    barriers and results cross no GPU), so that no NCCL communicator takes GPU memory beside what one
    GPU's run holds. A collective that waits longer than ``timeout`` (a rank hung or gone) fails
    instead of blocking the job forever. Destroyed on the way out, however the block ends, so NCCL's
    communicators and their threads do not outlive the run. A rank not started by torchrun has
    nothing to join."""
    if not rank.launched:
        yield
        return
    if rank.device.type == "cuda":
        if rank.local_rank >= torch.cuda.device_count():
            raise RankEnvironmentError(f"LOCAL_RANK {rank.local_rank} has no GPU: this node shows "
                                       f"{torch.cuda.device_count()}; start no more ranks per node than it has GPUs")
        torch.cuda.set_device(rank.device)
    if rank.device.type == "cuda" and not host_only:
        # device_id binds the communicator to this rank's GPU at once, instead of at the first collective
        dist.init_process_group("nccl", timeout=timeout, device_id=rank.device)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()


def gather_json(rank: Rank, payload: dict) -> list[dict] | None:
    """Every rank's ``payload``, in rank order, on rank 0; None on the others. Each payload travels as
    JSON text, so one that JSON cannot hold fails on the rank that made it, not in rank 0's row.
    Every rank of the job must call it (a collective)."""
    text = json.dumps(payload)
    if not rank.launched:
        return [json.loads(text)]
    received: list | None = [None] * rank.world_size if rank.main else None
    dist.gather_object(text, received, dst=0)
    return [json.loads(item) for item in received] if rank.main else None
