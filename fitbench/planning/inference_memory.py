"""Inference's and a forward pass's peak, term by term, and with offloaded layers
(docs/planning.md, "The memory model").
"""

from __future__ import annotations

from fitbench.planning import compiled as inductor
from fitbench.planning.activations import (activation_quantization_term, int8_outlier_terms, prefill_reserve_term,
                                           prefill_transient_bytes)
from fitbench.planning.kv_cache import hf_cache, kv_cache_bytes
from fitbench.planning.memory_constants import INT8_PRODUCT_BYTES
from fitbench.planning.sharding import kv_heads_split, rank_edge_params, rank_layer_params
from fitbench.planning.terms import BUILD, MLP, MemoryEstimate, OUTLIERS, OUTPUT, SHARDS, Term, Widths
from fitbench.planning.weights import largest_layer_matrix, rotary_term
from fitbench.precisions import TRAINING_MODES, entry
from fitbench.spec import Stage


def offloaded_estimate(arch, mode, precision, batch, seq_len, new_tokens, resident, parallelism, backend) -> MemoryEstimate:
    """Inference with ``k = resident`` of the L decoder layers on the GPU:

    - weights: w x (P - (L - k) x parameters per layer): the edges and k layers;
    - the offloaded layer in flight, w x parameters per layer, while L - k > 0: accelerate's hook
      copies a whole offloaded layer onto the GPU before its forward and drops it after,
      synchronously and without prefetch, so one layer is in flight at a time. It is counted at
      every moment because accelerate's device map keeps that room free for the whole run, which
      makes the split predicted here the one it makes; at the output projection the room is in fact
      empty, so there the prediction is one layer high;
    - the KV cache of all L layers and the temporaries, as without offload.
    """
    if mode in TRAINING_MODES or entry(precision).quantized or parallelism.gpus > 1:
        raise ValueError(f"offload models inference with floating-point weights on one GPU, not {mode} "
                         f"{precision} over {parallelism.gpus} GPU(s)")
    if not 0 <= resident <= arch.num_layers:
        raise ValueError(f"resident_layers must be 0 to {arch.num_layers}, got {resident}")
    widths = Widths.of(precision)
    w, L, per_layer = widths.weights, arch.num_layers, arch.params_per_layer
    on_gpu = arch.total_params - (L - resident) * per_layer
    terms = [Term("weights", w * on_gpu, f"{w:g} B x {on_gpu:,} parameters: the embeddings, final norm, output "
                  f"projection and {resident} of {L} layers"), rotary_term(arch, backend)]
    if resident < L:
        terms.append(Term("offloaded layer in flight", w * per_layer, f"{w:g} B x {per_layer:,} parameters: one "
                          f"offloaded layer, copied in for its forward"))
    return inference_estimate(arch, mode, widths, batch, seq_len, new_tokens, terms, 1, precision=precision, backend=backend)


