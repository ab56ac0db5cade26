"""Offload: the decoder layers that do not fit on the device stay in a slower tier and stream in
for their forward, through accelerate's big-model hooks.

**Tiers.** Running on a GPU, the layers that do not fit stay in host memory. Running on the CPU,
host memory is the device itself, so they stay on disk, in accelerate's memory-mapped files
(``offload_dir``): the same hooks move the same weights either way, so a CPU run exercises the
whole path.

**Placement.** accelerate's ``infer_auto_device_map`` places the decoder layers in order on the
device within ``layer_memory`` bytes (``fitbench.planning.planner.offload_split``: what the GPU has
left after the embeddings, final norm, output projection, KV cache, temporaries and CUDA context),
keeping one layer's room free for the layer in flight; the rest go to the tier. The embeddings,
final norm, output projection and rotary tables stay on the device, so the KV cache, which the
decoder allocates where the rotary tables are, does too.

**Build.** The model is built on the meta device. Each part is allocated on the device in module
order and initialized there, drawing the same random numbers as ``build_native``, so the weights
are identical to the plain model's; an offloaded layer then moves to its tier: copied to host
memory, or written to disk and dropped. No part that stays on the GPU ever has a host copy, and
the host never holds more than the offloaded layers (on disk: one layer).

**Execution.** ``accelerate.dispatch_model`` attaches an ``AlignDevicesHook`` to each offloaded
layer (the decoder layer class preloaded as a whole): its pre-forward copies the layer's weights
onto the device, its post-forward drops them. The copies run synchronously before the layer's
kernels, with no prefetch, so one layer is in flight at a time (the memory model's term). Host
weights stay in pageable memory, as accelerate keeps them, and accelerate empties the CUDA cache
after each tensor it places: both are part of what an offloaded run measures.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fitbench.models.architecture import Architecture
from fitbench.models.native import DecoderLayer, NativeCausalLM, empty_on, init_random_weights, materialize, meta_model

LAYER_CLASS = DecoderLayer.__name__


@dataclass(frozen=True)
class Offload:
    """Where the decoder layers went: the result row's ``offload``."""

    tier: str  # "cpu" (host memory, beside a GPU) or "disk" (beside the CPU)
    resident_layers: int
    offloaded_layers: int
    resident_bytes: int  # every weight on the device: the edges and the resident layers
    offloaded_bytes: int
    max_memory: dict[str, float]  # what accelerate was given to place the layers

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class OffloadCapacityError(Exception):
    """The tier cannot hold the offloaded layers; nothing was allocated."""


def tier_of(device: torch.device) -> str:
    """Where offloaded layers stay: host memory beside a GPU, disk beside the CPU."""
    return "cpu" if device.type == "cuda" else "disk"


def _accelerate_key(device: torch.device) -> int | str:
    """accelerate names a GPU by its index."""
    if device.type != "cuda":
        return "cpu"
    return device.index if device.index is not None else torch.cuda.current_device()


def place_layers(model: NativeCausalLM, device: torch.device, layer_memory: float,
                 host_memory: float) -> dict[str, int | str]:
    """Each decoder layer's place, ``model.layers.<i>`` -> the device's accelerate key, ``"cpu"`` or
    ``"disk"``, by ``infer_auto_device_map`` with ``layer_memory`` bytes on the device and, beside a
    GPU, ``host_memory`` bytes of host memory (past them, accelerate says disk)."""
    from accelerate import infer_auto_device_map

    max_memory: dict[int | str, int] = {_accelerate_key(device): max(int(layer_memory), 0)}
    if device.type == "cuda":
        max_memory["cpu"] = int(host_memory)
    placed = infer_auto_device_map(model.model.layers, max_memory=max_memory,
                                   no_split_module_classes=[LAYER_CLASS], clean_result=False)
    return {f"model.layers.{index}": where for index, where in placed.items()}


