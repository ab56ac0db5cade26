"""transformers' own fast decode: a static KV cache, and ``generate`` compiling the model's forward
(``torch.compile``, mode reduce-overhead: CUDA graphs), for ``benchmarks/vs_transformers.sh``.

transformers 5.x compiles the decoding forward inside ``generate`` when the cache is static and the
device is a GPU (``GenerationMixin._valid_auto_compile_criteria``); ``CompileConfig`` chooses the
mode. On a CPU it decodes eagerly over the static cache, and the row says so.

The per-token latency is taken as fitbench's is, steady-state decode only: a generation of
``new_tokens`` minus one of a single token (the prefill), over ``new_tokens - 1`` steps; the warm-up
generations (where the compilation happens) are never timed.

Usage: python benchmarks/hf_static_decode.py --model 7B --batch-size 1 --seq-len 128 --new-tokens 128 OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fitbench.models.hf import build_hf
from fitbench.models.registry import resolve


def _timed(model, ids: torch.Tensor, new_tokens: int) -> float:
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(model_name: str, batch: int, seq_len: int, new_tokens: int, warmup: int, repeats: int,
            device: str) -> dict:
    from transformers import CompileConfig

    arch = resolve(model_name)
    torch.manual_seed(0)
    model = build_hf(arch, device, torch.bfloat16).eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = CompileConfig(mode="reduce-overhead")
    model.generation_config.pad_token_id = 0
    compiled = torch.device(device).type == "cuda"
    ids = torch.randint(0, arch.vocab_size, (batch, seq_len), device=device)
    with torch.inference_mode():
        for _ in range(warmup):
            _timed(model, ids, new_tokens)
            _timed(model, ids, 1)
        latencies = [(_timed(model, ids, new_tokens) - _timed(model, ids, 1)) / (new_tokens - 1)
                     for _ in range(repeats)]
    latency = statistics.median(latencies)
    return {"model": model_name, "backend": "hf static cache + compile", "batch_size": batch, "seq_len": seq_len,
            "new_tokens": new_tokens, "device": device, "compiled": compiled,
            "reason": None if compiled else "transformers compiles generate's forward on GPUs only",
            "token_latency_s": latencies, "decode_tokens_per_s": batch / latency,
            "transformers": __import__("transformers").__version__, "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="7B")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2: the decode latency is measured over new_tokens - 1 steps")
    row = measure(args.model, args.batch_size, args.seq_len, args.new_tokens, args.warmup, args.repeats, args.device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
