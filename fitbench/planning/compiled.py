"""What a ``torch.compile``d native decoder keeps: saved activations and temporaries after
AOTAutograd's partition and inductor's fusion.

``--compile`` compiles the whole ``NativeCausalLM`` (``fitbench.models.backends``); the loss stays
outside, eager. AOTAutograd traces forward and backward as one joint graph and splits it with the
min-cut partitioner that inductor uses (``torch._inductor.compile_fx.partition_fn``): a tensor the
backward needs is either saved or recomputed in the backward from what is saved. Pointwise chains
are recomputed (inductor fuses them into the backward's kernels); matmul and attention outputs, the
inputs of a backward matmul and reduction results (1/rms) are saved. What survives, per layer, read
from the forward graph's saved outputs of the native model under bf16 autocast, bf16 weights and
fp32, with and without activation checkpointing (``tests/test_compiled.py`` runs that partition and
holds these formulas to it). Notation as in ``fitbench.planning.memory``: n tokens, h hidden, f MLP
width, k key/value width, H heads, c and r the byte widths of activations and the residual stream.

One layer, without checkpointing:

- its input (r n h) and the residual after attention (r n h): each RMSNorm's backward recomputes the
  normalized value from its input and 1/rms (4 n each, 8 n), so neither the fp32 upcasts nor the
  normalized outputs are kept;
- the two normalized inputs of the matmuls, in the compute dtype (2 c n h): norm, weight and the
  autocast cast fuse into one kernel whose output the q, k, v (or gate, up) projections share, so
  autocast no longer keeps one cast per projection;
- attention's inputs and outputs, as in eager: rotary q (c n h), k and v (2 c n k; fp32 with grouped
  heads keeps them expanded, 2 c n h), its output (c n h) and log-sum-exp (4 n H);
- the MLP: gate and up outputs and their product, the down projection's input (3 c n f); silu(gate)
  is recomputed in the backward.

    saved per layer = 2 r n h + 2 c n h + (2 c n h + 2 c n k + 4 n H + 3 c n f) / tp + 8 n

Under bf16 autocast that is 16 n h + 4 n k + 4 n H + 6 n f + 8 n bytes, what the eager model's own
training operators save too (``fitbench.models.layer_ops``, ``fitbench.planning.activations.saved_per_layer``).
The first layer, whose input is the embedding's output, keeps the attention output projection's
result (c n h) in place of the fp32 residual after attention and recomputes their sum: (r - c) n h
less. After the last layer: its output (r n h), the final norm's 1/rms (4 n) and the output
projection's input (c n h).

With activation checkpointing each layer keeps its input (r n h), as in eager; the last layer's
output is recomputed with that layer, so the final norm keeps only 1/rms and the projection's input.

Built with fused projections (one GPU, DDP, FSDP: ``fitbench.models.backends.load_model``'s default) a
layer saves the same: ``Attention.project`` copies v out of the fused q, k, v output, as eager's rotary
does, so nothing keeps that output alive once q and k are rotated (read from the storages the forward
graph saves, built fused and apart, whole and per layer: ``tests/test_compiled.py``). Before the copy,
attention saved v as a view and kept the whole output, c n (h + k) more per kept layer: 7.63 GB in the
30B preset's compiled FSDP row of ``benchmarks/results/2026-11-27-h200x4-largest`` (35 kept layers x
4 n h, to the byte); ``benchmarks/repredict.py`` lists such rows apart.

The 16-bit weight copies autocast makes are saved as in eager (the transposed casts are forward
outputs). The backward adds one thing eager has not: inductor's decomposition of the embedding's
backward accumulates the input embedding's gradient in fp32 (a zero V x h buffer, then cast to the
weight dtype), so with 16-bit weights the end of the backward holds 4 V h bytes more.

Without autograd (forward, prefill), inductor fuses each norm with its cast and silu with the
product, which it writes over the gate's output; the residual stream is kept, or rebuilt from the
branch outputs, in the fused norm kernels. The most one MLP holds, at the up projection: the residual
after attention (r n h), the projection's normalized input (c n h), the gate and up outputs
(2 c n f), under autocast the projection's 16-bit weight, cast just before (c h f), and the token
ids (8 n). The output projection holds its normalized input (c n h), the logits and, under
autocast, its cast weight. (Read from inductor's generated code on the CPU.)

Checkpointed layers, compiled as one graph (one GPU, tensor parallelism; under FSDP each layer is a
graph of its own): inductor schedules the backward graph's nodes for its estimate of the peak
(``torch._inductor.memory.reorder_for_peak_memory``, on by default), and the recompute of the next
checkpointed layer, which needs only that layer's saved input, runs before the layer at work has
formed its gradients. So where the backward pass reaches the first layers, two layers' recomputed
activations coexist, less the gradients of one layer not yet formed (``recompute_ahead_bytes``).
Traced on the CPU with torch 2.13 (bf16-pure, 2 x 256 tokens, h 256, f 704, the allocator's events
through the profiler): the peak holds 17 n h c and 6 n f c at a layer's attention backward, where the
memory model without this term is 2.53 MB short of 11.69 MB; with it, within 1.2% of the traced peak
at three layers or four, 512 or 1,024 tokens, f 704 or 1,408; without inductor's reordering the peak
is 1.56 MB lower.

The partition was read on the CPU. On a GPU the graph differs only in the attention operator (flash
or memory-efficient attention instead of the CPU flash kernel), which saves the same q, k, v,
output and log-sum-exp; the partitioner's choices come from its bans (not recomputable, needed by
a backward matmul, a reduction), which depend on the graph's structure, not on sizes or the device:
the same tensors survive at the 1B preset's widths (4 x 1536 tokens, three layers) as in the test's
small model. Other families (the hf backend) are not modelled compiled: they get the eager model.
"""

