"""Derived metrics: throughput, model FLOP utilization, and the decode bandwidth roofline.

- **MFU** (PaLM, Chowdhery et al. 2022, appendix B; as torchtitan and nanoGPT compute it):
  ``MFU = tokens/s x FLOPs per token / peak FLOP/s`` with FLOPs per token ``6 N + 12 L H Q T`` for a
  training step (forward + backward) and ``2 N + 4 L H Q T`` for a forward pass, N the matmul
  parameters, L layers, H heads, Q head dim, T the context. No causal halving. The peak is the
  datasheet's dense figure for the tensor-core kind that does most of the FLOPs
  (``fitbench.run.precision.peak_kind``, ``fitbench.hardware``), and, when
  ``fitbench env --measure`` has stored one for this device, also the measured matmul ceiling.
- **Decode bandwidth**: a decode step reads every weight once and the KV cache of every sequence, so
  ``bytes per step = weight bytes + B x kv bytes per token x context``, averaged over the generation's
  contexts; achieved bandwidth = bytes per step / median step latency; the roofline is the memory
  bandwidth, and ``tokens/s per sequence <= bandwidth / (weight bytes + kv bytes per sequence)``.
"""

from __future__ import annotations

from fitbench.models.architecture import Architecture
from fitbench.stats import SampleStats


def utilization(achieved_flops: float, peak: float | None) -> float | None:
    return achieved_flops / peak if peak else None


def step_metrics(arch: Architecture, mode: str, batch: int, seq_len: int, step: SampleStats,
                 peak_flops: float | None, measured_flops: float | None, adapter_params: int | None = None) -> dict:
    """Throughput and MFU of a training-style step; ``adapter_params`` when only adapters on a frozen
    base train (``Architecture.adapter_train_flops_per_token``)."""
    tokens = batch * seq_len
    if mode == "forward":
        per_token = arch.forward_flops_per_token(seq_len)
    elif adapter_params is not None:
        per_token = arch.adapter_train_flops_per_token(seq_len, adapter_params)
    else:
        per_token = arch.train_flops_per_token(seq_len)
    tokens_per_s = tokens / step.median
    achieved = tokens_per_s * per_token
    return {
        "tokens_per_step": tokens,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": per_token,
        "achieved_tflops": achieved / 1e12,
        "mfu": utilization(achieved, peak_flops),
        "mfu_measured_peak": utilization(achieved, measured_flops),
    }


def inference_metrics(arch: Architecture, batch: int, prompt_len: int, new_tokens: int, weight_bytes: int,
                      kv_bytes_per_element: float, ttft: SampleStats, token_latency: SampleStats | None,
                      peak_flops: float | None, measured_flops: float | None,
                      peak_bandwidth: float | None) -> dict:
    prefill_flops = batch * prompt_len * arch.forward_flops_per_token(prompt_len)
    metrics = {
        "prefill_tokens_per_s": batch * prompt_len / ttft.median,
        "prefill_tflops": prefill_flops / ttft.median / 1e12,
        "prefill_mfu": utilization(prefill_flops / ttft.median, peak_flops),
        "prefill_mfu_measured_peak": utilization(prefill_flops / ttft.median, measured_flops),
        "weight_bytes": weight_bytes,
    }
    if token_latency is None:
        return metrics
    mean_context = prompt_len + new_tokens / 2
    kv_bytes = batch * arch.kv_cache_bytes_per_token(kv_bytes_per_element) * mean_context
    bytes_per_step = weight_bytes + kv_bytes
    achieved_bandwidth = bytes_per_step / token_latency.median
    metrics.update({
        "decode_tokens_per_s": batch / token_latency.median,
        "decode_bytes_per_step": bytes_per_step,
        "decode_bandwidth_gbs": achieved_bandwidth / 1e9,
        "decode_roofline_tokens_per_s": batch * peak_bandwidth / bytes_per_step if peak_bandwidth else None,
        "decode_roofline_percent": 100 * achieved_bandwidth / peak_bandwidth if peak_bandwidth else None,
    })
    return metrics
