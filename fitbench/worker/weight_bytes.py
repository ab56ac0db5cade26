"""Bytes of a built model's weights: what every parameter stores (``weight_storage_bytes``), and what
one decode step reads of them (``decode_weight_bytes``), the numerator of a decode step's
bandwidth roofline (``fitbench.worker.metrics``)."""

from __future__ import annotations

import sys

import torch


def weight_storage_bytes(module: torch.nn.Module) -> int:
    """Bytes of every parameter's data, counting what quantized weights keep beside it: the inner
    tensors of torchao's tensor subclasses, bitsandbytes' row scales and 4-bit block states; of a
    DTensor, this rank's shard. Each tensor counts its elements x their size once per address:
    tensors sharing one allocation (a layer packed by ``fitbench.worker.packing``, bitsandbytes' ``CB``
    beside its weight) count apart."""
    seen: set[int] = set()

    def storage(tensor) -> int:
        if tensor is None:
            return 0
        if hasattr(tensor, "to_local"):  # a DTensor (tensor parallelism): this rank's shard
            return storage(tensor.to_local())
        if hasattr(type(tensor), "__tensor_flatten__"):
            names, _ = tensor.__tensor_flatten__()
            return sum(storage(getattr(tensor, name)) for name in names)
        if tensor.data_ptr() in seen:
            return 0
        seen.add(tensor.data_ptr())
        return tensor.numel() * tensor.element_size()

    total = 0
    for part in module.modules():
        # bitsandbytes' int8 layers move their row scales from the weight to the layer's state on
        # the first forward.
        total += storage(getattr(getattr(part, "state", None), "SCB", None))
    for parameter in module.parameters():
        total += storage(parameter) + storage(getattr(parameter, "SCB", None))
        state = getattr(parameter, "quant_state", None)
        if state is not None:
            total += storage(state.absmax) + storage(getattr(state, "code", None))
            nested = getattr(state, "state2", None)
            if nested is not None:
                total += storage(nested.absmax) + storage(nested.code)
    return total


def decode_weight_bytes(module: torch.nn.Module, stored_bytes: float, batch: int, vocab_size: int,
                        autocast_dtype: torch.dtype | None) -> float:
    """Bytes of weights one decode step of ``batch`` sequences reads, from the built module:

        stored - lookup tables + rows looked up + autocast copies + rotary rows

    - ``stored_bytes``: every parameter's storage (``weight_storage_bytes``, quantized layouts
      included; for offload, the resident and offloaded layers), each read once;
    - a lookup table (``nn.Embedding``) that no matmul shares is read a row at a time, not whole: the
      token table one row per sequence (B x dim x element bytes), a position table (GPT-2's) one
      row, the position every sequence is at. A table tied to the output projection is read whole
      by that matmul and stays in ``stored``;
    - under autocast (bf16 / fp16 over fp32 weights), every matmul (``nn.Linear``, transformers'
      ``Conv1D``) casts its fp32 weight and bias to 16 bits on every step, since autocast caches no
      casts inside ``inference_mode`` (profiled: one cast of the weight per call there, one in all
      under ``no_grad``); each element is read (4 B), written as a copy (2 B) and the copy read by
      the matmul (2 B): 8 B;
    - rotary positions: the native model's fp32 cos and sin tables (max_len x head_dim) are read one
      row each; transformers computes cos and sin from its inverse frequencies (head_dim / 2 fp32),
      read whole.
    """
    # A Conv1D exists only where transformers built the model, which imported it: a native model's
    # worker never imports transformers (seconds of CPU) to ask.
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    matmuls = (torch.nn.Linear, *((pytorch_utils.Conv1D,) if pytorch_utils else ()))
    matmul_weights = {id(p): p for part in module.modules() if isinstance(part, matmuls)
                      for p in part.parameters(recurse=False)}
    touched = float(stored_bytes)
    for part in module.modules():
        if isinstance(part, torch.nn.Embedding) and id(part.weight) not in matmul_weights:
            rows = batch if part.num_embeddings == vocab_size else 1
            table = _local(part.weight)  # under tensor parallelism, this rank's rows of the vocabulary
            touched += (rows - table.shape[0]) * part.embedding_dim * table.element_size()
    if autocast_dtype is not None:
        width = torch.finfo(autocast_dtype).bits // 8
        touched += sum(2 * width * _local(p).numel() for p in matmul_weights.values() if p.dtype == torch.float32)
    for name, buffer in module.named_buffers():
        leaf = name.rpartition(".")[2]
        if leaf in ("rope_cos", "rope_sin"):
            touched += buffer.shape[-1] * buffer.element_size()
        elif leaf == "inv_freq":
            touched += buffer.numel() * buffer.element_size()
    return touched


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (tensor parallelism, FSDP), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
