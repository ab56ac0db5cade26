"""The host's time to launch one operator on the run's device, measured in the worker before its
steps and kept in the row (``environment.host_launch_s``).

The speed forecast's host terms are seconds per operator launched eagerly (``fitbench.planning.forecast``:
``HOST_OP_S``, ``HF_HOST_OP_S``, ``DTENSOR_HOST_OP_S``), each solved from rows of one machine, and a host
of another CPU launches at another pace. This figure, taken the same way on every machine, is what lets
those terms be put per machine.

Definition: the median over ``REPEATS`` of the wall time of ``OPS`` back-to-back in-place additions to a
one-element tensor on the device, divided by ``OPS``, the device synchronized before and after each
repeat. On a GPU the launches are asynchronous and each addition is a few microseconds of device time,
so the host sets the pace: the figure is the host's per-operator cost through PyTorch's dispatcher and
the CUDA launch; on a CPU it includes the addition itself.
"""

from __future__ import annotations

import statistics
import time

import torch

OPS = 1000
REPEATS = 3


def host_launch_seconds(device: torch.device, ops: int = OPS, repeats: int = REPEATS) -> float:
    """Seconds per operator launched (the module docstring's definition)."""
    x = torch.zeros(1, device=device)
    cuda = device.type == "cuda"
    seconds = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(ops):
            x.add_(1)
        if cuda:
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds) / ops
