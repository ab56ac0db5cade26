"""A training step's peak, term by term: full training, float8 training and adapters on a quantized
base (docs/planning.md, "The memory model").
"""

from __future__ import annotations

from fitbench.models.loss import loss_chain_bytes, loss_chunk_rows
from fitbench.planning import compiled as inductor
from fitbench.planning.activations import (backward_transient_bytes, final_saved_bytes, first_layer_unformed,
                                           mlp_backward_bytes, output_backward_bytes, recompute_per_layer,
                                           saved_per_layer)
from fitbench.planning.memory_constants import INT8_OUTLIER_COLUMNS
from fitbench.planning.parallel_terms import fsdp_in_flight, fsdp_offload_staging, gpipe_terms
from fitbench.planning.sharding import Parallelism, rank_layer_params
from fitbench.planning.terms import BUILD, END, FIRST, LATER, MemoryEstimate, RECOMPUTE, START, Term, with_stage
from fitbench.planning.weights import (adapter_params, autocast_copies, largest_layer_matrix, layer_matmul_params,
                                       layer_matrices)
from fitbench.precisions import ADAPTER_RANK, entry
from fitbench.spec import Stage


def adapter_training_estimate(arch, mode, precision, widths, batch, seq_len, checkpointed, terms, layers, tp, backend,
                      stage, in_flight=1):
    """Adapters on a frozen quantized base (``fitbench.worker.adapters``): the base weights are in
    ``terms``; the adapters' fp32 weights, gradients and AdamW state are 16 B per adapter parameter.
    Gradients flow through every frozen matmul, so activations are saved as in bf16-pure training
    (transformers' norms less their normalized outputs, kept only for their frozen weights'
    gradients; the native norms save the same either way), plus each
    adapter's r-wide intermediate (c n r per matmul) and, for LLM.int8, its outlier columns; the
    frozen matmul's backward dequantizes its weight to bf16 for the gradient of its input (2 x the
    largest matrix)."""
    n = batch * seq_len
    A = adapter_params(arch) * layers / arch.num_layers / tp
    terms = [*terms, Term("adapters", 4 * A, f"4 B x {A:,.0f} fp32 adapter parameters (rank {ADAPTER_RANK})")]
    estimate = training_estimate(arch, mode, widths, batch, seq_len, checkpointed, terms, 0.0, layers, tp, trainable=A,
                         backend=backend, stage=stage, in_flight=in_flight)
    saving_layers = (layers - checkpointed) * in_flight  # the layers that keep their activations
    extra_saved = widths.compute * n * ADAPTER_RANK * len(layer_matrices(arch)) * saving_layers
    matmuls = len(arch.layer_matrices)
    added = [Term("adapter activations", extra_saved, f"{widths.compute} B x n x r per matmul, {matmuls} per layer",
                  frozenset({START}))]
    if entry(precision).outlier_columns:
        inputs = sum(columns for _, columns in layer_matrices(arch)) * INT8_OUTLIER_COLUMNS
        added.append(Term("LLM.int8 outlier columns", 2 * n * inputs * saving_layers / tp,
                          f"2 B x n x {INT8_OUTLIER_COLUMNS:g} of each matmul's input columns, {matmuls} per layer "
                          f"(measured fraction)", frozenset({START})))
    largest = largest_layer_matrix(arch)
    added.append(Term("dequantized weight in backward", 2 * largest / tp, "2 B x the largest matrix: the frozen "
                      "matmul's weight in bf16 for its input's gradient",
                      frozenset({FIRST, RECOMPUTE} if checkpointed else {FIRST})))
    return with_stage(MemoryEstimate(estimate.terms + tuple(added), estimate.moments + (BUILD,)), stage)


