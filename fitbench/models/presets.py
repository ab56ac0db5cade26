"""The registered architectures, each with the source of its numbers.

Three groups:

- the size ladder ``1B`` ... ``120B`` that users sweep: Llama-style models whose exact parameter
  count is within 10% of the name, following a real model where one has that size;
- the Stanford CS336 assignment 2 models (vocab 10000, untied embeddings, d_ff given);
- real architectures, copied field by field from their public ``config.json`` on the Hugging Face hub.

``tiny`` is a few million parameters for tests and CPU runs.
"""

from __future__ import annotations

from fitbench.models.architecture import Architecture

LLAMA2_VOCAB = 32000
LLAMA3_VOCAB = 128256
LLAMA31_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
CS336_SOURCE = "Stanford CS336 (spring 2025) assignment 2, table of model sizes"


def _llama(name: str, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, *,
           max_seq_len: int, tied: bool, source: str, follows: str = "", hf_model_type: str = "llama",
           **fields) -> Architecture:
    return Architecture(
        name=name, family="llama", hf_model_type=hf_model_type, vocab_size=vocab, hidden_size=hidden,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, ffn_size=ffn, max_seq_len=max_seq_len,
        tie_embeddings=tied, source=source, follows=follows, **fields,
    )


def _cs336(name: str, d_model: int, d_ff: int, layers: int, heads: int) -> Architecture:
    # The assignment fixes no maximum context; 2048 covers its benchmark sweeps (128 to 1024).
    return _llama(name, d_model, layers, heads, heads, d_ff, 10000, max_seq_len=2048, tied=False,
                  source=CS336_SOURCE, follows=f"CS336 {name}")


