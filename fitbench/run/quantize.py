"""Quantized weights for the decoder layers' matmuls, through bitsandbytes and torchao.

| precision      | library      | weights                                    | compute |
|----------------|--------------|--------------------------------------------|---------|
| ``int8``       | bitsandbytes | LLM.int8 (Dettmers et al. 2022), row absmax | bf16 + int8 matmul, outliers in 16 bits |
| ``nf4``/``fp4``| bitsandbytes | 4-bit, absmax per block of 64               | bf16 |
| ``int8-dynamic``| torchao     | int8 per row, activations int8 per token   | int8 |
| ``int8-weight-only``| torchao | int8 per row, activations left bf16        | bf16 (the weight cast to bf16 for the matmul) |
| ``int4``       | torchao      | int4 weight-only, groups of 128, tinygemm  | bf16 (GPU only) |
| ``fp8``        | torchao      | float8 e4m3, per-row scales, dynamic activations | fp8 (compute capability >= 8.9) |
| ``fp8-weight-only``| torchao  | float8 e4m3, per-row scales, activations left bf16 | bf16 (the weight cast to fp32, scaled, cast to bf16 for the matmul) |
| ``fp8-block``  | torchao      | float8 e4m3, 128 x 128 weight blocks, 1 x 128 activation blocks | fp8 (>= 8.9) |

Embeddings, norms and the output projection stay bf16, as transformers' integrations keep them.

A large model is quantized as it is built, one layer at a time (``build_quantized_native``), so the
full bf16 model never exists: the peak is the quantized layers so far plus one layer in bf16. Each
layer's weights, once quantized, move into one block of a pool of their own (``fitbench.run.packing``),
so that the next layer's bf16 weights and temporaries find the range this one's left free. The
same pass measures quality against the bf16 model (``fitbench.run.quality``): a probe sequence runs
through each layer in bf16, each matmul's input is kept, and the layer, once quantized, runs its
matmuls on those inputs and its own copy of the probe's hidden states through; the final logits of
the two copies give the next-token agreement and KL divergence.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from fitbench.models.architecture import Architecture
from fitbench.models.native import (NativeCausalLM, empty_on, init_random_weights, materialize, meta_model,
                                   replay_random_weights)
from fitbench.run.packing import Packer, packed_bytes
from fitbench.run.quality import (REFERENCE_TEXT_NAME, NoTokenizer, Perplexity, Quality, kl_divergence, matmul_errors,
                                  perplexity, recorded_matmuls, summarise, tokenize_reference_text, top1_agreement)

BITSANDBYTES = ("int8", "nf4", "fp4")
# What one pipeline stage's quantized build hands the next: the probe's bf16 and quantized hidden
# states (1, T, C) and the matmul errors so far.
Carried = tuple[torch.Tensor, torch.Tensor, dict[str, float]]
TORCHAO = ("int8-dynamic", "int8-weight-only", "int4", "fp8", "fp8-weight-only", "fp8-block")


def _quantizable(module: nn.Module, name: str) -> bool:
    return isinstance(module, nn.Linear) and not name.endswith("lm_head")


def _plain_linear(module: nn.Module) -> nn.Linear | None:
    """The nn.Linear computing what a transformers matmul module computes, sharing its parameters,
    or None for anything else. GPT-2's ``Conv1D`` stores W as (in, out) for ``x W + b``: the Linear
    holds W^T. Falcon's ``FalconLinear`` is an nn.Linear whose forward, ``x @ W.T``, transposes the
    weight itself, which torchao's quantized weights do not implement; as a plain Linear it calls
    ``F.linear``, as the quantizers expect."""
    is_conv1d = type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers.")
    is_subclass = (isinstance(module, nn.Linear) and type(module) is not nn.Linear
                   and type(module).__module__.startswith("transformers."))
    if not (is_conv1d or is_subclass):
        return None
    weight = module.weight.data.t().contiguous() if is_conv1d else module.weight.data
    rows, columns = weight.shape
    linear = nn.Linear(columns, rows, bias=module.bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
    if module.bias is not None:
        linear.bias = module.bias
    return linear


def _to_plain_linears(module: nn.Module) -> None:
    """Replace transformers' own matmul modules by nn.Linear, so that every family's matmuls are
    quantized alike."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            linear = _plain_linear(child)
            if linear is not None:
                setattr(parent, name, linear)


