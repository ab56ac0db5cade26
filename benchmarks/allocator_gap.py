"""Where reserved memory exceeds allocated memory in one training configuration, and why.

Runs two training steps of a native preset on the GPU in this process (fitbench's own loop, with
the allocator settings its workers use) under ``torch.cuda.memory._record_memory_history``, then
replays the allocator's event trace: reserved bytes grow with ``segment_alloc``/``segment_map`` and
shrink with their opposites, allocated bytes with ``alloc``/``free_completed``. At the moment of
peak reserved memory it reports the gap (reserved minus allocated), the live blocks largest first
with the Python frame that allocated each, and the allocations made just before the peak (the ones
that found no hole to reuse). The snapshot itself goes beside the summary, for
https://pytorch.org/memory_viz.

Usage (on a GPU): python benchmarks/allocator_gap.py OUT_DIR [--model llama-3.1-8b --batch 2
--seq-len 4096 --precision bf16-pure --recompute]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402  (after the allocator's settings)

from fitbench.models.backends import load_model  # noqa: E402
from fitbench.models.registry import resolve  # noqa: E402
from fitbench.precisions import policy as precision_policy  # noqa: E402
from fitbench.worker.loops import make_step, random_tokens  # noqa: E402
from fitbench.worker.trackers import allocator_settings  # noqa: E402

TRACE_ENTRIES = 2_000_000
SEGMENT_GROWS, SEGMENT_SHRINKS = ("segment_alloc", "segment_map"), ("segment_free", "segment_unmap")


def frame_of(event: dict) -> str:
    """The innermost frame of fitbench or torch.nn code that made the allocation."""
    for frame in event.get("frames", []):
        if "fitbench" in frame["filename"] or "torch/nn" in frame["filename"]:
            return f"{Path(frame['filename']).name}:{frame['line']} {frame['name']}"
    return "?"


def replay(events: list[dict]) -> dict:
    """Reserved and allocated bytes through the trace, and the live blocks at the peak of reserved."""
    reserved = allocated = 0
    live: dict[int, dict] = {}
    peak = {"reserved": -1}
    recent: list[dict] = []
    for index, event in enumerate(events):
        action, size = event["action"], event["size"]
        if action in SEGMENT_GROWS:
            reserved += size
        elif action in SEGMENT_SHRINKS:
            reserved -= size
        elif action == "alloc":
            allocated += size
            live[event["addr"]] = event
            recent = (recent + [event])[-20:]
        elif action == "free_completed":
            allocated -= size
            live.pop(event["addr"], None)
        if reserved > peak["reserved"]:
            blocks = sorted(live.values(), key=lambda e: -e["size"])[:25]
            peak = {"event": index, "reserved": reserved, "allocated": allocated, "gap": reserved - allocated,
                    "largest_live": [{"bytes": e["size"], "where": frame_of(e)} for e in blocks],
                    "last_allocations": [{"bytes": e["size"], "where": frame_of(e)} for e in recent]}
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--precision", default="bf16-pure")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--recompute", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    device = torch.device("cuda")
    arch, policy = resolve(args.model), precision_policy(args.precision)
    lm = load_model(arch, "native", device, policy.weight_dtype, compute_dtype=policy.compute_dtype)
    if args.recompute:
        lm.enable_activation_checkpointing()
    tokens = random_tokens(arch.vocab_size, args.batch, args.seq_len + 1, device, seed=0)
    step = make_step("train", lm, policy, tokens, device)
    torch.cuda.memory._record_memory_history(max_entries=TRACE_ENTRIES)
    for _ in range(2):  # the second step is the first with AdamW's state beside the activations
        step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    with (args.out / "snapshot.pickle").open("wb") as handle:
        pickle.dump(snapshot, handle)

    summary = {
        "configuration": vars(args) | {"out": str(args.out)},
        "allocator_settings": allocator_settings(),
        "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(),
        "stats": {key: value for key, value in torch.cuda.memory_stats().items()
                  if key.startswith(("num_alloc_retries", "inactive_split_bytes.all", "segment.all"))},
        "expandable_segments": [segment.get("is_expandable") for segment in snapshot["segments"]],
        "at_peak_reserved": replay(snapshot["device_traces"][torch.cuda.current_device()]),
    }
    (args.out / "allocator_gap.json").write_text(json.dumps(summary, indent=2, default=str))
    peak = summary["at_peak_reserved"]
    print(f"max allocated {summary['max_allocated'] / 1e9:.2f} GB, max reserved {summary['max_reserved'] / 1e9:.2f} GB; "
          f"at the peak of reserved: {peak['reserved'] / 1e9:.2f} GB reserved, {peak['allocated'] / 1e9:.2f} GB "
          f"allocated, gap {peak['gap'] / 1e9:.2f} GB; settings {summary['allocator_settings']!r}")
    for block in peak["largest_live"][:10]:
        print(f"  live {block['bytes'] / 1e9:7.3f} GB  {block['where']}")
    for block in peak["last_allocations"][-8:]:
        print(f"  new  {block['bytes'] / 1e9:7.3f} GB  {block['where']}")


if __name__ == "__main__":
    main()
