"""Device time: CUDA events on a GPU, ``perf_counter`` on the CPU.

On a GPU the host runs ahead of the device, so a host clock around a step measures the launch,
not the work. An event recorded before and after each step is stamped on the device's own
timeline; one ``synchronize`` after the last step makes every stamp readable, so measuring adds
no synchronization between steps. (A generation waits for an idle device before it starts, on
purpose: ``fitbench.worker.loops.generate``.) On the CPU, operators run synchronously and a host
clock is exact.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable, Iterator, TypeVar, Union

import torch

Mark = Union[float, torch.cuda.Event]
T = TypeVar("T")


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


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No garbage-collection pauses inside the timed stages (as ``timeit`` does); collect before them."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def run_stages(call: Callable[[], T], clock: DeviceClock, *, warmup: int, repeats: int,
               on_step: Callable[[str, int, int], None] = lambda phase, i, n: None,
               barrier: Callable[[], None] | None = None, counter=None) -> list[T]:
    """``warmup`` untimed calls, then ``repeats`` measured ones; returns what each measured call
    returned (its marks), readable once this function has synchronized. ``barrier``: where the ranks
    of a job time steps of their own (replicas), called once the warm-up has finished on the device
    and once the measured calls have, so that every rank's measured stage runs while the others' do.
    ``counter``: a device counter (``fitbench.worker.retries.RetryCounter``) whose ``around()`` each
    measured call runs inside, outside the call's own timing marks.

    The collector is paused over both stages and collects before the first warm-up call, so the first
    measured call follows a warm-up call as every other follows its predecessor. A full collection
    between the stages (tens of milliseconds of host work over the whole heap) made the first
    measured call slower than the rest wherever the host sets the pace: on an H200, the first time to
    first token of eager quantized generations was 8% to 24% above the median of ten."""
    with collector_paused():
        for i in range(warmup):
            call()
            on_step("warmup", i + 1, warmup)
        clock.synchronize()
        if barrier:
            barrier()
        results = []
        for i in range(repeats):
            with counter.around() if counter else contextlib.nullcontext():
                results.append(call())
            on_step("measure", i + 1, repeats)
        clock.synchronize()
        if barrier:
            barrier()
    return results


def time_steps(step: Callable[[], T], clock: DeviceClock, *, warmup: int, repeats: int,
               on_step: Callable[[str, int, int], None] = lambda phase, i, n: None,
               barrier: Callable[[], None] | None = None, counter=None) -> tuple[list[float], list[T]]:
    """Seconds of each of ``repeats`` timed steps after ``warmup`` untimed ones, and what each timed
    step returned (device tensors included: the measured stage ends with a synchronize); ``barrier``
    and ``counter`` as in ``run_stages``."""
    def timed() -> tuple[Mark, T, Mark]:
        start = clock.mark()
        result = step()
        return start, result, clock.mark()

    marks = run_stages(timed, clock, warmup=warmup, repeats=repeats, on_step=on_step, barrier=barrier,
                       counter=counter)
    return [clock.seconds(start, end) for start, _, end in marks], [result for _, result, _ in marks]


def first_call_seconds(call: Callable[[], object], clock: DeviceClock) -> float:
    """Wall time of one call through to the device finishing it: compilation plus one step."""
    started = time.perf_counter()
    call()
    clock.synchronize()
    return time.perf_counter() - started