def _bitsandbytes_linear(linear: nn.Linear, precision: str, device: torch.device) -> nn.Module:
    import bitsandbytes as bnb

    bias = linear.bias is not None
    if precision == "int8":
        layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=bias, has_fp16_weights=False,
                                    threshold=6.0, device="meta")
        weight = bnb.nn.Int8Params(linear.weight.data, requires_grad=False, has_fp16_weights=False)
        layer.weight = weight._quantize(device)
    else:
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=bias, compute_dtype=torch.bfloat16,
                                  quant_type=precision, device="meta")
        layer.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type=precision).to(device)
    if bias:
        layer.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    return layer


def _torchao_config(precision: str):
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig,
                                      Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig,
                                      Int8WeightOnlyConfig)
    from torchao.quantization.granularity import PerBlock, PerRow

    if precision == "int8-dynamic":
        return Int8DynamicActivationInt8WeightConfig()
    if precision == "int8-weight-only":
        return Int8WeightOnlyConfig()  # symmetric, one scale per output row (torchao's default, PerRow)
    if precision == "int4":
        return Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
    if precision == "fp8":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    if precision == "fp8-weight-only":
        return Float8WeightOnlyConfig(granularity=PerRow())  # e4m3, one fp32 scale per output row
    return Float8DynamicActivationFloat8WeightConfig(granularity=[PerBlock([1, 128]), PerBlock([128, 128])])


@torch.no_grad()
def quantize_linears(module: nn.Module, precision: str, device: torch.device,
                     each: Callable[[nn.Module], object] | None = None) -> None:
    """Replace (bitsandbytes) or convert (torchao) every matmul of ``module`` but the output projection,
    one at a time, the largest first, handing each quantized matmul to ``each``. Largest first: the
    range a matrix and its temporaries leave free is then long enough for every later one's, so the
    allocator need not map more for them."""
    _to_plain_linears(module)
    targets = [(parent, name, child.weight.numel()) for parent_name, parent in module.named_modules()
               for name, child in parent.named_children() if _quantizable(child, f"{parent_name}.{name}")]
    targets.sort(key=lambda target: -target[2])
    if precision not in BITSANDBYTES:
        from torchao.quantization import quantize_

        config = _torchao_config(precision)
    for parent, name, _ in targets:
        if precision in BITSANDBYTES:
            setattr(parent, name, _bitsandbytes_linear(getattr(parent, name), precision, device))
        else:
            quantize_(getattr(parent, name), config)
        if each is not None:
            each(getattr(parent, name))


