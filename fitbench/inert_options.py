"""Options that would change nothing in the modes and layout asked for: one table (``RULES``), each
entry the option, when it is inert, why, and the fix, read by ``fitbench run`` (its command line, its
YAML file and ``fitbench.run`` alike, through ``fitbench.config.expand``) and ``fitbench plan`` (and
``fitbench.plan``).

An option given where the other options make it inert is refused: a UserError, one paragraph naming
the option and the fix (exit 2), before anything runs. Where only this machine makes it inert (no
CUDA graphs on a CPU), it is a warning, so that a sweep meant for GPUs can be tried on a CPU as it is.
An option counts as given when the command line, the YAML file or the API's call set it; a resumed
sweep's saved defaults do not count. Why each option matters only where it does: ``docs/running.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from fitbench.planning.planner import GpuTarget
from fitbench.precisions import TRAINING_MODES
from fitbench.util.errors import UserError

# GPUs of one node where none are given (--gpus-per-node): the planner's.
NODE_GPUS = GpuTarget.__dataclass_fields__["node_gpus"].default

# The strategies under which generation spreads no layer over ranks: data parallelism has nothing to
# average or shard in it (``fitbench.config._layout`` runs it in one process), a pipeline keeps whole layers.
NO_TENSOR_PARALLELISM = ("ddp", "fsdp", "pipeline", "replicas")


@dataclass(frozen=True)
class Asked:
    """What a command was asked, as the rules read it: ``options``, every option's value by its field
    name (``new_tokens``); ``given``, those the user set; ``command``, run or plan; ``backends``, the
    backends its models resolve to (None: not known); ``device_type``, cuda or cpu (None: not known yet,
    and the rules about this machine wait)."""

    options: dict[str, Any]
    given: frozenset[str]
    command: str
    backends: frozenset[str] | None = None
    device_type: str | None = None

    def __getattr__(self, name: str) -> Any:
        try:
            return self.options[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def modes(self) -> list[str]:
        if self.options.get("mode"):
            return list(self.options["mode"])
        if self.command != "run":
            return ["train"]
        return ["infer"] if self.options.get("backend") == "vllm" else ["train", "infer"]

    @property
    def generates(self) -> bool:
        """A mode of the sweep generates tokens (infer)."""
        return "infer" in self.modes

    @property
    def trains(self) -> bool:
        """A mode of the sweep has a backward pass."""
        return bool(set(self.modes) & set(TRAINING_MODES))

    @property
    def native(self) -> bool:
        """A model of the sweep runs on fitbench's own decoder (or the backends are not known yet)."""
        return self.backends is None or "native" in self.backends

    @property
    def vllm(self) -> bool:
        """A model of the sweep runs on vLLM's engine (or the backends are not known yet)."""
        return self.backends is None or "vllm" in self.backends

    @property
    def tensor_parallel(self) -> bool:
        """A generation of the sweep may split its layers over ranks: several ranks, and --tp, --strategy tp,
        or --strategy auto (on GPUs the planner may choose tensor parallelism)."""
        gpus, tp, strategy = self.options.get("gpus") or 1, self.options.get("tp"), self.options.get("strategy")
        return gpus > 1 and ((tp or 1) > 1 or strategy not in NO_TENSOR_PARALLELISM)

    @property
    def on_cpu(self) -> bool:
        return self.device_type == "cpu"


@dataclass(frozen=True)
class InertRule:
    """An option (``option``, its field name) of ``commands`` that changes nothing where ``inert`` holds;
    ``why`` and ``fix`` complete the sentence "--option ... ; fix." (formatted with ``modes``, ``gpus``,
    ``strategy``, ``flag``: the option as written, ``mode_flags``: ``--mode`` as given). ``machine``: inert
    because of this machine alone, a warning rather than a refusal."""

    option: str
    commands: tuple[str, ...]
    inert: Callable[[Asked], bool]
    why: str
    fix: str
    machine: bool = False


def flag(option: str, value: Any = None) -> str:
    """The option as the command line writes it: ``--new-tokens``, ``--no-cuda-graphs`` for a switch
    that is on by default and was turned off."""
    name = "--" + option.replace("_", "-")
    return name.replace("--", "--no-", 1) if value is False and option in SWITCHES_ON_BY_DEFAULT else name


def written(option: str, value: Any) -> str:
    """The option with its value as the command line writes it: ``--new-tokens 64``, ``--strategy pipeline``,
    ``--no-cuda-graphs``."""
    if isinstance(value, bool) or value is None:
        return flag(option, value)
    shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else f"{value:g}" if isinstance(
        value, float) else str(value)
    return f"{flag(option)} {shown}"


