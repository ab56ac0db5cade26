"""The activations' terms: what a layer saves for its backward pass, the transient widths of a
backward, a prefill and a forward, and the quantized matmuls' extra temporaries.
"""

from __future__ import annotations

from fitbench.models.architecture import Architecture
from fitbench.planning.memory_constants import ACTIVATION_QUANTIZATION_BYTES, HF_WIDE_AT_MLP
from fitbench.planning.outliers import outlier_columns
from fitbench.planning.sharding import rank_layer_params, tp_layer_matrices
from fitbench.planning.terms import MLP, OUTLIERS, Term, Widths
from fitbench.precisions import entry


def norm_saved_bytes(tokens: int, hidden: int, widths: Widths, frozen: bool = False, backend: str = "native",
                     layer_norm: bool = False) -> float:
    """One norm's saved tensors, without its output, which the matmuls reading it save.

    - native RMSNorm (``fitbench.models.layer_ops.rms_norm``): its input (r n h) and 1/rms (4 n);
      its backward pass recomputes the normalized input, whether the weight trains or is ``frozen``,
      and its output is in the compute dtype (c n h), the matmuls' input;
    - transformers' RMSNorm (``LlamaRMSNorm``) upcasts once: its input (r n h), or one fp32 copy
      (4 n h) of a 16-bit one; 1/rms (4 n); and its normalized output (4 n h in fp32, c n h once
      cast back in 16 bits), which the product with the weight keeps for the weight's gradient, so
      not when the weight is ``frozen``;
    - LayerNorm (``layer_norm``; autocast runs it in fp32): its input (r n h) and its mean and
      1/std (2 r n); its output is saved by the matmul that reads it, not by the norm.
    """
    n, h, c, r = tokens, hidden, widths.compute, widths.residual
    if layer_norm:
        return r * n * h + 2 * r * n
    if backend == "native":
        return r * n * h + 4 * n
    normalized = 0 if frozen else (4 * n * h if r == 4 else c * n * h)
    return (r * n * h if r == 4 else 4 * n * h) + normalized + 4 * n


