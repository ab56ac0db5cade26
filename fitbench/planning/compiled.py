"""What a ``torch.compile``d native decoder keeps: saved activations and temporaries after
AOTAutograd's partition and inductor's fusion.

The model, its terms and their sources: docs/planning.md, "The compiled model's terms".
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
