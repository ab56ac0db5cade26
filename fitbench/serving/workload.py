"""What a serving benchmark sends: each request's prompt and output length, and when it is sent.

- **Lengths** are given (``128``) or drawn (``uniform:64:256``, each length equally likely between the
  bounds, inclusive), from a generator seeded with ``--seed``, so that two runs send the same requests.
- **Prompts** are token ids (``ids``: ``prompt_tokens`` ids drawn below ``ID_RANGE``, which every
  tokenizer of a preset has, for servers that take a list of ids, as vLLM's and SGLang's do) or text
  (``text``: words of the Gettysburg Address, one word per prompt token asked; the server's tokenizer
  decides the tokens, which the row takes from the server's ``usage`` where it reports one).
- **Arrivals**: at a request rate of r per second, a Poisson process: the gaps between sends are
  exponential with mean 1/r (the arrival model of vLLM's ``vllm bench serve`` and of queueing theory's
  M/x/x servers); at rate ``inf`` every request is sent at once. At a fixed concurrency c there are no
  arrival times: c clients each send their next request when their last one ends (a closed loop).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from importlib import resources

from fitbench.util.errors import UserError, excerpt

# Below the vocabulary of every preset (the smallest, tiny's, has 4,096 ids), above the special ids
# tokenizers put first.
ID_RANGE = (100, 4000)
PROMPT_FORMATS = ("ids", "text")


@dataclass(frozen=True)
class Lengths:
    """A length given (``low == high``) or drawn uniformly from ``low`` to ``high`` inclusive."""

    low: int
    high: int

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2

    def text(self) -> str:
        return str(self.low) if self.low == self.high else f"uniform:{self.low}:{self.high}"

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


def parse_lengths(text: str, field: str) -> Lengths:
    """``128`` or ``uniform:64:256``; a UserError naming ``field`` otherwise."""
    match = re.fullmatch(r"\s*(?:(\d+)|uniform:(\d+):(\d+))\s*", text)
    if match and match.group(1):
        low = high = int(match.group(1))
    elif match:
        low, high = int(match.group(2)), int(match.group(3))
    else:
        raise UserError(f"{field}: {excerpt(text)} is not a length; give a number of tokens (128) or a range to "
                        f"draw from (uniform:64:256).")
    if low < 1 or high < low:
        raise UserError(f"{field}: {excerpt(text)} is not a length; lengths are at least 1, and a range's first "
                        f"bound is at most its second (uniform:64:256).")
    return Lengths(low, high)


@dataclass(frozen=True)
class Request:
    """One request: its place in the run, its prompt (ids or text), the prompt tokens asked, the output
    tokens asked (``max_tokens``) and, at a request rate, its send time in seconds after the start."""

    index: int
    prompt: list[int] | str
    prompt_tokens: int
    output_tokens: int
    send_at: float


def _words() -> list[str]:
    return resources.files("fitbench").joinpath("data/gettysburg.txt").read_text().split()


def requests(count: int, prompt: Lengths, output: Lengths, prompt_format: str, rate: float | None,
             seed: int) -> list[Request]:
    """``count`` requests, the same for the same arguments: lengths drawn first, then prompts, then
    arrival gaps (exponential of mean 1/``rate``; all at 0 for ``inf`` or a concurrency, ``rate`` None)."""
    rng = random.Random(seed)
    words = _words()
    sizes = [(prompt.draw(rng), output.draw(rng)) for _ in range(count)]
    made, clock = [], 0.0
    for index, (prompt_tokens, output_tokens) in enumerate(sizes):
        if prompt_format == "ids":
            body: list[int] | str = [rng.randrange(*ID_RANGE) for _ in range(prompt_tokens)]
        else:
            start = rng.randrange(len(words))
            body = " ".join(words[(start + i) % len(words)] for i in range(prompt_tokens))
        if rate is not None and not math.isinf(rate) and index:
            clock += rng.expovariate(rate)
        made.append(Request(index, body, prompt_tokens, output_tokens, clock))
    return made
