"""Per-GPU peak memory of one configuration, term by term, before any GPU is touched.

The terms follow fitbench's own loops and native decoder tensor by tensor (``fitbench.run.loops``,
``fitbench.models.native``); ``fitbench.plan.trace`` runs those loops on fake tensors and is the
reference the tests hold this model to. Notation: ``n = B x T`` tokens, ``h`` hidden size, ``f``
MLP width, ``k`` the key/value width (kv heads x head dim), ``H`` heads, ``V`` vocabulary,
``L`` layers, ``P`` parameters. Byte widths: ``w`` weights, ``c`` compute (activations), ``r``
the residual stream (fp32 under autocast: the embedding is not autocast and the fp32 stream
absorbs each 16-bit branch it is added to).

Peak, not sum. A training step (gradients set to None at its start, fused AdamW) peaks at one of:

- the start of the backward pass: weights, AdamW state, every saved activation, and the logits'
  loss chain (16-bit logits, fp32 log-softmax output, its incoming and outgoing gradients);
- the optimizer step: weights, gradients and AdamW state (16 bytes per parameter in mixed precision).

Inference and forward passes keep nothing for a backward pass: their peak is the weights (and,
under autocast, their 16-bit copies, which autocast caches for the whole forward), the KV cache,
and the largest set of temporaries one layer holds at once.

Sharding divides terms per GPU (``Parallelism``): tensor parallelism divides every layer's
weights, the attention and MLP activations and the KV cache by its degree; FSDP divides weights,
gradients and optimizer state by the data-parallel degree and adds the unsharded units in flight;
pipeline parallelism divides the layers by its stages. Constants outside the formulas (CUDA
context, allocator slack, communication buffers) come from ``fitbench.plan.calibration``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fitbench.models.architecture import Architecture

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    formula: str
    at_peak: bool = True  # whether it is part of the peak moment


@dataclass(frozen=True)
class Widths:
    """Byte widths of weights (w), activations (c) and the residual stream (r), and whether
    autocast casts inputs and weights to 16 bits."""

    weights: float
    compute: int
    residual: int
    autocast: bool

    @classmethod
    def of(cls, precision: str) -> Widths:
        if precision in ("fp32", "tf32"):
            return cls(4, 4, 4, False)
        if precision in ("bf16", "fp16"):
            return cls(4, 2, 4, True)
        if precision == "bf16-pure":
            return cls(2, 2, 2, False)
        raise ValueError(f"no memory model for precision {precision!r}")


@dataclass(frozen=True)
class Parallelism:
    """How one model is spread over GPUs: data (ddp / fsdp), tensor and pipeline degrees."""

    strategy: str = "single"  # single, ddp, fsdp, tp, pipeline
    gpus: int = 1

    @property
    def tensor(self) -> int:
        return self.gpus if self.strategy == "tp" else 1

    @property
    def stages(self) -> int:
        return self.gpus if self.strategy == "pipeline" else 1

    @property
    def shards(self) -> int:
        """How many ways weights, gradients and optimizer state are split across data-parallel ranks."""
        return self.gpus if self.strategy == "fsdp" else 1


@dataclass(frozen=True)
class MemoryEstimate:
    terms: tuple[Term, ...]
    peak_moment: str
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def peak_bytes(self) -> float:
        return sum(term.bytes for term in self.terms if term.at_peak)

    def as_dict(self) -> dict:
        return {
            "peak_bytes": self.peak_bytes,
            "peak_moment": self.peak_moment,
            "terms": [{"name": t.name, "bytes": t.bytes, "formula": t.formula, "at_peak": t.at_peak}
                      for t in self.terms],
            "notes": list(self.notes),
        }


# ---- building blocks --------------------------------------------------------------------------


def layer_matmul_params(arch: Architecture) -> int:
    """The weight matrices of one layer (q, k, v, o and the MLP), without norms and biases."""
    h, k, q = arch.hidden_size, arch.num_kv_heads * arch.head_dim, arch.num_heads * arch.head_dim
    return 2 * h * q + 2 * h * k + 3 * h * arch.ffn_size


def saved_per_layer(arch: Architecture, tokens: int, widths: Widths, tp: int = 1) -> float:
    """Bytes one native layer saves for its backward pass (flash attention, no recompute).

    Tensor by tensor, in forward order (n tokens, widths r, c as in the module docstring):

    - input RMSNorm: the layer input (r n h), kept by x^2; with 16-bit residuals its two fp32
      upcasts (8 n h) instead; its normalized output (4 n h, fp32; c n h once cast back in bf16-pure)
      and 1/rms (4 n);
    - q, k, v projections: their input, cast to 16 bits once per projection under autocast (3 c n h),
      otherwise the norm's output, shared by the three (c n h);
    - rotary q and k (c n h + c n k) and v (c n k), saved by attention, with its output (c n h),
      which the output projection saves as its input, and the log-sum-exp (4 n H);
    - post-attention RMSNorm: as the first, on the new residual (r n h);
    - gate and up projections: their inputs (2 c n h under autocast, one shared c n h otherwise);
    - SwiGLU: gate and up outputs, silu(gate) and the product the down projection saves (4 c n f).
    """
    n, h, f = tokens, arch.hidden_size, arch.ffn_size
    k, heads = arch.num_kv_heads * arch.head_dim, arch.num_heads
    c, r = widths.compute, widths.residual
    norm = (r * n * h + 4 * n * h + 4 * n) if r == 4 else (8 * n * h + c * n * h + 4 * n)
    attention_inputs = 3 * c * n * h if widths.autocast else c * n * h
    attention = (c * n * h + 2 * c * n * k + c * n * h) / tp + 4 * n * heads / tp
    mlp_inputs = 2 * c * n * h if widths.autocast else c * n * h
    mlp = 4 * c * n * f / tp
    return 2 * norm + attention_inputs + attention + mlp_inputs + mlp


def recompute_per_layer(arch: Architecture, tokens: int, widths: Widths) -> float:
    """With full activation checkpointing a layer keeps only its input (r n h)."""
    return widths.residual * tokens * arch.hidden_size


def loss_chain_bytes(arch: Architecture, tokens: int, widths: Widths) -> float:
    """Logits and loss at the start of the backward pass: the compute-dtype logits the loop holds
    (c n V, shared when c is fp32), the fp32 log-softmax output (4 n V), and the gradient flowing
    into and out of it (8 n V). Large vocabularies make this the largest single term."""
    n, V, c = tokens, arch.vocab_size, widths.compute
    held_logits = c * n * V
    return held_logits + 4 * n * V + 8 * n * V


def final_saved_bytes(arch: Architecture, tokens: int, widths: Widths) -> float:
    """The final RMSNorm's saved tensors and the output projection's input (its cast, or the norm's
    own output)."""
    n, h, c, r = tokens, arch.hidden_size, widths.compute, widths.residual
    norm = (r * n * h + 4 * n * h + 4 * n) if r == 4 else (8 * n * h + c * n * h + 4 * n)
    return norm + c * n * h


def kv_cache_bytes(arch: Architecture, batch: int, length: int, widths: Widths, tp: int = 1) -> float:
    """2 x L x kv heads x head dim x c x tokens x batch (REFERENCE.md); preallocated for the whole
    prompt + generation."""
    return arch.kv_cache_bytes_per_token(widths.compute) * batch * length / tp


def prefill_transient_bytes(arch: Architecture, tokens: int, widths: Widths, tp: int = 1) -> float:
    """The most one layer holds at once without autograd: inside the MLP, silu(gate), up and their
    product (3 c n f; gate itself is freed once silu has read it), with the residual stream and its
    updated copy (2 r n h) and the normalized input (c n h)."""
    n, h, f, c, r = tokens, arch.hidden_size, arch.ffn_size, widths.compute, widths.residual
    return 2 * r * n * h + 3 * c * n * f / tp + c * n * h


# ---- the estimate -----------------------------------------------------------------------------


def estimate_memory(arch: Architecture, mode: str, precision: str, batch: int, seq_len: int, *,
                    new_tokens: int = 0, activation_checkpointing: bool = False,
                    parallelism: Parallelism = Parallelism()) -> MemoryEstimate:
    """Peak bytes on one GPU for this configuration, as terms (``at_peak`` marks those that
    coexist at the peak moment)."""
    widths = Widths.of(precision)
    tp, stages, shards = parallelism.tensor, parallelism.stages, parallelism.shards
    P = arch.total_params
    layers = arch.num_layers / stages
    layer_params = arch.params_per_layer * layers
    edge_params = P - arch.params_per_layer * arch.num_layers  # embeddings, output projection, final norm
    local_params = (layer_params / tp + edge_params / (stages if stages > 1 else 1)) if tp > 1 or stages > 1 else P
    weights = widths.weights * local_params / shards
    terms = [Term("weights", weights, f"{widths.weights:g} B x {local_params:,.0f} parameters"
                  + (f" / {shards} FSDP shards" if shards > 1 else ""))]
    if mode in ("train", "forward-backward"):
        return _training(arch, mode, widths, batch, seq_len, activation_checkpointing, terms, weights,
                         local_params / shards, layers, tp)
    return _inference(arch, mode, widths, batch, seq_len, new_tokens, terms, tp)


def autocast_copies(arch: Architecture, widths: Widths, saved_layers: float, tp: int) -> tuple[float, str]:
    """16-bit copies of the weights under autocast. Autograd saves each matmul's copy for the
    backward pass, so a training step holds those of every layer whose activations it keeps, and
    always the output projection's; without autograd each copy lives only for its matmul, and the
    largest (the output projection, or one MLP matrix) bounds them."""
    if not widths.autocast:
        return 0.0, ""
    output = arch.vocab_size * arch.hidden_size
    if saved_layers == 0:
        largest = max(output, arch.hidden_size * arch.ffn_size / tp)
        return widths.compute * largest, f"{widths.compute} B x {largest:,.0f}: the largest matrix, cast for its matmul"
    params = layer_matmul_params(arch) * saved_layers / tp + output
    return widths.compute * params, f"{widths.compute} B x {params:,.0f} matmul parameters saved by autograd"


def _training(arch, mode, widths, batch, seq_len, recompute, terms, weights, local_params, layers, tp):
    n = batch * seq_len
    gradients = widths.weights * local_params
    optimizer = 2 * widths.weights * local_params if mode == "train" else 0.0
    if recompute:
        per_layer = recompute_per_layer(arch, n, widths)
        one_layer = saved_per_layer(arch, n, widths, tp)
        activations = per_layer * layers + one_layer
        formula = f"{layers:g} layers x {per_layer:,.0f} B (inputs) + one layer recomputed ({one_layer:,.0f} B)"
    else:
        per_layer = saved_per_layer(arch, n, widths, tp)
        activations = per_layer * layers
        formula = f"{layers:g} layers x {per_layer:,.0f} B saved per layer"
    casts, casts_formula = autocast_copies(arch, widths, 1 if recompute else layers, tp)
    final = final_saved_bytes(arch, n, widths)
    loss = loss_chain_bytes(arch, n, widths)
    tied = 2 * widths.weights * arch.vocab_size * arch.hidden_size if arch.tie_embeddings else 0.0
    first_layer = saved_per_layer(arch, n, widths, tp)
    first_layer_casts = autocast_copies(arch, widths, 1, tp)[0] - widths.compute * arch.vocab_size * arch.hidden_size \
        if widths.autocast else 0.0
    moments = {
        "start of the backward pass": weights + optimizer + activations + casts + final + loss,
        "backward of the first layer": weights + gradients + optimizer + first_layer + first_layer_casts,
        "end of the backward pass": weights + gradients + optimizer + tied,
    }
    moment = max(moments, key=moments.get)
    at_start, at_first, at_end = (moment == name for name in moments)
    terms = [*terms,
             Term("gradients", gradients, f"{widths.weights:g} B x {local_params:,.0f} parameters",
                  at_peak=not at_start),
             Term("optimizer state", optimizer, "AdamW first and second moments, 2 x weight bytes")]
    if casts:
        terms.append(Term("autocast weight copies", casts, casts_formula, at_peak=at_start))
    terms += [
        Term("activations", activations, formula, at_peak=at_start),
        Term("final norm and output input", final, "saved by the final RMSNorm and the output projection",
             at_peak=at_start),
        Term("logits and loss", loss, f"{widths.compute} n V + 12 n V, n = {n:,}, V = {arch.vocab_size:,}",
             at_peak=at_start),
        Term("first layer in backward", first_layer + first_layer_casts,
             "one layer's saved activations (and weight copies) while the last gradients form", at_peak=at_first),
    ]
    if tied:
        terms.append(Term("tied embedding gradients", tied, "the input embedding's gradient and its sum with "
                          "the output projection's, 2 x V h x weight bytes", at_peak=at_end))
    return MemoryEstimate(tuple(terms), moment)


def _inference(arch, mode, widths, batch, seq_len, new_tokens, terms, tp):
    n = batch * seq_len
    casts, casts_formula = autocast_copies(arch, widths, 0, tp)
    if casts:
        terms.append(Term("autocast weight copy", casts, casts_formula))
    if mode == "infer":
        cache = kv_cache_bytes(arch, batch, seq_len + new_tokens, widths, tp)
        transient = prefill_transient_bytes(arch, n, widths, tp)
        logits = 4 * batch * arch.vocab_size
        terms += [
            Term("KV cache", cache, f"2 x {arch.num_layers} layers x {arch.num_kv_heads * arch.head_dim} x "
                                    f"{widths.compute} B x {batch} x {seq_len + new_tokens} tokens"),
            Term("prefill temporaries", transient, "residual stream and one MLP's intermediates"),
            Term("last-position logits", logits, "4 B x B x V"),
        ]
        return MemoryEstimate(tuple(terms), "prefill of the prompt, KV cache allocated")
    logits = widths.compute * n * arch.vocab_size
    final = final_saved_bytes(arch, n, widths)
    terms += [
        Term("logits", logits, f"{widths.compute} B x n V, n = {n:,}"),
        Term("final norm temporaries", final, "the last residual, its norm and cast"),
    ]
    return MemoryEstimate(tuple(terms), "output projection")
