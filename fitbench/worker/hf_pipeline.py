"""A transformers model over pipeline stages for inference: one process, its decoder layers split in
consecutive runs over the job's devices by accelerate's device map.

This serves every family the native decoder does not cover (Falcon, GPT-2), and any hf model: the
layers of stage i are ``fitbench.spec.pipeline_stages``' i-th run, the split the planner predicts,
on device i; the first stage also holds the embeddings (and a learned position table, rotary
tables), the last the final norm and the output projection. A tied output projection gets a copy of
the embedding on the last device, as the native pipeline's last stage builds its own: two copies,
as the planner counts them. ``accelerate.dispatch_model`` puts each module on its device and hooks
it to move its inputs there; the model's own hook brings the logits back to the first device.

A token passes the stages one after another, each device idle while the others work: the job's
latency is one device's for the whole model plus a copy of the hidden states at each boundary, and
its gain is memory, every device holding about 1 / N of the weights and of the KV cache. Training is
refused (``fitbench.spec.Layout.problem``): the stages would run the backward one after another
too, with none of a pipeline schedule's overlap.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fitbench.models.architecture import Architecture
from fitbench.models.backends import HuggingFaceLM
from fitbench.models.hf import has_weights, hf_config
from fitbench.spec import pipeline_stages

# The last stage's modules besides its layers, as the families name them at the top of the base model:
# the final norm (Llama's norm, Falcon's and GPT-2's ln_f)
FINAL_NORMS = ("norm", "ln_f")


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The qualified name and the list of ``model``'s decoder layers: the module list as long as the
    config's layer count (Llama's ``model.layers``, Falcon's and GPT-2's ``transformer.h``)."""
    count = model.config.num_hidden_layers
    found = [(name, module) for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and len(module) == count]
    if len(found) != 1:
        raise ValueError(f"{type(model).__name__} has {len(found)} module lists of {count} layers; "
                         f"expected one, the decoder layers")
    return found[0]


def stage_device_map(model: nn.Module, devices: list[str]) -> dict[str, str]:
    """accelerate's device map of ``model`` over ``devices``, one pipeline stage each: the layers of
    ``pipeline_stages``, the embeddings and every other module of the base model on the first
    device, the final norm and the output projection on the last."""
    prefix, layers = decoder_layers(model)
    base_name = prefix.rpartition(".")[0]
    base = model.get_submodule(base_name) if base_name else model
    stages = pipeline_stages(len(layers), len(devices))
    mapping: dict[str, str] = {}
    for name, _ in base.named_children():
        qualified = f"{base_name}.{name}" if base_name else name
        if qualified == prefix:
            for device, run in zip(devices, stages):
                mapping |= {f"{prefix}.{index}": device for index in run}
        else:
            mapping[qualified] = devices[-1] if name in FINAL_NORMS else devices[0]
    for name, _ in model.named_children():
        if name != base_name:
            mapping[name] = devices[-1]  # the output projection
    return mapping


def build_staged(arch: Architecture, devices: list[str], dtype: torch.dtype,
                 weights_dir: str | None = None) -> tuple[nn.Module, dict[str, str]]:
    """``arch`` as transformers builds it, each stage's modules allocated directly on its device (never
    the whole model on one), then dispatched (``accelerate.dispatch_model``) so that each module's
    inputs follow it; returns the model and its device map. Hooks are installed even where every
    device is one CPU, so that the path is the one several GPUs take. Random weights are drawn as
    ``fitbench.models.hf.build_hf`` draws them, a tied output projection a copy of the embedding."""
    from accelerate import dispatch_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(arch), dtype=dtype)
    mapping = stage_device_map(model, devices)
    if weights_dir is not None and has_weights(weights_dir):
        model = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=dtype, device_map=mapping,
                                                     attn_implementation="sdpa")
    else:
        output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        tied = output is not None and output.weight is embedding.weight
        if tied:
            output.weight = nn.Parameter(torch.empty_like(embedding.weight))  # the last stage's own copy
        for name, device in mapping.items():
            model.get_submodule(name).to_empty(device=device)
        model.initialize_weights()
        if tied:
            # the single build's initializer writes the tied table twice, the output projection's draw last
            with torch.no_grad():
                embedding.weight.copy_(output.weight)
    dispatch_model(model, device_map=mapping, main_device=devices[0], force_hooks=True)
    return model, mapping


class StagedHuggingFaceLM(HuggingFaceLM):
    """A transformers model over pipeline stages in one process (``build_staged``); ``from_checkpoint``:
    its weights were read from a checkpoint directory rather than drawn."""

    def __init__(self, module: nn.Module, static_cache: bool, devices: list[str], from_checkpoint: bool = False):
        super().__init__(module, static_cache)
        self.devices = devices
        self.from_checkpoint = from_checkpoint

    def applied(self, microbatches: int | None = None) -> dict[str, Any]:
        """What the row's ``parallel`` records; inference has no ``microbatches``."""
        _, layers = decoder_layers(self.module)
        return {"strategy": "pipeline", "world_size": 1, "stages": len(self.devices), "schedule": None,
                "microbatches": None, "method": "accelerate's device map, one process over every device",
                "devices": self.devices,
                "stage_layers": [[run.start, run.stop - 1]
                                 for run in pipeline_stages(len(layers), len(self.devices))],
                "initial_weights": "read from the checkpoint, each stage's on its device" if self.from_checkpoint
                else "drawn as one process draws them, each stage on its device"}

    def enable_activation_checkpointing(self, layers: int | None = None) -> None:
        raise ValueError("pipeline stages of the hf backend run inference only")


def stage_devices(device: torch.device, stages: int) -> list[str]:
    """The job's devices, one per stage: the visible GPUs 0 .. stages - 1, or the CPU for each."""
    if device.type == "cuda":
        if torch.cuda.device_count() < stages:
            raise ValueError(f"{stages} pipeline stages need {stages} visible GPUs; this process sees "
                             f"{torch.cuda.device_count()}")
        return [f"cuda:{index}" for index in range(stages)]
    return [device.type] * stages
