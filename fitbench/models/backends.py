"""One interface over both backends: full logits for training, prefill and decode for generation.

``native`` is fitbench's own decoder; ``hf`` is transformers' ``AutoModelForCausalLM``; both run
every family. Both keep a preallocated KV cache during generation
(the native ``KVCache``, transformers' ``StaticCache``), so the two measure the same algorithm.
The exception is transformers under autocast: its rotary step returns keys in fp32 during the
prefill and in the autocast dtype afterwards, which a preallocated cache of one dtype cannot
hold, so there it keeps the ``DynamicCache`` that ``generate`` uses by default.

On a GPU the native backend decodes through a CUDA graph of one decode step
(``fitbench.models.graphs``); transformers decodes eagerly, one forward call per token.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from fitbench.models.architecture import BACKENDS, Architecture, Backend, backend_error, default_backend
from fitbench.models.checkpoint_names import layer_of, native_state, unplaced_problem
from fitbench.models.graphs import Capture, GraphedDecode, Replay, capture_cuda_graph
from fitbench.models.hf import build_hf, has_weights, hf_config
from fitbench.models.native import EAGER, KVCache, NativeCausalLM, Regions, build_native, checkpoint_tensors
from fitbench.util.inject import injected

class CausalLM:
    """A model ready to run: ``module`` for training, and the three calls the loops need."""

    module: nn.Module

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T, V). The module may be wrapped (DDP), so the output's type says which it is."""
        out = self.module(tokens)
        return out if isinstance(out, torch.Tensor) else out.logits

    def prefill(self, tokens: torch.Tensor, max_len: int) -> torch.Tensor:
        """Start a generation: fill a cache of ``max_len`` positions with the prompt (B, T), from
        position 0; return the last position's logits (B, V)."""
        raise NotImplementedError

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """One step: tokens (B, 1) at the next position -> logits (B, V), which the next ``decode``
        may overwrite (a CUDA graph's output buffer): read them before calling it again."""
        raise NotImplementedError

    @property
    def decoding(self) -> dict[str, Any]:
        """How ``decode`` runs, for the result row: ``{"cuda_graphs": false, "reason": ...}``, or
        through CUDA graphs with the generation (counted from 1) in which each was captured."""
        raise NotImplementedError

    @property
    def capture_pending(self) -> bool:
        """Whether the next decode will capture a CUDA graph, a cost no measured generation may carry."""
        return False

    def kv_bytes_read(self, position: int) -> int:
        """Bytes of the KV cache, keys and values of every layer and sequence, that the decode step at
        ``position`` reads, as this backend decodes; from the cache of the last generation."""
        raise NotImplementedError

    def enable_activation_checkpointing(self, layers: int | None = None) -> None:
        """Recompute the activations of the first ``layers`` decoder layers (of each pipeline stage), every
        layer's when None, in the backward pass instead of keeping them."""
        raise NotImplementedError