# Switches that are on unless turned off (--no-...), whose given value is written either way.
SWITCHES_ON_BY_DEFAULT = ("cuda_graphs", "compile_decode", "symmetric_memory")

_DECODING = "chooses how native infer decodes"

MACHINE_FIX = "it changes nothing here, and applies where the sweep runs on GPUs"

RULES: tuple[InertRule, ...] = (
    InertRule("new_tokens", ("run", "plan"), lambda a: not a.generates,
              "sets the tokens generated in infer, and {mode_flags} generates none",
              "add infer to --mode, or leave {flag} out"),
    InertRule("activation_checkpointing", ("run",), lambda a: a.activation_checkpointing and not a.trains,
              "recomputes activations in the backward pass, and {mode_flags} has none",
              "add --mode train or forward-backward, or leave {flag} out"),
    InertRule("checkpointed_layers", ("run",), lambda a: not a.trains,
              "recomputes activations in the backward pass, and {mode_flags} has none",
              "add --mode train or forward-backward, or leave {flag} out"),
    InertRule("strategy", ("run",), lambda a: a.strategy != "auto" and a.gpus == 1 and a.tp is None,
              "spreads each configuration over --gpus N ranks, and --gpus is 1, so it would run as one process",
              "give --gpus 2 or more (or --nodes with --gpus-per-node), or leave --strategy out"),
    InertRule("strategy", ("run",),
              lambda a: a.strategy in ("ddp", "fsdp") and a.gpus > 1 and a.tp is None and a.modes == ["infer"],
              "shares gradients and optimizer state between ranks, and --mode infer has none: generation would run "
              "in one process",
              "give --strategy tp, pipeline or replicas for generation on {gpus} GPUs, or add a training mode"),
    InertRule("microbatches", ("run",), lambda a: a.strategy != "pipeline" or a.gpus == 1 or not a.trains,
              "split the batch of a pipelined training step, and {setting}",
              "give them with --strategy pipeline, --gpus 2 or more and --mode train or forward-backward, or leave "
              "--microbatches out"),
    InertRule("cuda_graphs", ("run",), lambda a: not (a.generates and (a.native or a.vllm)),
              f"{_DECODING} (and vLLM's, as its enforce_eager), and {{decoder}}", "leave {flag} out"),
    InertRule("compile_decode", ("run",), lambda a: not (a.generates and a.native),
              f"{_DECODING}, and {{decoder}}", "leave {flag} out"),
    InertRule("decode_tuning", ("run",), lambda a: not (a.generates and a.native),
              f"tunes the compiled decode step of native infer, and {{decoder}}", "leave {flag} out"),
    InertRule("decode_tuning", ("run",), lambda a: not a.compile_decode,
              "tunes the compiled decode step, and --no-compile-decode compiles none",
              "leave one of the two out"),
    InertRule("symmetric_memory", ("run",), lambda a: not (a.generates and a.native),
              "chooses how tensor-parallel native infer sums its small all-reduces, and {decoder}",
              "leave {flag} out"),
    InertRule("symmetric_memory", ("run",), lambda a: a.generates and a.native and not a.tensor_parallel,
              "chooses how tensor-parallel infer sums its small all-reduces, and no layer is split over ranks "
              "(--gpus {gpus}, --strategy {strategy})",
              "give --gpus 2 or more with --strategy tp (or --tp with pipeline), or leave {flag} out"),
    InertRule("symmetric_memory", ("run",), lambda a: not a.compile_decode and a.tensor_parallel,
              "chooses how the compiled decode step sums its all-reduces, and --no-compile-decode compiles none",
              "leave one of the two out"),
    InertRule("gpu_memory_utilization", ("run",), lambda a: not a.vllm,
              "sizes vLLM's engine, and no model runs on the vllm backend", "add --backend vllm, or leave {flag} out"),
    InertRule("kv_cache_bytes", ("run",), lambda a: not a.vllm,
              "sizes vLLM's KV cache, and no model runs on the vllm backend", "add --backend vllm, or leave {flag} out"),
    InertRule("ollama_timeout", ("run",), lambda a: not a.ollama_model,
              "bounds the analysis --ollama-model writes, and none is asked",
              "add --ollama-model, or leave {flag} out"),
    InertRule("strategy", ("plan",), lambda a: a.requirements,
              "limits the layouts of a plan, and --requirements considers every layout for its fewest GPUs",
              "leave out one of the two"),
    InertRule("gpus", ("plan",), lambda a: a.requirements,
              "sets how many GPUs to plan for, and --requirements finds the fewest itself",
              "leave out one of the two"),
    InertRule("nodes", ("plan",), lambda a: a.requirements,
              "sets how many nodes to plan for, and --requirements finds the fewest itself (in nodes of "
              "--gpus-per-node)", "leave out --nodes"),
    InertRule("inter_node_bandwidth", ("plan",), lambda a: not a.requirements and a.nodes is None and (
        a.gpus is not None and a.gpus <= (a.gpus_per_node or NODE_GPUS)),
              "gives collectives that cross nodes their bandwidth, and the {gpus} GPU(s) planned for fit in one node "
              "of {node_gpus}", "plan for more GPUs than a node holds (--gpus, --nodes), or leave {flag} out"),
    InertRule("trace", ("plan",), lambda a: a.requirements,
              "traces the chosen plan, and --requirements chooses none", "leave out one of the two"),
    InertRule("preregister", ("plan",), lambda a: a.requirements,
              "registers the forecasts of the chosen plans, and --requirements chooses none",
              "leave out one of the two"),
    InertRule("batch_size", ("plan",), lambda a: a.requirements and list(a.batch_size) != [1] and (
        len(a.batch_size) > 1 or a.batch_size[0] == "auto"),
              "gives several batches or auto, and --requirements answers for one batch",
              "give one --batch-size N with --requirements"),
    # What only this machine makes inert: warned.
    InertRule("cuda_graphs", ("run",), lambda a: a.on_cpu, f"{_DECODING} on a GPU, and the sweep runs on a CPU",
              MACHINE_FIX, machine=True),
    InertRule("compile_decode", ("run",), lambda a: a.on_cpu, f"{_DECODING} on a GPU, and the sweep runs on a CPU",
              MACHINE_FIX, machine=True),
    InertRule("decode_tuning", ("run",), lambda a: a.on_cpu,
              "tunes the compiled decode step on a GPU, and the sweep runs on a CPU", MACHINE_FIX, machine=True),
    InertRule("symmetric_memory", ("run",), lambda a: a.on_cpu,
              "chooses how tensor-parallel infer sums its all-reduces between GPUs, and the sweep runs on CPU "
              "processes", MACHINE_FIX, machine=True),
)


