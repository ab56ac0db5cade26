"""Measuring a calibration (``fitbench.planning.calibration``) on the GPU at hand: ``tiny`` through the
real worker in each kind of step, and its tensors traced on fake ones; on several GPUs, the bus
bandwidth and the latency of all-reduce and all-gather; over several nodes, the same inside a node
and between nodes."""

from __future__ import annotations

import json
import multiprocessing
import os
import secrets
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from fitbench.launch.local import run_one
from fitbench.launch.slurm.script import TORCHRUN, agent_options
from fitbench.models.registry import resolve
from fitbench.planning.calibration import DEFAULT, Calibration
from fitbench.planning.collectives import BusBandwidth
from fitbench.precisions import DEFAULT_LADDER
from fitbench.worker.collectives import RESULT_PREFIX
from fitbench.worker.trace import trace_peak
from fitbench.spec import Assignment, RunSpec
from fitbench.util.processes import PARENT_VARIABLE, TOKEN_VARIABLE, kill_tree

KIB, MIB = 1024, 1024**2
# Per backend, the small message (latency) and the large one (bandwidth): size, warm-up and timed
# operations. The small one is the size of a decode step's all-reduce at batch 1 (B x h x 2 bytes:
# 10 kB for the 13B, 16 kB for Llama-2-70B); NCCL's bus bandwidth on NVLink levels off from a few
# hundred MB (nccl-tests' curves). gloo on a CPU only has to exercise the code path.
COLLECTIVE_RUNS = {"nccl": ((16 * KIB, 20, 200), (256 * MIB, 5, 20)), "gloo": ((16 * KIB, 5, 20), (4 * MIB, 2, 5))}
# Bytes each rank moves per byte of the message (nccl-tests' bus bandwidth factors, over g ranks).
RING_FACTOR = {"all_reduce": lambda g: 2 * (g - 1) / g, "all_gather": lambda g: (g - 1) / g}


CALIBRATED_MODES = ("train", "infer", "forward")


def measure_calibration(device: str, scratch: Path, gpus: int = 1) -> Calibration:
    """Run ``tiny`` training, generating and a forward pass on ``device`` through the real worker, each in the
    first precision of its mode's default ladder (``DEFAULT_LADDER``: what the planner tries first) and in a
    fresh process, and read off the context and the workspaces (``overheads``). Where the job's own
    ``gpus`` (``device`` and the next ones) give each mode a GPU of the same kind (``calibration_devices``),
    the three run at once, one per GPU: the figures are the GPU kind's, and the first run's wait shrinks
    to one run's. GPUs outside the job are never used: another user's work there would disturb both."""
    devices = calibration_devices(device, gpus)

    def run_mode(mode: str, on: str):
        spec = RunSpec(model="tiny", backend="native", mode=mode, precision=DEFAULT_LADDER[mode][0],
                       batch_size=4, seq_len=256, new_tokens=8, device=on, warmup_steps=2, measure_steps=3)
        # each run's log and NVML timeline in a directory of its own: the three may run at once
        return spec, run_one(Assignment(spec=spec), scratch / mode / f"{mode}.log", timeout=600,
                             on_event=lambda event: None)

    with ThreadPoolExecutor(max_workers=len(set(devices))) as pool:
        runs = list(pool.map(run_mode, CALIBRATED_MODES, devices))
    for spec, row in runs:
        if row.status != "ok":
            raise RuntimeError(f"calibration run {spec.label} ended {row.status}: {row.error}")
        if not row.memory["gpus"][0].get("nvml_peak_used"):
            raise RuntimeError("NVML is unavailable, so the CUDA context cannot be measured")
    tensors = traced_tensor_peaks([spec for spec, _ in runs], device)
    found = {spec.mode: overheads(row.memory["gpus"][0], tensors[spec.mode]) for spec, row in runs}
    measured_at = time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())
    return Calibration(
        cuda_context_training=float(found["train"][0]), cuda_context_inference=float(found["infer"][0]),
        workspace_training=float(found["train"][1]), workspace_inference=float(found["infer"][1]),
        cuda_context_eager=float(found["forward"][0]), workspace_eager=float(found["forward"][1]),
        nccl_per_communicator=DEFAULT.nccl_per_communicator,
        source=f"measured on {torch.cuda.get_device_name(torch.device(device))} with torch {torch.__version__} "
               f"at {measured_at}",
        measured_at=measured_at,
    )


