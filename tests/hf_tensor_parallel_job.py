"""One rank of a small tensor-parallel job of the hf backend, for tests/test_hf_parallel.py; started by
torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/hf_tensor_parallel_job.py OUT.json

Two CPU ranks (gloo). ``tiny`` built by transformers (``LlamaForCausalLM``, GQA, tied embeddings) is
sharded with transformers' own plan (``fitbench.worker.hf_tensor_parallel``, applied by
``fitbench.worker.parallelize``): one forward and backward pass (the loss and a sample of a few
gradients), a generation (the prefill's logits and ``DECODE`` decode steps through the ``StaticCache``), then ``STEPS`` training steps. Every rank builds from its
own seed: the weights must come from rank 0. Rank 0 writes every rank's figures to OUT.json.
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from fitbench.models.backends import HuggingFaceLM, load_model
from fitbench.models.registry import resolve
from fitbench.precisions import policy
from fitbench.worker.cross_entropy import cross_entropy
from fitbench.worker.loops import make_step, random_tokens
from fitbench.worker.parallelize import parallelize
from fitbench.worker.ranks import Rank, gather_json, process_group
from fitbench.spec import Layout

SEED, BATCH, SEQ_LEN, STEPS, PRECISION = 0, 2, 16, 2, "fp32"
PROMPT, DECODE = 12, 4
LAYOUT = Layout(tp=2)
ARCH = resolve("tiny")
# gradients sampled: a column-wise matrix, a row-wise one, a replicated norm and the tied embedding
GRADIENTS = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
             "model.layers.0.input_layernorm.weight", "model.embed_tokens.weight")
SAMPLE = 101  # every SAMPLE-th element of a gradient or a row of logits
TIMEOUT = timedelta(seconds=60)


def sample(tensor: torch.Tensor) -> list[float]:
    whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return whole.detach().float().flatten()[::SAMPLE].tolist()


def built(rank: Rank, mode: str) -> HuggingFaceLM:
    """Rank 0's model is the reference's (seed ``SEED``); the other's differs, so a rank that kept its
    own weights would show."""
    torch.manual_seed(SEED if rank.main else SEED + 1 + rank.rank)
    lm = load_model(ARCH, "hf", rank.device, policy(PRECISION).weight_dtype)
    parallelize(lm, LAYOUT, policy(PRECISION), rank)
    return lm


def training_pass(rank: Rank) -> dict:
    lm = built(rank, "forward-backward")
    tokens = random_tokens(ARCH.vocab_size, BATCH, SEQ_LEN + 1, rank.device, SEED)
    loss = cross_entropy(lm.logits(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    parameters = dict(lm.module.named_parameters())
    return {"loss": loss.item(), "gradients": {name: sample(parameters[name].grad) for name in GRADIENTS},
            "loss_function": type(loss.grad_fn).__name__}


def generation(rank: Rank) -> dict:
    lm = built(rank, "infer")
    prompt = random_tokens(ARCH.vocab_size, BATCH, PROMPT, rank.device, SEED + 1)
    following = random_tokens(ARCH.vocab_size, BATCH, DECODE, rank.device, SEED + 2)
    with torch.inference_mode():
        logits = [lm.prefill(prompt, PROMPT + DECODE)]
        logits += [lm.decode(following[:, i:i + 1]) for i in range(DECODE)]
    return {"logits": [sample(step) for step in logits], "cache_kv_heads": lm.cache.layers[0].keys.shape[1]}


def training_losses(rank: Rank) -> list[float]:
    lm = built(rank, "train")
    tokens = random_tokens(ARCH.vocab_size, BATCH, SEQ_LEN + 1, rank.device, SEED)
    step = make_step("train", lm, policy(PRECISION), tokens, rank.device)
    return [step().item() for _ in range(STEPS)]


@record
def main(argv: list[str]) -> None:
    out = Path(argv[0])
    rank = Rank.from_environment("cpu")
    with process_group(rank, TIMEOUT):
        figures = {"train": training_pass(rank), "infer": generation(rank), "losses": training_losses(rank)}
        rows = gather_json(rank, {"rank": rank.rank, **figures})
        if rank.main:
            out.write_text(json.dumps(rows))
    # Every figure is on disk and the process group is gone. Under torch 2.11 a gloo thread that
    # transformers' tensor parallelism started can still be alive at the interpreter's teardown, whose
    # C++ destructors then abort the rank now and then: leave without them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
