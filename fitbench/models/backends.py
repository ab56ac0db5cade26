"""One interface over both backends: full logits for training, prefill and decode for generation.

``native`` is fitbench's own decoder (Llama-style models); ``hf`` is transformers'
``AutoModelForCausalLM`` (every family). Both keep a preallocated KV cache during generation
(the native ``KVCache``, transformers' ``StaticCache``), so the two measure the same algorithm.
The exception is transformers under autocast: its rotary step returns keys in fp32 during the
prefill and in the autocast dtype afterwards, which a preallocated cache of one dtype cannot
hold, so there it keeps the ``DynamicCache`` that ``generate`` uses by default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from torch import nn

from fitbench.models.architecture import Architecture
from fitbench.models.hf import build_hf, has_weights, hf_config
from fitbench.models.native import KVCache, NativeCausalLM, build_native

Backend = Literal["native", "hf"]
BACKENDS: tuple[str, ...] = ("native", "hf")


def default_backend(arch: Architecture) -> Backend:
    return "native" if arch.family == "llama" else "hf"


def backend_error(arch: Architecture, backend: str) -> str | None:
    """Why ``backend`` cannot run ``arch``, or None when it can."""
    if backend == "native" and arch.family != "llama":
        return f"the native backend covers Llama-style models; {arch.name} is {arch.family}: use --backend hf"
    return None


class CausalLM:
    """A model ready to run: ``module`` for training, and the three calls the loops need."""

    module: nn.Module

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T, V)."""
        return self.module(tokens) if isinstance(self.module, NativeCausalLM) else self.module(tokens).logits

    def prefill(self, tokens: torch.Tensor, max_len: int) -> torch.Tensor:
        """Start a generation: fill a fresh cache of ``max_len`` positions with the prompt (B, T);
        return the last position's logits (B, V)."""
        raise NotImplementedError

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """One step: tokens (B, 1) at the next position -> logits (B, V)."""
        raise NotImplementedError

    def enable_activation_checkpointing(self) -> None:
        """Recompute each layer's activations in the backward pass instead of keeping them."""
        raise NotImplementedError


class NativeLM(CausalLM):
    def __init__(self, module: NativeCausalLM, cache_dtype: torch.dtype):
        self.module = module
        self.cache_dtype = cache_dtype
        self.cache: KVCache | None = None
        self.position = 0

    def prefill(self, tokens: torch.Tensor, max_len: int) -> torch.Tensor:
        self.cache = None  # free the previous generation's cache before allocating the next
        self.cache = self.module.new_cache(tokens.shape[0], max_len, self.cache_dtype)
        self.position = tokens.shape[1]
        return self.module(tokens, cache=self.cache, start=0, last_only=True)[:, -1]

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.module(tokens, cache=self.cache, start=self.position)[:, -1]
        self.position += 1
        return logits

    def enable_activation_checkpointing(self) -> None:
        self.module.activation_checkpointing = True


class HuggingFaceLM(CausalLM):
    def __init__(self, module: nn.Module, static_cache: bool):
        self.module = module
        self.static_cache = static_cache
        self.cache = None
        self.position = 0

    def prefill(self, tokens: torch.Tensor, max_len: int) -> torch.Tensor:
        from transformers import DynamicCache, StaticCache

        self.cache = None
        self.cache = (StaticCache(config=self.module.config, max_cache_len=max_len) if self.static_cache
                      else DynamicCache(config=self.module.config))
        self.position = tokens.shape[1]
        out = self.module(tokens, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        position = torch.tensor([self.position], device=tokens.device)
        out = self.module(tokens, past_key_values=self.cache, use_cache=True, cache_position=position)
        self.position += 1
        return out.logits[:, -1]

    def enable_activation_checkpointing(self) -> None:
        self.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_model(arch: Architecture, backend: Backend, device: torch.device | str, dtype: torch.dtype,
               model_path: str | None = None, compute_dtype: torch.dtype | None = None) -> CausalLM:
    """Build ``arch`` with ``backend`` directly on ``device`` with weights in ``dtype``: random, or the
    checkpoint in ``model_path`` when that directory has one. ``compute_dtype`` is the activations'
    dtype when autocast makes it differ from the weights'; the KV cache holds it."""
    compute_dtype = compute_dtype or dtype
    if backend == "native":
        module = build_native(arch, device, dtype)
        if model_path is not None and has_weights(model_path):
            load_checkpoint(module, Path(model_path), device)
        return NativeLM(module, cache_dtype=compute_dtype)
    return HuggingFaceLM(build_hf(arch, device, dtype, weights_dir=model_path), static_cache=compute_dtype == dtype)


def load_checkpoint(module: nn.Module, directory: Path, device: torch.device | str) -> None:
    """Copy a transformers-layout checkpoint (safetensors or .bin shards) into the native model, shard by
    shard, each loaded straight to ``device``; every parameter must be found."""
    from safetensors.torch import load_file

    expected = set(module.state_dict())
    found: set[str] = set()
    for shard in sorted(directory.glob("*.safetensors")) or sorted(directory.glob("pytorch_model*.bin")):
        if shard.suffix == ".safetensors":
            state = load_file(str(shard), device=str(device))
        else:
            state = torch.load(shard, map_location=device, weights_only=True)
        state = {key: value for key, value in state.items() if key in expected}
        module.load_state_dict(state, strict=False, assign=False)
        found |= set(state)
    missing = expected - found
    if module.config.tie_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint in {directory} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


__all__ = ["BACKENDS", "Backend", "CausalLM", "backend_error", "default_backend", "hf_config", "load_model"]
