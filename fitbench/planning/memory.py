"""Per-GPU peak memory of one configuration, term by term, before any GPU is touched: ``estimate_memory``
picks the mode's terms (``fitbench.planning.training_memory``, ``fitbench.planning.inference_memory``) over
the weights the precision and the layout leave on one GPU, and under pipeline stages estimates each stage
(``stage_estimates``). The term families live beside it: ``terms`` (the records and the moments a peak
falls at), ``sharding`` (what each rank holds), ``weights``, ``activations``, ``kv_cache``,
``parallel_terms`` (what pipeline and data parallelism hold in flight) and ``memory_constants`` (the
measured constants, each with its source). docs/planning.md ("The memory model") says what each term
follows; ``fitbench.worker.trace`` runs fitbench's loops on fake tensors, the reference the tests hold
this model to.
"""

from __future__ import annotations

from dataclasses import replace

from fitbench.models.architecture import Architecture, default_backend
from fitbench.planning.inference_memory import inference_estimate, offloaded_estimate
from fitbench.planning.sharding import (Parallelism, pipeline_stage_list, rank_edge_params, rank_layer_params,
                                        tp_layer_matrices)
from fitbench.planning.terms import BUILD, MemoryEstimate, START, Term, Widths, with_stage
from fitbench.planning.training_memory import adapter_training_estimate, training_estimate
from fitbench.planning.weights import largest_layer_matrix, rotary_term
from fitbench.precisions import ADAPTERS, FLOAT8, TRAINING_MODES, UNQUANTIZED_BASE, entry
from fitbench.spec import checkpointed_count


# ---- the estimate -----------------------------------------------------------------------------


