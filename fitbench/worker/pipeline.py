"""Pipeline parallelism of the native model: each rank holds one stage, a run of consecutive decoder
layers (``fitbench.spec.pipeline_stages``, the split the planner predicts), the first stage also the
embedding and the last the final norm and output projection.

A stage is built from the meta device: only its own modules get storage, on its own device, so no
rank ever holds the whole model. Its weights are those the single-process build of the same seed
draws (``build_stage``), so that a pipelined run and a single-process run measure the same model.

- Training (``train``, ``forward-backward``) runs through ``torch.distributed.pipelining``: a
  ``PipelineStage`` per rank and ``ScheduleGPipe`` over ``microbatches`` microbatches; the last stage
  forms each microbatch's loss with the chunked cross-entropy of ``fitbench.worker.loops``, and the
  schedule divides the gradients by the microbatch count, so the step's gradients are those of the
  mean loss over the whole batch. A tied output projection is a second copy of the embedding on
  the last stage; the two copies' gradients are summed between the first and last stages before
  the optimizer steps, as Megatron-LM does, so the copies stay equal.
- ``forward`` and generation pass hidden states from stage to stage with point-to-point sends.
  In generation each stage keeps the KV cache of its own layers only; the last stage chooses each
  token (greedy) and sends it back to the first, which embeds it for the next decode step.

With tensor parallelism inside the stages (``Layout(pp=S, tp=T)``, inference and ``forward``),
the mesh is ("pp", "tp"), tp innermost: global rank r holds stage r // T, as tensor-parallel rank
r % T of it, its shards built as ``fitbench.worker.build.build_tensor_parallel`` builds them
(only the stage's modules). The hidden states are whole on every tensor-parallel rank after a
layer's row-wise all-reduce, so rank (s, t) sends them to (s + 1, t), and the last stage's rank
(S - 1, t) sends the token back to (0, t); each rank caches its own kv heads of its stage's layers.

Timing of a generation is the job's, taken on the last stage: every stage leaves a barrier
together and marks its start, and the last stage's marks fall where each token exists, so its
time to first token spans every stage's prefill and each of its token latencies a whole round
through the pipeline, the token's trip back to the first stage included. ``fitbench.worker.aggregate``
takes the last stage's figures for the row. The bytes a decode step reads (weights, KV cache), which
the bandwidth roofline divides by one GPU's bandwidth, are every stage's: the stages read theirs one
after another.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from fitbench.models.backends import CausalLM, compile_regions, error_summary
from fitbench.models.graphs import Capture, capture_cuda_graph
from fitbench.models.native import KVCache, NativeCausalLM
from fitbench.precisions import PrecisionPolicy
from fitbench.worker.cross_entropy import cross_entropy
from fitbench.worker.loops import LEARNING_RATE
from fitbench.worker.ranks import Rank
from fitbench.worker.stage_graph import GraphedStage, stage_decode_step
from fitbench.worker.timing import DeviceClock
from fitbench.spec import Stage, microbatch_problem


def stage_forward(model: NativeCausalLM, stage: Stage, x: torch.Tensor, cache: KVCache | None = None,
                  start: int = 0, last_only: bool = False) -> torch.Tensor:
    """The stage's part of ``NativeCausalLM.forward``: token ids (B, T) on the first stage, hidden
    states (B, T, C) on the others, in; hidden states (B, T, C), or on the last stage logits (B, T, V)
    ((B, 1, V) with ``last_only``), out. ``cache`` holds the stage's layers only, in order."""
    T = x.shape[1]
    cos, sin = model.rope_cos[start:start + T], model.rope_sin[start:start + T]
    if stage.first:
        x = model.add_positions(model.model.embed_tokens(x), slice(start, start + T))  # (B, T, C)
    layer_caches = cache.layers() if cache is not None else [None] * len(stage.layers)
    for position, (i, layer_cache) in enumerate(zip(stage.layers, layer_caches)):
        # the stage's first checkpointed_layers recompute: counted within the stage (NativeCausalLM.checkpoints)
        x = model.run_layer(position, model.model.layers[i], x, cos, sin, layer_cache, start)
    if not stage.last:
        return x
    x = model.model.norm(x)
    return model.lm_head(x[:, -1:, :] if last_only else x)


class _TrainingStage(nn.Module):
    """The stage as ``PipelineStage`` calls it: one input, one output."""

    def __init__(self, model: NativeCausalLM, stage: Stage):
        super().__init__()
        self.model = model
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return stage_forward(self.model, self.stage, x)


# ---- the stage as a CausalLM ---------------------------------------------------------------------------

