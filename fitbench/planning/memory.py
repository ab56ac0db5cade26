"""Per-GPU peak memory of one configuration, term by term, before any GPU is touched.

The terms follow fitbench's own loops and the model the run builds tensor by tensor
(``fitbench.worker.loops``; the native decoder ``fitbench.models.native``, or on the ``hf`` backend
transformers' model of the family); ``fitbench.worker.trace`` runs those loops on fake tensors and is
the reference the tests hold this model to. Weights, biases, norms and position tables come from
the family's own description (``Architecture.layer_matrices``, ``layer_norms``,
``position_embeddings``), so every term is a sum of non-negative sizes.

Notation: ``n = B x T`` tokens, ``h`` hidden size, ``f`` MLP width, ``k`` the key/value width
(kv heads x head dim), ``H`` heads, ``V`` vocabulary, ``L`` layers, ``P`` parameters. Byte widths:
``w`` weights, ``c`` compute (activations), ``r`` the residual stream (fp32 under autocast: the
embedding is not autocast and the fp32 stream absorbs each 16-bit branch it is added to).

Peak, not sum. A training step (gradients set to None at its start, fused AdamW) peaks at one of:

- the start of the backward pass, as the loss is formed: weights, AdamW state, every saved activation
  (under autocast every weight's 16-bit copy, saved by autograd, or with checkpointing held by
  autocast's cache), and the loss chain: the logits, which the loss overwrites with their gradient,
  and one chunk's fp32 temporaries (``loss_chain_bytes``), or the output projection's backward where
  it holds more (``output_backward_bytes``);
- the first layer's backward, at its MLP: the gradients of every layer above, the layer's saved
  activations and its MLP's gradients (``mlp_backward_bytes``);
- the optimizer step: weights, gradients and AdamW state (16 bytes per parameter in mixed precision).

Inference and forward passes keep nothing for a backward pass: their peak is the weights (and,
under autocast, their 16-bit copies, which autocast caches for the whole forward), the KV cache,
and the largest set of temporaries one layer holds at once.

Offload (inference on one GPU, ``fitbench.models.offload``) keeps only ``k`` of the ``L`` decoder
layers on the GPU: the weights term counts the edges (embeddings, final norm, output projection)
and those ``k`` layers, and while any layer is offloaded, one layer's weights are in flight, copied
in for its forward. The KV cache of every layer stays on the GPU.

Sharding divides terms per GPU (``Parallelism``, which carries the run's ``Layout``), as the run
shards:

- tensor parallelism (degree t): q, k, v, gate and up column-wise, o and down row-wise, so each rank
  holds 1/t of every layer matrix (``tp_layer_matrices``); k, v and the KV cache whole on every rank
  where the kv heads do not divide by t (``kv_heads_split``); the embedding and the output projection
  split over the vocabulary, the norms replicated; inside a layer the per-head and MLP intermediates
  are 1/t, the residual stream and the norms whole (no sequence parallelism), a training step's norms
  saving what transformers' norm saves (they run on DTensors, ``saved_per_layer``); the logits gathered
  whole (B, T, V) on each rank before the loss or the next token;
- pipeline parallelism (p stages): stage i holds the layers ``fitbench.spec.pipeline_stages`` gives
  it (``Stage``), the first also the embedding, the last the final norm, the output projection and
  the logits and loss; generation caches each stage's own layers; a training step runs m microbatches
  (by default p) under GPipe (``fitbench.worker.pipeline``), every stage holding the activations of all m
  at the end of the forwards, and m - 1 of them while the first microbatch's backward forms the
  gradients; at the second microbatch's backward every gradient exists already beside the m - 1
  waiting, with the outputs the schedule keeps and the gradients' receive buffers (``gpipe_terms``).
  Stages differ,
  so each is estimated (``stage_estimates``) and the largest stands for the layout, named.

Data parallelism (``_training``'s ``ddp`` and ``fsdp``, per rank,
``g`` ranks, ``p`` parameters per layer, ``E`` parameters of the root: embeddings, final norm,
output projection):

- DDP (``DistributedDataParallel(gradient_as_bucket_view=True)``) replicates weights, gradients
  and optimizer state. Its reducer copies each gradient into flat buckets of at most
  ``bucket_cap_mb`` = 25 MiB (the first 1 MiB; a larger parameter alone in its bucket), allocated
  at construction in the gradients' dtype: w P in all, for the whole run. With the buckets as the
  gradients' storage the gradients cost nothing more, but they exist at every moment, the start of
  the backward pass included, where one GPU's gradients (set to None each step) do not: w P more
  than one GPU there. DDP's default (``gradient_as_bucket_view=False``) keeps separate gradients
  beside the buckets, 2 w P from the first gradient on (torch ``DistributedDataParallel`` docs:
  "the saved memory size will be equal to the total gradients size"). Each gradient is formed as
  a fresh tensor and copied into its bucket: the input embedding's, formed last, is counted at
  the end of the backward pass as on one GPU.
- FSDP2 (``fully_shard`` on each decoder layer and on the root): weights, gradients and AdamW
  state w P / g each (w: the sharded dtype, fp32 under ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``; FSDP pads each parameter's first dimension to a multiple of g, at most
  g - 1 rows, not counted). The mixed-precision policy gathers 16-bit parameters and casts the
  root's inputs, so the layers compute as in bf16-pure: activations with bf16-pure's widths, no
  autocast copies. Gathered in flight (torch 2.11 to 2.13, ``torch/distributed/fsdp/_fully_shard/``
  ``_fsdp_param_group.py`` and ``_fsdp_collectives.py``), c the gathered dtype and rd the reduce
  dtype (fp32 under that policy, else the parameters'):
  the root, not resharded after forward, c E at every moment; two layers, 2 c p: the one at work,
  copied out of its all-gather, and an all-gather output (held until the next one's copy-out in
  forward; the one prefetched in backward); in the backward of a layer its unsharded gradients, c p, beside the
  previous layer's reduce-scatter input, rd p, which FSDP holds until this layer's reduce-scatter
  is issued (one held: ``reduce_scatter_state``, in 2.13 ``reduce_scatter_max_input_buffers`` = 1;
  the layer's gradients are copied into its own input before they are freed, and the held one is
  dropped first); the root's output projection and final
  norm gradients, c (V h + norm), unsharded until the root's reduce-scatter at the end, where the
  root's gradients and the first layer's reduce-scatter input give way to the root's own
  reduce-scatter input: max(c G + rd p, rd E), G the root's gradients (two V h contributions
  before their sum when the embedding is tied).
  Cached pools (``Term.cached``): the caching allocator keeps a pool per CUDA stream, and the most a
  stream ever held stays mapped. FSDP allocates the all-gather outputs and inputs on its copy-in
  stream, whose pool stays at max(2 c p, (1 + 1/g) c E) (two layers' outputs, or the root's output
  and input; 2 c p + c E where the root's output is smaller than a layer's, ``copy_in_pool``), and
  the reduce-scatter outputs, of which the sharded gradients are views, on its reduce-scatter
  stream: w P / g stays mapped while the gradients are None, the start of the backward pass included.
  Read from the allocator's snapshots on 2 x H200, torch 2.11 (``benchmarks/allocator_streams.py``,
  ``benchmarks/results/2026-11-24-h200x2-data-parallel``): the 20B preset in bf16-pure, 1 x 2048: the
  compute stream's most 87.5 GiB, the copy-in stream's 1.46 GiB (2 c p), the reduce-scatter stream's
  18.5 GiB (the sharded gradients); 116.2 GB reserved against 95.1 GB allocated.
- FSDP2 with CPU offload (``CPUOffloadPolicy``, ``--offload``): the shards, their gradients and
  AdamW's state live in host memory, where the optimizer steps; the GPU holds what is in flight
  as above, and the shards passing through it (``fsdp_offload_staging``).

Constants outside the formulas (CUDA context, allocator slack, NCCL's buffers per communicator)
come from ``fitbench.planning.calibration``.

``compiled``: the native model under ``torch.compile`` saves and holds less; its per-layer terms come
from ``fitbench.planning.compiled``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fitbench.models.architecture import Architecture, default_backend
from fitbench.models.hf_cache import CacheLayout, cache_layout
from fitbench.models.loss import loss_chain_bytes, loss_chunk_rows
from fitbench.planning import compiled as inductor
from fitbench.planning.outliers import outlier_columns
from fitbench.precisions import ADAPTER_RANK, ADAPTERS, FLOAT8, TRAINING_MODES, UNQUANTIZED_BASE, StorageFormat, entry
from fitbench.spec import Layout, Stage, checkpointed_count

# LLM.int8 keeps, for the backward pass, each matmul's input columns holding an outlier (|x| > 6)
# in fp16 (bitsandbytes' MatMul8bitLt, ``subA``): a data-dependent amount. With fitbench's random
# weights the residual stream grows layer after layer and about a third of the columns qualify
# (fraction measured on the 7B preset training adapters at 4 x 512 on one H100,
# benchmarks/results/2026-11-22-h100-quantized-training); trained weights have far fewer.
INT8_OUTLIER_COLUMNS = 0.32


@dataclass(frozen=True)
class Term:
    """One kind of memory, and the moments of the step at which it is alive (None: all of them).
    ``cached``: pages a CUDA stream's pool keeps mapped with no tensor in them (the caching allocator
    keeps a pool per stream, and a block freed on one stream serves only that stream); the allocator
    unmaps them, after a synchronizing retry, when a request on another stream would not fit, so they
    count in the peak NVML reads but not in what must fit."""

    name: str
    bytes: float
    formula: str
    moments: frozenset[str] | None = None
    cached: bool = False


@dataclass(frozen=True)
class Widths:
    """Byte widths of weights (w), activations (c) and the residual stream (r), and whether
    autocast casts inputs and weights to 16 bits."""

    weights: float
    compute: int
    residual: int
    autocast: bool

    @classmethod
    def of(cls, precision: str, parallelism: Parallelism | None = None) -> Widths:
        """``precision``'s widths, from its policy's dtypes: the weights' as built (a quantized model's
        weights outside the layers' matmuls stay bf16), the activations' and a residual stream as wide as
        the weights; under FSDP (``parallelism``), a mixed precision's: 16-bit gathered weights and
        inputs, so 16-bit activations and no autocast, beside its fp32 shards."""
        policy = entry(precision).policy
        mixed = policy.autocast_dtype_name is not None
        if parallelism is not None and parallelism.shards > 1 and mixed:
            return cls(policy.weight_bytes, policy.compute_bytes, policy.compute_bytes, False)
        return cls(policy.weight_bytes, policy.compute_bytes, policy.weight_bytes, mixed)


@dataclass(frozen=True)
class Parallelism:
    """How one model is spread over GPUs: its ``Layout`` (data-parallel replicas and shards, tensor and
    pipeline degrees; ``fitbench.spec``), the very object the run is given, so a planned layout is the
    layout that runs; ``offload``: FSDP's CPU offload; ``microbatches``: of a pipeline's training
    step (by default one per stage). ``Parallelism("fsdp", 4)`` names one strategy over some GPUs;
    ``Parallelism(layout=...)`` any layout, combined ones included. A given layout stands unless
    ``strategy`` and ``gpus`` name another (``dataclasses.replace`` of either): then it is rebuilt
    from them."""

    strategy: str = "single"  # single, ddp, fsdp, tp, pipeline; or a combined layout's, e.g. tp+pipeline
    gpus: int = 1
    offload: bool = False
    layout: Layout | None = None
    microbatches: int | None = None

    def __post_init__(self) -> None:
        layout = self.layout
        named = (self.strategy, self.gpus) != ("single", 1)
        if layout is None or (named and (layout.strategy, layout.world_size) != (self.strategy, self.gpus)):
            layout = Layout.of_strategy(self.strategy, self.gpus)
            object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "strategy", layout.strategy)
        object.__setattr__(self, "gpus", layout.world_size)
        if self.offload and self.shards == 1:
            raise ValueError(f"CPU offload is FSDP's, over several GPUs; not {self.strategy} over {self.gpus}")
        if self.microbatches is not None and self.microbatches < 1:
            raise ValueError(f"microbatches must be at least 1, got {self.microbatches}")

    @property
    def tensor(self) -> int:
        return self.layout.tp

    @property
    def stages(self) -> int:
        return self.layout.pp

    @property
    def shards(self) -> int:
        """How many ways weights, gradients and optimizer state are split across data-parallel ranks."""
        return self.layout.dp_shard

    @property
    def schedule_microbatches(self) -> int:
        """The microbatches of a pipeline's training step: ``microbatches``, by default one per stage."""
        return self.microbatches or self.stages

    def microbatches_of(self, batch: int) -> int:
        """The microbatches a step of ``batch`` sequences makes: no more than its sequences."""
        return min(self.schedule_microbatches, batch)


