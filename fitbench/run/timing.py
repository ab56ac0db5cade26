"""Device time: CUDA events on a GPU, ``perf_counter`` on the CPU.

On a GPU the host runs ahead of the device, so a host clock around a step measures the launch,
not the work. An event recorded before and after each step is stamped on the device's own
timeline; one ``synchronize`` after the last step makes every stamp readable, so measuring adds
no synchronization between steps. On the CPU, operators run synchronously and a host clock is exact.
"""

from __future__ import annotations

import time
from typing import Callable, Union

import torch

Mark = Union[float, torch.cuda.Event]


class DeviceClock:
    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"

    def mark(self) -> Mark:
        if self.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def seconds(self, start: Mark, end: Mark) -> float:
        """Elapsed time between two marks; on CUDA only after ``synchronize``."""
        if self.is_cuda:
            return start.elapsed_time(end) / 1000.0
        return end - start


def time_steps(step: Callable[[], object], clock: DeviceClock, *, warmup: int, repeats: int,
               on_step: Callable[[str, int, int], None] = lambda phase, i, n: None) -> list[float]:
    """Run ``warmup`` untimed steps, then ``repeats`` timed ones; return each timed step's seconds."""
    for i in range(warmup):
        step()
        on_step("warmup", i + 1, warmup)
    clock.synchronize()
    marks = []
    for i in range(repeats):
        start = clock.mark()
        step()
        marks.append((start, clock.mark()))
        on_step("measure", i + 1, repeats)
    clock.synchronize()
    return [clock.seconds(start, end) for start, end in marks]
