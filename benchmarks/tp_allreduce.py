"""The all-reduce of a tensor-parallel decode step, timed three ways on the GPUs of one node: NCCL's
``all_reduce`` and PyTorch's symmetric-memory one-shot and two-shot all-reduces
(``torch.ops.symm_mem``), at the message sizes a decode step sends.

At batch 1 a decoder layer under TP sends two all-reduces of B x h x 2 bytes (10 kB for the 13B preset,
16 kB for Llama-2-70B): latency, not bandwidth. A one-shot all-reduce has every rank read every peer's
buffer over NVLink and sum in one kernel (no ring, no protocol handshake); a two-shot one reduce-scatters
and all-gathers through the same buffers. Neither needs NVLink multicast (the ``multimem`` variants do).

Each method runs ``LAYERS`` x 2 all-reduces back to back, as a decode step's layers do, captured in a
CUDA graph and replayed ``REPLAYS`` times (and eagerly, for the host's share); the figure is the
median replay's time divided by the all-reduces in it. Each method's result is checked against a sum
formed on one rank from every rank's input.

Usage (one node, N GPUs; NVLink multicast off as the GPU image runs it):
    torchrun --standalone --nproc-per-node N benchmarks/tp_allreduce.py OUT.json
On CPU ranks (gloo) only NCCL's path is replaced by gloo's, to check the script: symmetric memory needs
GPUs.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

# (batch, hidden) of the decode steps measured: 13B (5120) and Llama-2-70B (8192) at batch 1, 8 and 16,
# and one prefill of 512 tokens of the 13B, where bandwidth counts
SHAPES = [(1, 5120), (8, 5120), (16, 5120), (1, 8192), (16, 8192), (512, 5120)]
LAYERS = 40
REPLAYS = 50
WARMUP = 5


def nccl(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor


def one_shot(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.ops.symm_mem.one_shot_all_reduce(tensor, "sum", group_name)


def two_shot(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    torch.ops.symm_mem.two_shot_all_reduce_(tensor, "sum", group_name)
    return tensor


def step(method, buffers: list[torch.Tensor], group_name: str) -> torch.Tensor:
    """LAYERS x 2 all-reduces in a row, each of its own buffer (as each layer's output is its own)."""
    out = None
    for buffer in buffers:
        out = method(buffer, group_name)
    return out


def time_method(method, shape: tuple[int, int], device: torch.device, symmetric: bool, group_name: str,
                graphed: bool) -> float:
    """Seconds per all-reduce, the median over REPLAYS steps."""
    if symmetric:
        from torch.distributed import _symmetric_memory as symm_mem

        buffers = [symm_mem.empty(shape, dtype=torch.bfloat16, device=device) for _ in range(2 * LAYERS)]
        for buffer in buffers:
            symm_mem.rendezvous(buffer, group_name)
    else:
        buffers = [torch.empty(shape, dtype=torch.bfloat16, device=device) for _ in range(2 * LAYERS)]
    for buffer in buffers:
        buffer.fill_(1.0)
    def run() -> torch.Tensor:
        return step(method, buffers, group_name)

    cuda = device.type == "cuda"
    if graphed and cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                run()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay  # noqa: F811: from here on, a step is the graph's replay
    for _ in range(WARMUP):
        run()
    seconds = []
    for _ in range(REPLAYS):
        dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - began)
    return statistics.median(seconds) / (2 * LAYERS)


def check(method, shape: tuple[int, int], device: torch.device, symmetric: bool, group_name: str) -> float:
    """The largest relative difference of ``method``'s sum from the sum of every rank's input."""
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator(device="cpu").manual_seed(rank)
    local = torch.randn(shape, generator=generator).to(torch.bfloat16)
    expected = sum(torch.randn(shape, generator=torch.Generator(device="cpu").manual_seed(r)).to(torch.bfloat16)
                   .float() for r in range(world))
    if symmetric:
        from torch.distributed import _symmetric_memory as symm_mem

        buffer = symm_mem.empty(shape, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(buffer, group_name)
        buffer.copy_(local.to(device))
    else:
        buffer = local.to(device)
    out = method(buffer, group_name).float().cpu()
    return float(((out - expected).abs().max() / expected.abs().max()).item())


def main(out_path: str) -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    group_name = dist.group.WORLD.group_name
    methods = {"nccl": (nccl, False)}
    if cuda:
        methods.update({"symm_mem one-shot": (one_shot, True), "symm_mem two-shot": (two_shot, True)})
    results = []
    for batch, hidden in SHAPES:
        for name, (method, symmetric) in methods.items():
            row = {"method": name, "batch": batch, "hidden": hidden, "bytes": batch * hidden * 2}
            try:
                row["max_relative_error"] = check(method, (batch, hidden), device, symmetric, group_name)
                row["graphed_us"] = 1e6 * time_method(method, (batch, hidden), device, symmetric, group_name, True)
                row["eager_us"] = 1e6 * time_method(method, (batch, hidden), device, symmetric, group_name, False)
            except Exception as error:  # a method this torch or these GPUs do not offer
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
            results.append(row)
    if dist.get_rank() == 0:
        environment = {"world": dist.get_world_size(), "torch": torch.__version__,
                       "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                       "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                       "layers": LAYERS, "replays": REPLAYS}
        with open(out_path, "w") as handle:
            json.dump({"environment": environment, "results": results}, handle, indent=1)
        print("| method | batch x hidden | bytes | graphed us | eager us | max rel. error |")
        print("|---|---|---|---|---|---|")
        for row in results:
            print(f"| {row['method']} | {row['batch']} x {row['hidden']} | {row['bytes']:,} | "
                  f"{row.get('graphed_us', float('nan')):.1f} | {row.get('eager_us', float('nan')):.1f} | "
                  f"{row.get('max_relative_error', float('nan')):.1e} {row.get('error', '')} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
