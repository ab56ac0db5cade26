"""The four workloads: what one timed step does in each mode.

- ``train``: zero gradients, forward, cross-entropy loss in fp32, backward, AdamW step. The loss
  (``fitbench.worker.cross_entropy``) works a chunk of rows at a time and leaves the logits' gradient
  in their place, so no fp32 copy of the logits is ever kept.
- ``forward-backward``: the same without the optimizer step (CS336's "backward" pass type).
- ``forward``: logits only, under ``inference_mode``.
- ``infer``: a generation: prefill of the prompt (which yields the first token), then
  ``new_tokens - 1`` decode steps through the KV cache, greedy. Each starts from an idle device, as
  a request does: the time to first token covers the host's launch work of the prefill as well
  as the device's, while each decode step's latency is steady-state device time.

Each step also returns, as a device scalar left unread, what ``fitbench.worker.sanity`` checks once
the measured stage has synchronized: the loss, or the fp32 sum of the logits (a generation: of the
prefill's and of the last decode step's logits). The forward step's sum reads its logits once more
inside the timed step (on a GPU without an fp32 copy: the reduction accumulates 16-bit inputs in fp32).

Inputs are random token ids of shape (batch, seq_len); targets are the inputs shifted by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fitbench.models.backends import CausalLM
from fitbench.precisions import PrecisionPolicy
from fitbench.worker.cross_entropy import cross_entropy
from fitbench.worker.timing import DeviceClock

LEARNING_RATE = 1e-5


def random_tokens(vocab: int, batch: int, length: int, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=generator).to(device)


def make_step(mode: str, lm: CausalLM, policy: PrecisionPolicy, tokens: torch.Tensor,
              device: torch.device) -> Callable[[], torch.Tensor]:
    """The step function of a training-style mode over ``tokens`` of shape (B, T + 1); a step returns
    its loss, or for ``forward`` the fp32 sum of its logits."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if mode == "forward":
        def forward() -> torch.Tensor:
            with torch.inference_mode(), policy.autocast(device.type):
                return lm.logits(inputs).sum(dtype=torch.float32)
        return forward

    parameters = [p for p in lm.module.parameters() if p.requires_grad]
    # Fused AdamW (CUDA and CPU) updates in place with no full-size temporaries, so the step's
    # memory is weights + gradients + the two moments and nothing more. It updates a parameter group
    # in one call, which takes DTensors or plain tensors, not both: under tensor parallelism that
    # leaves some weights whole (transformers' plans keep the norms plain), each kind is a group.
    groups = [[p for p in parameters if hasattr(p, "to_local") == sharded] for sharded in (False, True)]
    optimizer = torch.optim.AdamW([{"params": group} for group in groups if group], lr=LEARNING_RATE,
                                  fused=True) if mode == "train" else None
    scaler = torch.amp.GradScaler(device.type) if policy.scale_loss else None

    def forward_loss() -> torch.Tensor:
        # the loss writes the logits' gradient over them: nothing but the loss may hold them
        with policy.autocast(device.type):
            return cross_entropy(lm.logits(inputs).flatten(0, 1), targets.flatten())  # (B T, V)

    def loss_backward() -> torch.Tensor:
        loss = forward_loss()
        (scaler.scale(loss) if scaler else loss).backward()
        return loss.detach()

    def forward_backward() -> torch.Tensor:
        lm.module.zero_grad(set_to_none=True)
        return loss_backward()

    def train() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_backward()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        return loss

    return train if mode == "train" else forward_backward


@dataclass(frozen=True)
class Generation:
    """Seconds of one generation, from the device's own clock."""

    time_to_first_token: float  # from an idle device, the prefill's launch and work through the first token
    token_latencies: list[float]  # each decode step after the first token
    end_to_end: float


def generate(lm: CausalLM, prompt: torch.Tensor, new_tokens: int, policy: PrecisionPolicy,
             clock: DeviceClock, device: torch.device) -> Callable[[], tuple[list, list]]:
    """A function that runs one greedy generation and returns its marks, to be read after a synchronize,
    and the fp32 sums of its prefill's and last decode step's logits, summed after the last mark.

    It waits for the device to be idle before its first mark. Otherwise a generation's first mark
    would sit in a queue behind the last one's work while the host launched the prefill ahead, and
    the launch would never show. From idle, the mark is stamped at once and the prefill's kernels
    run as the host launches them, so the time to first token is what a request sees. The decode
    steps follow with no synchronization: their latencies are steady-state device time."""
    max_len = prompt.shape[1] + new_tokens

    def run() -> tuple[list, list]:
        with torch.inference_mode(), policy.autocast(device.type):
            clock.synchronize()
            marks = [clock.mark()]
            first = logits = lm.prefill(prompt, max_len)  # (B, V)
            token = first.argmax(dim=-1, keepdim=True)  # (B, 1)
            marks.append(clock.mark())
            for _ in range(new_tokens - 1):
                # the argmax is queued before the next decode, which may overwrite the logits (a graph's output)
                logits = lm.decode(token)
                token = logits.argmax(dim=-1, keepdim=True)
                marks.append(clock.mark())
            # after the last mark, so the timed steps stay as they were; the prefill's (B, V) logits
            # wait for it, a row of logits per sequence beside the cache
            sums = [first.sum(dtype=torch.float32), logits.sum(dtype=torch.float32)]
        return marks, sums

    return run


def read_generation(marks: list, clock: DeviceClock) -> Generation:
    steps = [clock.seconds(a, b) for a, b in zip(marks[1:], marks[2:])]
    return Generation(
        time_to_first_token=clock.seconds(marks[0], marks[1]),
        token_latencies=steps,
        end_to_end=clock.seconds(marks[0], marks[-1]),
    )