PRESETS: tuple[Architecture, ...] = (
    _llama("tiny", 256, 4, 8, 4, 768, 4096, max_seq_len=1024, tied=True,
           source="fitbench test model: every code path of the larger presets (GQA, tied embeddings) in 4.2M parameters"),

    # ---- the size ladder ----------------------------------------------------------------
    _llama("1B", 2048, 16, 32, 8, 8192, LLAMA2_VOCAB, max_seq_len=4096, tied=True,
           source="meta-llama/Llama-3.2-1B config.json, with Llama-2's 32000-token vocabulary",
           follows="Llama-3.2-1B (16 x 2048, GQA 8, tied)"),
    _llama("3B", 3072, 28, 24, 8, 8192, LLAMA3_VOCAB, max_seq_len=8192, tied=True, rope_theta=500000.0,
           source="meta-llama/Llama-3.2-3B config.json (context capped at 8192)", follows="Llama-3.2-3B"),
    _llama("7B", 4096, 32, 32, 32, 11008, LLAMA2_VOCAB, max_seq_len=4096, tied=False,
           source="meta-llama/Llama-2-7b-hf config.json", follows="Llama-2-7B"),
    _llama("11B", 4096, 48, 32, 8, 14336, LLAMA2_VOCAB, max_seq_len=4096, tied=False,
           source="Llama-3.1-8B layer shape, 48 layers deep, Llama-2 vocabulary",
           follows="none at this size; Llama-3.1-8B layers"),
    _llama("13B", 5120, 40, 40, 40, 13824, LLAMA2_VOCAB, max_seq_len=4096, tied=False,
           source="meta-llama/Llama-2-13b-hf config.json", follows="Llama-2-13B"),
    _llama("15B", 5120, 52, 40, 8, 13824, LLAMA2_VOCAB, max_seq_len=4096, tied=False,
           source="Llama-2-13B layer width with GQA 8, 52 layers deep",
           follows="none at this size; Llama-2-13B layers with GQA"),
    _llama("20B", 6144, 50, 48, 8, 16384, LLAMA2_VOCAB, max_seq_len=4096, tied=False,
           source="hidden 6144, GQA 8, SwiGLU 16384, 50 layers", follows="none at this size"),
    _llama("30B", 6656, 60, 52, 52, 17920, LLAMA2_VOCAB, max_seq_len=2048, tied=False,
           source="LLaMA-30B (Touvron et al. 2023, table 2: 6656 x 60, 52 heads)", follows="LLaMA-1 30B (32.5B)"),
    _llama("65B", 8192, 80, 64, 64, 22016, LLAMA2_VOCAB, max_seq_len=2048, tied=False,
           source="LLaMA-65B (Touvron et al. 2023, table 2: 8192 x 80, 64 heads)", follows="LLaMA-1 65B"),
    _llama("120B", 12288, 88, 96, 8, 28672, 32768, max_seq_len=32768, tied=False, rope_theta=1000000.0,
           source="mistralai/Mistral-Large-Instruct-2407 config.json (context capped at 32768)",
           follows="Mistral Large 2 (123B)", hf_model_type="mistral"),

    # ---- CS336 -------------------------------------------------------------------------
    _cs336("small", 768, 3072, 12, 12),
    _cs336("medium", 1024, 4096, 24, 16),
    _cs336("large", 1280, 5120, 36, 20),
    _cs336("xl", 1600, 6400, 48, 25),
    _cs336("2.7B", 2560, 10240, 32, 32),

    # ---- real architectures --------------------------------------------------------------
    _llama("llama-2-7b", 4096, 32, 32, 32, 11008, LLAMA2_VOCAB, max_seq_len=4096, tied=False,
           source="meta-llama/Llama-2-7b-hf config.json", follows="Llama-2-7B"),
    _llama("llama-2-13b", 5120, 40, 40, 40, 13824, LLAMA2_VOCAB, max_seq_len=4096, tied=False,
           source="meta-llama/Llama-2-13b-hf config.json", follows="Llama-2-13B"),
    _llama("llama-2-70b", 8192, 80, 64, 8, 28672, LLAMA2_VOCAB, max_seq_len=4096, tied=False,
           source="meta-llama/Llama-2-70b-hf config.json", follows="Llama-2-70B"),
    _llama("codellama-70b", 8192, 80, 64, 8, 28672, 32016, max_seq_len=16384, tied=False, rope_theta=1000000.0,
           source="codellama/CodeLlama-70b-hf config.json", follows="CodeLlama-70B"),
    _llama("llama-3.1-8b", 4096, 32, 32, 8, 14336, LLAMA3_VOCAB, max_seq_len=131072, tied=False,
           rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING,
           source="meta-llama/Llama-3.1-8B config.json", follows="Llama-3.1-8B"),
    _llama("llama-3.1-70b", 8192, 80, 64, 8, 28672, LLAMA3_VOCAB, max_seq_len=131072, tied=False,
           rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING,
           source="meta-llama/Llama-3.1-70B config.json", follows="Llama-3.1-70B"),
    _llama("llama-3.1-405b", 16384, 126, 128, 8, 53248, LLAMA3_VOCAB, max_seq_len=131072, tied=False,
           rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING,
           source="meta-llama/Llama-3.1-405B config.json", follows="Llama-3.1-405B"),
    _llama("mistral-7b", 4096, 32, 32, 8, 14336, 32768, max_seq_len=32768, tied=False, rope_theta=1000000.0,
           source="mistralai/Mistral-7B-v0.3 config.json (no sliding window)", follows="Mistral-7B-v0.3",
           hf_model_type="mistral"),
    _llama("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, max_seq_len=131072, tied=False, qkv_bias=True,
           rope_theta=1000000.0, norm_eps=1e-6,
           source="Qwen/Qwen2.5-7B config.json", follows="Qwen2.5-7B", hf_model_type="qwen2"),
    _llama("qwen2.5-72b", 8192, 80, 64, 8, 29568, 152064, max_seq_len=131072, tied=False, qkv_bias=True,
           rope_theta=1000000.0, norm_eps=1e-6,
           source="Qwen/Qwen2.5-72B config.json", follows="Qwen2.5-72B", hf_model_type="qwen2"),
    Architecture(name="falcon-40b", family="falcon", hf_model_type="falcon", vocab_size=65024, hidden_size=8192,
                 num_layers=60, num_heads=128, num_kv_heads=8, ffn_size=4 * 8192, max_seq_len=2048,
                 tie_embeddings=True, source="tiiuae/falcon-40b config.json", follows="Falcon-40B"),
    Architecture(name="falcon-180b", family="falcon", hf_model_type="falcon", vocab_size=65024, hidden_size=14848,
                 num_layers=80, num_heads=232, num_kv_heads=8, ffn_size=4 * 14848, max_seq_len=2048,
                 tie_embeddings=True, source="tiiuae/falcon-180B config.json", follows="Falcon-180B"),
    Architecture(name="gpt2", family="gpt2", hf_model_type="gpt2", vocab_size=50257, hidden_size=768,
                 num_layers=12, num_heads=12, num_kv_heads=12, ffn_size=4 * 768, max_seq_len=1024,
                 tie_embeddings=True, source="openai-community/gpt2 config.json", follows="GPT-2 (124M)"),
    Architecture(name="gpt2-xl", family="gpt2", hf_model_type="gpt2", vocab_size=50257, hidden_size=1600,
                 num_layers=48, num_heads=25, num_kv_heads=25, ffn_size=4 * 1600, max_seq_len=1024,
                 tie_embeddings=True, source="openai-community/gpt2-xl config.json", follows="GPT-2 XL (1.5B)"),
)

SIZE_LADDER: tuple[str, ...] = ("1B", "3B", "7B", "11B", "13B", "15B", "20B", "30B", "65B", "120B")
CS336_SIZES: tuple[str, ...] = ("small", "medium", "large", "xl", "2.7B")
