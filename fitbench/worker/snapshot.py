"""The CUDA caching allocator's own record of a run's steps, for finding what the planner misses.

With ``FITBENCH_MEMORY_SNAPSHOT=DIR`` in its environment, a worker on a GPU records every
allocation, free and segment mapping of its warm-up and measured steps (PyTorch's
``torch.cuda.memory._record_memory_history``, with the Python frames of each allocation) and writes
``DIR/<configuration key>-rank<R>.pickle``, which https://pytorch.org/memory_viz draws and
``stream_figures`` (``benchmarks/allocator_streams.py``) sums per CUDA stream. The build is not
recorded: the planner's step moments start after it. Recording slows the steps, so a row measured
this way is for reading memory, not time.

Per stream, because the allocator keeps a pool per CUDA stream: a block freed by one stream's tensor
serves only that stream's later requests, and its pages stay mapped (nothing calls ``empty_cache``
during the steps). So what NVML reports at the end of the steps is the sum over streams of what each
stream mapped, and a stream maps at least the most it ever held allocated at once.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
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


# The warning a row measured while the allocator's history was recorded carries: its times are not a
# configuration's (``benchmarks/speed_error.py`` leaves such rows out).
RECORDING_WARNING = ("the allocator's history was recorded (FITBENCH_MEMORY_SNAPSHOT), which slows the steps: "
                     "read this row for memory, not time")


def recording(device: torch.device) -> bool:
    """Whether ``recorded`` records on ``device``: a GPU, with ``FITBENCH_MEMORY_SNAPSHOT`` set."""
    return bool(os.environ.get(SNAPSHOT_VARIABLE)) and device.type == "cuda"


@contextmanager
def recorded(device: torch.device, key: str, rank: int) -> Iterator[None]:
    """Record the allocator's events inside the block when ``FITBENCH_MEMORY_SNAPSHOT`` names a
    directory and the device is a GPU; write the snapshot there after it, also when the block fails."""
    if not recording(device):
        yield
        return
    directory = os.environ[SNAPSHOT_VARIABLE]
    torch.cuda.memory._record_memory_history(max_entries=MAX_EVENTS, stacks="python")
    try:
        yield
    finally:
        path = snapshot_path(directory, key, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)


# Snapshot events (``device_traces``) and what they do to a stream's allocated or mapped bytes.
ALLOCATED = {"alloc": 1, "free_completed": -1}
MAPPED = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
# Frames worth naming as an allocation's maker: fitbench's, or torch's distributed, parallel or optimizer code.
FRAME_MARKS = ("fitbench/", "torch/distributed/", "torch/nn/parallel/", "torch/optim/", "torch/_tensor.py")


def maker(frames: list[dict]) -> str:
    """The innermost frame worth naming (``FRAME_MARKS``), as file:line function; else the innermost."""
    for frame in frames:
        if any(mark in frame.get("filename", "") for mark in FRAME_MARKS):
            return f"{frame['filename'].split('site-packages/')[-1]}:{frame.get('line')} {frame.get('name')}"
    return frames[0]["name"] if frames else "?"


def stream_figures(snapshot: dict, device: int) -> dict:
    """Bytes per stream of ``device`` over a recorded snapshot (``torch.cuda.memory._snapshot()``'s
    dict), replaying its events in order:

    - ``allocated_at_start``: the final state's allocated bytes less the events' net (what existed
      before the recording, or before its oldest kept event);
    - ``allocated_most``: the most the stream held at once; ``allocated_at_peak``: what it held when
      the sum over streams was largest (``allocated_peak``);
    - ``mapped_most_in_steps``: the most its mapped bytes grew over the events (``segment_map`` and
      ``segment_alloc`` add, their reverses subtract); ``mapped_at_end``: its segments' size at the end;
    and ``live_at_peak``: the blocks alive at the peak, as (bytes, stream, maker), largest first."""
    events = snapshot["device_traces"][device]
    final_allocated: Counter = Counter()
    final_mapped: Counter = Counter()
    for segment in snapshot["segments"]:
        if segment["device"] == device:
            final_mapped[segment["stream"]] += segment["total_size"]
            final_allocated[segment["stream"]] += segment["allocated_size"]
    net: Counter = Counter()
    for event in events:
        net[event["stream"]] += ALLOCATED.get(event["action"], 0) * event["size"]
    streams = sorted(set(final_allocated) | set(net) | set(final_mapped))
    allocated = {s: final_allocated[s] - net[s] for s in streams}
    start, most = dict(allocated), dict(allocated)
    mapped: Counter = Counter()
    mapped_most: dict[int, int] = defaultdict(int)
    live: dict[int, tuple[int, int, str]] = {}
    peak, at_peak, live_at_peak = sum(allocated.values()), dict(allocated), dict(live)
    for event in events:
        stream, action, size = event["stream"], event["action"], event["size"]
        if action in ALLOCATED:
            allocated[stream] += ALLOCATED[action] * size
            most[stream] = max(most[stream], allocated[stream])
            if action == "alloc":
                live[event["addr"]] = (size, stream, maker(event.get("frames", [])))
            else:
                live.pop(event["addr"], None)
            if sum(allocated.values()) > peak:
                peak, at_peak, live_at_peak = sum(allocated.values()), dict(allocated), dict(live)
        elif action in MAPPED:
            mapped[stream] += MAPPED[action] * size
            mapped_most[stream] = max(mapped_most[stream], mapped[stream])
    return {
        "streams": {s: {"allocated_at_start": start[s], "allocated_most": most[s], "allocated_at_peak": at_peak[s],
                        "mapped_most_in_steps": mapped_most[s], "mapped_at_end": final_mapped[s]} for s in streams},
        "allocated_peak": peak,
        "mapped_at_end": sum(final_mapped.values()),
        "live_at_peak": sorted(live_at_peak.values(), reverse=True),
    }