def _sentence(rule: InertRule, asked: Asked) -> str:
    """The paragraph of ``rule`` for ``asked``: the field, the option as written, why it changes nothing
    there, and the fix, its words filled in from what was asked."""
    value = asked.options.get(rule.option)
    modes = " ".join(asked.modes)
    backends = sorted(asked.backends or ())
    words = {
        "flag": flag(rule.option, value), "modes": modes, "gpus": asked.options.get("gpus") or 1,
        "strategy": asked.options.get("strategy"), "node_gpus": asked.options.get("gpus_per_node") or NODE_GPUS,
        "mode_flags": f"--mode {modes}" + ("" if "mode" in asked.given or asked.command != "run" else " (the default)"),
        "decoder": ("no mode generates (--mode " + modes + ")" if not asked.generates else
                    f"every model runs on the {' and '.join(backends)} backend, not the native one"),
        "setting": ("--strategy is " + str(asked.options.get("strategy")) if asked.options.get("strategy") != "pipeline"
                    else "--gpus is 1" if (asked.options.get("gpus") or 1) == 1 else f"--mode {modes} does not train"),
    }
    return f"{rule.option}: {written(rule.option, value)} {rule.why.format(**words)}; {rule.fix.format(**words)}."


def findings(asked: Asked) -> list[tuple[InertRule, str]]:
    """Every rule of ``RULES`` that holds for an option ``asked`` gives, with its sentence; rules about this
    machine only once its device type is known."""
    found = []
    for rule in RULES:
        if asked.command not in rule.commands or rule.option not in asked.given:
            continue
        if rule.machine and asked.device_type is None:
            continue
        if rule.inert(asked):
            found.append((rule, _sentence(rule, asked)))
    return found


def refuse_inert(asked: Asked) -> None:
    """A UserError with the first refusal of ``findings`` (the options contradict), if any."""
    for rule, sentence in findings(asked):
        if not rule.machine:
            raise UserError(sentence)


def inert_warnings(asked: Asked) -> list[str]:
    """The warnings of ``findings``: options that this machine alone makes inert."""
    return [sentence for rule, sentence in findings(asked) if rule.machine]
