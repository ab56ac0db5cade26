"""The commands' option groups, each adding its options to a parser in the order --help lists them;
a command names the groups it takes (``fitbench.cli.command.Command``).

List options take space-separated values as users type them (``--models 1B 3B 7B``). Every option of
``sweep_options`` is also a key of the YAML file given to ``run --config``; their defaults are left
out of the parsed arguments (``SUPPRESS``), so that the command line wins over the file only where
given, and the file over the defaults.
"""

from __future__ import annotations

import argparse

from fitbench.cli.command import OptionGroup
from fitbench.precisions import ADAPTERS, DEFAULT_LADDER, FLOAT8, PRECISIONS, QUANTIZED_PRECISIONS, entry
from fitbench.spec import MODES
from fitbench.util.errors import excerpt


def default_ladders() -> str:
    """The default fallback ladder of each mode (``DEFAULT_LADDER``), the modes that share one named
    together: ``train and forward-backward bf16 bf16-pure; forward and infer bf16-pure int8 nf4``."""
    modes_of: dict[tuple[str, ...], list[str]] = {}
    for mode, ladder in DEFAULT_LADDER.items():
        modes_of.setdefault(tuple(ladder), []).append(mode)
    return "; ".join(f"{' and '.join(modes)} {' '.join(ladder)}" for ladder, modes in modes_of.items())


def floating_precisions() -> str:
    """The floating-point precisions grouped by their weights' dtype and autocast, from the registry
    (``fitbench.precisions``): ``fp32, tf32 (float32 weights and optimizer state); bf16, fp16 (autocast over
    float32 weights); ...``."""
    by_policy: dict[str, list[str]] = {}
    for name in PRECISIONS:
        policy = entry(name).policy
        if policy.quantized:
            continue
        what = (f"autocast over {policy.weight_dtype_name} weights" if policy.autocast_dtype_name else
                f"{policy.weight_dtype_name} weights and optimizer state")
        by_policy.setdefault(what, []).append(name)
    return "; ".join(f"{', '.join(names)} ({what})" for what, names in by_policy.items())


def quantized_precisions() -> str:
    """The quantized precisions by library and how each trains, from the registry (``fitbench.precisions``)."""
    by_library: dict[str, list[str]] = {}
    for name in QUANTIZED_PRECISIONS:
        by_library.setdefault(entry(name).library, []).append(name)
    libraries = "; ".join(f"{', '.join(names)} ({library})" for library, names in by_library.items())
    float8, adapters = ([name for name in PRECISIONS if entry(name).training == way] for way in (FLOAT8, ADAPTERS))
    return (f"quantized weights: {libraries}. Training: float8 matmuls over every weight for {', '.join(float8)}; "
            f"low-rank adapters on the frozen quantized base (QLoRA) for {', '.join(adapters)}; none for the other "
            f"quantized ones")