class NativeLM(CausalLM):
    """The native decoder. With ``cuda_graphs`` on a GPU, the first decode of a cache captures
    ``decode_step`` in a CUDA graph and every later token replays it. A cache, and its graph, serve
    every generation of the same (batch, max_len), so only the first generation captures: in the
    worker a warm-up, never a measured one. Where a graph cannot be had (a CPU, a kernel that cannot
    be captured) decoding is eager and ``decoding`` says why.

    Under autocast (fp32 weights, 16-bit compute) the captured step holds the casts too: inside
    ``inference_mode`` autocast caches no cast weight, so eager decoding casts every matrix again at
    every token, and so does each replay. A step then moves about 8 bytes per matmul parameter (the
    fp32 read, the 16-bit write and read), which the decode bandwidth figures count.

    ``capture`` turns the step into a replayable one; the default, CUDA graphs, needs a GPU, and
    any other is taken to work where the model is. ``graph_problem`` says why this model's step can
    never be captured (the precision's entry, ``fitbench.precisions``): it then decodes eagerly from the start.

    ``compile_decode``: the captured step and the prefill run through compiled regions
    (``compile_regions``), one compiled decoder layer serving every layer; ``compiler`` compiles
    them (inductor by default) and ``decode_options`` are inductor's options for the decode step's
    layer alone. ``decoding`` reports each region's graphs and compile time.
    """

    def __init__(self, module: NativeCausalLM, cache_dtype: torch.dtype, cuda_graphs: bool = False,
                 capture: Capture | None = None, graph_problem: str | None = None, compile_decode: bool = False,
                 compiler: Compiler | None = None):
        self.module = module
        self.compile_decode = compile_decode
        self.compiler = compiler
        self.decode_options: dict[str, Any] = {}
        self.compiled: dict[str, Any] = {}
        self.regions: Regions | None = None  # compiled (compile_regions), once compile_decode first needs them
        self.prefill_shapes: set[tuple[int, int, int]] = set()
        self.cache_dtype = cache_dtype
        self.cache: KVCache | None = None
        self.position = 0
        self.generations = 0
        self.graph: GraphedDecode | None = None
        self.capture = capture or capture_cuda_graph
        self.captures: list[dict[str, Any]] = []
        self.graph_prefill = False
        self.prefill_graphs: dict[tuple[int, int, int], tuple[Replay, torch.Tensor]] = {}
        self.prefill_graph_problem: str | None = None
        device = module.rope_cos.device
        self.eager_reason: str | None = None
        if not cuda_graphs:
            self.eager_reason = "turned off (--no-cuda-graphs)"
        elif capture is None and device.type != "cuda":
            self.eager_reason = f"CUDA graphs need a GPU; this run is on {device.type}"
        elif graph_problem:
            self.eager_reason = graph_problem

    def prefill(self, tokens: torch.Tensor, max_len: int) -> torch.Tensor:
        """With compiled decoding, the prompt runs through the compiled regions, compiled for each
        (batch, prompt, cache length) at its first call, the shapes being static (``dynamic=False``);
        that call, compile included, is timed into ``compiled["prefill_first_call_s"]``."""
        B, T = tokens.shape
        if self.cache is None or (self.cache.batch, self.cache.max_len) != (B, max_len):
            self.graph = None  # it writes into the old cache
            self.prefill_graphs = {}  # so do these
            self.cache = None  # free the previous generation's cache before allocating the next
            self.cache = self.module.new_cache(B, max_len, self.cache_dtype)
        # A reused cache still holds the last generation's keys after position T: eager decoding
        # reads only positions up to the current one, and the graph's step masks the rest.
        self.generations += 1
        self.position = T
        if self.graph is not None:
            self.graph.start(T)

        def run(regions: Regions | None) -> torch.Tensor:
            return self.module(tokens, cache=self.cache, start=0, last_only=True, regions=regions)[:, -1]

        if self._compiling() and (B, T, max_len) in self.prefill_shapes and self.graph_prefill \
                and self.prefill_graph_problem is None:
            return self._graphed_prefill(tokens, max_len, run)
        if not self._compiling() or (B, T, max_len) in self.prefill_shapes:
            return run(self.regions if self._compiling() else None)
        self.prefill_shapes.add((B, T, max_len))
        started = time.perf_counter()
        logits = self._first_compiled_call(run)
        if self._compiling():
            self.compiled.setdefault("prefill_first_call_s", []).append(time.perf_counter() - started)
        return logits

    def _graphed_prefill(self, tokens: torch.Tensor, max_len: int,
                         run: Callable[[Regions | None], torch.Tensor]) -> torch.Tensor:
        """The prefill of a prompt shape compiled before, replayed from a CUDA graph captured at its
        second call (``graph_prefill``): a prefill through compiled regions still launches every
        layer's kernels and collectives from the host, which under tensor parallelism, with a quarter
        of each matmul per GPU and two collectives per layer, takes longer than the GPU's work. The
        graph reads the prompt from a buffer of its own and writes the cache it was captured with;
        its pool keeps a prefill's temporaries (one layer's at a time) for as long as the cache lives.
        Where the capture fails, prefills run as before (``run`` through the compiled regions) and
        ``decoding`` says why."""
        shape = (*tokens.shape, max_len)
        if shape not in self.prefill_graphs:
            prompt = tokens.clone()
            started = time.perf_counter()
            try:
                replay = self.capture(lambda: self.module(prompt, cache=self.cache, start=0, last_only=True,
                                                          regions=self.regions)[:, -1])
            except Exception as error:
                self.prefill_graph_problem = f"capture failed, prefilling through the compiled regions: " \
                                             f"{error_summary(error)}"
                return run(self.regions)
            self.prefill_graphs[shape] = (replay, prompt)
            self.captures.append({"generation": self.generations, "prefill": list(shape),
                                  "seconds": time.perf_counter() - started, "pool_bytes": replay.pool_bytes})
        replay, prompt = self.prefill_graphs[shape]
        prompt.copy_(tokens)
        return replay.run()

    def _compiling(self) -> bool:
        """Whether generation runs through compiled regions: asked for, a graph to capture, nothing failed."""
        return self.compile_decode and self.eager_reason is None and "compile_fallback" not in self.compiled

    def _first_compiled_call(self, run: Callable[[Regions | None], torch.Tensor]) -> torch.Tensor:
        """``run(regions)`` through the compiled regions, made here at the first call, a call that may
        compile them for new shapes; where that fails, ``run(None)``, eagerly, and the reason is kept."""
        try:
            self.regions = self.regions or compile_regions(self.compiler, self.decode_options)
            # Past Dynamo's limit of compiled versions of a function, it would run the function eagerly
            # and say nothing: a run that measured eager code and reported it compiled.
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                out = run(self.regions)
            if self.module.rope_cos.device.type == "cuda":
                torch.cuda.synchronize()
        except Exception as error:  # no C++ compiler, no Triton, an operation inductor cannot lower
            self._compile_failed(error)
            return run(None)
        return out

    def _compile_failed(self, error: BaseException) -> None:
        self.regions = None
        self.graph = None  # it may replay the compiled step: the next decode captures the eager one
        self.compiled = {"compiled": False, "compile_fallback": error_summary(error)}

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.position >= self.cache.max_len:
            # checked here: a graph would write out of bounds, which ends the process on a GPU
            raise IndexError(f"the KV cache holds {self.cache.max_len} positions; decoding position {self.position}")
        if self.capture_pending:
            self._capture()
        if self.graph is not None:
            logits = self.graph(tokens)
        else:
            logits = self.module(tokens, cache=self.cache, start=self.position)[:, -1]
        self.position += 1
        return logits

    @property
    def capture_pending(self) -> bool:
        return self.eager_reason is None and self.graph is None

    def _decode_step(self) -> Callable[..., torch.Tensor]:
        """The step to capture: ``decode_step``, through the compiled regions when ``compile_decode``
        asks for them (``compile_regions``), run once here so that any compile happens before the
        capture and is timed apart (``compiled["compile_s"]``); the run writes the cache at the
        position, a slot the first replay writes again before anything reads it. Where compiling
        fails, the eager step, and why."""
        if not self._compiling():
            return self.module.decode_step
        tokens = torch.zeros((self.cache.batch, 1), dtype=torch.long, device=self.cache.device)
        position = torch.full((1,), self.position, dtype=torch.long, device=self.cache.device)
        started = time.perf_counter()
        self._first_compiled_call(lambda regions: self.module.decode_step(tokens, self.cache, position, regions))
        if not self._compiling():
            return self.module.decode_step
        self.compiled = {**self.compiled, "compiled": True, "compile_s": time.perf_counter() - started}
        return functools.partial(self.module.decode_step, regions=self.regions)

    def _capture(self) -> None:
        step = self._decode_step()
        started = time.perf_counter()
        try:
            self.graph = GraphedDecode(self.module, self.cache, self.position, self.capture, step)
        except Exception as error:  # some quantized kernels synchronize or have data-dependent shapes
            self.eager_reason = f"capture failed, decoding eagerly: {error_summary(error)}"
            return
        self.captures.append({"generation": self.generations, "seconds": time.perf_counter() - started,
                              "pool_bytes": self.graph.replay.pool_bytes})

    @property
    def decoding(self) -> dict[str, Any]:
        if self.eager_reason is not None:
            return {"cuda_graphs": False, "reason": self.eager_reason}
        if not self.compile_decode:
            compiled = {"compiled": False, "compile_fallback": "turned off (--no-compile-decode)"}
        elif self.regions is not None:
            regions = {field.name: getattr(self.regions, field.name).record()
                       for field in dataclasses.fields(self.regions)}
            compiled = {**self.compiled, "regions": regions,
                        "compiled_graphs": sum(region["graphs"] for region in regions.values())}
        else:
            compiled = self.compiled
        prefill = {}
        if self.graph_prefill and self._compiling():
            prefill = {"prefill": self.prefill_graph_problem or "CUDA graph per prompt shape"}
        return {"cuda_graphs": True, "captures": list(self.captures), **prefill, **compiled}

    def kv_bytes_read(self, position: int) -> int:
        """The graph's ``decode_step`` attends over every slot of the preallocated cache (``max_len``,
        those after the position masked); eager decoding over positions 0..``position``."""
        slots = self.cache.max_len if self.graph is not None else position + 1
        return slots * self.cache.slot_bytes

    def decode_eagerly(self, reason: str) -> None:
        """Never capture: something about this model keeps its step out of a graph."""
        self.eager_reason = self.eager_reason or reason

    def enable_activation_checkpointing(self, layers: int | None = None) -> None:
        self.module.activation_checkpointing = True
        self.module.checkpointed_layers = layers


