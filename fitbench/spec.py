"""One configuration (``RunSpec``), how it spreads over GPUs (``Layout``), and what a worker is told
beside it (``Assignment``).

``Layout`` is the one place that says what composes and why not: offload, data, tensor and pipeline
parallelism against a precision (read from its registry entry), a backend and a model's shape. The
sweep's validation, the planner, the fallback ladder and the worker all ask it.

Plain data that validates and never acts: the planner reads it, the launcher writes it to a file,
the worker reads it back. Nothing here touches a device.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from fitbench.precisions import EVERY_WEIGHT, FLOAT8, PRECISIONS, TRAINING_MODES, UNQUANTIZED_BASE, entry

Mode = Literal["train", "forward", "forward-backward", "infer"]
MODES: tuple[str, ...] = get_args(Mode)
Precision = Literal[PRECISIONS]  # the registry's names (``fitbench.precisions``)

# Strategy names the CLI and the planner use, and the degree of a Layout each sets.
STRATEGY_DEGREES = {"ddp": "dp_replicate", "fsdp": "dp_shard", "tp": "tp", "pipeline": "pp", "replicas": "replicas"}


# The largest all-reduce a tensor-parallel generation sums through symmetric memory's one-shot kernel
# (``RunSpec.symmetric_memory``; inductor's default threshold, ``torch._inductor.config._collective``): a
# decode step's at batch 8 of an 8,192-wide model is 128 KiB, a prefill's megabytes. One-shot has each
# rank read every peer's whole buffer, which beyond some hundred kB costs more than NCCL's ring saves.
ONE_SHOT_BYTES = 128 * 1024


class LayoutError(ValueError):
    """Degrees that do not make the world size."""


class ModelShape(Protocol):
    """What a layout's rules need to know of a model (``fitbench.models.architecture.Architecture``
    has these): its query and kv heads, its decoder layers, and its family (whose transformers model
    may or may not carry a tensor-parallel plan)."""

    num_heads: int
    num_kv_heads: int
    num_layers: int
    family: str


class Layout(BaseModel):
    """The degrees of parallelism of one job: data-parallel replicas (DDP), data-parallel shards
    (FSDP2), tensor-parallel and pipeline-parallel ranks, and independent ``replicas`` (a whole model
    per rank, its own batch, no collective inside a step: inference and forward). Their product is
    the world size: the ranks of the job, one GPU each (the arithmetic of torchtitan's
    ``ParallelDims``). The default is one process on one device. What composes, and why not, is
    ``problem``'s to say."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp_replicate: int = Field(1, ge=1)
    dp_shard: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    replicas: int = Field(1, ge=1)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.replicas

    @property
    def data_parallel(self) -> int:
        """Ranks that see different batches: throughput sums over them."""
        return self.dp_replicate * self.dp_shard * self.replicas

    @property
    def strategy(self) -> str:
        """``single``, or the strategies in use joined by ``+`` (``fsdp``, ``ddp+fsdp`` is HSDP, ...)."""
        used = [name for name, degree in STRATEGY_DEGREES.items() if getattr(self, degree) > 1]
        return "+".join(used) or "single"

    @property
    def label(self) -> str:
        """``ddp x 2``, ``fsdp 2 x tp 4``; empty for a single process."""
        used = [(name, getattr(self, degree)) for name, degree in STRATEGY_DEGREES.items() if getattr(self, degree) > 1]
        if len(used) == 1:
            return f"{used[0][0]} x {used[0][1]}"
        return " x ".join(f"{name} {degree}" for name, degree in used)

    @classmethod
    def for_world(cls, world_size: int, **degrees: int) -> Layout:
        """The layout whose degrees are ``degrees`` (``dp_replicate``, ``dp_shard``, ``tp``, ``pp``; the
        ones not given are 1), one of which may be -1: it takes what the others leave of
        ``world_size``. Raises ``LayoutError`` naming every factor when they do not multiply to it."""
        unknown = set(degrees) - set(STRATEGY_DEGREES.values())
        if unknown:
            raise LayoutError(f"unknown degree(s) {', '.join(sorted(unknown))}; the degrees are "
                              f"{', '.join(STRATEGY_DEGREES.values())}")
        if world_size < 1:
            raise LayoutError(f"the world size must be at least 1, got {world_size}")
        values = {name: degrees.get(name, 1) for name in STRATEGY_DEGREES.values()}
        inferred = [name for name, value in values.items() if value == -1]
        bad = [f"{name}={value}" for name, value in values.items() if value < 1 and value != -1]
        if bad or len(inferred) > 1:
            raise LayoutError(f"degrees must be positive, with at most one -1 to infer; got "
                              f"{', '.join(bad + [f'{name}=-1' for name in inferred])}")
        known = 1
        for name, value in values.items():
            if value != -1:
                known *= value
        if inferred:
            if world_size % known:
                raise LayoutError(f"{' x '.join(f'{n}={v}' for n, v in values.items() if v != -1)} = {known} does "
                                  f"not divide the world size {world_size}, so {inferred[0]} cannot be inferred")
            values[inferred[0]] = world_size // known
        elif known != world_size:
            raise LayoutError(f"{' x '.join(f'{n}={v}' for n, v in values.items())} = {known}, not the world "
                              f"size {world_size}")
        return cls(**values)

    @classmethod
    def of_strategy(cls, strategy: str, gpus: int) -> Layout:
        """One strategy over ``gpus`` ranks (``single`` only with one)."""
        if strategy == "single":
            return cls.for_world(gpus)
        if strategy not in STRATEGY_DEGREES:
            raise LayoutError(f"unknown strategy {strategy!r}; known: single, {', '.join(STRATEGY_DEGREES)}")
        return cls.for_world(gpus, **{STRATEGY_DEGREES[strategy]: -1})

    def offload_problem(self, mode: str, precision: str, backend: str, compile: bool) -> str | None:
        """Why ``--offload`` cannot run ``precision`` in ``mode`` on ``backend`` (compiled when ``compile``)
        under this layout, in one sentence with the way out; None when it can. What offload is depends on
        the layout: on one device, decoder layers kept in host memory and streamed in for their forward
        (infer and forward); under FSDP, FSDP's CPU offload of the shards, their gradients and the
        optimizer state (``problem`` says in which modes FSDP runs); DDP has none."""
        strategy = self.strategy
        if strategy == "ddp":
            return _DDP_OFFLOAD
        if strategy == "fsdp":
            return None
        if strategy != "single":
            return f"{strategy} has no offload in fitbench: use --strategy fsdp --offload, or drop --offload"
        if mode not in ("infer", "forward"):
            return (f"layers stream in for inference only (--mode infer or forward); {mode} needs every weight "
                    f"with its gradient and optimizer state at each step, which FSDP can keep in host memory "
                    f"across several GPUs: --gpus 2 or more with --strategy fsdp (or auto)")
        if entry(precision).quantized:
            return (f"layers stream in as floating-point weights; {precision} layers keep quantization state that "
                    f"accelerate's hooks do not move: use {UNQUANTIZED_BASE}")
        if backend != "native":
            return ("fitbench builds its own decoder layer by layer to offload it: use --backend native")
        if compile:
            return ("torch.compile stops at accelerate's hooks around every offloaded layer, breaking the graph at "
                    "each: drop --compile")
        return None

    def problem(self, model: ModelShape, mode: str, precision: str, backend: str,
                offload: bool = False) -> str | None:
        """Why fitbench cannot run ``precision`` in ``mode`` on ``backend``'s build of ``model`` under this
        layout (with FSDP's CPU offload, or a run's ``--offload``, when ``offload``), in one paragraph
        that names the layout and the way out; None when it can. The one place the rules of what
        composes are written: the sweep's validation (``fitbench.config``) raises these reasons to the
        user, and the planner records them beside the layouts it passes over.

        - replicas: alone, for inference and forward (a training step's gradients need DDP or FSDP);
        - DDP and FSDP: as ``_data_parallel_problem`` says, DDP beside no tensor
          parallelism (FSDP is the data-parallel dimension of a 2-D mesh), neither beside stages;
        - tensor parallelism: whole heads per rank (``_tensor_parallel_heads_problem``), the precisions
          and backends ``_tensor_parallel_problem`` allows, the hf backend's plans alone, and inside
          pipeline stages for inference and forward only;
        - pipeline stages: at least one layer each, beside no data parallelism, as ``_pipeline_problem``
          allows;
        - offload: one device's layers, or FSDP's shards alone, in host memory;
        - the vllm backend: vLLM's own rules instead of those past the degrees' (``_vllm_problem``).
        One process on one device has no rule here (offload's are ``offload_problem``'s)."""
        reason = self._reason(model, mode, precision, backend, offload)
        return None if reason is None else f"{self.label}: {reason}"

    def composes(self, mode: str) -> bool:
        """Whether the degrees go together in ``mode`` for some model, precision and backend: the rules of
        ``problem`` that read the degrees and the mode alone (``_degrees_reason``); what the planner's
        enumeration of layouts keeps (``fitbench.planning.planner.layouts_for``)."""
        return self._degrees_reason(mode) is None

    def _degrees_reason(self, mode: str) -> str | None:
        """Replicas alone and not in training, pipeline stages beside no data parallelism, tensor
        parallelism inside stages not in training."""
        training = mode in TRAINING_MODES
        if self.replicas > 1:
            if self.world_size > self.replicas:
                return ("replicas are whole copies of the model, one per GPU, beside no other parallelism: give "
                        "--strategy replicas alone")
            if training:
                return (f"replicas are independent copies that exchange nothing, and {mode} needs its gradients "
                        f"averaged or sharded: use --strategy ddp or fsdp (or auto) to train over several GPUs, "
                        f"or replicas with --mode infer or forward")
        if self.pp > 1:
            if self.data_parallel > 1:
                return "pipeline stages run beside no data parallelism: give --strategy pipeline alone"
            if self.tp > 1 and training:
                return (f"tensor parallelism inside pipeline stages runs infer and forward, not {mode}: for training "
                        f"give --strategy fsdp --tp {self.tp} (FSDP x TP), or --strategy pipeline without --tp")
        return None

    def _reason(self, model: ModelShape, mode: str, precision: str, backend: str, offload: bool) -> str | None:
        reason = self._degrees_reason(mode)
        if reason:
            return reason
        if backend == "vllm":
            return _vllm_problem(model, self)
        if offload and self.strategy not in ("single", "fsdp"):
            if self.dp_replicate > 1:
                return _DDP_OFFLOAD
            return ("--offload keeps one GPU's decoder layers, or FSDP's shards, in host memory, beside no tensor "
                    "parallelism, pipeline stages or replicas: drop --offload, or give --strategy fsdp --offload")
        for degree, strategy in ((self.dp_replicate, "ddp"), (self.dp_shard, "fsdp")):
            if degree > 1:
                problem = _data_parallel_problem(strategy, precision, mode, backend, offload)
                if problem:
                    return problem
        if self.tp > 1:
            problem = (_tensor_parallel_heads_problem(model.num_heads, model.num_kv_heads, self.tp, backend)
                       or _tensor_parallel_problem(precision, mode, backend, model.family))
            if problem:
                return problem
            if backend != "native" and self.world_size > self.tp:
                return (f"the {backend} backend's tensor parallelism (transformers' plans) runs alone, beside no "
                        f"FSDP or stages: give --backend native, or --strategy tp with --gpus {self.tp}")
            if self.dp_replicate > 1:
                return ("DDP beside tensor parallelism is not built: FSDP shards the data-parallel dimension "
                        "(--strategy fsdp --tp N)")
        if self.pp > 1:
            if self.pp > model.num_layers:
                return (f"{self.pp} pipeline stages for the model's {model.num_layers} decoder layers leave a stage "
                        f"without one: use at most {model.num_layers} stages")
            return _pipeline_problem(precision, mode, backend)
        return None


