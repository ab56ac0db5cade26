"""One rank of a small tensor-parallel job, for tests/test_tensor_parallel.py; started by torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/tensor_parallel_job.py OUT.json

Four CPU ranks (gloo) on a ("dp_shard", "tp") mesh of 2 x 2. First each variant of ``VARIANTS`` is
sharded over the "tp" pairs (both pairs do the same work): one training forward and backward pass
under sequence parallelism (the loss and a sample of a few gradients), then a generation on local
shards (the prefill's logits and ``DECODE`` steps, the eager forward and the ``decode_step`` that a
CUDA graph captures on a GPU); the operators of a prefill and a decode step of ``tiny`` are counted
by name (``dispatched``), for comparison with one process's. Then ``tiny`` trains ``STEPS`` steps under FSDP x TP (``Layout(dp_shard=2,
tp=2)``), each data-parallel pair on its own batch. Every rank builds its shards from seed ``SEED``
on the meta device (``fitbench.worker.build.build_tensor_parallel``), drawing the whole weights as one process does and
keeping its part; the build of ``tiny`` records the largest tensor it allocated and the rank's
parameter storage. Last, ``tiny`` runs on ``PIPELINE`` (two stages of two tensor-parallel ranks
each, ``build_pipelined``): a forward pass and the generation above, the last stage's ranks keeping
their logits. Rank 0 writes every rank's figures to OUT.json.
"""

import json
import sys
from collections import Counter
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.distributed.elastic.multiprocessing.errors import record

from fitbench.models.backends import NativeLM
from fitbench.models.graphs import Replay
from fitbench.models.registry import resolve
from fitbench.precisions import policy
from fitbench.worker.build import build_layout, build_pipelined, build_tensor_parallel
from fitbench.worker.cross_entropy import cross_entropy
from fitbench.worker.loops import make_step, random_tokens
from fitbench.worker.parallel import data_seed
from fitbench.worker.parallelize import parallelize
from fitbench.worker.ranks import Rank, gather_json, process_group
from fitbench.worker.tensor_parallel import data_parallel_rank, device_mesh
from fitbench.spec import Layout, RunSpec, Stage
from test_models import counting_compiler

SEED, BATCH, SEQ_LEN, STEPS, PRECISION = 0, 2, 32, 3, "fp32"
PROMPT, DECODE = 12, 4
LAYOUT = Layout(dp_shard=2, tp=2)
PIPELINE = Layout(pp=2, tp=2)
VARIANTS = {"tiny": resolve("tiny"), "tiny-1kv": replace(resolve("tiny"), num_kv_heads=1)}
# gradients sampled: a sharded matrix, a k projection (replicated with one kv head), a norm (under
# sequence parallelism) and the tied embedding
GRADIENTS = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
             "model.layers.0.input_layernorm.weight", "model.embed_tokens.weight")
SAMPLE = 101  # every SAMPLE-th element of a gradient or a row of logits
TIMEOUT = timedelta(seconds=60)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank, from a DTensor's shards."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def sample(tensor: torch.Tensor) -> list[float]:
    return full(tensor).detach().float().flatten()[::SAMPLE].tolist()


class LargestAllocation(TorchDispatchMode):
    """The bytes of the largest tensor with storage that any operation returns while it is on (a
    DTensor's: its local shard's)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            if isinstance(local, torch.Tensor) and not local.is_meta:
                self.bytes = max(self.bytes, local.untyped_storage().nbytes())
        return out


class DispatchedOps(TorchDispatchMode):
    """How many times each operator runs while it is on, by name (``aten.mm.default``, and the
    collectives' ``c10d.allreduce_.default``...); an operator given a tensor subclass (a DTensor)
    is named with it, ``aten.view_as.default on DTensor``, since a subclass dispatches its own
    operators on the host, beneath this mode, for each one it is given."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[" on ".join([str(func), *sorted(t.__name__ for t in types)])] += 1
        return func(*args, **(kwargs or {}))


def dispatched(lm: NativeLM, device: torch.device) -> dict[str, dict[str, int]]:
    """The operators of one prefill of ``PROMPT`` tokens and of one ``decode_step`` after it (the
    function a CUDA graph captures), counted by name."""
    prompt = random_tokens(lm.module.config.vocab_size, BATCH, PROMPT, device, SEED + 1)
    token = random_tokens(lm.module.config.vocab_size, BATCH, 1, device, SEED + 2)
    counts = {}
    with torch.inference_mode():
        with DispatchedOps() as ops:
            lm.prefill(prompt, PROMPT + DECODE)
        counts["prefill"] = dict(ops.counts)
        position = torch.tensor([PROMPT], device=device)
        with DispatchedOps() as ops:
            lm.module.decode_step(token, lm.cache, position)
        counts["decode_step"] = dict(ops.counts)
    return counts


def built(arch, rank: Rank, mesh, sequence_parallel: bool = False, inference: bool = False) -> tuple[NativeLM, dict]:
    """Every rank's shards of the model of seed ``SEED``, and what was applied."""
    torch.manual_seed(SEED)
    module, applied = build_tensor_parallel(arch, Stage.of(arch.num_layers, 0, 1), mesh, rank.device,
                                            policy(PRECISION).weight_dtype, sequence_parallel=sequence_parallel,
                                            inference=inference)
    return NativeLM(module, policy(PRECISION).compute_dtype), applied


def build_memory(arch, rank: Rank, mesh) -> dict:
    """The largest tensor the build allocated and the rank's parameter storage, in bytes."""
    with LargestAllocation() as largest:
        lm, _ = built(arch, rank, mesh)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in lm.module.parameters()]
    return {"largest_allocation": largest.bytes, "parameter_bytes": sum(t.numel() * t.element_size() for t in local)}