# Inductor's options for the decode step's layer under --decode-tuning: coordinate descent over each
# generated kernel's launch parameters (block sizes, warps), as gpt-fast compiles its decode step: a
# longer compile, for kernels that then run once per layer and token.
DECODE_TUNING = {"coordinate_descent_tuning": True}

# Compiles one graph that Dynamo traced, given example inputs, into the function that runs it (a
# torch.compile backend).
Compiler = Callable[[torch.fx.GraphModule, list], Callable[..., Any]]


def inductor(options: dict[str, Any] | None = None) -> Compiler:
    """Inductor, with ``options`` (``torch._inductor.config`` names) and without its own CUDA graphs:
    ``fitbench.models.graphs`` captures the compiled step itself."""
    patches = {"triton.cudagraphs": False, **(options or {})}

    def compile_graph(graph: torch.fx.GraphModule, inputs: list) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(graph, inputs, config_patches=patches)

    return compile_graph


class CompiledRegion:
    """``function`` compiled for the shapes it is called with (``dynamic=False``: a decode step's
    shapes never change, and each prefill shape gets its own code). Called with every decoder layer
    in turn, it compiles once per shape: the layer, its weights and its cache are arguments, guarded
    by type, shape, strides and dtype, not identity. ``graphs`` counts the graphs ``compiler`` compiled and
    ``seconds`` the wall time of the calls that compiled (Dynamo's tracing, the compile and that one
    run); more graphs than shapes are recompiles, which the row shows."""

    def __init__(self, function: Callable[..., torch.Tensor], compiler: Compiler):
        self.compiler = compiler
        self.graphs = 0
        self.seconds = 0.0
        self.compiled = torch.compile(function, backend=self._compile, dynamic=False)

    def _compile(self, graph: torch.fx.GraphModule, inputs: list) -> Callable[..., Any]:
        self.graphs += 1
        return self.compiler(graph, inputs)

    def __call__(self, *args: Any) -> torch.Tensor:
        graphs, started = self.graphs, time.perf_counter()
        out = self.compiled(*args)
        if self.graphs != graphs:
            self.seconds += time.perf_counter() - started
        return out

    def record(self) -> dict[str, Any]:
        return {"graphs": self.graphs, "compile_s": self.seconds}