def training_estimate(arch, mode, widths, batch, seq_len, checkpointed, terms, local_params, layers, tp,
              trainable: float | None = None, backend: str = "native", compiled: bool = False,
              layout: Parallelism = Parallelism(), stage: Stage | None = None, in_flight: int = 1):
    """A training step's terms. ``trainable``: adapter parameters (fp32) when the weights are a frozen
    base; then gradients and optimizer state are the adapters', and no weight gradient forms.

    ``checkpointed``: the first C of the stage's ``layers`` recompute their activations (activation
    checkpointing), the other K = layers - C keep them (C = 0: none; C = layers: every layer). With
    ``one`` a kept layer's saved bytes (``saved_per_layer``) and ``r n h`` a checkpointed layer's
    input (``recompute_per_layer``), per microbatch:

    - start of the backward pass: K one + C r n h (every layer's, as Megatron-LM's block-wise
      recomputation and Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
      Transformer Models", count them);
    - the recompute of the last checkpointed layer (layer C - 1): the backward pass reaches it after
      the K kept layers, whose activations are freed by then and whose gradients are formed (w K p on
      one GPU; DDP's buckets and FSDP's reduce-scatter pool hold them at every moment, and FSDP also
      holds the last kept layer's reduce-scatter input, rd p); so C r n h, one layer recomputed, the
      gradient flowing in, and those gradients. Recomputing the first C rather than the last keeps the
      recomputed layer from standing beside the kept activations.
    ``compiled``: layers, the final norm and the embedding's gradient as ``fitbench.planning.compiled`` has them.
    ``layout``: DDP's buckets and FSDP's units in flight (the module docstring); adapters on a frozen
    base keep one GPU's terms, their few gradients in a bucket or a shard changing little.

    ``stage``: a pipeline stage, ``batch`` one microbatch of it and ``in_flight`` the microbatches
    whose activations it holds at once (GPipe: all of them): the embedding's terms are the first
    stage's, the final norm's, the output projection's and the loss's the last's (one microbatch's
    logits at a time: the loss is formed in each microbatch's forward, its chain freed once reduced
    to the loss). Under tensor parallelism the output projection and the embedding are split over the
    vocabulary and the logits gathered whole on each rank, so the loss chain is one GPU's."""
    n, V, h = batch * seq_len, arch.vocab_size, arch.hidden_size
    c, r, w = widths.compute, widths.residual, widths.weights
    stage = stage or Stage(0, 1, range(arch.num_layers))
    has_embedding, has_head = stage.first, stage.last
    frozen = trainable is not None  # adapters on a frozen base: embeddings and norms are frozen too
    sharded = layout.shards > 1 and not frozen
    ddp = layout.layout.dp_replicate > 1 and layout.shards == 1 and not frozen
    # The output projection's share on this rank, where this stage holds it.
    output = V * h / tp if has_head else 0.0
    recompute = checkpointed > 0
    kept = layers - checkpointed
    every = recompute and kept == 0  # every layer of the stage recomputes
    moments = (START, RECOMPUTE, FIRST, END) if recompute else (START, FIRST, END)
    later = (LATER,) if in_flight > 1 else ()  # GPipe's second microbatch: the first one's gradients exist
    moments += later
    rows = min(loss_chunk_rows(V), n)
    head_backward = (output_backward_bytes(n, h, V, widths, 0.0 if frozen else output) - loss_chain_bytes(n, V, c)
                     if has_head else 0.0)

    def at(*names: str) -> frozenset[str]:
        return frozenset(names)

    one_layer = (inductor.saved_per_layer(arch, n, c, r, tp) if compiled
                 else saved_per_layer(arch, n, widths, tp, frozen_norms=frozen, backend=backend, context=seq_len))
    one_layer_casts = c * layer_matmul_params(arch) / tp if widths.autocast and not sharded else 0.0
    # a layer's backward pass at its widest, beyond what the layer saved (native eager only)
    widest = 0.0 if compiled else backward_transient_bytes(arch, n, widths, tp, backend)
    # An untied input embedding gets its gradient from the very last backward operator, after the
    # first layer's activations are gone; a tied one is counted with the tied gradients where one
    # stage holds both ends of the model.
    tied_here = arch.tie_embeddings and has_embedding and has_head
    embedding_grad = 0.0 if tied_here or sharded or frozen or not has_embedding else V * h / tp
    saved = layers * in_flight
    held = f"{layers:g} layers x {in_flight} microbatches in flight" if in_flight > 1 else f"{layers:g} layers"
    inputs = recompute_per_layer(arch, n, widths)
    # one microbatch's activations at the start of the backward pass
    per_microbatch = inputs * checkpointed + one_layer * kept
    at_recompute: list[Term] = []
    if every:
        activations = Term("activations", inputs * saved, f"{held} x {inputs:,.0f} B: each layer's "
                           f"input, kept for recomputation", at(START, RECOMPUTE))
    elif recompute:
        microbatches = f"{in_flight} microbatches x " if in_flight > 1 else ""
        activations = Term("activations", per_microbatch * in_flight, f"{microbatches}({kept} layers x "
                           f"{one_layer:,.0f} B saved per layer + {checkpointed} checkpointed layers x {inputs:,.0f} "
                           f"B: each one's input, kept for recomputation)", at(START))
        # this microbatch's kept layers are through their backward; the others' wait (GPipe)
        at_recompute.append(Term(
            "activations at the recompute", inputs * checkpointed * in_flight + one_layer * kept * (in_flight - 1),
            f"the {checkpointed} checkpointed layers' inputs"
            + (f" of {in_flight} microbatches, the {kept} kept layers' activations of the other {in_flight - 1}"
               if in_flight > 1 else ", the kept layers' activations freed by their backward"), at(RECOMPUTE)))
    else:
        # compiled, the first layer saves a 16-bit tensor in place of an fp32 one (on the first stage)
        first = inductor.first_layer_saving(arch, n, c, r) if compiled and layers == arch.num_layers else 0.0
        activations = Term("activations", one_layer * saved - first, f"{held} x {one_layer:,.0f} B saved "
                           f"per layer" + (f", less {first:,.0f} B in the first" if first else ""), at(START))
    if in_flight > 1:  # GPipe: the first microbatch's backward forms every gradient beside the others' activations
        terms.append(Term("other microbatches' activations", per_microbatch * (in_flight - 1),
                          f"{in_flight - 1} microbatches x {per_microbatch:,.0f} B: GPipe runs every forward before "
                          f"the first backward, so the others' activations wait while its gradients form (and, "
                          f"at the second's backward, its own and the later ones')", at(FIRST, *later)))
        terms += gpipe_terms(arch, n, widths, tp, stage, in_flight, one_layer if recompute else 0.0, frozen)
    if layout.offload and not frozen:
        state = Term("optimizer state", 0.0, f"AdamW's moments of the shards, {2 * w * local_params:,.0f} B in host "
                     f"memory (CPU offload), where the optimizer steps")
        gradients = Term("gradients", 0.0, f"the shards' gradients, {w * local_params:,.0f} B in host memory (CPU "
                         f"offload), copied there after each reduce-scatter")
    elif ddp:
        state = Term("optimizer state", 2 * w * local_params if mode == "train" else 0.0,
                     "AdamW first and second moments, 2 x weight bytes")
        gradients = Term("gradient buckets", w * local_params, f"{w:g} B x {local_params:,.0f} parameters: DDP's "
                         f"buckets, the gradients' storage (gradient_as_bucket_view), from construction on")
    elif not frozen:
        state = Term("optimizer state", 2 * w * local_params if mode == "train" else 0.0,
                     "AdamW first and second moments, 2 x weight bytes")
        gradients = Term("gradients", w * (local_params - embedding_grad), f"{w:g} B x {local_params:,.0f} parameters"
                         + (", less the input embedding's" if embedding_grad else ""), at(FIRST, END, *later))
    else:
        state = Term("optimizer state", 8 * trainable if mode == "train" else 0.0,
                     "AdamW first and second moments of the adapters, 2 x 4 B")
        gradients = Term("gradients", 4 * trainable, f"4 B x {trainable:,.0f} adapter parameters",
                         at(FIRST, END, *later))
    terms = [*terms, state, gradients, activations, *at_recompute]
    if widths.autocast and not sharded:
        # Recomputed layers save no copy, but eager autocast caches each weight's copy until its region
        # closes, after the loss: at the loss every copy is alive either way. A compiled graph casts
        # inside itself, past the cache.
        if every and compiled:
            casts, formula = c * output, f"{c} B x V h / {tp}: the output projection's copy, saved by autograd"
        elif recompute and compiled:
            casts, formula = autocast_copies(arch, widths, kept, tp, output)
            formula += f": the {kept} kept layers' and the output projection's"
        else:
            casts, formula = autocast_copies(arch, widths, layers, tp, output)
            if recompute:
                formula += ", held by autocast's cache until the loss is formed"
        terms.append(Term("autocast weight copies", casts, formula, at(START)))
    if has_head:
        terms += [
            Term("final norm and output input", inductor.final_saved_bytes(arch, n, c, r, every) if compiled
                 else final_saved_bytes(arch, n, widths, frozen_norm=frozen, backend=backend),
                 "saved by the final norm and the output projection", at(START)),
            Term("loss chain", loss_chain_bytes(n, V, c), f"the {c} B logits, overwritten by their gradient, and one "
                 f"chunk's fp32 exponentials: {c} n V + 4 r V, n = {n:,}, r = {rows:,}, V = {V:,}", at(START)),
        ]
        if head_backward > 0:
            terms.append(Term("output projection backward", head_backward, "where the output projection's backward "
                              "holds more than the loss (output_backward_bytes less the loss chain): its gradients "
                              "beside the logits'", at(START)))
    if recompute:
        output_grad = 0.0 if frozen or sharded else w * output  # FSDP: one of the root's gradients
        # the kept layers' gradients, formed before the recompute (DDP's buckets and FSDP's pool hold them already)
        kept_grads = 0.0 if frozen or sharded or ddp else w * kept * rank_layer_params(arch, tp)
        terms.append(Term("recomputed last layer", one_layer + one_layer_casts + widest + output_grad + kept_grads
                          + r * n * h,
                          "one layer's activations (and weight copies) recomputed, with the output projection's "
                          "gradient" + (f", the {kept} kept layers' gradients" if kept_grads else "")
                          + " and the gradient flowing into the layer"
                          + (", and its SwiGLU's gradients" if widest else ""), at(RECOMPUTE)))
        if sharded and kept:
            p = rank_layer_params(arch, tp)
            terms.append(Term("FSDP reduce-scatter input", w * p, f"rd p = {w:g} B x {p:,}: the last kept layer's "
                              f"reduce-scatter input, held until the recomputed layer's is issued", at(RECOMPUTE)))
    if compiled:  # the layer as inductor's partition saves it; its backward's own tensors are not modelled
        terms.append(Term("first layer in backward", one_layer + one_layer_casts,
                          "one layer's saved activations (and weight copies) while the last gradients form", at(FIRST)))
        if checkpointed >= 2 and not layout.shards > 1 and not frozen:
            # one graph for every layer (FSDP compiles each layer alone): the next layer's recompute runs early
            p = rank_layer_params(arch, tp)
            ahead = inductor.recompute_ahead_bytes(arch, n, c, r, w * p, tp)
            terms.append(Term("next layer recomputed ahead", ahead, f"saved per layer - w p = {one_layer:,.0f} - "
                              f"{w:g} x {p:,} B: inductor's schedule recomputes the next "
                              f"checkpointed layer before this one's gradients are formed", at(FIRST)))
    else:
        # The first layer's gradients its MLP's backward has not formed yet are counted with the others
        # (FSDP's unsharded ones in the compute width), though they take nothing yet; DDP's buckets do
        # hold them already, and frozen weights form none.
        unformed = 0.0 if frozen or ddp else (c if sharded else w) * first_layer_unformed(arch, tp)
        temporaries = mlp_backward_bytes(arch, n, widths, tp)
        terms.append(Term("first layer in backward", max(0.0, one_layer + one_layer_casts + temporaries - unformed),
                          f"one layer's saved activations (and weight copies) at its MLP's backward, with the "
                          f"gradients there ({temporaries:,.0f} B), less its gradients not yet formed "
                          f"({unformed:,.0f} B)", at(FIRST)))
    if sharded:
        terms += fsdp_in_flight(arch, c, w, layout.shards, tp)
    if sharded and not layout.offload:
        terms.append(Term("reduce-scatter pool", gradients.bytes, "the sharded gradients' pages: views of the "
                          "reduce-scatter outputs, allocated on FSDP's reduce-scatter stream, whose pool keeps them "
                          "mapped while the gradients are None", at(START, RECOMPUTE), cached=True))
    if sharded and layout.offload:
        terms.append(fsdp_offload_staging(arch, w, c, layout.shards))
    if ddp and not frozen:
        terms.append(Term("second gradient buckets", w * local_params, f"{w:g} B x {local_params:,.0f}: measured on "
                          "2 x H200 (torch 2.11, benchmarks/results/2026-11-24-h200x2-data-parallel), 5 of 6 ranks "
                          "held a second set of buckets' bytes at every moment (1B preset: 62.0 GB against 57.9 GB); "
                          "rank 0's allocator snapshot, where it did not, shows the set DDP rebuilds after its first "
                          "step"))
    if ddp and tied_here:
        terms.append(Term("tied gradient awaiting its sum", w * V * h, "w x V h: the output projection's "
                          "contribution, held by autograd until the embedding's joins it and the sum goes to its "
                          "bucket", at(FIRST)))
    if embedding_grad:
        terms.append(Term("input embedding gradient", w * embedding_grad, f"w x V h / {tp}, formed by the last "
                          "backward operator" + (", before DDP copies it into its bucket" if ddp else "")
                          + (" (under GPipe, the first microbatch's)" if later else ""), at(END, *later)))
    accumulator = inductor.embedding_gradient_accumulator(arch, w) / tp if compiled and not frozen and \
        has_embedding else 0.0
    if accumulator:
        terms.append(Term("embedding gradient accumulator", accumulator, "4 B x V h: the compiled embedding "
                          "backward's fp32 sum, cast to the weights' dtype", at(END)))
    if tied_here and not frozen and not sharded:
        terms.append(Term("tied embedding gradients", 2 * w * V * h, "the input embedding's gradient and its sum "
                          "with the output projection's, 2 x V h x weight bytes", at(END)))
    return MemoryEstimate(tuple(terms), moments)
