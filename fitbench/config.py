"""What to run: ``SweepConfig``, validated user input, expanded into ``RunSpec``s (``fitbench.spec``).

Configs validate; they never act: no device access, no environment changes. Values the hardware
decides (the device, the default models, precisions and shapes) arrive as arguments to ``expand``.
Precedence is CLI > YAML file > defaults; the merge happens in ``merge_sources``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Callable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

from fitbench.inert_options import Asked, refuse_inert
from fitbench.models.architecture import Architecture, backend_error, default_backend
from fitbench.models.registry import resolve
from fitbench.models.vllm_options import precision_options
from fitbench.planning.nodes import parse_inter_node_bandwidth
from fitbench.precisions import ALIASES, DEFAULT_LADDER, PRECISIONS, TRAINING_MODES, default_precision, entry
from fitbench.spec import STRATEGY_DEGREES, Layout, Mode, Precision, RunSpec, microbatch_problem, pipeline_stages
from fitbench.util.endpoints import http_url_problem
from fitbench.util.errors import UserError, excerpt
from fitbench.util.jsonfile import read_bounded

BackendChoice = Literal["auto", "native", "hf", "vllm"]

# The seeds' CS336 script says --pass-type forward|backward; backward there means forward + backward.
PASS_TYPES = {"forward": "forward", "backward": "forward-backward"}

# Counts (batch, tokens, steps) become int64 tensor sizes and products of two of them must still fit.
COUNT_MAX = 2**31 - 1
# Ranks of one job on one node: torchrun --standalone starts them all here.
RANKS_MAX = 1024
# torch.manual_seed takes an unsigned 64-bit seed.
SEED_MAX = 2**64 - 1


def _whole_number(value: Any, minimum: int, maximum: int, auto: bool = False) -> Any:
    """``value`` if it is a whole number in [minimum, maximum] (or ``auto``); YAML's true, 2.5 and "4" are
    not counts, so no type coercion happens here."""
    if auto and value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "text" if isinstance(value, str) else type(value).__name__
        raise ValueError(f"expected a whole number{' or auto' if auto else ''}, got {excerpt(value)} ({kind})")
    if value < minimum:
        raise ValueError(f"must be positive, got {value}" if minimum == 1 else f"must be at least {minimum}, "
                                                                                f"got {value}")
    if value > maximum:
        raise ValueError(f"must be at most {maximum:,}, got {excerpt(value)}")
    return value


def _as_list(value: Any) -> Any:
    return value if value is None or isinstance(value, list) else [value]


class SweepConfig(BaseModel):
    """A sweep: the cartesian product of models x mode x precision x batch_size x seq_len.

    A field left as None takes a default that depends on the device (see ``expand``).
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    models: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, description="preset names, local directories or hub ids")
    mode: list[Mode] | None = Field(None, min_length=1, description="train, forward, forward-backward, infer")
    precision: list[Precision] | None = Field(None, min_length=1, description=", ".join(PRECISIONS))
    batch_size: list[int | Literal["auto"]] | None = Field(
        None, min_length=1, description="positive integers, or auto for the largest that runs")
    seq_len: list[int] | None = Field(None, min_length=1, description="positive integers (the prompt length in infer)",
                                      validation_alias="context_length")
    new_tokens: int | None = Field(None, gt=1, description="tokens generated per sequence in infer (at least 2)")
    fallback: list[Precision] | None = Field(
        None, min_length=1, description="precisions to fall back through on out-of-memory, in order")
    # Switches are true or false: YAML's 'yes' in quotes, 1 or "off" are not read as either.
    no_fallback: StrictBool = Field(False, description="true or false")
    offload: StrictBool = Field(False, description="true or false: keep the decoder layers that do not fit in host "
                                                   "memory (infer, forward on one GPU); under FSDP, the shards, "
                                                   "gradients and optimizer state")
    backend: BackendChoice = "auto"
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="a share above 0, at most 1: of each GPU's "
                                          "memory, vLLM's engine's (backend vllm; on a CPU, of the host's)")
    kv_cache_bytes: int | None = Field(None, gt=0, description="a positive whole number of bytes: vLLM's KV cache "
                                       "per GPU, in place of what gpu_memory_utilization leaves (backend vllm)")
    compile: StrictBool = Field(False, description="true or false")
    cuda_graphs: StrictBool = Field(True, description="true or false: native infer on a GPU decodes through a CUDA "
                                                      "graph")
    compile_decode: StrictBool = Field(True, description="true or false: native infer on a GPU compiles the "
                                                         "decode step and prefill with inductor before capturing")
    decode_tuning: StrictBool = Field(False, description="true or false: the compiled decode step's layer is tuned "
                                                         "by inductor's coordinate descent")
    symmetric_memory: StrictBool = Field(True, description="true or false: tensor-parallel generation on GPUs sums "
                                                           "its small all-reduces through symmetric memory")
    activation_checkpointing: StrictBool | None = Field(None, description="true or false; left out, the planner "
                                                                          "decides (on a GPU)")
    checkpointed_layers: int | None = Field(
        None, description=f"a whole number of decoder layers, 1 to {COUNT_MAX:,}: activation checkpointing for the "
                          f"first N layers of each pipeline stage (of the model without stages), the others keeping "
                          f"their activations; it implies activation_checkpointing (to checkpoint none, leave both "
                          f"out or set activation_checkpointing false)")
    warmup_steps: int = Field(5, ge=0)
    measure_steps: int = Field(10, gt=0, validation_alias="samples")
    device: str = "auto"
    timeout: float = Field(3600.0, gt=0, allow_inf_nan=False,
                           description="a finite, positive number of seconds: a configuration's whole life")
    out: str | None = Field(None, min_length=1, description="a directory path")
    seed: int = Field(0, description=f"a whole number from 0 to {SEED_MAX:,} (2^64 - 1)")
    gpus: int = Field(1, description=f"ranks of each configuration's job, 1 to {RANKS_MAX}: GPUs, or CPU processes "
                                     f"with device cpu")
    strategy: Literal["auto", "ddp", "fsdp", "tp", "pipeline", "replicas"] = Field(
        "auto", description="auto, ddp, fsdp, tp, pipeline or replicas: how a job of several ranks shares the model "
                            "(auto: the planner's choice among what fits, by forecast throughput; tp: tensor "
                            "parallelism, every mode; replicas: a whole model per rank, each its own batch, infer "
                            "and forward)")
    microbatches: int | None = Field(None, description=f"microbatches of a pipelined training step, 1 to {COUNT_MAX:,} "
                                                       f"(default: one per pipeline stage)")
    tp: int | None = Field(None, validation_alias="tensor_parallel_size",
                           description=f"the tensor-parallel degree, 1 to {RANKS_MAX}, inside each FSDP group "
                                       f"(--strategy fsdp) or pipeline stage (--strategy pipeline); it divides --gpus")

    launcher: Literal["local", "slurm"] = Field(
        "local", description="local (each configuration a process of this machine) or slurm (each a SLURM job, a "
                             "sweep one job array)")
    partition: str | None = Field(None, min_length=1, description="a SLURM partition's name (slurm launcher)")
    account: str | None = Field(None, min_length=1, description="a SLURM account's name (slurm launcher)")
    time: str | None = Field(None, min_length=1, description="a job's time limit as sbatch takes it: 90, 24:00:00, "
                                                             "1-12 (slurm launcher)")
    nodes: int | None = Field(None, description=f"nodes of each configuration's job, 1 to {RANKS_MAX} (slurm "
                                                f"launcher); its ranks (--gpus) spread evenly over them")
    gpus_per_node: int | None = Field(None, description=f"GPUs asked of each node, 1 to {RANKS_MAX} (slurm launcher)")
    gpu: str | None = Field(None, min_length=1, description="the GPU of the nodes the jobs are planned for: H100-80GB, "
                                                            "A100-40GB (slurm launcher; default: the partition's GRES)")
    cpus_per_task: int | None = Field(None, description=f"CPUs asked for each node's task, 1 to {RANKS_MAX} (slurm "
                                                        f"launcher)")
    mem: str | None = Field(None, min_length=1, description="memory per node as sbatch takes it: 256G (slurm "
                                                            "launcher)")
    sbatch_args: list[str] | None = Field(None, min_length=1, description="further sbatch options, each one word: "
                                                                          "--qos=high (slurm launcher)")
    setup: list[str] | None = Field(
        None, min_length=1, description="shell lines the batch script runs before fitbench, each one line: module "
                                        "load cuda, source venv/bin/activate (slurm launcher)")
    max_concurrent: int | None = Field(None, description=f"jobs of the sweep's array running at once, 1 to "
                                                         f"{COUNT_MAX:,} (slurm launcher; default: all)")
    inter_node_bandwidth: str | None = Field(
        None, description="bandwidth between nodes per GPU, which the planner gives collectives that cross nodes: "
                          "a fabric (ndr, hdr, 100gbe) or a figure with its unit, 400Gb/s or 50GB/s (default: "
                          "fitbench calibrate's over nodes, else the GPU's fabric)")

    gpu_hour_price: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="what one GPU costs an hour, in dollars, a number such as 2.49: "
                                                     "the tables show the cost of a million tokens")

    ollama_url: str | None = Field(None, description="an http(s) URL of an Ollama server, e.g. http://localhost:11434")
    ollama_model: str | None = Field(None, min_length=1, description="the model it runs for the analysis, e.g. "
                                                                     "gpt-oss-20b")
    ollama_timeout: float | None = Field(None, gt=0, allow_inf_nan=False,
                                         description="a finite, positive number of seconds the server has for the "
                                                     "whole analysis (left out: 120)")

    @field_validator("ollama_url")
    @classmethod
    def _ollama_url(cls, value: str | None) -> str | None:
        problem = None if value is None else http_url_problem(value)
        if problem:
            raise ValueError(f"{problem}; give the address of an Ollama server, like http://localhost:11434")
        return value

    @field_validator("models", "mode", "precision", "batch_size", "seq_len", "fallback", mode="before")
    @classmethod
    def _scalar_to_list(cls, value: Any) -> Any:
        return _as_list(value)

    @field_validator("batch_size", "seq_len", mode="before")
    @classmethod
    def _counts(cls, values: Any, info) -> Any:
        values = _as_list(values)
        if isinstance(values, list):
            for value in values:
                _whole_number(value, 1, COUNT_MAX, auto=info.field_name == "batch_size")
        return values

    @field_validator("new_tokens", "warmup_steps", "measure_steps", mode="before")
    @classmethod
    def _count(cls, value: Any, info) -> Any:
        minimum = {"new_tokens": 2, "warmup_steps": 0, "measure_steps": 1}[info.field_name]
        return value if value is None else _whole_number(value, minimum, COUNT_MAX)

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus(cls, value: Any) -> Any:
        return _whole_number(value, 1, RANKS_MAX)

    @field_validator("microbatches", "max_concurrent", "checkpointed_layers", mode="before")
    @classmethod
    def _optional_count(cls, value: Any) -> Any:
        return value if value is None else _whole_number(value, 1, COUNT_MAX)

    @field_validator("tp", "nodes", "gpus_per_node", "cpus_per_task", mode="before")
    @classmethod
    def _optional_rank_count(cls, value: Any) -> Any:
        return value if value is None else _whole_number(value, 1, RANKS_MAX)

    @field_validator("inter_node_bandwidth")
    @classmethod
    def _inter_node_bandwidth(cls, value: str | None) -> str | None:
        if value is not None:
            parse_inter_node_bandwidth(value)
        return value

    @field_validator("sbatch_args", "setup", mode="before")
    @classmethod
    def _sbatch_args(cls, value: Any) -> Any:
        return _as_list(value)

    @field_validator("seed", mode="before")
    @classmethod
    def _seed(cls, value: Any) -> Any:
        return _whole_number(value, 0, SEED_MAX)

    @field_validator("timeout", "ollama_timeout", "gpu_hour_price", mode="before")
    @classmethod
    def _seconds(cls, value: Any, info) -> Any:
        # YAML's true and "10" are not durations nor prices; pydantic would read them as 1.0 and 10.0.
        if isinstance(value, (bool, str)):
            kind = "text" if isinstance(value, str) else "bool"
            what = "price in dollars" if info.field_name == "gpu_hour_price" else "number of seconds"
            raise ValueError(f"expected a {what}, got {excerpt(value)} ({kind})")
        return value

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
            return value
        raise ValueError(f"must be auto, cpu, cuda or cuda:N, got {excerpt(value)}")

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "pass_type" in data:
            pass_type = data.pop("pass_type")
            if not isinstance(pass_type, str) or pass_type not in PASS_TYPES:
                raise ValueError(f"pass_type must be forward or backward, got {pass_type!r}")
            data.setdefault("mode", PASS_TYPES[pass_type])
        for alias, name in FIELD_ALIASES:
            if alias in data and name in data:
                data.pop(alias)
        return data

    @model_validator(mode="before")
    @classmethod
    def _derived_gpus(cls, data: Any) -> Any:
        """``--nodes N --gpus-per-node G`` without ``--gpus``: the N x G ranks those options ask for."""
        if isinstance(data, dict) and data.get("gpus") is None and all(
                type(data.get(name)) is int for name in ("nodes", "gpus_per_node")):
            return {**data, "gpus": data["nodes"] * data["gpus_per_node"]}
        return data


