"""A decoder-only transformer described as plain data, with its exact parameter count and FLOPs.

Three families cover every registered model:

- ``llama``: pre-norm RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention,
  optional q/k/v biases (Qwen2), tied or untied embeddings. Llama, Mistral, Qwen2 and the
  CS336 models are all this family.
- ``falcon``: Falcon's "new decoder architecture" (40B, 180B): parallel attention and MLP,
  two LayerNorms per layer, fused multi-query q/k/v, GELU MLP of 4x width, tied embeddings.
- ``gpt2``: learned positions, LayerNorm, fused q/k/v with biases, GELU MLP of 4x width,
  tied embeddings.

Each family says what one layer holds (``layer_matrices``, ``layer_norms``) and how positions
enter (``position_embeddings``); every count, and fitbench's memory and speed models, derive from
that description. Counts are computed from the shapes alone; the tests check each matrix, norm and
count against the instantiated model (on the meta device for the big ones): the native decoder for
``llama``, transformers' ``FalconForCausalLM`` and ``GPT2LMHeadModel`` for the others. The native
decoder builds every family (``fitbench.models.native.DecoderConfig.from_architecture``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Family = Literal["llama", "falcon", "gpt2"]


@dataclass(frozen=True)
class Matrix:
    """One weight matrix of a layer: the module at ``name`` (its path inside a layer) computes
    ``x W^T (+ b)`` with W of ``rows`` (out features) x ``columns`` (in features), and a bias of
    ``rows`` when ``bias``. GPT-2's ``Conv1D`` stores W transposed; the shape here is the same map."""

    name: str
    rows: int
    columns: int
    bias: bool = False

    @property
    def weights(self) -> int:
        return self.rows * self.columns

    @property
    def params(self) -> int:
        return self.weights + (self.rows if self.bias else 0)


