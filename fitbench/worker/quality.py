"""How far quantized weights move a model from its bf16 self, in figures that mean something on any
weights, random ones included.

- **Per-matmul error.** For each quantized matmul, on the input it receives in the bf16 model on
  the probe sequence: ``||Q(x) - W x|| / ||W x||``, Frobenius norms over every position, where
  ``W x`` is the bf16 layer's output (bias included; the quantized layer keeps the same bias) and
  ``Q(x)`` the quantized layer's output on the same ``x``. Each matmul sees the inputs the bf16
  model gives it, so errors do not compound through the layers and the figure is the method's own
  (the layer-wise objective ``||W X - Q(W) X||`` of GPTQ, Frantar et al. 2023, on a layer's inputs).
  Summarised as the mean and the worst over the model's quantized matmuls, with the worst one named.
- **Next-token agreement.** Over the probe's positions, the fraction where the quantized model's
  most likely next token is the bf16 model's.
- **KL divergence.** ``KL(p_bf16 || p_quant) = sum_v p_bf16(v) (log p_bf16(v) - log p_quant(v))``
  of the two next-token distributions (softmax of the final logits, in fp32), in nats, the mean
  over the probe's positions: the information lost per token by sampling from the quantized model.
- **Perplexity,** when the weights come from a checkpoint: ``exp(-1/(N-1) sum_{i>0} log p(t_i | t_<i))``
  over the ``N`` tokens of a short public-domain text shipped with fitbench (``fitbench/data``),
  tokenized by the checkpoint's own tokenizer, for the bf16 and the quantized model. On random
  weights a text has no meaning, so there is none.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

REFERENCE_TEXT = "gettysburg.txt"
REFERENCE_TEXT_NAME = "Gettysburg Address (Lincoln 1863, Bliss copy)"


@dataclass(frozen=True)
class MatmulError:
    mean: float | None  # of ||Q(x) - W x|| / ||W x|| over the quantized matmuls; None when there are none
    worst: float | None
    worst_matmul: str | None  # its module name, e.g. model.layers.3.mlp.down_proj
    count: int


@dataclass(frozen=True)
class Perplexity:
    text: str
    tokens: int
    bf16: float
    quantized: float


@dataclass(frozen=True)
class Quality:
    matmul_error: MatmulError
    top1_agreement: float
    kl_divergence: float  # nats per position
    probe_tokens: int
    # a checkpoint's perplexities; the reason there are none when it has no tokenizer; None on random weights
    perplexity: Perplexity | str | None
    reference: str

    def as_dict(self) -> dict:
        return asdict(self)


# ---- per-matmul error ----------------------------------------------------------------------------

Record = dict[str, list[tuple[torch.Tensor, torch.Tensor]]]


@contextlib.contextmanager
def recorded_matmuls(linears: dict[str, nn.Module],
                     keep: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> Iterator[Record]:
    """Within the block, every call of each named matmul appends its (input, output), passed through
    ``keep`` (e.g. a copy to host memory), to the yielded record under its name."""
    record: Record = {name: [] for name in linears}
    handles = []
    for name, linear in linears.items():
        def hook(module, args, output, name=name) -> None:
            record[name].append((keep(args[0].detach()), keep(output.detach())))
        handles.append(linear.register_forward_hook(hook))
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def matmul_errors(record: Record, quantized: dict[str, nn.Module], device: torch.device) -> dict[str, float]:
    """``||Q(x) - W x|| / ||W x||`` per matmul: each recorded input run through the quantized matmul of
    the same name, against the recorded bf16 output (all of a matmul's calls together)."""
    errors = {}
    for name, calls in record.items():
        difference = reference = 0.0
        for x, y in calls:
            output = quantized[name](x.to(device)).float()
            y = y.to(device).float()
            difference += (output - y).pow(2).sum().item()
            reference += y.pow(2).sum().item()
        errors[name] = math.sqrt(difference) / math.sqrt(reference) if reference else math.nan
    return errors


def summarise(errors: dict[str, float]) -> MatmulError:
    """Mean and worst (NaN counts as worst: it is what a reader must see)."""
    if not errors:
        return MatmulError(None, None, None, 0)
    worst = max(errors, key=lambda name: math.inf if math.isnan(errors[name]) else errors[name])
    return MatmulError(sum(errors.values()) / len(errors), errors[worst], worst, len(errors))


# ---- final logits --------------------------------------------------------------------------------


def top1_agreement(quantized: torch.Tensor, reference: torch.Tensor) -> float:
    """Fraction of positions of logits (..., V) where both argmaxes agree."""
    return (quantized.argmax(-1) == reference.argmax(-1)).float().mean().item()


KL_CHUNK = 8  # positions at a time: float64 (V,) rows of a 128k vocabulary are 1 MB each


def kl_divergence(quantized: torch.Tensor, reference: torch.Tensor) -> float:
    """Mean over positions of KL(softmax(reference) || softmax(quantized)), in nats, from logits (..., V).
    In float64: the divergence of two close distributions is a sum of small differences of logs near
    -log V, which fp32 resolves to about 0.1% (measured on tiny int8: 2.302e-5 against 2.308e-5)."""
    vocab = reference.shape[-1]
    total = 0.0
    for q, r in zip(quantized.reshape(-1, vocab).split(KL_CHUNK), reference.reshape(-1, vocab).split(KL_CHUNK)):
        log_p = F.log_softmax(r.double(), dim=-1)
        log_q = F.log_softmax(q.double(), dim=-1)
        total += (log_p.exp() * (log_p - log_q)).sum().item()
    return total / (reference.numel() // vocab)


# ---- perplexity on the shipped text --------------------------------------------------------------


def reference_text() -> str:
    """The shipped text without its header (the lines starting with ``#`` that say where it comes from)."""
    raw = resources.files("fitbench").joinpath("data", REFERENCE_TEXT).read_text(encoding="utf-8")
    return "\n".join(line for line in raw.splitlines() if not line.startswith("#")).strip()


class NoTokenizer(Exception):
    """The checkpoint directory has no tokenizer that transformers can load."""


# The files a tokenizer that transformers loads is saved in: a fast tokenizer's, SentencePiece's model,
# GPT-2's byte-pair vocabulary
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def tokenize_reference_text(directory: str | Path, vocab_size: int, max_tokens: int) -> list[int]:
    """The shipped text in the token ids of the tokenizer in ``directory`` (offline; special tokens
    such as a leading BOS as the tokenizer adds them), cut to the model's ``max_tokens`` positions."""
    from transformers import AutoTokenizer

    if not any((Path(directory) / name).is_file() for name in TOKENIZER_FILES):
        raise NoTokenizer(f"no tokenizer in {directory}: none of {', '.join(TOKENIZER_FILES)}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise NoTokenizer(f"no tokenizer in {directory} that transformers can load ({first})") from None
    ids = list(tokenizer(reference_text())["input_ids"])[:max_tokens]
    if len(ids) < 2:
        raise NoTokenizer(f"the tokenizer in {directory} gives {len(ids)} token(s) for the text")
    if max(ids) >= vocab_size:
        raise NoTokenizer(f"the tokenizer in {directory} gives token id {max(ids)}, beyond the model's "
                          f"{vocab_size}-token vocabulary")
    return ids


def perplexity(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    """exp of the mean negative log-likelihood of tokens[1:] given logits[:-1]; logits (1, N, V), tokens (1, N)."""
    nll = F.cross_entropy(logits[0, :-1].float(), tokens[0, 1:])
    return nll.exp().item()