# Other names of fields: (alias, field), the alias as the seeds' configs spell it.
FIELD_ALIASES = (("context_length", "seq_len"), ("samples", "measure_steps"), ("tensor_parallel_size", "tp"))

def fallback_ladder(config: SweepConfig, mode: str) -> list[str]:
    """The precisions a configuration of ``mode`` may fall back through: the user's ladder (for training,
    only rungs that train every weight: ``trains_every_weight``), else the default for the mode."""
    ladder = list(dict.fromkeys(config.fallback or DEFAULT_LADDER[mode]))  # a repeated rung counts once
    if mode in TRAINING_MODES:
        ladder = [p for p in ladder if entry(p).trains_every_weight]
    return ladder or DEFAULT_LADDER[mode]


def _default_shapes(mode: str, device_type: str) -> tuple[int, int]:
    """(batch, seq_len) when the user gave none: CS336's 4 x 512 for training-style modes on a GPU,
    batch 1 with a 128-token prompt for inference, and 1 x 128 for everything on a CPU."""
    if mode == "infer" or device_type == "cpu":
        return 1, 128
    return 4, 512


def check_context(arch, mode: str, seq_len: int, new_tokens: int) -> None:
    """A UserError when the tokens of a step (the prompt and the generated ones in infer) exceed the model's
    context; ``run`` and ``plan`` both ask here."""
    needed = seq_len + (new_tokens if mode == "infer" else 0)
    if needed > arch.max_seq_len:
        what = f"seq_len {seq_len} + new_tokens {new_tokens}" if mode == "infer" else f"seq_len {seq_len}"
        longest = arch.max_seq_len - (new_tokens if mode == "infer" else 0)
        fix = (f"Use --seq-len (alias --context-length) of at most {longest}" if longest > 0 else
               "Use fewer --new-tokens")
        raise UserError(f"seq_len: {what} exceeds the {arch.max_seq_len}-token context of {excerpt(arch.name)}. "
                        f"{fix}.")