def traced_tensor_peaks(specs: list[RunSpec], device: str) -> dict[str, int]:
    """Each spec's tensor peak traced with fake tensors on ``device`` (``trace_peak``), by mode, traced in a
    child process that ends with it: tracing on a GPU's fake tensors initializes CUDA there, and the
    context it makes (about half a GB) would otherwise stay in this process, on that GPU, beside every
    run of the job that follows."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as child:
        return child.submit(_trace_each, specs, device).result()


def _trace_each(specs: list[RunSpec], device: str) -> dict[str, int]:
    return {spec.mode: trace_peak(resolve(spec.model), spec.mode, spec.precision, spec.batch_size, spec.seq_len,
                                  new_tokens=spec.new_tokens, device=device).peak_bytes for spec in specs}


def calibration_devices(device: str, gpus: int) -> list[str]:
    """The GPU each of ``CALIBRATED_MODES`` runs on: ``cuda:i``, ``cuda:i+1``, ... from ``device``'s index i
    where the job's ``gpus`` from there are that many, all of ``device``'s name, else ``device`` for all,
    one after another (two on one GPU would read each other's memory)."""
    index = int(device.partition(":")[2] or 0)
    wanted = range(index, index + len(CALIBRATED_MODES))
    if len(wanted) <= gpus and wanted.stop <= torch.cuda.device_count() and \
            len({torch.cuda.get_device_name(i) for i in wanted}) == 1:
        return [f"cuda:{i}" for i in wanted]
    return [device] * len(CALIBRATED_MODES)


def overheads(gpu: dict, tensors: float) -> tuple[float, float]:
    """The CUDA context and the workspaces of one kind of step from its row's memory report
    (``memory.gpus[0]``) and its traced tensor peak: the context the larger of
    ``nvml_peak_used`` - ``peak_reserved`` and ``nvml_context_end`` (the process's NVML figure less
    what the allocator reserved, read together as the step ended: ``fitbench.worker.trackers``), the
    workspaces ``peak_allocated`` - ``tensors``.

    Both readings of the context are needed: NVML's peak is sampled (every 50 ms), so the first reads
    short where no sample caught the reserved peak beside the whole context (on one host of 4 H100s,
    torch 2.11: generating read 734 MB in one calibration and 795 MB in the next,
    ``benchmarks/results/2026-11-27-h100x4-vs-one-gpu-2/run.log`` and ``2026-11-27-h100x4-tp-steps/
    calibrate.log``; one rank of four read 732 MB where the others read 795 MB in
    ``benchmarks/results/2026-11-27-h100x4-default-job``), while the kernels a process loads only add to
    its context, so the reading at the end holds all of them."""
    context = gpu["nvml_peak_used"] - gpu["peak_reserved"]
    if gpu.get("nvml_context_end") is not None:
        context = max(context, gpu["nvml_context_end"])
    return float(context), float(gpu["peak_allocated"] - tensors)


def measure_bus_bandwidth(ranks: int, device: str, scratch: Path, timeout_s: float = 300.0) -> BusBandwidth:
    """All-reduce and all-gather bus bandwidth and latency over ``ranks`` processes, one per GPU with NCCL
    (``device`` cuda), or CPU processes over gloo (``device`` cpu, to exercise the path). The ranks run
    ``fitbench.worker.collectives`` at a small and a large message (``COLLECTIVE_RUNS``); ``fit_collective``
    turns the two times into a latency and a bus bandwidth. Every rank has ended when this returns, by
    itself or killed at ``timeout_s`` or on the first that fails."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    sizes, warmups, iterations = zip(*COLLECTIVE_RUNS[backend])
    commands = [[sys.executable, "-m", "fitbench.worker.collectives", "--rank", str(rank), "--world", str(ranks),
                 "--backend", backend, "--scratch", str(scratch), "--timeout", str(timeout_s),
                 "--message-bytes", *map(str, sizes), "--warmup", *map(str, warmups),
                 "--iterations", *map(str, iterations)] for rank in range(ranks)]
    _run_together(commands, [scratch / f"rank{rank}.log" for rank in range(ranks)], None, timeout_s,
                  f"the bus-bandwidth measurement over {ranks} ranks", "rank")
    timed = json.loads((scratch / "collectives.json").read_text())
    g = timed["world"]
    what = f"{g} x {torch.cuda.get_device_name(0)}" if backend == "nccl" else f"{g} CPU processes"
    return fit_level(timed["runs"], g, f"on {what} with {backend}")


def _run_together(commands: list[list[str]], logs: list[Path], outputs: list[Path] | None, timeout_s: float,
                  what: str, one: str) -> None:
    """Start every command at once (each its own session, its standard error into its log, its standard
    output into its file of ``outputs`` or nowhere) and wait for all: until each has ended, one has
    failed or ``timeout_s`` has passed; then end every one left (``kill_tree``). Raises, naming ``what``
    and the first that failed (``one`` and its index) with its log's last lines, unless all ended with 0."""
    token = secrets.token_hex(8)
    environment = {**os.environ, TOKEN_VARIABLE: token, PARENT_VARIABLE: str(os.getpid())}
    processes = []
    try:
        for index, (command, log) in enumerate(zip(commands, logs)):
            with log.open("w") as stderr, (outputs[index].open("w") if outputs else open(os.devnull, "w")) as stdout:
                processes.append(subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                                  env=environment, start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in processes) and all(p.returncode in (None, 0) for p in processes):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{what} did not end in {timeout_s:.0f} s")
            time.sleep(0.1)
    finally:
        for process in processes:
            kill_tree(process.pid, token)
            process.wait()
    failed = [(index, p.returncode) for index, p in enumerate(processes) if p.returncode != 0]
    if failed:
        index, code = failed[0]
        tail = " | ".join(logs[index].read_text(errors="replace").strip().splitlines()[-3:])
        raise RuntimeError(f"{one} {index} of {what} ended with exit status {code}: {tail}")


def fit_level(runs: list[dict], ranks: int, where: str) -> BusBandwidth:
    """The latency and bus bandwidth of all-reduce and all-gather over groups of ``ranks`` from the small
    and the large message's times (``fit_collective``); ``where`` says what was measured."""
    small, large = runs
    fitted = {name: fit_collective(small["message_bytes"], small[f"{name}_s"], large["message_bytes"],
                                   large[f"{name}_s"], RING_FACTOR[name](ranks)) for name in RING_FACTOR}
    measured_at = time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())
    return BusBandwidth(fitted["all_reduce"][1], fitted["all_gather"][1],
                        f"measured {where}, {small['message_bytes'] / KIB:.0f} KiB and "
                        f"{large['message_bytes'] / MIB:.0f} MiB messages, torch {torch.__version__} at {measured_at}",
                        fitted["all_reduce"][0], fitted["all_gather"][0])


