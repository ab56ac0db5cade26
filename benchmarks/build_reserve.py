"""The caching allocator's reserve beyond its allocations while a model is quantized layer by layer,
across model shapes and precisions.

Each build runs in a fresh process (``fitbench.worker.quantize.build_quantized_native``, as the worker
does) and prints its peaks of allocated and reserved memory and what stays allocated once the model
is built. ``gap_GB`` = peak reserved - peak allocated: memory the allocator holds that no tensor
uses at the build's worst moment.

Usage (on a GPU): python benchmarks/build_reserve.py [--models 3B 7B 13B 30B] [--precisions int8 fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

PRECISIONS = ["int8", "nf4", "fp4", "int8-dynamic", "int4", "fp8", "fp8-block"]


def build(model: str, precision: str) -> dict:
    import torch

    from fitbench.models.registry import resolve
    from fitbench.worker.loops import random_tokens
    from fitbench.worker.quantize import build_quantized_native
    from fitbench.worker.weight_bytes import weight_storage_bytes

    arch, device = resolve(model), torch.device("cuda")
    probe = random_tokens(arch.vocab_size, 1, 64, device, seed=0)
    start = time.time()
    built, _ = build_quantized_native(arch, device, precision, probe)
    torch.cuda.synchronize()
    return {"model": model, "precision": precision, "s": round(time.time() - start, 1),
            "after": torch.cuda.memory_allocated(), "max_alloc": torch.cuda.max_memory_allocated(),
            "max_res": torch.cuda.max_memory_reserved(), "weights": weight_storage_bytes(built)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["3B", "7B", "13B", "30B"])
    parser.add_argument("--precisions", nargs="+", default=PRECISIONS)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # model, precision: one build, in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(build(*args.one)))
        return
    for model in args.models:
        for precision in args.precisions:
            done = subprocess.run([sys.executable, __file__, "--one", model, precision], capture_output=True, text=True)
            if done.returncode:
                print(json.dumps({"model": model, "precision": precision, "error": done.stderr[-400:]}), flush=True)
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            row["gap_GB"] = round((row["max_res"] - row["max_alloc"]) / 1e9, 3)
            row["temp_GB"] = round((row["max_alloc"] - row["after"]) / 1e9, 3)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