def training_pass(arch, rank: Rank, mesh) -> dict:
    lm, applied = built(arch, rank, mesh, sequence_parallel=True)
    tokens = random_tokens(arch.vocab_size, BATCH, SEQ_LEN + 1, rank.device, SEED)
    loss = cross_entropy(lm.logits(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    parameters = dict(lm.module.named_parameters())
    return {"loss": loss.item(), "gradients": {name: sample(parameters[name].grad) for name in GRADIENTS},
            "applied": applied, "loss_function": type(loss.grad_fn).__name__}


def generation(arch, rank: Rank, mesh, graphed: bool, compiled: bool = False) -> dict:
    """The prefill's logits and ``DECODE`` decode steps' on fixed tokens, on the local shards that
    generation runs; ``graphed``: the decode goes through ``decode_step``, the function a CUDA graph
    captures, here replayed eagerly; ``compiled``: through the compiled regions as well, each graph
    that Dynamo traces run as traced (no inductor), and the collectives counted in them."""
    lm, applied = built(arch, rank, mesh, inference=True)
    graphs: list[torch.fx.GraphModule] = []
    if graphed:
        lm = NativeLM(lm.module, lm.cache_dtype, cuda_graphs=True, capture=lambda step: Replay(step),
                      compile_decode=compiled, compiler=counting_compiler(graphs) if compiled else None)
    prompt = random_tokens(arch.vocab_size, BATCH, PROMPT, rank.device, SEED + 1)
    following = random_tokens(arch.vocab_size, BATCH, DECODE, rank.device, SEED + 2)
    with torch.inference_mode():
        logits = [lm.prefill(prompt, PROMPT + DECODE)]
        logits += [lm.decode(following[:, i:i + 1]).clone() for i in range(DECODE)]
    return {"logits": [sample(step) for step in logits], "cache_kv_heads": lm.cache.layer_keys[0].shape[1],
            "decoding": lm.decoding, "applied": applied,
            "traced_collectives": [sum("all_reduce" in str(node.target) or "all_gather" in str(node.target)
                                       for node in graph.graph.nodes) for graph in graphs]}


def fsdp_tp_losses(rank: Rank) -> tuple[list[float], dict]:
    arch, precision = resolve("tiny"), policy(PRECISION)
    torch.manual_seed(SEED)
    lm, mesh, applied = build_layout(arch, LAYOUT, precision, "train", SEQ_LEN, rank)
    applied = parallelize(lm, LAYOUT, precision, rank, tensor_parallel=applied, mesh=mesh)
    tokens = random_tokens(arch.vocab_size, BATCH, SEQ_LEN + 1, rank.device,
                           data_seed(SEED, data_parallel_rank(LAYOUT, rank.rank)))
    step = make_step("train", lm, precision, tokens, rank.device)
    return [step().item() for _ in range(STEPS)], applied


def pipelined(rank: Rank) -> dict:
    """Tensor-parallel pipeline stages of ``tiny``: the forward pass's logits and the prefill's and decode
    steps' (on the last stage), and what each rank holds."""
    spec = RunSpec(model="tiny", backend="native", mode="infer", precision=PRECISION, batch_size=BATCH,
                   seq_len=PROMPT, new_tokens=DECODE, device="cpu", warmup_steps=0, measure_steps=1,
                   seed=SEED, layout=PIPELINE)
    torch.manual_seed(SEED)
    lm, _ = build_pipelined(spec, resolve("tiny"), policy(PRECISION), rank)
    prompt = random_tokens(lm.module.config.vocab_size, BATCH, PROMPT, rank.device, SEED + 1)
    following = random_tokens(lm.module.config.vocab_size, BATCH, DECODE, rank.device, SEED + 2)
    tokens = random_tokens(lm.module.config.vocab_size, BATCH, SEQ_LEN, rank.device, SEED)
    with torch.inference_mode():
        forward = lm.forward_pass(tokens)
        logits = [lm.prefill(prompt, PROMPT + DECODE)]
        logits += [lm.decode(following[:, i:i + 1]).clone() for i in range(DECODE)]
    last = lm.stage.last
    return {"stage": lm.stage.index, "applied": lm.applied(None), "cache_kv_heads": lm.cache.layer_keys[0].shape[1],
            "forward": sample(forward) if last else None, "logits": [sample(step) for step in logits] if last else None}


@record
def main(argv: list[str]) -> None:
    out = Path(argv[0])
    rank = Rank.from_environment("cpu")
    with process_group(rank, TIMEOUT):
        tp_mesh = device_mesh(LAYOUT, rank.device.type)["tp"]
        figures = {"build": build_memory(VARIANTS["tiny"], rank, tp_mesh),
                   "dispatched": dispatched(built(VARIANTS["tiny"], rank, tp_mesh, inference=True)[0], rank.device)}
        for name, arch in VARIANTS.items():
            figures[name] = {"train": training_pass(arch, rank, tp_mesh),
                             "infer": generation(arch, rank, tp_mesh, graphed=False),
                             "infer_graphed": generation(arch, rank, tp_mesh, graphed=True),
                             "infer_compiled": generation(arch, rank, tp_mesh, graphed=True, compiled=True)}
        losses, applied = fsdp_tp_losses(rank)
        figures["fsdp+tp"] = {"losses": losses, "applied": applied}
        figures["pipeline+tp"] = pipelined(rank)
        rows = gather_json(rank, {"rank": rank.rank, **figures})
        if rank.main:
            out.write_text(json.dumps(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
