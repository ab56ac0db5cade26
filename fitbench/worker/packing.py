"""A module's tensors moved into one allocation of their own, so that what a model keeps never sits
between what it frees.

Why: quantizing a model layer by layer (``fitbench.worker.quantize.build_quantized_native``) interleaves,
in the caching allocator's one expandable segment, what stays (each layer's quantized weights) with
what goes (the layer in bf16, the quantizers' temporaries). The freed ranges left between the weights
are too short for the next layer's requests, so the segment grows although its free bytes would
suffice: on an H200 the build held 0.02 to 3.1 GB beyond its allocations, with no closed form in the
model's shape (``benchmarks/results/2026-11-23-h200-build-reserve``). Packed, each layer's weights
leave the default pool; its temporaries are then freed as one range, which the next layer reuses.

``Packer.pack`` gathers every tensor holding a module's state (``state_tensors``), copies each
distinct storage into one block, at offsets rounded up to 512 bytes (the allocator's granule, which
keeps every dtype aligned), and re-points every tensor at its place in the block with ``Tensor.set_``, so
the modules, their parameters, bitsandbytes' ``CB``/``SCB`` and ``QuantState`` and torchao's inner
tensors all keep working on the same objects. The old storages are freed once nothing refers to them.

On a GPU the block comes from a private ``torch.cuda.MemPool`` kept for the model's whole life: the
caching allocator serves a private pool's request of 10 MiB or more with a segment of its own rounded
up to 2 MiB, and smaller ones from shared 2 MiB (at most 1 MiB) or 20 MiB segments
(``c10/cuda/CUDACachingAllocator.cpp``, ``get_allocation_size``).
"""

from __future__ import annotations

import torch
from torch import nn

GRANULE = 512  # bytes: the caching allocator rounds every request to a multiple of this


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 512 bytes."""
    return -(-nbytes // GRANULE) * GRANULE


def _inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold a tensor subclass's data (torchao's quantized weights wrap their int or
    float8 data and scales, recursively), or the tensor itself when it holds its own storage."""
    if hasattr(type(tensor), "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return [leaf for name in names for leaf in _inner_tensors(getattr(tensor, name))]
    return [tensor]


def _tensors_among(value, seen: set[int], found: dict[int, torch.Tensor], depth: int) -> None:
    """Collect the tensors in ``value``: a tensor, an object's attributes (bitsandbytes keeps ``CB``,
    ``SCB`` on its parameters and a ``QuantState`` of tensors beside them), lists, tuples, dicts."""
    if id(value) in seen or depth < 0 or isinstance(value, (str, bytes, int, float, bool, type(None), nn.Module)):
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        found.update((id(leaf), leaf) for leaf in _inner_tensors(value))
        attributes = getattr(value, "__dict__", {})
    elif isinstance(value, dict):
        attributes = value
    elif isinstance(value, (list, tuple)):
        attributes = dict(enumerate(value))
    else:
        attributes = getattr(value, "__dict__", {})
    for item in attributes.values():
        _tensors_among(item, seen, found, depth - 1)


def state_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every tensor object holding part of ``module``'s state: parameters, buffers, and the tensors
    reachable from the non-module attributes of each submodule and of each parameter."""
    seen: set[int] = set()
    found: dict[int, torch.Tensor] = {}
    for submodule in module.modules():
        for value in submodule.__dict__.values():
            if isinstance(value, dict):  # _parameters, _buffers, and plain attributes alike
                for item in value.values():
                    _tensors_among(item, seen, found, depth=4)
            elif not isinstance(value, nn.Module):
                _tensors_among(value, seen, found, depth=4)
    return list(found.values())


def _resolved(device: torch.device) -> torch.device:
    """``device`` as tensors name it ("cuda" as "cuda:0"), to compare with their devices."""
    return torch.empty(0, device=device).device


def _storages(module: nn.Module, device: torch.device) -> dict[int, list[torch.Tensor]]:
    """The tensors of ``module``'s state on ``device`` (resolved), grouped by the storage they share
    (by its address)."""
    groups: dict[int, list[torch.Tensor]] = {}
    for tensor in state_tensors(module):
        if tensor.device == device and tensor.untyped_storage().nbytes():
            groups.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
    return groups


def _footprint(groups: dict[int, list[torch.Tensor]]) -> int:
    """The sum of the groups' storage sizes, each rounded up to 512 bytes."""
    return sum(aligned(tensors[0].untyped_storage().nbytes()) for tensors in groups.values())


def packed_bytes(module: nn.Module, device: torch.device) -> int:
    """What ``Packer.pack`` would take for ``module``: the distinct storages on ``device``, each rounded
    up to 512 bytes."""
    return _footprint(_storages(module, _resolved(device)))


class Packer:
    """Moves modules' state into blocks of a pool of its own: on a GPU a private ``torch.cuda.MemPool``,
    kept as long as the packer. ``reserve`` opens one block that the following ``pack`` calls fill from
    its start, so that matrices packed one by one as they are quantized end up in one allocation;
    what does not fit gets a block of its own."""

    def __init__(self, device: torch.device) -> None:
        self.device = _resolved(device)
        self.pool = torch.cuda.MemPool() if self.device.type == "cuda" else None
        self._open: torch.Tensor | None = None
        self._used = 0
        self._blocks: set[int] = set()  # the address of every block handed out

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.pool is None:
            block = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        else:
            with torch.cuda.use_mem_pool(self.pool):
                block = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._blocks.add(block.untyped_storage().data_ptr())
        return block

    @property
    def open_block(self) -> tuple[int, int]:
        """The open block's size and the bytes of it in use (0, 0 when none is open)."""
        return (self._open.numel(), self._used) if self._open is not None else (0, 0)

    def reserve(self, nbytes: int) -> None:
        """Open a block of ``nbytes`` for the next ``pack`` calls."""
        self._open, self._used = self._allocate(nbytes), 0

    @torch.no_grad()
    def pack(self, module: nn.Module) -> int:
        """Move every storage of ``module``'s state on the device (but those already packed) into the
        open block, or a new one when it lacks room; return the bytes taken."""
        groups = {address: tensors for address, tensors in _storages(module, self.device).items()
                  if address not in self._blocks}
        total = _footprint(groups)
        if not total:
            return 0
        if self._open is not None and self._used + total <= self._open.numel():
            block, start = self._open, self._used
            self._used += total
        else:
            block, start = self._allocate(total), 0
        packed = block.untyped_storage()
        for tensors in groups.values():
            storage = tensors[0].untyped_storage()
            old = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
            block[start:start + storage.nbytes()].copy_(old)
            for tensor in tensors:
                size = tensor.element_size()
                tensor.set_(packed, (start + tensor.storage_offset() * size) // size, tensor.size(), tensor.stride())
            start += aligned(storage.nbytes())
        return total