def _vllm_problem(model: ModelShape, layout: Layout) -> str | None:
    """Why vLLM's engine cannot run ``model`` under ``layout``, in one sentence with the way out; None when
    it can. vLLM (0.32, ``vllm/config/parallel.py``, ``vllm/model_executor/models/llama.py``) splits a
    layer's heads over ``tensor_parallel_size`` ranks, which must divide the query heads, and the kv
    heads or be divided by them (it replicates kv heads over the ranks past their count); its
    ``pipeline_parallel_size`` stages take whole layers; replicas are engines of their own. It shards no
    training state: DDP and FSDP have no meaning for it."""
    if layout.dp_replicate > 1 or layout.dp_shard > 1:
        return ("vLLM serves with tensor parallelism, pipeline stages and replicas; DDP and FSDP shard training "
                "state, which serving has none of: give --strategy tp, pipeline or replicas")
    if layout.tp > 1 and (model.num_heads % layout.tp or (model.num_kv_heads % layout.tp
                                                           and layout.tp % model.num_kv_heads)):
        return (f"vLLM splits whole heads over its tensor-parallel ranks, and {layout.tp} ranks neither divide the "
                f"model's {model.num_heads} query heads and {model.num_kv_heads} kv heads nor are divided by the kv "
                f"heads: give a tensor-parallel degree that divides {model.num_heads}, or --strategy pipeline")
    if layout.pp > model.num_layers:
        return (f"{layout.pp} pipeline stages for the model's {model.num_layers} decoder layers leave a stage "
                f"without one: use at most {model.num_layers} stages")
    return None