def inference_estimate(arch, mode, widths, batch, seq_len, new_tokens, terms, tp, stage=None, *, precision,
               backend="native", compiled=False):
    """Without autograd, a layer's temporaries die with it. Two moments can peak: the widest MLP,
    where silu(gate), up and their product (3 c n f) live beside the layer's input, the residual
    after attention and its normalized copy (3 r n h) and the token ids (8 n); and the output projection, with the final normalized input (r n h), its 16-bit
    cast under autocast, the projection's own cast weight (V h c) and the logits. ``compiled``: inductor's
    fused MLP and final norm (``fitbench.planning.compiled``).

    Quantized weights (``precision``) add the moment of the build (``quantizer temporaries``), when no
    step has run and no KV cache exists yet; so does tensor parallelism of other weights, whose
    ranks draw each whole weight into one scratch buffer and keep their shards
    (``fitbench.worker.tensor_parallel``): the shards and the largest whole weight; a weight some formats
    dequantize for a prefill matmul (the entry's ``dequantized``: 4-bit weights to bf16, 2 B x the largest
    matrix, at the MLP; float8 weight-only ones for every matmul, through fp32); LLM.int8 adds the moment
    of its outlier columns (``int8_outlier_terms``).

    A pipeline ``stage`` holds the KV cache of its own layers, and only the last stage the output
    projection's moment. Tensor parallelism (degree ``tp``) splits the layers' intermediates, the
    kv heads where they divide by it (``kv_heads_split``; else each rank caches all of them) and the
    output projection over the vocabulary; the logits are gathered whole on each rank, beside the
    rank's own slice of them, and for more than one row copied from the gather's rank-major buffer
    into vocabulary order (``fitbench.worker.tensor_parallel``), so the output moment holds
    c rows V (2 + 1 / tp) (c V (1 + 1 / tp) for one row)."""
    n, V, h = batch * seq_len, arch.vocab_size, arch.hidden_size
    c, r = widths.compute, widths.residual
    stage = stage or Stage(0, 1, range(arch.num_layers))
    layers = len(stage.layers)
    rows = batch if mode == "infer" else n  # infer computes logits for the last position only
    facts = entry(precision)
    moments = (MLP,) + ((OUTPUT,) if stage.last else ()) + ((OUTLIERS,) if facts.outlier_columns else ())
    sharded_build = tp > 1 and not facts.quantized
    if sharded_build and backend == "hf":
        # transformers' tensor-parallel plan shards a model built whole on each rank, a weight at a time
        whole = widths.weights * arch.total_params
        rank = widths.weights * (layers * rank_layer_params(arch, tp) + rank_edge_params(arch, tp, stage))
        terms.append(Term("whole model before sharding", whole - rank, f"{widths.weights:g} B x "
                          f"{arch.total_params:,} less this rank's shards: the hf backend builds the whole model on "
                          f"each rank and transformers' plan shards it in place", frozenset({SHARDS})))
    elif sharded_build:
        # every weight of the whole model is drawn whole into one scratch buffer, of which the rank keeps its shard
        largest = max(V * h, largest_layer_matrix(arch))
        terms.append(Term("whole-weight scratch", widths.weights * largest,
                          f"{widths.weights:g} B x {largest:,}: the largest weight drawn whole while the rank "
                          f"keeps its shard of it", frozenset({SHARDS})))
    if mode == "infer":
        kv_tp = kv_heads_split(arch, tp)
        cache = kv_cache_bytes(arch, batch, seq_len + new_tokens, widths, kv_tp, backend) * layers / arch.num_layers
        per_token = cache / layers / batch / (seq_len + new_tokens) / 2
        kept = f": {hf_cache(arch, widths).formula}" if backend == "hf" else ""
        terms.append(Term("KV cache", cache, f"2 x {layers} layers x {per_token:g} B x {batch} x "
                          f"{seq_len + new_tokens} tokens{kept}",
                          frozenset(moments) if facts.quantized or sharded_build else None))
    elif backend == "hf":
        # transformers' models grow a DynamicCache in a forward pass too (``use_cache`` is on by default)
        cache = kv_cache_bytes(arch, batch, seq_len, widths, kv_heads_split(arch, tp), backend) * layers / arch.num_layers
        layout = hf_cache(arch, widths)
        terms.append(Term("KV cache", cache, f"{layers} layers of the forward pass's {batch} x {seq_len} tokens, "
                          f"which transformers caches unasked: keys {layout.key_bytes} B and values "
                          f"{layout.value_bytes} B ({layout.source}, read by running it)",
                          frozenset(moments) if facts.quantized or sharded_build else None))
    if facts.outlier_columns:
        terms += int8_outlier_terms(arch, n, widths, tp)
    if facts.dequantized is not None:
        copy = facts.dequantized
        terms.append(Term("dequantized weight", copy.bytes * largest_layer_matrix(arch) / tp,
                          f"{copy.bytes:g} B x the largest matrix: {copy.why}", frozenset({MLP})))
    if facts.activation_scaling and n > 1:
        terms.append(activation_quantization_term(arch, n, c, tp))
    if facts.outlier_columns and n > 1:
        terms.append(Term("LLM.int8 product", INT8_PRODUCT_BYTES * n * arch.ffn_size / tp,
                          f"{INT8_PRODUCT_BYTES} B x {n:,} tokens x {arch.ffn_size:,}: the up projection's int32 "
                          f"product and one more 16-bit copy beside the MLP's temporaries (traced)", frozenset({MLP})))
    reserve = prefill_reserve_term(arch, precision, n, tp)
    if reserve is not None:
        terms.append(reserve)
    # Under tensor parallelism the gather's buffer is rank-major, (tp, rows, V / tp): putting the
    # vocabulary back in order copies it, a second whole logits tensor, wherever rows > 1.
    reordered = tp > 1 and rows > 1
    logits = c * rows * V * ((2 if reordered else 1) + 1 / tp if tp > 1 else 1)
    gathered = (f" ({tp} slices gathered whole beside this rank's" + (", and their copy in vocabulary order)"
                                                                     if reordered else ")")) if tp > 1 else ""
    if compiled:
        terms.append(Term("MLP temporaries", inductor.prefill_transient_bytes(arch, n, c, r, widths.autocast, tp),
                          "r n h + c n h + 2 c n f (+ c h f under autocast) + 8 n: one fused MLP's "
                          "intermediates beside the residual stream", frozenset({MLP})))
        head = inductor.output_input_bytes(arch, n, c) + logits
        formula = f"final normalized input, cast in the norm's kernel, and {c} B x {rows:,} x V logits{gathered}"
    else:
        terms.append(Term("MLP temporaries", prefill_transient_bytes(arch, n, widths, tp, backend, seq_len),
                          "one MLP's intermediates beside the residual stream, and the token ids",
                          frozenset({MLP})))
        head = r * n * h + (c * n * h if widths.autocast else 0) + logits
        formula = f"final normalized input, its cast, and {c} B x {rows:,} x V logits{gathered}"
    if widths.autocast:
        head += c * V * h / tp
        formula += ", and the output projection's 16-bit copy"
    if stage.last:
        terms.append(Term("output projection", head, formula, frozenset({OUTPUT})))
    return MemoryEstimate(tuple(terms), moments + ((BUILD,) if facts.quantized else ())
                          + ((SHARDS,) if sharded_build else ()))