def expand(config: SweepConfig, *, device: str, default_models: list[str]) -> list[RunSpec]:
    """Every RunSpec of the sweep, in order: model, mode, precision, batch, seq_len. Raises UserError."""
    device_type = device.split(":")[0]
    modes = config.mode or (["infer"] if config.backend == "vllm" else ["train", "infer"])
    new_tokens = config.new_tokens or (32 if device_type == "cpu" else 128)
    backends = [(model, _backend(config, model)) for model in config.models or default_models]
    refuse_inert(asked_of(config, backends=frozenset(backend for _, backend in backends)))
    _refuse_vllm_misfits(config, modes, device_type)
    if config.checkpointed_layers is not None and config.activation_checkpointing is False:
        raise UserError(f"checkpointed_layers: --checkpointed-layers {config.checkpointed_layers} recomputes that many "
                        f"layers, and activation_checkpointing is false; leave out one of the two (without "
                        f"checkpointing, leave out --checkpointed-layers).")
    specs = []
    for model, backend in backends:
        arch = resolve(model)
        if config.checkpointed_layers is not None and backend != "native" and set(modes) & set(TRAINING_MODES):
            raise UserError(f"checkpointed_layers: the {backend} backend checkpoints every layer of "
                            f"{excerpt(model)} (transformers' gradient checkpointing) or none; give --backend "
                            f"native for some of them, or --activation-checkpointing alone.")
        for mode in modes:
            default_batch, default_seq = _default_shapes(mode, device_type)
            first_rung = fallback_ladder(config, mode)[0] if config.fallback else default_precision(mode, device_type)
            for precision in config.precision or [first_rung]:
                if mode in TRAINING_MODES and entry(precision).training_problem:
                    raise UserError(f"precision: {entry(precision).training_problem}; or use --mode infer or forward "
                                    f"with {precision}.")
                layout = _layout(config, mode, precision, backend, arch)
                problem = layout.offload_problem(mode, precision, backend, config.compile) if config.offload else None
                if problem:
                    raise UserError(f"offload: {problem}.")
                for batch in config.batch_size or [default_batch]:
                    if layout.pp > 1 and mode in TRAINING_MODES:
                        if batch == "auto":
                            raise UserError("batch-size: auto is not searched for pipeline stages, whose batch must "
                                            "split into --microbatches; give --batch-size N.")
                        problem = microbatch_problem(batch, config.microbatches or layout.pp)
                        if problem:
                            raise UserError(f"microbatches: {problem} (--microbatches, --batch-size).")
                    for seq_len in config.seq_len or [default_seq]:
                        check_context(arch, mode, seq_len, new_tokens)
                        checkpointing = (config.activation_checkpointing or config.checkpointed_layers is not None) \
                            and mode in TRAINING_MODES
                        specs.append(RunSpec(
                            model=model, backend=backend, mode=mode, precision=precision,
                            batch_size=1 if batch == "auto" else batch, auto_batch=batch == "auto",
                            seq_len=seq_len, new_tokens=new_tokens, compile=config.compile,
                            cuda_graphs=config.cuda_graphs, compile_decode=config.compile_decode,
                            decode_tuning=config.decode_tuning, symmetric_memory=config.symmetric_memory,
                            activation_checkpointing=checkpointing,
                            checkpointed_layers=_checkpointed_layers(config, arch, layout) if checkpointing else None,
                            offload=config.offload, device=device,
                            warmup_steps=config.warmup_steps, measure_steps=config.measure_steps, seed=config.seed,
                            layout=layout, microbatches=config.microbatches if layout.pp > 1 else None,
                            gpu_memory_utilization=config.gpu_memory_utilization, kv_cache_bytes=config.kv_cache_bytes,
                        ))
    return specs


