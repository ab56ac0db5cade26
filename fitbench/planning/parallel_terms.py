"""What pipeline and data parallelism hold in flight: GPipe's microbatches, FSDP2's gathered layers,
reduce-scatter inputs and cached stream pools, and its CPU offload's staging.
"""

from __future__ import annotations

from fitbench.models.architecture import Architecture
from fitbench.planning.activations import mlp_backward_bytes
from fitbench.planning.sharding import rank_edge_params, rank_layer_params
from fitbench.planning.terms import END, FIRST, LATER, RECOMPUTE, START, Term, Widths
from fitbench.planning.weights import largest_layer_matrix, layer_matmul_params
from fitbench.spec import Stage


def gpipe_terms(arch: Architecture, tokens: int, widths: Widths, tp: int, stage: Stage, microbatches: int,
                recomputed: float, frozen: bool = False) -> list[Term]:
    """What a stage of GPipe (``torch.distributed.pipelining.ScheduleGPipe``, m >= 2 microbatches of n
    tokens each) holds beyond one microbatch's step, per rank (torch 2.11 to 2.13,
    ``torch/distributed/pipelining/stage.py``):

    - the stage's output of every microbatch whose backward has not run, kept by the schedule for it
      (``fwd_cache``): m - 1 of them at the first microbatch's backward and at the second's start; on
      the last stage the logits, c n V / tp x tp = c n V each (the fused loss wrote their gradient over
      them), elsewhere the hidden states, r n h each;
    - a receive buffer per microbatch for the gradient of the stage's output, on every stage but the
      last, allocated at the first step and kept: m r n h (the forward's buffers are the next
      layer's inputs, counted with the activations);
    - at the second microbatch's backward (``LATER``) every gradient exists already, the first
      microbatch's (the gradients term, the input embedding's on the first stage included), and each
      new one is formed beside the one it is added to: the layer in backward (its recomputed
      activations ``recomputed`` under checkpointing, the weight copies under autocast and its MLP's
      backward, ``mlp_backward_bytes``) with the largest parameter's new gradient (c, then cast to w
      under autocast), or on the last stage the output projection's backward where larger, its input's
      gradient and its weight's new gradient, c (n h + V h / tp).

    Measured on 4 x H100 (13B, bf16-pure, 4 x 1024, checkpointed, 4 stages of 10 layers,
    ``benchmarks/results/2026-11-27-h100x4-model-parallel/8``): allocated peaks 0.72, 0.41, 0.41 and
    0.61 GB above the first microbatch's backward as planned before, for the first, middle and last
    stages; these terms add 0.78, 0.45, 0.45 and 0.58 GB there."""
    n, h, V = tokens, arch.hidden_size, arch.vocab_size
    c, r, w = widths.compute, widths.residual, widths.weights
    output = c * n * V if stage.last else r * n * h
    terms = [Term("outputs awaiting their backward", (microbatches - 1) * output,
                  f"{microbatches - 1} x " + (f"c n V = {c} x {n:,} x {V:,}" if stage.last else
                                              f"r n h = {r} x {n:,} x {h:,}")
                  + ": the stage's outputs the schedule keeps for the microbatches not yet backward",
                  frozenset({START, RECOMPUTE, FIRST, LATER}))]
    if not stage.last:
        terms.append(Term("gradient receive buffers", microbatches * r * n * h,
                          f"m r n h = {microbatches} x {r} x {n:,} x {h:,}: one buffer per microbatch for the "
                          f"gradient of the stage's output, kept from the first step on"))
    new_gradient = 0.0 if frozen else (c + (w if widths.autocast else 0)) * largest_layer_matrix(arch) / tp
    casts = c * layer_matmul_params(arch) / tp if widths.autocast else 0.0
    layer = recomputed + casts + mlp_backward_bytes(arch, n, widths, tp) + new_gradient
    head = c * (n * h + (0 if frozen else V * h / tp)) if stage.last else 0.0
    terms.append(Term("second microbatch in backward", max(layer, head),
                      f"max(layer, head) = max({layer:,.0f}, {head:,.0f}) B: a layer's backward (recomputed "
                      f"activations, weight copies, its MLP's gradients and the largest parameter's new gradient "
                      f"before it is added to the first microbatch's) or the output projection's (its input's "
                      f"gradient and its weight's new one)", frozenset({LATER})))
    return terms


def copy_in_pool(layer: float, root: float, g: int) -> tuple[float, str]:
    """Bytes FSDP's copy-in stream keeps mapped, and the formula that gives them, from ``layer`` = c p and
    ``root`` = c E, the gathered bytes of a decoder layer and of the root, over g shards
    (``fsdp_in_flight``): 2 c p + c E where the root's all-gather output is smaller than a layer's,
    else max(2 c p, (1 + 1/g) c E)."""
    if root < layer:
        return 2 * layer + root, "2 c p + c E"
    return max(2 * layer, (1 + 1 / g) * root), "max(2 c p, (1 + 1/g) c E)"


