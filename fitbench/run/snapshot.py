"""The CUDA caching allocator's own record of a run's steps, for finding what the planner misses.

With ``FITBENCH_MEMORY_SNAPSHOT=DIR`` in its environment, a worker on a GPU records every
allocation, free and segment mapping of its warm-up and measured steps (PyTorch's
``torch.cuda.memory._record_memory_history``, with the Python frames of each allocation) and writes
``DIR/<configuration key>-rank<R>.pickle``, which https://pytorch.org/memory_viz draws and
``benchmarks/allocator_streams.py`` sums per CUDA stream. The build is not recorded: the planner's
step moments start after it. Recording slows the steps, so a row measured this way is for reading
memory, not time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

SNAPSHOT_VARIABLE = "FITBENCH_MEMORY_SNAPSHOT"
# Allocation events kept (the oldest dropped first): a training step of a 32-layer model makes
# tens of thousands.
MAX_EVENTS = 2_000_000


def snapshot_path(directory: str, key: str, rank: int) -> Path:
    return Path(directory) / f"{key}-rank{rank}.pickle"


@contextmanager
def recorded(device: torch.device, key: str, rank: int) -> Iterator[None]:
    """Record the allocator's events inside the block when ``FITBENCH_MEMORY_SNAPSHOT`` names a
    directory and the device is a GPU; write the snapshot there after it, also when the block fails."""
    directory = os.environ.get(SNAPSHOT_VARIABLE)
    if not directory or device.type != "cuda":
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=MAX_EVENTS, stacks="python")
    try:
        yield
    finally:
        path = snapshot_path(directory, key, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
