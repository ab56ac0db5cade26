"""Tensor parallelism of a built native model over the ranks of a "tp" device mesh, the Megatron-LM
split (Shoeybi et al. 2019) as torchtitan's ``apply_tp`` lays it out with DTensor
(``torch.distributed.tensor.parallel.parallelize_module``):

- attention: q (and k / v where the kv heads divide by the degree) column-wise, so each rank holds
  ``n_heads / tp`` whole query heads (and ``n_kv_heads / tp`` kv heads) and attends over them alone;
  o row-wise, its partial sums all-reduced: one all-reduce per attention block;
- MLP: gate and up (a GELU MLP's up alone) column-wise, down row-wise: one all-reduce per MLP block;
- biases (Qwen2's q, k, v; Falcon's and GPT-2's every matrix): a column-wise matmul's cut with its
  rows, a row-wise matmul's held whole and added once, after the sum (on every rank before it, it
  would be counted ``tp`` times). Falcon's parallel block sums its attention and its MLP each with
  its own all-reduce, two per layer as Llama's sequential block: one all-reduce of the two partial
  sums together would halve them, at the cost of a layer that knows it is cut;
- GPT-2's learned position table replicated, added to the embedding's gathered rows on every rank;
- the embedding sharded over the vocabulary (``RowwiseParallel`` with a replicated input: each rank
  looks up the tokens of its rows, the others' lookups are zeros, and an all-reduce sums them) and
  the output projection column-wise over the vocabulary, its logits gathered on every rank
  (``Replicate``), so the loss and generation see whole logits and run unchanged. These are
  what the planner counts: the embedding and the output projection each 1 / tp per rank (a tied
  pair shares one shard, both being split along the vocabulary);
- the norms replicated; with ``sequence_parallel`` (training) they run on 1 / tp of the sequence
  each (``SequenceParallel``), the row-wise outputs reduce-scattered along the sequence instead of
  all-reduced and the column-wise inputs all-gathered, so the norms' inputs and outputs and the
  residual stream kept for the backward pass are 1 / tp per rank, for the same bytes on the wire.
  Generation keeps the plain layout: a decode step has one position per sequence, nothing to split.
  A model with learned positions (GPT-2) trains without it: its position rows are added to the
  whole sequence's embeddings, which sequence parallelism would hold cut.

Fewer kv heads than ranks, or a count the degree does not divide: the k and v projections are
replicated and every rank computes all kv heads, keeps those its own query heads read and caches only
those (``kv_heads_of_rank``). In training each rank's gradients then reach only the heads it kept, so
their sum over the ranks is the gradient, summed in the backward pass (``_sum_gradients``).

No rank ever holds the whole model (``fitbench.worker.build.build_tensor_parallel``): the model is made on the meta
device, sharded there (``parallelize_tensor``, as torchtitan does), and only the local shards get
storage; then every rank draws the whole model's random weights from the same seed in the order a
single process draws them, each weight into one scratch buffer, and keeps its own part of each
(``fitbench.models.native.replay_random_weights`` with ``write_shard``). The ranks draw identical
weights, so nothing is broadcast, and a TP job's logits are a single process's of the same seed. The
peak of a rank during the build is its shards plus that scratch, one whole weight, the largest
(the embedding's, for a large vocabulary), as the planner counts it.

Two ways run this split. Training, and anything under FSDP, runs through DTensor, which autograd
(the sequence-parallel layouts, the replicated kv heads' gradient sums) and FSDP2's second mesh
dimension need. Generation and ``forward`` (``inference``) need none of it, and pay for it on the host:
DTensor wraps every matmul's input and output and works out each operator's sharding on every call,
and under ``inference_mode`` a row-wise matmul (``aten.linear`` of a ``Shard(-1)`` input by a
``Shard(1)`` weight, for which DTensor has no rule) reaches it whole: its sharding is propagated with
fake tensors, fails, is not cached (the cache keeps no exception), and the call is decomposed, two
of each layer's matmuls so on every call (profiled on CPU ranks: a prefill of ``tiny`` at TP 2 took
several times one process's host time, the same ops and collectives aside). So inference keeps the
shards as plain local tensors (``localize`` after the build) and runs one process's operators on
them: an all-reduce in place after each row-wise matmul (``RowShardLinear``), the embedding's
lookup of its own rows (``VocabShardEmbedding``) and the logits' all-gather (``_gather_vocabulary``),
nothing else per layer; each layer's column-wise shards stacked into one matmul as the one-GPU model
fuses them (``fuse_local_projections``), and on GPUs the decode step's small all-reduces summed through
symmetric memory (``small_all_reduces``).

The decode step stays one static-shaped function of device tensors (``NativeCausalLM.decode_step``):
its collectives are NCCL calls on the current stream, which a CUDA graph captures with the kernels,
so ``fitbench.models.graphs`` captures it under TP as on one GPU.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fitbench.models.native import DecoderLayer, FusedLinear, NativeCausalLM
from fitbench.worker.collectives import all_gather
from fitbench.spec import ONE_SHOT_BYTES, Layout, LayoutError, RunSpec


def device_mesh(layout: Layout, device_type: str):
    """The job's mesh: ("tp",) over every rank, ("dp_shard", "tp") for FSDP x TP or ("pp", "tp") for
    TP inside pipeline stages, the tensor-parallel ranks innermost (consecutive global ranks, one
    node's fast links under torchrun)."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout.dp_replicate > 1 or (layout.pp > 1 and layout.dp_shard > 1):
        raise LayoutError(f"tensor parallelism combines here with FSDP or with pipeline stages, one of them; "
                          f"{layout.label} asks for more")
    if layout.pp > 1:
        return init_device_mesh(device_type, (layout.pp, layout.tp), mesh_dim_names=("pp", "tp"))
    if layout.dp_shard == 1:
        return init_device_mesh(device_type, (layout.tp,), mesh_dim_names=("tp",))
    return init_device_mesh(device_type, (layout.dp_shard, layout.tp), mesh_dim_names=("dp_shard", "tp"))


def tensor_mesh(mesh):
    """The "tp" dimension of a job's mesh (``device_mesh``)."""
    return mesh["tp"] if mesh.ndim > 1 else mesh


def data_parallel_rank(layout: Layout, rank: int) -> int:
    """The data-parallel group of global rank ``rank``: its tensor-parallel ranks are consecutive and
    must draw the same batch."""
    return rank // (layout.world_size // layout.data_parallel)


def kv_heads_of_rank(n_heads: int, n_kv_heads: int, tp: int, tp_rank: int) -> list[int]:
    """The kv heads, in the order its attention reads them, that tensor-parallel rank ``tp_rank``'s
    query heads (``n_heads / tp`` consecutive ones) use: query head h reads kv head h // (H / KV).

    Where the local query heads split evenly over those kv heads, each is listed once (grouped-query
    attention on the rank); otherwise one per local query head, which attention reads as MHA."""
    local = n_heads // tp
    group = n_heads // n_kv_heads
    used = [(tp_rank * local + i) // group for i in range(local)]
    unique = sorted(set(used))
    per_head = local // len(unique)
    if local % len(unique) == 0 and used == [unique[i // per_head] for i in range(local)]:
        return unique
    return used


def split_heads(n_heads: int, n_kv_heads: int, tp: int, tp_rank: int) -> list[int] | None:
    """How rank ``tp_rank`` of ``tp`` holds the attention heads: None when the kv heads shard like the
    query heads (``n_kv_heads / tp`` each), or the kv heads it keeps from replicated k and v
    projections (``kv_heads_of_rank``). Raises ``LayoutError`` when the query heads do not divide by
    the degree: a head's dot products cannot be split between ranks without a collective per head."""
    if n_heads % tp:
        raise LayoutError(f"tensor parallelism of degree {tp} splits whole attention heads, and the model's "
                          f"{n_heads} query heads do not divide by {tp}: use a degree that divides {n_heads}, "
                          f"or pipeline stages (--strategy pipeline)")
    return None if n_kv_heads % tp == 0 else kv_heads_of_rank(n_heads, n_kv_heads, tp, tp_rank)


# The Megatron split of a decoder layer: these column-wise (output features, so whole heads and whole
# MLP columns), the k and v projections too where the kv heads divide by the degree ...
COLUMN_WISE = ("self_attn.q_proj", "mlp.gate_proj", "mlp.up_proj")  # those a layer has: a GELU MLP has no gate
KV_PROJECTIONS = ("self_attn.k_proj", "self_attn.v_proj")
# ... and these row-wise (input features), each rank's output a partial sum of the whole one
ROW_WISE = ("self_attn.o_proj", "mlp.down_proj")


def parallelize_tensor(model: NativeCausalLM, mesh, device: torch.device | str, *, sequence_parallel: bool = False,
                       inference: bool = False) -> dict[str, Any]:
    """Shard ``model``, still on the meta device, in place over ``mesh`` (1-D, the tensor-parallel
    ranks; every rank of the job calls it, before its weights get storage on ``device`` and before
    activation checkpointing, compile and FSDP); return what was applied. Raises ``LayoutError``
    when the query heads do not divide by the degree.

    ``inference``: the weights are cut as DTensors (so that the build draws and writes them as it
    does for training) but no DTensor style is applied: the modules run plain ops on local shards
    with explicit collectives once ``localize`` has swapped the DTensors for their local tensors
    (module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    if inference and sequence_parallel:
        raise ValueError("sequence parallelism splits the activations a backward pass keeps; inference keeps none")
    if sequence_parallel and model.config.positions != "rotary":
        raise ValueError("learned positions are added to the whole sequence's embeddings, which sequence "
                         "parallelism would hold cut")
    config, tp = model.config, mesh.size()
    kv_heads = split_heads(config.n_heads, config.n_kv_heads, tp, mesh.get_local_rank())
    kv_sharded = kv_heads is None
    sequence = Shard(1)
    row_output = {"output_layouts": sequence} if sequence_parallel else {}
    for layer in model.model.layers:
        attention = layer.self_attn
        columns = [name for name in COLUMN_WISE + (KV_PROJECTIONS if kv_sharded else ())
                   if _has(layer, name)]
        if not kv_sharded:
            keep = torch.tensor(kv_heads, device=device)
            for projection in (attention.k_proj, attention.v_proj):
                projection.register_forward_hook(_keep_heads(keep, attention.head_dim, mesh))
        if inference:
            for name in columns:
                _cut(layer.get_submodule(name), mesh, 0)
            for name in ROW_WISE:
                _cut(layer.get_submodule(name), mesh, 1)
                RowShardLinear.convert(layer.get_submodule(name), mesh.get_group())
        else:
            plan = {name: ColwiseParallel() for name in columns}
            plan |= {name: RowwiseParallel(**row_output) for name in ROW_WISE}
            if sequence_parallel:
                # the attention and the MLP take the whole sequence, gathered from the norms' shards
                args = (None,) * 4  # cos, sin, cache, start: not activations
                plan |= {name: SequenceParallel() for name in ("input_layernorm", "post_attention_layernorm")
                         if _has(layer, name)}
                plan |= {"self_attn": PrepareModuleInput(input_layouts=(sequence, *args),
                                                         desired_input_layouts=(Replicate(), *args),
                                                         use_local_output=True),
                         "mlp": PrepareModuleInput(input_layouts=(sequence,), desired_input_layouts=(Replicate(),),
                                                   use_local_output=True)}
            parallelize_module(layer, mesh, plan, src_data_rank=None)  # meta: nothing to send
        attention.n_heads = config.n_heads // tp
        attention.n_kv_heads = config.n_kv_heads // tp if kv_sharded else len(kv_heads)
    if inference:
        _cut(model.model.embed_tokens, mesh, 0)
        VocabShardEmbedding.convert(model.model.embed_tokens, mesh)
        _cut(model.lm_head, mesh, 0)
        model.lm_head.register_forward_hook(_gather_vocabulary(mesh.get_group(), tp, config.vocab_size))
    else:
        root = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), **row_output),
                "lm_head": ColwiseParallel(input_layouts=sequence if sequence_parallel else Replicate(),
                                           output_layouts=Replicate())}
        if sequence_parallel:
            root["model.norm"] = SequenceParallel()
        parallelize_module(model, mesh, root, src_data_rank=None)
    if config.tie_embeddings:
        # each style made a parameter of its own from the shared one; both shards are the same rows
        model.lm_head.weight = model.model.embed_tokens.weight
    return {"tensor_parallel": tp, "sequence_parallel": sequence_parallel,
            "kv_heads": "sharded" if kv_sharded else "replicated",
            "kv_heads_per_rank": model.model.layers[0].self_attn.n_kv_heads,
            "query_heads_per_rank": config.n_heads // tp,
            "dispatch": "local shards, explicit collectives" if inference else "DTensor"}


def write_shard(weight: torch.Tensor) -> Callable[[torch.Tensor], None] | None:
    """For ``fitbench.models.native.replay_random_weights``: for a DTensor weight, the function that
    copies this rank's part of the whole weight into its local shard (cut locally, ``src_data_rank``
    None: every rank holds the same whole weight, nothing is sent); None for a weight held whole."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(weight, DTensor):
        return None

    def write(whole: torch.Tensor) -> None:
        part = distribute_tensor(whole, weight.device_mesh, weight.placements, src_data_rank=None)
        weight.to_local().copy_(part.to_local())

    return write


@torch.no_grad()
def localize(model: nn.Module) -> None:
    """Swap every DTensor parameter of ``model`` for its local shard (the same storage), a tied one
    once. The parameters keep ``requires_grad`` as they were, since a matmul chooses its kernel by it
    (``F.linear`` of the last position's slice folds into one ``mm`` only for a weight that requires
    grad), so that the ranks run one process's kernels; the model is for ``inference_mode``, its
    collectives being outside autograd."""
    from torch.distributed.tensor import DTensor

    local: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            if isinstance(parameter, DTensor):
                if id(parameter) not in local:
                    local[id(parameter)] = nn.Parameter(parameter.to_local(), requires_grad=parameter.requires_grad)
                setattr(module, name, local[id(parameter)])


def small_all_reduces(spec: RunSpec, group, device: torch.device) -> dict[str, str]:
    """How a tensor-parallel generation of ``spec`` sums its small all-reduces over ``group``: through
    symmetric memory (``one_shot_small_all_reduces``, set up here) where the spec asks for it and it
    applies (``RunSpec.one_shot_applies``) on GPUs that map each other's memory, else NCCL's; for the
    row's parallel record."""
    if device.type != "cuda":
        return {}
    if not (spec.symmetric_memory and spec.one_shot_applies):
        return {"small_all_reduces": "NCCL"}
    if not _peers_mapped(device, dist.get_world_size(group)):
        return {"small_all_reduces": "NCCL: symmetric memory needs the group's GPUs on one node, each with "
                                     "peer access to the others"}
    one_shot_small_all_reduces(group)
    return {"small_all_reduces": f"symmetric memory, one-shot (up to {ONE_SHOT_BYTES // 1024} KiB)"}


def _peers_mapped(device: torch.device, ranks: int) -> bool:
    """Whether a group of ``ranks`` consecutive ranks lies on this node (torchrun's LOCAL_WORLD_SIZE a
    multiple of it) and this GPU has peer access to every other GPU of the node."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local % ranks:
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return all(torch.cuda.can_device_access_peer(index, other)
               for other in range(torch.cuda.device_count()) if other != index)


def one_shot_small_all_reduces(group) -> None:
    """Have inductor sum the small all-reduces of ``group`` that it compiles (the per-layer sums of a
    decode step: batch x hidden x 2 bytes, 10 kB for the 13B preset at batch 1) with PyTorch's
    symmetric-memory one-shot all-reduce instead of NCCL's: the matmul writes its partial sum into a
    buffer every rank of the group maps, and one kernel on each rank reads its peers' buffers over
    NVLink and adds them, with no ring and no protocol handshake, the latency that sets a TP decode
    step's speed at batch 1. Inductor's rule (``torch._inductor.config._collective``): a sum of at
    most ``one_shot_all_reduce_threshold_bytes`` (128 KiB) whose input it allocates, in a group that
    has symmetric memory; larger ones (a prefill's) stay NCCL's. Needs GPUs of one node with
    peer-to-peer access; the setting is the process's, which runs one configuration."""
    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory as symmetric_memory

    with warnings.catch_warnings():  # deprecated, yet inductor's rule still asks whether the group has it
        warnings.simplefilter("ignore", FutureWarning)
        symmetric_memory.enable_symm_mem_for_group(group.group_name)
    inductor_config._collective.auto_select = True
    inductor_config._collective.one_shot_all_reduce_threshold_bytes = ONE_SHOT_BYTES


@torch.no_grad()
def fuse_local_projections(model: NativeCausalLM, kv_sharded: bool) -> None:
    """Stack each layer's column-wise shards by rows into one matmul, as the fused one-GPU model holds
    them (``fitbench.models.native.FusedLinear``): q, k and v into ``qkv_proj`` where the kv heads are
    sharded (replicated ones keep their own projections, whose outputs are cut to the rank's heads),
    gate and up into ``gate_up_proj``. A decode step at batch 1 then reads its input once and launches
    one matrix-vector kernel where three or two did (a GELU MLP's up projection is one already), each on a wider matrix (at TP 4 the 13B preset's
    q, k and v shards are 1,280 rows each; stacked, 3,840), which runs nearer the copy bandwidth. The
    stacked weight is made before its parts are dropped: one layer's projections more, for a moment,
    than the shards (less than the whole weight of scratch the build held before)."""
    for layer in model.model.layers:
        if not isinstance(layer, DecoderLayer):  # another pipeline stage's layer
            continue
        attention, mlp = layer.self_attn, layer.mlp
        groups = [(mlp, "gate_up_proj", ("gate_proj", "up_proj"))] if hasattr(mlp, "gate_proj") else []
        if kv_sharded:
            groups.append((attention, "qkv_proj", ("q_proj", "k_proj", "v_proj")))
        for owner, fused_name, parts in groups:
            projections = [getattr(owner, name) for name in parts]
            weight = projections[0].weight
            has_bias = projections[0].bias is not None
            with torch.device("meta"):
                fused = FusedLinear(weight.shape[1], parts, tuple(p.weight.shape[0] for p in projections), has_bias)
            fused.weight = nn.Parameter(torch.cat([p.weight for p in projections]), requires_grad=weight.requires_grad)
            if has_bias:
                fused.bias = nn.Parameter(torch.cat([p.bias for p in projections]), requires_grad=weight.requires_grad)
            for name in parts:
                delattr(owner, name)
            setattr(owner, fused_name, fused)


def _has(module: nn.Module, name: str) -> bool:
    """Whether ``module`` holds a submodule at the dotted path ``name``."""
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def _cut(module: nn.Module, mesh, dim: int) -> None:
    """Replace ``module``'s weight (on the meta device) by a DTensor sharded along ``dim`` over
    ``mesh``, and with a column-wise cut (``dim`` 0) its bias, where it has one, along its only
    dimension; what ``parallelize_module``'s styles do to a weight, without their input and output
    handling. A row-wise matmul's bias stays whole (``RowShardLinear`` adds it after the sum)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    module.weight = nn.Parameter(distribute_tensor(module.weight, mesh, [Shard(dim)], src_data_rank=None))
    if getattr(module, "bias", None) is not None and dim == 0:
        module.bias = nn.Parameter(distribute_tensor(module.bias, mesh, [Shard(0)], src_data_rank=None))


class RowShardLinear(nn.Linear):
    """A row-wise matmul of local shards (columns of the weight): its output, this rank's partial sum,
    all-reduced in place into the whole output, the one collective of the attention or the MLP; then
    its bias, held whole on every rank, added once."""

    group: Any

    @classmethod
    def convert(cls, linear: nn.Linear, group) -> None:
        """Turn ``linear``, whose weight ``_cut`` sharded along its columns, into one."""
        linear.__class__ = cls
        linear.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = F.linear(x, self.weight)
        dist.all_reduce(output, group=self.group)
        return output if self.bias is None else output.add_(self.bias)


def _gather_vocabulary(group, tp: int, vocab_size: int):
    """A forward hook for the output projection's local shard (rows of the vocabulary, ``torch.chunk``'s
    split as DTensor's ``Shard(0)`` cuts it): its logits (B, T, V / tp) gathered from every rank into
    the whole (B, T, V) on each, so generation and the loss see whole logits. A vocabulary that does
    not divide by the degree is padded to equal shards for the gather, and the padding dropped."""
    width = -(-vocab_size // tp)

    def hook(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        if output.shape[-1] < width:
            output = F.pad(output, (0, width - output.shape[-1]))
        output = output.contiguous()
        shards = output.new_empty(tp * output.shape[0], *output.shape[1:])  # (tp B, T, width), rank-major
        all_gather(shards, output, group=group)
        return shards.view(tp, *output.shape).movedim(0, -2).flatten(-2)[..., :vocab_size]  # (B, T, V)

    return hook


class VocabShardEmbedding(nn.Embedding):
    """An embedding holding rows [first, first + rows) of the vocabulary (``num_embeddings`` stays the
    whole vocabulary's size): each rank looks up the tokens in its rows, writes zeros for the others',
    and an all-reduce sums the ranks' lookups into every token's row. No token's row is gathered
    whole, and nothing depends on which tokens came, so a CUDA graph captures it."""

    first: int
    group: Any

    @classmethod
    def convert(cls, embedding: nn.Embedding, mesh) -> None:
        """Turn ``embedding``, whose weight ``_cut`` sharded along the vocabulary, into one."""
        embedding.__class__ = cls
        embedding.first = mesh.get_local_rank() * -(-embedding.num_embeddings // mesh.size())
        embedding.group = mesh.get_group()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = tokens - self.first  # (B, T)
        elsewhere = (rows < 0) | (rows >= self.weight.shape[0])
        x = F.embedding(rows.masked_fill(elsewhere, 0), self.weight)  # (B, T, C)
        dist.all_reduce(x.masked_fill_(elsewhere.unsqueeze(-1), 0), group=self.group)
        return x


def _keep_heads(heads: torch.Tensor, head_dim: int, mesh):
    """A forward hook for a replicated k or v projection: its output (B, T, KV * D) cut to ``heads``."""

    def hook(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            output = _sum_gradients(output, mesh)
        B, T, _ = output.shape
        return output.view(B, T, -1, head_dim).index_select(2, heads).reshape(B, T, len(heads) * head_dim)

    return hook


def _sum_gradients(tensor: torch.Tensor, mesh) -> torch.Tensor:
    """``tensor`` unchanged, whose gradient is summed over ``mesh`` in the backward pass: each rank's
    gradient is a partial sum (``Partial``), which turning back into the replicated forward layout
    all-reduces."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(tensor, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
