"""One rank of a small data-parallel job, for tests/test_parallel.py; started by torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/data_parallel_job.py OUT.json [FAIL_RANK]

Every configuration of ``CONFIGURATIONS`` trains ``tiny`` (fp32, on the CPU, gloo) for ``STEPS``
steps of ``BATCH`` x ``SEQ_LEN`` tokens per rank from seed ``SEED``; rank 0 writes every rank's
losses, and what ``parallelize`` applied, to OUT.json. Then, with FAIL_RANK, the first
configuration trains once more and that rank raises in its second step, while the others wait in
that step's gradient all-reduce (one job for both saves the seconds a job takes to start).
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from fitbench.models.backends import load_model
from fitbench.models.registry import resolve
from fitbench.precisions import policy
from fitbench.worker.loops import make_step, random_tokens
from fitbench.worker.parallel import data_seed
from fitbench.worker.parallelize import parallelize
from fitbench.worker.ranks import Rank, gather_json, process_group
from fitbench.spec import Layout

SEED, BATCH, SEQ_LEN, STEPS, PRECISION = 0, 2, 32, 3, "fp32"
# (name, strategy, options of parallelize)
CONFIGURATIONS = [
    ("ddp", "ddp", {}),
    ("fsdp", "fsdp", {}),
    ("ddp+checkpointing", "ddp", {"activation_checkpointing": True}),
    ("fsdp+checkpointing+offload", "fsdp", {"activation_checkpointing": True, "offload": True}),
    ("fsdp+2-checkpointed-layers", "fsdp", {"activation_checkpointing": True, "checkpointed_layers": 2}),
]
TIMEOUT = timedelta(seconds=10)


def train(rank: Rank, strategy: str, options: dict, fail: bool) -> tuple[list[float], dict]:
    arch, precision = resolve("tiny"), policy(PRECISION)
    torch.manual_seed(SEED + rank.rank)  # a different seed per rank: the weights must come from rank 0
    lm = load_model(arch, "native", rank.device, precision.weight_dtype)
    applied = parallelize(lm, Layout.of_strategy(strategy, rank.world_size), precision, rank, **options)
    tokens = random_tokens(arch.vocab_size, BATCH, SEQ_LEN + 1, rank.device, data_seed(SEED, rank.rank))
    step = make_step("train", lm, precision, tokens, rank.device)
    losses = []
    for i in range(STEPS):
        if fail and i == 1:
            raise RuntimeError(f"injected failure in rank {rank.rank} at step {i + 1}")
        losses.append(step().item())
    return losses, applied


@record
def main(argv: list[str]) -> None:
    out = Path(argv[0])
    fail_rank = int(argv[1]) if len(argv) > 1 else None
    rank = Rank.from_environment("cpu")
    with process_group(rank, TIMEOUT):
        results = {}
        for name, strategy, options in CONFIGURATIONS:
            losses, applied = train(rank, strategy, options, fail=False)
            rows = gather_json(rank, {"rank": rank.rank, "losses": losses, "applied": applied})
            if rank.main:
                results[name] = rows
        if rank.main:
            out.write_text(json.dumps(results))
        if fail_rank is not None:
            _, strategy, options = CONFIGURATIONS[0]
            train(rank, strategy, options, fail=rank.rank == fail_rank)


if __name__ == "__main__":
    main(sys.argv[1:])
