"""The weights' terms: a layer's matrices and their quantized bytes, adapters, offloaded layers, the
rotary tables, and autocast's 16-bit copies of the weights.
"""

from __future__ import annotations

from fitbench.models.architecture import Architecture
from fitbench.planning.terms import Term, Widths
from fitbench.precisions import ADAPTER_RANK, StorageFormat


# ---- building blocks --------------------------------------------------------------------------


def layer_matmul_params(arch: Architecture) -> int:
    """The weights of one layer's matrices (``Architecture.layer_matrices``), without norms and biases."""
    return arch.layer_matmul_weights


def layer_matrices(arch: Architecture) -> list[tuple[int, int]]:
    """(rows, columns) = (out, in) of one layer's weight matrices, from the family's description."""
    return [(matrix.rows, matrix.columns) for matrix in arch.layer_matrices]


def quantized_layer_bytes(arch: Architecture, fmt: StorageFormat) -> float:
    return sum(fmt.matrix_bytes(rows, columns) for rows, columns in layer_matrices(arch))


def largest_layer_matrix(arch: Architecture) -> int:
    """Elements of the largest matrix of a layer (an MLP matrix, h x f, in every family)."""
    return max(matrix.weights for matrix in arch.layer_matrices)


def adapter_params(arch: Architecture, rank: int = ADAPTER_RANK) -> int:
    """Trainable parameters of the adapters: r x (in + out) for each matmul of each layer."""
    return rank * sum(rows + columns for rows, columns in layer_matrices(arch)) * arch.num_layers


def offloaded_weights(arch: Architecture, precision: str, resident_layers: int) -> float:
    """Bytes kept off the GPU: w x (L - k) x parameters per layer."""
    return Widths.of(precision).weights * (arch.num_layers - resident_layers) * arch.params_per_layer


def rotary_term(arch: Architecture, backend: str = "native") -> Term:
    """The native decoder's cos and sin tables, fp32, for every position of the context. transformers
    keeps only the inverse frequencies (D / 2 fp32) and computes cos and sin for each forward's own
    positions; learned positions (GPT-2) are a weight, counted with the weights."""
    if arch.position_embeddings != "rotary":
        return Term("rotary tables", 0.0, "none: learned positions")
    if backend == "hf":
        return Term("rotary tables", 2 * arch.head_dim, f"{arch.head_dim // 2} inverse frequencies x 4 B")
    size = 2 * arch.max_seq_len * arch.head_dim * 4
    return Term("rotary tables", size, f"2 x {arch.max_seq_len} positions x {arch.head_dim} x 4 B")


def autocast_copies(arch: Architecture, widths: Widths, saved_layers: float, tp: int,
                    output: float | None = None) -> tuple[float, str]:
    """16-bit copies of the weights under autocast. Autograd saves each matmul's copy for the
    backward pass, so a training step holds those of every layer whose activations it keeps, and
    always the output projection's (``output`` parameters of it on this rank: V h by default, none on
    a pipeline stage without it); without autograd each copy lives only for its matmul, and the
    largest (the output projection, or one MLP matrix) bounds them."""
    if not widths.autocast:
        return 0.0, ""
    output = arch.vocab_size * arch.hidden_size if output is None else output
    if saved_layers == 0:
        largest = max(output, largest_layer_matrix(arch) / tp)
        return widths.compute * largest, f"{widths.compute} B x {largest:,.0f}: the largest matrix, cast for its matmul"
    params = layer_matmul_params(arch) * saved_layers / tp + output
    return widths.compute * params, f"{widths.compute} B x {params:,.0f} matmul parameters saved by autograd"
