"""The compiled memory model (``fitbench.planning.compiled``) against AOTAutograd's real partition of the
native model, and by hand.

The partition is the one inductor makes: ``torch.compile`` with a backend built on AOTAutograd,
inductor's own partition function (its joint-graph passes, then the min-cut partitioner) and its
decomposition table, on the CPU; instead of generating kernels, the backend runs the forward graph
and reads its outputs: the logits, then every tensor saved for the backward pass, each counted by
the storage it keeps alive (a saved view keeps all of its base).
"""

import dataclasses

import pytest
import torch

from fitbench.models.native import build_native
from fitbench.models.registry import resolve
from fitbench.planning import compiled
from fitbench.planning.calibration import DEFAULT
from fitbench.planning.memory import estimate_memory
from fitbench.planning.sharding import Parallelism
from fitbench.planning.terms import END, FIRST, MLP, OUTPUT, START
from fitbench.planning.planner import Candidate, GpuTarget, predict_spec
from fitbench.precisions import PRECISIONS as RUNNABLE, policy
from fitbench.spec import Layout, RunSpec

# Two layers: the first (which saves a 16-bit tensor in place of an fp32 one) and one like every
# later layer. Widths all differ, and none equals the batch or the token count, so a saved tensor's
# leading dimension says whether it is an activation (B or n) or a weight.
H, L, HEADS, KV_HEADS, F_, V = 64, 2, 4, 2, 176, 100
D, K = H // HEADS, KV_HEADS * H // HEADS
ARCH = dataclasses.replace(resolve("tiny"), name="compiled-test", hidden_size=H, num_layers=L, num_heads=HEADS,
                           num_kv_heads=KV_HEADS, ffn_size=F_, vocab_size=V, tie_embeddings=False, max_seq_len=64)
B, T = 3, 40
N = B * T
LAYER_MATMUL = 2 * H * H + 2 * H * K + 3 * H * F_

# bytes of an activation (c), of the residual stream (r), of a weight (w); autocast on or off
WIDTHS = {"fp32": (4, 4, 4, False), "bf16": (2, 4, 4, True), "bf16-pure": (2, 2, 2, False)}


@dataclasses.dataclass(frozen=True)
class Saved:
    activations: int  # tensors with a token dimension
    weight_copies: int  # the 16-bit weights autocast casts, saved for the backward's input gradients