def _backend(config: SweepConfig, model: str) -> str:
    """The backend ``model`` runs on: the one asked for, else its default; a UserError where it cannot."""
    arch = resolve(model)
    backend = default_backend(arch) if config.backend == "auto" else config.backend
    problem = backend_error(arch, backend)
    if problem:
        raise UserError(f"backend: {problem}.")
    return backend


def asked_of(config: SweepConfig, *, backends: frozenset[str] | None = None,
             device_type: str | None = None) -> Asked:
    """``config`` as the inert-option rules read it (``fitbench.inert_options``): every option, those the
    user set (a resumed sweep's saved defaults are not among them: ``saved_options``)."""
    return Asked(config.model_dump(), frozenset(config.model_fields_set), "run", backends, device_type)


def _refuse_vllm_misfits(config: SweepConfig, modes: list[str], device_type: str) -> None:
    """What vLLM's engine does not run, refused in one paragraph before anything starts: a mode but
    generation, a precision it has no dtype or quantization for (``fitbench.models.vllm_options``), a job
    over several nodes, the batch search, fitbench's compile and offload. (vLLM's own options given to
    another backend are ``fitbench.inert_options``'.)"""
    if config.backend != "vllm":
        return
    others = [mode for mode in modes if mode != "infer"]
    if others:
        raise UserError(f"mode: the vllm backend measures generation (--mode infer); vLLM's engine runs no training "
                        f"step, and its forward pass over a prompt is the prefill, which infer times as the time to "
                        f"first token. Give --mode infer, or --backend native or hf for {' '.join(others)}.")
    for precision in config.precision or [default_precision("infer", device_type)]:
        options = precision_options(precision)
        if isinstance(options, str):
            raise UserError(f"precision: {options} (--precision, with --backend vllm)")
    if (config.nodes or 1) > 1:
        raise UserError(f"nodes: vLLM spreads an engine over several nodes through Ray, which fitbench does not "
                        f"start; with --backend vllm give one node (leave --nodes out, or --nodes 1).")
    if "auto" in (config.batch_size or []):
        raise UserError("batch-size: the vllm backend does not search for the largest batch; vLLM's engine reports "
                        "how many sequences its KV cache holds (the row's vllm.max_concurrency). Give --batch-size N.")
    for given, option, instead in ((config.compile, "--compile", "vLLM compiles its own model and captures CUDA "
                                    "graphs on a GPU unless --no-cuda-graphs"),
                                   (config.offload, "--offload", "vLLM keeps every layer on its GPUs")):
        if given:
            raise UserError(f"{option.lstrip('-')}: {option} is applied to fitbench's own builds; {instead}. Leave "
                            f"{option} out with --backend vllm.")


