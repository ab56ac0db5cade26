"""What the CUDA caching allocator held per stream during a run's steps, from the snapshots that
``FITBENCH_MEMORY_SNAPSHOT=DIR fitbench run ...`` writes (``fitbench.worker.snapshot``, whose
``stream_figures`` defines the figures).

Usage: python benchmarks/allocator_streams.py SNAPSHOT.pickle [...] [--json FILE] [--top N]

Prints per snapshot and device, in GiB: each stream's allocated bytes at the start of the recording,
at most and at the moment the sum over streams is largest; its mapped bytes at most and at the end;
the largest live blocks at that moment (size, stream, the frame that made them) and the live bytes
there summed by that frame.
"""

from __future__ import annotations

import argparse
import json
import pickle
from collections import Counter
from pathlib import Path

from fitbench.worker.snapshot import stream_figures

GIB = 1 << 30


def in_gib(figures: dict, top: int) -> dict:
    live = figures["live_at_peak"]
    by_maker = Counter()
    for size, _, made in live:
        by_maker[made] += size
    return {
        "streams": {str(stream): {f"{name}_gib": value / GIB for name, value in values.items()}
                    for stream, values in figures["streams"].items()},
        "allocated_peak_gib": figures["allocated_peak"] / GIB,
        "mapped_at_end_gib": figures["mapped_at_end"] / GIB,
        "sum_of_stream_peaks_gib": sum(values["allocated_most"] for values in figures["streams"].values()) / GIB,
        "largest_live_at_peak": [{"gib": size / GIB, "stream": stream, "made_by": made}
                                 for size, stream, made in live[:top]],
        "live_at_peak_by_maker_gib": {made: round(size / GIB, 3) for made, size in by_maker.most_common(3 * top)},
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
        report[Path(path).name] = {str(d): in_gib(stream_figures(snapshot, d), args.top) for d in devices}
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
