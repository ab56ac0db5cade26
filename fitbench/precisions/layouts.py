"""What a precision can do in a layout, in one sentence with the way out where it cannot: offload
(``offload_problem``), data parallelism (``data_parallel_problem``), tensor parallelism
(``tensor_parallel_problem``, ``tensor_parallel_heads_problem``) and pipeline stages
(``pipeline_problem``), each read from the precision's entry (``fitbench.precisions``).
"""

from __future__ import annotations

from fitbench.precisions import EVERY_WEIGHT, FLOAT8, TRAINING_MODES, entry


def offload_problem(mode: str, precision: str, backend: str, compile: bool, strategy: str = "single") -> str | None:
    """Why a configuration cannot run with ``--offload``, or None when it can. What offload is depends
    on the layout (``strategy``): on one device, decoder layers kept in host memory and streamed in
    for their forward (infer and forward); under FSDP, FSDP's CPU offload of the shards, their
    gradients and the optimizer state, in every mode FSDP runs (``data_parallel_problem`` says
    which); DDP has none."""
    if strategy == "ddp":
        return DDP_OFFLOAD
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
                f"accelerate's hooks do not move: use bf16-pure")
    if backend != "native":
        return "fitbench builds its own decoder layer by layer to offload it: use --backend native (Llama-style models)"
    if compile:
        return ("torch.compile stops at accelerate's hooks around every offloaded layer, breaking the graph at "
                "each: drop --compile")
    return None


DATA_PARALLEL_STRATEGIES: tuple[str, ...] = ("ddp", "fsdp")
DDP_OFFLOAD = ("--offload and --strategy ddp do not combine: DDP keeps a whole replica of the weights, gradients and "
               "optimizer state on every GPU and has no CPU offload; keeping them in host memory is FSDP's: use "
               "--strategy fsdp --offload, or drop --offload")


def pipeline_problem(precision: str, mode: str, backend: str = "native") -> str | None:
    """Why pipeline stages cannot run this configuration, in one sentence with the way out; None
    when they can. The native decoder's stages are ranks of a torchrun job (``fitbench.run.pipeline``)
    and train too; the hf backend's are one process's devices under accelerate's device map
    (``fitbench.run.hf_pipeline``), for inference and forward in the floating-point precisions."""
    if backend != "native":
        if mode in TRAINING_MODES:
            return (f"the {backend} backend's pipeline stages run one after another in one process, for inference: "
                    f"train Llama-style models as stages with --backend native, or run {mode} on one GPU")
        if entry(precision).quantized:
            return (f"the {backend} backend's pipeline stages hold floating-point weights; {precision} layers are "
                    f"quantized on one device: use bf16-pure over stages, or --backend native for quantized stages")
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


def data_parallel_problem(strategy: str, precision: str, mode: str, backend: str = "native",
                          offload: bool = False) -> str | None:
    """Why ``strategy`` (``ddp`` or ``fsdp``) cannot run ``precision`` in ``mode`` with ``backend`` (and
    FSDP's CPU offload when ``offload``), in one sentence with the way out; None when it can.

    What composes: fp32, tf32, bf16, fp16 and bf16-pure under both, in train, forward-backward and
    forward; fp8 training under both (torchao's float8 linears keep plain bf16 weights, and with
    row-wise scales FSDP gathers them in bf16 and each rank casts its own); adapters on an int8,
    nf4 or fp4 base under DDP (a frozen replica per rank, the fp32 adapters' gradients averaged)."""
    if strategy not in DATA_PARALLEL_STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is not data parallel; expected one of {DATA_PARALLEL_STRATEGIES}")
    name = strategy.upper()
    if backend != "native":
        return (f"{name} is applied to fitbench's native decoder, layer by layer, and the {backend} backend's "
                f"models are not: use --backend native (Llama-style models) or run on one GPU")
    if mode == "infer" and strategy == "ddp":
        return ("generation has no gradients for DDP to average, so N GPUs would run N independent copies that "
                "one GPU's figures already describe: run infer on one GPU")
    if mode == "infer":
        return ("FSDP gathers a layer's weights around its forward call, and decoding runs the KV-cache step and "
                "CUDA graphs outside those calls: run infer on one GPU, with --offload for a model that does not fit")
    if offload and strategy == "ddp":
        return DDP_OFFLOAD
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
HF_TENSOR_PARALLEL_FAMILIES = ("llama",)


def tensor_parallel_problem(precision: str, mode: str, backend: str = "native",
                            family: str | None = None) -> str | None:
    """Why tensor parallelism cannot run ``precision`` in ``mode`` with ``backend`` on a model of
    ``family``, in one sentence with the way out; None when it can: the floating-point precisions, in
    every mode, on the native decoder (``fitbench.run.tensor_parallel``) and on transformers' models
    of the families with a tensor-parallel plan (``fitbench.run.hf_tensor_parallel``).

    Quantized weights are refused: DTensor shards a weight by viewing and splitting it, which
    torchao's inference tensors do not implement (the same stops DDP's broadcast and FSDP's sharding of
    them), and a bitsandbytes weight carries its scales and block state beside its data, which a shard of
    it would not. fp8 training would need torchao's own float8 tensor-parallel styles. Pipeline stages split a model by layers
    and leave each layer's weights whole. The hf backend's answer depends on the model's ``family``;
    without one it is refused."""
    if backend != "native" and family not in HF_TENSOR_PARALLEL_FAMILIES:
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


def tensor_parallel_heads_problem(heads: int, kv_heads: int, degree: int, backend: str = "native") -> str | None:
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
