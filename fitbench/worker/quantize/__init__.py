"""Quantized weights for the decoder layers' matmuls, each precision converted by its entry's library
(``fitbench.precisions``): one converter per library, ``fitbench.worker.quantize.bitsandbytes`` and
``fitbench.worker.quantize.torchao``. What each precision stores and computes is its entry's ``summary``.

Embeddings, norms and the output projection stay bf16, as transformers' integrations keep them
(``fitbench.worker.quantize.linears``).

A large model is quantized as it is built, one layer at a time (``build_quantized_native``), its
weights random or each layer's read from a checkpoint as the layer is made, so the full bf16 model
never exists: the peak is the quantized layers so far plus one layer in bf16. Each
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
from fitbench.models.checkpoint_names import layer_of, native_state, unplaced_problem
from fitbench.models.checkpoint_reader import CheckpointReader
from fitbench.models.native import (NativeCausalLM, empty_on, init_random_weights, materialize, meta_model,
                                   replay_random_weights)
from fitbench.precisions import entry
from fitbench.worker.packing import Packer, packed_bytes
from fitbench.worker.quality import (REFERENCE_TEXT_NAME, NoTokenizer, Perplexity, Quality, kl_divergence, matmul_errors,
                                  perplexity, recorded_matmuls, summarise, tokenize_reference_text, top1_agreement)
from fitbench.worker.quantize import bitsandbytes, torchao
from fitbench.worker.quantize.linears import quantizable, quantizable_linears, to_plain_linears

# Why a pipeline stage's quality has no perplexity of a checkpoint's text: the quantized one needs the whole
# model's logits, which no stage's process holds.
STAGE_PERPLEXITY = ("not measured: the text's perplexity needs the whole quantized model in one process, and each "
                    "pipeline stage holds its own layers")
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
                           send: Callable[[Carried], None] | None = None,
                           checkpoint: str | Path | None = None) -> tuple[NativeCausalLM, Quality | None]:
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
    stage, None on the others.

    ``checkpoint``: a directory that transformers' ``save_pretrained`` wrote, of ``arch``; each module,
    as it gets storage, takes its tensors from it, read then and only then (``fill_native``), instead
    of random ones (a stage reads its own modules' alone). Built whole, where the checkpoint's
    tokenizer reads the shipped text, the text's bf16 hidden states pass the layers beside the
    probe's, and the quality holds its perplexity before and after (``STAGE_PERPLEXITY`` on a
    stage)."""
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
    reader = CheckpointReader(checkpoint) if checkpoint is not None else None
    if reader is None:
        replay_random_weights(list(ends), device)
    else:
        names = {module: name for name, module in model.named_modules()}
        fill_native(reader, {f"{names[part]}.{key}": tensor for part, owned in owners if owned
                             for key, tensor in part.state_dict(keep_vars=True).items()}, None)
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
    if reader is not None and first and last:
        text, perplexities = shipped_text(checkpoint, arch, device)
    else:
        text, perplexities = None, STAGE_PERPLEXITY if reader is not None else None
    if text is not None:
        text_hidden = model.add_positions(embedding(text), slice(0, text.shape[1]))
        text_cos, text_sin = model.rope_cos[:text.shape[1]], model.rope_sin[:text.shape[1]]
    # the layers of earlier stages draw their weights into scratch; those of later stages draw nothing here
    for i in range(layers.stop):
        layer = model.model.layers[i]
        if i not in layers:
            if reader is None:
                replay_random_weights([layer], device)
            continue
        materialize(layer, device)
        prefix = f"model.layers.{i}."
        if reader is None:
            init_random_weights(layer)
        else:
            fill_native(reader, {f"{prefix}{key}": tensor for key, tensor in layer.state_dict(keep_vars=True).items()},
                        i)
        with recorded_matmuls(quantizable_linears(layer, prefix)) as record:
            reference = layer(reference, cos, sin, None, 0)
        if text is not None:
            text_hidden = layer(text_hidden, text_cos, text_sin, None, 0)
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
    if text is not None:
        perplexities = Perplexity(REFERENCE_TEXT_NAME, text.shape[1],
                                  perplexity(model.lm_head(model.model.norm(text_hidden)), text),
                                  perplexity(model(text), text))
    weights = "same random weights" if reader is None else "the checkpoint's weights"
    return model, Quality(summarise(errors), top1_agreement(quantized_logits, reference_logits),
                          kl_divergence(quantized_logits, reference_logits), probe.numel(), perplexities,
                          reference=f"bf16, {weights}, same input")


@torch.no_grad()
def fill_native(reader: CheckpointReader, targets: dict[str, torch.Tensor], layer: int | None) -> None:
    """Copy into ``targets`` (the native model's tensors by their names) the checkpoint's tensors of
    decoder layer ``layer`` (None: those outside the layers), each read alone in the targets' dtype
    and renamed as the native model names them (``fitbench.models.checkpoint_names``, told the layout
    by the directory's ``config.json``). Every target must be found (a tied output projection is none:
    the embedding's table), and every tensor of a layer must have its target: one dropped would be a
    model other than the checkpoint's."""
    dtype = next(iter(targets.values())).dtype
    state = native_state(reader.config, {key: reader.tensor(key, dtype) for key in sorted(reader.keys())
                                     if layer_of(key) == layer})
    for key, value in state.items():
        if key in targets:
            targets[key].data.copy_(value)
    missing = set(targets) - set(state)
    if missing:
        raise ValueError(f"the checkpoint in {reader.directory} lacks {len(missing)} tensors of the model its "
                         f"config.json describes, e.g. {sorted(missing)[:3]}: save the checkpoint and its config "
                         f"with transformers' save_pretrained from one model")
    unused = set(state) - set(targets) if layer is not None else set()
    if unused:
        raise ValueError(unplaced_problem(reader.directory, unused, f"layer {layer}"))


def shipped_text(checkpoint: str | Path, arch: Architecture, device: torch.device) -> tuple[torch.Tensor | None,
                                                                                            str | None]:
    """The shipped text's token ids (1, N) on ``device``, by the tokenizer of the ``checkpoint`` directory
    (``fitbench.worker.quality.tokenize_reference_text``), and None; or None and why its perplexity is not
    measured."""
    try:
        ids = tokenize_reference_text(checkpoint, arch.vocab_size, arch.max_seq_len)
    except NoTokenizer as reason:
        return None, f"not measured: {reason}"
    return torch.tensor([ids], device=device), None
