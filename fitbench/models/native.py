"""fitbench's own decoder (Llama, and Falcon's and GPT-2's blocks as variants), readable top to bottom.

RMSNorm, rotary positions (Llama 3.1 frequency scaling included), SwiGLU MLP, grouped-query
attention through ``F.scaled_dot_product_attention``, tied or untied embeddings, optional q/k/v
biases (Qwen2), and a preallocated KV cache for decoding. The same blocks take Falcon's and GPT-2's
variants as data (``DecoderConfig``: LayerNorm, parallel attention and MLP, learned positions, GELU
MLP, biases; ``DecoderConfig.from_hf_config``), each one ``if`` where its concern is, so that a
Llama builds and runs what it did; their checkpoints load under the native names
(``fitbench.models.checkpoint_names``).

Two ways to decode one token: ``forward`` with ``start``, a Python int, attends over the cache's
first ``start + 1`` positions; ``decode_step`` takes the position as a device tensor and attends
over the whole cache under a mask, so every shape is fixed and nothing depends on host values
that change per token: the step a CUDA graph can capture once and replay (``fitbench.models.graphs``).
Both run each layer and the head through ``Regions``: the plain calls, or one compiled function per
part that serves every layer (``fitbench.models.backends.compile_regions``), for which a layer gets
its own keys and values as arguments.

Modules carry the same names as transformers' ``LlamaForCausalLM`` (``model.layers.0.self_attn.q_proj``
...), and rotary embeddings use the same half-split convention, so a checkpoint of either loads into
the other unchanged. Built ``fused``, a layer holds q, k and v as one ``qkv_proj`` and gate and up as
one ``gate_up_proj`` (``FusedLinear``): one matmul reads the input once and launches one kernel where
three or two did, which is what a decode step at batch 1 and a short training step both pay for. The
fused weights are the unfused ones stacked by rows, drawn part by part in the unfused order, so a
fused model holds the weights of the unfused one of the same seed, and a transformers checkpoint loads
into each part (``checkpoint_tensors``). Tensor-parallel training, pipeline stages and quantized builds
keep the unfused layout: their plans and quantizers name q, k, v, gate and up (a tensor-parallel
generation stacks its local shards after the build: ``fitbench.worker.tensor_parallel``).

In eager training (autograd recording, no ``torch.compile``) RMSNorm, the rotary positions and
SwiGLU run as the autograd Functions of ``fitbench.models.layer_ops``, which save less and launch
fewer kernels than the tensor expressions here, and the fused gate/up projection lays its two
outputs one after the other (``stacked_linear``). Without autograd, and under ``torch.compile``,
which fuses the expressions itself, the modules run the expressions.

The model is built on the meta device and materialized where it will run (``materialize``), so
no full copy of the weights ever sits in host memory on the way to a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fitbench.models.architecture import Architecture
from fitbench.models.layer_ops import eager_training, output_dtype, rms_norm, rotary, stacked_linear, swiglu


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    tie_embeddings: bool
    qkv_bias: bool
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    norm_eps: float
    # The variants beyond Llama's block, each one concern (defaults: Llama's). ``norm``: "rms", or
    # "layer" (LayerNorm, weight and bias). ``parallel_attention``: attention and MLP read the same
    # input and add to the residual together (Falcon); ``shared_norm``: that input through one norm,
    # ``input_layernorm`` (Falcon-7B), else through two. ``positions``: "rotary", or "learned" (a
    # table added to the token embeddings, GPT-2). ``mlp``: "swiglu", or "gelu" / "gelu_tanh" (one
    # up projection, the exact or tanh-approximated GELU, one down). ``linear_bias``: biases on the
    # attention's output projection and the MLP's matrices.
    norm: str = "rms"
    parallel_attention: bool = False
    shared_norm: bool = False
    positions: str = "rotary"
    mlp: str = "swiglu"
    linear_bias: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_architecture(cls, arch: Architecture) -> DecoderConfig:
        """The decoder of ``arch``. A Falcon or GPT-2 architecture is read through its transformers config
        (``Architecture.hf_config_dict``) by ``from_hf_config``: one mapping from a family's fields to
        the block's variants, so that a preset and the config.json it follows cannot build apart."""
        if arch.family != "llama":
            return cls.from_hf_config({"model_type": arch.hf_model_type, **arch.hf_config_dict()})
        return cls(
            vocab_size=arch.vocab_size, dim=arch.hidden_size, n_layers=arch.num_layers, n_heads=arch.num_heads,
            n_kv_heads=arch.num_kv_heads, ffn_dim=arch.ffn_size, max_seq_len=arch.max_seq_len,
            tie_embeddings=arch.tie_embeddings, qkv_bias=arch.qkv_bias, rope_theta=arch.rope_theta,
            rope_scaling=arch.rope_scaling, norm_eps=arch.norm_eps,
        )

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> DecoderConfig:
        """The decoder of a transformers ``config.json`` (a dict) of the falcon or gpt2 type, as
        ``FalconForCausalLM`` and ``GPT2LMHeadModel`` build it: Falcon's parallel block with two
        LayerNorms (new decoder architecture, 40B and 180B) or one (Falcon-7B, multi-query: one key/value
        head), rotary positions, GELU MLP, ``bias`` on every matrix; GPT-2's learned positions, LayerNorms,
        tanh-GELU MLP and biases everywhere. Falcon's ALiBi and sequential variants are refused."""
        model_type = config.get("model_type")
        if model_type == "falcon":
            if config.get("activation", "gelu") != "gelu":
                raise ValueError(f"the native decoder's Falcon MLP is GELU's; this config asks for {config['activation']}")
            if config.get("alibi", False) or not config.get("parallel_attn", True):
                raise ValueError("the native decoder covers Falcon's rotary, parallel-attention blocks; this config "
                                 "asks for ALiBi or sequential attention")
            new_architecture = config.get("new_decoder_architecture", False)
            heads = config["num_attention_heads"]
            # transformers' FalconAttention: multi-query (Falcon-7B) keeps one key/value head
            kv_heads = config.get("num_kv_heads") or heads
            if not new_architecture:
                kv_heads = 1 if config.get("multi_query", True) else heads
            rope = config.get("rope_parameters") or {}
            return cls(
                vocab_size=config["vocab_size"], dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
                n_heads=heads, n_kv_heads=kv_heads,
                ffn_dim=config.get("ffn_hidden_size") or 4 * config["hidden_size"],
                max_seq_len=config.get("max_position_embeddings", 2048),
                tie_embeddings=config.get("tie_word_embeddings", True), qkv_bias=config.get("bias", False),
                rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)), rope_scaling=None,
                norm_eps=config.get("layer_norm_epsilon", 1e-5), norm="layer", parallel_attention=True,
                shared_norm=not new_architecture or config.get("num_ln_in_parallel_attn") == 1,
                mlp="gelu", linear_bias=config.get("bias", False),
            )
        if model_type == "gpt2":
            if config.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh") \
                    or config.get("scale_attn_by_inverse_layer_idx") or config.get("reorder_and_upcast_attn"):
                raise ValueError("the native decoder's GPT-2 block is tanh-GELU with attention scaled by "
                                 "1/sqrt(head_dim); this config asks for another activation or scaling")
            dim = config["n_embd"]
            return cls(
                vocab_size=config["vocab_size"], dim=dim, n_layers=config["n_layer"], n_heads=config["n_head"],
                n_kv_heads=config["n_head"], ffn_dim=config.get("n_inner") or 4 * dim,
                max_seq_len=config.get("n_positions", 1024), tie_embeddings=config.get("tie_word_embeddings", True),
                qkv_bias=True, rope_theta=10000.0, rope_scaling=None,
                norm_eps=config.get("layer_norm_epsilon", 1e-5), norm="layer", positions="learned",
                mlp="gelu_tanh", linear_bias=True,
            )
        raise ValueError(f"DecoderConfig.from_hf_config reads falcon and gpt2 configs; this one is {model_type}")


