"""Fault injection for tests (comma-separated in ``FITBENCH_INJECT``):

- ``crash:<model>``: the worker of that model aborts (SIGABRT) once its model is built, as a
  segfaulting kernel or a killed process would;
- ``oom:<precision>``: a worker running that precision with every layer on the device raises the
  real ``torch.cuda.OutOfMemoryError`` before it builds its model (an offloaded run is what gets
  around it), as a run predicted to fit that then runs out would; before the build, so that a
  quantized rung's libraries are not loaded for nothing (seconds of CPU per attempt);
- ``hang:<model>``: the worker of that model sleeps before it builds anything, as a hung
  collective would (for timeouts and signals);
- ``orphan:<model>``: the worker first starts a process in a session of its own that sleeps and
  holds the worker's stdout open, as a stray server or compiler daemon would;
- ``garbage:<model>``: the worker writes a JSON line that is not an object, bytes that are not
  UTF-8 and a line of several MiB to its progress channel, then runs normally;
- ``sigkill:<model>``: the worker kills itself with SIGKILL once its model is built, as the
  kernel's out-of-memory killer would;
- ``alloc:<model>``: the worker asks the allocator of its device for 2**62 bytes once its model is
  built: a real allocation failure (on a CPU, ``DefaultCPUAllocator: can't allocate memory``);
- ``rank-error:<rank>``: that rank of a torchrun job raises once its model is built, while the others
  go on to their first collective; ``rank-hang:<rank>``: that rank sleeps there instead;
- ``collective-timeout:<seconds>``: the ranks' collectives fail after that long instead of
  ``COLLECTIVE_TIMEOUT``, so that a hang ends in seconds;
- ``compile-error:decode``: compiling the native decode step or prefill raises, as on a machine
  without a C++ compiler or Triton: generation falls back to the eager step and says why;
- ``alloc-retries:<n>``: the allocator-retry counter of a worker (``fitbench.worker.retries``) reads n
  retries more in each measured step or generation, on any device (a CPU has no such counter), as a
  step at the GPU's capacity would;
- ``mem-limit:<bytes>``: a worker raises it, before it builds its model, when the planner's
  predicted tensor peak for its configuration exceeds that budget, which makes a CPU behave like
  a GPU of that size; an offloaded configuration also keeps on the device only the layers that
  budget has room for.
  ``fitbench run`` plans against the same budget on a CPU, so what is predicted not to fit there
  is refused before launch, as on a GPU. The parent takes the same budget for the host memory
  a CPU worker had (``fitbench.launch.local``).

The switch is read from the environment of each process, so a test sets it for the sweep it starts
and every worker, rank and launcher of that sweep sees it. Plain Python: the launcher reads the
memory budget without importing torch.
"""

from __future__ import annotations

import os


def injected(kind: str, value: str) -> bool:
    """True when FITBENCH_INJECT lists ``kind:value`` (comma-separated entries)."""
    entries = os.environ.get("FITBENCH_INJECT", "").split(",")
    return f"{kind}:{value}" in (entry.strip() for entry in entries)


def injected_value(kind: str) -> float | None:
    """The number FITBENCH_INJECT gives ``kind`` (``kind:<number>``), None when it lists none."""
    for entry in os.environ.get("FITBENCH_INJECT", "").split(","):
        name, _, value = entry.strip().partition(":")
        if name == kind:
            return float(value)
    return None


def injected_memory_limit() -> float | None:
    return injected_value("mem-limit")