def estimate_memory(arch: Architecture, mode: str, precision: str, batch: int, seq_len: int, *,
                    new_tokens: int = 0, activation_checkpointing: bool = False,
                    checkpointed_layers: int | None = None,
                    parallelism: Parallelism = Parallelism(), resident_layers: int | None = None,
                    backend: str | None = None, compiled: bool = False, stage: int | None = None) -> MemoryEstimate:
    """Peak bytes on one GPU for this configuration, as terms (``at_peak`` marks those that
    coexist at the peak moment). ``resident_layers`` (infer and forward, floating-point weights,
    one GPU) keeps that many decoder layers on the GPU and offloads the rest (``offloaded_weights``).
    ``backend`` (native or hf; by default the family's, ``fitbench.models.backends.default_backend``)
    is the model the run builds. ``checkpointed_layers``: with ``activation_checkpointing``, the first N
    decoder layers of each stage recompute, the others keep their activations (every layer when None;
    ``fitbench.spec.checkpointed_count``; ``training_estimate`` gives the terms). ``compiled``: the native model
    under ``torch.compile`` (``fitbench.planning.compiled``); quantized weights (adapters, inference) keep
    the eager model's terms, an upper bound: their kernels break the graph.

    Under pipeline parallelism the stages differ (uneven layer counts; the embedding on the first,
    the final norm, output projection and logits on the last): ``stage`` (an index) estimates that
    stage's GPUs; by default the estimate is that of the stage with the largest peak, which its
    ``stage`` names (``stage_estimates`` gives them all). A training step's pipeline runs
    ``parallelism.microbatches_of(batch)`` microbatches of ``ceil(batch / m)`` sequences under GPipe,
    every stage running all m forwards before the first backward."""
    backend = backend or default_backend(arch)
    if resident_layers is not None:
        return offloaded_estimate(arch, mode, precision, batch, seq_len, new_tokens, resident_layers, parallelism, backend)
    if parallelism.stages > 1 and stage is None:
        return max(stage_estimates(arch, mode, precision, batch, seq_len, new_tokens=new_tokens,
                                   activation_checkpointing=activation_checkpointing,
                                   checkpointed_layers=checkpointed_layers, parallelism=parallelism,
                                   backend=backend, compiled=compiled), key=lambda estimate: estimate.peak_bytes)
    where = pipeline_stage_list(arch, parallelism.stages)[stage or 0]
    # Only the native decoder's compiled graph has been read; the hf backend keeps the eager terms.
    compiled = compiled and backend == "native"
    widths = Widths.of(precision)
    tp, shards = parallelism.tensor, parallelism.shards
    layers = len(where.layers)
    local_params = layers * rank_layer_params(arch, tp) + rank_edge_params(arch, tp, where)
    training = mode in TRAINING_MODES
    # the stage's layers that recompute: the first ``checkpointed`` (0 without checkpointing)
    checkpointed = checkpointed_count(layers, checkpointed_layers) if activation_checkpointing and training else 0
    facts = entry(precision)
    if training and facts.training == FLOAT8:
        return float8_training_estimate(arch, mode, batch, seq_len, activation_checkpointing, checkpointed_layers,
                                parallelism, backend, compiled, where)
    in_flight = 1
    if training and parallelism.stages > 1:
        microbatches = parallelism.microbatches_of(batch)
        in_flight, batch = microbatches, -(-batch // microbatches)
    if training and facts.quantized and facts.training != ADAPTERS:
        raise ValueError(f"{precision} weights have no backward pass: no training memory model")
    if facts.quantized:
        fmt = facts.storage
        shares = tp_layer_matrices(arch, tp)
        quantized = sum(fmt.matrix_bytes(rows, columns) for rows, columns, _ in shares) * layers
        plain = widths.weights * (local_params - sum(rows * columns for rows, columns, _ in shares) * layers)
        weights = quantized + plain
        terms = [Term("weights", weights, f"{fmt.source}: {quantized:,.0f} B in the layers' "
                                          f"matrices, {plain:,.0f} B in bf16 elsewhere"), rotary_term(arch, backend)]
        per_element = facts.build_temporary_bytes
        # both backends make and quantize one layer at a time, random or read from a checkpoint as each layer
        # is made (fitbench.worker.quantize, and its hf_layers for transformers' model, as from_pretrained
        # loads a quantized model): never the bf16 model whole
        terms.append(Term("quantizer temporaries",
                          (2 * arch.params_per_layer + per_element * largest_layer_matrix(arch)) / tp,
                          f"one layer in bf16 while it is quantized, and {per_element:g} B x its largest matrix "
                          f"(measured)", frozenset({BUILD})))
        if training:
            return adapter_training_estimate(arch, mode, precision, widths, batch, seq_len, checkpointed, terms,
                                     layers, tp, backend, where, in_flight)
        return with_stage(inference_estimate(arch, mode, widths, batch, seq_len, new_tokens, terms, tp, where,
                                      precision=precision, backend=backend), where)
    weights = widths.weights * local_params / shards
    terms = [Term("weights", 0.0 if parallelism.offload else weights,
                  f"{widths.weights:g} B x {local_params:,.0f} parameters"
                  + (f" / {shards} FSDP shards" if shards > 1 else "")
                  + (f", {weights:,.0f} B in host memory (CPU offload)" if parallelism.offload else "")),
             rotary_term(arch, backend)]
    if training:
        widths = Widths.of(precision, parallelism)
        return with_stage(training_estimate(arch, mode, widths, batch, seq_len, checkpointed, terms,
                                     local_params / shards, layers, tp, backend=backend, compiled=compiled,
                                     layout=parallelism, stage=where, in_flight=in_flight), where)
    return with_stage(inference_estimate(arch, mode, widths, batch, seq_len, new_tokens, terms, tp, where,
                                  precision=precision, backend=backend, compiled=compiled), where)


def stage_estimates(arch: Architecture, mode: str, precision: str, batch: int, seq_len: int, *,
                    parallelism: Parallelism, **options) -> tuple[MemoryEstimate, ...]:
    """``estimate_memory`` of every pipeline stage, in order (one estimate without pipeline
    parallelism); stages of the same shape (layer count, edges, microbatches in flight) are estimated
    once."""
    estimates: dict[tuple, MemoryEstimate] = {}
    result = []
    microbatches = parallelism.microbatches_of(batch)
    for stage in pipeline_stage_list(arch, parallelism.stages):
        shape = (len(stage.layers), stage.first, stage.last)
        if shape not in estimates:
            estimates[shape] = estimate_memory(arch, mode, precision, batch, seq_len, parallelism=parallelism,
                                               stage=stage.index, **options)
        result.append(replace(estimates[shape], stage=stage) if parallelism.stages > 1 else estimates[shape])
    return tuple(result)


def float8_training_estimate(arch, mode, batch, seq_len, recompute, checkpointed_layers, parallelism, backend,
                     compiled=False, stage=None):
    """fp8 training (torchao float8, row-wise): bf16 weights, gradients and AdamW state as in the
    unquantized base (``UNQUANTIZED_BASE``, bf16-pure), and each converted matmul saves its bf16 input and weight, as a bf16 matmul does;
    the float8 copies live only inside a matmul. The largest bound them: the MLP matrix's weight
    cast twice (along rows for the forward, along columns for the backward) and the n x f
    operands of the down projection's backward (its input and incoming gradient) in float8."""
    estimate = estimate_memory(arch, mode, UNQUANTIZED_BASE, batch, seq_len, activation_checkpointing=recompute,
                               checkpointed_layers=checkpointed_layers,
                               parallelism=parallelism, backend=backend, compiled=compiled,
                               stage=stage.index if stage else None)
    if parallelism.stages > 1:  # one microbatch in a matmul at a time
        batch = -(-batch // parallelism.microbatches_of(batch))
    n, h, f, tp = batch * seq_len, arch.hidden_size, arch.ffn_size, parallelism.tensor
    casts = (2 * h * f + 2 * n * f) / tp
    moments = frozenset(m for m in estimate.moments if m != START)
    terms = estimate.terms + (Term("float8 casts", casts, "2 h f + 2 n f: one MLP matrix cast twice and the "
                                   "down projection's backward operands, 1 B each", moments),)
    return MemoryEstimate(terms, estimate.moments, estimate.stage)
