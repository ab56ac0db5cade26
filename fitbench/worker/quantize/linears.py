"""The matmuls of a plain model that quantization converts: every ``nn.Linear`` but the output
projection, transformers' own matmul modules (GPT-2's ``Conv1D``, Falcon's ``FalconLinear``) turned into
plain ``nn.Linear`` first, so that every family's matmuls are quantized alike."""

from __future__ import annotations

from torch import nn


def quantizable(module: nn.Module, name: str) -> bool:
    """Whether the module called ``name`` in the model is a matmul that quantization converts."""
    return isinstance(module, nn.Linear) and not name.endswith("lm_head")


def _is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is GPT-2's ``Conv1D``, which stores W as (in, out) for ``x W + b``."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers.")


def transposed_weights(module: nn.Module) -> set[str]:
    """The names, in ``module``, of the weights that ``to_plain_linears`` transposes: a checkpoint holds
    them as (in, out), the plain ``nn.Linear`` as (out, in)."""
    return {f"{name}.weight" for name, child in module.named_modules() if _is_conv1d(child)}


def _plain_linear(module: nn.Module) -> nn.Linear | None:
    """The nn.Linear computing what a transformers matmul module computes, sharing its parameters,
    or None for anything else. GPT-2's ``Conv1D`` stores W as (in, out) for ``x W + b``: the Linear
    holds W^T. Falcon's ``FalconLinear`` is an nn.Linear whose forward, ``x @ W.T``, transposes the
    weight itself, which torchao's quantized weights do not implement; as a plain Linear it calls
    ``F.linear``, as the quantizers expect."""
    is_conv1d = _is_conv1d(module)
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


def to_plain_linears(module: nn.Module) -> None:
    """Replace transformers' own matmul modules by nn.Linear, so that every family's matmuls are
    quantized alike."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            linear = _plain_linear(child)
            if linear is not None:
                setattr(parent, name, linear)


def quantizable_linears(module: nn.Module, prefix: str = "") -> dict[str, nn.Module]:
    """The matmuls ``fitbench.worker.quantize.quantize_linears`` replaces or converts, by their names in the
    model."""
    return {f"{prefix}{name}": child for name, child in module.named_modules()
            if quantizable(child, f"{prefix}{name}")}