def pipeline_stage_list(arch: Architecture, stages: int) -> tuple[Stage, ...]:
    """Every stage of ``stages`` over ``arch``'s layers (``fitbench.spec.pipeline_stages``)."""
    return Stage.every(arch.num_layers, stages)


def kv_heads_split(arch: Architecture, tp: int) -> int:
    """How many ways tensor parallelism splits the kv heads: ``tp`` when they divide by it, else 1 (the
    k and v projections and the KV cache replicated on every rank)."""
    return tp if arch.num_kv_heads % tp == 0 else 1


ROW_WISE = ("o_proj", "down_proj", "dense", "dense_4h_to_h", "c_proj")
FUSED_QKV = ("query_key_value", "c_attn")


def tp_layer_matrices(arch: Architecture, tp: int) -> list[tuple[int, int, int]]:
    """(rows, columns, bias) of each layer matrix on one tensor-parallel rank: q, k, v, gate, up (and
    the fused qkv and MLP inputs) column-wise, their rows split; o and down row-wise, their columns
    split, their biases whole; k and v (the kv part of a fused qkv) whole where the kv heads do not
    divide by ``tp``."""
    kv_tp = kv_heads_split(arch, tp)
    q, k = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shares = []
    for matrix in arch.layer_matrices:
        bias = matrix.rows if matrix.bias else 0
        if matrix.name.rsplit(".", 1)[-1] in ROW_WISE:
            shares.append((matrix.rows, matrix.columns // tp, bias))
        elif matrix.name.endswith(("k_proj", "v_proj")):
            shares.append((matrix.rows // kv_tp, matrix.columns, bias // kv_tp))
        elif matrix.name.endswith(FUSED_QKV):
            rows = q // tp + 2 * k // kv_tp
            shares.append((rows, matrix.columns, rows if matrix.bias else 0))
        else:
            shares.append((matrix.rows // tp, matrix.columns, bias // tp))
    return shares


def rank_layer_params(arch: Architecture, tp: int) -> int:
    """One layer's parameters on one tensor-parallel rank (``tp_layer_matrices``; the norms replicated)."""
    return sum(rows * columns + bias for rows, columns, bias in tp_layer_matrices(arch, tp)) + \
        arch.norm_params_per_layer


def rank_edge_params(arch: Architecture, tp: int, stage: Stage) -> int:
    """The parameters outside the decoder layers on one rank of ``stage``: the token embedding on the
    first stage, split over the vocabulary by ``tp``, with a learned position table whole; the final
    norm (replicated) and the output projection (split over the vocabulary) on the last. A tied output
    projection is the embedding itself on one stage, a copy of its own on a last stage that is not the
    first."""
    table = arch.vocab_size * arch.hidden_size // tp
    first = table + arch.position_params if stage.first else 0
    output = table if not arch.tie_embeddings or not stage.first else 0
    last = arch.final_norm_params + output if stage.last else 0
    return first + last


@dataclass(frozen=True)
class MemoryEstimate:
    """Terms, and the moment at which the most of them coexist: the peak."""

    terms: tuple[Term, ...]
    moments: tuple[str, ...]
    stage: Stage | None = None  # the pipeline stage estimated, where there are several

    def total_at(self, moment: str, cached: bool = True) -> float:
        """Bytes at ``moment``; without ``cached``, the tensors alone (what must fit)."""
        return sum(t.bytes for t in self.terms if (t.moments is None or moment in t.moments) and (cached or not t.cached))

    @property
    def peak_moment(self) -> str:
        return max(self.moments, key=self.total_at)

    @property
    def peak_bytes(self) -> float:
        return self.total_at(self.peak_moment)

    def at_peak(self, term: Term) -> bool:
        return term.moments is None or self.peak_moment in term.moments

    def as_dict(self) -> dict:
        return {
            "peak_bytes": self.peak_bytes,
            "peak_moment": self.peak_moment,
            "stage": self.stage.label if self.stage else None,
            "moments": {moment: self.total_at(moment) for moment in self.moments},
            "terms": [{"name": t.name, "bytes": t.bytes, "formula": t.formula, "at_peak": self.at_peak(t),
                       **({"cached": True} if t.cached else {})} for t in self.terms],
        }


# ---- building blocks --------------------------------------------------------------------------


def layer_matmul_params(arch: Architecture) -> int:
    """The weights of one layer's matrices (``Architecture.layer_matrices``), without norms and biases."""
    return arch.layer_matmul_weights


def layer_matrices(arch: Architecture) -> list[tuple[int, int]]:
    """(rows, columns) = (out, in) of one layer's weight matrices, from the family's description."""
    return [(matrix.rows, matrix.columns) for matrix in arch.layer_matrices]


def quantized_layer_bytes(arch: Architecture, fmt: StorageFormat) -> float:
    return sum(fmt.matrix_bytes(rows, columns) for rows, columns in layer_matrices(arch))


def largest_layer_matrix(arch: Architecture) -> int:
    """Elements of the largest matrix of a layer (an MLP matrix, h x f, in every family)."""
    return max(matrix.weights for matrix in arch.layer_matrices)


def adapter_params(arch: Architecture, rank: int = ADAPTER_RANK) -> int:
    """Trainable parameters of the adapters: r x (in + out) for each matmul of each layer."""
    return rank * sum(rows + columns for rows, columns in layer_matrices(arch)) * arch.num_layers


def norm_saved_bytes(tokens: int, hidden: int, widths: Widths, frozen: bool = False, backend: str = "native",
                     layer_norm: bool = False) -> float:
    """One norm's saved tensors, without its output, which the matmuls reading it save.

    - native RMSNorm (``fitbench.models.layer_ops.rms_norm``): its input (r n h) and 1/rms (4 n);
      its backward pass recomputes the normalized input, whether the weight trains or is ``frozen``,
      and its output is in the compute dtype (c n h), the matmuls' input;
    - transformers' RMSNorm (``LlamaRMSNorm``) upcasts once: its input (r n h), or one fp32 copy
      (4 n h) of a 16-bit one; 1/rms (4 n); and its normalized output (4 n h in fp32, c n h once
      cast back in 16 bits), which the product with the weight keeps for the weight's gradient, so
      not when the weight is ``frozen``;
    - LayerNorm (``layer_norm``; autocast runs it in fp32): its input (r n h) and its mean and
      1/std (2 r n); its output is saved by the matmul that reads it, not by the norm.
    """
    n, h, c, r = tokens, hidden, widths.compute, widths.residual
    if layer_norm:
        return r * n * h + 2 * r * n
    if backend == "native":
        return r * n * h + 4 * n
    normalized = 0 if frozen else (4 * n * h if r == 4 else c * n * h)
    return (r * n * h if r == 4 else 4 * n * h) + normalized + 4 * n


def saved_per_layer(arch: Architecture, tokens: int, widths: Widths, tp: int = 1, frozen_norms: bool = False,
                    backend: str = "native", context: int = 0) -> float:
    """Bytes one layer saves for its backward pass (fused attention, no recompute), for n tokens of
    sequences of ``context`` tokens, on ``backend``.

    Llama family, tensor by tensor in forward order (n tokens, widths r, c as in the module docstring),
    the native decoder's eager training operators (``fitbench.models.layer_ops``) as they save, with
    its fused or separate projections alike:

    - input RMSNorm: ``norm_saved_bytes`` (transformers' less its normalized output when
      ``frozen_norms``);
    - q, k, v projections: their input, the native norm's output in the compute dtype, shared by
      the three (c n h); in transformers' model cast to 16 bits once per projection under autocast
      (3 c n h), otherwise shared (c n h);
    - rotary q and k (c n h + c n k) and v (c n k), saved by attention, with its output (c n h),
      which the output projection saves as its input, and the log-sum-exp (4 n H); the native
      rotation itself saves nothing; in fp32 with grouped heads the native decoder expands k and v
      to all heads first (c n h each), since no fused fp32 kernel takes grouped heads (transformers
      passes grouped heads to the kernel);
    - post-attention RMSNorm: as the first, on the new residual (r n h);
    - gate and up projections: their input, shared as the first's (c n h; transformers' two casts,
      2 c n h, under autocast);
    - SwiGLU: gate and up outputs, which the native SwiGLU saves (it recomputes silu(gate)), and the
      product the down projection saves (3 c n f); transformers' model saves silu(gate) too (4 c n f).

    Falcon (``FalconDecoderLayer``, parallel attention and MLP, both LayerNorms reading the layer's
    input): that input (r n h) and each norm's mean and 1/std (4 r n); six h-wide tensors (6 c n h):
    the two norms' outputs (or their 16-bit casts) saved by ``query_key_value`` and
    ``dense_h_to_4h``, the rotary queries, the keys and values broadcast to every head, and
    attention's output; the log-sum-exp (4 n H); the GELU's input and output (2 c n f); and the
    boolean causal mask, which the attention kernel saves converted to the compute dtype (c n T).

    GPT-2 (``GPT2Block``): the layer's input and the residual after attention (2 r n h), each
    LayerNorm's mean and 1/std (4 r n); eight h-wide tensors (8 c n h): ``c_attn``'s input, its
    3 h-wide output whose q, k, v views attention saves, attention's output and its reshaped copy
    that ``c_proj`` saves, ``c_fc``'s input and one more copy of a norm's output; the log-sum-exp
    (4 n H); and the tanh GELU (``NewGELUActivation``, written out in tensor operations), which
    saves x, tanh(.), 0.5 x and 1 + tanh(.), beside ``c_proj``'s input (5 c n f). Under autocast on
    a GPU, ``pow`` is one of the operations CUDA's autocast runs in fp32, so from it on the chain is
    fp32: x cast to fp32, tanh(.) and 1 + tanh(.) are saved in 4 bytes, 0.5 x and ``c_proj``'s cast
    input in c: (12 + 2 c) n f (``gpt2_gelu_upcast_bytes`` more than 5 c n f; measured on one H200,
    gpt2-xl bf16 4 x 1024: 53.7 GB against 45.7 GB predicted without it, 7.5 GB of it this term).
    The CPU's autocast keeps ``pow`` in 16 bits, so the CPU trace sees 5 c n f.

    Every figure above is checked against the fake-tensor trace of the real modules
    (``fitbench.worker.trace``).
    """
    n, h, f = tokens, arch.hidden_size, arch.ffn_size
    k, heads = arch.num_kv_heads * arch.head_dim, arch.num_heads
    c, r = widths.compute, widths.residual
    if backend == "native" and arch.family != "llama":
        # The native decoder's Falcon and GPT-2 blocks, with the fused projections one GPU trains:
        # the layer's input (and GPT-2's residual after attention) and each LayerNorm's mean and
        # 1/std; the two norms' outputs, each read by one matmul (c n h each; under autocast the
        # fp32 output's one cast); attention's q, its k and v (expanded to every head in fp32, as
        # for Llama), its output and log-sum-exp; the GELU's input and output (2 c n f, one
        # ``F.gelu``). No mask: attention is causal by flag.
        residuals = 1 if arch.parallel_attention else 2
        kv_saved = 2 * c * n * (h if c == 4 and k != h else k)
        attention = (2 * c * n * h + kv_saved + 4 * n * heads) / tp
        return residuals * r * n * h + 4 * r * n + 2 * c * n * h + attention + 2 * c * n * f / tp
    if arch.family == "falcon":
        attention = (4 * c * n * h + 4 * n * heads + c * n * context) / tp
        return r * n * h + 4 * r * n + 2 * c * n * h + attention + 2 * c * n * f / tp
    if arch.family == "gpt2":
        attention = (6 * c * n * h + 4 * n * heads) / tp
        mlp = 5 * c * n * f / tp + gpt2_gelu_upcast_bytes(arch, n, widths, tp)
        return 2 * r * n * h + 4 * r * n + 2 * c * n * h + attention + mlp
    # Under tensor parallelism a training step's activations are DTensors, for which the native norm runs
    # its plain expressions, not its Function (``fitbench.models.layer_ops.eager_training``): it saves
    # what transformers' norm saves.
    norm = norm_saved_bytes(n, h, widths, frozen_norms, "hf" if tp > 1 else backend)
    casts = widths.autocast and backend == "hf"
    attention_inputs = 3 * c * n * h if casts else c * n * h
    expanded = backend == "native" and c == 4 and k != h
    kv_saved = 2 * c * n * (h if expanded else k)
    attention = (c * n * h + kv_saved + c * n * h) / tp + 4 * n * heads / tp
    mlp_inputs = 2 * c * n * h if casts else c * n * h
    mlp = (3 if backend == "native" else 4) * c * n * f / tp
    return 2 * norm + attention_inputs + attention + mlp_inputs + mlp


def backward_transient_bytes(arch: Architecture, tokens: int, widths: Widths, tp: int = 1,
                             backend: str = "native") -> float:
    """What a native layer's backward pass holds beyond the layer's saved tensors at its widest, in
    SwiGLU's backward (``fitbench.models.layer_ops.swiglu``): the gradients of gate and up (2 c n f)
    written beside the gradient of their product (c n f), the product itself (c n f) freed with the
    down projection's backward: 2 c n f. The layer's weight gradients not formed yet are counted
    already (an over-estimate of one layer's weights). transformers' model is held to its saved
    tensors (0 here)."""
    if backend != "native" or arch.family != "llama":
        return 0.0
    return 2 * widths.compute * tokens * arch.ffn_size / tp


def gpt2_gelu_upcast_bytes(arch: Architecture, tokens: int, widths: Widths, tp: int = 1) -> float:
    """What GPT-2's tanh GELU saves beyond 5 c n f under a GPU's autocast, which runs ``pow`` in
    fp32: x, tanh(.) and 1 + tanh(.) in fp32 instead of c bytes, (12 + 2 c - 5 c) n f; nothing
    without autocast or for other families."""
    if arch.family != "gpt2" or not widths.autocast:
        return 0.0
    c = widths.compute
    return (12 + 2 * c - 5 * c) * tokens * arch.ffn_size / tp


def mlp_backward_bytes(arch: Architecture, tokens: int, widths: Widths, tp: int = 1) -> float:
    """What a layer's backward pass holds beyond its saved activations where it is widest, in its MLP:
    the gradient flowing into the layer (r n h), and the MLP's gradients beyond the down projection's
    input, which its backward has freed by then. SwiGLU (llama) forms the product's gradient, then
    from it gate's and up's at once: 3 c n f less the product's c n f; a plain activation (Falcon's
    and GPT-2's GELU) its output's gradient, then its input's: 2 c n f less the output's c n f."""
    gradients = 2 if arch.family == "llama" else 1
    return widths.residual * tokens * arch.hidden_size + gradients * widths.compute * tokens * arch.ffn_size / tp


def first_layer_unformed(arch: Architecture, tp: int = 1) -> int:
    """Parameters of a layer, on one tensor-parallel rank, whose gradients its MLP's backward finds not
    yet formed: all but the down projection's (``mlp_backward_bytes``'s moment follows its backward)."""
    rows, columns, bias = tp_layer_matrices(arch, tp)[-1]  # the down projection: the layer's last matrix
    return rank_layer_params(arch, tp) - rows * columns - bias


def output_backward_bytes(tokens: int, hidden: int, vocab: int, widths: Widths, weight: float) -> float:
    """What the output projection's backward holds beside the saved activations, where it is widest,
    for its ``weight`` parameters on this rank (none when frozen). Its matmul forms its input's
    gradient (c n h) and its weight's (c x weight) beside the logits' gradient (c n V), which the
    fused loss left in the logits; under autocast the weight's 16-bit gradient is then cast to the
    weights' width (w x weight), once the logits' gradient and the matmul's saved input and 16-bit
    weight are freed."""
    n, c = tokens, widths.compute
    cast = widths.weights * weight - c * n * vocab if widths.autocast else 0.0
    return c * n * vocab + max(c * n * hidden + c * weight, cast)


def recompute_per_layer(arch: Architecture, tokens: int, widths: Widths) -> float:
    """A checkpointed layer keeps only its input (r n h)."""
    return widths.residual * tokens * arch.hidden_size


def final_saved_bytes(arch: Architecture, tokens: int, widths: Widths, frozen_norm: bool = False,
                      backend: str = "native") -> float:
    """The final norm's saved tensors and the output projection's input (its cast, or the norm's
    own output)."""
    return (norm_saved_bytes(tokens, arch.hidden_size, widths, frozen_norm, backend, arch.layer_norm)
            + widths.compute * tokens * arch.hidden_size)


def hf_cache(arch: Architecture, widths: Widths) -> CacheLayout:
    """The KV cache the installed transformers keeps for ``arch`` at these widths: weights of 4 bytes
    are fp32, of 2 bf16; activations likewise (``fitbench.models.hf_cache``, which runs it once)."""
    return cache_layout(arch, "float32" if widths.weights == 4 else "bfloat16",
                        "float32" if widths.compute == 4 else "bfloat16")


def kv_cache_bytes(arch: Architecture, batch: int, length: int, widths: Widths, tp: int = 1,
                   backend: str = "native") -> float:
    """2 x L x kv heads x head dim x c x tokens x batch (keys and values, c bytes each); preallocated for the whole
    prompt + generation. transformers' cache is the installed version's (``hf_cache``): its keys and
    values each at their own width, and Falcon's of every query head."""
    if backend == "hf":
        return hf_cache(arch, widths).bytes_per_token(arch) * batch * length / tp
    return arch.kv_cache_bytes_per_token(widths.compute) * batch * length / tp


def kv_bytes_read_per_position(arch: Architecture, widths: Widths, backend: str = "native") -> float:
    """What a decode step reads of the KV cache per cached position (``CausalLM.kv_bytes_read``): the
    cache's bytes per token, twice over for a transformers ``DynamicCache`` that each step writes anew
    (the copy reads the earlier positions, then attention reads them: 2 p + 1 slots at position p)."""
    if backend != "hf":
        return arch.kv_cache_bytes_per_token(widths.compute)
    layout = hf_cache(arch, widths)
    return layout.bytes_per_token(arch) * (2 if layout.copies_on_growth else 1)


# Tensors of width h alive at the MLP's widest point of a forward pass without autograd in
# transformers' models, beside the MLP's own intermediates and the KV cache: (residual-width r,
# compute-width c) counts, forward pass and generation's prefill alike, as the fake-tensor trace of
# ``LlamaDecoderLayer``, ``FalconDecoderLayer`` and ``GPT2Block`` through fitbench's loops finds them
# with transformers 5.17 and 5.24 (the layer's input and residual, the norms' outputs, and in Falcon's
# parallel layer the attention output waiting to be added).
HF_WIDE_AT_MLP = {"llama": (4, 0), "falcon": (5, 0), "gpt2": (4, 1)}


def prefill_transient_bytes(arch: Architecture, tokens: int, widths: Widths, tp: int = 1, backend: str = "native",
                            context: int = 0) -> float:
    """The most one layer holds at once without autograd, and the token ids (8 n).

    Inside the MLP: SwiGLU's silu(gate), up and their product (3 c n f; gate itself is freed once
    silu has read it); Falcon's GELU input and output (2 c n f); GPT-2's tanh GELU, written out in
    tensor operations in transformers, its input and three intermediates (4 c n f), one ``F.gelu`` in
    the native decoder (2 c n f). Beside them, residual-sized
    tensors: in the native decoder three (3 r n h: the layer's input, which the caller still holds,
    the residual after attention and its normalized copy); in transformers' models ``HF_WIDE_AT_MLP``;
    and Falcon's boolean causal mask (B T^2 = n T bytes)."""
    n, h, f, c, r = tokens, arch.hidden_size, arch.ffn_size, widths.compute, widths.residual
    intermediates = {"llama": 3, "falcon": 2, "gpt2": 2 if backend == "native" else 4}[arch.family] * c * n * f / tp
    residuals, casts = (3, 0) if backend == "native" else HF_WIDE_AT_MLP[arch.family]
    mask = n * context if backend == "hf" and arch.family == "falcon" else 0
    return (residuals * r + casts * c) * n * h + intermediates + mask + 8 * n


# ---- the estimate -----------------------------------------------------------------------------


def estimate_memory(arch: Architecture, mode: str, precision: str, batch: int, seq_len: int, *,
                    new_tokens: int = 0, activation_checkpointing: bool = False,
                    checkpointed_layers: int | None = None,
                    parallelism: Parallelism = Parallelism(), resident_layers: int | None = None,
                    backend: str | None = None, compiled: bool = False, stage: int | None = None) -> MemoryEstimate:
    """Peak bytes on one GPU for this configuration, as terms (``at_peak`` marks those that
    coexist at the peak moment). ``resident_layers`` (infer and forward, floating-point weights,
    one GPU) keeps that many decoder layers on the GPU and offloads the rest (``offloaded_weights``).
    ``backend`` (native or hf; by default the family's, ``fitbench.models.backends.default_backend``)
    is the model the run builds. ``checkpointed_layers``: with ``activation_checkpointing``, the first N
    decoder layers of each stage recompute, the others keep their activations (every layer when None;
    ``fitbench.spec.checkpointed_count``; ``_training`` gives the terms). ``compiled``: the native model
    under ``torch.compile`` (``fitbench.planning.compiled``); quantized weights (adapters, inference) keep
    the eager model's terms, an upper bound: their kernels break the graph.

    Under pipeline parallelism the stages differ (uneven layer counts; the embedding on the first,
    the final norm, output projection and logits on the last): ``stage`` (an index) estimates that
    stage's GPUs; by default the estimate is that of the stage with the largest peak, which its
    ``stage`` names (``stage_estimates`` gives them all). A training step's pipeline runs
    ``parallelism.microbatches_of(batch)`` microbatches of ``ceil(batch / m)`` sequences under GPipe,
    every stage running all m forwards before the first backward."""
    backend = backend or default_backend(arch)
    if resident_layers is not None:
        return _offloaded(arch, mode, precision, batch, seq_len, new_tokens, resident_layers, parallelism, backend)
    if parallelism.stages > 1 and stage is None:
        return max(stage_estimates(arch, mode, precision, batch, seq_len, new_tokens=new_tokens,
                                   activation_checkpointing=activation_checkpointing,
                                   checkpointed_layers=checkpointed_layers, parallelism=parallelism,
                                   backend=backend, compiled=compiled), key=lambda estimate: estimate.peak_bytes)
    where = pipeline_stage_list(arch, parallelism.stages)[stage or 0]
    # Only the native decoder's compiled graph has been read; the hf backend keeps the eager terms.
    compiled = compiled and backend == "native"
    widths = Widths.of(precision)
    tp, shards = parallelism.tensor, parallelism.shards
    layers = len(where.layers)
    local_params = layers * rank_layer_params(arch, tp) + rank_edge_params(arch, tp, where)
    training = mode in TRAINING_MODES
    # the stage's layers that recompute: the first ``checkpointed`` (0 without checkpointing)
    checkpointed = checkpointed_count(layers, checkpointed_layers) if activation_checkpointing and training else 0
    facts = entry(precision)
    if training and facts.training == FLOAT8:
        return _float8_training(arch, mode, batch, seq_len, activation_checkpointing, checkpointed_layers,
                                parallelism, backend, compiled, where)
    in_flight = 1
    if training and parallelism.stages > 1:
        microbatches = parallelism.microbatches_of(batch)
        in_flight, batch = microbatches, -(-batch // microbatches)
    if training and facts.quantized and facts.training != ADAPTERS:
        raise ValueError(f"{precision} weights have no backward pass: no training memory model")
    if facts.quantized:
        fmt = facts.storage
        shares = tp_layer_matrices(arch, tp)
        quantized = sum(fmt.matrix_bytes(rows, columns) for rows, columns, _ in shares) * layers
        plain = widths.weights * (local_params - sum(rows * columns for rows, columns, _ in shares) * layers)
        weights = quantized + plain
        terms = [Term("weights", weights, f"{fmt.source}: {quantized:,.0f} B in the layers' "
                                          f"matrices, {plain:,.0f} B in bf16 elsewhere"), rotary_term(arch, backend)]
        per_element = facts.build_temporary_bytes
        # both backends make and quantize one layer at a time (fitbench.worker.quantize, and its hf_layers
        # for transformers' model, as from_pretrained loads a quantized model)
        terms.append(Term("quantizer temporaries",
                          (2 * arch.params_per_layer + per_element * largest_layer_matrix(arch)) / tp,
                          f"one layer in bf16 while it is quantized, and {per_element:g} B x its largest matrix "
                          f"(measured)", frozenset({BUILD})))
        if training:
            return _adapter_training(arch, mode, precision, widths, batch, seq_len, checkpointed, terms,
                                     layers, tp, backend, where, in_flight)
        return _with_stage(_inference(arch, mode, widths, batch, seq_len, new_tokens, terms, tp, where,
                                      precision=precision, backend=backend), where)
    weights = widths.weights * local_params / shards
    terms = [Term("weights", 0.0 if parallelism.offload else weights,
                  f"{widths.weights:g} B x {local_params:,.0f} parameters"
                  + (f" / {shards} FSDP shards" if shards > 1 else "")
                  + (f", {weights:,.0f} B in host memory (CPU offload)" if parallelism.offload else "")),
             rotary_term(arch, backend)]
    if training:
        widths = Widths.of(precision, parallelism)
        return _with_stage(_training(arch, mode, widths, batch, seq_len, checkpointed, terms,
                                     local_params / shards, layers, tp, backend=backend, compiled=compiled,
                                     layout=parallelism, stage=where, in_flight=in_flight), where)
    return _with_stage(_inference(arch, mode, widths, batch, seq_len, new_tokens, terms, tp, where,
                                  precision=precision, backend=backend, compiled=compiled), where)


def stage_estimates(arch: Architecture, mode: str, precision: str, batch: int, seq_len: int, *,
                    parallelism: Parallelism, **options) -> tuple[MemoryEstimate, ...]:
    """``estimate_memory`` of every pipeline stage, in order (one estimate without pipeline
    parallelism); stages of the same shape (layer count, edges, microbatches in flight) are estimated
    once."""
    estimates: dict[tuple, MemoryEstimate] = {}
    result = []
    microbatches = parallelism.microbatches_of(batch)
    for stage in pipeline_stage_list(arch, parallelism.stages):
        shape = (len(stage.layers), stage.first, stage.last)
        if shape not in estimates:
            estimates[shape] = estimate_memory(arch, mode, precision, batch, seq_len, parallelism=parallelism,
                                               stage=stage.index, **options)
        result.append(replace(estimates[shape], stage=stage) if parallelism.stages > 1 else estimates[shape])
    return tuple(result)


def _with_stage(estimate: MemoryEstimate, stage: Stage) -> MemoryEstimate:
    """``estimate`` naming its pipeline stage, where there are several."""
    return replace(estimate, stage=stage) if stage.count > 1 else estimate


def _offloaded(arch, mode, precision, batch, seq_len, new_tokens, resident, parallelism, backend) -> MemoryEstimate:
    """Inference with ``k = resident`` of the L decoder layers on the GPU:

    - weights: w x (P - (L - k) x parameters per layer): the edges and k layers;
    - the offloaded layer in flight, w x parameters per layer, while L - k > 0: accelerate's hook
      copies a whole offloaded layer onto the GPU before its forward and drops it after,
      synchronously and without prefetch, so one layer is in flight at a time. It is counted at
      every moment because accelerate's device map keeps that room free for the whole run, which
      makes the split predicted here the one it makes; at the output projection the room is in fact
      empty, so there the prediction is one layer high;
    - the KV cache of all L layers and the temporaries, as without offload.
    """
    if mode in TRAINING_MODES or entry(precision).quantized or parallelism.gpus > 1:
        raise ValueError(f"offload models inference with floating-point weights on one GPU, not {mode} "
                         f"{precision} over {parallelism.gpus} GPU(s)")
    if not 0 <= resident <= arch.num_layers:
        raise ValueError(f"resident_layers must be 0 to {arch.num_layers}, got {resident}")
    widths = Widths.of(precision)
    w, L, per_layer = widths.weights, arch.num_layers, arch.params_per_layer
    on_gpu = arch.total_params - (L - resident) * per_layer
    terms = [Term("weights", w * on_gpu, f"{w:g} B x {on_gpu:,} parameters: the embeddings, final norm, output "
                  f"projection and {resident} of {L} layers"), rotary_term(arch, backend)]
    if resident < L:
        terms.append(Term("offloaded layer in flight", w * per_layer, f"{w:g} B x {per_layer:,} parameters: one "
                          f"offloaded layer, copied in for its forward"))
    return _inference(arch, mode, widths, batch, seq_len, new_tokens, terms, 1, precision=precision, backend=backend)


def offloaded_weights(arch: Architecture, precision: str, resident_layers: int) -> float:
    """Bytes kept off the GPU: w x (L - k) x parameters per layer."""
    return Widths.of(precision).weights * (arch.num_layers - resident_layers) * arch.params_per_layer


def rotary_term(arch: Architecture, backend: str = "native") -> Term:
    """The native decoder's cos and sin tables, fp32, for every position of the context. transformers
    keeps only the inverse frequencies (D / 2 fp32) and computes cos and sin for each forward's own
    positions; learned positions (GPT-2) are a weight, counted with the weights."""
    if arch.position_embeddings != "rotary":
        return Term("rotary tables", 0.0, "none: learned positions")
    if backend == "hf":
        return Term("rotary tables", 2 * arch.head_dim, f"{arch.head_dim // 2} inverse frequencies x 4 B")
    size = 2 * arch.max_seq_len * arch.head_dim * 4
    return Term("rotary tables", size, f"2 x {arch.max_seq_len} positions x {arch.head_dim} x 4 B")


def autocast_copies(arch: Architecture, widths: Widths, saved_layers: float, tp: int,
                    output: float | None = None) -> tuple[float, str]:
    """16-bit copies of the weights under autocast. Autograd saves each matmul's copy for the
    backward pass, so a training step holds those of every layer whose activations it keeps, and
    always the output projection's (``output`` parameters of it on this rank: V h by default, none on
    a pipeline stage without it); without autograd each copy lives only for its matmul, and the
    largest (the output projection, or one MLP matrix) bounds them."""
    if not widths.autocast:
        return 0.0, ""
    output = arch.vocab_size * arch.hidden_size if output is None else output
    if saved_layers == 0:
        largest = max(output, largest_layer_matrix(arch) / tp)
        return widths.compute * largest, f"{widths.compute} B x {largest:,.0f}: the largest matrix, cast for its matmul"
    params = layer_matmul_params(arch) * saved_layers / tp + output
    return widths.compute * params, f"{widths.compute} B x {params:,.0f} matmul parameters saved by autograd"


# RECOMPUTE: of the last layer that recomputes (the last of a stage under full checkpointing, the
# last of the first N under ``checkpointed_layers`` N).
START, RECOMPUTE, FIRST, END = ("start of the backward pass", "recompute of the last layer",
                                "backward of the first layer", "end of the backward pass")
# GPipe with two microbatches or more: the second microbatch's backward, beside the first one's gradients
LATER = "backward of the second microbatch"


def _float8_training(arch, mode, batch, seq_len, recompute, checkpointed_layers, parallelism, backend,
                     compiled=False, stage=None):
    """fp8 training (torchao float8, row-wise): bf16 weights, gradients and AdamW state as in the
    unquantized base (``UNQUANTIZED_BASE``, bf16-pure), and each converted matmul saves its bf16 input and weight, as a bf16 matmul does;
    the float8 copies live only inside a matmul. The largest bound them: the MLP matrix's weight
    cast twice (along rows for the forward, along columns for the backward) and the n x f
    operands of the down projection's backward (its input and incoming gradient) in float8."""
    estimate = estimate_memory(arch, mode, UNQUANTIZED_BASE, batch, seq_len, activation_checkpointing=recompute,
                               checkpointed_layers=checkpointed_layers,
                               parallelism=parallelism, backend=backend, compiled=compiled,
                               stage=stage.index if stage else None)
    if parallelism.stages > 1:  # one microbatch in a matmul at a time
        batch = -(-batch // parallelism.microbatches_of(batch))
    n, h, f, tp = batch * seq_len, arch.hidden_size, arch.ffn_size, parallelism.tensor
    casts = (2 * h * f + 2 * n * f) / tp
    moments = frozenset(m for m in estimate.moments if m != START)
    terms = estimate.terms + (Term("float8 casts", casts, "2 h f + 2 n f: one MLP matrix cast twice and the "
                                   "down projection's backward operands, 1 B each", moments),)
    return MemoryEstimate(terms, estimate.moments, estimate.stage)


def _adapter_training(arch, mode, precision, widths, batch, seq_len, checkpointed, terms, layers, tp, backend,
                      stage, in_flight=1):
    """Adapters on a frozen quantized base (``fitbench.worker.adapters``): the base weights are in
    ``terms``; the adapters' fp32 weights, gradients and AdamW state are 16 B per adapter parameter.
    Gradients flow through every frozen matmul, so activations are saved as in bf16-pure training
    (transformers' norms less their normalized outputs, kept only for their frozen weights'
    gradients; the native norms save the same either way), plus each
    adapter's r-wide intermediate (c n r per matmul) and, for LLM.int8, its outlier columns; the
    frozen matmul's backward dequantizes its weight to bf16 for the gradient of its input (2 x the
    largest matrix)."""
    n = batch * seq_len
    A = adapter_params(arch) * layers / arch.num_layers / tp
    terms = [*terms, Term("adapters", 4 * A, f"4 B x {A:,.0f} fp32 adapter parameters (rank {ADAPTER_RANK})")]
    estimate = _training(arch, mode, widths, batch, seq_len, checkpointed, terms, 0.0, layers, tp, trainable=A,
                         backend=backend, stage=stage, in_flight=in_flight)
    saving_layers = (layers - checkpointed) * in_flight  # the layers that keep their activations
    extra_saved = widths.compute * n * ADAPTER_RANK * len(layer_matrices(arch)) * saving_layers
    matmuls = len(arch.layer_matrices)
    added = [Term("adapter activations", extra_saved, f"{widths.compute} B x n x r per matmul, {matmuls} per layer",
                  frozenset({START}))]
    if entry(precision).outlier_columns:
        inputs = sum(columns for _, columns in layer_matrices(arch)) * INT8_OUTLIER_COLUMNS
        added.append(Term("LLM.int8 outlier columns", 2 * n * inputs * saving_layers / tp,
                          f"2 B x n x {INT8_OUTLIER_COLUMNS:g} of each matmul's input columns, {matmuls} per layer "
                          f"(measured fraction)", frozenset({START})))
    largest = largest_layer_matrix(arch)
    added.append(Term("dequantized weight in backward", 2 * largest / tp, "2 B x the largest matrix: the frozen "
                      "matmul's weight in bf16 for its input's gradient",
                      frozenset({FIRST, RECOMPUTE} if checkpointed else {FIRST})))
    return _with_stage(MemoryEstimate(estimate.terms + tuple(added), estimate.moments + (BUILD,)), stage)


def _training(arch, mode, widths, batch, seq_len, checkpointed, terms, local_params, layers, tp,
              trainable: float | None = None, backend: str = "native", compiled: bool = False,
              layout: Parallelism = Parallelism(), stage: Stage | None = None, in_flight: int = 1):
    """A training step's terms. ``trainable``: adapter parameters (fp32) when the weights are a frozen
    base; then gradients and optimizer state are the adapters', and no weight gradient forms.

    ``checkpointed``: the first C of the stage's ``layers`` recompute their activations (activation
    checkpointing), the other K = layers - C keep them (C = 0: none; C = layers: every layer). With
    ``one`` a kept layer's saved bytes (``saved_per_layer``) and ``r n h`` a checkpointed layer's
    input (``recompute_per_layer``), per microbatch:

    - start of the backward pass: K one + C r n h (every layer's, as Megatron-LM's block-wise
      recomputation and Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
      Transformer Models", count them);
    - the recompute of the last checkpointed layer (layer C - 1): the backward pass reaches it after
      the K kept layers, whose activations are freed by then and whose gradients are formed (w K p on
      one GPU; DDP's buckets and FSDP's reduce-scatter pool hold them at every moment, and FSDP also
      holds the last kept layer's reduce-scatter input, rd p); so C r n h, one layer recomputed, the
      gradient flowing in, and those gradients. Recomputing the first C rather than the last keeps the
      recomputed layer from standing beside the kept activations.
    ``compiled``: layers, the final norm and the embedding's gradient as ``fitbench.planning.compiled`` has them.
    ``layout``: DDP's buckets and FSDP's units in flight (the module docstring); adapters on a frozen
    base keep one GPU's terms, their few gradients in a bucket or a shard changing little.

    ``stage``: a pipeline stage, ``batch`` one microbatch of it and ``in_flight`` the microbatches
    whose activations it holds at once (GPipe: all of them): the embedding's terms are the first
    stage's, the final norm's, the output projection's and the loss's the last's (one microbatch's
    logits at a time: the loss is formed in each microbatch's forward, its chain freed once reduced
    to the loss). Under tensor parallelism the output projection and the embedding are split over the
    vocabulary and the logits gathered whole on each rank, so the loss chain is one GPU's."""
    n, V, h = batch * seq_len, arch.vocab_size, arch.hidden_size
    c, r, w = widths.compute, widths.residual, widths.weights
    stage = stage or Stage(0, 1, range(arch.num_layers))
    has_embedding, has_head = stage.first, stage.last
    frozen = trainable is not None  # adapters on a frozen base: embeddings and norms are frozen too
    sharded = layout.shards > 1 and not frozen
    ddp = layout.layout.dp_replicate > 1 and layout.shards == 1 and not frozen
    # The output projection's share on this rank, where this stage holds it.
    output = V * h / tp if has_head else 0.0
    recompute = checkpointed > 0
    kept = layers - checkpointed
    every = recompute and kept == 0  # every layer of the stage recomputes
    moments = (START, RECOMPUTE, FIRST, END) if recompute else (START, FIRST, END)
    later = (LATER,) if in_flight > 1 else ()  # GPipe's second microbatch: the first one's gradients exist
    moments += later
    rows = min(loss_chunk_rows(V), n)
    head_backward = (output_backward_bytes(n, h, V, widths, 0.0 if frozen else output) - loss_chain_bytes(n, V, c)
                     if has_head else 0.0)

    def at(*names: str) -> frozenset[str]:
        return frozenset(names)

    one_layer = (inductor.saved_per_layer(arch, n, c, r, tp) if compiled
                 else saved_per_layer(arch, n, widths, tp, frozen_norms=frozen, backend=backend, context=seq_len))
    one_layer_casts = c * layer_matmul_params(arch) / tp if widths.autocast and not sharded else 0.0
    # a layer's backward pass at its widest, beyond what the layer saved (native eager only)
    widest = 0.0 if compiled else backward_transient_bytes(arch, n, widths, tp, backend)
    # An untied input embedding gets its gradient from the very last backward operator, after the
    # first layer's activations are gone; a tied one is counted with the tied gradients where one
    # stage holds both ends of the model.
    tied_here = arch.tie_embeddings and has_embedding and has_head
    embedding_grad = 0.0 if tied_here or sharded or frozen or not has_embedding else V * h / tp
    saved = layers * in_flight
    held = f"{layers:g} layers x {in_flight} microbatches in flight" if in_flight > 1 else f"{layers:g} layers"
    inputs = recompute_per_layer(arch, n, widths)
    # one microbatch's activations at the start of the backward pass
    per_microbatch = inputs * checkpointed + one_layer * kept
    at_recompute: list[Term] = []
    if every:
        activations = Term("activations", inputs * saved, f"{held} x {inputs:,.0f} B: each layer's "
                           f"input, kept for recomputation", at(START, RECOMPUTE))
    elif recompute:
        microbatches = f"{in_flight} microbatches x " if in_flight > 1 else ""
        activations = Term("activations", per_microbatch * in_flight, f"{microbatches}({kept} layers x "
                           f"{one_layer:,.0f} B saved per layer + {checkpointed} checkpointed layers x {inputs:,.0f} "
                           f"B: each one's input, kept for recomputation)", at(START))
        # this microbatch's kept layers are through their backward; the others' wait (GPipe)
        at_recompute.append(Term(
            "activations at the recompute", inputs * checkpointed * in_flight + one_layer * kept * (in_flight - 1),
            f"the {checkpointed} checkpointed layers' inputs"
            + (f" of {in_flight} microbatches, the {kept} kept layers' activations of the other {in_flight - 1}"
               if in_flight > 1 else ", the kept layers' activations freed by their backward"), at(RECOMPUTE)))
    else:
        # compiled, the first layer saves a 16-bit tensor in place of an fp32 one (on the first stage)
        first = inductor.first_layer_saving(arch, n, c, r) if compiled and layers == arch.num_layers else 0.0
        activations = Term("activations", one_layer * saved - first, f"{held} x {one_layer:,.0f} B saved "
                           f"per layer" + (f", less {first:,.0f} B in the first" if first else ""), at(START))
    if in_flight > 1:  # GPipe: the first microbatch's backward forms every gradient beside the others' activations
        terms.append(Term("other microbatches' activations", per_microbatch * (in_flight - 1),
                          f"{in_flight - 1} microbatches x {per_microbatch:,.0f} B: GPipe runs every forward before "
                          f"the first backward, so the others' activations wait while its gradients form (and, "
                          f"at the second's backward, its own and the later ones')", at(FIRST, *later)))
        terms += gpipe_terms(arch, n, widths, tp, stage, in_flight, one_layer if recompute else 0.0, frozen)
    if layout.offload and not frozen:
        state = Term("optimizer state", 0.0, f"AdamW's moments of the shards, {2 * w * local_params:,.0f} B in host "
                     f"memory (CPU offload), where the optimizer steps")
        gradients = Term("gradients", 0.0, f"the shards' gradients, {w * local_params:,.0f} B in host memory (CPU "
                         f"offload), copied there after each reduce-scatter")
    elif ddp:
        state = Term("optimizer state", 2 * w * local_params if mode == "train" else 0.0,
                     "AdamW first and second moments, 2 x weight bytes")
        gradients = Term("gradient buckets", w * local_params, f"{w:g} B x {local_params:,.0f} parameters: DDP's "
                         f"buckets, the gradients' storage (gradient_as_bucket_view), from construction on")
    elif not frozen:
        state = Term("optimizer state", 2 * w * local_params if mode == "train" else 0.0,
                     "AdamW first and second moments, 2 x weight bytes")
        gradients = Term("gradients", w * (local_params - embedding_grad), f"{w:g} B x {local_params:,.0f} parameters"
                         + (", less the input embedding's" if embedding_grad else ""), at(FIRST, END, *later))
    else:
        state = Term("optimizer state", 8 * trainable if mode == "train" else 0.0,
                     "AdamW first and second moments of the adapters, 2 x 4 B")
        gradients = Term("gradients", 4 * trainable, f"4 B x {trainable:,.0f} adapter parameters",
                         at(FIRST, END, *later))
    terms = [*terms, state, gradients, activations, *at_recompute]
    if widths.autocast and not sharded:
        # Recomputed layers save no copy, but eager autocast caches each weight's copy until its region
        # closes, after the loss: at the loss every copy is alive either way. A compiled graph casts
        # inside itself, past the cache.
        if every and compiled:
            casts, formula = c * output, f"{c} B x V h / {tp}: the output projection's copy, saved by autograd"
        elif recompute and compiled:
            casts, formula = autocast_copies(arch, widths, kept, tp, output)
            formula += f": the {kept} kept layers' and the output projection's"
        else:
            casts, formula = autocast_copies(arch, widths, layers, tp, output)
            if recompute:
                formula += ", held by autocast's cache until the loss is formed"
        terms.append(Term("autocast weight copies", casts, formula, at(START)))
    if has_head:
        terms += [
            Term("final norm and output input", inductor.final_saved_bytes(arch, n, c, r, every) if compiled
                 else final_saved_bytes(arch, n, widths, frozen_norm=frozen, backend=backend),
                 "saved by the final norm and the output projection", at(START)),
            Term("loss chain", loss_chain_bytes(n, V, c), f"the {c} B logits, overwritten by their gradient, and one "
                 f"chunk's fp32 exponentials: {c} n V + 4 r V, n = {n:,}, r = {rows:,}, V = {V:,}", at(START)),
        ]
        if head_backward > 0:
            terms.append(Term("output projection backward", head_backward, "where the output projection's backward "
                              "holds more than the loss (output_backward_bytes less the loss chain): its gradients "
                              "beside the logits'", at(START)))
    if recompute:
        output_grad = 0.0 if frozen or sharded else w * output  # FSDP: one of the root's gradients
        # the kept layers' gradients, formed before the recompute (DDP's buckets and FSDP's pool hold them already)
        kept_grads = 0.0 if frozen or sharded or ddp else w * kept * rank_layer_params(arch, tp)
        terms.append(Term("recomputed last layer", one_layer + one_layer_casts + widest + output_grad + kept_grads
                          + r * n * h,
                          "one layer's activations (and weight copies) recomputed, with the output projection's "
                          "gradient" + (f", the {kept} kept layers' gradients" if kept_grads else "")
                          + " and the gradient flowing into the layer"
                          + (", and its SwiGLU's gradients" if widest else ""), at(RECOMPUTE)))
        if sharded and kept:
            p = rank_layer_params(arch, tp)
            terms.append(Term("FSDP reduce-scatter input", w * p, f"rd p = {w:g} B x {p:,}: the last kept layer's "
                              f"reduce-scatter input, held until the recomputed layer's is issued", at(RECOMPUTE)))
    if compiled:  # the layer as inductor's partition saves it; its backward's own tensors are not modelled
        terms.append(Term("first layer in backward", one_layer + one_layer_casts,
                          "one layer's saved activations (and weight copies) while the last gradients form", at(FIRST)))
        if checkpointed >= 2 and not layout.shards > 1 and not frozen:
            # one graph for every layer (FSDP compiles each layer alone): the next layer's recompute runs early
            p = rank_layer_params(arch, tp)
            ahead = inductor.recompute_ahead_bytes(arch, n, c, r, w * p, tp)
            terms.append(Term("next layer recomputed ahead", ahead, f"saved per layer - w p = {one_layer:,.0f} - "
                              f"{w:g} x {p:,} B: inductor's schedule recomputes the next "
                              f"checkpointed layer before this one's gradients are formed", at(FIRST)))
    else:
        # The first layer's gradients its MLP's backward has not formed yet are counted with the others
        # (FSDP's unsharded ones in the compute width), though they take nothing yet; DDP's buckets do
        # hold them already, and frozen weights form none.
        unformed = 0.0 if frozen or ddp else (c if sharded else w) * first_layer_unformed(arch, tp)
        temporaries = mlp_backward_bytes(arch, n, widths, tp)
        terms.append(Term("first layer in backward", max(0.0, one_layer + one_layer_casts + temporaries - unformed),
                          f"one layer's saved activations (and weight copies) at its MLP's backward, with the "
                          f"gradients there ({temporaries:,.0f} B), less its gradients not yet formed "
                          f"({unformed:,.0f} B)", at(FIRST)))
    if sharded:
        terms += fsdp_in_flight(arch, c, w, layout.shards, tp)
    if sharded and not layout.offload:
        terms.append(Term("reduce-scatter pool", gradients.bytes, "the sharded gradients' pages: views of the "
                          "reduce-scatter outputs, allocated on FSDP's reduce-scatter stream, whose pool keeps them "
                          "mapped while the gradients are None", at(START, RECOMPUTE), cached=True))
    if sharded and layout.offload:
        terms.append(fsdp_offload_staging(arch, w, c, layout.shards))
    if ddp and not frozen:
        terms.append(Term("second gradient buckets", w * local_params, f"{w:g} B x {local_params:,.0f}: measured on "
                          "2 x H200 (torch 2.11, benchmarks/results/2026-11-24-h200x2-data-parallel), 5 of 6 ranks "
                          "held a second set of buckets' bytes at every moment (1B preset: 62.0 GB against 57.9 GB); "
                          "rank 0's allocator snapshot, where it did not, shows the set DDP rebuilds after its first "
                          "step"))
    if ddp and tied_here:
        terms.append(Term("tied gradient awaiting its sum", w * V * h, "w x V h: the output projection's "
                          "contribution, held by autograd until the embedding's joins it and the sum goes to its "
                          "bucket", at(FIRST)))
    if embedding_grad:
        terms.append(Term("input embedding gradient", w * embedding_grad, f"w x V h / {tp}, formed by the last "
                          "backward operator" + (", before DDP copies it into its bucket" if ddp else "")
                          + (" (under GPipe, the first microbatch's)" if later else ""), at(END, *later)))
    accumulator = inductor.embedding_gradient_accumulator(arch, w) / tp if compiled and not frozen and \
        has_embedding else 0.0
    if accumulator:
        terms.append(Term("embedding gradient accumulator", accumulator, "4 B x V h: the compiled embedding "
                          "backward's fp32 sum, cast to the weights' dtype", at(END)))
    if tied_here and not frozen and not sharded:
        terms.append(Term("tied embedding gradients", 2 * w * V * h, "the input embedding's gradient and its sum "
                          "with the output projection's, 2 x V h x weight bytes", at(END)))
    return MemoryEstimate(tuple(terms), moments)


def gpipe_terms(arch: Architecture, tokens: int, widths: Widths, tp: int, stage: Stage, microbatches: int,
                recomputed: float, frozen: bool = False) -> list[Term]:
    """What a stage of GPipe (``torch.distributed.pipelining.ScheduleGPipe``, m >= 2 microbatches of n
    tokens each) holds beyond one microbatch's step, per rank (torch 2.11 to 2.13,
    ``torch/distributed/pipelining/stage.py``):

    - the stage's output of every microbatch whose backward has not run, kept by the schedule for it
      (``fwd_cache``): m - 1 of them at the first microbatch's backward and at the second's start; on
      the last stage the logits, c n V / tp x tp = c n V each (the fused loss wrote their gradient over
      them), elsewhere the hidden states, r n h each;
    - a receive buffer per microbatch for the gradient of the stage's output, on every stage but the
      last, allocated at the first step and kept: m r n h (the forward's buffers are the next
      layer's inputs, counted with the activations);
    - at the second microbatch's backward (``LATER``) every gradient exists already, the first
      microbatch's (the gradients term, the input embedding's on the first stage included), and each
      new one is formed beside the one it is added to: the layer in backward (its recomputed
      activations ``recomputed`` under checkpointing, the weight copies under autocast and its MLP's
      backward, ``mlp_backward_bytes``) with the largest parameter's new gradient (c, then cast to w
      under autocast), or on the last stage the output projection's backward where larger, its input's
      gradient and its weight's new gradient, c (n h + V h / tp).

    Measured on 4 x H100 (13B, bf16-pure, 4 x 1024, checkpointed, 4 stages of 10 layers,
    ``benchmarks/results/2026-11-27-h100x4-model-parallel/8``): allocated peaks 0.72, 0.41, 0.41 and
    0.61 GB above the first microbatch's backward as planned before, for the first, middle and last
    stages; these terms add 0.78, 0.45, 0.45 and 0.58 GB there."""
    n, h, V = tokens, arch.hidden_size, arch.vocab_size
    c, r, w = widths.compute, widths.residual, widths.weights
    output = c * n * V if stage.last else r * n * h
    terms = [Term("outputs awaiting their backward", (microbatches - 1) * output,
                  f"{microbatches - 1} x " + (f"c n V = {c} x {n:,} x {V:,}" if stage.last else
                                              f"r n h = {r} x {n:,} x {h:,}")
                  + ": the stage's outputs the schedule keeps for the microbatches not yet backward",
                  frozenset({START, RECOMPUTE, FIRST, LATER}))]
    if not stage.last:
        terms.append(Term("gradient receive buffers", microbatches * r * n * h,
                          f"m r n h = {microbatches} x {r} x {n:,} x {h:,}: one buffer per microbatch for the "
                          f"gradient of the stage's output, kept from the first step on"))
    new_gradient = 0.0 if frozen else (c + (w if widths.autocast else 0)) * largest_layer_matrix(arch) / tp
    casts = c * layer_matmul_params(arch) / tp if widths.autocast else 0.0
    layer = recomputed + casts + mlp_backward_bytes(arch, n, widths, tp) + new_gradient
    head = c * (n * h + (0 if frozen else V * h / tp)) if stage.last else 0.0
    terms.append(Term("second microbatch in backward", max(layer, head),
                      f"max(layer, head) = max({layer:,.0f}, {head:,.0f}) B: a layer's backward (recomputed "
                      f"activations, weight copies, its MLP's gradients and the largest parameter's new gradient "
                      f"before it is added to the first microbatch's) or the output projection's (its input's "
                      f"gradient and its weight's new one)", frozenset({LATER})))
    return terms


def copy_in_pool(layer: float, root: float, g: int) -> tuple[float, str]:
    """Bytes FSDP's copy-in stream keeps mapped, and the formula that gives them, from ``layer`` = c p and
    ``root`` = c E, the gathered bytes of a decoder layer and of the root, over g shards
    (``fsdp_in_flight``): 2 c p + c E where the root's all-gather output is smaller than a layer's,
    else max(2 c p, (1 + 1/g) c E)."""
    if root < layer:
        return 2 * layer + root, "2 c p + c E"
    return max(2 * layer, (1 + 1 / g) * root), "max(2 c p, (1 + 1/g) c E)"


def fsdp_in_flight(arch: Architecture, c: float, rd: float, g: int, tp: int = 1) -> list[Term]:
    """FSDP2's unsharded units beside the shards (the module docstring): c the gathered (compute)
    dtype's width, rd the reduce dtype's, which is the sharded parameters' own (fp32 under
    ``MixedPrecisionPolicy(bf16, reduce fp32)``, bf16 in bf16-pure), g the shards. Under FSDP x TP each
    unit gathers the rank's tensor-parallel share (``rank_layer_params``, ``rank_edge_params``).

    An all-gather's flat input and output are allocated on FSDP's copy-in stream and the parameters
    are copied out of it into their own storage on the compute stream. The caching allocator keeps a
    pool per stream, so the copy-in stream's pool stays mapped at its largest from the first step on:
    two layers' outputs, or the root's output with its input, max(2 c p, (1 + 1/g) c E); where the
    root's output is smaller than a layer's (c E < c p), the block it leaves is never large enough for
    a layer's output, and the two layers' outputs are mapped beside it: 2 c p + c E (``copy_in_pool``).
    Read from the allocator's snapshots, torch 2.11 (``benchmarks/allocator_streams.py``): on
    2 x H200, 1.46 GiB for the 20B preset in bf16-pure, 2 c p (c E = 1.007 c p), and 2.94 GiB for
    llama-3.1-8b in bf16, (1 + 1/2) c E; on 4 x H200 and 4 x H100, 2.79 GiB for the 30B preset in
    bf16-pure, 2 c p + c E (c E = 0.80 c p)."""
    whole = Stage(0, 1, range(arch.num_layers))
    p, V, h = rank_layer_params(arch, tp), arch.vocab_size, arch.hidden_size // tp
    E = rank_edge_params(arch, tp, whole)
    head = V * h + arch.final_norm_params
    G = E + (V * h if arch.tie_embeddings else 0)
    pool, pool_formula = copy_in_pool(c * p, c * E, g)
    return [
        Term("FSDP root gathered", c * E, f"c E = {c:g} B x {E:,} parameters of the root (embeddings, final norm, "
             f"output projection), not resharded after forward"),
        Term("FSDP layers gathered", 2 * c * p, f"2 c p = 2 x {c:g} B x {p:,}: the layer at work, copied out of "
             f"its all-gather, and an all-gather output", frozenset({START, RECOMPUTE, FIRST})),
        Term("FSDP all-gather pool", pool - c * p,
             f"{pool_formula} - c p, c p = {c * p:,.0f} B, c E = {c * E:,.0f} B, g = {g}: the copy-in stream's pool "
             f"(two layers' all-gather outputs, beside the root's where it is the smaller, or the root's "
             f"output and input) beyond the output in use", cached=True),
        Term("FSDP layer gradients", (c + rd) * p, f"(c + rd) p = ({c:g} + {rd:g}) B x {p:,}: a layer's unsharded "
             f"gradients beside the previous layer's reduce-scatter input", frozenset({FIRST})),
        Term("FSDP root gradients", c * head, f"c (V h + norm) = {c:g} B x {head:,}: the output projection's and "
             f"final norm's gradients, unsharded until the root's reduce-scatter", frozenset({RECOMPUTE, FIRST})),
        Term("FSDP root reduce-scatter", max(c * G + rd * p, rd * E), f"max(c G + rd p, rd E), G = {G:,}: the "
             f"root's gradients beside the first layer's reduce-scatter input, then the root's own input",
             frozenset({END})),
    ]


def fsdp_offload_staging(arch: Architecture, w: float, c: float, g: int) -> Term:
    """Under FSDP's CPU offload, what of the shards passes through the GPU: before a unit's all-gather
    its shard is copied in (w) and cast into the all-gather's input (c), and after its reduce-scatter
    the gradient's shard waits for its copy back to host memory (w); two layers in flight, the root's
    larger shard counted for one of them (torch 2.13, ``torch/distributed/fsdp/_fully_shard/``
    ``_fsdp_param.py``: ``offload_to_cpu``)."""
    p = arch.params_per_layer
    E = arch.total_params - p * arch.num_layers
    shard = (p + max(p, E)) / g
    return Term("FSDP offload staging", (2 * w + c) * shard, f"(2 w + c) (p + max(p, E)) / g = ({2 * w:g} + {c:g}) "
                f"B x {shard:,.0f}: two units' shards copied in, cast for their all-gather, and their gradients' "
                f"shards on the way out")


MLP, OUTPUT, BUILD = "prefill MLP", "output projection", "quantizing a layer"
SHARDS = "building the tensor-parallel shards"
OUTLIERS = "LLM.int8 outlier columns"


def int8_outlier_terms(arch: Architecture, tokens: int, widths: Widths, tp: int = 1) -> list[Term]:
    """LLM.int8's widest moment in a prefill or forward of n tokens: the MLP's output projection (h x f)
    taking its k outlier columns (``fitbench.planning.outliers``) out of the int8 product
    (bitsandbytes' ``int8_mixed_scaled_mm``). Beside the residual stream (3 r n h, as at the MLP) and
    the projection's input (c n f): the outlier columns of the input in fp16 (2 n k), the same columns
    of the int8 weight gathered (h k), the weight columns dequantized in fp32, the product with the row
    scales and its scaled copy (2 x 4 h k), and two n x h 4-byte buffers of the int8 product. Traced on
    one H200 (benchmarks/peak_anatomy.py, 7B 4 x 512): 612 MB live against 613 MB from this formula.

    The reserve: the dequantized columns change size from layer to layer as k does, so the caching
    allocator finds no hole of the next size and maps more; on the same trace reserved memory grew by
    four blocks of the pair's size (713 MB) for the 360 MB the pair holds: one more pair (8 h k)."""
    n, h, f, c, r = tokens, arch.hidden_size, arch.ffn_size, widths.compute, widths.residual
    k = outlier_columns(arch, n) / tp
    live = 3 * r * n * h + c * n * f / tp + 2 * n * k + 9 * h * k + 8 * n * h
    return [Term("LLM.int8 outlier columns", live,
                 f"3 r n h + c n f + 2 n k + 9 h k + 8 n h, k = {k:,.0f} of {f / tp:,.0f} input columns of the "
                 f"MLP's output projection holding an outlier (|x| >= 6) on random weights", frozenset({OUTLIERS})),
            Term("LLM.int8 allocator reserve", 8 * h * k, "one more fp32 pair of dequantized outlier columns "
                 "(8 h k): blocks that change size from layer to layer (measured)", frozenset({OUTLIERS}))]


# Bytes per element of a matmul's input while torchao quantizes it: three fp32 copies (the input
# upcast, its scaled and its clamped values) and the 8-bit result. Traced on an H200 at 3B fp8
# 4 x 1024 (``benchmarks/results/2026-11-23-h200-packed-build/anatomy``): three 134.2 MB fp32 blocks
# (``_quantize_affine_float8``) and a 33.6 MB float8 one, for the 4,096 x 8,192 input of down_proj.
ACTIVATION_QUANTIZATION_BYTES = 13


def activation_quantization_term(arch: Architecture, tokens: int, compute: float, tp: int) -> Term:
    """The widest matmul input, ``n x f`` for the MLP's down projection, being quantized: 13 B per
    element beside it. In Llama's MLP silu(gate) and up (``2 c n f`` of the MLP temporaries) are
    freed by then, so the term adds ``(13 - 2 c) n f``; other families add the 13 B in full."""
    freed = 2 * compute if arch.family == "llama" else 0
    per_element = ACTIVATION_QUANTIZATION_BYTES - freed
    return Term("activation quantization", per_element * tokens * arch.ffn_size / tp,
                f"({ACTIVATION_QUANTIZATION_BYTES} - {freed:g}) B x {tokens:,} tokens x {arch.ffn_size:,}: the "
                f"down projection's input in fp32 three times and quantized, beside the MLP's product",
                frozenset({MLP}))


# LLM.int8 at the MLP, per element of n x f beyond the three 16-bit intermediates the MLP temporaries
# count: the up projection's int32 product (4 B) and one more 16-bit copy (2 B). Traced on an H200 at
# 1B int8 8 x 256 (``benchmarks/results/2026-11-23-h200-packed-build/anatomy/1B-int8-8x256.json``):
# a 67.1 MB int32 block (bitsandbytes' ops.py:80) and four 33.6 MB 16-bit ones at 2,048 x 8,192.
INT8_PRODUCT_BYTES = 6


def prefill_reserve_term(arch: Architecture, precision: str, tokens: int, tp: int) -> Term | None:
    """The caching allocator's reserve at a quantized model's prefill MLP: one more block of the
    MLP's largest temporary. The holes one layer's MLP leaves are split by the next layer's smaller
    blocks before its MLP needs them again, so the allocator maps the largest temporary anew. Traced on
    an H200 at 3B fp8 4 x 1024 (``benchmarks/results/2026-11-23-h200-packed-build/anatomy``): the three
    134 MB fp32 temporaries of the down projection's input each mapped pages twice, 187 MB reserved
    beyond the allocations at the peak; 3B nf4 8 x 512: 226 MB, where the product of the MLP (67 MB) is
    the largest; 1B int8 8 x 256: 60 MB. The largest temporary (the entry's ``prefill_reserve``): the
    fp32 copy of the down projection's input (4 B x n x f) where activations are quantized (fp8,
    int8-dynamic); the up projection's int32 product (4 B x n x f) for LLM.int8 (its outlier columns have
    their own, ``int8_outlier_terms``); the MLP's product (c x n x f) for bitsandbytes' 4-bit weights.
    torchao's int4 and fp8-block were not traced and get none."""
    reserve = entry(precision).prefill_reserve
    if tokens <= 1 or reserve is None:
        return None
    per_element, what = reserve.bytes, reserve.what
    return Term("allocator reserve at the MLP", per_element * tokens * arch.ffn_size / tp,
                f"{per_element:g} B x {tokens:,} tokens x {arch.ffn_size:,}: {what} mapped once more, the holes "
                f"of the previous layer split by smaller blocks (traced)", frozenset({MLP}))


def _inference(arch, mode, widths, batch, seq_len, new_tokens, terms, tp, stage=None, *, precision,
               backend="native", compiled=False):
    """Without autograd, a layer's temporaries die with it. Two moments can peak: the widest MLP,
    where silu(gate), up and their product (3 c n f) live beside the layer's input, the residual
    after attention and its normalized copy (3 r n h) and the token ids (8 n); and the output projection, with the final normalized input (r n h), its 16-bit
    cast under autocast, the projection's own cast weight (V h c) and the logits. ``compiled``: inductor's
    fused MLP and final norm (``fitbench.planning.compiled``).

    Quantized weights (``precision``) add the moment of the build (``quantizer temporaries``), when no
    step has run and no KV cache exists yet; so does tensor parallelism of other weights, whose
    ranks draw each whole weight into one scratch buffer and keep their shards
    (``fitbench.worker.tensor_parallel``): the shards and the largest whole weight; a weight some formats
    dequantize for a prefill matmul (the entry's ``dequantized``: 4-bit weights to bf16, 2 B x the largest
    matrix, at the MLP; float8 weight-only ones for every matmul, through fp32); LLM.int8 adds the moment
    of its outlier columns (``int8_outlier_terms``).

    A pipeline ``stage`` holds the KV cache of its own layers, and only the last stage the output
    projection's moment. Tensor parallelism (degree ``tp``) splits the layers' intermediates, the
    kv heads where they divide by it (``kv_heads_split``; else each rank caches all of them) and the
    output projection over the vocabulary; the logits are gathered whole on each rank, beside the
    rank's own slice of them, and for more than one row copied from the gather's rank-major buffer
    into vocabulary order (``fitbench.worker.tensor_parallel``), so the output moment holds
    c rows V (2 + 1 / tp) (c V (1 + 1 / tp) for one row)."""
    n, V, h = batch * seq_len, arch.vocab_size, arch.hidden_size
    c, r = widths.compute, widths.residual
    stage = stage or Stage(0, 1, range(arch.num_layers))
    layers = len(stage.layers)
    rows = batch if mode == "infer" else n  # infer computes logits for the last position only
    facts = entry(precision)
    moments = (MLP,) + ((OUTPUT,) if stage.last else ()) + ((OUTLIERS,) if facts.outlier_columns else ())
    sharded_build = tp > 1 and not facts.quantized
    if sharded_build and backend == "hf":
        # transformers' tensor-parallel plan shards a model built whole on each rank, a weight at a time
        whole = widths.weights * arch.total_params
        rank = widths.weights * (layers * rank_layer_params(arch, tp) + rank_edge_params(arch, tp, stage))
        terms.append(Term("whole model before sharding", whole - rank, f"{widths.weights:g} B x "
                          f"{arch.total_params:,} less this rank's shards: the hf backend builds the whole model on "
                          f"each rank and transformers' plan shards it in place", frozenset({SHARDS})))
    elif sharded_build:
        # every weight of the whole model is drawn whole into one scratch buffer, of which the rank keeps its shard
        largest = max(V * h, largest_layer_matrix(arch))
        terms.append(Term("whole-weight scratch", widths.weights * largest,
                          f"{widths.weights:g} B x {largest:,}: the largest weight drawn whole while the rank "
                          f"keeps its shard of it", frozenset({SHARDS})))
    if mode == "infer":
        kv_tp = kv_heads_split(arch, tp)
        cache = kv_cache_bytes(arch, batch, seq_len + new_tokens, widths, kv_tp, backend) * layers / arch.num_layers
        per_token = cache / layers / batch / (seq_len + new_tokens) / 2
        kept = f": {hf_cache(arch, widths).formula}" if backend == "hf" else ""
        terms.append(Term("KV cache", cache, f"2 x {layers} layers x {per_token:g} B x {batch} x "
                          f"{seq_len + new_tokens} tokens{kept}",
                          frozenset(moments) if facts.quantized or sharded_build else None))
    elif backend == "hf":
        # transformers' models grow a DynamicCache in a forward pass too (``use_cache`` is on by default)
        cache = kv_cache_bytes(arch, batch, seq_len, widths, kv_heads_split(arch, tp), backend) * layers / arch.num_layers
        layout = hf_cache(arch, widths)
        terms.append(Term("KV cache", cache, f"{layers} layers of the forward pass's {batch} x {seq_len} tokens, "
                          f"which transformers caches unasked: keys {layout.key_bytes} B and values "
                          f"{layout.value_bytes} B ({layout.source}, read by running it)",
                          frozenset(moments) if facts.quantized or sharded_build else None))
    if facts.outlier_columns:
        terms += int8_outlier_terms(arch, n, widths, tp)
    if facts.dequantized is not None:
        copy = facts.dequantized
        terms.append(Term("dequantized weight", copy.bytes * largest_layer_matrix(arch) / tp,
                          f"{copy.bytes:g} B x the largest matrix: {copy.why}", frozenset({MLP})))
    if facts.activation_scaling and n > 1:
        terms.append(activation_quantization_term(arch, n, c, tp))
    if facts.outlier_columns and n > 1:
        terms.append(Term("LLM.int8 product", INT8_PRODUCT_BYTES * n * arch.ffn_size / tp,
                          f"{INT8_PRODUCT_BYTES} B x {n:,} tokens x {arch.ffn_size:,}: the up projection's int32 "
                          f"product and one more 16-bit copy beside the MLP's temporaries (traced)", frozenset({MLP})))
    reserve = prefill_reserve_term(arch, precision, n, tp)
    if reserve is not None:
        terms.append(reserve)
    # Under tensor parallelism the gather's buffer is rank-major, (tp, rows, V / tp): putting the
    # vocabulary back in order copies it, a second whole logits tensor, wherever rows > 1.
    reordered = tp > 1 and rows > 1
    logits = c * rows * V * ((2 if reordered else 1) + 1 / tp if tp > 1 else 1)
    gathered = (f" ({tp} slices gathered whole beside this rank's" + (", and their copy in vocabulary order)"
                                                                     if reordered else ")")) if tp > 1 else ""
    if compiled:
        terms.append(Term("MLP temporaries", inductor.prefill_transient_bytes(arch, n, c, r, widths.autocast, tp),
                          "r n h + c n h + 2 c n f (+ c h f under autocast) + 8 n: one fused MLP's "
                          "intermediates beside the residual stream", frozenset({MLP})))
        head = inductor.output_input_bytes(arch, n, c) + logits
        formula = f"final normalized input, cast in the norm's kernel, and {c} B x {rows:,} x V logits{gathered}"
    else:
        terms.append(Term("MLP temporaries", prefill_transient_bytes(arch, n, widths, tp, backend, seq_len),
                          "one MLP's intermediates beside the residual stream, and the token ids",
                          frozenset({MLP})))
        head = r * n * h + (c * n * h if widths.autocast else 0) + logits
        formula = f"final normalized input, its cast, and {c} B x {rows:,} x V logits{gathered}"
    if widths.autocast:
        head += c * V * h / tp
        formula += ", and the output projection's 16-bit copy"
    if stage.last:
        terms.append(Term("output projection", head, formula, frozenset({OUTPUT})))
    return MemoryEstimate(tuple(terms), moments + ((BUILD,) if facts.quantized else ())
                          + ((SHARDS,) if sharded_build else ()))
