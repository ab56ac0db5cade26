"""One rank of the collectives' measurement: ``fitbench.launch.calibrate.measure_bus_bandwidth`` starts
``python -m fitbench.run.collectives`` once per GPU, or per CPU rank over gloo.

Each rank joins the process group through a file in the measurement's scratch directory (no port
to find or collide); for each message size it times back-to-back all-reduces of one fp32 tensor and
all-gathers into one of the same size after a warm-up, and rank 0 writes the slowest rank's mean
seconds per operation, per size, to a JSON file. Fitting latency and bus bandwidth to them is the
caller's. A rank dies with its parent (``fitbench.util.processes.tie_to_parent``).
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from fitbench.util.processes import tie_to_parent

# torch 2.13 deprecates all_gather_into_tensor for all_gather_single, which torch 2.11 lacks.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def main() -> None:
    parser = argparse.ArgumentParser(description="one rank of fitbench calibrate's collectives measurement")
    for name, kind in (("--rank", int), ("--world", int), ("--backend", str), ("--scratch", Path), ("--timeout", float)):
        parser.add_argument(name, type=kind, required=True)
    # one entry per message size, in the same order
    for name in ("--message-bytes", "--warmup", "--iterations"):
        parser.add_argument(name, type=int, nargs="+", required=True)
    args = parser.parse_args()
    tie_to_parent(args.scratch)
    device = torch.device("cpu")
    if args.backend == "nccl":
        torch.cuda.set_device(args.rank)  # one node: the rank is the local rank
        device = torch.device("cuda", args.rank)
    dist.init_process_group(args.backend, init_method=f"file://{args.scratch / 'rendezvous'}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=args.timeout))
    try:
        runs = [{**time_collectives(device, size, warmup, iterations), "message_bytes": size, "iterations": iterations}
                for size, warmup, iterations in zip(args.message_bytes, args.warmup, args.iterations, strict=True)]
        if args.rank == 0:
            (args.scratch / "collectives.json").write_text(json.dumps({
                "world": args.world, "backend": args.backend, "runs": runs}))
    finally:
        dist.destroy_process_group()


def time_collectives(device: torch.device, message_bytes: int, warmup: int, iterations: int) -> dict[str, float]:
    """The slowest rank's mean seconds per all-reduce of ``message_bytes`` and per all-gather whose
    gathered tensor is ``message_bytes`` (each rank contributes its 1 / world share)."""
    world = dist.get_world_size()
    elements = message_bytes // 4 // world * world
    reduced = torch.ones(elements, dtype=torch.float32, device=device)
    gathered = torch.empty(elements, dtype=torch.float32, device=device)
    share = torch.ones(elements // world, dtype=torch.float32, device=device)
    operations = {"all_reduce_s": lambda: dist.all_reduce(reduced),
                  "all_gather_s": lambda: all_gather(gathered, share)}
    result = {}
    for name, operation in operations.items():
        for _ in range(warmup):
            operation()
        _synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            operation()
        _synchronize(device)
        elapsed = torch.tensor([(time.perf_counter() - start) / iterations], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a collective ends when its slowest rank does
        result[name] = float(elapsed.item())
    return result


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
