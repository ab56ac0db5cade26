"""The exact estimator: run one configuration's real loop on fake tensors and record the peak.

Under ``FakeTensorMode`` every tensor has a shape, dtype and device but no storage, so a 70B
training step "runs" on a laptop without memory. ``LiveStorage``, a dispatch mode, sees every
storage an operator creates (parameters, gradients, optimizer state, activations, temporaries)
and a finalizer sees it freed, so it knows the live bytes after every operator and their peak.
torch keeps one Python object per storage for the storage's whole life, which is what makes the
finalizer fire exactly when the memory would be returned. The loop is fitbench's own
(``fitbench.worker.loops``), so what is traced is what the worker runs, with the model of its backend:
the native decoder, or transformers' model of the family (``fitbench.models.backends.HuggingFaceLM``),
built on the meta device and given fake storage. Training traces two steps: the first creates
AdamW's state, the second is the steady state.

It measures live tensor bytes, as ``torch.cuda.max_memory_allocated`` does; the CUDA context and
the allocator's slack are outside it. On a machine without a GPU the trace runs on fake CPU
tensors, whose kernels (the CPU flash attention) save what the CUDA ones save.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from fitbench.models.architecture import Architecture
from fitbench.models.architecture import backend_error
from fitbench.models.backends import CausalLM, HuggingFaceLM, NativeLM
from fitbench.models.hf import hf_config
from fitbench.models.native import meta_model
from fitbench.precisions import policy as precision_policy
from fitbench.worker.allocator import Allocator
from fitbench.worker.loops import generate, make_step
from fitbench.worker.parallelize import parallelize
from fitbench.worker.ranks import Rank
from fitbench.worker.timing import DeviceClock
from fitbench.spec import Layout

TRAINING_STEPS = 2
DECODE_STEPS = 2


class LiveStorage(TorchDispatchMode):
    """Live and peak bytes of every storage created while active, plus those ``adopt`` is given,
    each also served, in the same order, by a replay of the caching allocator."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.allocator = Allocator()
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._count = 0

    def adopt(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage in self._seen:
            return
        size = storage.nbytes()
        self._count += 1
        self._seen[storage] = self._count
        self.live += size
        self.peak = max(self.peak, self.live)
        self.allocator.malloc(self._count, size)
        weakref.finalize(storage, self._free, self._count, size)

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self.allocator.free(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self.adopt(value)
        return out


@dataclass(frozen=True)
class TracedPeak:
    """``peak_bytes``: live tensor bytes at their peak (``torch.cuda.max_memory_allocated``);
    ``peak_reserved``: the caching allocator's mapped bytes at their peak
    (``torch.cuda.max_memory_reserved``), from ``fitbench.worker.allocator``."""

    peak_bytes: int
    device: str
    peak_reserved: int = 0


def trace_peak(arch: Architecture, mode: str, precision: str, batch: int, seq_len: int, *,
               new_tokens: int = DECODE_STEPS + 1, activation_checkpointing: bool = False,
               checkpointed_layers: int | None = None, device: str | None = None, backend: str = "native",
               fused: bool = False) -> TracedPeak:
    """Peak live bytes of ``mode`` for ``arch`` on ``backend`` (native or hf), traced with fake tensors;
    ``checkpointed_layers``: with checkpointing, the first N layers' (every layer's when None);
    ``fused``: the native model with its fused projections, as a run on one GPU builds it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    problem = backend_error(arch, backend)
    if problem:
        raise ValueError(problem)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    target = torch.device(device)
    policy = precision_policy(precision)

    module = _meta_module(arch, backend, policy.weight_dtype, fused)
    with FakeTensorMode(allow_non_fake_inputs=True):
        lm = _fake_model(arch, module, backend, policy, target, activation_checkpointing, checkpointed_layers)
        tracker = LiveStorage()
        for tensor in [*lm.module.parameters(), *lm.module.buffers()]:
            tracker.adopt(tensor)
        with tracker:
            if mode == "infer":
                prompt = torch.zeros((batch, seq_len), dtype=torch.long, device=target)
                generate(lm, prompt, min(new_tokens, DECODE_STEPS + 1), policy, DeviceClock(target), target)()
            else:
                tokens = torch.zeros((batch, seq_len + 1), dtype=torch.long, device=target)
                step = make_step(mode, lm, policy, tokens, target)
                for _ in range(TRAINING_STEPS if mode == "train" else 1):
                    step()
    return TracedPeak(peak_bytes=tracker.peak, device=str(target), peak_reserved=tracker.allocator.peak_reserved)


def _meta_module(arch: Architecture, backend: str, dtype: torch.dtype, fused: bool) -> nn.Module:
    """The model ``backend`` builds, on the meta device (built outside ``FakeTensorMode``)."""
    if backend == "native":
        return meta_model(arch, dtype, fused)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(arch), dtype=dtype)


def _fake_model(arch: Architecture, module: nn.Module, backend: str, policy, target: torch.device,
                activation_checkpointing: bool, checkpointed_layers: int | None = None) -> CausalLM:
    """The meta ``module`` given fake storage, wrapped as ``fitbench.models.backends.load_model``
    wraps it (called inside ``FakeTensorMode``)."""
    if backend == "native":
        module.to_empty(device=target)
        if arch.tie_embeddings:
            module.lm_head.weight = module.model.embed_tokens.weight
        # Eager decoding: a CUDA graph of the decode step holds the same tensors, one layer's at a time,
        # and cannot be captured from fake ones.
        lm: CausalLM = NativeLM(module, cache_dtype=policy.compute_dtype)
    else:
        # transformers' modules hold weak references to their parameters, which ``to_empty`` cannot
        # swap: give each parameter and buffer fake storage in place.
        for part in module.modules():
            for name, parameter in list(part.named_parameters(recurse=False)):
                setattr(part, name, nn.Parameter(torch.empty_like(parameter, device=target),
                                                 requires_grad=parameter.requires_grad))
            for name, buffer in list(part.named_buffers(recurse=False)):
                setattr(part, name, torch.empty_like(buffer, device=target))
        module.tie_weights()
        lm = HuggingFaceLM(module, static_cache=policy.compute_dtype == policy.weight_dtype)
    single = Rank(rank=0, local_rank=0, world_size=1, local_world_size=1, device=target, launched=False)
    parallelize(lm, Layout(), policy, single, activation_checkpointing=activation_checkpointing,
                checkpointed_layers=checkpointed_layers)
    return lm