def recording_backend(calls: list):
    """A ``torch.compile`` backend that partitions as inductor does and appends, for each run of a
    forward graph, its saved outputs that are not graph inputs: (shape, dtype, storage address, storage
    bytes)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table

    def forward_compiler(graph, inputs):
        placeholders = {node for node in graph.graph.nodes if node.op == "placeholder"}
        [output] = [node for node in graph.graph.nodes if node.op == "output"]
        saved = [node not in placeholders for node in output.args[0]]
        run = make_boxed_func(graph)

        def recorded(args):
            outputs = run(args)
            # the first output is the graph's own (the logits, or a layer's output), the rest is saved
            calls.append([(tuple(out.shape), out.dtype, out.untyped_storage().data_ptr(),
                           out.untyped_storage().nbytes())
                          for out, keep in zip(outputs[1:], saved[1:]) if keep and isinstance(out, torch.Tensor)])
            return outputs

        recorded._boxed_call = True
        return recorded

    return aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda graph, inputs: make_boxed_func(graph),
                        partition_fn=partition_fn, decompositions=select_decomp_table())


def saved_of(call: list, autocast: bool) -> Saved:
    """Bytes of one forward run's saved storages, each once. Random-number-generator states (kept for
    checkpointed regions, 16 bytes on a GPU) and the rotary tables' rows cast for the prompt (T x head
    dim) do not grow with the tokens."""
    activations = weight_copies = 0
    for shape, dtype, address, size in {address: (shape, dtype, address, size)
                                        for shape, dtype, address, size in call}.values():
        if dtype == torch.uint8 or shape == (T, D):
            continue
        if shape[0] in (B, N):
            activations += size
        else:
            assert len(shape) == 2 and autocast, shape
            weight_copies += size
    return Saved(activations, weight_copies)


def partition(precision: str, checkpointing: bool, fused: bool = False) -> Saved:
    """Compile the native model (``fused``: with its fused projections, as the run builds it on one GPU)
    as ``--compile`` does on one GPU, run one forward pass on the CPU, and sum the storages the forward
    graph saves. Parameters and buffers saved are already alive and cost nothing."""
    calls: list = []
    run = policy(precision)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_native(ARCH, "cpu", run.weight_dtype, fused=fused)
    model.activation_checkpointing = checkpointing
    model.compile(backend=recording_backend(calls))
    with run.autocast("cpu"):
        model(torch.randint(0, V, (B, T)))
    [call] = calls
    return saved_of(call, run.autocast_dtype is not None)


CASES = [pytest.param(precision, checkpointing, fused,
                      id=f"{precision}-{'ckpt' if checkpointing else 'full'}{'-fused' if fused else ''}")
         for precision in WIDTHS for checkpointing in (False, True) for fused in (False, True)
         if not (checkpointing and fused and precision != "bf16")]


@pytest.mark.parametrize("precision, checkpointing, fused", CASES)
def test_compiled_saved_bytes_match_the_partition(precision, checkpointing, fused):
    c, r, _, autocast = WIDTHS[precision]
    saved = partition(precision, checkpointing, fused)
    if checkpointing:
        layers = L * r * N * H  # each layer's input
    else:
        # built fused or apart, a layer saves the same: the fused q, k, v output is freed once v is copied
        layers = L * compiled.saved_per_layer(ARCH, N, c, r) - compiled.first_layer_saving(ARCH, N, c, r)
    assert saved.activations == layers + compiled.final_saved_bytes(ARCH, N, c, r, checkpointing)
    # autocast's copies, as eager saves them: every layer's and the output projection's, or with
    # checkpointing only the output projection's (the layers' are cast again in the recompute)
    copies = c * ((0 if checkpointing else L * LAYER_MATMUL) + V * H) if autocast else 0
    assert saved.weight_copies == copies
    # and the memory model's terms say the same
    terms = {t.name: t.bytes for t in estimate_memory(ARCH, "train", precision, B, T,
                                                      activation_checkpointing=checkpointing, compiled=True).terms}
    assert terms["activations"] + terms["final norm and output input"] == saved.activations
    assert terms.get("autocast weight copies", 0) == saved.weight_copies


def test_compiled_saved_per_layer_by_hand():
    # n = 10 tokens under bf16 autocast (c = 2, r = 4): the layer's input and the residual after
    # attention in fp32 (2 x 4 x 10 x 64), the two normalized matmul inputs (2 x 2 x 10 x 64), rotary
    # q and the attention output (2 x 2 x 10 x 64), k and v (2 x 2 x 10 x 32), the log-sum-exp
    # (4 x 10 x 4 heads), gate, up and their product (3 x 2 x 10 x 176) and two 1/rms (2 x 4 x 10)
    assert compiled.saved_per_layer(ARCH, 10, 2, 4) == 5_120 + 2_560 + 2_560 + 1_280 + 160 + 10_560 + 80 == 22_320
    # fp32 expands the grouped k and v to all heads (2 x 4 x 10 x 64), and r = c leaves the first layer as the rest
    assert compiled.saved_per_layer(ARCH, 10, 4, 4) == 5_120 + 5_120 + 5_120 + 5_120 + 160 + 21_120 + 80
    assert compiled.first_layer_saving(ARCH, 10, 2, 4) == 2 * 10 * 64
    assert compiled.first_layer_saving(ARCH, 10, 4, 4) == compiled.first_layer_saving(ARCH, 10, 2, 2) == 0
    # after the last layer: its output (4 x 10 x 64), 1/rms (4 x 10), the projection's input (2 x 10 x 64)
    assert compiled.final_saved_bytes(ARCH, 10, 2, 4, recompute=False) == 2_560 + 40 + 1_280
    assert compiled.final_saved_bytes(ARCH, 10, 2, 4, recompute=True) == 40 + 1_280


@pytest.mark.parametrize("fused", [False, True])
def test_compiled_per_layer_saved_bytes_match_the_partition(fused):
    """Compiled per decoder layer, as ``fitbench.worker.parallelize`` compiles under DDP and FSDP (after
    checkpointing, here of the first layer), bf16-pure as FSDP computes: the layer that keeps its
    activations saves a compiled layer's tensors, its input among them, a graph input of its own
    graph; the checkpointed layer's graph saves the same, which the checkpoint drops."""
    calls: list = []
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_native(ARCH, "cpu", torch.bfloat16, fused=fused)
    model.activation_checkpointing, model.checkpointed_layers = True, 1
    backend = recording_backend(calls)
    for layer in model.model.layers:
        layer.compile(backend=backend)
    x = torch.randint(0, V, (B, T))
    model(x)
    assert len(calls) == L
    saved = saved_of(calls[-1], autocast=False)
    # the kept layer's input is a graph input: the checkpointed layer's output, alive anyway (r n h);
    # built fused or apart, the same (v is copied out of the fused q, k, v output)
    assert saved.activations + 2 * N * H == compiled.saved_per_layer(ARCH, N, 2, 2)
    assert saved.weight_copies == 0
    # and the memory model says so for FSDP (one kept layer, one checkpointed)
    activations = {t.name: t.bytes for t in estimate_memory(
        ARCH, "train", "bf16-pure", B, T, activation_checkpointing=True, checkpointed_layers=1,
        parallelism=Parallelism("fsdp", 2), compiled=True).terms}["activations"]
    assert activations == 2 * N * H + compiled.saved_per_layer(ARCH, N, 2, 2)


