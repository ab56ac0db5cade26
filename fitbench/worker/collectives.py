"""One rank of the collectives' measurement: ``fitbench.launch.calibrate.measure_bus_bandwidth`` starts
``python -m fitbench.worker.collectives`` once per GPU, or per CPU rank over gloo, on one node;
``fitbench.launch.calibrate.measure_across_nodes`` starts it through torchrun agents, one per node.

On one node, each rank joins the process group through a file in the measurement's scratch
directory (no port to find or collide); for each message size it times back-to-back all-reduces of
one fp32 tensor and all-gathers into one of the same size after a warm-up, and rank 0 writes the
slowest rank's mean seconds per operation, per size, to a JSON file.

Started by torchrun (no ``--rank``), the ranks join through torchrun's environment and time two
levels apart: ``intra``, each node's ranks as a group, and ``inter``, each group of the ranks of one
local rank across the nodes (one GPU per node, as the levels of ``fitbench.planning.nodes`` run); every
group of a level at once, as a step's collectives run, the level's time its slowest rank's. Rank 0
prints them as one line, ``RESULT_PREFIX`` then JSON, on its standard output, which torchrun and
srun pass on to whoever started the agents: the nodes need no shared directory. Fitting latency
and bus bandwidth to the times is the caller's. A rank dies with its parent
(``fitbench.util.processes.tie_to_parent``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from fitbench.util.processes import tie_to_parent

# torch 2.13 deprecates all_gather_into_tensor for all_gather_single, which torch 2.11 lacks.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
RESULT_PREFIX = "fitbench-collectives "


def main() -> None:
    parser = argparse.ArgumentParser(description="one rank of fitbench calibrate's collectives measurement")
    for name, kind in (("--backend", str), ("--scratch", Path), ("--timeout", float)):
        parser.add_argument(name, type=kind, required=True)
    # without them, torchrun's environment names the rank and the world
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world", type=int)
    # one entry per message size, in the same order
    for name in ("--message-bytes", "--warmup", "--iterations"):
        parser.add_argument(name, type=int, nargs="+", required=True)
    args = parser.parse_args()
    tie_to_parent(args.scratch)
    agents = args.rank is None
    local = int(os.environ["LOCAL_RANK"]) if agents else args.rank  # one node: the rank is the local rank
    device = torch.device("cpu")
    if args.backend == "nccl":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    timeout = timedelta(seconds=args.timeout)
    if agents:
        dist.init_process_group(args.backend, timeout=timeout)
    else:
        dist.init_process_group(args.backend, init_method=f"file://{args.scratch / 'rendezvous'}", rank=args.rank,
                                world_size=args.world, timeout=timeout)
    sizes = list(zip(args.message_bytes, args.warmup, args.iterations, strict=True))
    try:
        if not agents:
            runs = time_level(device, sizes, None)
            if args.rank == 0:
                (args.scratch / "collectives.json").write_text(json.dumps({
                    "world": args.world, "backend": args.backend, "runs": runs}))
            return
        per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        nodes = dist.get_world_size() // per_node
        intra, inter = level_groups(nodes, per_node)
        levels = {"intra": time_level(device, sizes, intra) if per_node > 1 else None,
                  "inter": time_level(device, sizes, inter) if nodes > 1 else None}
        if dist.get_rank() == 0:
            print(RESULT_PREFIX + json.dumps({"world": dist.get_world_size(), "nodes": nodes, "per_node": per_node,
                                              "backend": args.backend, "levels": levels}), flush=True)
    finally:
        dist.destroy_process_group()


def level_groups(nodes: int, per_node: int):
    """This rank's group of each level: its node's ranks (``intra``), and the ranks of its local rank on
    every node (``inter``). Every rank creates every group, in the same order, as ``new_group`` requires;
    a level of one rank per group has none (None)."""
    rank = dist.get_rank()
    mine = {}
    for level, groups in (("intra", [[n * per_node + i for i in range(per_node)] for n in range(nodes)]),
                          ("inter", [[n * per_node + i for n in range(nodes)] for i in range(per_node)])):
        if len(groups[0]) > 1:
            for ranks in groups:
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine[level] = group
    return mine.get("intra"), mine.get("inter")


def time_level(device: torch.device, sizes: list[tuple[int, int, int]], group) -> list[dict]:
    """``time_collectives`` at each (message bytes, warm-up, iterations), in ``group`` (None: every rank)."""
    return [{**time_collectives(device, size, warmup, iterations, group), "message_bytes": size,
             "iterations": iterations} for size, warmup, iterations in sizes]


def time_collectives(device: torch.device, message_bytes: int, warmup: int, iterations: int,
                     group=None) -> dict[str, float]:
    """The slowest rank's mean seconds per all-reduce of ``message_bytes`` and per all-gather whose
    gathered tensor is ``message_bytes`` (each rank of ``group`` contributes its share), every group
    timed at once between barriers of all ranks."""
    world = dist.get_world_size(group)
    elements = message_bytes // 4 // world * world
    reduced = torch.ones(elements, dtype=torch.float32, device=device)
    gathered = torch.empty(elements, dtype=torch.float32, device=device)
    share = torch.ones(elements // world, dtype=torch.float32, device=device)
    operations = {"all_reduce_s": lambda: dist.all_reduce(reduced, group=group),
                  "all_gather_s": lambda: all_gather(gathered, share, group=group)}
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