def compile_regions(compiler: Compiler | None = None, decode_options: dict[str, Any] | None = None) -> Regions:
    """The native model's regions (``fitbench.models.native.Regions``) compiled, each once for every
    layer, instead of the whole model at once, in which Dynamo unrolls the layers and inductor
    compiles each copy: a decoder layer over the prompt and its decode step, and the head (final norm
    and output projection), which the prefill and the decode step share, both giving it the last
    position (B, 1, C), and the decode step's embedding: under tensor parallelism its all-reduce is then
    a compiled collective, which a one-shot kernel can sum (``fitbench.worker.tensor_parallel``), as the
    layers' are. The few operators that gather the step's rotary rows and build its mask run eagerly,
    inside the captured graph all the same: a handful of elementwise kernels on (1, max_len) or fewer
    elements. ``compiler``: inductor by default; ``decode_options``: inductor's options for the decode
    step's layer alone. Raises, for tests, under ``FITBENCH_INJECT=compile-error:decode``, as a
    machine without a compiler would."""
    if injected("compile-error", "decode"):
        raise RuntimeError("FITBENCH_INJECT: compiling fails")
    return Regions(layer=CompiledRegion(EAGER.layer, compiler or inductor()),
                   layer_decode=CompiledRegion(EAGER.layer_decode, compiler or inductor(decode_options)),
                   head=CompiledRegion(EAGER.head, compiler or inductor()),
                   embed=CompiledRegion(EAGER.embed, compiler or inductor()))