def capacity_problem(device: torch.device, layers: dict[str, int | str], needed: int, offload_dir: Path) -> str | None:
    """Why the tier cannot hold ``needed`` bytes of offloaded layers, or None."""
    if device.type == "cuda":
        spilled = sum(where == "disk" for where in layers.values())
        if spilled:
            return (f"offload: {spilled} of {len(layers)} decoder layers fit neither on the GPU nor in the host "
                    f"memory available ({needed / 1e9:.1f} GB to offload); free host memory or use a smaller model")
        return None
    offload_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(offload_dir).free
    if needed > free:
        return f"offload: {needed / 1e9:.1f} GB of decoder layers to write to disk, {free / 1e9:.1f} GB free under {offload_dir}"
    return None


def _parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def build_offloaded(arch: Architecture, device: torch.device, dtype: torch.dtype, layer_memory: float,
                    host_memory: float, offload_dir: Path) -> tuple[NativeCausalLM, Offload]:
    """The native model with the layers past ``layer_memory`` offloaded (``place_layers``), the
    random weights ``build_native`` draws, and accelerate's hooks attached; disk offload writes to
    ``offload_dir``. Raises ``OffloadCapacityError`` before allocating anything when the tier cannot
    hold the offloaded layers."""
    from accelerate import dispatch_model
    from accelerate.utils import offload_weight, save_offload_index

    model = meta_model(arch, dtype)
    model.requires_grad_(False)
    total = _parameter_bytes(model)
    layers = place_layers(model, device, layer_memory, host_memory)
    execution, tier = _accelerate_key(device), tier_of(device)
    offloaded = [name for name, where in layers.items() if where != execution]
    offloaded_bytes = _parameter_bytes(model.model.layers[0]) * len(offloaded)
    problem = capacity_problem(device, layers, offloaded_bytes, offload_dir)
    if problem:
        raise OffloadCapacityError(problem)

    if arch.tie_embeddings:  # untied while the parts are allocated one by one, as build_native does
        model.lm_head.weight = nn.Parameter(torch.empty(0, device="meta", dtype=dtype), requires_grad=False)
    host: dict[str, torch.Tensor] = {}
    index: dict[str, dict] = {}
    edges = ["model.embed_tokens", *(["model.embed_positions"] if hasattr(model.model, "embed_positions") else []),
             "model.norm", "lm_head"]
    for name in [*edges[:-2], *layers, *edges[-2:]]:
        part = model.get_submodule(name)
        if name == "lm_head" and arch.tie_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        else:
            materialize(part, device)
        init_random_weights(part)
        if name not in offloaded:
            continue
        if tier == "cpu":
            part.to("cpu")  # the device's copy is freed: only the host keeps this layer
            host.update({f"{name}.{key}": tensor for key, tensor in part.state_dict().items()})
        else:
            for key, tensor in part.state_dict().items():
                offload_weight(tensor, f"{name}.{key}", str(offload_dir), index)
            part.to("meta")
    model.rope_cos, model.rope_sin = empty_on(model.rope_cos, device), empty_on(model.rope_sin, device)
    model.reset_rope()

    if offloaded:
        save_offload_index(index, str(offload_dir))
        device_map = {name: execution for name in edges}
        device_map.update({name: tier if name in offloaded else execution for name in layers})
        dispatch_model(model, device_map, main_device=execution, state_dict=host or None,
                       offload_dir=str(offload_dir) if index else None, offload_index=index or None,
                       preload_module_classes=[LAYER_CLASS])
    max_memory = {str(execution): float(max(layer_memory, 0))}
    if device.type == "cuda":
        max_memory["cpu"] = float(host_memory)
    return model, Offload(tier=tier, resident_layers=len(layers) - len(offloaded), offloaded_layers=len(offloaded),
                          resident_bytes=total - offloaded_bytes, offloaded_bytes=offloaded_bytes,
                          max_memory=max_memory)