def saved_per_layer(arch: Architecture, tokens: int, widths: Widths, tp: int = 1, frozen_norms: bool = False,
                    backend: str = "native", context: int = 0) -> float:
    """Bytes one layer saves for its backward pass (fused attention, no recompute), for n tokens of
    sequences of ``context`` tokens, on ``backend``.

    Llama family, tensor by tensor in forward order (n tokens, widths r, c as in the module docstring),
    the native decoder's eager training operators (``fitbench.models.layer_ops``) as they save, with
    its fused or separate projections alike:

    - input RMSNorm: ``norm_saved_bytes`` (transformers' less its normalized output when
      ``frozen_norms``);
    - q, k, v projections: their input, the native norm's output in the compute dtype, shared by
      the three (c n h); in transformers' model cast to 16 bits once per projection under autocast
      (3 c n h), otherwise shared (c n h);
    - rotary q and k (c n h + c n k) and v (c n k), saved by attention, with its output (c n h),
      which the output projection saves as its input, and the log-sum-exp (4 n H); the native
      rotation itself saves nothing; in fp32 with grouped heads the native decoder expands k and v
      to all heads first (c n h each), since no fused fp32 kernel takes grouped heads (transformers
      passes grouped heads to the kernel);
    - post-attention RMSNorm: as the first, on the new residual (r n h);
    - gate and up projections: their input, shared as the first's (c n h; transformers' two casts,
      2 c n h, under autocast);
    - SwiGLU: gate and up outputs, which the native SwiGLU saves (it recomputes silu(gate)), and the
      product the down projection saves (3 c n f); transformers' model saves silu(gate) too (4 c n f).

    Falcon (``FalconDecoderLayer``, parallel attention and MLP, both LayerNorms reading the layer's
    input): that input (r n h) and each norm's mean and 1/std (4 r n); six h-wide tensors (6 c n h):
    the two norms' outputs (or their 16-bit casts) saved by ``query_key_value`` and
    ``dense_h_to_4h``, the rotary queries, the keys and values broadcast to every head, and
    attention's output; the log-sum-exp (4 n H); the GELU's input and output (2 c n f); and the
    boolean causal mask, which the attention kernel saves converted to the compute dtype (c n T).

    GPT-2 (``GPT2Block``): the layer's input and the residual after attention (2 r n h), each
    LayerNorm's mean and 1/std (4 r n); eight h-wide tensors (8 c n h): ``c_attn``'s input, its
    3 h-wide output whose q, k, v views attention saves, attention's output and its reshaped copy
    that ``c_proj`` saves, ``c_fc``'s input and one more copy of a norm's output; the log-sum-exp
    (4 n H); and the tanh GELU (``NewGELUActivation``, written out in tensor operations), which
    saves x, tanh(.), 0.5 x and 1 + tanh(.), beside ``c_proj``'s input (5 c n f). Under autocast on
    a GPU, ``pow`` is one of the operations CUDA's autocast runs in fp32, so from it on the chain is
    fp32: x cast to fp32, tanh(.) and 1 + tanh(.) are saved in 4 bytes, 0.5 x and ``c_proj``'s cast
    input in c: (12 + 2 c) n f (``gpt2_gelu_upcast_bytes`` more than 5 c n f; measured on one H200,
    gpt2-xl bf16 4 x 1024: 53.7 GB against 45.7 GB predicted without it, 7.5 GB of it this term).
    The CPU's autocast keeps ``pow`` in 16 bits, so the CPU trace sees 5 c n f.

    Every figure above is checked against the fake-tensor trace of the real modules
    (``fitbench.worker.trace``).
    """
    n, h, f = tokens, arch.hidden_size, arch.ffn_size
    k, heads = arch.num_kv_heads * arch.head_dim, arch.num_heads
    c, r = widths.compute, widths.residual
    if backend == "native" and arch.family != "llama":
        # The native decoder's Falcon and GPT-2 blocks, with the fused projections one GPU trains:
        # the layer's input (and GPT-2's residual after attention) and each LayerNorm's mean and
        # 1/std; the two norms' outputs, each read by one matmul (c n h each; under autocast the
        # fp32 output's one cast); attention's q, its k and v (expanded to every head in fp32, as
        # for Llama), its output and log-sum-exp; the GELU's input and output (2 c n f, one
        # ``F.gelu``). No mask: attention is causal by flag.
        residuals = 1 if arch.parallel_attention else 2
        kv_saved = 2 * c * n * (h if c == 4 and k != h else k)
        attention = (2 * c * n * h + kv_saved + 4 * n * heads) / tp
        return residuals * r * n * h + 4 * r * n + 2 * c * n * h + attention + 2 * c * n * f / tp
    if arch.family == "falcon":
        attention = (4 * c * n * h + 4 * n * heads + c * n * context) / tp
        return r * n * h + 4 * r * n + 2 * c * n * h + attention + 2 * c * n * f / tp
    if arch.family == "gpt2":
        attention = (6 * c * n * h + 4 * n * heads) / tp
        mlp = 5 * c * n * f / tp + gpt2_gelu_upcast_bytes(arch, n, widths, tp)
        return 2 * r * n * h + 4 * r * n + 2 * c * n * h + attention + mlp
    # Under tensor parallelism a training step's activations are DTensors, for which the native norm runs
    # its plain expressions, not its Function (``fitbench.models.layer_ops.eager_training``): it saves
    # what transformers' norm saves.
    norm = norm_saved_bytes(n, h, widths, frozen_norms, "hf" if tp > 1 else backend)
    casts = widths.autocast and backend == "hf"
    attention_inputs = 3 * c * n * h if casts else c * n * h
    expanded = backend == "native" and c == 4 and k != h
    kv_saved = 2 * c * n * (h if expanded else k)
    attention = (c * n * h + kv_saved + c * n * h) / tp + 4 * n * heads / tp
    mlp_inputs = 2 * c * n * h if casts else c * n * h
    mlp = (3 if backend == "native" else 4) * c * n * f / tp
    return 2 * norm + attention_inputs + attention + mlp_inputs + mlp


def backward_transient_bytes(arch: Architecture, tokens: int, widths: Widths, tp: int = 1,
                             backend: str = "native") -> float:
    """What a native layer's backward pass holds beyond the layer's saved tensors at its widest, in
    SwiGLU's backward (``fitbench.models.layer_ops.swiglu``): the gradients of gate and up (2 c n f)
    written beside the gradient of their product (c n f), the product itself (c n f) freed with the
    down projection's backward: 2 c n f. The layer's weight gradients not formed yet are counted
    already (an over-estimate of one layer's weights). transformers' model is held to its saved
    tensors (0 here)."""
    if backend != "native" or arch.family != "llama":
        return 0.0
    return 2 * widths.compute * tokens * arch.ffn_size / tp


