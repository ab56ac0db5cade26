"""transformers' Falcon and GPT-2 checkpoints under the native decoder's names.

The native decoder names its tensors as transformers' ``LlamaForCausalLM`` does (``model.layers.0.self_attn.q_proj
.weight`` ...), whatever the family; a Falcon or GPT-2 checkpoint names and lays out the same maps otherwise:

- Falcon (``FalconForCausalLM``): ``transformer.h.{i}.self_attention.query_key_value`` holds q, k and v fused.
  With grouped key/value heads (new decoder architecture, and Falcon-7B's multi-query, one group), its rows
  are KV groups of (G query heads, the key head, the value head), G = H / KV, D rows each; without
  (``multi_query`` off), H groups of (query, key, value). Query head g of group j is head j G + g, which
  attends with key/value head j, as the native attention pairs head h with h // G; so q is every group's
  query rows in order, k the key rows, v the value rows. ``dense`` is ``o_proj``, ``dense_h_to_4h`` and
  ``dense_4h_to_h`` the MLP's ``up_proj`` and ``down_proj``, ``ln_attn`` (or ``input_layernorm``) and
  ``ln_mlp`` the layer's ``input_layernorm`` and ``post_attention_layernorm``.
- GPT-2 (``GPT2LMHeadModel``): ``Conv1D`` stores W transposed (in x out, y = x W + b), so every matrix is
  transposed; ``c_attn`` holds q, k and v side by side, h columns each; ``wte``, ``wpe``, ``ln_1``,
  ``ln_2``, ``ln_f`` are the token and position tables and the norms. The attention's causal mask buffers
  (``attn.bias``, ``attn.masked_bias``), which older checkpoints carry, hold no weights.
- Llama: the native names; the rotary frequencies some older checkpoints carry in each layer
  (``self_attn.rotary_emb.inv_freq``) hold no weights (the native model computes its own) and are left out.

Source: transformers' models/falcon/modeling_falcon.py (``FalconAttention.forward``) and
models/gpt2/modeling_gpt2.py (``GPT2Attention``, ``Conv1D``).
"""

from __future__ import annotations

import re
from typing import Any

import torch

_FALCON = {"self_attention.dense": "self_attn.o_proj", "mlp.dense_h_to_4h": "mlp.up_proj",
           "mlp.dense_4h_to_h": "mlp.down_proj", "ln_attn": "input_layernorm", "input_layernorm": "input_layernorm",
           "ln_mlp": "post_attention_layernorm"}
_GPT2 = {"attn.c_proj": "self_attn.o_proj", "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj",
         "ln_1": "input_layernorm", "ln_2": "post_attention_layernorm"}
_TOP = {"word_embeddings": "model.embed_tokens", "wte": "model.embed_tokens", "wpe": "model.embed_positions",
        "ln_f": "model.norm"}
_LAYER = re.compile(r"(?:transformer\.)?h\.(\d+)\.(.+)\.(weight|bias)")
_OUTSIDE = re.compile(r"(?:transformer\.)?(\w+)\.(weight|bias)")
# a decoder layer's tensor in any of the three layouts: Llama's model.layers.{i}., Falcon's and GPT-2's
# transformer.h.{i}. (h.{i}. in a checkpoint of GPT-2's base model)
_LAYER_INDEX = re.compile(r"(?:model\.layers|(?:transformer\.)?h)\.(\d+)\..+")


def unplaced_problem(directory, unplaced: set[str], where: str = "its decoder layers") -> str:
    """Why a checkpoint whose decoder layers (``where``: which) hold the tensors ``unplaced``, which the
    native model of its config.json has no place for, is refused: built without them, it would be another
    model."""
    return (f"the checkpoint in {directory} holds {len(unplaced)} tensors of {where} that the native "
            f"model of its config.json has no place for, e.g. {sorted(unplaced)[:3]} (a Falcon config with bias "
            f"true: fitbench's Falcon has no biases in its matmuls); run it with --backend hf, which builds the "
            f"model of its config.json")


def native_state(hf_config: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state``, tensors of a checkpoint whose ``config.json`` is ``hf_config``, under the native names,
    as views; a llama-type checkpoint's unchanged but for its rotary frequencies."""
    model_type = hf_config.get("model_type")
    if model_type not in ("falcon", "gpt2"):
        return {key: tensor for key, tensor in state.items() if not key.endswith("rotary_emb.inv_freq")}
    renamed = _FALCON if model_type == "falcon" else _GPT2
    native: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        layer = _LAYER.fullmatch(key)
        outside = _OUTSIDE.fullmatch(key)
        if key == "lm_head.weight":
            native[key] = tensor
        elif layer is None and outside is not None and outside[1] in _TOP:
            native[f"{_TOP[outside[1]]}.{outside[2]}"] = tensor
        elif layer is not None:
            index, module, kind = layer.groups()
            prefix = f"model.layers.{index}"
            if module in renamed:
                native[f"{prefix}.{renamed[module]}.{kind}"] = tensor.T if model_type == "gpt2" and kind == "weight" \
                    and tensor.dim() == 2 else tensor
            elif module in ("self_attention.query_key_value", "attn.c_attn"):
                parts = _falcon_qkv(hf_config, tensor) if model_type == "falcon" else _gpt2_qkv(tensor, kind)
                native |= {f"{prefix}.self_attn.{name}.{kind}": part for name, part in zip(("q_proj", "k_proj", "v_proj"),
                                                                                           parts)}
    return native


def layer_of(key: str) -> int | None:
    """The index of the decoder layer whose tensor a checkpoint names ``key``, or None outside the layers."""
    found = _LAYER_INDEX.fullmatch(key)
    return int(found[1]) if found else None


def _falcon_qkv(hf_config: dict[str, Any], fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Falcon's fused q/k/v rows (weight or bias) -> q, k, v (module docstring)."""
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config["hidden_size"] // heads
    rest = fused.shape[1:]
    if hf_config.get("new_decoder_architecture", False) or hf_config.get("multi_query", True):
        kv_heads = (hf_config.get("num_kv_heads") or heads) if hf_config.get("new_decoder_architecture", False) else 1
        groups = fused.view(kv_heads, heads // kv_heads + 2, head_dim, *rest)
        query, key, value = groups[:, :-2], groups[:, -2], groups[:, -1]
    else:
        query, key, value = fused.view(heads, 3, head_dim, *rest).unbind(1)
    return tuple(part.reshape(-1, *rest) for part in (query, key, value))


def _gpt2_qkv(fused: torch.Tensor, kind: str) -> tuple[torch.Tensor, ...]:
    """GPT-2's ``c_attn`` weight (h x 3 h, transposed) or bias (3 h) -> q, k, v."""
    rows = fused.T if kind == "weight" else fused
    return tuple(rows.chunk(3, dim=0))
