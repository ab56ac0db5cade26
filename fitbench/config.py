"""What to run: ``SweepConfig`` (validated user input) and ``RunSpec`` (one configuration).

Configs validate; they never act: no device access, no environment changes. Values the hardware
decides (the device, the default models, precisions and shapes) arrive as arguments to ``expand``.
Precedence is CLI > YAML file > defaults; the merge happens in ``merge_sources``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fitbench.errors import UserError
from fitbench.models.backends import backend_error, default_backend
from fitbench.models.registry import resolve
from fitbench.plan.memory import offload_problem
from fitbench.precisions import TRAINING_MODES
from fitbench.run.precision import PRECISIONS, training_problem, trains_every_weight

Mode = Literal["train", "forward", "forward-backward", "infer"]
Precision = Literal["fp32", "tf32", "bf16", "fp16", "bf16-pure",
                    "int8", "nf4", "fp4", "int8-dynamic", "int4", "fp8", "fp8-block"]
BackendChoice = Literal["auto", "native", "hf"]

# The seeds' CS336 script says --pass-type forward|backward; backward there means forward + backward.
PASS_TYPES = {"forward": "forward", "backward": "forward-backward"}


class RunSpec(BaseModel):
    """One configuration, run in one fresh process."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    backend: Literal["native", "hf"]
    mode: Mode
    precision: Precision
    batch_size: int = Field(gt=0)
    seq_len: int = Field(gt=0)
    new_tokens: int = Field(gt=0)
    compile: bool = False
    activation_checkpointing: bool = False
    device: str
    warmup_steps: int = Field(ge=0)
    measure_steps: int = Field(gt=0)
    seed: int = 0
    auto_batch: bool = False  # batch_size is found by probing, starting from the planner's prediction
    cuda_graphs: bool = True  # native infer on a GPU decodes through a CUDA graph
    # Decoder layers that do not fit on the device stay in a slower tier (host memory beside a GPU,
    # disk beside the CPU) and stream in for their forward (fitbench.models.offload).
    offload: bool = False

    @model_validator(mode="after")
    def _offload_applies(self) -> RunSpec:
        problem = offload_problem(self.mode, self.precision, self.backend, self.compile) if self.offload else None
        if problem:
            raise ValueError(problem)
        return self

    @property
    def key(self) -> str:
        """Identity of the configuration: the same key means the same measurement. ``cuda_graphs`` and
        ``offload``, added later, count only when they change what runs, so earlier results keep their
        keys."""
        fields = self.model_dump()
        if self.mode != "infer":
            fields.pop("new_tokens")
        if not self.graphs_off:
            fields.pop("cuda_graphs")
        if not self.offload:
            fields.pop("offload")
        digest = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()
        return digest[:12]

    @property
    def graphs_off(self) -> bool:
        """CUDA graphs turned off where they apply: generation with the native backend."""
        return not self.cuda_graphs and self.mode == "infer" and self.backend == "native"

    @property
    def label(self) -> str:
        batch = "auto" if self.auto_batch else self.batch_size
        shape = f"{batch}x{self.seq_len}" + (f"+{self.new_tokens}" if self.mode == "infer" else "")
        recompute = " recompute" if self.activation_checkpointing else ""
        eager = " no-cuda-graphs" if self.graphs_off else ""
        offload = " offload" if self.offload else ""
        return f"{self.model} {self.mode} {self.precision} {shape}{recompute}{eager}{offload} [{self.backend}]"


def _as_list(value: Any) -> Any:
    return value if value is None or isinstance(value, list) else [value]