# ---- what a precision can do in a layout: the rules ``Layout`` asks, read from the precision's entry ----

_DDP_OFFLOAD = ("--offload and --strategy ddp do not combine: DDP keeps a whole replica of the weights, gradients and "
               "optimizer state on every GPU and has no CPU offload; keeping them in host memory is FSDP's: use "
               "--strategy fsdp --offload, or drop --offload")


def _pipeline_problem(precision: str, mode: str, backend: str) -> str | None:
    """Why pipeline stages cannot run this configuration, in one sentence with the way out; None
    when they can. The native decoder's stages are ranks of a torchrun job (``fitbench.worker.pipeline``)
    and train too; the hf backend's are one process's devices under accelerate's device map
    (``fitbench.worker.hf_pipeline``), for inference and forward, quantized layers made and quantized on
    their stage's device (``fitbench.worker.quantize.hf_layers``)."""
    if backend != "native":
        if mode in TRAINING_MODES:
            return (f"the {backend} backend's pipeline stages run one after another in one process, for inference: "
                    f"train as stages with --backend native, or run {mode} on one GPU")
        return None
    if mode not in TRAINING_MODES:
        return None
    if entry(precision).policy.scale_loss:
        return (f"{precision} training scales its loss with one GradScaler over every gradient, which pipeline stages "
                "split between ranks: use --precision bf16 or bf16-pure")
    if entry(precision).training != EVERY_WEIGHT:
        return (f"pipeline stages train every weight in a floating-point precision, not {precision}'s adapters or "
                f"float8 linears: train with bf16 or bf16-pure, or run {precision} in infer or forward")
    return None