@dataclass(frozen=True)
class Norm:
    """One norm of ``size`` features: RMSNorm has a weight; LayerNorm (``bias``) a weight and a bias."""

    name: str
    size: int
    bias: bool

    @property
    def params(self) -> int:
        return self.size * (2 if self.bias else 1)


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

    # ---- what one layer holds ----------------------------------------------------------

    @property
    def layer_matrices(self) -> tuple[Matrix, ...]:
        """Each layer's weight matrices, named as the modules that hold them.

        - llama (native decoder; transformers' Llama, Mistral, Qwen2 alike): q (H D x h), k and v
          (KV D x h each, with biases for Qwen2), o (h x H D), SwiGLU gate and up (f x h) and down (h x f);
        - falcon (``FalconDecoderLayer``, new decoder architecture, ``bias=False``): the fused
          ``query_key_value`` ((H + 2 KV) D x h), ``dense`` (h x H D), ``dense_h_to_4h`` (f x h),
          ``dense_4h_to_h`` (h x f);
        - gpt2 (``GPT2Block``, ``Conv1D`` modules): the fused ``c_attn`` (3 h x h), ``c_proj`` (h x h),
          ``c_fc`` (f x h), the MLP's ``c_proj`` (h x f), all with biases.
        """
        h, f = self.hidden_size, self.ffn_size
        q, k = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.family == "llama":
            return (Matrix("self_attn.q_proj", q, h, self.qkv_bias), Matrix("self_attn.k_proj", k, h, self.qkv_bias),
                    Matrix("self_attn.v_proj", k, h, self.qkv_bias), Matrix("self_attn.o_proj", h, q),
                    Matrix("mlp.gate_proj", f, h), Matrix("mlp.up_proj", f, h), Matrix("mlp.down_proj", h, f))
        if self.family == "falcon":
            return (Matrix("self_attention.query_key_value", q + 2 * k, h), Matrix("self_attention.dense", h, q),
                    Matrix("mlp.dense_h_to_4h", f, h), Matrix("mlp.dense_4h_to_h", h, f))
        return (Matrix("attn.c_attn", q + 2 * k, h, True), Matrix("attn.c_proj", h, q, True),
                Matrix("mlp.c_fc", f, h, True), Matrix("mlp.c_proj", h, f, True))

    @property
    def layer_norms(self) -> tuple[Norm, ...]:
        """Two norms per layer: RMSNorm (llama) before attention and before the MLP; Falcon's
        LayerNorms ``ln_attn`` and ``ln_mlp``, both reading the layer's input (parallel attention and
        MLP); GPT-2's LayerNorms ``ln_1`` and ``ln_2``."""
        h = self.hidden_size
        names = {"llama": ("input_layernorm", "post_attention_layernorm"), "falcon": ("ln_attn", "ln_mlp"),
                 "gpt2": ("ln_1", "ln_2")}[self.family]
        return tuple(Norm(name, h, self.layer_norm) for name in names)

    @property
    def layer_norm(self) -> bool:
        """LayerNorm (weight and bias) rather than RMSNorm (weight only)."""
        return self.family != "llama"

    @property
    def parallel_attention(self) -> bool:
        """Attention and MLP read the same input and their outputs add to the residual together (Falcon)."""
        return self.family == "falcon"

    @property
    def position_embeddings(self) -> Literal["rotary", "learned"]:
        """Rotary (llama, falcon) or a learned table of ``max_seq_len`` x h added to the tokens' (gpt2)."""
        return "learned" if self.family == "gpt2" else "rotary"

    # ---- parameter counts ------------------------------------------------------------

    @property
    def attention_params_per_layer(self) -> int:
        """The attention matrices of ``layer_matrices`` with their biases."""
        return sum(m.params for m in self.layer_matrices if not m.name.startswith("mlp."))

    @property
    def mlp_params_per_layer(self) -> int:
        """The MLP matrices of ``layer_matrices`` with their biases."""
        return sum(m.params for m in self.layer_matrices if m.name.startswith("mlp."))

    @property
    def layer_matmul_weights(self) -> int:
        """The weights of one layer's matrices, without biases: what a matmul multiplies by."""
        return sum(m.weights for m in self.layer_matrices)

    @property
    def norm_params_per_layer(self) -> int:
        return sum(norm.params for norm in self.layer_norms)

    @property
    def params_per_layer(self) -> int:
        return self.attention_params_per_layer + self.mlp_params_per_layer + self.norm_params_per_layer

    @property
    def embedding_params(self) -> int:
        """Token embedding table, plus the learned position table where there is one."""
        return self.vocab_size * self.hidden_size + self.position_params

    @property
    def position_params(self) -> int:
        """The learned position table (max_seq_len x h), zero with rotary positions."""
        return self.max_seq_len * self.hidden_size if self.position_embeddings == "learned" else 0

    @property
    def output_params(self) -> int:
        """The output projection (lm_head) as a separate matrix; zero when tied to the embedding."""
        return 0 if self.tie_embeddings else self.vocab_size * self.hidden_size

    @property
    def final_norm_params(self) -> int:
        return Norm("norm", self.hidden_size, self.layer_norm).params

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
                # No dropout, as in the other families (Llama's and Falcon's configs have none):
                # fitbench measures the architecture's compute and memory, and GPT-2's 0.1 would add
                # a mask per dropout and move attention off the fused kernels that take no dropout.
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
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


Backend = Literal["native", "hf", "vllm"]
BACKENDS: tuple[str, ...] = ("native", "hf", "vllm")


def default_backend(arch: Architecture) -> Backend:
    """fitbench's own decoder for Llama-style models, transformers for Falcon and GPT-2, which the
    native decoder runs too (``--backend native``) but whose committed rows and calibration are
    transformers' (docs/architecture.md, "The two engines")."""
    return "native" if arch.family == "llama" else "hf"


def backend_error(arch: Architecture, backend: str) -> str | None:
    """Why ``backend`` cannot run ``arch``, or None when it can: both run every family."""
    return None
