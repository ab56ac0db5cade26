"""A pipeline stage's decode step captured in a CUDA graph, as one GPU's step is
(``fitbench.models.graphs``).

Each stage of a pipelined generation runs its own layers for every token: eagerly, its host launches
each of its kernels (several per layer), and at batch 1 that host time, not the weights' bandwidth,
sets the stage's pace. Captured, the stage's step is one replay; the point-to-point sends between
stages stay outside the graph (a stage receives into the buffer the graph reads and sends the buffer
the graph writes), so the stages' graphs are captured independently, each by its own ranks, with
only the stage's tensor-parallel all-reduces inside.

``stage_decode_step`` is ``NativeCausalLM.decode_step`` over the stage's part: the first stage embeds
the token, every stage runs its layers' ``decode`` at a position held on the device with attention
over every slot of its cache (those after the position masked), the last stage applies the head.
Static shapes, nothing synchronizes, so the step captures; through compiled regions
(``fitbench.models.backends.compile_regions``) one compiled decoder layer serves every layer.
"""

from __future__ import annotations

from typing import Callable

import torch

from fitbench.models.graphs import Capture
from fitbench.models.native import EAGER, KVCache, NativeCausalLM, Regions
from fitbench.spec import Stage


def stage_decode_step(model: NativeCausalLM, stage: Stage, x: torch.Tensor, cache: KVCache, position: torch.Tensor,
                      hidden_dtype: torch.dtype, regions: Regions | None = None) -> torch.Tensor:
    """One token through ``stage``: token ids (B, 1) on the first stage, hidden states (B, 1, C) on the
    others, at ``position`` (a (1,) long tensor on the device) -> the last stage's logits (B, 1, V), the
    hidden states (B, 1, C) in ``hidden_dtype`` on the others. ``cache`` holds the stage's layers only."""
    regions = regions or EAGER
    slots = torch.arange(cache.max_len, device=position.device)
    visible = (slots <= position).view(1, 1, 1, -1)  # (1, 1, 1, S)
    cos, sin = model.rope_cos.index_select(0, position), model.rope_sin.index_select(0, position)  # (1, D)
    if stage.first:
        x = model.add_positions(regions.embed(model, x), position)  # (B, 1, C)
    for i, layer_cache in zip(stage.layers, cache.layers()):
        x = regions.layer_decode(model.model.layers[i], x, cos, sin, layer_cache, position, visible)
    if stage.last:
        return regions.head(model, x)  # (B, 1, V)
    return x.to(hidden_dtype)


class GraphedStage:
    """``stage_decode_step`` captured for one cache. ``inputs`` is the buffer the graph reads (the
    token ids on the first stage, the hidden states received on the others), ``position`` the
    position it decodes, advanced on the device after each replay."""

    def __init__(self, step: Callable[..., torch.Tensor], inputs: torch.Tensor, cache: KVCache, position: int,
                 capture: Capture):
        self.inputs = inputs
        self.position = torch.full((1,), position, dtype=torch.long, device=cache.device)  # (1,)
        # the warm-up writes the cache at the position, a slot the first replay writes again before any read
        self.replay = capture(lambda: step(self.inputs, cache, self.position))

    def start(self, position: int) -> None:
        """A new generation in the same cache, whose first decoded token is at ``position``."""
        self.position.fill_(position)

    def __call__(self) -> torch.Tensor:
        """Replay on what ``inputs`` holds now; the output is valid until the next call."""
        out = self.replay.run()
        self.position.add_(1)
        return out