def sweep_options(parser: argparse.ArgumentParser) -> None:
    """What ``fitbench run`` sweeps and how (``fitbench.config.SweepConfig``), and where it writes."""
    S = argparse.SUPPRESS
    add = parser.add_argument
    add("--models", nargs="+", default=S, metavar="MODEL",
        help="presets (see `fitbench models`), local directories with a config.json, or hub ids. Default: "
             "tiny and small on a CPU; on one GPU the two largest sizes that train on it; on --gpus N the largest "
             "that trains on all N (one GPU's under --strategy ddp or replicas)")
    add("--mode", "--modes", dest="mode", nargs="+", choices=MODES, default=S, metavar="MODE",
        help="what a step does: train (forward, backward, AdamW), forward, forward-backward, infer "
             "(prefill + decode with a KV cache). Default: train infer (infer with --backend vllm)")
    add("--pass-type", dest="pass_type", choices=("forward", "backward"), default=S,
        help="CS336 spelling: forward = --mode forward, backward = --mode forward-backward")
    add("--precision", nargs="+", choices=PRECISIONS, default=S, metavar="PRECISION",
        help=f"{floating_precisions()}; {quantized_precisions()}")
    add("--batch-size", dest="batch_size", nargs="+", type=batch_size, default=S, metavar="N",
        help="sequences per step, or auto: the largest that runs, from the planner's prediction verified by "
             "probe runs (reported as max_batch)")
    add("--fallback", nargs="+", choices=PRECISIONS, default=S, metavar="PRECISION",
        help="on out-of-memory, retry with the next of these precisions, then activation checkpointing, then half "
             f"the batch, and last, for infer and forward, with offload in the first floating-point one (default "
             f"per mode: {default_ladders()}); also the ladder the planner picks the first fitting precision from")
    add("--no-fallback", dest="no_fallback", action="store_true", default=S,
        help="record an out-of-memory as it is, without retrying")
    add("--offload", action="store_true", default=S,
        help="infer and forward with the decoder layers that do not fit on the GPU kept in host memory and "
             "streamed in for their forward (accelerate); on a CPU, the layers that do not fit in RAM go to disk. "
             "With --gpus N under FSDP: FSDP's CPU offload, each rank's shards, gradients and optimizer state "
             "in host memory")
    add("--seq-len", "--context-length", dest="seq_len", nargs="+", type=int, default=S, metavar="T",
        help="tokens per sequence; the prompt length in infer")
    add("--new-tokens", dest="new_tokens", type=int, default=S, metavar="N",
        help="tokens generated per sequence in infer (default 128 on a GPU, 32 on a CPU)")
    add("--backend", choices=("auto", "native", "hf", "vllm"), default=S,
        help="native: fitbench's decoder; hf: transformers; both run every family; vllm: vLLM's engine on the "
             "preset with random weights, infer only (docs/serving.md). Default auto")
    add("--gpu-memory-utilization", dest="gpu_memory_utilization", type=float, default=S, metavar="SHARE",
        help="with --backend vllm: the share of each GPU's memory vLLM's engine takes (on a CPU, of the host's); "
             "default 0.9")
    add("--kv-cache-bytes", dest="kv_cache_bytes", type=int, default=S, metavar="BYTES",
        help="with --backend vllm: vLLM's KV cache per GPU in bytes, in place of what --gpu-memory-utilization "
             "leaves")
    add("--compile", action="store_true", default=S, help="torch.compile the model; compile time is reported apart")
    add("--cuda-graphs", dest="cuda_graphs", action=argparse.BooleanOptionalAction, default=S,
        help="infer with the native backend on a GPU: replay each decode step from a CUDA graph captured in the "
             "first warm-up generation (default), or with --no-cuda-graphs launch its kernels one by one. The hf "
             "backend always decodes eagerly")
    add("--compile-decode", dest="compile_decode", action=argparse.BooleanOptionalAction, default=S,
        help="infer with the native backend on a GPU: compile the decode step and the prefill with inductor "
             "(once per shape, timed apart: the row's decode record) before the capture (default); "
             "--no-compile-decode captures the eager step. Where compiling fails the eager step runs and the "
             "decode record says why")
    add("--decode-tuning", dest="decode_tuning", action="store_true", default=S,
        help="with --compile-decode: tune the decode step's layer with inductor's coordinate descent (its "
             "compile only; a longer compile)")
    add("--symmetric-memory", dest="symmetric_memory", action=argparse.BooleanOptionalAction, default=S,
        help="infer under tensor parallelism on GPUs with --compile-decode: sum each layer's small all-reduces "
             "(up to 128 KiB: a decode step's) with symmetric memory's one-shot kernel, each rank reading its "
             "peers' partial sums over NVLink (default); --no-symmetric-memory keeps NCCL's")
    add("--activation-checkpointing", dest="activation_checkpointing", action="store_true", default=S,
        help="recompute each decoder layer's activations in the backward pass instead of keeping them "
             "(train, forward-backward): every layer, or those --checkpointed-layers names. Left out with "
             "--checkpointed-layers too, on a GPU the planner decides, and picks the fewest layers that fit")
    add("--checkpointed-layers", dest="checkpointed_layers", type=int, default=S, metavar="N",
        help="activation checkpointing for the first N decoder layers of each pipeline stage (of the model "
             "without stages); the other layers keep their activations, trading memory for about N/layers of "
             "the recomputation's cost. Implies --activation-checkpointing; N at or above a stage's layers is "
             "every layer. The native backend")
    add("--warmup-steps", dest="warmup_steps", type=int, default=S, metavar="N", help="untimed steps first (default 5)")
    add("--measure-steps", "--samples", dest="measure_steps", type=int, default=S, metavar="N",
        help="timed steps (generations in infer), default 10")
    add("--device", default=S, help="cpu, cuda or cuda:N (default: the first GPU if there is one, else cpu)")
    add("--gpus", type=int, default=S, metavar="N",
        help="run each configuration as one torchrun job of N ranks, one GPU each (on --device cpu, N CPU "
             "processes talking over gloo); default 1")
    add("--strategy", choices=("auto", "ddp", "fsdp", "tp", "pipeline", "replicas"), default=S,
        help="with --gpus N: ddp (a replica per GPU, gradients averaged), fsdp (weights, gradients and optimizer "
             "state sharded, FSDP2), tp (tensor parallelism: each layer's heads and MLP split over the GPUs, "
             "every mode, infer included), pipeline (consecutive decoder layers per GPU: the native backend "
             "trains and infers, one rank per stage; the hf backend runs infer and forward in one process over "
             "the GPUs), replicas (infer and forward: N independent copies, one per GPU, each with its own batch; "
             "tokens/s summed over them) or auto (default: among what fits and composes, the fastest forecast; "
             "without a plan, as on a CPU, DDP first)")
    add("--microbatches", type=int, default=S, metavar="N",
        help="with --strategy pipeline: microbatches of a training step, which must divide the batch (default: "
             "one per GPU)")
    add("--tp", type=int, default=S, metavar="N",
        help="2-D layouts: N tensor-parallel GPUs inside each FSDP group or pipeline stage, N dividing --gpus. "
             "--gpus 4 --strategy fsdp --tp 2: FSDP 2 x TP 2 (training); --gpus 4 --strategy pipeline --tp 2: "
             "2 stages of TP 2 (infer, forward); with --strategy tp, N is --gpus")
    add("--timeout", type=float, default=S, metavar="SECONDS",
        help="a configuration's whole life: its batch probes (--batch-size auto), fallback attempts and run "
             "together; past it the worker and all it started are killed and the row says timeout (default 3600)")
    add("--seed", type=int, default=S, help="seed of the random weights and tokens (default 0)")
    add("--out", default=S, metavar="DIR", help="results directory (default ./fitbench-results/<UTC time>)")
    add("--resume", metavar="DIR", default=None,
        help="continue the sweep in DIR: its saved settings apply, finished configurations are skipped; options "
             "that differ from the saved ones are refused (the difference is shown) unless --extend is given")
    add("--extend", action="store_true",
        help="with --resume: add the models, modes, precisions, batch sizes and sequence lengths given to the "
             "saved sweep (it becomes their product; what it had stays in it)")
    add("--config", metavar="FILE", default=None, help="YAML file with any of these options as keys")
    gpu_hour_price(parser, S, "; saved with the sweep, so that `fitbench report` shows it too")
    analysis_options(S)(parser)
    cluster_options(parser)


