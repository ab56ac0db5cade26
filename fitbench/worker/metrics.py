"""Derived metrics: throughput, model FLOP utilization, and the decode bandwidth roofline.

- **MFU** (PaLM, Chowdhery et al. 2022, appendix B; as torchtitan and nanoGPT compute it):
  ``MFU = tokens/s x FLOPs per token / peak FLOP/s`` with FLOPs per token ``6 N + 12 L H Q T`` for a
  training step (forward + backward) and ``2 N + 4 L H Q T`` for a forward pass, N the matmul
  parameters, L layers, H heads, Q head dim, T the context. No causal halving. The peak is the
  datasheet's dense figure for the tensor-core kind that does most of the FLOPs
  (the precision entry's ``peak_kind``, ``fitbench.hardware.datasheet``), and, when ``fitbench env --measure``
  has stored one for this device, also the measured matmul ceiling.
- **Prefill** of a prompt of T tokens, per sequence: ``T (2 (N - V h) + 4 L H Q T) + 2 V h`` FLOPs
  (``Architecture.prefill_flops``): the output projection (V h, tied or not) runs for the last
  position only, whose logits give the first token; the rest as in a forward pass. Prefill
  TFLOP/s and MFU divide it by the time to first token, which starts from an idle device and so
  includes the host's launch work (``fitbench.worker.loops.generate``).
- **Decode bandwidth**: the bytes one decode step reads, over the median step latency.
  ``weight bytes per step``: the weights the step touches (``fitbench.worker.weight_bytes.decode_weight_bytes``:
  every parameter's storage but the lookup tables, of which a row per sequence; under autocast the
  16-bit copies the step writes and reads again); ``KV bytes per step``: the KV cache the step
  attends over, as the backend reads it (``CausalLM.kv_bytes_read``), averaged over the generation's
  decode steps. Two figures: weights only, the convention of gpt-fast and torchao (bytes = model
  size), to compare with theirs; and weights + KV, all that the step reads. Each as GB/s and as a
  percentage of the device's memory bandwidth (the roofline), and ``tokens/s <= B x bandwidth /
  bytes per step``.
"""

from __future__ import annotations

from fitbench.models.architecture import Architecture
from fitbench.util.stats import SampleStats


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


def _percent(achieved: float, peak: float | None) -> float | None:
    return 100 * achieved / peak if peak else None


def inference_metrics(arch: Architecture, batch: int, prompt_len: int, weight_bytes: int, ttft: SampleStats,
                      token_latency: SampleStats, decode_weight_bytes: float, decode_kv_bytes: float,
                      peak_flops: float | None, measured_flops: float | None, peak_bandwidth: float | None) -> dict:
    """Prefill and decode figures of a generation, by the formulas of the module docstring.

    ``weight_bytes``: the weights the model holds; ``decode_weight_bytes`` and ``decode_kv_bytes``:
    what one decode step reads of the weights and of the KV cache (averaged over the steps). The
    row's fields: ``decode_weight_bytes_per_step``, ``decode_kv_bytes_per_step`` and their sum
    ``decode_bytes_per_step``; ``decode_weights_bandwidth_gbs`` and ``decode_weights_roofline_percent``
    from the weights alone (gpt-fast's and torchao's figure), ``decode_bandwidth_gbs`` and
    ``decode_roofline_percent`` from weights + KV; ``decode_roofline_tokens_per_s``, the decode
    rate at full bandwidth for weights + KV."""
    prefill_flops = batch * arch.prefill_flops(prompt_len)
    step = token_latency.median
    bytes_per_step = decode_weight_bytes + decode_kv_bytes
    return {
        "prefill_tokens_per_s": batch * prompt_len / ttft.median,
        "prefill_flops": prefill_flops,
        "prefill_tflops": prefill_flops / ttft.median / 1e12,
        "prefill_mfu": utilization(prefill_flops / ttft.median, peak_flops),
        "prefill_mfu_measured_peak": utilization(prefill_flops / ttft.median, measured_flops),
        "weight_bytes": weight_bytes,
        "decode_tokens_per_s": batch / step,
        "decode_weight_bytes_per_step": decode_weight_bytes,
        "decode_kv_bytes_per_step": decode_kv_bytes,
        "decode_bytes_per_step": bytes_per_step,
        "decode_weights_bandwidth_gbs": decode_weight_bytes / step / 1e9,
        "decode_bandwidth_gbs": bytes_per_step / step / 1e9,
        "decode_weights_roofline_percent": _percent(decode_weight_bytes / step, peak_bandwidth),
        "decode_roofline_percent": _percent(bytes_per_step / step, peak_bandwidth),
        "decode_roofline_tokens_per_s": batch * peak_bandwidth / bytes_per_step if peak_bandwidth else None,
    }
