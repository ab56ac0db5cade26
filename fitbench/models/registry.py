"""Name -> Architecture: exact lookup of presets, or a transformers config from a directory or hub id."""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any

from fitbench.models.architecture import Architecture
from fitbench.models.presets import PRESETS
from fitbench.util.errors import UserError, excerpt
from fitbench.util.jsonfile import read_json

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
    try:
        return (Path(name) / "config.json").is_file()
    except OSError:  # a name too long to be a path
        return False


# A config.json is a few kilobytes; anything near this is not one.
CONFIG_MAX_BYTES = 16_000_000
# Beyond these a field is a typo, not a model (the largest published models are far below): every count
# of the planner stays a finite number.
SIZE_LIMITS = {"hidden": 1 << 20, "ffn": 1 << 22, "vocab": 1 << 24, "layers": 1 << 14, "heads": 1 << 16,
               "context": 1 << 30}


def _read_config(directory: str) -> dict[str, Any]:
    """The JSON object in ``directory``/config.json, or a UserError saying what is wrong with the file."""
    path = Path(directory) / "config.json"
    fix = "Fix the file (a transformers config.json), or pass a preset (`fitbench models`)."
    config = read_json(path, limit=CONFIG_MAX_BYTES, field="models", fix=fix)
    if not isinstance(config, dict):
        raise UserError(f"models: {path} holds a JSON {type(config).__name__}, not an object of fields "
                        f"(hidden_size, num_attention_heads, ...). {fix}")
    return config


class _Fields:
    """Typed reads of a transformers config that collect every problem, so one message lists them all."""

    def __init__(self, config: dict[str, Any]):
        self.config, self.problems = config, []

    def size(self, key: str, limit: str, default: Any = ...) -> int:
        """A whole number from 1 to ``SIZE_LIMITS[limit]``; ``default`` when the key is missing or null."""
        value = self.config.get(key)
        if value is None:
            if default is not ...:
                return default
            self.problems.append(f"`{key}` is missing (a whole number above zero)")
            return 1
        maximum = SIZE_LIMITS[limit]
        if isinstance(value, bool) or not isinstance(value, int):
            kind = "text" if isinstance(value, str) else type(value).__name__
            self.problems.append(f"`{key}` is {excerpt(value)} ({kind}); it must be a whole number above zero")
        elif not 0 < value <= maximum:
            self.problems.append(f"`{key}` is {excerpt(value)}; it must be a whole number from 1 to {maximum:,}")
        else:
            return value
        return 1

    def number(self, key: str, default: float, below: float = math.inf) -> float:
        """A finite number above zero (and below ``below``): rope_theta, the norms' epsilon."""
        value = self.config.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            kind = "text" if isinstance(value, str) else type(value).__name__
            self.problems.append(f"`{key}` is {excerpt(value)} ({kind}); it must be a number above zero")
        elif not (math.isfinite(value) and 0 < value < below):
            bound = f" and below {below:g}" if below != math.inf else ""
            self.problems.append(f"`{key}` is {excerpt(value)}; it must be a finite number above zero{bound}")
        else:
            return float(value)
        return default

    def flag(self, key: str, default: bool) -> bool:
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.problems.append(f"`{key}` is {excerpt(value)}; it must be true or false")
            return default
        return value

    def mapping(self, key: str) -> None:
        value = self.config.get(key)
        if value is not None and not isinstance(value, dict):
            self.problems.append(f"`{key}` is {excerpt(value)}; it must be an object or null")


def resolve(name: str) -> Architecture:
    """A preset by its exact name, or the architecture of a local directory / hub id with a config.json."""
    if name in _BY_NAME:
        return _BY_NAME[name]
    if is_local_model(name):
        return architecture_from_hf_config(_read_config(name), name=name, source=str(Path(name).resolve()),
                                           where=str(Path(name) / "config.json"))
    try:
        exists = Path(name).exists()
    except OSError:
        exists = False
    if not exists and name.startswith(("/", "./", "../", "~")):
        raise UserError(f"models: the directory {excerpt(name)} does not exist; a local model is a directory with a "
                        f"transformers config.json. Check the path, or pass a preset (`fitbench models`).")
    if exists and Path(name).is_dir():
        raise UserError(f"models: the directory {excerpt(name)} has no config.json; a local model is a directory "
                        f"with a transformers config.json, or pass a preset (`fitbench models`).")
    if "/" in name and not exists:
        return architecture_from_hf_config(_hub_config(name), name=name, source=f"hub: {name}",
                                           where=f"the config of hub model {excerpt(name)}")
    suggestions = closest_names(name)
    hint = f" Did you mean {', '.join(suggestions)}?" if suggestions else ""
    raise UserError(
        f"models: unknown model {excerpt(name)}.{hint} `fitbench models` lists the presets; a local directory "
        f"with a config.json or a hub id (org/name) works too."
    )