def cluster_options(parser: argparse.ArgumentParser) -> None:
    """Running the sweep as SLURM jobs (``fitbench.launch.slurm``); each option but --dry-run is also a
    YAML key."""
    S = argparse.SUPPRESS
    group = parser.add_argument_group("SLURM clusters (docs/clusters.md)")
    add = group.add_argument
    add("--launcher", choices=("local", "slurm"), default=S,
        help="local: each configuration a process of this machine (default); slurm: each a SLURM job that runs "
             "its whole life (batch search, fallbacks) in its allocation, a sweep of several one job array")
    add("--partition", default=S, help="the partition to submit to (default: the cluster's)")
    add("--account", default=S, help="the account charged (default: yours)")
    add("--time", default=S, metavar="LIMIT",
        help="each job's time limit as sbatch takes it: 90 (minutes), 24:00:00, 1-12 (days-hours)")
    add("--nodes", type=int, default=S, metavar="N",
        help="nodes of each configuration's job: one torchrun agent per node started by srun; --gpus N ranks "
             "spread evenly over them (default 1)")
    add("--gpus-per-node", dest="gpus_per_node", type=int, default=S, metavar="N", help="GPUs asked of each node")
    add("--gpu", default=S, metavar="NAME",
        help="the nodes' GPU the jobs are planned for here: H100-80GB, A100-40GB (default: the one the partition's "
             "GRES names, as sinfo lists it)")
    add("--cpus-per-task", dest="cpus_per_task", type=int, default=S, metavar="N",
        help="CPUs asked for each node's task")
    add("--mem", default=S, metavar="SIZE", help="memory per node as sbatch takes it: 256G; 0 is all of it")
    add("--sbatch-arg", dest="sbatch_args", action="append", default=S, metavar="OPTION",
        help="a further sbatch option, one word, repeatable: --sbatch-arg=--qos=high")
    add("--setup", action="append", default=S, metavar="LINE",
        help="a shell line the batch script runs before fitbench, repeatable: --setup 'module load cuda/12.4' "
             "--setup 'source ~/venv/bin/activate'")
    add("--max-concurrent", dest="max_concurrent", type=int, default=S, metavar="N",
        help="jobs of the sweep's array running at once (default: all)")
    add("--inter-node-bandwidth", dest="inter_node_bandwidth", default=S, metavar="RATE",
        help="bandwidth between nodes per GPU, for the planner's collectives that cross nodes: a fabric (ndr, hdr, "
             "100gbe) or a figure with its unit, 400Gb/s or 50GB/s (default: fitbench calibrate's over nodes, else "
             "ndr; hdr for A100)")
    add("--dry-run", dest="dry_run", action="store_true",
        help="print the batch scripts that would be submitted, and submit nothing")


