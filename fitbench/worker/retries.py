"""The CUDA caching allocator's retries over a run's measured steps.

When a request finds no free block and ``cudaMalloc`` fails, the caching allocator frees every cached
block it can (which synchronizes the device) and calls ``cudaMalloc`` again: one retry, counted in
``torch.cuda.memory_stats()["num_alloc_retries"]`` (``c10/cuda/CUDACachingAllocator.cpp``). A step that
retries pays for the frees, the synchronization and the new mappings inside its own time: it runs at
the GPU's capacity. The counter is read around each measured call, outside its timing marks, so a row
says how many retries its measured steps made and how long the steps that made them took.

A CPU has no caching allocator and no such counter: there ``RetryCounter.of`` is None and the row has
no ``allocator_retries``. FITBENCH_INJECT's ``alloc-retries:<n>`` (``fitbench.util.inject``) adds n retries to
each measured call, on any device, for tests of what the row and the terminal make of them.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator

from fitbench.util.inject import injected_value

if TYPE_CHECKING:
    import torch

WARNING_START = "the CUDA caching allocator retried"


class RetryCounter:
    """Reads the allocator's retry count (``read``) around each measured call; ``per_call`` holds how much
    it rose during each, ``injected`` more each (FITBENCH_INJECT's ``alloc-retries``)."""

    def __init__(self, read: Callable[[], int], injected: int = 0):
        self.read, self.injected = read, injected
        self.per_call: list[int] = []

    @classmethod
    def of(cls, device: torch.device) -> RetryCounter | None:
        """The counter of ``device``'s caching allocator; None on a CPU, which has none, unless retries are
        injected."""
        injected = int(injected_value("alloc-retries") or 0)
        if device.type == "cuda":
            import torch

            return cls(lambda: torch.cuda.memory_stats(device).get("num_alloc_retries", 0), injected)
        return cls(lambda: 0, injected) if injected else None

    @contextlib.contextmanager
    def around(self) -> Iterator[None]:
        before = self.read()
        yield
        self.per_call.append(self.read() - before + self.injected)

    def report(self, seconds: list[float]) -> dict[str, Any]:
        """The row's ``allocator_retries``, from each measured call's retries and ``seconds`` (its measured
        time: a step's, or a generation's end to end):

        - ``num_alloc_retries``: the retries of every measured call, summed;
        - ``per_step``: each call's;
        - ``steps_with_retries``: the calls that retried at least once;
        - ``seconds_in_steps_with_retries``: their measured time, summed (0 when none retried)."""
        retried = [index for index, count in enumerate(self.per_call) if count > 0]
        return {"num_alloc_retries": sum(self.per_call), "per_step": list(self.per_call),
                "steps_with_retries": len(retried),
                "seconds_in_steps_with_retries": sum(seconds[index] for index in retried)}


def retries_warning(report: dict[str, Any] | None, steps: str = "measured steps") -> str | None:
    """A row's warning for an ``allocator_retries`` report (``RetryCounter.report``) with retries; None
    without."""
    if not report or not report["num_alloc_retries"]:
        return None
    return (f"{WARNING_START} {report['num_alloc_retries']} allocation(s) in {report['steps_with_retries']} of the "
            f"{steps} ({report['seconds_in_steps_with_retries']:.3g} s of them): each retry frees cached blocks and "
            f"calls cudaMalloc again inside the step, at the edge of the GPU's memory; activation checkpointing, a "
            f"smaller batch or another layout keeps a step off it")