def _checkpointed_layers(config: SweepConfig, arch: Architecture, layout: Layout) -> int | None:
    """``checkpointed_layers`` as the spec keeps it: None (every layer) where the count covers each
    pipeline stage's layers, so that one configuration has one key and one label."""
    count = config.checkpointed_layers
    if count is None or count >= max(len(layers) for layers in pipeline_stages(arch.num_layers, layout.pp)):
        return None
    return count


def _layout(config: SweepConfig, mode: str, precision: str, backend: str, arch: Architecture) -> Layout:
    """The layout of a job of ``config.gpus`` ranks: the strategy asked for, or under ``auto`` the first of
    DDP and FSDP that composes with the configuration (the planner may choose another by forecast
    throughput where it plans: ``fitbench.planning.planner``). Generation under ``auto``, ``ddp`` or
    ``fsdp`` runs in one process: data parallelism has nothing to average or shard in it; tensor
    parallelism (``tp``) runs every mode, ``replicas`` inference and forward. With ``offload``, FSDP,
    whose CPU offload it is (DDP has none). What composes is ``Layout.problem``'s to say; raises
    UserError with its reason when the layout asked for does not."""
    if config.tp is not None:
        return _tensor_parallel_layout(config, mode, precision, backend, arch)
    if config.gpus == 1:
        return Layout()
    if config.strategy in ("tp", "pipeline", "replicas"):
        layout = Layout.of_strategy(config.strategy, config.gpus)
        problem = layout.problem(arch, mode, precision, backend, config.offload)
        if problem:
            raise UserError(f"strategy: {mode} {precision} under --strategy {config.strategy} on {config.gpus} ranks "
                            f"cannot run: {problem}.")
        return layout
    if mode == "infer":
        return Layout()  # generation has no gradients to average or shard: it runs on one GPU
    candidates = ("ddp", "fsdp") if config.strategy == "auto" else (config.strategy,)
    problems = []
    for strategy in candidates:
        layout = Layout.of_strategy(strategy, config.gpus)
        problem = layout.problem(arch, mode, precision, backend, config.offload)
        if problem is None:
            return layout
        problems.append(problem)
    field = "offload" if config.offload and config.strategy == "ddp" else "strategy"
    raise UserError(f"{field}: {mode} {precision} on {config.gpus} ranks cannot run ({'; '.join(problems)}).")


def _tensor_parallel_layout(config: SweepConfig, mode: str, precision: str, backend: str,
                            arch: Architecture) -> Layout:
    """The layout of ``--tp N`` with ``--gpus`` and ``--strategy``: N tensor-parallel ranks inside each
    group of the strategy named (FSDP in training modes and forward; generation, which has no data
    parallelism, on N ranks alone), each pipeline stage, or over every rank (``tp``). The options' own
    arithmetic is checked here (and ``auto``, which names no layout to go inside), what the layout composes
    with by ``Layout.problem``; raises UserError naming the options and the fix for every combination
    that does not run."""
    tp, gpus, strategy = config.tp, config.gpus, config.strategy
    if gpus == 1:
        raise UserError(f"tp: --tp {tp} splits each layer over {tp} of a job's ranks, and --gpus is 1; give "
                        f"--gpus {max(tp, 2)} or more (a multiple of --tp), or leave --tp out.")
    if gpus % tp:
        raise UserError(f"tp: --tp {tp} does not divide --gpus {gpus}; give a --tp that divides {gpus} (the ranks "
                        f"left over make the FSDP groups or pipeline stages), or --gpus a multiple of {tp}.")
    if strategy == "auto":
        raise UserError(f"tp: --tp {tp} combines with --strategy fsdp (training), pipeline (infer, forward) or "
                        f"tp, not --strategy auto; name one of those, or leave --tp out.")
    if strategy == "tp" and tp != gpus:
        raise UserError(f"tp: --strategy tp spreads each layer over every rank, so --tp {tp} must equal --gpus "
                        f"{gpus}; leave --tp out, or give --strategy fsdp or pipeline for {gpus // tp} groups of "
                        f"{tp}.")
    if strategy == "tp" or (strategy == "fsdp" and mode == "infer"):
        layout = Layout(tp=tp)
    else:
        layout = Layout.for_world(gpus, tp=tp, **{STRATEGY_DEGREES[strategy]: -1})
    problem = layout.problem(arch, mode, precision, backend, config.offload)
    if problem:
        raise UserError(f"tp: {mode} {precision} with --tp {tp} and --strategy {strategy}: {problem}; or leave --tp "
                        f"out.")
    return layout