@pytest.mark.parametrize("precision", list(WIDTHS))
@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_training_saves_what_eager_saves_but_at_the_first_and_last_layers(precision, checkpointing):
    """The eager layers' own operators save what the partition keeps (``fitbench.models.layer_ops``);
    compiled, the first layer keeps a 16-bit tensor for an fp32 one, and under checkpointing the last
    layer's output is recomputed with it, and the layers' 16-bit weight copies are cast inside the
    graph, where autocast's cache, which holds them in eager checkpointed training, does not reach."""
    c, r, _, autocast = WIDTHS[precision]
    arch, n, h = resolve("1B"), 4 * 2048, 2048
    eager = estimate_memory(arch, "train", precision, 4, 2048, activation_checkpointing=checkpointing)
    fused = estimate_memory(arch, "train", precision, 4, 2048, activation_checkpointing=checkpointing,
                            compiled=True)
    layer_copies = c * arch.num_layers * arch.layer_matmul_weights if autocast else 0
    expected = r * n * h + layer_copies if checkpointing else (r - c) * n * h
    assert eager.total_at(START) - fused.total_at(START) == expected
    eager_terms, fused_terms = ({t.name: t.bytes for t in e.terms} for e in (eager, fused))
    # what autograd keeps outside the compiled module, and the model's state, do not change
    for name in ("weights", "optimizer state", "gradients", "loss chain"):
        assert fused_terms[name] == eager_terms[name], name
    assert all(t.bytes >= 0 for t in fused.terms)


def test_compiled_embedding_gradient_accumulates_in_fp32_with_16_bit_weights():
    for precision, accumulator in (("bf16-pure", 4 * V * H), ("bf16", 0), ("fp32", 0)):
        estimate = estimate_memory(ARCH, "train", precision, B, T, compiled=True)
        terms = {t.name: t for t in estimate.terms}
        if accumulator:
            assert terms["embedding gradient accumulator"].bytes == accumulator
            assert terms["embedding gradient accumulator"].moments == frozenset({END})
        else:
            assert "embedding gradient accumulator" not in terms
        assert "embedding gradient accumulator" not in {t.name for t in estimate_memory(ARCH, "train", precision, B, T)
                                                        .terms}


@pytest.mark.parametrize("precision", list(WIDTHS))
def test_compiled_inference_temporaries_by_hand(precision):
    c, r, _, autocast = WIDTHS[precision]
    for mode, rows in (("forward", N), ("infer", B)):
        estimate = estimate_memory(ARCH, mode, precision, B, T, new_tokens=3, compiled=True)
        terms = {t.name: t.bytes for t in estimate.terms}
        # the residual after attention, the up projection's input, gate and up (the product over the
        # gate's), the up projection's 16-bit weight under autocast, the token ids
        assert terms["MLP temporaries"] == r * N * H + c * N * H + 2 * c * N * F_ + (c * H * F_ if autocast else 0) \
            + 8 * N
        assert terms["output projection"] == c * N * H + c * rows * V + (c * V * H if autocast else 0)
        eager = {t.name: t.bytes for t in estimate_memory(ARCH, mode, precision, B, T, new_tokens=3).terms}
        assert terms["MLP temporaries"] < eager["MLP temporaries"]
        assert estimate.moments == (MLP, OUTPUT)


def test_compiled_worked_example_1b():
    """1B, bf16 autocast, 4 x 2048 tokens: 16 layers of 16 n h + 4 n k + 4 n H + 6 n f + 8 n bytes,
    less 2 n h in the first; eager saves the 16 layers whole."""
    n, h, k, f, heads, layers = 4 * 2048, 2048, 512, 8192, 32, 16
    eager = layers * (16 * n * h + 4 * n * k + 4 * n * heads + 6 * n * f + 8 * n)
    arch = resolve("1B")

    def activations(**options) -> float:
        terms = estimate_memory(arch, "train", "bf16", 4, 2048, **options).terms
        return {t.name: t.bytes for t in terms}["activations"]

    assert activations(compiled=True) == eager - 2 * n * h == 10_990_125_056
    assert activations() == eager


