"""transformers' model quantized as it is built, one decoder layer at a time, on one device or split by
layers over several, as ``from_pretrained`` with a quantization config and a ``device_map`` loads it:
every module is created on the meta device, and each decoder layer gets storage on its device, its
weights (random, or read from a checkpoint directory tensor by tensor,
``fitbench.models.checkpoint_reader``), and its quantized matmuls before the next layer gets
storage. The peak on a device is its quantized layers so far, the bf16 modules it holds whole
(embeddings, norms, the output projection), and one layer in bf16 with the quantizer's temporaries.

The layers are split over the devices as ``fitbench.worker.hf_pipeline`` splits floating-point stages
(``stage_device_map``), and the model is dispatched the same way (accelerate's hooks move each
module's inputs to its device). Quality against bf16 is measured in the same pass, as the native
build measures it (``fitbench.worker.quantize.build_quantized_native``): a probe sequence runs
through the model while it is built, each layer getting its weights when the probe reaches it and
running in bf16 with its matmuls' inputs recorded; then its matmuls are quantized and each is run on
the inputs it had. The logits of that pass are the bf16 model's; a second pass through the finished
model gives the quantized logits.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fitbench.models.architecture import Architecture
from fitbench.models.checkpoint_reader import CheckpointReader
from fitbench.models.hf import hf_config
from fitbench.models.native import materialize
from fitbench.worker.hf_pipeline import decoder_layers, stage_device_map
from fitbench.worker.quality import (REFERENCE_TEXT_NAME, Perplexity, Quality, kl_divergence, matmul_errors,
                                     perplexity, recorded_matmuls, summarise, top1_agreement)
from fitbench.worker.quantize import quantize_linears, shipped_text
from fitbench.worker.quantize.linears import quantizable_linears, to_plain_linears, transposed_weights


def _moving_inputs_to(device: str) -> Callable:
    """A forward pre-hook (``with_kwargs``) that moves a module's tensor inputs to ``device``."""
    from accelerate.utils import send_to_device

    def hook(module, args, kwargs):
        return send_to_device(args, device), send_to_device(kwargs, device)
    return hook