class PipelineLM(CausalLM):
    """One rank's stage of a pipelined native model, with what the worker's loops call: a training
    step (``make_step``) and a generation (``generator``), both of which every stage of the job runs
    at once. ``hidden_dtype``: the dtype of the hidden states between stages (the weights' dtype,
    which the residual stream keeps under autocast too). ``tp``: the tensor-parallel ranks of each
    stage (module docstring), ``stage_group`` the process group of this rank's pipeline, one rank per
    stage (None: every rank of the job).

    Decoding: with ``cuda_graphs`` on a GPU, the first decode of a cache captures the stage's step
    (``fitbench.worker.stage_graph``), through compiled regions where ``compile_decode`` asks, and every
    later token replays it between the receive and the send; ``capture`` and ``graph_problem`` as
    ``fitbench.models.backends.NativeLM`` takes them. Where no graph can be had, the stage decodes
    eagerly and ``decoding`` says why. ``from_checkpoint``: the stage's weights were read from a
    checkpoint directory rather than drawn."""

    def __init__(self, module: NativeCausalLM, stage: Stage, rank: Rank, cache_dtype: torch.dtype,
                 hidden_dtype: torch.dtype, tp: int = 1, stage_group=None, tensor_parallel: dict | None = None,
                 cuda_graphs: bool = False, graph_problem: str | None = None, capture: Capture | None = None,
                 from_checkpoint: bool = False):
        self.module = module
        self.stage = stage
        self.from_checkpoint = from_checkpoint
        self.rank = rank
        self.cache_dtype = cache_dtype
        self.hidden_dtype = hidden_dtype
        self.tp = tp
        self.stage_group = stage_group
        self.tensor_parallel = tensor_parallel
        self.cache: KVCache | None = None
        self.position = 0
        self.graph: GraphedStage | None = None
        self.capture = capture or capture_cuda_graph
        self.captures: list[dict[str, Any]] = []
        self.compile_decode = False
        self.decode_options: dict[str, Any] = {}
        self.compiled: dict[str, Any] = {}
        self.eager_reason: str | None = None
        if not cuda_graphs:
            self.eager_reason = "turned off (--no-cuda-graphs)"
        elif capture is None and self.device.type != "cuda":
            self.eager_reason = f"CUDA graphs need a GPU; this run is on {self.device.type}"
        elif graph_problem:
            self.eager_reason = graph_problem
        # the first and last stages' copies of a tied embedding sum their gradients in a group of their
        # own (training, which runs without tensor parallelism); every rank takes part in making a
        # group, whichever ranks it holds
        self.tied_group = None
        if module.config.tie_embeddings and stage.count > 1 and dist.is_initialized() and tp == 1:
            first, last = rank.rank - stage.index, rank.rank - stage.index + stage.count - 1
            self.tied_group = dist.new_group([first, last])

    @property
    def device(self) -> torch.device:
        return self.module.rope_cos.device

    @property
    def previous(self) -> int:
        return self.rank.rank - self.tp

    @property
    def next(self) -> int:
        return self.rank.rank + self.tp

    @property
    def first_rank(self) -> int:
        return self.rank.rank - self.stage.index * self.tp

    @property
    def last_rank(self) -> int:
        return self.first_rank + (self.stage.count - 1) * self.tp

    def parameter_count(self) -> int:
        """The stage's parameters this rank holds (its shards under tensor parallelism)."""
        unique = {id(p): p for p in self.module.parameters()}.values()
        return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in unique)

    def applied(self, microbatches: int | None) -> dict[str, Any]:
        """What the row's ``parallel`` records of this rank's stage."""
        return {"strategy": "pipeline" if self.tp == 1 else "tp+pipeline", "world_size": self.rank.world_size,
                "stages": self.stage.count, "schedule": "GPipe" if microbatches else None,
                "microbatches": microbatches,
                "stage": {**self.stage.as_dict(), "rank": self.rank.rank, "params": self.parameter_count()},
                "initial_weights": "read per stage from the checkpoint" if self.from_checkpoint
                else "drawn per stage as the single-process build of the same seed draws them",
                **(self.tensor_parallel or {})}

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("a pipeline stage holds part of the model: its logits exist on the last stage "
                                  "of a pipelined forward (forward_pass)")

    def enable_activation_checkpointing(self, layers: int | None = None) -> None:
        self.module.activation_checkpointing = True
        self.module.checkpointed_layers = layers

    def decode_eagerly(self, reason: str) -> None:
        """Never capture: something about this run keeps its step out of a graph."""
        self.eager_reason = self.eager_reason or reason

    # -- point to point

    def _receive_hidden(self, batch: int, length: int) -> torch.Tensor:
        hidden = torch.empty(batch, length, self.module.config.dim, dtype=self.hidden_dtype, device=self.device)
        dist.recv(hidden, src=self.previous)
        return hidden

    def _pass_on(self, x: torch.Tensor, start: int, last_only: bool) -> torch.Tensor:
        """Run the stage on ``x`` (token ids on the first stage, else ignored and received) and send the
        result on; the last stage's logits (B, T, V) or the hidden states sent."""
        if not self.stage.first:
            x = self._receive_hidden(x.shape[0], x.shape[1])
        out = stage_forward(self.module, self.stage, x, self.cache, start, last_only)
        if not self.stage.last:
            out = out.to(self.hidden_dtype).contiguous()
            dist.send(out, dst=self.next)
        return out

    def forward_pass(self, tokens: torch.Tensor) -> torch.Tensor:
        """The whole model's forward through the stages (no cache): the last stage's logits (B, T, V),
        the hidden states a stage sent on the others."""
        self.cache = None
        return self._pass_on(tokens, 0, last_only=False)

    def exchange_token(self, out: torch.Tensor, batch: int) -> torch.Tensor | None:
        """The greedy token (B, 1), chosen on the last stage and sent to the first; None on the
        stages between, which need none."""
        if self.stage.last:
            token = out[:, -1].argmax(dim=-1, keepdim=True)
            dist.send(token, dst=self.first_rank)
            return token
        if self.stage.first:
            token = torch.empty(batch, 1, dtype=torch.long, device=self.device)
            dist.recv(token, src=self.last_rank)
            return token
        return None

    def prefill(self, tokens: torch.Tensor, max_len: int) -> torch.Tensor:
        B, T = tokens.shape
        if self.cache is None or (self.cache.batch, self.cache.max_len) != (B, max_len):
            self.cache = self.graph = None  # the graph writes into the old cache
            config = dataclasses.replace(self.module.config, n_layers=len(self.stage.layers))
            kv_heads = self.module.model.layers[self.stage.layers[0]].self_attn.n_kv_heads
            self.cache = KVCache(config, B, max_len, self.cache_dtype, self.device, kv_heads)
        self.position = T
        if self.graph is not None:
            self.graph.start(T)
        return self._pass_on(tokens, 0, last_only=True)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """As ``CausalLM.decode``, the stage's part: the last stage's logits (B, 1, V), the hidden states
        sent on the others."""
        if self.position >= self.cache.max_len:
            raise IndexError(f"the KV cache holds {self.cache.max_len} positions; decoding position {self.position}")
        if self.capture_pending:
            self._capture(tokens.shape[0])
        if self.graph is None:
            out = self._pass_on(tokens, self.position, last_only=False)
        else:
            if self.stage.first:
                self.graph.inputs.copy_(tokens)
            else:
                dist.recv(self.graph.inputs, src=self.previous)
            out = self.graph()
            if not self.stage.last:
                dist.send(out, dst=self.next)
        self.position += 1
        return out

    @property
    def capture_pending(self) -> bool:
        return self.eager_reason is None and self.graph is None

    def _step(self) -> Callable[..., torch.Tensor]:
        """The step to capture, through compiled regions where ``compile_decode`` asks and they compile
        (once here, timed apart: ``compiled["compile_s"]``); else the eager step, and why."""
        step = functools.partial(stage_decode_step, self.module, self.stage, hidden_dtype=self.hidden_dtype)
        if not self.compile_decode:
            return step
        inputs = self._inputs(self.cache.batch)
        position = torch.full((1,), self.position, dtype=torch.long, device=self.device)
        started = time.perf_counter()
        try:
            regions = compile_regions(decode_options=self.decode_options)
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                step(inputs, self.cache, position, regions=regions)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as error:  # no C++ compiler, no Triton, an operation inductor cannot lower
            self.compiled = {"compiled": False, "compile_fallback": error_summary(error)}
            return step
        self.compiled = {"compiled": True, "compile_s": time.perf_counter() - started}
        return functools.partial(step, regions=regions)

    def _inputs(self, batch: int) -> torch.Tensor:
        """A buffer of what the stage's step reads: token ids (B, 1), or hidden states (B, 1, C)."""
        if self.stage.first:
            return torch.zeros((batch, 1), dtype=torch.long, device=self.device)
        return torch.zeros((batch, 1, self.module.config.dim), dtype=self.hidden_dtype, device=self.device)

    def _capture(self, batch: int) -> None:
        step = self._step()
        started = time.perf_counter()
        try:
            self.graph = GraphedStage(step, self._inputs(batch), self.cache, self.position, self.capture)
        except Exception as error:  # some quantized kernels synchronize or have data-dependent shapes
            self.eager_reason = f"capture failed, decoding eagerly: {error_summary(error)}"
            return
        self.captures.append({"seconds": time.perf_counter() - started, "pool_bytes": self.graph.replay.pool_bytes})

    @property
    def decoding(self) -> dict[str, Any]:
        if self.eager_reason is not None:
            return {"cuda_graphs": False, "reason": self.eager_reason}
        compiled = self.compiled or {"compiled": False, "compile_fallback": "turned off (--no-compile-decode)"}
        return {"cuda_graphs": True, "captures": list(self.captures), **compiled,
                "between_stages": "one point-to-point send per stage and token, outside the graphs"}

    def kv_bytes_read(self, position: int) -> int:
        """This stage's layers' keys and values: the graph's step attends over every slot of the cache
        (those after the position masked), eager decoding over positions 0..``position``."""
        slots = self.cache.max_len if self.graph is not None else position + 1
        return slots * self.cache.slot_bytes

    def summed_over_stages(self, *values: float) -> list[float]:
        """Each of ``values`` summed over the stages of this rank's pipeline (a collective of the job)."""
        totals = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(totals, group=self.stage_group)
        return totals.tolist()

    # -- the workloads

    def generator(self, prompt: torch.Tensor, new_tokens: int, policy: PrecisionPolicy, clock: DeviceClock,
                  device: torch.device) -> Callable[[], tuple[list, list]]:
        """``fitbench.worker.loops.generate`` through the stages: the same marks and sums, taken on every
        stage; the last stage's are the job's (module docstring). The sums are of the logits on the
        last stage and of the hidden states sent on the others."""
        B = prompt.shape[0]
        max_len = prompt.shape[1] + new_tokens

        def run() -> tuple[list, list]:
            with torch.inference_mode(), policy.autocast(device.type):
                dist.barrier()
                clock.synchronize()
                marks = [clock.mark()]
                first = out = self.prefill(prompt, max_len)
                token = self.exchange_token(out, B)
                marks.append(clock.mark())
                for _ in range(new_tokens - 1):
                    out = self.decode(token if token is not None else prompt[:, :1])
                    token = self.exchange_token(out, B)
                    marks.append(clock.mark())
                sums = [first.sum(dtype=torch.float32), out.sum(dtype=torch.float32)]
            return marks, sums

        return run

    def make_step(self, mode: str, policy: PrecisionPolicy, tokens: torch.Tensor,
                  microbatches: int) -> Callable[[], torch.Tensor | None]:
        """A step of ``mode`` over ``tokens`` (B, T + 1), every stage calling it at once; it returns the
        loss (the mean of the microbatches' losses) on the last stage, the fp32 sum of the logits for
        ``forward`` there, and None on the other stages."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if mode == "forward":
            def forward() -> torch.Tensor | None:
                with torch.inference_mode(), policy.autocast(self.device.type):
                    out = self.forward_pass(inputs)
                    return out.sum(dtype=torch.float32) if self.stage.last else None
            return forward

        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        problem = microbatch_problem(tokens.shape[0], microbatches)
        if problem:
            raise ValueError(problem)
        stage = PipelineStage(_TrainingStage(self.module, self.stage), self.stage.index, self.stage.count,
                              self.device)

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return cross_entropy(logits.flatten(0, 1), target.flatten())  # (b T, V)

        schedule = ScheduleGPipe(stage, microbatches, loss_fn=loss_fn, scale_grads=True)
        parameters = [p for p in self.module.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(parameters, lr=LEARNING_RATE, fused=True) if mode == "train" else None
        tied = self.tied_group is not None and (self.stage.first or self.stage.last)
        shared = (self.module.model.embed_tokens if self.stage.first else self.module.lm_head).weight if tied else None

        def step() -> torch.Tensor | None:
            self.module.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            with policy.autocast(self.device.type):
                if self.stage.first:
                    schedule.step(inputs, return_outputs=False)
                elif self.stage.last:
                    schedule.step(target=targets, losses=losses, return_outputs=False)
                else:
                    schedule.step(return_outputs=False)
            if shared is not None:
                dist.all_reduce(shared.grad, group=self.tied_group)
            if optimizer is not None:
                optimizer.step()
            return torch.stack(losses).mean().detach() if self.stage.last else None

        return step