def test_predict_spec_predicts_the_compiled_model():
    target = GpuTarget("NVIDIA H200", 1, 150e9, described=False)

    def prediction(compile_: bool) -> dict:
        spec = RunSpec(model="1B", backend="native", mode="train", precision="bf16", batch_size=4, seq_len=2048,
                       new_tokens=8, device="cuda:0", warmup_steps=1, measure_steps=1, compile=compile_)
        return predict_spec(resolve("1B"), spec, target, DEFAULT, choose_precision=False, choose_recompute=False,
                            runnable=RUNNABLE)[1]

    eager, fused = prediction(False), prediction(True)
    assert fused["tensor_peak_bytes"] == estimate_memory(resolve("1B"), "train", "bf16", 4, 2048,
                                                         compiled=True).peak_bytes
    assert eager["tensor_peak_bytes"] == estimate_memory(resolve("1B"), "train", "bf16", 4, 2048).peak_bytes
    assert eager["tensor_peak_bytes"] - fused["tensor_peak_bytes"] == 2 * 4 * 2048 * 2048  # the first layer's
    assert Candidate("bf16", Layout(), False, 4, compiled=True).label == "bf16, 1 GPU, compiled, batch 4"


@pytest.mark.parametrize("mode", ["train", "forward"])
def test_other_families_keep_the_eager_model_when_compiled(mode):
    """Only the native (Llama-family) decoder's compiled graph has been read; GPT-2 runs on the hf
    backend, whose compiled graph differs, and gets the eager terms."""
    gpt2 = resolve("gpt2")
    eager = estimate_memory(gpt2, mode, "bf16", 2, 256)
    assert estimate_memory(gpt2, mode, "bf16", 2, 256, compiled=True).as_dict() == eager.as_dict()
    llama = resolve("tiny")
    assert estimate_memory(llama, mode, "bf16", 2, 256, compiled=True).peak_bytes \
        < estimate_memory(llama, mode, "bf16", 2, 256).peak_bytes


def test_compiled_next_layer_recomputed_ahead_by_hand():
    """Checkpointed layers compiled as one graph: the next layer's recomputed activations beside the
    first layer's backward, less one layer's gradients (``compiled.recompute_ahead_bytes``)."""
    # n = 10 tokens in bf16-pure (c = r = w = 2): 2 r n h + 2 c n h + 2 c n h + 2 c n k + 4 n H + 3 c n f + 8 n
    one = 4 * 10 * 64 + 4 * 10 * 64 + 4 * 10 * 64 + 4 * 10 * 32 + 4 * 10 * 4 + 6 * 10 * 176 + 8 * 10
    assert compiled.saved_per_layer(ARCH, 10, 2, 2) == one == 19_760
    assert compiled.recompute_ahead_bytes(ARCH, 10, 2, 2, 2 * 1_000) == one - 2_000
    assert compiled.recompute_ahead_bytes(ARCH, 10, 2, 2, 10 ** 9) == 0  # never negative
    # in the estimate: at the first layer's backward, with w p the layer's own parameters
    p = LAYER_MATMUL + 2 * H  # the matrices and the two norms
    terms = {t.name: t for t in estimate_memory(ARCH, "train", "bf16-pure", B, T, activation_checkpointing=True,
                                                compiled=True).terms}
    ahead = terms["next layer recomputed ahead"]
    assert ahead.bytes == compiled.saved_per_layer(ARCH, N, 2, 2) - 2 * p
    assert ahead.moments == frozenset({FIRST})


@pytest.mark.parametrize("options", [dict(compiled=False), dict(checkpointed_layers=1),
                                     dict(activation_checkpointing=False),
                                     dict(parallelism=Parallelism("fsdp", 2))])
def test_compiled_next_layer_recomputed_ahead_only_in_one_graph_of_checkpointed_layers(options):
    """Not eager, not with one checkpointed layer (no next one), not without checkpointing (nothing
    recomputed), not under FSDP (each layer a graph of its own)."""
    kwargs = dict(activation_checkpointing=True, compiled=True) | options
    names = {t.name for t in estimate_memory(ARCH, "train", "bf16-pure", B, T, **kwargs).terms}
    assert "next layer recomputed ahead" not in names