@torch.no_grad()
def build_quantized_hf(arch: Architecture, devices: list[str], precision: str, probe: torch.Tensor,
                       checkpoint: str | Path | None = None) -> tuple[nn.Module, dict[str, str], Quality]:
    """``arch`` as transformers builds it, its decoder layers' matmuls in ``precision``, each layer made
    and quantized on its device in turn (module docstring), split over ``devices`` by layers (one
    device: all on it); returns the dispatched model, its device map and its quality against bf16 on
    ``probe`` (1, T) token ids. Random weights are transformers' initializer's, drawn module by
    module; over several devices a tied output projection gets its own copy on the last, as
    ``fitbench.worker.hf_pipeline.build_staged`` gives it.

    ``checkpoint``: a directory that transformers' ``save_pretrained`` wrote; the model is its
    ``config.json``'s, and each module, as it gets storage, is filled with its tensors in bf16, read
    from the checkpoint then and only then (``fill_from_checkpoint``), so the quality is measured
    against the checkpoint's own bf16 weights. Where its tokenizer reads the shipped text, the text
    passes the bf16 layers beside the probe, in a second row (``reference_batch``), and the quality
    holds its perplexity before and after (``fitbench.worker.quality.Perplexity``)."""
    from accelerate import dispatch_model
    from transformers import AutoModelForCausalLM

    reader = CheckpointReader(checkpoint) if checkpoint is not None else None
    text, perplexities = shipped_text(checkpoint, arch, probe.device) if checkpoint is not None else (None, None)
    T = probe.shape[1]
    # the probe's rows alone: the text's are no part of the matmuls' errors
    keep = torch.clone if text is None else lambda t: t[:1, :T].clone()
    config = hf_config(arch) if reader is None else checkpoint_config(reader.directory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    transposed = transposed_weights(model)  # as a checkpoint holds them, (in, out)
    to_plain_linears(model)
    mapping = stage_device_map(model, devices)
    prefix, layers = decoder_layers(model)
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = output is not None and output.weight is embedding.weight
    separate_head = tied and len(devices) > 1  # the last stage's own copy, as the floating-point stages'
    if separate_head:
        output.weight = nn.Parameter(torch.empty_like(embedding.weight))  # the last device's own copy
    head = _name_of(model, output) if output is not None else None

    def make(name: str, device: str) -> nn.Module:
        """The module called ``name`` given storage on ``device`` and its weights."""
        module = materialize(model.get_submodule(name), device)
        for part in module.modules():
            model._init_weights(part)  # the random weights, and the buffers a checkpoint does not hold
        if reader is not None:
            fill_from_checkpoint(module, name, reader, model.base_model_prefix, transposed)
        return module

    for name, device in mapping.items():
        if not (name.startswith(f"{prefix}.") or (tied and name == head)):
            make(name, device)
    if separate_head:  # a copy, drawing nothing: the layers get the one device's weights
        materialize(output, mapping[head]).weight.data.copy_(embedding.weight.data)
    elif tied:
        output.weight = embedding.weight  # materialized apart, the two are tied again

    errors: dict[str, float] = {}
    recordings: dict[int, tuple] = {}  # a layer's recording of its matmuls, from its forward's start to its end
    handles = [model.get_submodule(name).register_forward_pre_hook(_moving_inputs_to(device), with_kwargs=True)
               for name, device in mapping.items()]

    def make_layer(index: int, layer: nn.Module, device: str) -> None:
        def before(module, args):
            make(f"{prefix}.{index}", device)
            linears = quantizable_linears(module, f"{prefix}.{index}.")
            # copies: transformers' layers may add into a matmul's output in place (Falcon's parallel block)
            recording = recorded_matmuls(linears, keep=keep)
            recordings[index] = (recording, recording.__enter__())

        def after(module, args, result):
            recording, record = recordings.pop(index)
            recording.__exit__(None, None, None)
            quantize_linears(module, precision, torch.device(device))
            named = {f"{prefix}.{index}.{name}": child for name, child in module.named_modules()}
            errors.update(matmul_errors(record, named, torch.device(device)))
        handles.append(layer.register_forward_pre_hook(before))
        handles.append(layer.register_forward_hook(after))

    for index, layer in enumerate(layers):
        make_layer(index, layer, mapping[f"{prefix}.{index}"])
    first = devices[0]
    logits = model(reference_batch(probe, text).to(first), use_cache=False).logits.to(first)
    reference = logits[:1, :T]
    for handle in handles:
        handle.remove()
    dispatch_model(model, device_map=mapping, main_device=first, force_hooks=True)
    quantized = model(probe.to(first), use_cache=False).logits.to(first)
    if text is not None:
        text = text.to(first)
        bf16 = perplexity(logits[1:, :text.shape[1]], text)
        perplexities = Perplexity(REFERENCE_TEXT_NAME, text.shape[1], bf16,
                                  perplexity(model(text, use_cache=False).logits.to(first), text))
    weights = "same random weights" if reader is None else "the checkpoint's weights"
    quality = Quality(summarise(errors), top1_agreement(quantized, reference), kl_divergence(quantized, reference),
                      probe.numel(), perplexities, reference=f"bf16, {weights}, same input")
    return model, mapping, quality


def reference_batch(probe: torch.Tensor, text: torch.Tensor | None) -> torch.Tensor:
    """The token ids the bf16 layers see while they are built: the probe (1, T); with the text (1, N), a
    batch of the two, each padded at its end to the longer with token 0. Attention is causal, so
    padding after a position changes nothing at it: row 0's first T positions are the probe's alone,
    row 1's first N the text's."""
    if text is None:
        return probe
    length = max(probe.shape[1], text.shape[1])
    return torch.cat([F.pad(row, (0, length - row.shape[1])) for row in (probe, text.to(probe.device))])


def checkpoint_config(directory: Path):
    """transformers' config of the checkpoint in ``directory``, its attention sdpa, as ``from_pretrained``
    with ``attn_implementation="sdpa"`` reads it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    config._attn_implementation = "sdpa"
    return config


@torch.no_grad()
def fill_from_checkpoint(module: nn.Module, name: str, reader: CheckpointReader, base_prefix: str,
                         transposed: set[str]) -> None:
    """Copy into ``module`` (called ``name`` in the model) its parameters and the persistent buffers the
    checkpoint holds, each tensor read alone and cast to the module's dtype on the host, those named in
    ``transposed`` (GPT-2's ``Conv1D`` weights, now plain ``nn.Linear``) copied from their transpose. A
    name is the model's, or without the base model's prefix (``base_prefix``: ``model``,
    ``transformer``), as a checkpoint of the base model names it and ``from_pretrained`` accepts it; a
    parameter the checkpoint lacks is an error."""
    buffers = {f"{name}.{key}" for key, _ in module.named_buffers()}
    for key, target in module.state_dict(prefix=f"{name}.", keep_vars=True).items():
        stored = key if key in reader else key.removeprefix(f"{base_prefix}.")
        if stored in reader:
            value = reader.tensor(stored, target.dtype)
            target.data.copy_(value.T if key in transposed else value)
        elif key not in buffers:
            raise ValueError(f"the checkpoint in {reader.directory} has no tensor {key} (nor {stored}), which the "
                             f"model of its config.json needs: the checkpoint and config.json are of different "
                             f"models; save both with transformers' save_pretrained from one model")


def _name_of(model: nn.Module, module: nn.Module) -> str:
    """The top-level entry of the device map that holds ``module``."""
    for name, child in model.named_modules():
        if child is module:
            return name
    raise ValueError(f"{type(module).__name__} is not a module of {type(model).__name__}")