def plan_options(parser: argparse.ArgumentParser) -> None:
    """What ``fitbench plan`` plans and for which GPUs."""
    add = parser.add_argument
    add("--models", nargs="+", required=True, metavar="MODEL", help="presets, local directories or hub ids")
    add("--mode", "--modes", dest="mode", nargs="+", choices=MODES, default=["train"], help="default: train")
    add("--precision", nargs="+", choices=PRECISIONS, default=None, metavar="PRECISION",
        help=f"the precision ladder, in order of preference (default per mode: {default_ladders()})")
    add("--batch-size", dest="batch_size", nargs="+", type=batch_size, default=[1], metavar="N",
        help="batch sizes, or auto for the largest predicted to fit (default 1)")
    add("--seq-len", "--context-length", dest="seq_len", type=int, default=512, metavar="T", help="default 512")
    add("--new-tokens", dest="new_tokens", type=int, default=None, metavar="N",
        help="generated tokens in infer (default 128)")
    add("--strategy", nargs="+", choices=("single", "ddp", "fsdp", "tp", "pipeline", "replicas"), default=None,
        help="limit the layouts considered (default: all that apply to the mode)")
    add("--gpus", type=int, default=None, help="how many GPUs to plan for (default: those detected)")
    add("--gpu-memory", dest="gpu_memory", default=None, metavar="SIZE", help="memory per GPU, e.g. 80GB or 79.2GiB")
    add("--gpu", default=None, metavar="NAME", help="a named GPU, e.g. H100-80GB, A100-40GB, L40S (sets memory and speed)")
    add("--gpus-per-node", dest="gpus_per_node", type=int, default=None, metavar="N",
        help="GPUs of one node of a cluster: tensor parallelism stays inside a node, pipeline stages and data "
             "parallelism cross nodes; --requirements then answers in nodes, and the plan prints its #SBATCH lines "
             "(default 8)")
    add("--nodes", type=int, default=None, metavar="N",
        help="with --gpus-per-node: plan for N nodes, N x --gpus-per-node GPUs (instead of --gpus)")
    add("--inter-node-bandwidth", dest="inter_node_bandwidth", default=None, metavar="RATE",
        help="bandwidth between nodes per GPU, for collectives that cross nodes: a fabric (ndr, hdr, 100gbe) or "
             "a figure with its unit, 400Gb/s or 50GB/s (default: what fitbench calibrate measured over nodes, "
             "else ndr; hdr for A100)")
    add("--backend", choices=("auto", "native", "hf"), default=None,
        help="whose build to predict: native (fitbench's own decoder) or hf (transformers'), as `fitbench run "
             "--backend` runs it (default auto: the family's own, native for Llama, hf for Falcon and GPT-2)")
    add("--trace", action="store_true", help="also trace the chosen plan on fake tensors (exact tensor peak)")
    add("--requirements", action="store_true", help="table of the fewest GPUs each model x precision needs")
    add("--json", action="store_true", help="machine-readable output, sizes in bytes")
    add("--preregister", metavar="FILE", default=None,
        help="also write each chosen configuration's predicted peak and forecast tokens/s to FILE (a new file), "
             "before anything runs; `fitbench report DIR --preregistered FILE` sets them beside what ran")


