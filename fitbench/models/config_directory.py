"""A preset as a model directory an engine loads by path: its transformers ``config.json`` alone,
no weights and no tokenizer (vLLM loads it with ``--load-format dummy``: random weights of the
config's shapes). Written as JSON from ``Architecture.hf_config_dict``, without importing
transformers, so that the process that writes it needs no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from fitbench.models.architecture import Architecture

# transformers' model class of each model_type, which an engine reads from ``architectures``
# (transformers' models/auto/modeling_auto.py, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES).
CAUSAL_LM_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "falcon": "FalconForCausalLM", "gpt2": "GPT2LMHeadModel"}


def config_dict(arch: Architecture, dtype: str) -> dict:
    """The ``config.json`` of ``arch`` with weights of ``dtype`` (``bfloat16``)."""
    fields = {key: value for key, value in arch.hf_config_dict().items() if value is not None}
    return {"model_type": arch.hf_model_type, "architectures": [CAUSAL_LM_CLASSES[arch.hf_model_type]],
            "torch_dtype": dtype, **fields}


def write_config_directory(arch: Architecture, directory: Path, dtype: str) -> Path:
    """Write ``directory/config.json`` for ``arch`` and return ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_dict(arch, dtype), indent=2) + "\n")
    return directory