def float8_training(module: nn.Module) -> int:
    """Convert the decoder layers' matmuls to torchao's float8 training linears (row-wise scales: each
    step casts weights, activations and gradients to float8 e4m3 with one scale per row, and the
    backward pass casts again along the other axis); returns how many were converted. The output
    projection stays bf16, and a matmul whose sides are not multiples of 16 (the float8 kernel's
    tile) too."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted = []

    def convertible(linear: nn.Module, fqn: str) -> bool:
        ok = (_quantizable(linear, fqn) and linear.in_features % 16 == 0 and linear.out_features % 16 == 0)
        if ok:
            converted.append(fqn)
        return ok

    convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name("rowwise"),
                               module_filter_fn=convertible)
    return len(converted)


def quantizable_linears(module: nn.Module, prefix: str = "") -> dict[str, nn.Module]:
    """The matmuls ``quantize_linears`` replaces or converts, by their names in the model."""
    return {f"{prefix}{name}": child for name, child in module.named_modules()
            if _quantizable(child, f"{prefix}{name}")}


@torch.no_grad()
def build_quantized_native(arch: Architecture, device: torch.device, precision: str, probe: torch.Tensor,
                           layers: range | None = None, receive: Callable[[], Carried] | None = None,
                           send: Callable[[Carried], None] | None = None) -> tuple[NativeCausalLM, Quality | None]:
    """Materialize, quantize and pack one layer at a time, carrying a bf16 and a quantized copy of the
    probe's hidden states through the layers; return the model and its quality against bf16. The first
    layer, once quantized, sizes one block for every layer's weights (``fitbench.run.packing``); from
    the second on, each matmul moves into it as soon as it is quantized. On a GPU the block lives in a
    private memory pool, kept as the model's ``packer``: one block, because the pool maps whole pages
    of 20 MiB for each of its allocations (on an H200, a block per layer of 52 MB took 63 MB).

    ``layers``: a pipeline stage's (``fitbench.run.pipeline``), the only decoder layers given storage;
    the first stage also materializes the embedding and the last the final norm and the output
    projection (a tied one: its own copy of the table), every other module staying on the meta
    device, and every weight drawn as in the whole model's build (``replay_random_weights``). The
    probe's two hidden states and the matmul errors so far come from the stage before (``receive``)
    and go to the next (``send``); the quality exists on the last stage, None on the others."""
    layers = range(arch.num_layers) if layers is None else layers
    first, last = layers.start == 0, layers.stop == arch.num_layers
    model = meta_model(arch, torch.bfloat16)
    packer = Packer(device)
    # a tied output projection is never allocated on its own: freed once tied, its table would be a
    # hole the size of the vocabulary at the bottom of the allocator's segment for the whole run
    tied = arch.tie_embeddings
    embedding, norm, head = model.model.embed_tokens, model.model.norm, model.lm_head
    ends = (embedding, norm, *(() if tied else (head,)))
    for part, owned in ((embedding, first or (tied and last)), (norm, last), (head, last and not tied)):
        if owned:
            materialize(part, device)
    replay_random_weights(list(ends), device)
    if tied and last:
        model.lm_head.weight = embedding.weight
    model.rope_cos, model.rope_sin = empty_on(model.rope_cos, device), empty_on(model.rope_sin, device)
    model.reset_rope()

    T = probe.shape[1]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    errors: dict[str, float] = {}
    if first:
        reference = quantized = embedding(probe)
    else:
        reference, quantized, errors = receive()
    # the layers of earlier stages draw their weights into scratch; those of later stages draw nothing here
    for i in range(layers.stop):
        layer = model.model.layers[i]
        if i not in layers:
            replay_random_weights([layer], device)
            continue
        materialize(layer, device)
        init_random_weights(layer)
        prefix = f"model.layers.{i}."
        with recorded_matmuls(quantizable_linears(layer, prefix)) as record:
            reference = layer(reference, cos, sin, None, 0)
        quantize_linears(layer, precision, device, each=packer.pack if i != layers.start else None)
        errors |= matmul_errors(record, {f"{prefix}{name}": m for name, m in layer.named_modules()}, device)
        del record
        quantized = layer(quantized, cos, sin, None, 0)
        if i == layers.start:  # the first layer, quantized, tells what each takes: one block for all of them
            packer.reserve(packed_bytes(layer, device) * len(layers))
        packer.pack(layer)  # the first layer whole; then each layer's norms and what its forward added
    model.packer = packer
    if not last:
        send((reference, quantized, errors))
        return model, None
    reference_logits = model.lm_head(model.model.norm(reference))
    quantized_logits = model.lm_head(model.model.norm(quantized))
    return model, Quality(summarise(errors), top1_agreement(quantized_logits, reference_logits),
                          kl_divergence(quantized_logits, reference_logits), probe.numel(), None,
                          reference="bf16, same random weights, same input")


@torch.no_grad()
def quantize_built(lm, arch: Architecture, precision: str, device: torch.device, probe: torch.Tensor,
                   checkpoint: str | Path | None = None) -> Quality:
    """Quantize an already built bf16 model of ``arch`` in place (transformers, or a checkpoint),
    measuring its quality against itself before; ``lm`` is a ``fitbench.models.backends.CausalLM``.
    The matmuls' inputs and outputs of the bf16 pass wait in host memory (a large model has hundreds
    of matmuls) until the quantized matmuls run on them. With the ``checkpoint`` directory the weights
    came from, the perplexity of the shipped text before and after."""
    text, perplexities = None, None
    if checkpoint is not None:
        try:
            ids = tokenize_reference_text(checkpoint, arch.vocab_size, arch.max_seq_len)
            text = torch.tensor([ids], device=device)
        except NoTokenizer as reason:
            perplexities = f"not measured: {reason}"
    linears = quantizable_linears(lm.module)
    with recorded_matmuls(linears, keep=lambda t: t.to("cpu")) as record:
        reference = lm.logits(probe)
    bf16_perplexity = perplexity(lm.logits(text), text) if text is not None else None
    quantize_linears(lm.module, precision, device)
    errors = matmul_errors(record, dict(lm.module.named_modules()), device)
    del record
    quantized = lm.logits(probe)
    if text is not None:
        perplexities = Perplexity(REFERENCE_TEXT_NAME, text.shape[1], bf16_perplexity,
                                  perplexity(lm.logits(text), text))
    return Quality(summarise(errors), top1_agreement(quantized, reference), kl_divergence(quantized, reference),
                   probe.numel(), perplexities, reference="bf16, same weights, same input")
