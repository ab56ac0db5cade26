"""How far the caching allocator reserves beyond its allocations while a quantized model is built
layer by layer, with and without returning the free pages after each layer.

Each variant builds in a fresh process (``fitbench.worker.quantize.build_quantized_native``, as the
worker does) and prints the peaks of allocated and reserved memory, and the allocations once the model is built (the
peak beyond them is what the build's temporaries add).

Usage (on a GPU): python benchmarks/build_gap.py [--model 7B] [--precisions int8 nf4 fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def build(model: str, precision: str, release: bool) -> dict:
    import torch

    from fitbench.models.registry import resolve
    from fitbench.worker import quantize
    from fitbench.worker.loops import random_tokens

    if release:
        plain = quantize.quantize_linears

        def quantize_then_release(module, precision, device):
            plain(module, precision, device)
            torch.cuda.empty_cache()

        quantize.quantize_linears = quantize_then_release
    arch, device = resolve(model), torch.device("cuda")
    probe = random_tokens(arch.vocab_size, 1, 64, device, seed=0)
    built, _ = quantize.build_quantized_native(arch, device, precision, probe)
    return {"model": model, "precision": precision, "release_each_layer": release,
            "allocated_after": torch.cuda.memory_allocated(),
            "max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="7B")
    parser.add_argument("--precisions", nargs="+", default=["int8", "nf4", "fp8"])
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # precision, release: one build, in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(build(args.model, args.one[0], args.one[1] == "1")))
        return
    for precision in args.precisions:
        for release in ("0", "1"):
            done = subprocess.run([sys.executable, __file__, "--model", args.model, "--one", precision, release],
                                  capture_output=True, text=True)
            line = done.stdout.strip().splitlines()[-1] if done.returncode == 0 else done.stderr.strip()[-300:]
            row = json.loads(line) if done.returncode == 0 else {"precision": precision, "error": line}
            if "max_reserved" in row:
                row["gap_GB"] = round((row["max_reserved"] - row["max_allocated"]) / 1e9, 3)
                row["build_temporaries_GB"] = round((row["max_allocated"] - row["allocated_after"]) / 1e9, 3)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