def _data_parallel_problem(strategy: str, precision: str, mode: str, backend: str, offload: bool) -> str | None:
    """Why ``strategy`` (``ddp`` or ``fsdp``) cannot run ``precision`` in ``mode`` with ``backend`` (and
    FSDP's CPU offload when ``offload``), in one sentence with the way out; None when it can.

    What composes: fp32, tf32, bf16, fp16 and bf16-pure under both, in train, forward-backward and
    forward; fp8 training under both (torchao's float8 linears keep plain bf16 weights, and with
    row-wise scales FSDP gathers them in bf16 and each rank casts its own); adapters on an int8,
    nf4 or fp4 base under DDP (a frozen replica per rank, the fp32 adapters' gradients averaged)."""
    name = strategy.upper()
    if backend != "native":
        return (f"{name} is applied to fitbench's native decoder, layer by layer, and the {backend} backend's "
                f"models are not: use --backend native or run on one GPU")
    if mode == "infer" and strategy == "ddp":
        return ("generation has no gradients for DDP to average, so N GPUs would run N independent copies that "
                "one GPU's figures already describe: run infer on one GPU")
    if mode == "infer":
        return ("FSDP gathers a layer's weights around its forward call, and decoding runs the KV-cache step and "
                "CUDA graphs outside those calls: run infer on one GPU, with --offload for a model that does not fit")
    if offload and strategy == "ddp":
        return _DDP_OFFLOAD
    # torchao's inference tensors: subclasses that implement the quantized matmul and little else
    # (measured on torch 2.13 / torchao 0.18: DDP's start-up broadcast stops at aten.view, FSDP's
    # sharding at aten.split); fp8 training's float8 linears keep plain bf16 weights instead.
    facts = entry(precision)
    if facts.library == "torchao" and not (facts.training == FLOAT8 and mode in TRAINING_MODES):
        return (f"{precision} weights are torchao tensor subclasses that implement the quantized matmul and little "
                f"else, so {name} can neither {'broadcast' if strategy == 'ddp' else 'shard'} them: run {precision} "
                f"on one GPU, or use bf16 across GPUs")
    if facts.library == "bitsandbytes" and strategy == "fsdp":
        return (f"bitsandbytes keeps each {precision} weight's scales beside its data, and the flat shards FSDP "
                f"cuts from a weight carry none: use --strategy ddp, or bf16 or fp8 under FSDP")
    return None


