"""transformers models: from a preset's shipped architecture, a local directory or a hub id.

Random weights are created the same way as the native decoder's: the model is built on the meta
device, its storage allocated directly on the target device, then transformers' own initializer
fills it (``initialize_weights`` also recomputes the rotary tables that the meta device lost).
Real weights, when the directory has them, load through ``from_pretrained`` straight to the device.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fitbench.models.architecture import Architecture

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def has_weights(path: str | Path) -> bool:
    directory = Path(path)
    return directory.is_dir() and any(any(directory.glob(pattern)) for pattern in WEIGHT_PATTERNS)


def hf_config(arch: Architecture):
    from transformers import AutoConfig

    config = AutoConfig.for_model(arch.hf_model_type, **arch.hf_config_dict())
    config._attn_implementation = "sdpa"
    return config


def build_hf(arch: Architecture, device: torch.device | str, dtype: torch.dtype,
             weights_dir: str | None = None) -> nn.Module:
    from transformers import AutoModelForCausalLM

    if weights_dir is not None and has_weights(weights_dir):
        model = AutoModelForCausalLM.from_pretrained(
            weights_dir, dtype=dtype, device_map={"": str(device)}, attn_implementation="sdpa"
        )
        return model
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(arch), dtype=dtype)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives every parameter its own storage, untying the output projection
    model.initialize_weights()
    return model
