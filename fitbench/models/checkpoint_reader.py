"""A checkpoint directory's tensors read one at a time, so that a model built layer by layer holds in
memory only the tensors of the module being made: safetensors shards through ``safe_open`` (each tensor
copied out of its file alone), ``pytorch_model*.bin`` shards through ``torch.load(mmap=True)`` (the file
mapped, a tensor's pages read when it is copied). A tensor comes back on the CPU in the dtype asked, so a
device receives only the bytes it keeps; ``read`` lists the names read, in order.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch


class CheckpointReader:
    """The tensors of the checkpoint in ``directory`` by their names in it."""

    def __init__(self, directory: str | Path):
        from safetensors import safe_open

        self.directory = Path(directory)
        self.read: list[str] = []
        self._where: dict[str, Any] = {}  # name -> the open shard that holds it
        shards = sorted(self.directory.glob("*.safetensors"))
        for shard in shards:
            handle = safe_open(str(shard), framework="pt", device="cpu")
            self._where |= {key: handle for key in handle.keys()}
        if not shards:
            for shard in sorted(self.directory.glob("pytorch_model*.bin")):
                state = torch.load(shard, map_location="cpu", weights_only=True, mmap=True)
                self._where |= {key: state for key in state}
        if not self._where:
            raise ValueError(f"{self.directory} holds no *.safetensors nor pytorch_model*.bin shard: no checkpoint "
                             f"to read; pass a directory that transformers' save_pretrained wrote")

    @functools.cached_property
    def config(self) -> dict[str, Any]:
        """The directory's ``config.json``, read once."""
        return json.loads((self.directory / "config.json").read_text())

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> list[str]:
        """Every tensor's name."""
        return list(self._where)

    def tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor ``name``, on the CPU, in ``dtype``."""
        source = self._where[name]
        value = source[name] if isinstance(source, dict) else source.get_tensor(name)
        self.read.append(name)
        return value.to(dtype)
