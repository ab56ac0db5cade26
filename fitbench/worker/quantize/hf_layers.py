"""transformers' model quantized as it is built, one decoder layer at a time, on one device or split by
layers over several, as ``from_pretrained`` with a quantization config and a ``device_map`` loads it:
every module is created on the meta device, and each decoder layer gets storage on its device, its
random weights, and its quantized matmuls before the next layer gets storage. The peak on a device is
its quantized layers so far, the bf16 modules it holds whole (embeddings, norms, the output
projection), and one layer in bf16 with the quantizer's temporaries.

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

import torch
from torch import nn

from fitbench.models.architecture import Architecture
from fitbench.models.hf import hf_config
from fitbench.models.native import materialize
from fitbench.worker.hf_pipeline import decoder_layers, stage_device_map
from fitbench.worker.quality import Quality, kl_divergence, matmul_errors, recorded_matmuls, summarise, top1_agreement
from fitbench.worker.quantize import quantize_linears
from fitbench.worker.quantize.linears import quantizable_linears, to_plain_linears


def _moving_inputs_to(device: str) -> Callable:
    """A forward pre-hook (``with_kwargs``) that moves a module's tensor inputs to ``device``."""
    from accelerate.utils import send_to_device

    def hook(module, args, kwargs):
        return send_to_device(args, device), send_to_device(kwargs, device)
    return hook


@torch.no_grad()
def build_quantized_hf(arch: Architecture, devices: list[str], precision: str,
                       probe: torch.Tensor) -> tuple[nn.Module, dict[str, str], Quality]:
    """``arch`` as transformers builds it, its decoder layers' matmuls in ``precision``, each layer made
    and quantized on its device in turn (module docstring), split over ``devices`` by layers (one
    device: all on it); returns the dispatched model, its device map and its quality against bf16 on
    ``probe`` (1, T) token ids. Random weights are transformers' initializer's, drawn module by
    module; over several devices a tied output projection gets its own copy on the last, as
    ``fitbench.worker.hf_pipeline.build_staged`` gives it."""
    from accelerate import dispatch_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.bfloat16)
    model.eval()
    to_plain_linears(model)
    mapping = stage_device_map(model, devices)
    prefix, layers = decoder_layers(model)
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = output is not None and output.weight is embedding.weight
    separate_head = tied and len(devices) > 1  # the last stage's own copy, as the floating-point stages'
    if separate_head:
        output.weight = nn.Parameter(torch.empty_like(embedding.weight))  # the last device's own copy
    head = _name_of(model, output) if output is not None else None
    for name, device in mapping.items():
        if name.startswith(f"{prefix}.") or (tied and name == head):
            continue
        for module in materialize(model.get_submodule(name), device).modules():
            model._init_weights(module)
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
            materialize(module, device)
            for part in module.modules():
                model._init_weights(part)
            linears = quantizable_linears(module, f"{prefix}.{index}.")
            # copies: transformers' layers may add into a matmul's output in place (Falcon's parallel block)
            recording = recorded_matmuls(linears, keep=torch.clone)
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
    reference = model(probe.to(first), use_cache=False).logits.to(first)
    for handle in handles:
        handle.remove()
    dispatch_model(model, device_map=mapping, main_device=first, force_hooks=True)
    quantized = model(probe.to(first), use_cache=False).logits.to(first)
    quality = Quality(summarise(errors), top1_agreement(quantized, reference), kl_divergence(quantized, reference),
                      probe.numel(), None, reference="bf16, same random weights, same input")
    return model, mapping, quality


def _name_of(model: nn.Module, module: nn.Module) -> str:
    """The top-level entry of the device map that holds ``module``."""
    for name, child in model.named_modules():
        if child is module:
            return name
    raise ValueError(f"{type(module).__name__} is not a module of {type(model).__name__}")
