"""Quantized weights for the decoder layers' matmuls, each precision converted by its entry's library
(``fitbench.precisions``): one converter per library, ``fitbench.worker.quantize.bitsandbytes`` and
``fitbench.worker.quantize.torchao``. What each precision stores and computes is its entry's ``summary``.

Embeddings, norms and the output projection stay bf16, as transformers' integrations keep them
(``fitbench.worker.quantize.linears``).

A large model is quantized as it is built, one layer at a time (``build_quantized_native``), so the
full bf16 model never exists: the peak is the quantized layers so far plus one layer in bf16. Each
layer's weights, once quantized, move into one block of a pool of their own (``fitbench.worker.packing``),
so that the next layer's bf16 weights and temporaries find the range this one's left free. The
same pass measures quality against the bf16 model (``fitbench.worker.quality``): a probe sequence runs
through each layer in bf16, each matmul's input is kept, and the layer, once quantized, runs its
matmuls on those inputs and its own copy of the probe's hidden states through; the final logits of
the two copies give the next-token agreement and KL divergence.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from fitbench.models.architecture import Architecture
from fitbench.models.native import (NativeCausalLM, empty_on, init_random_weights, materialize, meta_model,
                                   replay_random_weights)
from fitbench.precisions import entry
from fitbench.worker.packing import Packer, packed_bytes
from fitbench.worker.quality import (REFERENCE_TEXT_NAME, NoTokenizer, Perplexity, Quality, kl_divergence, matmul_errors,
                                  perplexity, recorded_matmuls, summarise, tokenize_reference_text, top1_agreement)
from fitbench.worker.quantize import bitsandbytes, torchao
from fitbench.worker.quantize.linears import quantizable, quantizable_linears, to_plain_linears

# What one pipeline stage's quantized build hands the next: the probe's bf16 and quantized hidden
# states (1, T, C) and the matmul errors so far.
Carried = tuple[torch.Tensor, torch.Tensor, dict[str, float]]
# The converter of each library an entry may name: a function of the precision and the device giving what
# turns one plain matmul into its quantized module.
CONVERTERS = {"bitsandbytes": bitsandbytes.converter, "torchao": torchao.converter}


@torch.no_grad()
def quantize_linears(module: nn.Module, precision: str, device: torch.device,
                     each: Callable[[nn.Module], object] | None = None) -> None:
    """Replace (bitsandbytes) or convert (torchao) every matmul of ``module`` but the output projection,
    one at a time, the largest first, handing each quantized matmul to ``each``. Largest first: the
    range a matrix and its temporaries leave free is then long enough for every later one's, so the
    allocator need not map more for them."""
    to_plain_linears(module)
    targets = [(parent, name, child.weight.numel()) for parent_name, parent in module.named_modules()
               for name, child in parent.named_children() if quantizable(child, f"{parent_name}.{name}")]
    targets.sort(key=lambda target: -target[2])
    convert = CONVERTERS[entry(precision).library](precision, device)
    for parent, name, _ in targets:
        setattr(parent, name, convert(getattr(parent, name)))
        if each is not None:
            each(getattr(parent, name))


@torch.no_grad()
def build_quantized_native(arch: Architecture, device: torch.device, precision: str, probe: torch.Tensor,
                           layers: range | None = None, receive: Callable[[], Carried] | None = None,
                           send: Callable[[Carried], None] | None = None) -> tuple[NativeCausalLM, Quality | None]:
    """Materialize, quantize and pack one layer at a time, carrying a bf16 and a quantized copy of the
    probe's hidden states through the layers; return the model and its quality against bf16. The first
    layer, once quantized, sizes one block for every layer's weights (``fitbench.worker.packing``); from
    the second on, each matmul moves into it as soon as it is quantized. On a GPU the block lives in a
    private memory pool, kept as the model's ``packer``: one block, because the pool maps whole pages
    of 20 MiB for each of its allocations (on an H200, a block per layer of 52 MB took 63 MB).

    ``layers``: a pipeline stage's (``fitbench.worker.pipeline``), the only decoder layers given storage;
    the first stage also materializes the embedding (and a learned position table) and the last the
    final norm and the output projection (a tied one: its own copy of the table), every other module
    staying on the meta device, and every weight drawn as in the whole model's build
    (``replay_random_weights``). The probe's two hidden states and the matmul errors so far come from
    the stage before (``receive``) and go to the next (``send``); the quality exists on the last
    stage, None on the others."""
    layers = range(arch.num_layers) if layers is None else layers
    first, last = layers.start == 0, layers.stop == arch.num_layers
    model = meta_model(arch, torch.bfloat16)
    packer = Packer(device)
    # a tied output projection is never allocated on its own: freed once tied, its table would be a
    # hole the size of the vocabulary at the bottom of the allocator's segment for the whole run
    tied = arch.tie_embeddings
    embedding, norm, head = model.model.embed_tokens, model.model.norm, model.lm_head
    positions = (model.model.embed_positions,) if hasattr(model.model, "embed_positions") else ()
    ends = (embedding, *positions, norm, *(() if tied else (head,)))
    owners = ((embedding, first or (tied and last)), *((table, first) for table in positions), (norm, last),
              (head, last and not tied))
    for part, owned in owners:
        if owned:
            materialize(part, device)
    replay_random_weights(list(ends), device)
    if tied and last:
        model.lm_head.weight = embedding.weight
    model.rope_cos, model.rope_sin = empty_on(model.rope_cos, device), empty_on(model.rope_sin, device)
    model.reset_rope()

    T = probe.shape[1]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    errors: dict[str, float] = {}
    if first:
        reference = quantized = model.add_positions(embedding(probe), slice(0, T))
    else:
        reference, quantized, errors = receive()
    # the layers of earlier stages draw their weights into scratch; those of later stages draw nothing here
    for i in range(layers.stop):
        layer = model.model.layers[i]
        if i not in layers:
            replay_random_weights([layer], device)
            continue
        materialize(layer, device)
        init_random_weights(layer)
        prefix = f"model.layers.{i}."
        with recorded_matmuls(quantizable_linears(layer, prefix)) as record:
            reference = layer(reference, cos, sin, None, 0)
        quantize_linears(layer, precision, device, each=packer.pack if i != layers.start else None)
        errors |= matmul_errors(record, {f"{prefix}{name}": m for name, m in layer.named_modules()}, device)
        del record
        quantized = layer(quantized, cos, sin, None, 0)
        if i == layers.start:  # the first layer, quantized, tells what each takes: one block for all of them
            packer.reserve(packed_bytes(layer, device) * len(layers))
        packer.pack(layer)  # the first layer whole; then each layer's norms and what its forward added
    model.packer = packer
    if not last:
        send((reference, quantized, errors))
        return model, None
    reference_logits = model.lm_head(model.model.norm(reference))
    quantized_logits = model.lm_head(model.model.norm(quantized))
    return model, Quality(summarise(errors), top1_agreement(quantized_logits, reference_logits),
                          kl_divergence(quantized_logits, reference_logits), probe.numel(), None,
                          reference="bf16, same random weights, same input")


@torch.no_grad()
def quantize_built(lm, arch: Architecture, precision: str, device: torch.device, probe: torch.Tensor,
                   checkpoint: str | Path | None = None) -> Quality:
    """Quantize an already built bf16 model of ``arch`` in place (transformers, or a checkpoint),
    measuring its quality against itself before; ``lm`` is a ``fitbench.models.backends.CausalLM``.
    The matmuls' inputs and outputs of the bf16 pass wait in host memory (a large model has hundreds
    of matmuls) until the quantized matmuls run on them. With the ``checkpoint`` directory the weights
    came from, the perplexity of the shipped text before and after."""
    text, perplexities = None, None
    if checkpoint is not None:
        try:
            ids = tokenize_reference_text(checkpoint, arch.vocab_size, arch.max_seq_len)
            text = torch.tensor([ids], device=device)
        except NoTokenizer as reason:
            perplexities = f"not measured: {reason}"
    linears = quantizable_linears(lm.module)
    with recorded_matmuls(linears, keep=lambda t: t.to("cpu")) as record:
        reference = lm.logits(probe)
    bf16_perplexity = perplexity(lm.logits(text), text) if text is not None else None
    quantize_linears(lm.module, precision, device)
    errors = matmul_errors(record, dict(lm.module.named_modules()), device)
    del record
    quantized = lm.logits(probe)
    if text is not None:
        perplexities = Perplexity(REFERENCE_TEXT_NAME, text.shape[1], bf16_perplexity,
                                  perplexity(lm.logits(text), text))
    return Quality(summarise(errors), top1_agreement(quantized, reference), kl_divergence(quantized, reference),
                   probe.numel(), perplexities, reference="bf16, same weights, same input")