def _hub_config(repo_id: str) -> dict[str, Any]:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(repo_id).to_dict()
    except (OSError, ValueError) as error:
        raise UserError(
            f"models: could not read the config of hub model {excerpt(repo_id)} ({excerpt(str(error), 200)}). "
            f"Check the id, or download "
            f"it and pass its local directory instead."
        ) from error


# A thousand times the largest published model: beyond it a config is a typo.
PARAMS_MAX = 1e15


def architecture_from_hf_config(config: dict[str, Any], *, name: str, source: str,
                                where: str = "config.json") -> Architecture:
    """Map a transformers config of the llama, mistral, qwen2, falcon or gpt2 type to an Architecture.
    Every field is checked first; a UserError names each bad one (``where``: the file, for messages)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        model_type = None if model_type is None else excerpt(model_type)
    fields = _Fields(config)
    if model_type in _LLAMA_LIKE:
        heads = fields.size("num_attention_heads", "heads")
        shape = dict(
            family="llama", hf_model_type=model_type, vocab_size=fields.size("vocab_size", "vocab"),
            hidden_size=fields.size("hidden_size", "hidden"), num_layers=fields.size("num_hidden_layers", "layers"),
            num_heads=heads, num_kv_heads=fields.size("num_key_value_heads", "heads", default=heads),
            ffn_size=fields.size("intermediate_size", "ffn"),
            max_seq_len=fields.size("max_position_embeddings", "context", default=2048),
            tie_embeddings=fields.flag("tie_word_embeddings", False),
            qkv_bias=fields.flag("attention_bias", model_type == "qwen2"),
            norm_eps=fields.number("rms_norm_eps", 1e-6, below=1.0),
        )
        fields.mapping("rope_scaling")
        fields.mapping("rope_parameters")
        if not fields.problems:
            theta = _rope_value(config, "rope_theta", 10000.0)
            fields.config = {**config, "rope_theta": theta}
            shape.update(rope_theta=fields.number("rope_theta", 10000.0), rope_scaling=_rope_scaling(config))
            _check_rope_scaling(fields, shape["rope_scaling"])
    elif model_type == "falcon" and fields.flag("new_decoder_architecture", False):
        hidden, heads = fields.size("hidden_size", "hidden"), fields.size("num_attention_heads", "heads")
        shape = dict(
            family="falcon", hf_model_type="falcon", vocab_size=fields.size("vocab_size", "vocab"), hidden_size=hidden,
            num_layers=fields.size("num_hidden_layers", "layers"), num_heads=heads,
            num_kv_heads=fields.size("num_kv_heads", "heads", default=heads),
            ffn_size=fields.size("ffn_hidden_size", "ffn", default=4 * hidden),
            max_seq_len=fields.size("max_position_embeddings", "context", default=2048),
            tie_embeddings=fields.flag("tie_word_embeddings", True),
            norm_eps=fields.number("layer_norm_epsilon", 1e-5, below=1.0),
        )
    elif model_type == "gpt2":
        hidden, heads = fields.size("n_embd", "hidden"), fields.size("n_head", "heads")
        shape = dict(
            family="gpt2", hf_model_type="gpt2", vocab_size=fields.size("vocab_size", "vocab"), hidden_size=hidden,
            num_layers=fields.size("n_layer", "layers"), num_heads=heads, num_kv_heads=heads,
            ffn_size=fields.size("n_inner", "ffn", default=4 * hidden),
            max_seq_len=fields.size("n_positions", "context", default=1024),
            tie_embeddings=fields.flag("tie_word_embeddings", True),
            norm_eps=fields.number("layer_norm_epsilon", 1e-5, below=1.0),
        )
    else:
        found = "no model_type" if model_type is None else f"model_type {excerpt(model_type)}"
        found += f" ({'; '.join(fields.problems)})" if fields.problems else ""
        raise UserError(
            f"models: {where} has {found}; fitbench supports llama, mistral, qwen2, falcon (new decoder "
            f"architecture) and gpt2 configs. Fix `model_type` in the file, or pass a preset (`fitbench models`)."
        )
    names = _FIELD_NAMES[shape["family"]]
    if not fields.problems:
        hidden, heads, kv_heads = shape["hidden_size"], shape["num_heads"], shape["num_kv_heads"]
        if hidden % heads:
            fields.problems.append(f"`{names['hidden']}` {hidden} is not divisible by `{names['heads']}` {heads} "
                                   f"(each head gets hidden/heads features)")
        elif shape["family"] == "llama" and (hidden // heads) % 2:
            fields.problems.append(f"`{names['hidden']}` {hidden} / `{names['heads']}` {heads} gives heads of "
                                   f"{hidden // heads} features; rotary positions need an even number")
        if heads % kv_heads:
            fields.problems.append(f"`{names['kv_heads']}` {kv_heads} does not divide `{names['heads']}` {heads} "
                                   f"(each key/value head serves a whole group of query heads)")
    if not fields.problems:
        arch = Architecture(name=name, source=source, **shape)
        if arch.total_params > PARAMS_MAX:
            fields.problems.append(f"these sizes make {arch.total_params:.3g} parameters, more than {PARAMS_MAX:.0e}")
        else:
            return arch
    raise UserError(f"models: {where}: {'; '.join(fields.problems)}. Fix the file, or pass a preset "
                    f"(`fitbench models`).")


# The config keys of each family's sizes, for messages.
_FIELD_NAMES = {
    "llama": {"hidden": "hidden_size", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads"},
    "falcon": {"hidden": "hidden_size", "heads": "num_attention_heads", "kv_heads": "num_kv_heads"},
    "gpt2": {"hidden": "n_embd", "heads": "n_head", "kv_heads": "n_head"},
}


def _rope_scaling(config: dict[str, Any]) -> dict[str, Any] | None:
    """The rope scaling of a config: ``rope_scaling`` in older configs; in transformers 5, the
    ``rope_parameters`` whose ``rope_type`` is not ``default``."""
    if config.get("rope_scaling"):
        return config["rope_scaling"]
    parameters = config.get("rope_parameters") or {}
    if parameters.get("rope_type", parameters.get("type", "default")) == "default":
        return None
    return {key: value for key, value in parameters.items() if key != "rope_theta"}


# The fields Llama 3.1's frequency scaling reads (fitbench.models.native.rope_inverse_frequencies).
_LLAMA3_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _check_rope_scaling(fields: _Fields, scaling: dict[str, Any] | None) -> None:
    """The scaling's numbers are finite and above zero; llama3 scaling has every field it divides by."""
    if not scaling:
        return
    kind = scaling.get("rope_type", scaling.get("type"))
    scaled = _Fields(scaling)
    if kind == "llama3":
        for key in _LLAMA3_SCALING:
            if scaling.get(key) is None:
                scaled.problems.append(f"`{key}` is missing (llama3 scaling needs {', '.join(_LLAMA3_SCALING)})")
            else:
                scaled.number(key, 1.0)
        if not scaled.problems and scaling["low_freq_factor"] == scaling["high_freq_factor"]:
            scaled.problems.append("`low_freq_factor` equals `high_freq_factor` (the band between them is divided by "
                                   "their difference)")
    elif "factor" in scaling:
        scaled.number("factor", 1.0)
    fields.problems.extend(f"`rope_scaling`: {problem}" for problem in scaled.problems)


def _rope_value(config: dict[str, Any], key: str, default: float) -> float:
    """transformers 5 moves rope_theta into rope_parameters; older configs keep it at the top level."""
    if key in config and config[key] is not None:
        return config[key]
    parameters = config.get("rope_parameters") or {}
    return parameters.get(key, default)
