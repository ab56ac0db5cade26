"""What vLLM does with each GPU's memory, predicted: its share, the weights, the profiled activations,
the KV cache that is left, and so the KV tokens and the requests a configuration holds at once.

vLLM 0.32's V1 engine (``vllm/v1/worker/gpu_worker.py``, ``determine_available_memory``;
``vllm/v1/core/kv_cache_utils.py``):

- **requested** = ceil(total memory x ``gpu_memory_utilization``) per GPU (``vllm/v1/worker/utils.py``,
  ``request_memory``); on its CPU build, of the host's memory (``vllm/v1/worker/cpu_worker.py``).
- **weights** per GPU = the parameters held by one rank x the bytes of the dtype: the decoder layers
  split over ``pp`` stages, each layer's matrices over ``tp`` ranks (norms replicated), the embedding
  and the output projection split over ``tp`` (vocabulary-parallel) on the first and last stage.
- **activations**: the peak of vLLM's profile run, one forward of ``max_num_batched_tokens`` tokens
  and the sampler over ``max_num_seqs`` rows. fitbench's estimate (not vLLM's, and not yet checked
  against a GPU): the widest temporary of a layer on one rank, the fused gate and up projection and
  its product, 3 x ffn / tp values per token, plus the residual stream and its norm, 2 x hidden,
  in the dtype; and the sampler's float32 logits, max_num_seqs x vocab. The larger of the two.
- **non-torch**: memory outside PyTorch's allocator (the CUDA context, NCCL's buffers); a given figure
  (``NON_TORCH_BYTES``, the CUDA context the planner assumes elsewhere; 0 on a CPU).
- **KV cache** = requested - weights - activations - non-torch, or ``kv_cache_memory_bytes`` where given
  (vLLM then skips the rest).
- **blocks** = floor(KV cache / bytes per block), a block being ``block_size`` tokens of every layer of
  the rank: block_size x layers/pp x 2 (k and v) x kv_heads/tp x head_dim x dtype bytes
  (``get_num_blocks``; ``AttentionSpec.page_size_bytes``). vLLM's block size is 16 on a GPU and 128 on
  its CPU build (``vllm/platforms/cpu.py``).
- **KV tokens** = blocks x block_size, the cache's token slots (vLLM's own "KV cache size" in tokens is
  int(concurrency at ``max_model_len`` x ``max_model_len``), ``get_kv_cache_capacity``, which is
  the same where ``max_model_len`` is a whole number of blocks); **concurrency** at a length L: blocks / ceil(L / block_size), the
  requests of L tokens whose caches fit at once (``get_max_concurrency_for_kv_cache_config``; vLLM logs
  it at ``max_model_len`` as "Maximum concurrency for L tokens per request").

A ``fitbench run --backend vllm`` configuration (``vllm_prediction``) fits when its batch's sequences,
each of its prompt and its new tokens, fit the KV cache at once: batch x ceil(L / block_size) blocks at
most, L = seq_len + new_tokens (vLLM would otherwise queue some of them behind the others, and the row
would not time one batch).

A server started for a preset (``fitbench serve-bench --start-vllm``) takes the planner's layout where
none is given (``server_layout``): the fewest GPUs of tensor parallelism, among those present, whose
KV cache holds at least one request of the longest length the benchmark sends; with vLLM's offline
scheduler limits (8192 tokens, 256 sequences) standing for the server's, which are smaller on most
GPUs, so that the activations are not underestimated.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from fitbench.models.architecture import Architecture
from fitbench.models.vllm_options import engine_limits, precision_options
from fitbench.precisions.entry import DTYPE_BYTES
from fitbench.spec import Layout

NON_TORCH_BYTES = 500 * 2**20  # the CUDA context and NCCL: the planner's CUDA context term
GPU_BLOCK_SIZE = 16
CPU_BLOCK_SIZE = 128


@dataclass(frozen=True)
class VllmMemory:
    """Each term in bytes per GPU (the module's docstring defines them), and their sources."""

    requested: int
    weights: int
    activations: int
    non_torch: int
    kv_cache: int
    block_bytes: int
    blocks: int
    block_size: int
    kv_tokens: int

    def concurrency(self, length: int) -> float:
        """The requests of ``length`` tokens whose KV caches fit at once: blocks / ceil(length / block_size)."""
        return self.blocks / math.ceil(length / self.block_size)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def rank_weights(arch: Architecture, tp: int, pp: int, dtype_bytes: int) -> int:
    """The bytes of the weights of the rank that holds most: layers / pp (rounded up), the matrices over
    tp and the norms whole, plus the embedding and output projection over tp."""
    layers = math.ceil(arch.num_layers / pp)
    layer = (arch.attention_params_per_layer + arch.mlp_params_per_layer) / tp + arch.norm_params_per_layer
    ends = (arch.embedding_params + arch.output_params) / tp + arch.final_norm_params
    return int((layers * layer + ends) * dtype_bytes)


def profile_activations(arch: Architecture, tp: int, dtype_bytes: int, max_num_batched_tokens: int,
                        max_num_seqs: int) -> int:
    """fitbench's estimate of the profile run's peak (the module's docstring)."""
    layer = max_num_batched_tokens * (3 * arch.ffn_size / tp + 2 * arch.hidden_size) * dtype_bytes
    logits = min(max_num_seqs, max_num_batched_tokens) * arch.vocab_size * 4
    return int(max(layer, logits))


def block_bytes(arch: Architecture, tp: int, pp: int, dtype_bytes: int, block_size: int) -> int:
    """block_size x layers/pp x 2 x kv_heads/tp x head_dim x dtype bytes (at least one kv head per rank,
    as vLLM replicates kv heads when tp exceeds them)."""
    kv_heads = max(1, arch.num_kv_heads // tp)
    return block_size * math.ceil(arch.num_layers / pp) * 2 * kv_heads * arch.head_dim * dtype_bytes


def vllm_memory(arch: Architecture, total_bytes: int, gpu_memory_utilization: float = 0.9, tp: int = 1,
                pp: int = 1, dtype: str = "bfloat16", block_size: int = GPU_BLOCK_SIZE,
                max_num_batched_tokens: int = 8192, max_num_seqs: int = 256, non_torch: int = NON_TORCH_BYTES,
                kv_cache_memory_bytes: int | None = None) -> VllmMemory:
    """vLLM's memory per GPU of ``total_bytes`` for ``arch`` (the module's docstring)."""
    size = DTYPE_BYTES[dtype]
    requested = math.ceil(total_bytes * gpu_memory_utilization)
    weights = rank_weights(arch, tp, pp, size)
    activations = profile_activations(arch, tp, size, max_num_batched_tokens, max_num_seqs)
    kv = (kv_cache_memory_bytes if kv_cache_memory_bytes is not None
          else max(0, requested - weights - activations - non_torch))
    per_block = block_bytes(arch, tp, pp, size, block_size)
    blocks = kv // per_block
    return VllmMemory(requested=requested, weights=weights, activations=activations, non_torch=non_torch,
                      kv_cache=kv, block_bytes=per_block, blocks=blocks, block_size=block_size,
                      kv_tokens=blocks * block_size)


def vllm_prediction(arch: Architecture, spec, total_bytes: float, memory_source: str) -> dict:
    """The prediction a ``--backend vllm`` row keeps (the module's docstring): vLLM's terms per GPU of
    ``total_bytes`` (``memory_source`` says whence: a GPU's memory, or the host's on a CPU, whose engine
    has no CUDA context and 128-token blocks), its KV blocks and tokens, the most sequences of the row's
    length that fit, and whether the row's batch does. ``predicted_peak_bytes`` is what vLLM takes of
    each GPU: its share, or with ``kv_cache_bytes`` given, the weights, activations, non-torch memory
    and that cache."""
    on_cpu = spec.device == "cpu"
    length = spec.seq_len + spec.new_tokens
    limits = engine_limits(spec.batch_size, length)
    memory = vllm_memory(arch, int(total_bytes), spec.gpu_memory_utilization, tp=spec.layout.tp, pp=spec.layout.pp,
                         dtype=precision_options(spec.precision)["dtype"],
                         block_size=CPU_BLOCK_SIZE if on_cpu else GPU_BLOCK_SIZE,
                         max_num_batched_tokens=limits["max_num_batched_tokens"], max_num_seqs=limits["max_num_seqs"],
                         non_torch=0 if on_cpu else NON_TORCH_BYTES, kv_cache_memory_bytes=spec.kv_cache_bytes)
    needed = spec.batch_size * math.ceil(length / memory.block_size)
    taken = (memory.requested if spec.kv_cache_bytes is None
             else memory.weights + memory.activations + memory.non_torch + memory.kv_cache)
    terms = [("weights", memory.weights), ("profiled activations", memory.activations),
             ("non-torch (CUDA context, NCCL)", memory.non_torch), ("KV cache", memory.kv_cache)]
    return {"predicted_peak_bytes": taken, "fits": memory.blocks >= needed, "gpu_memory_bytes": total_bytes,
            "memory_source": memory_source,
            "terms": [{"name": name, "bytes": size, "at_peak": True} for name, size in terms],
            "calibration": "vLLM's memory model (fitbench.planning.vllm_memory)",
            "vllm": {**memory.as_dict(), "max_model_len": length, "needed_blocks": needed,
                     "max_concurrency": memory.concurrency(length)}}


def vllm_refusal(spec, prediction: dict) -> str:
    """One paragraph: the row's batch does not fit vLLM's KV cache as predicted, and what would."""
    figures = prediction["vllm"]
    most = math.floor(figures["max_concurrency"])
    share = (f"--kv-cache-bytes {spec.kv_cache_bytes}" if spec.kv_cache_bytes is not None
             else f"--gpu-memory-utilization {spec.gpu_memory_utilization:g}")
    holds = (f"{most} such sequences at once" if most else
             f"not one sequence of {figures['max_model_len']} tokens")
    smaller = f"--batch-size {most} or less, " if most else ""
    return (f"refused before launch: {spec.label} needs {figures['needed_blocks']} KV blocks of "
            f"{figures['block_size']} tokens per GPU for its {spec.batch_size} sequences of "
            f"{figures['max_model_len']} tokens, and vLLM's cache under {share} is predicted to hold "
            f"{figures['blocks']} (fitbench.planning.vllm_memory): {holds}. Give {smaller}a larger "
            f"{share.split()[0]}, more GPUs (--strategy tp or pipeline), or a shorter --seq-len or --new-tokens.")


def server_layout(arch: Architecture, gpu_memory: float, gpus: int, length: int, precision: str = "bf16",
                  gpu_memory_utilization: float = 0.9) -> tuple[int, VllmMemory] | None:
    """The tensor-parallel degree of vLLM's server for ``arch`` on ``gpus`` GPUs of ``gpu_memory`` bytes
    (the module's docstring) and its memory per GPU: the smallest of 1, 2, 4, ... up to ``gpus`` that
    vLLM can split the heads by (``Layout.problem``) whose KV cache holds ``length`` tokens; None when
    none does."""
    dtype = precision_options(precision)["dtype"]
    limits = engine_limits(1, length)
    degree = 1
    while degree <= gpus:
        if Layout(tp=degree).problem(arch, "infer", precision, "vllm") is None:
            memory = vllm_memory(arch, int(gpu_memory), gpu_memory_utilization, tp=degree, dtype=dtype,
                                 max_num_batched_tokens=limits["max_num_batched_tokens"],
                                 max_num_seqs=limits["max_num_seqs"])
            if memory.blocks >= math.ceil(length / memory.block_size):
                return degree, memory
        degree *= 2
    return None