class SweepConfig(BaseModel):
    """A sweep: the cartesian product of models x mode x precision x batch_size x seq_len.

    A field left as None takes a default that depends on the device (see ``expand``).
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    models: list[str] | None = Field(None, min_length=1, description="preset names, local directories or hub ids")
    mode: list[Mode] | None = Field(None, min_length=1, description="train, forward, forward-backward, infer")
    precision: list[Precision] | None = Field(None, min_length=1, description=", ".join(PRECISIONS))
    batch_size: list[int | Literal["auto"]] | None = Field(
        None, min_length=1, description="positive integers, or auto for the largest that runs")
    seq_len: list[int] | None = Field(None, min_length=1, description="positive integers (the prompt length in infer)",
                                      validation_alias="context_length")
    new_tokens: int | None = Field(None, gt=1, description="tokens generated per sequence in infer (at least 2)")
    fallback: list[Precision] | None = Field(
        None, min_length=1, description="precisions to fall back through on out-of-memory, in order")
    no_fallback: bool = False
    offload: bool = Field(False, description="keep the decoder layers that do not fit in host memory (infer, forward)")
    backend: BackendChoice = "auto"
    compile: bool = False
    cuda_graphs: bool = Field(True, description="true or false: native infer on a GPU decodes through a CUDA graph")
    activation_checkpointing: bool | None = Field(None, description="None: the planner decides (on a GPU)")
    warmup_steps: int = Field(5, ge=0)
    measure_steps: int = Field(10, gt=0, validation_alias="samples")
    device: str = "auto"
    timeout: float = Field(3600.0, gt=0, allow_inf_nan=False,
                           description="a finite, positive number of seconds: a configuration's whole life")
    out: str | None = None
    seed: int = 0

    @field_validator("models", "mode", "precision", "batch_size", "seq_len", "fallback", mode="before")
    @classmethod
    def _scalar_to_list(cls, value: Any) -> Any:
        return _as_list(value)

    @field_validator("batch_size", "seq_len")
    @classmethod
    def _positive(cls, values: list | None) -> list | None:
        for value in values or []:
            if value != "auto" and value <= 0:
                raise ValueError(f"must be positive, got {value}")
        return values


    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
            return value
        raise ValueError(f"must be auto, cpu, cuda or cuda:N, got {value!r}")

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
        for alias, name in (("context_length", "seq_len"), ("samples", "measure_steps")):
            if alias in data and name in data:
                data.pop(alias)
        return data


# The seeds' config.yaml says priority_order: ["none", "fp16", "8bit", "4bit"].
SEED_PRECISIONS = {"none": "fp32", "fp16": "bf16-pure", "8bit": "int8", "4bit": "nf4"}
DEFAULT_FALLBACK = {
    "train": ["bf16", "bf16-pure"],
    "forward-backward": ["bf16", "bf16-pure"],
    "forward": ["bf16-pure", "int8", "nf4"],
    "infer": ["bf16-pure", "int8", "nf4"],
}


def fallback_ladder(config: SweepConfig, mode: str) -> list[str]:
    """The precisions a configuration of ``mode`` may fall back through: the user's ladder (for training,
    only rungs that train every weight: ``trains_every_weight``), else the default for the mode."""
    ladder = list(dict.fromkeys(config.fallback or DEFAULT_FALLBACK[mode]))  # a repeated rung counts once
    if mode in TRAINING_MODES:
        ladder = [p for p in ladder if trains_every_weight(p)]
    return ladder or DEFAULT_FALLBACK[mode]


def _default_shapes(mode: str, device_type: str) -> tuple[int, int]:
    """(batch, seq_len) when the user gave none: CS336's 4 x 512 for training-style modes on a GPU,
    batch 1 with a 128-token prompt for inference, and 1 x 128 for everything on a CPU."""
    if mode == "infer" or device_type == "cpu":
        return 1, 128
    return 4, 512


def default_precision(mode: str, device_type: str) -> str:
    """fp32 on a CPU; on a GPU bf16 autocast for training-style modes and bf16 weights for inference."""
    if device_type == "cpu":
        return "fp32"
    return "bf16-pure" if mode == "infer" else "bf16"


def expand(config: SweepConfig, *, device: str, default_models: list[str]) -> list[RunSpec]:
    """Every RunSpec of the sweep, in order: model, mode, precision, batch, seq_len. Raises UserError."""
    device_type = device.split(":")[0]
    modes = config.mode or ["train", "infer"]
    new_tokens = config.new_tokens or (32 if device_type == "cpu" else 128)
    specs = []
    for model in config.models or default_models:
        arch = resolve(model)
        backend = default_backend(arch) if config.backend == "auto" else config.backend
        problem = backend_error(arch, backend)
        if problem:
            raise UserError(f"backend: {problem}.")
        for mode in modes:
            default_batch, default_seq = _default_shapes(mode, device_type)
            first_rung = fallback_ladder(config, mode)[0] if config.fallback else default_precision(mode, device_type)
            for precision in config.precision or [first_rung]:
                if mode in TRAINING_MODES and training_problem(precision):
                    raise UserError(f"precision: {training_problem(precision)}; or use --mode infer or forward "
                                    f"with {precision}.")
                problem = offload_problem(mode, precision, backend, config.compile) if config.offload else None
                if problem:
                    raise UserError(f"offload: {problem}.")
                for batch in config.batch_size or [default_batch]:
                    for seq_len in config.seq_len or [default_seq]:
                        needed = seq_len + (new_tokens if mode == "infer" else 0)
                        if needed > arch.max_seq_len:
                            what = f"seq_len {seq_len} + new_tokens {new_tokens}" if mode == "infer" else f"seq_len {seq_len}"
                            raise UserError(
                                f"seq_len: {what} exceeds the {arch.max_seq_len}-token context of {model}. "
                                f"Use --seq-len (alias --context-length) of at most "
                                f"{arch.max_seq_len - (new_tokens if mode == 'infer' else 0)}."
                            )
                        specs.append(RunSpec(
                            model=model, backend=backend, mode=mode, precision=precision,
                            batch_size=1 if batch == "auto" else batch, auto_batch=batch == "auto",
                            seq_len=seq_len, new_tokens=new_tokens, compile=config.compile,
                            cuda_graphs=config.cuda_graphs,
                            activation_checkpointing=bool(config.activation_checkpointing)
                            and mode in TRAINING_MODES, offload=config.offload, device=device,
                            warmup_steps=config.warmup_steps, measure_steps=config.measure_steps, seed=config.seed,
                        ))
    return specs


# ---- loading and merging ------------------------------------------------------------------


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file with the sweep's fields; the seeds' layout ``models: {sizes: [...]}`` is accepted."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise UserError(f"config: cannot read {path}: {error.strerror}. Pass an existing YAML file to --config.") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"config: {path} is not valid YAML{where} ({getattr(error, 'problem', error)}). "
                        f"Fix the file; every field of `fitbench run --help` can be a key.") from None
    if not isinstance(data, dict):
        raise UserError(f"config: {path} must hold a mapping of fields (models: [...], mode: ...), "
                        f"not a {type(data).__name__}.")
    data = {key.replace("-", "_"): value for key, value in data.items()}
    models = data.get("models")
    if isinstance(models, dict):
        if "sizes" not in models:
            raise UserError(f"config: in {path}, `models` is a mapping without `sizes`; write models: [7B, 13B] "
                            f"or models: {{sizes: [7B, 13B]}}.")
        quantization = models.get("quantization") or {}
        data["models"] = models["sizes"]
        if isinstance(quantization, dict) and "priority_order" in quantization:
            data.setdefault("priority_order", quantization["priority_order"])
            if quantization.get("enabled") is False or quantization.get("fallback_strategy") is False:
                data.setdefault("no_fallback", True)
    if "priority_order" in data:
        order = data.pop("priority_order")
        data.setdefault("fallback", [SEED_PRECISIONS.get(str(p).lower(), p) for p in _as_list(order)])
    return data


def _field_names(source: dict[str, Any]) -> dict[str, Any]:
    """One source with its aliases under the fields' own names, so that a later source's alias
    (``--pass-type``) overrides an earlier source's field (``mode:`` in the file), and the reverse."""
    source = dict(source)
    if isinstance(source.get("pass_type"), str) and source["pass_type"] in PASS_TYPES:
        source.setdefault("mode", PASS_TYPES[source.pop("pass_type")])
    for alias, name in (("context_length", "seq_len"), ("samples", "measure_steps")):
        if alias in source:
            source.setdefault(name, source.pop(alias))
    return source


def merge_sources(defaults: dict[str, Any], file: dict[str, Any], cli: dict[str, Any]) -> SweepConfig:
    """CLI > file > defaults, then validation with one clear paragraph per problem."""
    merged = {**_field_names(defaults), **_field_names(file), **_field_names(cli)}
    try:
        return SweepConfig.model_validate(merged)
    except ValidationError as error:
        raise UserError(describe_validation_error(error)) from None


def describe_validation_error(error: ValidationError) -> str:
    problems = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"] if not isinstance(part, int)) or "config"
        flag = "--" + field.replace("_", "-")
        description = SweepConfig.model_fields.get(field)
        expected = f" Expected: {description.description}." if description and description.description else ""
        if item["type"] == "extra_forbidden":
            problems.append(f"{field}: unknown field. `fitbench run --help` lists the fields.")
            continue
        message = item["msg"].removeprefix("Value error, ")
        problems.append(f"{field}: {message} (got {item.get('input')!r}).{expected} Fix {flag} or the "
                        f"`{field}` key of the config file.")
    return " ".join(problems)