def measure_across_nodes(nodes: int, ranks_per_node: int, device: str, scratch: Path, *, endpoint: str,
                         agents: Callable[[list[str]], list[list[str]]],
                         timeout_s: float = 300.0) -> tuple[BusBandwidth | None, BusBandwidth]:
    """All-reduce and all-gather bus bandwidth and latency inside a node and between nodes, over
    ``nodes`` torchrun agents of ``ranks_per_node`` ranks each (one per GPU with NCCL, ``device`` cuda;
    CPU processes over gloo, ``device`` cpu) meeting at a c10d rendezvous at ``endpoint`` (host:port).
    ``agents`` turns one agent's command into the commands that start them all: under SLURM one
    ``srun`` of a task per node (``fitbench.launch.slurm.nodes.srun_agents``); on one host, the command
    once per agent. Each level is timed on its own (``fitbench.worker.collectives``) and fitted as on one
    node (``fit_level``): the level inside a node over its ``ranks_per_node`` ranks (None for one rank a
    node), the level between nodes over ``nodes`` ranks, one per node. Every agent has ended when this
    returns, by itself or killed at ``timeout_s`` or on the first that fails."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    sizes, warmups, iterations = zip(*COLLECTIVE_RUNS[backend])
    agent = [sys.executable, *TORCHRUN, *agent_options(nodes, ranks_per_node), f"--rdzv-endpoint={endpoint}",
             f"--rdzv-id=calibrate-{secrets.token_hex(4)}", "-m", "fitbench.worker.collectives", "--backend", backend,
             "--scratch", str(scratch), "--timeout", str(timeout_s), "--message-bytes", *map(str, sizes),
             "--warmup", *map(str, warmups), "--iterations", *map(str, iterations)]
    commands = agents(agent)
    outputs = [scratch / f"agent{index}.out" for index in range(len(commands))]
    _run_together(commands, [scratch / f"agent{index}.log" for index in range(len(commands))], outputs, timeout_s,
                  f"the measurement over {nodes} nodes", "agent")
    lines = [line for output in outputs for line in output.read_text(errors="replace").splitlines()
             if line.startswith(RESULT_PREFIX)]
    if not lines:
        raise RuntimeError(f"the measurement over {nodes} nodes ended without rank 0's times on its output")
    timed = json.loads(lines[0][len(RESULT_PREFIX):])
    gpu = torch.cuda.get_device_name(0) if backend == "nccl" else "CPU process"
    intra = timed["levels"]["intra"]
    inside = fit_level(intra, ranks_per_node, f"inside a node, {ranks_per_node} x {gpu} with {backend}") \
        if intra else None
    between = fit_level(timed["levels"]["inter"], nodes,
                        f"between {nodes} nodes, one {gpu} each, {ranks_per_node} such groups at once, with {backend}")
    return inside, between


def fit_collective(small_bytes: float, small_s: float, large_bytes: float, large_s: float,
                   factor: float) -> tuple[float, float]:
    """(latency in seconds, bus bandwidth in bytes/s) of ``t = latency + factor x S / B`` through two
    timed messages: B from the slope between them, ``factor (S_large - S_small) / (t_large - t_small)``,
    the latency what the small one took beyond its bytes, ``t_small - factor S_small / B``. The fit is
    exact through both points; where noise leaves no positive slope or latency, the measurement is
    refused rather than stored."""
    if large_s <= small_s:
        raise RuntimeError(f"the {large_bytes:.0f}-byte collective took no longer than the {small_bytes:.0f}-byte "
                           f"one ({large_s:.3g} s against {small_s:.3g} s): too noisy to fit; run it again")
    bandwidth = factor * (large_bytes - small_bytes) / (large_s - small_s)
    latency = small_s - factor * small_bytes / bandwidth
    if latency <= 0:
        raise RuntimeError(f"the {small_bytes:.0f}-byte collective ({small_s:.3g} s) took less than its bytes at the "
                           f"large message's rate: too noisy to fit; run it again")
    return latency, bandwidth


def with_bus_bandwidth(calibration: Calibration, bus: BusBandwidth) -> Calibration:
    return replace(calibration, all_reduce_bus_bandwidth=bus.all_reduce, all_gather_bus_bandwidth=bus.all_gather,
                   all_reduce_latency_s=bus.all_reduce_latency, all_gather_latency_s=bus.all_gather_latency,
                   collectives_source=bus.source)


def with_inter_node(calibration: Calibration, link: BusBandwidth) -> Calibration:
    """``calibration`` with ``link``, measured between nodes (``measure_across_nodes``), as its inter-node figures."""
    return replace(calibration, inter_node_all_reduce_bus_bandwidth=link.all_reduce,
                   inter_node_all_gather_bus_bandwidth=link.all_gather,
                   inter_node_all_reduce_latency_s=link.all_reduce_latency,
                   inter_node_all_gather_latency_s=link.all_gather_latency, inter_node_source=link.source)
