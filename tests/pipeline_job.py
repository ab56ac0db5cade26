"""One rank of a small pipeline-parallel job, for tests/test_pipeline.py; started by torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 3 tests/pipeline_job.py OUT_DIR

``ARCH`` (``tiny`` five layers deep, so that the stages are uneven: on three ranks 2, 2 and 1 layers,
the tied embedding on both ends) is built as one stage per rank from seed ``SEED`` (fp32, on the
CPU, gloo).
The job trains it for ``STEPS`` steps of ``BATCH`` x ``SEQ_LEN`` tokens in ``MICROBATCHES``
microbatches, starts over from the same seed for one forward step, then greedily generates
``NEW_TOKENS`` tokens after a prompt of ``PROMPT`` tokens, twice (the second generation reuses the
cache), the same twice through each stage's static decode step (``fitbench.worker.stage_graph``, replayed
by a stand-in for a CUDA graph), and once more as the worker times it (``PipelineLM.generator``). OUT_DIR/ranks.json gets
every rank's stage and parameter count, the losses, the forward step's logits sum, the tokens and
the timed generation's sums and seconds; OUT_DIR/logits.pt the last stage's logits of every
generated token. Then, for each of ``QUANTIZED`` (those that run on a CPU), the stages are built
quantized (``build_pipelined``, the probe ``probe()``) and generate once: OUT_DIR/quantized.pt
gets the last stage's logits and quality figures by precision.
"""

import dataclasses
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from fitbench.models.graphs import Replay
from fitbench.models.registry import resolve
from fitbench.precisions import policy
from fitbench.worker.loops import random_tokens
from fitbench.worker.loops import read_generation
from fitbench.worker.build import build_pipelined
from fitbench.worker.pipeline import PipelineLM
from fitbench.worker.ranks import Rank, gather_json, process_group
from fitbench.worker.stages import build_stage
from fitbench.worker.timing import DeviceClock
from fitbench.spec import Layout, RunSpec, Stage

ARCH = dataclasses.replace(resolve("tiny"), num_layers=5)
SEED, BATCH, SEQ_LEN, STEPS, MICROBATCHES, PRECISION = 0, 4, 16, 3, 2, "fp32"
PROMPT, NEW_TOKENS, GENERATIONS = 8, 5, 2
QUANTIZED = ("int8-dynamic", "nf4", "int8")
TIMEOUT = timedelta(seconds=60)


def probe() -> torch.Tensor:
    return random_tokens(ARCH.vocab_size, 1, 12, torch.device("cpu"), SEED + 2)


def quantized_stage(rank: Rank, precision: str):
    spec = RunSpec(model="tiny", backend="native", mode="infer", precision=precision, batch_size=2, seq_len=PROMPT,
                   new_tokens=NEW_TOKENS, device="cpu", warmup_steps=0, measure_steps=1,
                   layout=Layout.of_strategy("pipeline", rank.world_size))
    torch.manual_seed(SEED)
    return build_pipelined(spec, ARCH, policy(precision), rank, probe())


def stage(rank: Rank, graphed: bool = False):
    """This rank's stage; ``graphed``: decoding through the stage's static step, "captured" by a
    replay that runs it (a CPU has no CUDA graphs; the step, its buffers and the sends are the same)."""
    torch.manual_seed(SEED)
    stage = Stage.of(ARCH.num_layers, rank.rank, rank.world_size)
    weights = policy(PRECISION).weight_dtype
    graphs = {"cuda_graphs": True, "capture": Replay} if graphed else {}
    return PipelineLM(build_stage(ARCH, stage, rank.device, weights), stage, rank, weights, weights, **graphs)


def generate(lm, prompt: torch.Tensor) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens (on the first and last stages) and the last stage's logits (B, V) of each."""
    tokens, logits = [], []
    with torch.inference_mode():
        out = lm.prefill(prompt, PROMPT + NEW_TOKENS)
        for i in range(NEW_TOKENS):
            token = lm.exchange_token(out, prompt.shape[0])
            if lm.stage.last:
                logits.append(out[:, -1].clone())
            if token is not None:
                tokens.append(token[:, 0].tolist())
            if i < NEW_TOKENS - 1:
                out = lm.decode(token if token is not None else prompt[:, :1])
    return tokens, logits


@record
def main(argv: list[str]) -> None:
    out = Path(argv[0])
    rank = Rank.from_environment("cpu")
    precision = policy(PRECISION)
    with process_group(rank, TIMEOUT):
        lm = stage(rank)
        count = lm.parameter_count()
        on_meta = sum(p.is_meta for p in lm.module.parameters())
        tokens = random_tokens(ARCH.vocab_size, BATCH, SEQ_LEN + 1, rank.device, SEED)
        step = lm.make_step("train", precision, tokens, MICROBATCHES)
        losses = [loss.item() for loss in (step() for _ in range(STEPS)) if loss is not None]

        lm = stage(rank)
        forward = lm.make_step("forward", precision, tokens, MICROBATCHES)()
        prompt = random_tokens(ARCH.vocab_size, 2, PROMPT, rank.device, SEED + 1)
        generations = [generate(lm, prompt) for _ in range(GENERATIONS)]
        graphed = stage(rank, graphed=True)
        graphed_generations = [generate(graphed, prompt) for _ in range(GENERATIONS)]
        clock = DeviceClock(rank.device)
        marks, sums = lm.generator(prompt, NEW_TOKENS, precision, clock, rank.device)()
        timed = read_generation(marks, clock)
        if lm.stage.last:
            torch.save([torch.stack(logits) for _, logits in generations], out / "logits.pt")
            torch.save([torch.stack(logits) for _, logits in graphed_generations], out / "graphed_logits.pt")
        quantized = {}
        for name in QUANTIZED:
            lm, quality = quantized_stage(rank, name)
            _, logits = generate(lm, prompt)
            if lm.stage.last:
                quantized[name] = {"logits": torch.stack(logits), "quality": quality.as_dict()}
            else:
                assert quality is None
        if lm.stage.last:
            torch.save(quantized, out / "quantized.pt")
        rows = gather_json(rank, {"rank": rank.rank, "stage": lm.stage.as_dict(), "params": count,
                                  "meta_params": on_meta, "losses": losses,
                                  "forward_sum": forward.item() if forward is not None else None,
                                  "tokens": [tokens for tokens, _ in generations],
                                  "graphed_tokens": [tokens for tokens, _ in graphed_generations],
                                  "graphed_decoding": graphed.decoding,
                                  "timed": {"sums": [value.item() for value in sums],
                                            "time_to_first_token": timed.time_to_first_token,
                                            "token_latencies": timed.token_latencies}})
        if rank.main:
            (out / "ranks.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
