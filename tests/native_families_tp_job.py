"""One rank of a tensor-parallel job over the native Falcon and GPT-2 blocks, for
tests/test_native_families_tp.py; started by torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/native_families_tp_job.py OUT.json

Two CPU ranks (gloo), one "tp" mesh of 2. For each of ``VARIANTS`` (Falcon's new decoder block with
grouped key/value heads, Falcon-7B's multi-query block with one shared LayerNorm, GPT-2), every rank
builds its shards from seed ``SEED`` as a run does (``fitbench.worker.stages.build_stage`` cut by
``fitbench.worker.parallelize.tensor_parallel_cut``), moves every bias and norm off its initial value
(``perturb``: the random build leaves biases at zero, where adding one once or twice is the same), and
then generates on local shards: the prefill's logits and ``DECODE`` decode steps, through the eager
``decode`` and through ``decode_step``, the static-shaped step a CUDA graph captures, here replayed
eagerly. A training forward pass through DTensor gives the loss. Rank 0 writes every rank's figures.
"""

import json
import sys
import zlib
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from fitbench.models.backends import NativeLM
from fitbench.models.graphs import Replay
from fitbench.models.registry import resolve
from fitbench.worker.build import build_tensor_parallel
from fitbench.worker.cross_entropy import cross_entropy
from fitbench.worker.loops import random_tokens
from fitbench.worker.parallelize import local_shards, tensor_parallel_cut
from fitbench.worker.ranks import Rank, gather_json, process_group
from fitbench.worker.stages import build_stage
from fitbench.worker.tensor_parallel import device_mesh
from fitbench.spec import Layout, Stage

SEED, BATCH, PROMPT, DECODE, SEQ_LEN = 0, 2, 6, 4, 8
LAYOUT = Layout(tp=2)
TINY = dict(hidden_size=64, num_layers=2, num_heads=8, ffn_size=160, vocab_size=256, max_seq_len=32)
VARIANTS = {
    "falcon-grouped": replace(resolve("falcon-40b"), name="tiny-falcon", num_kv_heads=2, **TINY,
                              extra_hf_config={"bias": True}),
    "falcon-multi-query": replace(resolve("falcon-40b"), name="tiny-falcon-7b", num_kv_heads=1, **TINY,
                                  extra_hf_config={"bias": True, "new_decoder_architecture": False,
                                                   "multi_query": True}),
    "gpt2": replace(resolve("gpt2"), name="tiny-gpt2", num_kv_heads=8, **TINY),
}
TIMEOUT = timedelta(seconds=60)


@torch.no_grad()
def perturb(model: torch.nn.Module) -> None:
    """Add 0.1 N(0, 1) to every one-dimensional parameter (biases, norms), drawn from a generator seeded by
    the parameter's name, so one process and every tensor-parallel rank add the same whole tensor; a
    DTensor adds its own part of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, parameter in model.named_parameters():
        if parameter.dim() != 1:
            continue
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        whole = 0.1 * torch.randn(parameter.shape, generator=generator).to(parameter.dtype)
        if isinstance(parameter, DTensor):
            parameter.to_local().add_(distribute_tensor(whole, parameter.device_mesh, parameter.placements,
                                                        src_data_rank=None).to_local())
        else:
            parameter.add_(whole)


def generation(arch, rank: Rank, mesh, graphed: bool) -> dict:
    """The prefill's and ``DECODE`` decode steps' logits on local shards, ``graphed`` through
    ``decode_step``."""
    applied: dict = {}
    torch.manual_seed(SEED)
    cut = tensor_parallel_cut(mesh, rank.device, applied, inference=True)
    module = build_stage(arch, Stage.of(arch.num_layers, 0, 1), rank.device, torch.float32, shard=cut)
    perturb(module)
    local_shards(module, applied)
    lm = NativeLM(module, torch.float32, cuda_graphs=graphed, capture=(lambda step: Replay(step)) if graphed else None)
    return {"logits": logits(lm, arch, rank.device), "applied": applied,
            "cache_kv_heads": lm.cache.layer_keys[0].shape[1], "decoding": lm.decoding}


def logits(lm: NativeLM, arch, device: torch.device) -> list:
    prompt = random_tokens(arch.vocab_size, BATCH, PROMPT, device, SEED + 1)
    following = random_tokens(arch.vocab_size, BATCH, DECODE, device, SEED + 2)
    with torch.inference_mode():
        steps = [lm.prefill(prompt, PROMPT + DECODE)]
        steps += [lm.decode(following[:, i:i + 1]).clone() for i in range(DECODE)]
    return [step.float().flatten().tolist() for step in steps]


def training_loss(arch, rank: Rank, mesh) -> dict:
    """One training forward pass through DTensor, sequence parallel where positions are rotary (as
    ``fitbench.worker.build.build_layout`` chooses), and its loss."""
    torch.manual_seed(SEED)
    sequence_parallel = arch.position_embeddings == "rotary"
    module, applied = build_tensor_parallel(arch, Stage.of(arch.num_layers, 0, 1), mesh, rank.device, torch.float32,
                                            sequence_parallel=sequence_parallel)
    perturb(module)
    tokens = random_tokens(arch.vocab_size, BATCH, SEQ_LEN + 1, rank.device, SEED)
    loss = cross_entropy(NativeLM(module, torch.float32).logits(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return {"loss": loss.item(), "sequence_parallel": applied["sequence_parallel"]}


@record
def main(argv: list[str]) -> None:
    out = Path(argv[0])
    rank = Rank.from_environment("cpu")
    with process_group(rank, TIMEOUT):
        mesh = device_mesh(LAYOUT, rank.device.type)
        figures = {name: {"infer": generation(arch, rank, mesh, graphed=False),
                          "infer_graphed": generation(arch, rank, mesh, graphed=True),
                          "train": training_loss(arch, rank, mesh)}
                   for name, arch in VARIANTS.items()}
        rows = gather_json(rank, {"rank": rank.rank, **figures})
        if rank.main:
            out.write_text(json.dumps(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
