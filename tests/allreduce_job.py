"""One rank of a job that all-reduces over gloo on CPUs, for tests of several nodes; started by torchrun:

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d ... \
        tests/allreduce_job.py OUT.json

Each rank contributes its rank + 1; rank 0 writes the sum, the world size and, for every rank, its
torchrun node rank and its SLURM node (None outside SLURM) to OUT.json.
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
ranks = [None] * dist.get_world_size()
dist.all_gather_object(ranks, {"rank": dist.get_rank(), "node_rank": int(os.environ["GROUP_RANK"]),
                               "slurm_node": os.environ.get("SLURMD_NODENAME")})
if dist.get_rank() == 0:
    Path(sys.argv[1]).write_text(json.dumps({"sum": total.item(), "world_size": dist.get_world_size(),
                                             "ranks": ranks}))
dist.destroy_process_group()
