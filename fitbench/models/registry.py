"""Name -> Architecture: exact lookup of presets, or a transformers config from a directory or hub id."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from fitbench.errors import UserError
from fitbench.models.architecture import Architecture
from fitbench.models.presets import PRESETS

_BY_NAME: dict[str, Architecture] = {arch.name: arch for arch in PRESETS}

# transformers model_type -> fitbench family, for configs read from a directory or the hub.
_LLAMA_LIKE = {"llama", "mistral", "qwen2"}


def preset_names() -> list[str]:
    return list(_BY_NAME)


def closest_names(name: str, limit: int = 3) -> list[str]:
    lowered = {n.lower(): n for n in _BY_NAME}
    matches = difflib.get_close_matches(name.lower(), list(lowered), n=limit, cutoff=0.5)
    return [lowered[m] for m in matches]


def is_local_model(name: str) -> bool:
    return (Path(name) / "config.json").is_file()


def resolve(name: str) -> Architecture:
    """A preset by its exact name, or the architecture of a local directory / hub id with a config.json."""
    if name in _BY_NAME:
        return _BY_NAME[name]
    if is_local_model(name):
        config = json.loads((Path(name) / "config.json").read_text())
        return architecture_from_hf_config(config, name=name, source=str(Path(name).resolve()))
    if "/" in name and not Path(name).exists():
        return architecture_from_hf_config(_hub_config(name), name=name, source=f"hub: {name}")
    suggestions = closest_names(name)
    hint = f" Did you mean {', '.join(suggestions)}?" if suggestions else ""
    raise UserError(
        f"models: unknown model {name!r}.{hint} `fitbench models` lists the presets; a local directory "
        f"with a config.json or a hub id (org/name) works too."
    )


def _hub_config(repo_id: str) -> dict[str, Any]:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(repo_id).to_dict()
    except (OSError, ValueError) as error:
        raise UserError(
            f"models: could not read the config of hub model {repo_id!r} ({error}). Check the id, or download "
            f"it and pass its local directory instead."
        ) from error


def architecture_from_hf_config(config: dict[str, Any], *, name: str, source: str) -> Architecture:
    """Map a transformers config of the llama, mistral, qwen2, falcon or gpt2 type to an Architecture."""
    model_type = config.get("model_type", "")
    tied = bool(config.get("tie_word_embeddings", model_type in ("falcon", "gpt2")))
    if model_type in _LLAMA_LIKE:
        heads = config["num_attention_heads"]
        return Architecture(
            name=name, family="llama", hf_model_type=model_type, vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"], num_layers=config["num_hidden_layers"], num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads, ffn_size=config["intermediate_size"],
            max_seq_len=config.get("max_position_embeddings", 2048), tie_embeddings=tied, source=source,
            qkv_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            rope_theta=float(_rope_value(config, "rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(config), norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        )
    if model_type == "falcon" and config.get("new_decoder_architecture"):
        hidden = config["hidden_size"]
        return Architecture(
            name=name, family="falcon", hf_model_type="falcon", vocab_size=config["vocab_size"], hidden_size=hidden,
            num_layers=config["num_hidden_layers"], num_heads=config["num_attention_heads"],
            num_kv_heads=config.get("num_kv_heads") or config["num_attention_heads"],
            ffn_size=config.get("ffn_hidden_size") or 4 * hidden, max_seq_len=config.get("max_position_embeddings", 2048),
            tie_embeddings=tied, source=source, norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        )
    if model_type == "gpt2":
        hidden = config["n_embd"]
        return Architecture(
            name=name, family="gpt2", hf_model_type="gpt2", vocab_size=config["vocab_size"], hidden_size=hidden,
            num_layers=config["n_layer"], num_heads=config["n_head"], num_kv_heads=config["n_head"],
            ffn_size=config.get("n_inner") or 4 * hidden, max_seq_len=config.get("n_positions", 1024),
            tie_embeddings=tied, source=source, norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        )
    raise UserError(
        f"models: {name!r} has model_type {model_type!r}; fitbench supports llama, mistral, qwen2, "
        f"falcon (new decoder architecture) and gpt2 configs."
    )


def _rope_scaling(config: dict[str, Any]) -> dict[str, Any] | None:
    """The rope scaling of a config: ``rope_scaling`` in older configs; in transformers 5, the
    ``rope_parameters`` whose ``rope_type`` is not ``default``."""
    if config.get("rope_scaling"):
        return config["rope_scaling"]
    parameters = config.get("rope_parameters") or {}
    if parameters.get("rope_type", parameters.get("type", "default")) == "default":
        return None
    return {key: value for key, value in parameters.items() if key != "rope_theta"}


def _rope_value(config: dict[str, Any], key: str, default: float) -> float:
    """transformers 5 moves rope_theta into rope_parameters; older configs keep it at the top level."""
    if key in config and config[key] is not None:
        return config[key]
    parameters = config.get("rope_parameters") or {}
    return parameters.get(key, default)
