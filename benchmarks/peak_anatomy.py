"""What is alive on the GPU at a configuration's peaks: the whole worker measurement of one spec
(build, quality probe, warm-up, capture, measured steps), traced by the caching allocator.

Runs ``fitbench.worker.worker.measure`` in this process under ``torch.cuda.memory._record_memory_history``
(the allocator settings of fitbench's workers), then replays the event trace (allocated bytes follow
``alloc``/``free_completed``, reserved bytes ``segment_alloc``/``segment_map`` and their opposites) and
reports, at the peak of allocated and at the peak of reserved memory, the totals and the live blocks
summed by the frame that allocated them (the innermost frame of fitbench, bitsandbytes, torchao or
torch.nn), and the largest growths of reserved memory with the allocation that made each. The snapshot goes beside the summary, for
https://pytorch.org/memory_viz.

Usage (on a GPU): python benchmarks/peak_anatomy.py OUT_DIR --spec '{"model": "7B", "mode": "infer",
"precision": "int8", "batch_size": 4, "seq_len": 512, "new_tokens": 32}'
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import tempfile
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402  (after the allocator's settings)

from fitbench.worker import worker  # noqa: E402
from fitbench.spec import Assignment, RunSpec  # noqa: E402

TRACE_ENTRIES = 4_000_000
SEGMENT_GROWS, SEGMENT_SHRINKS = ("segment_alloc", "segment_map"), ("segment_free", "segment_unmap")
OWN_CODE = ("fitbench", "bitsandbytes", "torchao", "torch/nn")
DEFAULTS = {"backend": "native", "device": "cuda:0", "warmup_steps": 1, "measure_steps": 3, "new_tokens": 32}


def frame_of(event: dict) -> str:
    """The innermost frame of fitbench, the quantization libraries or torch.nn that made the allocation."""
    for frame in event.get("frames", []):
        if any(part in frame["filename"] for part in OWN_CODE):
            return f"{Path(frame['filename']).name}:{frame['line']} {frame['name']}"
    return "?"


def at_moment(live: dict[int, dict], allocated: int, reserved: int) -> dict:
    by_frame: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for event in live.values():
        entry = by_frame[frame_of(event)]
        entry[0] += event["size"]
        entry[1] += 1
    ranked = sorted(by_frame.items(), key=lambda item: -item[1][0])[:20]
    return {"allocated": allocated, "reserved": reserved, "gap": reserved - allocated,
            "live_by_frame": [{"bytes": b, "blocks": n, "where": where} for where, (b, n) in ranked]}


def totals(events: list[dict]):
    """(allocated, reserved, live blocks) after each event, as a generator."""
    reserved = allocated = 0
    live: dict[int, dict] = {}
    for event in events:
        action, size = event["action"], event["size"]
        if action in SEGMENT_GROWS:
            reserved += size
        elif action in SEGMENT_SHRINKS:
            reserved -= size
        elif action == "alloc":
            allocated += size
            live[event["addr"]] = event
        elif action == "free_completed":
            allocated -= size
            live.pop(event["addr"], None)
        yield allocated, reserved, live


def replay(events: list[dict]) -> dict:
    """The peaks of allocated and of reserved memory through the trace, with what is live at each, and
    the largest growths of reserved memory (each with the allocation that made it)."""
    peak_allocated = peak_reserved = (-1, 0)  # (bytes, -event index)
    growths = []
    for index, (allocated, reserved, _) in enumerate(totals(events)):
        peak_allocated = max(peak_allocated, (allocated, -index))
        peak_reserved = max(peak_reserved, (reserved, -index))
        if events[index]["action"] in SEGMENT_GROWS:
            following = next((e for e in events[index + 1:index + 4] if e["action"] == "alloc"), {})
            growths.append({"bytes": events[index]["size"], "reserved_after": reserved, "allocated": allocated,
                            "for": f"{following.get('size', 0)} B at {frame_of(following)}"})
    moments = {}
    for name, (_, index) in (("at_peak_allocated", peak_allocated), ("at_peak_reserved", peak_reserved)):
        for at, (allocated, reserved, live) in enumerate(totals(events)):
            if at == -index:
                moments[name] = at_moment(live, allocated, reserved)
                break
    moments["largest_growths"] = sorted(growths, key=lambda g: -g["bytes"])[:15]
    return moments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--spec", required=True, help="RunSpec fields as JSON (backend, device, warm-up and "
                                                       "measured steps have defaults)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    spec = RunSpec.model_validate(DEFAULTS | json.loads(args.spec))
    device = torch.device(spec.device)
    torch.cuda.set_device(device)

    torch.cuda.memory._record_memory_history(max_entries=TRACE_ENTRIES)
    with tempfile.TemporaryDirectory() as scratch:
        row = worker.measure(Assignment(spec=spec), device, Path(scratch))
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    with (args.out / "snapshot.pickle").open("wb") as handle:
        pickle.dump(snapshot, handle)
    events = snapshot["device_traces"][device.index or 0]
    summary = {"spec": spec.model_dump(), "status": row["status"], "decode": row.get("decode"),
               "max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved(),
               "trace_events": len(events), "trace_complete": len(events) < TRACE_ENTRIES,
               **replay(events)}
    (args.out / "peak_anatomy.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"{spec.model} {spec.mode} {spec.precision} {spec.batch_size}x{spec.seq_len}: max allocated "
          f"{summary['max_allocated'] / 1e9:.3f} GB, max reserved {summary['max_reserved'] / 1e9:.3f} GB, "
          f"decode {json.dumps(row.get('decode'))[:200]}")
    for name in ("at_peak_allocated", "at_peak_reserved"):
        moment = summary[name]
        print(f" {name}: allocated {moment['allocated'] / 1e9:.3f} GB, reserved {moment['reserved'] / 1e9:.3f} GB")
        for block in moment["live_by_frame"][:12]:
            print(f"   {block['bytes'] / 1e9:8.4f} GB in {block['blocks']:5d} blocks  {block['where']}")
    for growth in summary["largest_growths"]:
        print(f" grew {growth['bytes'] / 1e6:8.1f} MB to {growth['reserved_after'] / 1e9:.3f} GB reserved "
              f"({growth['allocated'] / 1e9:.3f} GB allocated), for {growth['for']}")


if __name__ == "__main__":
    main()