def fsdp_in_flight(arch: Architecture, c: float, rd: float, g: int, tp: int = 1) -> list[Term]:
    """FSDP2's unsharded units beside the shards (the module docstring): c the gathered (compute)
    dtype's width, rd the reduce dtype's, which is the sharded parameters' own (fp32 under
    ``MixedPrecisionPolicy(bf16, reduce fp32)``, bf16 in bf16-pure), g the shards. Under FSDP x TP each
    unit gathers the rank's tensor-parallel share (``rank_layer_params``, ``rank_edge_params``).

    An all-gather's flat input and output are allocated on FSDP's copy-in stream and the parameters
    are copied out of it into their own storage on the compute stream. The caching allocator keeps a
    pool per stream, so the copy-in stream's pool stays mapped at its largest from the first step on:
    two layers' outputs, or the root's output with its input, max(2 c p, (1 + 1/g) c E); where the
    root's output is smaller than a layer's (c E < c p), the block it leaves is never large enough for
    a layer's output, and the two layers' outputs are mapped beside it: 2 c p + c E (``copy_in_pool``).
    Read from the allocator's snapshots, torch 2.11 (``benchmarks/allocator_streams.py``): on
    2 x H200, 1.46 GiB for the 20B preset in bf16-pure, 2 c p (c E = 1.007 c p), and 2.94 GiB for
    llama-3.1-8b in bf16, (1 + 1/2) c E; on 4 x H200 and 4 x H100, 2.79 GiB for the 30B preset in
    bf16-pure, 2 c p + c E (c E = 0.80 c p)."""
    whole = Stage(0, 1, range(arch.num_layers))
    p, V, h = rank_layer_params(arch, tp), arch.vocab_size, arch.hidden_size // tp
    E = rank_edge_params(arch, tp, whole)
    head = V * h + arch.final_norm_params
    G = E + (V * h if arch.tie_embeddings else 0)
    pool, pool_formula = copy_in_pool(c * p, c * E, g)
    return [
        Term("FSDP root gathered", c * E, f"c E = {c:g} B x {E:,} parameters of the root (embeddings, final norm, "
             f"output projection), not resharded after forward"),
        Term("FSDP layers gathered", 2 * c * p, f"2 c p = 2 x {c:g} B x {p:,}: the layer at work, copied out of "
             f"its all-gather, and an all-gather output", frozenset({START, RECOMPUTE, FIRST})),
        Term("FSDP all-gather pool", pool - c * p,
             f"{pool_formula} - c p, c p = {c * p:,.0f} B, c E = {c * E:,.0f} B, g = {g}: the copy-in stream's pool "
             f"(two layers' all-gather outputs, beside the root's where it is the smaller, or the root's "
             f"output and input) beyond the output in use", cached=True),
        Term("FSDP layer gradients", (c + rd) * p, f"(c + rd) p = ({c:g} + {rd:g}) B x {p:,}: a layer's unsharded "
             f"gradients beside the previous layer's reduce-scatter input", frozenset({FIRST})),
        Term("FSDP root gradients", c * head, f"c (V h + norm) = {c:g} B x {head:,}: the output projection's and "
             f"final norm's gradients, unsharded until the root's reduce-scatter", frozenset({RECOMPUTE, FIRST})),
        Term("FSDP root reduce-scatter", max(c * G + rd * p, rd * E), f"max(c G + rd p, rd E), G = {G:,}: the "
             f"root's gradients beside the first layer's reduce-scatter input, then the root's own input",
             frozenset({END})),
    ]


def fsdp_offload_staging(arch: Architecture, w: float, c: float, g: int) -> Term:
    """Under FSDP's CPU offload, what of the shards passes through the GPU: before a unit's all-gather
    its shard is copied in (w) and cast into the all-gather's input (c), and after its reduce-scatter
    the gradient's shard waits for its copy back to host memory (w); two layers in flight, the root's
    larger shard counted for one of them (torch 2.13, ``torch/distributed/fsdp/_fully_shard/``
    ``_fsdp_param.py``: ``offload_to_cpu``)."""
    p = arch.params_per_layer
    E = arch.total_params - p * arch.num_layers
    shard = (p + max(p, E)) / g
    return Term("FSDP offload staging", (2 * w + c) * shard, f"(2 w + c) (p + max(p, E)) / g = ({2 * w:g} + {c:g}) "
                f"B x {shard:,.0f}: two units' shards copied in, cast for their all-gather, and their gradients' "
                f"shards on the way out")