# The families whose transformers models carry a tensor-parallel plan (a ``base_model_tp_plan`` in
# their config, transformers 5.x): Llama, Mistral and Qwen2, fitbench's "llama" family. Falcon and
# GPT-2 have none.
_HF_TENSOR_PARALLEL_FAMILIES = ("llama",)


def _tensor_parallel_problem(precision: str, mode: str, backend: str, family: str | None) -> str | None:
    """Why tensor parallelism cannot run ``precision`` in ``mode`` with ``backend`` on a model of
    ``family``, in one sentence with the way out; None when it can: the floating-point precisions, in
    every mode, on the native decoder (``fitbench.worker.tensor_parallel``) and on transformers' models
    of the families with a tensor-parallel plan (``fitbench.worker.hf_tensor_parallel``).

    Quantized weights are refused: DTensor shards a weight by viewing and splitting it, which
    torchao's inference tensors do not implement (the same stops DDP's broadcast and FSDP's sharding of
    them), and a bitsandbytes weight carries its scales and block state beside its data, which a shard of
    it would not. fp8 training would need torchao's own float8 tensor-parallel styles. Pipeline stages split a model by layers
    and leave each layer's weights whole. The hf backend's answer depends on the model's ``family``;
    without one it is refused."""
    if backend != "native" and family not in _HF_TENSOR_PARALLEL_FAMILIES:
        whose = f"{family} models" if family else "a model of unnamed family"
        return (f"transformers has no tensor-parallel plan for {whose}: split the model over GPUs by layers with "
                f"--strategy pipeline (--mode infer or forward)")
    way_out = "split the model over GPUs by layers with --strategy pipeline, or use bf16 under --strategy tp"
    facts = entry(precision)
    if facts.training == FLOAT8 and mode in TRAINING_MODES:
        return (f"{precision} training's float8 matmuls take tensor-parallel shards only through torchao's own float8 "
                f"styles, which fitbench does not apply: {way_out}")
    if facts.quantized:
        return (f"{precision} weights cannot be sharded by tensor parallelism: DTensor cuts a weight into shards "
                f"by views and splits, which {facts.library}'s {precision} tensors do not "
                f"implement: {way_out}")
    return None


