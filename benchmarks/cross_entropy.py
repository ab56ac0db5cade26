"""The training loss three ways, on one GPU: fitbench's fused loss (``cross_entropy``, which writes the
logits' gradient over them), the out-of-place chunked loss it replaced (``chunked_cross_entropy``), and
the whole fp32 loss (``F.cross_entropy(logits.float(), targets)``).

``head``: the output projection and its loss alone, forward and backward, over (n, h) bf16 inputs and
a (V, h) bf16 weight: the median time of the pair from CUDA events, and the peak of allocated memory
beyond the operands and their gradients, against ``fitbench.models.loss.loss_chain_bytes`` (the fused loss's
chain), the logits' own c n V, and the old chain, 4 n V + max(c n V + 4 r V, 8 r V).

``step``: one training step of a native preset through fitbench's own loop (``make_step``, eager, with
the allocator settings its workers use), the median step time and the peaks of allocated and reserved
memory, beside the planner's estimate of the tensors' peak (``estimate_memory``).

Usage (on a GPU): python benchmarks/cross_entropy.py OUT.json [--tokens 16384] [--vocab 32000 128256]
[--model 1B --batch 8 --seq-len 2048 --precision bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402  (after the allocator's settings)
import torch.nn.functional as F  # noqa: E402

from fitbench.models.backends import load_model  # noqa: E402
from fitbench.models.loss import loss_chain_bytes, loss_chunk_rows  # noqa: E402
from fitbench.models.registry import resolve  # noqa: E402
from fitbench.planning.memory import estimate_memory  # noqa: E402
from fitbench.precisions import policy  # noqa: E402
from fitbench.worker import loops  # noqa: E402
from fitbench.worker.cross_entropy import chunked_cross_entropy, cross_entropy  # noqa: E402
from fitbench.worker.timing import DeviceClock, time_steps  # noqa: E402

LOSSES = {"fused": cross_entropy, "chunked": chunked_cross_entropy,
          "whole": lambda logits, targets: F.cross_entropy(logits.float(), targets)}


def timed(run, repeats: int) -> float:
    """Median seconds of ``run`` over ``repeats`` calls after three untimed ones (``time_steps``: CUDA events)."""
    seconds, _ = time_steps(run, DeviceClock(torch.device("cuda")), warmup=3, repeats=repeats)
    return statistics.median(seconds)


def head(loss_name: str, tokens: int, vocab: int, hidden: int, repeats: int) -> dict:
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=generator).requires_grad_()
    weight = (torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16, generator=generator)
              / hidden**0.5).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    loss = LOSSES[loss_name]

    def run() -> None:
        x.grad = weight.grad = None
        loss(x @ weight.t(), targets).backward()

    seconds = timed(run, repeats)
    x.grad = weight.grad = None
    torch.cuda.synchronize()
    operands = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    beyond = torch.cuda.max_memory_allocated() - operands
    n, V, rows = tokens, vocab, min(loss_chunk_rows(vocab), tokens)
    return {"loss": loss_name, "tokens": n, "vocab": V, "hidden": hidden, "ms": seconds * 1e3,
            "peak_beyond_operands": beyond, "logits_bytes": 2 * n * V,
            "fused_chain": loss_chain_bytes(n, V, 2),
            "old_chain": 4 * n * V + max(2 * n * V + 4 * rows * V, 8 * rows * V)}


def step(loss_name: str, model: str, batch: int, seq_len: int, precision: str, repeats: int) -> dict:
    device = torch.device("cuda")
    loops.cross_entropy = LOSSES[loss_name]
    arch, rules = resolve(model), policy(precision)
    torch.manual_seed(0)
    lm = load_model(arch, "native", device, rules.weight_dtype, compute_dtype=rules.compute_dtype)
    run = loops.make_step("train", lm, rules, loops.random_tokens(arch.vocab_size, batch, seq_len + 1, device, 0),
                          device)
    seconds = timed(run, repeats)
    estimate = estimate_memory(arch, "train", precision, batch, seq_len)
    return {"loss": loss_name, "model": model, "batch": batch, "seq_len": seq_len, "precision": precision,
            "step_ms": seconds * 1e3, "peak_allocated": torch.cuda.max_memory_allocated(),
            "peak_reserved": torch.cuda.max_memory_reserved(), "estimated_tensor_peak": estimate.peak_bytes,
            "estimated_moment": estimate.peak_moment}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--what", choices=("head", "step"), default="head")
    parser.add_argument("--loss", choices=tuple(LOSSES), nargs="+", default=list(LOSSES))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--model", default="1B")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if args.what == "head":
        rows = [head(name, args.tokens, vocab, args.hidden, args.repeats) for vocab in args.vocab for name in args.loss]
    else:  # one loss per process: each step's peaks start from a fresh allocator
        rows = [step(args.loss[0], args.model, args.batch, args.seq_len, args.precision, args.repeats)]
    rows = [{**row, "device": torch.cuda.get_device_name(), "torch": torch.__version__} for row in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