def gpt2_gelu_upcast_bytes(arch: Architecture, tokens: int, widths: Widths, tp: int = 1) -> float:
    """What GPT-2's tanh GELU saves beyond 5 c n f under a GPU's autocast, which runs ``pow`` in
    fp32: x, tanh(.) and 1 + tanh(.) in fp32 instead of c bytes, (12 + 2 c - 5 c) n f; nothing
    without autocast or for other families."""
    if arch.family != "gpt2" or not widths.autocast:
        return 0.0
    c = widths.compute
    return (12 + 2 * c - 5 * c) * tokens * arch.ffn_size / tp


def mlp_backward_bytes(arch: Architecture, tokens: int, widths: Widths, tp: int = 1) -> float:
    """What a layer's backward pass holds beyond its saved activations where it is widest, in its MLP:
    the gradient flowing into the layer (r n h), and the MLP's gradients beyond the down projection's
    input, which its backward has freed by then. SwiGLU (llama) forms the product's gradient, then
    from it gate's and up's at once: 3 c n f less the product's c n f; a plain activation (Falcon's
    and GPT-2's GELU) its output's gradient, then its input's: 2 c n f less the output's c n f."""
    gradients = 2 if arch.family == "llama" else 1
    return widths.residual * tokens * arch.hidden_size + gradients * widths.compute * tokens * arch.ffn_size / tp


def first_layer_unformed(arch: Architecture, tp: int = 1) -> int:
    """Parameters of a layer, on one tensor-parallel rank, whose gradients its MLP's backward finds not
    yet formed: all but the down projection's (``mlp_backward_bytes``'s moment follows its backward)."""
    rows, columns, bias = tp_layer_matrices(arch, tp)[-1]  # the down projection: the layer's last matrix
    return rank_layer_params(arch, tp) - rows * columns - bias


def output_backward_bytes(tokens: int, hidden: int, vocab: int, widths: Widths, weight: float) -> float:
    """What the output projection's backward holds beside the saved activations, where it is widest,
    for its ``weight`` parameters on this rank (none when frozen). Its matmul forms its input's
    gradient (c n h) and its weight's (c x weight) beside the logits' gradient (c n V), which the
    fused loss left in the logits; under autocast the weight's 16-bit gradient is then cast to the
    weights' width (w x weight), once the logits' gradient and the matmul's saved input and 16-bit
    weight are freed."""
    n, c = tokens, widths.compute
    cast = widths.weights * weight - c * n * vocab if widths.autocast else 0.0
    return c * n * vocab + max(c * n * hidden + c * weight, cast)


def recompute_per_layer(arch: Architecture, tokens: int, widths: Widths) -> float:
    """A checkpointed layer keeps only its input (r n h)."""
    return widths.residual * tokens * arch.hidden_size


def final_saved_bytes(arch: Architecture, tokens: int, widths: Widths, frozen_norm: bool = False,
                      backend: str = "native") -> float:
    """The final norm's saved tensors and the output projection's input (its cast, or the norm's
    own output)."""
    return (norm_saved_bytes(tokens, arch.hidden_size, widths, frozen_norm, backend, arch.layer_norm)
            + widths.compute * tokens * arch.hidden_size)


def prefill_transient_bytes(arch: Architecture, tokens: int, widths: Widths, tp: int = 1, backend: str = "native",
                            context: int = 0) -> float:
    """The most one layer holds at once without autograd, and the token ids (8 n).

    Inside the MLP: SwiGLU's silu(gate), up and their product (3 c n f; gate itself is freed once
    silu has read it); Falcon's GELU input and output (2 c n f); GPT-2's tanh GELU, written out in
    tensor operations in transformers, its input and three intermediates (4 c n f), one ``F.gelu`` in
    the native decoder (2 c n f). Beside them, residual-sized
    tensors: in the native decoder three (3 r n h: the layer's input, which the caller still holds,
    the residual after attention and its normalized copy); in transformers' models ``HF_WIDE_AT_MLP``;
    and Falcon's boolean causal mask (B T^2 = n T bytes)."""
    n, h, f, c, r = tokens, arch.hidden_size, arch.ffn_size, widths.compute, widths.residual
    intermediates = {"llama": 3, "falcon": 2, "gpt2": 2 if backend == "native" else 4}[arch.family] * c * n * f / tp
    residuals, casts = (3, 0) if backend == "native" else HF_WIDE_AT_MLP[arch.family]
    mask = n * context if backend == "hf" and arch.family == "falcon" else 0
    return (residuals * r + casts * c) * n * h + intermediates + mask + 8 * n