def _tensor_parallel_heads_problem(heads: int, kv_heads: int, degree: int, backend: str) -> str | None:
    """Why tensor parallelism of ``degree`` cannot split a model of ``heads`` query and ``kv_heads`` kv
    heads, in one sentence with the way out; None when it can. A head's dot products stay on one rank,
    so the query heads must divide by the degree. The native decoder replicates kv heads that do not
    divide; transformers' plans cut the k and v projections column-wise, which splits whole kv heads
    only when they divide too."""
    if heads % degree:
        return (f"tensor parallelism splits whole attention heads, and {degree} ranks do not divide the model's "
                f"{heads} heads: use a tensor-parallel degree that divides {heads} (--gpus under --strategy tp, --tp "
                f"beside --strategy fsdp or pipeline), or --strategy pipeline alone")
    if backend != "native" and kv_heads % degree:
        return (f"transformers' tensor-parallel plan splits the k and v projections by whole kv heads, and "
                f"{degree} ranks do not divide the model's {kv_heads}: use --gpus that divides {kv_heads}, "
                f"--backend native (which replicates the kv heads), or --strategy pipeline")
    return None


def pipeline_stages(n_layers: int, stages: int) -> tuple[range, ...]:
    """The decoder layers of each pipeline stage, in order: ``n_layers // stages`` each, and the
    ``n_layers % stages`` layers left over one apiece to the middle stages first, then to the first
    stage, and to the last only when every other has one. The first stage also holds the embedding
    and the last the final norm, the output projection and the loss: with a large vocabulary the
    last is the heaviest, so it takes an extra layer last. The planner and the run both split here,
    so a planned stage is the stage that runs. 126 layers on 16 stages: 7, 8 x 14, 7.

    Raises ``LayoutError`` when there are fewer layers than stages (a stage without a layer)."""
    if stages < 1 or n_layers < stages:
        raise LayoutError(f"{n_layers} decoder layers cannot make {stages} pipeline stages: each stage needs at "
                          f"least one layer (use at most {n_layers} stages)")
    counts = [n_layers // stages] * stages
    order = list(range(1, stages - 1)) + [0] + ([stages - 1] if stages > 1 else [])
    for stage in order[:n_layers % stages]:
        counts[stage] += 1
    starts = [sum(counts[:i]) for i in range(stages)]
    return tuple(range(start, start + count) for start, count in zip(starts, counts))


def checkpointed_count(layers: int, checkpointed_layers: int | None) -> int:
    """How many of a stage's ``layers`` decoder layers recompute their activations under activation
    checkpointing of ``checkpointed_layers`` per stage (None: every layer): the first
    min(N, layers) of them."""
    return layers if checkpointed_layers is None else min(checkpointed_layers, layers)


def recompute_label(activation_checkpointing: bool, checkpointed_layers: int | None, stages: int = 1) -> str:
    """What a row's label says of checkpointing: `` recompute`` (every layer), `` recompute 12 layers``
    (the first 12), `` recompute 12 layers per stage`` under a pipeline; nothing without it."""
    if not activation_checkpointing:
        return ""
    if checkpointed_layers is None:
        return " recompute"
    plural = "s" if checkpointed_layers != 1 else ""
    return f" recompute {checkpointed_layers} layer{plural}" + (" per stage" if stages > 1 else "")


def microbatch_problem(batch_size: int, microbatches: int) -> str | None:
    """Why a pipelined training step cannot cut ``batch_size`` sequences into ``microbatches``; None when it can."""
    if batch_size % microbatches:
        return (f"a batch of {batch_size} sequences does not split into {microbatches} equal microbatches: give a "
                f"--batch-size that {microbatches} divides, or a --microbatches that divides {batch_size}")
    return None


@dataclass(frozen=True)
class Stage:
    """Pipeline stage ``index`` of ``count`` and its decoder layers (``pipeline_stages``); the first stage
    also holds the embedding, the last the final norm, the output projection and the loss. Without
    pipeline parallelism the one stage is first and last. The ranks of a pipeline are consecutive:
    stage i runs on its first rank + i. The planner predicts each stage's peak and the run builds it."""

    index: int
    count: int
    layers: range

    @classmethod
    def of(cls, n_layers: int, index: int, count: int) -> Stage:
        return cls(index, count, pipeline_stages(n_layers, count)[index])

    @classmethod
    def every(cls, n_layers: int, count: int) -> tuple[Stage, ...]:
        return tuple(cls(i, count, layers) for i, layers in enumerate(pipeline_stages(n_layers, count)))

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    @property
    def label(self) -> str:
        held = ["embedding"] if self.first else []
        held += ["final norm, output projection and logits"] if self.last else []
        edges = f", {' and '.join(held)}" if held else ""
        return (f"stage {self.index + 1} of {self.count} ({len(self.layers)} layers, "
                f"{self.layers.start}-{self.layers.stop - 1}{edges})")

    def as_dict(self) -> dict[str, Any]:
        return {"stage": self.index, "layers": [self.layers.start, self.layers.stop],
                "embedding": self.first, "output_projection": self.last}


class RunSpec(BaseModel):
    """One configuration, run in one fresh process."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    backend: Literal["native", "hf", "vllm"]
    mode: Mode
    precision: Precision
    batch_size: int = Field(gt=0)
    seq_len: int = Field(gt=0)
    new_tokens: int = Field(gt=0)
    compile: bool = False
    activation_checkpointing: bool = False
    # With activation checkpointing: the first N decoder layers of each pipeline stage (of the model,
    # without stages) recompute their activations in the backward pass, the others keep them; None:
    # every layer (``checkpointed_count``).
    checkpointed_layers: int | None = Field(None, gt=0)
    device: str
    warmup_steps: int = Field(ge=0)
    measure_steps: int = Field(gt=0)
    seed: int = 0
    auto_batch: bool = False  # batch_size is found by probing, starting from the planner's prediction
    cuda_graphs: bool = True  # native infer on a GPU decodes through a CUDA graph
    compile_decode: bool = True  # ... of the decode step compiled by inductor (fitbench.models.backends)
    decode_tuning: bool = False  # ... its layer's kernels tuned by inductor's coordinate descent
    symmetric_memory: bool = True  # ... under TP, its small all-reduces one-shot through symmetric memory
    # On one device, decoder layers that do not fit stay in a slower tier (host memory beside a GPU,
    # disk beside the CPU) and stream in for their forward (fitbench.models.offload); under FSDP, the
    # shards, their gradients and the optimizer state live in host memory (FSDP's CPU offload).
    offload: bool = False
    # How the configuration spreads over ranks: one process on one device unless said otherwise.
    layout: Layout = Layout()
    # Microbatches of a pipelined training step; None: one per pipeline stage.
    microbatches: int | None = Field(None, gt=0)
    # The vllm backend's memory (vLLM's own options): the share of each GPU's memory its engine takes
    # (gpu_memory_utilization; on its CPU build, of the host's), and the KV cache's bytes per GPU
    # (kv_cache_memory_bytes), which, given, replaces what that share leaves (fitbench.planning.vllm_memory).
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    kv_cache_bytes: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _checkpointed_layers_need_checkpointing(self) -> RunSpec:
        if self.checkpointed_layers is not None and not self.activation_checkpointing:
            raise ValueError(f"checkpointed_layers {self.checkpointed_layers} counts the layers that activation "
                             f"checkpointing recomputes, and activation_checkpointing is off")
        return self

    @model_validator(mode="after")
    def _offload_applies(self) -> RunSpec:
        problem = (self.layout.offload_problem(self.mode, self.precision, self.backend, self.compile)
                   if self.offload else None)
        if problem:
            raise ValueError(problem)
        return self

    @model_serializer(mode="wrap")
    def _vllm_fields_with_vllm(self, handler):
        """The vllm backend's memory options are written for its configurations alone, so that the rows of
        every other backend, and their keys, stay as they were."""
        fields = handler(self)
        if self.backend != "vllm":
            fields.pop("gpu_memory_utilization", None)
            fields.pop("kv_cache_bytes", None)
        return fields

    @property
    def layer_offload(self) -> bool:
        """Decoder layers offloaded around one device (``fitbench.models.offload``)."""
        return self.offload and self.layout.world_size == 1

    @property
    def fsdp_offload(self) -> bool:
        """FSDP's CPU offload: each rank's shards, gradients and optimizer state in host memory."""
        return self.offload and self.layout.dp_shard > 1

    @property
    def key(self) -> str:
        """Identity of the configuration: the same key means the same measurement. ``cuda_graphs``,
        ``offload``, ``layout`` (its ``replicas`` degree), ``microbatches``, ``checkpointed_layers`` and the vllm
        backend's memory, added later, count only
        when they change what runs, so earlier results keep their keys."""
        fields = self.model_dump()
        if self.mode != "infer":
            fields.pop("new_tokens")
        if not self.graphs_off:
            fields.pop("cuda_graphs")
        if self.compile_decode or self.mode != "infer" or self.backend != "native":
            fields.pop("compile_decode")
        if not self.tuned_decode:
            fields.pop("decode_tuning")
        if self.symmetric_memory or not self.one_shot_applies:
            fields.pop("symmetric_memory")
        if not self.offload:
            fields.pop("offload")
        if self.layout.world_size == 1:
            fields.pop("layout")
        elif self.layout.replicas == 1:
            fields["layout"].pop("replicas")
        if self.microbatches is None:
            fields.pop("microbatches")
        if self.checkpointed_layers is None:
            fields.pop("checkpointed_layers")
        digest = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()
        return digest[:12]

    @property
    def pipeline_microbatches(self) -> int:
        """Microbatches of a pipelined training step: as given, else one per stage."""
        return self.microbatches or self.layout.pp

    @property
    def graphs_off(self) -> bool:
        """CUDA graphs turned off where they apply: generation with the native backend, or vLLM's engine
        (whose ``enforce_eager`` turns off its graphs and its compilation)."""
        return not self.cuda_graphs and self.mode == "infer" and self.backend in ("native", "vllm")

    @property
    def tuned_decode(self) -> bool:
        """Inductor's coordinate descent turned on where it applies: a compiled native decode step."""
        return self.decode_tuning and self.compile_decode and self.mode == "infer" and self.backend == "native"

    @property
    def one_shot_applies(self) -> bool:
        """Where ``symmetric_memory`` changes what runs: a compiled native generation under tensor
        parallelism (``fitbench.worker.tensor_parallel.one_shot_small_all_reduces``), on GPUs."""
        return (self.compile_decode and self.mode == "infer" and self.backend == "native" and self.layout.tp > 1
                and self.device != "cpu")

    @property
    def label(self) -> str:
        batch = "auto" if self.auto_batch else self.batch_size
        shape = f"{batch}x{self.seq_len}" + (f"+{self.new_tokens}" if self.mode == "infer" else "")
        recompute = recompute_label(self.activation_checkpointing, self.checkpointed_layers, self.layout.pp)
        eager = " no-cuda-graphs" if self.graphs_off else (" decode-tuning" if self.tuned_decode else "")
        offload = " offload" if self.offload else ""
        nccl = " no-symmetric-memory" if not self.symmetric_memory and self.one_shot_applies else ""
        layout = f" {self.layout.label}" if self.layout.world_size > 1 else ""
        return (f"{self.model} {self.mode} {self.precision} {shape}{recompute}{eager}{offload}{nccl}{layout} "
                f"[{self.backend}]")


class Assignment(BaseModel):
    """What a worker is told beside its configuration: the figures of the planner it acts on,
    computed by the launcher, so that a worker never plans (``fitbench.launch.orders``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spec: RunSpec
    # Bytes the decoder layers of an offloaded run may take on the device (the planner's
    # ``offload_split``); None when nothing is offloaded.
    offload_layer_memory: float | None = None
    # The planner's tensor peak for this configuration, as it will be built; a FITBENCH_INJECT
    # mem-limit compares against it.
    predicted_peak_bytes: float | None = None