def rope_inverse_frequencies(config: DecoderConfig, device: torch.device | str) -> torch.Tensor:
    """theta^(-2i/d) for i < d/2 (Su et al. 2021), with Llama 3.1's scaling when the config asks for it:
    wavelengths above ``original_max / low_freq_factor`` are divided by ``factor``, those below
    ``original_max / high_freq_factor`` kept, and the band between interpolated smoothly (Meta's
    Llama 3.1 reference code, ``apply_scaling``)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    scaling = config.rope_scaling
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "llama3":
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    in_band = (wavelength <= original / low) & (wavelength >= original / high)
    return torch.where(in_band, interpolated, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, head_dim); cos, sin: (T, head_dim), tables kept in fp32 and applied in x's dtype
    as transformers does, so no fp32 copy of q and k is saved for the backward pass."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


# One layer's keys and values, (B, kv_heads, max_len, head_dim) each: what its attention reads and writes.
LayerCache = tuple[torch.Tensor, torch.Tensor]


class KVCache(nn.Module):
    """Keys and values of every layer, preallocated for (batch, max_len): one write per step, no growth.
    ``kv_heads``: the heads this process's attention keeps, all of them unless tensor parallelism
    gave it a share (``fitbench.worker.tensor_parallel``).

    Each layer's keys and values are a tensor of their own, (B, kv_heads, max_len, head_dim), not views
    of one: a compiled decode step (``fitbench.models.backends.compile_regions``) takes the cache as an
    argument, and a write into a view of a larger argument is compiled as a new copy of all of it,
    written back at every step (measured on an H200: a capture pool of 1.7 times the cache and 216
    tokens/s at batch 8 on Llama-2-7B, against 1,039 eager); a write into a whole argument with
    ``index_put_`` is compiled in place, as gpt-fast writes its cache.

    A layer gets its own pair as an argument (``layers``), never an index into the cache: one compiled
    layer then serves every layer, where an index, a Python int, would be a constant of the compiled
    code, compiled again for each layer."""

    def __init__(self, config: DecoderConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device,
                 kv_heads: int | None = None):
        super().__init__()
        shape = (batch, kv_heads or config.n_kv_heads, max_len, config.head_dim)
        self.layer_keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.layer_values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]

    @property
    def batch(self) -> int:
        return self.layer_keys[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.layer_keys[0].shape[2]

    @property
    def device(self) -> torch.device:
        return self.layer_keys[0].device

    @property
    def slot_bytes(self) -> int:
        """Bytes of one position's keys and values over every layer and sequence: 2 L B KV D x element size."""
        k = self.layer_keys[0]
        return 2 * len(self.layer_keys) * k[:, :, 0].numel() * k.element_size()

    def layers(self) -> list[LayerCache]:
        """Each layer's keys and values, in layer order."""
        return list(zip(self.layer_keys, self.layer_values))


