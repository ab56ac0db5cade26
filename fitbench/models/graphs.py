"""Decoding through a CUDA graph: one decode step captured once, replayed for every token.

Eager decoding launches each of a step's kernels from Python, a few microseconds of host time
apiece and several per layer, so at batch 1 the host, not the GPU's memory bandwidth, sets the
speed (transformers' eager ``generate`` on Llama-2-7B bf16: 15% of an H100's bandwidth roofline),
and the decode speeds of different weight formats compare launch overheads. A CUDA graph records
the step's kernels once and launches them all with one call; with a static KV cache that is how
gpt-fast decodes Llama-2-7B at 69% of an A100's bandwidth (its README: 104.9 tokens/s, 1,397 GB/s).
The capture follows torch's "CUDA Graphs" notes.

A graph replays fixed kernels on fixed addresses, so the captured step
(``NativeCausalLM.decode_step``) has static shapes, reads its token and position from buffers that
``GraphedDecode`` fills before each replay, keeps the position on the device, and never
synchronizes.

Memory: the tensors a capture allocates come from a private pool that lives as long as the
graph, so the pool keeps one decode step's temporaries: one layer's at a time plus the logits,
the largest being the MLP's three (B, f) intermediates and the (B, V) logits, about 130 KB for
Llama-2-7B in bf16 at batch 1. Rounded up to the caching allocator's segments (2 MiB for tensors
up to 1 MiB, 20 MiB up to 10 MiB) that is 2 MiB at batch 1 and tens of MiB at batch 64, beside
gigabytes of weights and cache. ``Replay.pool_bytes`` reports what a capture reserved. The side
stream the capture runs on also gets its own cuBLAS workspace in the warm-up (32 MiB per handle
and stream on Hopper: cuBLAS's documentation of cublasSetWorkspace), a constant that
``fitbench calibrate`` measures with the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fitbench.models.native import KVCache, NativeCausalLM

Step = Callable[[], torch.Tensor]
WARMUP_STEPS = 3  # eager runs before the capture, as in torch's notes: lazy initialization happens there


@dataclass(frozen=True)
class Replay:
    """A captured step: ``run`` launches it and returns its output, a tensor the next run
    overwrites; ``pool_bytes`` is the memory the capture reserved."""

    run: Step
    pool_bytes: int = 0


Capture = Callable[[Step], Replay]


def capture_cuda_graph(step: Step) -> Replay:
    """Warm ``step`` up and capture it on one side stream, then replay it on the current stream.

    The warm-up runs first so that what happens once (cuBLAS handles and this stream's workspace,
    kernel selection and autotuning, lazy module state) happens outside the capture, on the stream
    the capture will use. Raises what the capture raises: an operation that synchronizes or
    allocates outside torch (a data-dependent shape, ``.item()``) cannot be captured.
    """
    current = torch.cuda.current_stream()
    # A capture puts the device's random generator in capture mode and only a clean end takes it out;
    # after a failed one, random numbers (a later model's initialization) would fail, so the
    # generator gets back a copy of its state from before.
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    random_state = generator.clone_state()
    side = torch.cuda.Stream()
    side.wait_stream(current)  # the warm-up reads the cache the prefill wrote
    try:
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                step()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-up's temporaries, so that what the capture adds is the pool
        reserved = torch.cuda.memory_reserved()
        graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.graph(graph, pool=pool, stream=side):
                output = step()
        except BaseException:
            _end_failed_capture(pool)
            generator.graphsafe_set_state(random_state)
            raise
    finally:
        # torch.cuda.graph restores the previous stream only when the capture ends cleanly; the
        # eager decoding that follows a failed capture must run where it ran before.
        torch.cuda.set_stream(current)
        current.wait_stream(side)
    pool_bytes = torch.cuda.memory_reserved() - reserved

    def run() -> torch.Tensor:
        graph.replay()
        return output

    return Replay(run, pool_bytes)


def _end_failed_capture(pool) -> None:
    """Tell the caching allocator that a failed capture is over, and free its pool.

    ``CUDAGraph.capture_end`` stops routing allocations to the graph's pool only after
    ``cudaStreamEndCapture`` succeeds. When a step invalidated the capture (it synchronized), that
    call fails and the allocator goes on believing a capture is underway: every later allocation
    of the eager decoding asks the driver whether its stream is capturing, cached memory is no
    longer released before an out-of-memory, and ``torch.cuda.empty_cache`` fails an internal
    assertion. These are the two calls ``torch.cuda.use_mem_pool`` ends a pool with; torch has no
    public one for this.
    """
    device = torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(device, pool)
    except RuntimeError:  # the capture itself ended (the step raised in Python): the graph frees its pool
        return
    torch._C._cuda_releasePool(device, pool)


class GraphedDecode:
    """``decode_step`` captured for one cache. Each call copies the tokens into the buffer the graph
    reads, replays it, and advances the position the graph reads, all on the device."""

    def __init__(self, module: NativeCausalLM, cache: KVCache, position: int, capture: Capture,
                 step: Callable[..., torch.Tensor] | None = None):
        device = cache.device
        self.tokens = torch.zeros((cache.batch, 1), dtype=torch.long, device=device)  # (B, 1)
        self.position = torch.full((1,), position, dtype=torch.long, device=device)  # (1,)
        # The warm-up writes the cache at the position, a slot the first replay writes again
        # before anything reads it.
        step = step or module.decode_step  # or through compiled regions (fitbench.models.backends.compile_regions)
        self.replay = capture(lambda: step(self.tokens, cache, self.position))

    def start(self, position: int) -> None:
        """A new generation in the same cache, whose first decoded token is at ``position``."""
        self.position.fill_(position)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, 1) at the next position -> logits (B, V), valid until the next call."""
        self.tokens.copy_(tokens)
        logits = self.replay.run()
        self.position.add_(1)
        return logits
