"""The planner's vLLM memory (``fitbench.planning.vllm_memory``): each term recomputed by hand for a
preset, and the KV blocks, tokens and concurrency checked against what vLLM's engine reports (its CPU
build, in the environment ``FITBENCH_VLLM_PYTHON`` names; skipped without it)."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from fitbench.models.config_directory import write_config_directory
from fitbench.models.registry import resolve
from fitbench.planning.vllm_memory import (CPU_BLOCK_SIZE, NON_TORCH_BYTES, profile_activations, rank_weights,
                                           server_layout, vllm_memory)
from fitbench.serving.vllm_server import PYTHON_VARIABLE

ENGINE = Path(__file__).resolve().parents[1] / "fitbench" / "worker" / "vllm_engine.py"


def test_each_term_by_hand_for_llama_3_1_8b_on_an_80_gb_gpu():
    arch = resolve("llama-3.1-8b")
    # Llama 3.1 8B: hidden 4096, 32 layers, 32 heads, 8 kv heads (head_dim 128), ffn 14336, vocab 128256, untied
    assert (arch.hidden_size, arch.num_layers, arch.num_kv_heads, arch.head_dim, arch.ffn_size, arch.vocab_size) == (
        4096, 32, 8, 128, 14336, 128256)
    total = 80 * 10**9
    memory = vllm_memory(arch, total, 0.9, tp=2)
    assert memory.requested == math.ceil(0.9 * total)
    layer = (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336) / 2 + 2 * 4096  # q, o; k, v; mlp over tp; norms
    assert memory.weights == int((32 * layer + 2 * 128256 * 4096 / 2 + 4096) * 2)
    assert memory.activations == max(8192 * (3 * 14336 / 2 + 2 * 4096) * 2, 256 * 128256 * 4)
    assert memory.kv_cache == memory.requested - memory.weights - memory.activations - NON_TORCH_BYTES
    assert memory.block_bytes == 16 * 32 * 2 * (8 // 2) * 128 * 2  # 16-token blocks of k and v, 4 kv heads a rank
    assert memory.blocks == memory.kv_cache // memory.block_bytes and memory.kv_tokens == memory.blocks * 16
    assert memory.concurrency(8192) == memory.blocks / 512


def test_a_servers_layout_is_the_fewest_gpus_whose_cache_holds_one_request():
    """By hand, bf16 at 0.9 of 80 GB: 8B's 16 GB of weights fit one GPU; 70B's 141 GB need more than two
    GPUs' 72 GB shares (70.6 GB of weights each, and the profile and CUDA context beside them), so four;
    405B's 810 GB is 101 GB per GPU over eight: none."""
    total, length = 80 * 10**9, 4096
    share = math.ceil(0.9 * total)
    assert server_layout(resolve("llama-3.1-8b"), total, 8, length)[0] == 1
    seventy = resolve("llama-3.1-70b")
    left_at_2 = share - rank_weights(seventy, 2, 1, 2) - profile_activations(seventy, 2, 2, 8192, 256) - NON_TORCH_BYTES
    assert left_at_2 < 0
    degree, memory = server_layout(seventy, total, 8, length)
    assert degree == 4 and memory.blocks >= length // 16
    assert server_layout(seventy, total, 2, length) is None
    assert server_layout(resolve("llama-3.1-405b"), total, 8, length) is None
    assert 2 * resolve("llama-3.1-405b").total_params / 8 > share


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get(PYTHON_VARIABLE),
                    reason=f"no vLLM environment: {PYTHON_VARIABLE} names none (.ci/run makes one)")
def test_the_kv_blocks_vllm_reports_are_the_planners(tmp_path):
    """With the KV cache's bytes given (vLLM's kv_cache_memory_bytes), the blocks follow from the block's
    bytes alone: the prediction must be exact (tolerance 0 blocks). The share-of-memory path depends on
    the process's resident memory on a CPU, which no planner knows before it runs, so it is not checked
    here."""
    arch = resolve("tiny")
    kv_bytes, max_model_len, new_tokens = 40 * 2**20, 256, 8
    options = {"model": str(write_config_directory(arch, tmp_path / "tiny", "bfloat16")), "dtype": "bfloat16",
               "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "max_model_len": max_model_len,
               "gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": kv_bytes, "enforce_eager": True, "batch": 3,
               "prompt_tokens": 16, "new_tokens": new_tokens}
    (tmp_path / "options.json").write_text(json.dumps(options))
    done = subprocess.run([os.environ[PYTHON_VARIABLE], str(ENGINE), str(tmp_path / "options.json"),
                           str(tmp_path / "result.json")], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    engine = json.loads((tmp_path / "result.json").read_text())
    predicted = vllm_memory(arch, 0, block_size=CPU_BLOCK_SIZE, kv_cache_memory_bytes=kv_bytes)
    assert engine["block_size"] == predicted.block_size
    assert engine["num_gpu_blocks"] == predicted.blocks == kv_bytes // (128 * 4 * 2 * 4 * 32 * 2)
    assert engine["kv_cache_size_tokens"] == predicted.kv_tokens
    assert engine["kv_cache_max_concurrency"] == pytest.approx(predicted.concurrency(max_model_len))
    assert [len(tokens) for tokens in engine["tokens"]] == [new_tokens] * 3  # ignore_eos: every token asked
    assert len(engine["token_latency_s"]) == 3
    for whole, one, step in zip(engine["generate_s"], engine["first_token_s"], engine["token_latency_s"]):
        assert step == pytest.approx((whole - one) / (new_tokens - 1))