def int8_outlier_terms(arch: Architecture, tokens: int, widths: Widths, tp: int = 1) -> list[Term]:
    """LLM.int8's widest moment in a prefill or forward of n tokens: the MLP's output projection (h x f)
    taking its k outlier columns (``fitbench.planning.outliers``) out of the int8 product
    (bitsandbytes' ``int8_mixed_scaled_mm``). Beside the residual stream (3 r n h, as at the MLP) and
    the projection's input (c n f): the outlier columns of the input in fp16 (2 n k), the same columns
    of the int8 weight gathered (h k), the weight columns dequantized in fp32, the product with the row
    scales and its scaled copy (2 x 4 h k), and two n x h 4-byte buffers of the int8 product. Traced on
    one H200 (benchmarks/peak_anatomy.py, 7B 4 x 512): 612 MB live against 613 MB from this formula.

    The reserve: the dequantized columns change size from layer to layer as k does, so the caching
    allocator finds no hole of the next size and maps more; on the same trace reserved memory grew by
    four blocks of the pair's size (713 MB) for the 360 MB the pair holds: one more pair (8 h k)."""
    n, h, f, c, r = tokens, arch.hidden_size, arch.ffn_size, widths.compute, widths.residual
    k = outlier_columns(arch, n) / tp
    live = 3 * r * n * h + c * n * f / tp + 2 * n * k + 9 * h * k + 8 * n * h
    return [Term("LLM.int8 outlier columns", live,
                 f"3 r n h + c n f + 2 n k + 9 h k + 8 n h, k = {k:,.0f} of {f / tp:,.0f} input columns of the "
                 f"MLP's output projection holding an outlier (|x| >= 6) on random weights", frozenset({OUTLIERS})),
            Term("LLM.int8 allocator reserve", 8 * h * k, "one more fp32 pair of dequantized outlier columns "
                 "(8 h k): blocks that change size from layer to layer (measured)", frozenset({OUTLIERS}))]


def activation_quantization_term(arch: Architecture, tokens: int, compute: float, tp: int) -> Term:
    """The widest matmul input, ``n x f`` for the MLP's down projection, being quantized: 13 B per
    element beside it. In Llama's MLP silu(gate) and up (``2 c n f`` of the MLP temporaries) are
    freed by then, so the term adds ``(13 - 2 c) n f``; other families add the 13 B in full."""
    freed = 2 * compute if arch.family == "llama" else 0
    per_element = ACTIVATION_QUANTIZATION_BYTES - freed
    return Term("activation quantization", per_element * tokens * arch.ffn_size / tp,
                f"({ACTIVATION_QUANTIZATION_BYTES} - {freed:g}) B x {tokens:,} tokens x {arch.ffn_size:,}: the "
                f"down projection's input in fp32 three times and quantized, beside the MLP's product",
                frozenset({MLP}))


def prefill_reserve_term(arch: Architecture, precision: str, tokens: int, tp: int) -> Term | None:
    """The caching allocator's reserve at a quantized model's prefill MLP: one more block of the
    MLP's largest temporary. The holes one layer's MLP leaves are split by the next layer's smaller
    blocks before its MLP needs them again, so the allocator maps the largest temporary anew. Traced on
    an H200 at 3B fp8 4 x 1024 (``benchmarks/results/2026-11-23-h200-packed-build/anatomy``): the three
    134 MB fp32 temporaries of the down projection's input each mapped pages twice, 187 MB reserved
    beyond the allocations at the peak; 3B nf4 8 x 512: 226 MB, where the product of the MLP (67 MB) is
    the largest; 1B int8 8 x 256: 60 MB. The largest temporary (the entry's ``prefill_reserve``): the
    fp32 copy of the down projection's input (4 B x n x f) where activations are quantized (fp8,
    int8-dynamic); the up projection's int32 product (4 B x n x f) for LLM.int8 (its outlier columns have
    their own, ``int8_outlier_terms``); the MLP's product (c x n x f) for bitsandbytes' 4-bit weights.
    torchao's int4 and fp8-block were not traced and get none."""
    reserve = entry(precision).prefill_reserve
    if tokens <= 1 or reserve is None:
        return None
    per_element, what = reserve.bytes, reserve.what
    return Term("allocator reserve at the MLP", per_element * tokens * arch.ffn_size / tp,
                f"{per_element:g} B x {tokens:,} tokens x {arch.ffn_size:,}: {what} mapped once more, the holes "
                f"of the previous layer split by smaller blocks (traced)", frozenset({MLP}))