from __future__ import annotations

from fitbench.models.architecture import Architecture


def attention_kv_width(arch: Architecture, compute: int) -> int:
    """Width of the saved keys and values: k, or h when fp32 expands grouped heads for its kernel."""
    k = arch.num_kv_heads * arch.head_dim
    return arch.hidden_size if compute == 4 and k != arch.hidden_size else k


def saved_per_layer(arch: Architecture, tokens: int, compute: int, residual: int, tp: int = 1) -> float:
    """2 r n h + 2 c n h + (2 c n h + 2 c n k + 4 n H + 3 c n f) / tp + 8 n: one compiled layer's
    saved tensors (module docstring)."""
    n, h, f, heads, c, r = tokens, arch.hidden_size, arch.ffn_size, arch.num_heads, compute, residual
    attention = 2 * c * n * h + 2 * c * n * attention_kv_width(arch, c) + 4 * n * heads
    return 2 * r * n * h + 2 * c * n * h + (attention + 3 * c * n * f) / tp + 8 * n


def first_layer_saving(arch: Architecture, tokens: int, compute: int, residual: int) -> float:
    """(r - c) n h: the first layer keeps the attention projection's output, not the residual sum."""
    return (residual - compute) * tokens * arch.hidden_size


def final_saved_bytes(arch: Architecture, tokens: int, compute: int, residual: int, recompute: bool) -> float:
    """After the last layer: its output (r n h, recomputed with the last layer under checkpointing),
    the final norm's 1/rms (4 n) and the output projection's input (c n h)."""
    n, h = tokens, arch.hidden_size
    return (0 if recompute else residual * n * h) + 4 * n + compute * n * h


def recompute_ahead_bytes(arch: Architecture, tokens: int, compute: int, residual: int, layer_gradients: float,
                          tp: int = 1) -> float:
    """saved_per_layer - w p: the next checkpointed layer's recomputed activations, which inductor's
    schedule of one backward graph runs before the layer at work has formed its gradients
    (``layer_gradients``, w p: one layer's on this rank, which the memory model counts as formed
    already; module docstring)."""
    return max(0.0, saved_per_layer(arch, tokens, compute, residual, tp) - layer_gradients)


def embedding_gradient_accumulator(arch: Architecture, weights: float) -> float:
    """4 V h: the fp32 buffer the embedding's backward accumulates into when weights are 16-bit."""
    return 4 * arch.vocab_size * arch.hidden_size if weights < 4 else 0.0


def prefill_transient_bytes(arch: Architecture, tokens: int, compute: int, residual: int, autocast: bool,
                            tp: int = 1) -> float:
    """r n h + c n h + 2 c n f + (c h f under autocast) + 8 n: inside one compiled MLP without autograd."""
    n, h, f, c = tokens, arch.hidden_size, arch.ffn_size, compute
    cast = c * h * f / tp if autocast else 0
    return residual * n * h + c * n * h + 2 * c * n * f / tp + cast + 8 * n


def output_input_bytes(arch: Architecture, tokens: int, compute: int) -> float:
    """c n h: the output projection's input, normalized and cast in one kernel."""
    return compute * tokens * arch.hidden_size
