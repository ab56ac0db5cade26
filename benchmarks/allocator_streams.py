"""What the CUDA caching allocator held per stream during a run's steps, from the snapshots that
``FITBENCH_MEMORY_SNAPSHOT=DIR fitbench run ...`` writes (``fitbench.run.snapshot``).

Usage: python benchmarks/allocator_streams.py SNAPSHOT.pickle [...] [--json FILE] [--top N]

The allocator keeps a pool per CUDA stream: a block freed by one stream's tensor serves only that
stream's later requests, and its pages stay mapped (nothing calls ``empty_cache`` during the steps).
So the memory NVML reports at the end of the steps is the sum over streams of what each stream had
mapped, and each stream's mapped memory is at least the most it ever held allocated at once. This
script replays the events (``alloc`` and ``free_completed`` for allocated bytes; ``segment_map``,
``segment_alloc`` and their reverses for mapped bytes) and prints, per stream:

- allocated: at the start of the recording (what the final state and the events imply), at most,
  and at the moment the sum over streams is largest;
- mapped: at most and at the end;
and the largest live blocks at the moment of the most allocated (size, stream, the innermost frame
of fitbench or of torch's distributed, parallel or optimizer modules that made it), and the live bytes
there summed by that frame.
"""

from __future__ import annotations

import argparse
import json
import pickle
from collections import defaultdict
from pathlib import Path

GIB = 1 << 30
ALLOCATED = {"alloc": 1, "free_completed": -1}
MAPPED = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
FRAME_MARKS = ("fitbench/", "torch/distributed/", "torch/nn/parallel/", "torch/optim/", "torch/_tensor.py")


def where(frames: list[dict]) -> str:
    """The innermost frame worth naming: fitbench's, or torch's distributed, parallel or optimizer code."""
    for frame in frames:
        if any(mark in frame.get("filename", "") for mark in FRAME_MARKS):
            name = frame["filename"].split("site-packages/")[-1]
            return f"{name}:{frame.get('line')} {frame.get('name')}"
    return frames[0]["name"] if frames else "?"


def streams_of(snapshot: dict, device: int, top: int) -> dict:
    events = snapshot["device_traces"][device]
    final_allocated: dict[int, int] = defaultdict(int)
    final_mapped: dict[int, int] = defaultdict(int)
    for segment in snapshot["segments"]:
        if segment["device"] != device:
            continue
        final_mapped[segment["stream"]] += segment["total_size"]
        final_allocated[segment["stream"]] += segment["allocated_size"]
    net_allocated: dict[int, int] = defaultdict(int)
    for event in events:
        net_allocated[event["stream"]] += ALLOCATED.get(event["action"], 0) * event["size"]
    allocated = {s: final_allocated[s] - net_allocated[s] for s in set(final_allocated) | set(net_allocated)}
    start = dict(allocated)
    most = dict(allocated)
    mapped: dict[int, int] = defaultdict(int)
    most_mapped: dict[int, int] = defaultdict(int)
    live: dict[int, tuple[int, int, str]] = {}
    peak_total, at_peak, peak_blocks = sum(allocated.values()), dict(allocated), []
    for event in events:
        stream, action, size = event["stream"], event["action"], event["size"]
        if action in ALLOCATED:
            allocated[stream] = allocated.get(stream, 0) + ALLOCATED[action] * size
            most[stream] = max(most.get(stream, 0), allocated[stream])
            if action == "alloc":
                live[event["addr"]] = (size, stream, where(event.get("frames", [])))
            else:
                live.pop(event["addr"], None)
            total = sum(allocated.values())
            if total > peak_total:
                peak_total, at_peak = total, dict(allocated)
                peak_blocks = sorted(live.values(), reverse=True)
        elif action in MAPPED:
            mapped[stream] += MAPPED[action] * size
            most_mapped[stream] = max(most_mapped[stream], mapped[stream])
    return {
        "streams": {str(s): {"allocated_at_start_gib": start.get(s, 0) / GIB, "allocated_most_gib": most.get(s, 0) / GIB,
                             "allocated_at_peak_gib": at_peak.get(s, 0) / GIB,
                             "mapped_most_in_steps_gib": most_mapped.get(s, 0) / GIB,
                             "mapped_at_end_gib": final_mapped.get(s, 0) / GIB}
                    for s in sorted(set(start) | set(final_mapped))},
        "allocated_peak_gib": peak_total / GIB,
        "mapped_at_end_gib": sum(final_mapped.values()) / GIB,
        "sum_of_stream_peaks_gib": sum(most.values()) / GIB,
        "largest_live_at_peak": [{"gib": size / GIB, "stream": stream, "made_by": made}
                                 for size, stream, made in peak_blocks[:top]],
        "live_at_peak_by_maker_gib": dict(sorted(((made, round(sum(b[0] for b in peak_blocks if b[2] == made) / GIB, 3))
                                                  for made in {b[2] for b in peak_blocks}),
                                                 key=lambda item: -item[1])[:3 * top]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("snapshots", nargs="+")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--top", type=int, default=12, help="live blocks listed at the peak (default 12)")
    args = parser.parse_args()
    report = {}
    for path in args.snapshots:
        snapshot = pickle.loads(Path(path).read_bytes())
        devices = [i for i, trace in enumerate(snapshot["device_traces"]) if trace]
        report[Path(path).name] = {str(d): streams_of(snapshot, d, args.top) for d in devices}
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