# ---- loading and merging ------------------------------------------------------------------


# A sweep's file is a few hundred bytes; the caps keep a hostile or mistaken file from costing memory.
YAML_MAX_BYTES = 1_000_000
YAML_MAX_NODES = 10_000  # counting every alias as the copy it stands for


def _shortened(text: str, limit: int = 40) -> str:
    """An option name as written, cut: an unknown key can be any length."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Source(dict):
    """The options of one source (``cli``, a YAML ``file``, a ``saved`` sweep) and how a message names
    each: ``where(field)`` says where the value was written (``--batch-size``, the ``priority_order``
    key of config.yaml), ``label(field)`` what to call it, the key as written in a file."""

    def __init__(self, values: dict[str, Any], *, kind: str, name: str = "", keys: dict[str, str] | None = None):
        super().__init__(values)
        self.kind, self.name, self.keys = kind, name, dict(keys or {})

    def label(self, field: str) -> str:
        return field if self.kind == "cli" else self.keys.get(field, field)

    def where(self, field: str) -> str:
        key = _shortened(self.keys.get(field, field))
        if self.kind == "cli":
            return "--" + key.replace("_", "-")
        if self.kind == "file":
            return f"the `{key}` key of {self.name}"
        return f"`{key}` in the saved sweep {self.name} (it was saved damaged; start a new sweep with --out)"


class _Refused(yaml.YAMLError):
    """Well-formed YAML that fitbench will not expand."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing documents whose aliases expand past ``YAML_MAX_NODES`` nodes (a
    "billion laughs" of a few hundred bytes stands for gigabytes once anything walks it) or refer to
    themselves."""

    def compose_document(self):
        node = super().compose_document()
        sizes: dict[int, int] = {}
        seen: set[int] = set()

        def unique_keys(item) -> None:
            # PyYAML keeps the last of two equal keys; a file that sets an option twice says two things.
            if id(item) in seen or not isinstance(item.value, list):
                return
            seen.add(id(item))
            if isinstance(item, yaml.MappingNode):
                keys = [key.value for key, _ in item.value if isinstance(key, yaml.ScalarNode)]
                repeated = next((key for key in keys if keys.count(key) > 1 and key != "<<"), None)
                if repeated is not None:
                    raise _Refused(f"the key {excerpt(repeated)} appears twice in one mapping (line "
                                   f"{item.start_mark.line + 1})")
            for child in item.value:
                for part in (child if isinstance(child, tuple) else (child,)):
                    unique_keys(part)

        def expanded(item, inside: frozenset) -> int:
            if id(item) in inside:
                raise _Refused("an alias refers to the node that contains it")
            if id(item) not in sizes:
                children = item.value if isinstance(item.value, list) else []
                pairs = [part for child in children for part in (child if isinstance(child, tuple) else (child,))]
                total = 1
                for child in pairs:
                    total += expanded(child, inside | {id(item)})
                    if total > YAML_MAX_NODES:
                        raise _Refused(f"its aliases expand to more than {YAML_MAX_NODES:,} values")
                sizes[id(item)] = total
            return sizes[id(item)]

        if node is not None:
            expanded(node, frozenset())
            unique_keys(node)
        return node


def _contradictions(source: dict[str, Any], name: Callable[[str], str]) -> None:
    """Two options of one source that say different things: a UserError naming both. Across sources
    the usual precedence decides."""
    if "pass_type" in source and "mode" in source:
        raise UserError(f"{name('pass_type')} and {name('mode')} both set the mode (pass_type forward is mode "
                        f"forward, backward is forward-backward); give only one of them.")
    if source.get("no_fallback") is True and source.get("fallback") is not None:
        raise UserError(f"{name('no_fallback')} and {name('fallback')} contradict: one turns retrying off, the "
                        f"other lists the precisions to retry with; give only one of them.")
    for alias, field in FIELD_ALIASES:
        if alias in source and field in source and source[alias] != source[field]:
            raise UserError(f"{name(alias)} and {name(field)} are one setting with two values "
                            f"({excerpt(source[alias])} and {excerpt(source[field])}); give only one of them.")


def _read_yaml(path: str | Path) -> Any:
    raw = read_bounded(path, limit=YAML_MAX_BYTES, field="config",
                       fix="A sweep's YAML file is a few lines of options: pass an existing one to --config.")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"config: {path} is not UTF-8 text (byte {error.object[error.start]:#04x} at offset "
                        f"{error.start}). Save it as UTF-8.") from None
    try:
        return yaml.load(text, Loader=_BoundedLoader)
    except _Refused as error:
        fix = "Give each option once" if "twice" in str(error) else "Write the values out instead of through aliases"
        raise UserError(f"config: {path} is refused: {error}. {fix}.") from None
    except RecursionError:
        raise UserError(f"config: {path} nests lists or mappings too deeply to read; a sweep's options are at most "
                        f"two levels deep. Fix the file.") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error)
        raise UserError(f"config: {path} is not valid YAML{where} ({excerpt(problem, 120)}). "
                        f"Fix the file; every field of `fitbench run --help` can be a key.") from None
    except ValueError as error:  # an integer of thousands of digits
        raise UserError(f"config: {path} holds a number fitbench cannot read ({excerpt(str(error), 80)}). "
                        f"Fix the file.") from None


def _text_keys(mapping: dict, path: str | Path, inside: str) -> None:
    for key in mapping:
        if not isinstance(key, str):
            raise UserError(f"config: in {path}, {inside} has the key {excerpt(key)} ({type(key).__name__}); keys "
                            f"are option names, such as models or batch_size. Fix the file.")


def load_yaml(path: str | Path) -> Source:
    """A YAML file with the sweep's fields; the seeds' layout ``models: {sizes: [...]}`` is accepted."""
    data = _read_yaml(path)
    if data is None:
        raise UserError(f"config: {path} holds no options (it is empty or only comments). Add options such as "
                        f"models: [tiny], or leave out --config.")
    if not isinstance(data, dict):
        raise UserError(f"config: {path} must hold a mapping of fields (models: [...], mode: ...), "
                        f"not a {type(data).__name__}.")
    _text_keys(data, path, "the top level")
    spelled = {key.replace("-", "_"): key for key in data}
    if len(spelled) < len(data):
        twice = next(key for key in data if key != spelled[key.replace("-", "_")])
        other = spelled[twice.replace("-", "_")]
        raise UserError(f"config: in {path}, `{_shortened(twice)}` and `{_shortened(other)}` are one option written "
                        f"twice; keep one of them.")
    data = {key.replace("-", "_"): value for key, value in data.items()}
    _contradictions(data, lambda key: f"`{key}` in {path}")
    keys = {}
    models = data.get("models")
    if isinstance(models, dict):
        _text_keys(models, path, "`models`")
        if "sizes" not in models:
            raise UserError(f"config: in {path}, `models` is a mapping without `sizes`; write models: [7B, 13B] "
                            f"or models: {{sizes: [7B, 13B]}}.")
        quantization = models.get("quantization") or {}
        if not isinstance(quantization, dict):
            raise UserError(f"config: in {path}, `models.quantization` is {excerpt(quantization)}; it must be a "
                            f"mapping such as {{priority_order: [fp16, 8bit]}}. Fix the file.")
        data["models"], keys["models"] = models["sizes"], "models.sizes"
        if "priority_order" in quantization:
            _text_keys(quantization, path, "`models.quantization`")
            if "priority_order" not in data:
                data["priority_order"] = quantization["priority_order"]
                keys["fallback"] = "models.quantization.priority_order"
            if quantization.get("enabled") is False or quantization.get("fallback_strategy") is False:
                data.setdefault("no_fallback", True)
                keys.setdefault("no_fallback", "models.quantization.enabled")
    if "priority_order" in data:
        order = data.pop("priority_order")
        if order is None:
            raise UserError(f"config: in {path}, `{keys.get('fallback', 'priority_order')}` is empty; list the "
                            f"precisions to fall back through, e.g. [fp16, 8bit, 4bit], or leave the key out.")
        if "fallback" not in data:
            data["fallback"] = [ALIASES.get(str(p).lower(), p) for p in _as_list(order)]
            keys.setdefault("fallback", "priority_order")
    return Source(data, kind="file", name=str(path), keys=keys)


def _field_names(source: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """One source with its aliases under the fields' own names, so that a later source's alias
    (``--pass-type``) overrides an earlier source's field (``mode:`` in the file), and the reverse;
    with the key each renamed field was written as."""
    source, written = dict(source), {}
    if isinstance(source.get("pass_type"), str) and source["pass_type"] in PASS_TYPES:
        source.setdefault("mode", PASS_TYPES[source.pop("pass_type")])
        written["mode"] = "pass_type"
    for alias, name in FIELD_ALIASES:
        if alias in source:
            source.setdefault(name, source.pop(alias))
            written[name] = alias
    return source, written


def merge_sources(defaults: dict[str, Any], file: dict[str, Any], cli: dict[str, Any]) -> SweepConfig:
    """CLI > file > defaults, then validation with one clear paragraph that names where each bad value
    was written. ``defaults`` is the saved sweep on ``--resume``."""
    cli = cli if isinstance(cli, Source) else Source(cli, kind="cli")
    _contradictions(cli, cli.where)
    sources = [source if isinstance(source, Source) else Source(source, kind=kind, name=name)
               for source, kind, name in ((defaults, "saved", "sweep.json"), (file, "file", "the config file"))]
    merged, origin = {}, {}
    for source in (*sources, cli):
        values, written = _field_names(source)
        merged.update(values)
        origin.update({field: Source({}, kind=source.kind, name=source.name,
                                     keys={**source.keys, field: written.get(field, source.keys.get(field, field))})
                       for field in values})
    try:
        return SweepConfig.model_validate(merged)
    except ValidationError as error:
        raise UserError(describe_validation_error(error, origin)) from None


def describe_validation_error(error: ValidationError, origin: dict[str, Source] | None = None) -> str:
    """One sentence per problem: the option as the user wrote it, what is wrong with a short excerpt
    of the value, what is expected, and where to fix it."""
    problems = []
    for item in error.errors():
        field = next((str(part) for part in item["loc"] if isinstance(part, str)), "config")
        source = (origin or {}).get(field)
        if source is None:
            source = Source({}, kind="cli")
        label = source.label(field)
        description = SweepConfig.model_fields.get(field)
        expected = f" Expected: {description.description}." if description and description.description else ""
        if item["type"] == "extra_forbidden":
            problems.append(f"{_shortened(label)}: unknown field ({source.where(field)}). "
                            f"`fitbench run --help` lists the fields.")
            continue
        message = item["msg"].removeprefix("Value error, ")
        got = "" if "got " in message else f" (got {excerpt(item.get('input'))})"
        problems.append(f"{label}: {message[:200]}{got}.{expected} Fix {source.where(field)}.")
    return " ".join(dict.fromkeys(problems))


# ---- resuming a saved sweep ---------------------------------------------------------------

# What --extend may add to: the lists whose product is the sweep. Everything else is one setting of
# the whole sweep.
EXTENDABLE = ("models", "mode", "precision", "batch_size", "seq_len")
# What only shows the rows: given again on a resume, the new value holds and nothing is refused.
PRESENTATION = ("gpu_hour_price",)


def saved_options(sweep: Any, name: str) -> Source:
    """The options of a sweep.json (``name`` for messages), validated: a damaged file is a UserError."""
    config = sweep.get("config") if isinstance(sweep, dict) else None
    if not isinstance(config, dict):
        raise UserError(f"resume: {name} is damaged: it holds no `config` object. It is not a sweep fitbench "
                        f"saved, or it was edited; start a new sweep with --out.")
    # A value saved as its default was not set by the user: it stays out of the options given
    # (``SweepConfig.model_fields_set``), which the inert-option rules read. The ranks stay: left out,
    # they would be derived again from the nodes.
    fields = SweepConfig.model_fields
    source = Source({key: value for key, value in config.items()
                     if value is not None and not (key in fields and key != "gpus" and value == fields[key].default)},
                    kind="saved", name=name)
    try:
        SweepConfig.model_validate(dict(source))
    except ValidationError as error:
        raise UserError(f"resume: {name} is damaged: " + describe_validation_error(
            error, {field: source for field in source})) from None
    return source


def resumed_config(saved: Source, requested: SweepConfig, *, extend: bool) -> SweepConfig:
    """The sweep a ``--resume`` runs: the saved one when the options given change nothing; with
    ``extend``, the saved one with the new values added to its lists, so every configuration it had
    stays in it. Any other difference is a UserError that lists it: a saved sweep is never replaced."""
    before, after = SweepConfig.model_validate(dict(saved)).model_dump(), requested.model_dump()
    changed = [field for field in before if before[field] != after[field] and field not in PRESENTATION]
    if not changed:
        return requested
    shown = "; ".join(f"{field}: saved {excerpt(before[field])}, given {excerpt(after[field])}" for field in changed)
    if not extend:
        raise UserError(f"resume: the options given differ from the sweep saved in {saved.name} ({shown}). "
                        f"`fitbench run --resume DIR` alone finishes the saved sweep; add --extend to add the "
                        f"new models, modes, precisions, batch sizes or sequence lengths to it; or start a new "
                        f"sweep with --out.")
    fixed = [field for field in changed if field not in EXTENDABLE or before[field] is None]
    if fixed:
        raise UserError(f"resume: --extend adds values to the saved sweep's lists of {', '.join(EXTENDABLE)} "
                        f"(a list the saved sweep left to its defaults cannot grow), but the options given also "
                        f"change {', '.join(fixed)} ({shown}). Give only values to add, or start a new sweep "
                        f"with --out.")
    grown = {field: list(dict.fromkeys([*before[field], *after[field]])) for field in changed}
    shown = {field: after[field] for field in PRESENTATION if after[field] is not None}
    return SweepConfig.model_validate({**saved, **grown, **shown})
