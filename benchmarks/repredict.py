"""The current planner's prediction for rows already measured: each row's configuration planned again,
against the GPU memory its NVML sampler recorded. Nothing is run on a GPU: this tells how a change to
the planner moves the error on measurements it did not take, and the result is labelled as such. It
holds only for rows measured with the worker as it runs now: a change to what the worker does (the
chunked loss, the packed quantized build) moves the measurement as well, and such rows must be
measured again.

Error = (predicted - measured) / measured, measured = NVML's per-process peak (the largest over a
row's GPUs where it ran on several), as in memory_error.py; the plan is for the row's GPU count.
The calibration is the one the rows were measured with: a calibration.json of fitbench's cache, given
by --calibration (the GPU's entry is taken from it by the rows' device name and torch version; rows of
a GPU and torch it has no entry for keep their own), or else each row's own, read back from its
prediction's terms (its CUDA context and workspaces; NCCL's buffers per communicator as the default has
them).

Rows measured before a change to what the worker holds are listed apart, not counted (``superseded``):
FSDP rows from before the worker returned the cached blocks of the model built whole once the layout is
applied (``EMPTY_CACHE_SINCE``; benchmarks/results/2026-11-27-h100x4-fsdp-memory measured the same
configurations again); training rows from before the fused cross-entropy and the native decoder's own
autograd Functions (``FUSED_TRAINING_SINCE``), and those whose own plan counted the out-of-place
chunked loss, whatever their date (``out_of_place_loss``); compiled training rows of a fused build from before
attention copied v out of the fused projection (``COMPILED_V_COPY_SINCE``); quantized native builds from
before their layers were packed as they were quantized (``PACKED_BUILD_SINCE``).

Out of sample (``--out-of-sample``): the calibration's measured constants, the CUDA context and the
workspaces, are each row's own (read back as above), measured on the row's GPU. Here each row is predicted
again with the medians of those read back from the rows of the other GPU models, of the same kind of step
(training; generation decoded through a CUDA graph; a forward pass or eager decoding), beside its own:
the planner's error where the GPU was never calibrated. The memory model's traced constants
(``fitbench.planning.memory_constants``) stay as they are.

Usage: python benchmarks/repredict.py RESULTS_DIR [--calibration FILE] [--markdown FILE] [--min-gpus N]
                                      [--out-of-sample]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from fitbench.models.hf_cache import kept_under
from fitbench.models.loss import loss_chunk_rows
from fitbench.models.registry import resolve
from fitbench.planning.calibration import DEFAULT, Calibration, calibration_key
from fitbench.planning.planner import GpuTarget, predict_spec
from fitbench.precisions import FLOAT8, TRAINING_MODES, entry
from fitbench.results.store import ResultStore
from fitbench.spec import RunSpec


def calibration_of(prediction: dict) -> Calibration:
    """The calibration a row's prediction used, read back from its terms: its CUDA context and
    workspaces stand for every kind of step (only the row's own is read again)."""
    terms = {term["name"]: term["bytes"] for term in prediction["terms"]}
    context, workspace = terms.get("CUDA context", DEFAULT.cuda_context_training), terms.get("workspaces", 0.0)
    return replace(DEFAULT, cuda_context_training=context, cuda_context_inference=context, cuda_context_eager=context,
                   workspace_training=workspace, workspace_inference=workspace, workspace_eager=workspace,
                   source="read back from the row's prediction")


# The worker calls torch.cuda.empty_cache() once a parallel layout is applied from this commit on
# (4f1bbca): before, a sharded run's steps started beside the cached blocks of the whole model.
EMPTY_CACHE_SINCE = "2026-11-27T07:50:03+00:00"

# From 5e2c62b (2026-11-24T09:31:43) the training loss writes the logits' gradient over the logits, so no
# fp32 copy of them is kept, and from ebb9493, on the same branch (its rows in
# benchmarks/results/2026-11-24-h200-eager-ops were measured from 09:59 on, before it was committed), the
# native decoder's eager layers save what the compiled model saves. The rows before held more: the 1B
# preset, bf16, 8 x 2048 on one H200 measured 52.85 GB before and 38.95 GB after (2026-11-24-h200x2-data-
# parallel/weak-1 against 2026-11-24-h200-engine/vs-transformers/train/1B-native), and the same under DDP
# over 2 GPUs 62.04 GB before and 48.15 GB after (2026-11-27-h100x4-vs-one-gpu/weak/ddp-2): DDP's own
# 9.2 GB is the same in both.
FUSED_TRAINING_SINCE = "2026-11-24T09:31:43+00:00"

# From this commit on, compiled attention copies v out of the fused q, k, v projection (one GPU, DDP, FSDP);
# before, it saved v as a view, which kept the whole output alive: c n (h + k) more per layer that kept its
# activations (fitbench.planning.compiled). The 30B preset's compiled FSDP row of
# benchmarks/results/2026-11-27-h200x4-largest held 7.63 GB more than its eager one, that to the byte.
COMPILED_V_COPY_SINCE = "2026-11-27T18:55:00+00:00"


# From this commit on (7d33362), a quantized build packs each layer's quantized matmuls into one block of a
# private pool as it goes; before, what the build left free sat between the quantized layers, and the
# rows of that build (benchmarks/results/2026-11-22-h100-quantized-decode) peaked higher at "quantizing a
# layer" than the packed build the planner counts now.
PACKED_BUILD_SINCE = "2026-11-23T22:37:33+00:00"


def out_of_place_loss(row: dict, spec: RunSpec) -> bool:
    """Whether a training row's own plan counted the out-of-place chunked loss that came before the fused
    one (5e2c62b), whose forward pass kept every chunk's fp32 log-probabilities: a "loss chain" term of

        4 n V + max(c n V + 4 r V, 8 r V),   n = B x T, r = min(rows, n)

    (``fitbench.models.loss.loss_chain_bytes``'s docstring). A tree's planner and worker change together, so
    such a row ran that loss, whatever its date: the training rows of 2026-11-24-h200-eager-ops ran from
    09:59 on a tree without 5e2c62b, and their plans say so."""
    if spec.mode not in TRAINING_MODES:
        return False
    counted = {term["name"]: term["bytes"] for term in row["prediction"].get("terms", [])}.get("loss chain")
    n, vocab, c = spec.batch_size * spec.seq_len, resolve(spec.model).vocab_size, entry(spec.precision).policy.compute_bytes
    r = min(loss_chunk_rows(vocab), n)
    out_of_place = 4 * n * vocab + max(c * n * vocab + 4 * r * vocab, 8 * r * vocab)
    return counted is not None and abs(counted - out_of_place) <= 1e-6 * out_of_place


def step_kind(row: dict, spec: RunSpec) -> str:
    """Which of the calibration's figures a row's step uses (``Calibration.context``): training, a generation
    decoded through a CUDA graph, or a forward pass and eager decoding."""
    if spec.mode in TRAINING_MODES:
        return "training"
    return "inference" if spec.mode == "infer" and (row.get("decode") or {}).get("cuda_graphs") else "eager"


def out_of_sample_calibration(read_back: list[tuple[str, str, float, float]], gpu: str, kind: str) -> Calibration | None:
    """The medians of the CUDA contexts and workspaces read back from rows of ``kind`` on GPUs other than
    ``gpu`` (``read_back``: (GPU, kind, context, workspace) per row), as a calibration; None where no
    other GPU's row is of that kind."""
    others = [(context, workspace) for name, of, context, workspace in read_back if name != gpu and of == kind]
    if not others:
        return None
    context = statistics.median(c for c, _ in others)
    workspace = statistics.median(w for _, w in others)
    return replace(DEFAULT, cuda_context_training=context, cuda_context_inference=context, cuda_context_eager=context,
                   workspace_training=workspace, workspace_inference=workspace, workspace_eager=workspace,
                   source=f"the medians of {len(others)} rows of other GPUs")


def superseded(row: dict, spec: RunSpec) -> str | None:
    """Why ``row`` measured a worker that no longer runs, or None."""
    if spec.layout.dp_shard > 1 and row.get("started_at", "") < EMPTY_CACHE_SINCE:
        return "FSDP before the worker returned the build's cached blocks"
    if spec.mode in TRAINING_MODES and row.get("started_at", "") < FUSED_TRAINING_SINCE:
        return "training before the fused cross-entropy and the native layers' own autograd Functions"
    if out_of_place_loss(row, spec):
        return "training with the out-of-place chunked loss, as its own plan counted it"
    fused = (spec.backend == "native" and spec.layout.tp == 1 and spec.layout.pp == 1
             and not entry(spec.precision).quantized and entry(spec.precision).training != FLOAT8)
    kept = not spec.activation_checkpointing or spec.checkpointed_layers is not None  # a layer kept its activations
    if spec.compile and spec.mode in TRAINING_MODES and fused and kept and \
            row.get("started_at", "") < COMPILED_V_COPY_SINCE:
        return "compiled training before attention copied v out of the fused q, k, v projection"
    if spec.backend == "native" and entry(spec.precision).quantized and row.get("started_at", "") < PACKED_BUILD_SINCE:
        return "a quantized build before its layers were packed into one block as they were quantized"
    return None


def out_of_sample(counted: list[tuple[dict, RunSpec, GpuTarget, str, float]], errors: list[float]) -> list[str]:
    """Each counted row predicted with the calibration of the other GPUs' rows (``out_of_sample_calibration``),
    its error beside the in-sample one (``errors``, in the same order): the lines of a table per GPU."""
    read_back = []
    for row, spec, _, gpu, _ in counted:
        own = calibration_of(row["prediction"])
        read_back.append((gpu, step_kind(row, spec), own.cuda_context_training, own.workspace_training))
    inside: dict[str, list[float]] = {}
    outside: dict[str, list[float]] = {}
    for (row, spec, target, gpu, measured), error in zip(counted, errors):
        calibration = out_of_sample_calibration(read_back, gpu, step_kind(row, spec))
        if calibration is None:
            continue
        with kept_under(row["environment"].get("transformers")):
            _, prediction = predict_spec(resolve(spec.model), spec, target, calibration, choose_precision=False,
                                         choose_recompute=False, runnable=(spec.precision,))
        inside.setdefault(gpu, []).append(error)
        outside.setdefault(gpu, []).append((prediction["predicted_peak_bytes"] - measured) / measured)

    def summary(values: list[float]) -> str:
        return f"{statistics.median(abs(e) for e in values):.2%} median |error|, worst {max(values, key=abs):+.2%}"

    lines = ["Out of sample: each GPU's rows with the CUDA context and workspaces of the other GPUs' rows", "",
             "| GPU | rows | own calibration | other GPUs' calibration |", "|---|---|---|---|"]
    lines += [f"| {gpu} | {len(inside[gpu])} | {summary(inside[gpu])} | {summary(outside[gpu])} |" for gpu in inside]
    every_in = [e for values in inside.values() for e in values]
    every_out = [e for values in outside.values() for e in values]
    if every_in:
        lines.append(f"| all | {len(every_in)} | {summary(every_in)} | {summary(every_out)} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--calibration", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--min-gpus", type=int, default=1, metavar="N",
                        help="only rows whose layout spans at least N GPUs (2: the several-GPU rows)")
    parser.add_argument("--out-of-sample", action="store_true",
                        help="also predict each row with the calibration read back from the other GPUs' rows")
    args = parser.parse_args()
    stored = json.loads(args.calibration.read_text()) if args.calibration else None
    lines = ["| configuration | measured | predicted then | predicted now | error then | error now | peak moment now |",
             "|---|---|---|---|---|---|---|"]
    errors, apart = [], []
    counted: list[tuple[dict, RunSpec, GpuTarget, str, float]] = []  # for --out-of-sample
    for sweep in sorted({path.parent for path in args.directory.rglob("results.jsonl")}, key=str):
        for row in ResultStore(sweep).rows():
            gpus = (row.get("memory") or {}).get("gpus") or []
            if row["status"] != "ok" or not gpus or not row.get("prediction"):
                continue
            environment = row["environment"]
            gpu = environment["gpus"][0]
            spec = RunSpec.model_validate(row["spec"])
            if spec.layout.world_size < args.min_gpus:
                continue
            reason = superseded(row, spec)
            if reason:
                apart.append(f"| {row['label']} | {sweep} | {reason} |")
                continue
            entry = (stored or {}).get(calibration_key(gpu["name"], environment["torch"]))
            calibration = Calibration(**entry) if entry else calibration_of(row["prediction"])
            target = GpuTarget(gpu["name"], spec.layout.world_size, gpu["total_memory"], described=False)
            with kept_under(environment.get("transformers")):  # the cache the row's transformers kept
                _, prediction = predict_spec(resolve(spec.model), spec, target, calibration, choose_precision=False,
                                             choose_recompute=False, runnable=(spec.precision,))
            measured = max(gpu["nvml_peak_used"] for gpu in gpus)
            counted.append((row, spec, target, gpu["name"], measured))
            then, now = row["prediction"]["predicted_peak_bytes"], prediction["predicted_peak_bytes"]
            errors.append((now - measured) / measured)
            lines.append(f"| {row['label']} | {measured / 1e9:.2f} GB | {then / 1e9:.2f} GB | {now / 1e9:.2f} GB | "
                         f"{(then - measured) / measured:+.1%} | {errors[-1]:+.1%} | {prediction['peak_moment']} |")
    lines += ["", f"- rows: {len(errors)}"]
    if errors:
        lines += [f"- median |error| now: {statistics.median(abs(e) for e in errors):.2%}",
                  f"- worst |error| now: {max(abs(e) for e in errors):.2%}",
                  f"- largest under-prediction now: {min(errors):+.2%}"]
    if args.out_of_sample and errors:
        lines += ["", *out_of_sample(counted, errors)]
    if apart:
        lines += ["", "Listed apart, not counted:", "", "| configuration | directory | why |", "|---|---|---|", *apart]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    main()