def json_output(help: str) -> OptionGroup:
    """``--json``: print machine-readable output instead of tables."""
    def group(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help=help)

    return group


def quiet_option(help: str) -> OptionGroup:
    """``--quiet``: no progress display, and only what the command's ``help`` names (for scripts and logs)."""
    def group(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--quiet", "-q", action="store_true", help=help)

    return group


def device_option(help: str) -> OptionGroup:
    """``--device``: the device a command measures, the first GPU by default."""
    def group(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--device", default="auto", help=help)

    return group


def preset_sources(parser: argparse.ArgumentParser) -> None:
    """``--sources``: where the presets' numbers come from."""
    parser.add_argument("--sources", action="store_true", help="print where each preset's numbers come from")


def bus_gpus(parser: argparse.ArgumentParser) -> None:
    """``--gpus`` and ``--nodes`` of calibrate: the GPUs whose collectives it measures."""
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs for the all-reduce's and all-gather's bus bandwidth and latency (default: all "
                             "visible; on --device cpu, that many processes over gloo); with --nodes, per node")
    parser.add_argument("--nodes", type=int, default=None, metavar="N",
                        help="inside a SLURM allocation of N nodes: also measure them between nodes, one torchrun "
                             "agent per node started by srun (default: this node only)")


def results_directory(parser: argparse.ArgumentParser) -> None:
    """The results directories to show, and how."""
    add = parser.add_argument
    add("directories", metavar="DIR", nargs="+",
        help="the --out directory of a fitbench run; several are read together (the HTML page and the workbook "
             "hold the rows of all, each directory's provenance apart)")
    add("--markdown", action="store_true", help="print a Markdown table with provenance (one per DIR)")
    add("--csv", action="store_true", help="also write DIR/results.csv from the rows, as `fitbench run` writes it")


def analysis_options(default=None) -> OptionGroup:
    """``--ollama-url``, ``--ollama-model`` and ``--ollama-timeout``: a written analysis of the rows by a
    model an Ollama server runs (``fitbench.report.analysis``); ``default`` is ``SUPPRESS`` where a YAML
    file may give them (the file's values are checked by ``fitbench.config.SweepConfig``)."""
    def group(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--ollama-url", dest="ollama_url", default=default, metavar="URL",
                            help="an Ollama server that writes a short analysis of the rows into analysis.md and the "
                                 "HTML report, e.g. http://localhost:11434 (default with --ollama-model)")
        parser.add_argument("--ollama-model", dest="ollama_model", default=default, metavar="MODEL",
                            help="the model it runs, e.g. gpt-oss-20b; a server or model that does not answer is a "
                                 "warning, and the report is written without an analysis")
        parser.add_argument("--ollama-timeout", dest="ollama_timeout", type=seconds, default=default,
                            metavar="SECONDS",
                            help="how long the server has for the whole analysis; past it, a warning, and the report "
                                 "is written without it (default 120)")

    return group


def preregistered_option(parser: argparse.ArgumentParser) -> None:
    """``--preregistered FILE``: the forecasts ``fitbench plan --preregister`` wrote, beside what ran."""
    parser.add_argument("--preregistered", metavar="FILE", default=None,
                        help="the file of `fitbench plan --preregister FILE`: each registered configuration's "
                             "forecast beside the row that ran it, with their errors")


def report_documents(parser: argparse.ArgumentParser) -> None:
    """The files ``fitbench report`` writes beside showing the rows."""
    parser.add_argument("--html", metavar="FILE", help="write a self-contained HTML report with plots")
    parser.add_argument("--xlsx", metavar="FILE", help="write an Excel workbook: a sheet per mode, provenance, samples")
    gpu_hour_price(parser, None, "; default: the price the sweep was run with, where it was given one")
    analysis_options()(parser)


def gpu_hour_price(parser: argparse.ArgumentParser, default=None, more: str = "") -> None:
    """``--gpu-hour-price``: the cost of a million tokens in the tables (``default`` is ``SUPPRESS`` where
    a YAML file may give it)."""
    parser.add_argument("--gpu-hour-price", dest="gpu_hour_price", type=price, default=default, metavar="DOLLARS",
                        help="what one GPU costs an hour: adds the cost of a million tokens to every table, page and "
                             f"workbook (price x GPUs / 3600 / tokens/s x 1e6){more}")


def two_sweeps(parser: argparse.ArgumentParser) -> None:
    """The two results directories ``fitbench compare`` compares, and its gate."""
    add = parser.add_argument
    add("a", metavar="A", help="the --out directory of the run compared against (before), or a folder of several "
                               "(paired with B's folder by folder)")
    add("b", metavar="B", help="the --out directory of the run compared (after), or a folder of several")
    add("--fail-on", dest="fail_on", action="append", metavar="FIGURE:PERCENT",
        help="exit 1 when a configuration got worse by more than PERCENT: mean:5%% (the mean time, "
             "slower beyond its noise), memory:5%% (peak memory); or is no longer ok, or is missing from B. "
             "Repeatable: each gate is checked and reported. A comparison of nothing always exits 1")
    add("--match-across", dest="match_across", nargs="+", metavar="OPTION",
        help="pair rows that differ only in these options of a configuration, e.g. precision (A's bf16 "
             "against B's int8) or layout")
    add("--html", metavar="FILE", help="write the comparison as a self-contained HTML page")


def measure_ceilings(parser: argparse.ArgumentParser) -> None:
    """``--measure``: measure this machine's ceilings before showing them."""
    parser.add_argument("--measure", action="store_true",
                        help="measure the matmul and copy ceilings of the device and store them for MFU")


def seconds(text: str) -> float:
    """A positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {excerpt(text)}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive, finite number of seconds, got {excerpt(text)}")
    return value


def price(text: str) -> float:
    """A non-negative, finite price: ``2.49`` or ``$2.49``."""
    try:
        value = float(text.strip().lstrip("$"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a price such as 2.49 (dollars an hour), got {excerpt(text)}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a non-negative, finite price, got {excerpt(text)}")
    return value


def batch_size(text: str) -> int | str:
    """A ``--batch-size`` value: a positive whole number, or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {excerpt(text)}") from None