def fill_cache(cache: LayerCache, start: int, k: torch.Tensor, v: torch.Tensor) -> LayerCache:
    """Write k, v (B, kv_heads, T, head_dim) at positions start..start+T of one layer's cache; return
    its positions so far."""
    keys, values = cache
    end = start + k.shape[2]
    keys[:, :, start:end] = k
    values[:, :, start:end] = v
    return keys[:, :, :end], values[:, :, :end]


def write_cache(cache: LayerCache, position: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> LayerCache:
    """Write k, v (B, kv_heads, 1, head_dim) at ``position``, a (1,) index tensor on the cache's device,
    into one layer's cache; return every slot of it (B, kv_heads, max_len, head_dim), those after the
    position included: the caller masks them."""
    keys, values = cache
    keys[:, :, position] = k
    values[:, :, position] = v
    return keys, values


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight (Zhang and Sennrich 2019), computed in fp32. In eager
    training, ``layer_ops.rms_norm``: its output in the dtype its matmuls compute in, x and 1/rms saved."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if eager_training(x):
            return rms_norm(x, self.weight, self.eps)
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.type_as(x)


def norm(config: DecoderConfig) -> nn.Module:
    """The config's norm of ``dim`` features: RMSNorm, or LayerNorm (Ba et al. 2016) with weight and bias."""
    if config.norm == "layer":
        return nn.LayerNorm(config.dim, config.norm_eps)
    return RMSNorm(config.dim, config.norm_eps)


class FusedLinear(nn.Linear):
    """Several projections of one input as one matmul: the weight is theirs stacked by rows, in the
    order of ``parts`` (transformers' names of the projections), ``sizes`` rows each."""

    def __init__(self, in_features: int, parts: tuple[str, ...], sizes: tuple[int, ...], bias: bool):
        super().__init__(in_features, sum(sizes), bias=bias)
        self.parts, self.sizes = parts, sizes

    def slices(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each part's rows of ``tensor`` (the weight or the bias), views by part name."""
        return dict(zip(self.parts, tensor.split(self.sizes)))


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, fused: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.rotary = config.positions == "rotary"
        q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        if fused:
            self.qkv_proj = FusedLinear(config.dim, ("q_proj", "k_proj", "v_proj"), (q, kv, kv), config.qkv_bias)
        else:
            self.q_proj = nn.Linear(config.dim, q, bias=config.qkv_bias)
            self.k_proj = nn.Linear(config.dim, kv, bias=config.qkv_bias)
            self.v_proj = nn.Linear(config.dim, kv, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q, config.dim, bias=config.linear_bias)

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C) -> q (B, H, T, D) and k (B, KV, T, D) with rotary positions, and v (B, KV, T, D)."""
        B, T, _ = x.shape
        fused = hasattr(self, "qkv_proj")
        if eager_training(x) and self.rotary:
            # q and k rotated into a new buffer (v copied beside them when fused); their gradients are
            # written straight into the gradient of the projections' output
            heads = (self.n_heads, self.n_kv_heads, self.n_kv_heads)
            if fused:
                return rotary(self.qkv_proj(x).view(B, T, sum(heads), self.head_dim), cos, sin, heads, rotated=2)
            (q,), (k,) = (rotary(projection(x).view(B, T, count, self.head_dim), cos, sin, (count,), rotated=1)
                          for projection, count in ((self.q_proj, heads[0]), (self.k_proj, heads[1])))
            return q, k, self.v_proj(x).view(B, T, heads[2], self.head_dim).transpose(1, 2)
        if fused:
            q, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, dim=-1)  # (B, T, (H + 2 KV) D) in three views
            if torch.is_grad_enabled() and self.rotary:
                # attention saves v for its backward: a view would keep the whole projection's output
                # alive, c (h + k) more per token and layer, so v gets storage of its own, as eager's
                # rotary gives it (q and k are new tensors once rotated); unrotated (learned positions)
                # q, k and v are all views of the one output, which is what attention saves
                v = v.contiguous()
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        if not self.rotary:  # learned positions entered with the embeddings
            return q, k, v
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None, start: int) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if cache is not None:
            k, v = fill_cache(cache, start, k, v)  # (B, KV, start+T, D)
        if T > 1 and start > 0:
            raise NotImplementedError("prefill continuing an existing cache needs a block mask")
        grouped = self.n_kv_heads != self.n_heads
        if grouped and q.dtype == torch.float32:
            # Flash attention takes grouped heads but not fp32; the fp32 (memory-efficient) kernel takes
            # fp32 but not grouped heads, and the math fallback would keep T x T probabilities per head.
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)  # (B, H, S, D)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            grouped = False
            if eager_training(q):
                # q of its own: the fused rotation wrote q, k and v into one buffer, which attention's
                # saved q would otherwise keep whole beside the expanded copies of k and v. Laid out
                # (B, T, H, D) as before, which attention's output follows, so that the output
                # projection's reshape below stays a view.
                q = q.transpose(1, 2).contiguous().transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=grouped)  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache,
               position: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """One token per sequence, x (B, 1, C), at ``position``; attention over every slot of this
        layer's ``cache``, with ``visible`` (1, 1, 1, S) hiding those after the position.

        With one query per sequence, the G = H / KV query heads that share a key/value head become
        the G rows of one query block against that head's keys: grouped heads need no kernel support
        and no expanded copy of the cache, in every dtype.
        """
        B = x.shape[0]
        q, k, v = self.project(x, cos, sin)  # (B, H, 1, D), (B, KV, 1, D), (B, KV, 1, D)
        keys, values = write_cache(cache, position, k, v)  # (B, KV, S, D)
        # query head h uses key/value head h // G, as with enable_gqa or repeat_interleave
        q = q.reshape(B, self.n_kv_heads, self.n_heads // self.n_kv_heads, self.head_dim)  # (B, KV, G, D)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)  # (B, KV, G, D)
        return self.o_proj(y.reshape(B, 1, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Shazeer 2020)."""

    def __init__(self, config: DecoderConfig, fused: bool = False):
        super().__init__()
        f = config.ffn_dim
        if fused:
            self.gate_up_proj = FusedLinear(config.dim, ("gate_proj", "up_proj"), (f, f), bias=False)
        else:
            self.gate_proj = nn.Linear(config.dim, f, bias=False)
            self.up_proj = nn.Linear(config.dim, f, bias=False)
        self.down_proj = nn.Linear(f, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = hasattr(self, "gate_up_proj")
        if eager_training(x):
            if fused:
                return self.down_proj(swiglu(stacked_linear(x, self.gate_up_proj.weight, 2)))  # via (2, B, T, F)
            return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
        if not fused:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (B, T, 2 F) in two views
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(gate) * up)
        # Without autograd the product overwrites silu(gate): the fused output lives until the
        # product is formed, so a new product would hold 4 F per token where the unfused MLP holds 3 F.
        return self.down_proj(F.silu(gate).mul_(up))


class GeluMLP(nn.Module):
    """down(gelu(up(x))) (Hendrycks and Gimpel 2016): the exact GELU (Falcon), or its tanh
    approximation (GPT-2, ``gelu_tanh``), with biases when the config has them."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.approximate = "tanh" if config.mlp == "gelu_tanh" else "none"
        self.up_proj = nn.Linear(config.dim, config.ffn_dim, bias=config.linear_bias)
        self.down_proj = nn.Linear(config.ffn_dim, config.dim, bias=config.linear_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x), approximate=self.approximate))


class DecoderLayer(nn.Module):
    """Pre-norm attention then MLP, each added to the residual (Llama, GPT-2); or, ``parallel``
    (Falcon), both from the same input, x + attention(norm(x)) + mlp(norm'(x)), where norm' is the
    MLP's own LayerNorm or, ``shared_norm``, the attention's."""

    def __init__(self, config: DecoderConfig, fused: bool = False):
        super().__init__()
        self.parallel = config.parallel_attention
        self.input_layernorm = norm(config)
        self.self_attn = Attention(config, fused)
        if not config.shared_norm:
            self.post_attention_layernorm = norm(config)
        self.mlp = SwiGLU(config, fused) if config.mlp == "swiglu" else GeluMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None, start: int) -> torch.Tensor:
        if self.parallel:
            return x + self.self_attn(self.input_layernorm(x), cos, sin, cache, start) + self.mlp(self.mlp_norm(x))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, start)
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache,
               position: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        if self.parallel:
            attention = self.self_attn.decode(self.input_layernorm(x), cos, sin, cache, position, visible)
            return x + attention + self.mlp(self.mlp_norm(x))
        x = x + self.self_attn.decode(self.input_layernorm(x), cos, sin, cache, position, visible)
        return x + self.mlp(self.post_attention_layernorm(x))

    def mlp_norm(self, x: torch.Tensor) -> torch.Tensor:
        """A parallel block's MLP input: its own norm of x, or the attention's (``shared_norm``)."""
        norm_of_mlp = getattr(self, "post_attention_layernorm", self.input_layernorm)
        return norm_of_mlp(x)


class DecoderStack(nn.Module):
    def __init__(self, config: DecoderConfig, fused: bool = False):
        super().__init__()
        # Built with its weight, so nn.Embedding draws no N(0, 1) of its own: on the meta device that one
        # call imports torch._dynamo (seconds in every worker), and init_weights draws them later anyway.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim,
                                         _weight=torch.empty(config.vocab_size, config.dim))
        if config.positions == "learned":
            self.embed_positions = nn.Embedding(config.max_seq_len, config.dim,
                                                _weight=torch.empty(config.max_seq_len, config.dim))
        self.layers = nn.ModuleList(DecoderLayer(config, fused) for _ in range(config.n_layers))
        self.norm = norm(config)


class NativeCausalLM(nn.Module):
    """``fused``: q, k, v and gate, up as one matmul each (module docstring)."""

    def __init__(self, config: DecoderConfig, fused: bool = False):
        super().__init__()
        self.config = config
        self.fused = fused
        self.model = DecoderStack(config, fused)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Activation checkpointing (Chen et al. 2016): a checkpointed layer keeps only its input and
        # recomputes the rest during the backward pass. ``checkpointed_layers`` None: every layer; N: the
        # first N (``checkpoints``).
        self.activation_checkpointing = False
        self.checkpointed_layers: int | None = None
        self.register_buffer("rope_cos", torch.empty(config.max_seq_len, config.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(config.max_seq_len, config.head_dim), persistent=False)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, start: int = 0,
                last_only: bool = False, regions: Regions | None = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V), or (B, 1, V) for the last position when ``last_only``.
        ``regions``: what the layers, and the head of the last position, run through (``Regions``),
        the plain calls by default."""
        regions = regions or EAGER
        T = tokens.shape[1]
        x = self.add_positions(self.model.embed_tokens(tokens), slice(start, start + T))  # (B, T, C)
        # cast once here rather than in every layer: the rotation is applied in q's dtype
        dtype = output_dtype(x)
        cos, sin = self.rope_cos[start:start + T].to(dtype), self.rope_sin[start:start + T].to(dtype)
        layer_caches = cache.layers() if cache is not None else [None] * len(self.model.layers)
        for position, (layer, layer_cache) in enumerate(zip(self.model.layers, layer_caches)):
            x = self.run_layer(position, layer, x, cos, sin, layer_cache, start, regions)
        if not last_only:
            x = self.model.norm(x)  # the states before the norm are freed before the logits exist
            return self.lm_head(x)  # (B, T, V)
        # In the decode step's strides, size-1 dimensions included, which compiled code is guarded on
        # (``contiguous`` keeps a view's): one compiled head serves the prefill and the step.
        return regions.head(self, x[:, -1:, :].clone(memory_format=torch.contiguous_format))  # (B, 1, V)

    def run_layer(self, position: int, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  layer_cache: LayerCache | None, start: int, regions: Regions | None = None) -> torch.Tensor:
        """The decoder ``layer`` at ``position`` among those this model (or its pipeline stage) runs, on ``x``:
        recomputed in the backward pass where it ``checkpoints`` and autograd records, else through
        ``regions`` (the plain call by default). The one place a layer's activation checkpointing applies."""
        if torch.is_grad_enabled() and self.checkpoints(position):
            return checkpoint(layer, x, cos, sin, layer_cache, start, use_reentrant=False)
        return (regions or EAGER).layer(layer, x, cos, sin, layer_cache, start)

    def checkpoints(self, position: int) -> bool:
        """Whether the layer at ``position`` among those this model (or its pipeline stage) runs, counted
        from 0, recomputes its activations: the first ``checkpointed_layers`` do. The first rather than
        the last: the backward pass reaches them last, once the kept layers' activations are freed, so
        recomputing one never stands beside the kept activations; and under a pipeline a stage's first
        layers hold theirs longest."""
        return self.activation_checkpointing and (self.checkpointed_layers is None
                                                  or position < self.checkpointed_layers)

    def decode_step(self, tokens: torch.Tensor, cache: KVCache, position: torch.Tensor,
                    regions: Regions | None = None) -> torch.Tensor:
        """tokens (B, 1) at ``position``, a (1,) long tensor on the model's device -> logits (B, V).

        ``forward(tokens, cache, start=position)`` with static shapes: the rotary rows are gathered
        and the cache written at the position on the device, and attention covers all ``max_len``
        slots with those after the position masked, so no shape or host value changes from token to
        token and nothing synchronizes. Its temporaries are one layer's at a time plus the logits,
        as in ``forward``; the mask and the slot indices add about ten bytes per cache slot.
        ``regions``: as in ``forward``; every layer's step runs through the same ``layer_decode``.
        """
        regions = regions or EAGER
        slots = torch.arange(cache.max_len, device=position.device)
        visible = (slots <= position).view(1, 1, 1, -1)  # (1, 1, 1, S)
        cos, sin = self.rope_cos.index_select(0, position), self.rope_sin.index_select(0, position)  # (1, D)
        x = self.add_positions(regions.embed(self, tokens), position)  # (B, 1, C)
        for layer, layer_cache in zip(self.model.layers, cache.layers()):
            x = regions.layer_decode(layer, x, cos, sin, layer_cache, position, visible)
        return regions.head(self, x)[:, -1]  # (B, V)

    def add_positions(self, x: torch.Tensor, positions: slice | torch.Tensor) -> torch.Tensor:
        """Token embeddings x (B, T, C) with the learned position table's rows at ``positions`` added (GPT-2),
        the same rows for every sequence; ``positions`` a slice, or an index tensor on the device (a
        decode step's). x itself where positions are rotary, applied inside attention."""
        if self.config.positions != "learned":
            return x
        return x + self.model.embed_positions.weight[positions]  # (T, C) broadcast over B

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> their embeddings (B, T, C); a function of its own, so that compiling it
        (``Regions.embed``) counts against no other region's limit of compiled versions."""
        return self.model.embed_tokens(tokens)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states (B, T, C) -> logits (B, T, V): the final norm and the output projection."""
        return self.lm_head(self.model.norm(x))

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Random weights and the rotary tables: everything a freshly materialized model needs."""
        init_random_weights(self, std)
        self.reset_rope()

    @torch.no_grad()
    def reset_rope(self) -> None:
        inv_freq = rope_inverse_frequencies(self.config, self.rope_cos.device)
        positions = torch.arange(self.config.max_seq_len, device=inv_freq.device, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # (max_seq_len, head_dim), half-split layout
        self.rope_cos.copy_(angles.cos())
        self.rope_sin.copy_(angles.sin())

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype) -> KVCache:
        return KVCache(self.config, batch, max_len, dtype, self.rope_cos.device,
                       self.model.layers[0].self_attn.n_kv_heads)


def call_module(module: nn.Module, *args: Any) -> torch.Tensor:
    """``module(*args)``: through ``nn.Module.__call__``, so its hooks run (tensor parallelism's
    collectives, offload's weight streaming)."""
    return module(*args)


@dataclass(frozen=True)
class Regions:
    """What ``forward`` and ``decode_step`` run the model's parts through, each function taking the
    part first: ``layer``, a decoder layer's forward (``call_module``); ``layer_decode``, its step for
    one token (``DecoderLayer.decode``); ``head``, the final norm and output projection
    (``NativeCausalLM.head``); ``embed``, a decode step's token embedding (``NativeCausalLM.embed``,
    whose tensor-parallel all-reduce then compiles with it). ``EAGER`` holds the plain
    calls; ``fitbench.models.backends.compile_regions`` compiles each once, and one compiled function
    then runs every layer, whose weights and cache come in as arguments."""

    layer: Callable[..., torch.Tensor]
    layer_decode: Callable[..., torch.Tensor]
    head: Callable[..., torch.Tensor]
    embed: Callable[..., torch.Tensor]


EAGER = Regions(layer=call_module, layer_decode=DecoderLayer.decode, head=NativeCausalLM.head,
                embed=NativeCausalLM.embed)


def checkpoint_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state by transformers' names: its state dict, with each fused weight and bias
    replaced by views of its parts (``model.layers.0.self_attn.q_proj.weight`` ...), so that copying
    a checkpoint's tensors into them loads a fused model as an unfused one."""
    tensors = dict(module.state_dict(keep_vars=True))
    for name, part in module.named_modules():
        if isinstance(part, FusedLinear):
            owner = name.rpartition(".")[0]
            for kind in ("weight", "bias"):
                tensor = tensors.pop(f"{name}.{kind}", None)
                if tensor is not None:
                    tensors |= {f"{owner}.{projection}.{kind}": view
                                for projection, view in part.slices(tensor.data).items()}
    return tensors


def draw_normal(part: nn.Module, weight: torch.Tensor, std: float) -> None:
    """N(0, std) into ``weight``, ``part``'s weight or a tensor of its shape: a fused weight part by part,
    in order, so the generator gives each part what it gives the unfused projection of the same name."""
    for piece in (part.slices(weight).values() if isinstance(part, FusedLinear) else (weight,)):
        nn.init.normal_(piece, mean=0.0, std=std)


@torch.no_grad()
def init_random_weights(module: nn.Module, std: float = 0.02) -> None:
    """N(0, std) for matrices and embeddings, ones for norms, zeros for biases, in any part of a model."""
    for part in module.modules():
        if isinstance(part, (nn.Linear, nn.Embedding)):
            draw_normal(part, part.weight, std)
            if getattr(part, "bias", None) is not None:
                nn.init.zeros_(part.bias)
        elif isinstance(part, RMSNorm):
            nn.init.ones_(part.weight)
        elif isinstance(part, nn.LayerNorm):
            nn.init.ones_(part.weight)
            nn.init.zeros_(part.bias)


# Given a weight, the function that writes this process's part of the whole weight (its argument) into
# it, or None when the weight is held whole (``replay_random_weights``).
ShardWriter = Callable[[torch.Tensor], Callable[[torch.Tensor], None] | None]


@torch.no_grad()
def replay_random_weights(modules: list[nn.Module], device: torch.device | str, std: float = 0.02,
                          shard_writer: ShardWriter | None = None) -> None:
    """``init_random_weights`` over ``modules`` in order, of which only some have storage, or only a
    shard of it: a weight still on the meta device draws its N(0, std) into scratch of its shape and
    dtype on ``device`` and drops it, and a weight that ``shard_writer`` says is held as a shard
    (tensor parallelism: ``fitbench.worker.tensor_parallel``) draws the whole weight into that scratch
    and keeps its own part of it, so that the device's generator advances as when every weight is
    drawn and the weights with storage get what a build of the whole model gives them. The scratch is
    one buffer as large as the largest such weight, reused. Part of a model is built so (a pipeline
    stage, a tensor-parallel rank's shards) from the same seed as the whole model, with no broadcast
    from a rank that holds it all: every rank draws the same whole weights and keeps its part."""
    parts = [part for module in modules for part in module.modules()]
    writers = {}
    for part in parts:
        if isinstance(part, (nn.Linear, nn.Embedding)) and not part.weight.is_meta and shard_writer is not None:
            writer = shard_writer(part.weight)
            if writer is not None:
                writers[id(part.weight)] = writer
    drawn = [part.weight for part in parts if isinstance(part, (nn.Linear, nn.Embedding))
             and (part.weight.is_meta or id(part.weight) in writers)]
    scratch = {dtype: torch.empty(max(w.numel() for w in drawn if w.dtype == dtype), dtype=dtype, device=device)
               for dtype in {w.dtype for w in drawn}}
    for part in parts:
        if isinstance(part, (nn.Linear, nn.Embedding)):
            weight = part.weight
            if weight.is_meta or id(weight) in writers:
                whole = scratch[weight.dtype][:weight.numel()].view(weight.shape)
                draw_normal(part, whole, std)
                if id(weight) in writers:
                    writers[id(weight)](whole)
            else:
                draw_normal(part, weight, std)
            bias = getattr(part, "bias", None)
            if bias is not None and not bias.is_meta:
                nn.init.zeros_(bias)
        elif isinstance(part, RMSNorm) and not part.weight.is_meta:
            nn.init.ones_(part.weight)
        elif isinstance(part, nn.LayerNorm) and not part.weight.is_meta:
            nn.init.ones_(part.weight)
            nn.init.zeros_(part.bias)


def meta_model(arch: Architecture, dtype: torch.dtype, fused: bool = False) -> NativeCausalLM:
    """The model on the meta device with weights in ``dtype`` and fp32 rotary tables: shapes, no storage."""
    return meta_decoder(DecoderConfig.from_architecture(arch), dtype, fused)


def meta_decoder(config: DecoderConfig, dtype: torch.dtype, fused: bool = False) -> NativeCausalLM:
    """``meta_model`` of a decoder config."""
    with torch.device("meta"):
        model = NativeCausalLM(config, fused)
        model.to(dtype=dtype)
        model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
    return model


def empty_on(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Uninitialized storage on ``device`` with the shape and dtype of ``tensor`` (a meta tensor),
    contiguous. ``torch.empty_like`` of a meta tensor otherwise works out its strides symbolically,
    which imports sympy: most of a second of CPU in every worker that builds a model."""
    return torch.empty_like(tensor, device=device, memory_format=torch.contiguous_format)


def materialize(module: nn.Module, device: torch.device | str) -> nn.Module:
    """``module.to_empty(device=device)`` through ``empty_on``: every parameter and buffer gets
    uninitialized, contiguous storage on ``device``, as every weight of these models has."""
    return module._apply(lambda tensor: empty_on(tensor, device))


def build_native(arch: Architecture, device: torch.device | str, dtype: torch.dtype,
                 fused: bool = False) -> NativeCausalLM:
    """Build on the meta device, allocate storage directly on ``device`` in ``dtype``, then initialize.

    The rotary tables stay fp32 whatever the weight dtype: positions up to 128k need the precision.
    ``fused``: the fused projections (module docstring), allocated fused and drawn part by part, so
    the build's peak is the unfused build's, every weight and nothing more.
    """
    return build_decoder(DecoderConfig.from_architecture(arch), device, dtype, fused)


def build_decoder(config: DecoderConfig, device: torch.device | str, dtype: torch.dtype,
                  fused: bool = False) -> NativeCausalLM:
    """``build_native`` of a decoder config."""
    model = meta_decoder(config, dtype, fused)
    if config.tie_embeddings:
        # materialize visits a shared parameter once per module that holds it, allocating it twice;
        # the second allocation would exist beside the first at the end of the build, when every
        # other weight is already there. Untie for the allocation, tie again after.
        model.lm_head.weight = nn.Parameter(torch.empty(0, device="meta", dtype=dtype))
    materialize(model, device)
    if config.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_weights()
    return model
