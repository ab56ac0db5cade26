"""A decoder-only transformer described as plain data, with its exact parameter count and FLOPs.

Three families cover every registered model:

- ``llama``: pre-norm RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention,
  optional q/k/v biases (Qwen2), tied or untied embeddings. Llama, Mistral, Qwen2 and the
  CS336 models are all this family; fitbench's native decoder implements it.
- ``falcon``: Falcon's "new decoder architecture" (40B, 180B): parallel attention and MLP,
  two LayerNorms per layer, fused multi-query q/k/v, GELU MLP of 4x width, tied embeddings.
- ``gpt2``: learned positions, LayerNorm, fused q/k/v with biases, GELU MLP of 4x width,
  tied embeddings.

Counts are computed from the shapes alone; the tests check each one against the
instantiated model (on the meta device for the big ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Family = Literal["llama", "falcon", "gpt2"]


@dataclass(frozen=True)
class Architecture:
    name: str
    family: Family
    hf_model_type: str  # transformers' model_type: llama, mistral, qwen2, falcon, gpt2
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_size: int
    max_seq_len: int
    tie_embeddings: bool
    source: str  # where the numbers come from
    follows: str = ""  # the real model this one follows, if any
    qkv_bias: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    norm_eps: float = 1e-5
    extra_hf_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"{self.name}: hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    # ---- parameter counts ------------------------------------------------------------

    @property
    def attention_params_per_layer(self) -> int:
        """q and o are h x (heads * head_dim); k and v are h x (kv_heads * head_dim), plus biases."""
        h, q_width, kv_width = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        weights = h * q_width + 2 * h * kv_width + q_width * h
        if self.family == "gpt2":
            return weights + q_width + 2 * kv_width + h  # c_attn and c_proj biases
        return weights + (q_width + 2 * kv_width if self.qkv_bias else 0)

    @property
    def mlp_params_per_layer(self) -> int:
        """SwiGLU has three h x ffn matrices (gate, up, down); GELU MLPs have two, GPT-2 with biases."""
        h, f = self.hidden_size, self.ffn_size
        if self.family == "llama":
            return 3 * h * f
        if self.family == "gpt2":
            return 2 * h * f + f + h
        return 2 * h * f

    @property
    def norm_params_per_layer(self) -> int:
        """RMSNorm has a weight of h; LayerNorm a weight and a bias. Two norms per layer in every family."""
        per_norm = self.hidden_size if self.family == "llama" else 2 * self.hidden_size
        return 2 * per_norm

    @property
    def params_per_layer(self) -> int:
        return self.attention_params_per_layer + self.mlp_params_per_layer + self.norm_params_per_layer

    @property
    def embedding_params(self) -> int:
        """Token embedding table, plus GPT-2's learned position table."""
        positions = self.max_seq_len * self.hidden_size if self.family == "gpt2" else 0
        return self.vocab_size * self.hidden_size + positions

    @property
    def output_params(self) -> int:
        """The output projection (lm_head) as a separate matrix; zero when tied to the embedding."""
        return 0 if self.tie_embeddings else self.vocab_size * self.hidden_size

    @property
    def final_norm_params(self) -> int:
        return self.hidden_size if self.family == "llama" else 2 * self.hidden_size

    @property
    def total_params(self) -> int:
        return (
            self.embedding_params
            + self.num_layers * self.params_per_layer
            + self.final_norm_params
            + self.output_params
        )

    @property
    def non_embedding_params(self) -> int:
        """Total minus the token (and position) embedding tables, as torchtitan and nanoGPT count N.

        An untied output projection stays in: it is a matmul, not a lookup.
        """
        return self.total_params - self.embedding_params

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul for every token: the non-embedding parameters,
        plus the output projection when it is tied to the embedding (its matmul is real work)."""
        tied_output = self.vocab_size * self.hidden_size if self.tie_embeddings else 0
        return self.non_embedding_params + tied_output

    # ---- FLOPs -----------------------------------------------------------------------

    def forward_flops_per_token(self, context: int) -> float:
        """2 N + 4 L H Q T: every matmul parameter does one multiply-add per token, and attention
        does QK^T and AV over T positions (PaLM appendix B; no causal halving)."""
        return 2 * self.matmul_params + 4 * self.num_layers * self.num_heads * self.head_dim * context

    def prefill_flops(self, prompt_len: int) -> float:
        """One sequence's prefill of T = ``prompt_len`` tokens: T (2 (N - V h) + 4 L H Q T) + 2 V h.
        A forward pass over the prompt (``forward_flops_per_token``, PaLM's convention) but for the
        output projection (V h, in N tied or not), which runs for the last position only: its logits
        give the first token, and no other position's are computed."""
        output = 2 * self.vocab_size * self.hidden_size
        return prompt_len * (self.forward_flops_per_token(prompt_len) - output) + output

    def train_flops_per_token(self, context: int) -> float:
        """6 N + 12 L H Q T (PaLM appendix B): backward costs twice the forward."""
        return 3 * self.forward_flops_per_token(context)

    def adapter_train_flops_per_token(self, context: int, adapter_params: int) -> float:
        """4 N + 12 L H Q T + 6 A with a frozen base and A adapter parameters: the backward pass forms
        the activations' gradients (2 N) but no weight gradient (the other 2 N of 6 N); attention,
        which has no weights, costs as in full training, and the adapters train fully."""
        return self.train_flops_per_token(context) - 2 * self.matmul_params + 6 * adapter_params

    # ---- sizes -----------------------------------------------------------------------

    def kv_cache_bytes_per_token(self, bytes_per_element: float) -> float:
        """2 (k and v) x layers x kv_heads x head_dim x bytes: the cache one sequence adds per token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    # ---- transformers ----------------------------------------------------------------

    def hf_config_dict(self) -> dict[str, Any]:
        """The keyword arguments of the transformers config for this architecture."""
        common: dict[str, Any] = {"vocab_size": self.vocab_size, "tie_word_embeddings": self.tie_embeddings}
        if self.family == "llama":
            config = {
                **common,
                "hidden_size": self.hidden_size,
                "intermediate_size": self.ffn_size,
                "num_hidden_layers": self.num_layers,
                "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads,
                "max_position_embeddings": self.max_seq_len,
                "rms_norm_eps": self.norm_eps,
                "rope_theta": self.rope_theta,
                # a copy: transformers writes into the dict it is given, and presets share theirs
                "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            }
            if self.hf_model_type == "llama":
                config["attention_bias"] = self.qkv_bias
        elif self.family == "falcon":
            config = {
                **common,
                "hidden_size": self.hidden_size,
                "ffn_hidden_size": self.ffn_size,
                "num_hidden_layers": self.num_layers,
                "num_attention_heads": self.num_heads,
                "num_kv_heads": self.num_kv_heads,
                "new_decoder_architecture": True,
                "parallel_attn": True,
                "bias": False,
                "alibi": False,
                "max_position_embeddings": self.max_seq_len,
                "layer_norm_epsilon": self.norm_eps,
                "rope_theta": self.rope_theta,
            }
        else:
            config = {
                **common,
                "n_embd": self.hidden_size,
                "n_inner": self.ffn_size,
                "n_layer": self.num_layers,
                "n_head": self.num_heads,
                "n_positions": self.max_seq_len,
                "layer_norm_epsilon": self.norm_eps,
            }
        return {**config, **self.extra_hf_config}

    def summary(self) -> dict[str, Any]:
        """The fields `fitbench models` lists."""
        return {
            "name": self.name,
            "family": self.family,
            "total_params": self.total_params,
            "non_embedding_params": self.non_embedding_params,
            "layers": self.num_layers,
            "hidden": self.hidden_size,
            "heads": self.num_heads,
            "kv_heads": self.num_kv_heads,
            "ffn": self.ffn_size,
            "vocab": self.vocab_size,
            "max_context": self.max_seq_len,
            "tied": self.tie_embeddings,
            "follows": self.follows,
            "source": self.source,
        }