def error_summary(error: BaseException) -> str:
    """The exception's type and first line, after the one it interrupted if any: a failed capture
    raises again when torch ends it, and the first error is the cause."""
    chain = [error] if error.__context__ is None else [error.__context__, error]
    lines = [f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}" for e in chain]
    return "; then ".join(lines)[:500]


class HuggingFaceLM(CausalLM):
    """A transformers model. Its KV cache is transformers' own: ``StaticCache`` when ``static_cache``
    (weights and activations share a dtype), else ``DynamicCache``; what each holds depends on the
    installed version (``fitbench.models.hf_cache``)."""

    def __init__(self, module: nn.Module, static_cache: bool):
        self.module = module
        self.static_cache = static_cache
        self.cache = None
        self.position = 0
        self.copied_on_growth = False
        # transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (the old name warns)
        parameters = inspect.signature(module.forward).parameters
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"

    def prefill(self, tokens: torch.Tensor, max_len: int) -> torch.Tensor:
        from transformers import DynamicCache, StaticCache

        self.cache = None
        self.cache = (StaticCache(config=self.module.config, max_cache_len=max_len) if self.static_cache
                      else DynamicCache(config=self.module.config))
        self.position = tokens.shape[1]
        out = self.module(tokens, **{self.cache_argument: self.cache}, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        position = torch.tensor([self.position], device=tokens.device)
        before = self.cache.layers[0].keys.untyped_storage().data_ptr()
        out = self.module(tokens, **{self.cache_argument: self.cache}, use_cache=True, cache_position=position)
        self.copied_on_growth = self.cache.layers[0].keys.untyped_storage().data_ptr() != before
        self.position += 1
        return out.logits[:, -1]

    @property
    def decoding(self) -> dict[str, Any]:
        return {"cuda_graphs": False, "reason": "the hf backend decodes eagerly, one transformers forward per token"}

    def kv_bytes_read(self, position: int) -> int:
        """Attention reads the whole ``StaticCache`` (``max_len`` slots, masked), or the ``DynamicCache``
        up to the position; a ``DynamicCache`` that the step grew by writing it anew (concatenation:
        ``copied_on_growth``) read the ``position`` earlier slots once more. The widths are the cache's
        own, keys' and values' each (``fitbench.models.hf_cache``)."""
        layers = self.cache.layers
        per_slot = sum(t[..., 0, :].numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
        if self.static_cache:
            slots = layers[0].keys.shape[-2]
        else:
            slots = position + 1 + (position if self.copied_on_growth else 0)
        return slots * per_slot

    def enable_activation_checkpointing(self, layers: int | None = None) -> None:
        if layers is not None:  # fitbench.config refuses it first; this guards the API
            raise ValueError("transformers' gradient checkpointing covers every layer: the hf backend takes no "
                             "count of checkpointed layers")
        self.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_model(arch: Architecture, backend: Backend, device: torch.device | str, dtype: torch.dtype,
               model_path: str | None = None, compute_dtype: torch.dtype | None = None,
               cuda_graphs: bool = False, graph_problem: str | None = None, fused: bool = True) -> CausalLM:
    """Build ``arch`` with ``backend`` directly on ``device`` with weights in ``dtype``: random, or the
    checkpoint in ``model_path`` when that directory has one. ``compute_dtype`` is the activations'
    dtype when autocast makes it differ from the weights'; the KV cache holds it. ``cuda_graphs``:
    the native backend decodes through CUDA graphs on a GPU, unless ``graph_problem`` says why the
    weights it will hold cannot be captured (``NativeLM``). ``fused``: the native model's fused
    projections (``fitbench.models.native``); a model quantized after loading keeps them apart, as
    the quantizers name each projection."""
    compute_dtype = compute_dtype or dtype
    if backend == "native":
        module = build_native(arch, device, dtype, fused=fused)
        if model_path is not None and has_weights(model_path):
            load_checkpoint(module, Path(model_path), device)
        return NativeLM(module, cache_dtype=compute_dtype, cuda_graphs=cuda_graphs, graph_problem=graph_problem)
    return HuggingFaceLM(build_hf(arch, device, dtype, weights_dir=model_path), static_cache=compute_dtype == dtype)


@torch.no_grad()
def load_checkpoint(module: nn.Module, directory: Path, device: torch.device | str) -> None:
    """Copy a transformers-layout checkpoint (safetensors or .bin shards) into the native model, shard by
    shard, each loaded straight to ``device``, a fused model's projections into their parts
    (``checkpoint_tensors``), a Falcon or GPT-2 checkpoint's tensors under the native names
    (``fitbench.models.checkpoint_names``, told which by the directory's ``config.json``); every
    parameter must be found, and every tensor of a decoder layer must have its parameter: one dropped
    would be a model other than the checkpoint's (a Falcon config with bias true)."""
    from safetensors.torch import load_file

    config_file = directory / "config.json"
    hf_config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    targets = checkpoint_tensors(module)
    expected = set(targets)
    found: set[str] = set()
    unplaced: set[str] = set()
    for shard in sorted(directory.glob("*.safetensors")) or sorted(directory.glob("pytorch_model*.bin")):
        if shard.suffix == ".safetensors":
            state = load_file(str(shard), device=str(device))
        else:
            state = torch.load(shard, map_location=device, weights_only=True)
        state = native_state(hf_config, state)
        for key, value in state.items():
            if key in expected:
                targets[key].copy_(value)
                found.add(key)
            elif layer_of(key) is not None:
                unplaced.add(key)
        del state
    missing = expected - found
    if module.config.tie_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint in {directory} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    if unplaced:
        raise ValueError(unplaced_problem(directory, unplaced))


__all__ = ["BACKENDS", "Backend", "CausalLM", "backend_error", "default_backend", "hf_config", "load_model"]
