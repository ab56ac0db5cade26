"""The step-time forecast (fitbench.planning.forecast): each term recomputed by hand on a small case, the
counts it takes from fitbench's own step counted again in the real step on the CPU, and each constant
solved again from the measured row it names (benchmarks/results)."""

import dataclasses
import functools
import importlib.util
import json
import re
import statistics
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fitbench.planning.collectives as collectives
import fitbench.planning.forecast as forecast
from fitbench import precisions
from fitbench.hardware import ceilings as hardware_ceilings, datasheet
from fitbench.hardware.environment import torch_version
from fitbench.models.backends import NativeLM, load_model
from fitbench.models.native import DecoderConfig, NativeCausalLM
from fitbench.models.registry import resolve
from fitbench.planning.calibration import DEFAULT
from fitbench.planning.collectives import BusBandwidth
from fitbench.planning.forecast import (Ceilings, StepRun, ceilings, decode_format, forecast_spec, forecast_step_time,
                                    layer_traffic, side_by_side, step_run)
from fitbench.planning.sharding import Parallelism
from fitbench.planning.terms import Widths
from fitbench.planning.planner import GpuTarget, predict_spec
from fitbench.precisions import DENSE, entry, policy
from fitbench.precisions.entry import DecodeFormat
from fitbench.worker.cross_entropy import cross_entropy
from fitbench.worker.loops import make_step, random_tokens
from fitbench.spec import Layout, RunSpec

ROOT = Path(__file__).parent.parent
RESULTS = ROOT / "benchmarks/results"
H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"
TINY = dataclasses.replace(resolve("tiny"), vocab_size=512)
# A tiny configuration of each block of the native decoder, counted in its real step: Llama's (tiny);
# Falcon's new decoder block, grouped key/value heads and two LayerNorms (falcon-40b's); Falcon-7B's
# multi-query block with one LayerNorm (its config's new_decoder_architecture off); GPT-2's.
BLOCK_SIZES = dict(hidden_size=256, num_heads=8, ffn_size=1024, vocab_size=512, max_seq_len=1024)
BLOCKS = {
    "llama": TINY,
    "falcon-grouped": dataclasses.replace(resolve("falcon-40b"), name="tiny-falcon", num_kv_heads=2, **BLOCK_SIZES),
    "falcon-multi-query": dataclasses.replace(resolve("falcon-40b"), name="tiny-falcon-7b", num_kv_heads=1,
                                              extra_hf_config={"new_decoder_architecture": False,
                                                               "multi_query": True}, **BLOCK_SIZES),
    "gpt2": dataclasses.replace(resolve("gpt2"), name="tiny-gpt2", num_kv_heads=8, **BLOCK_SIZES),
}
# Round figures, so that a forecast can be worked out by hand.
ROUND = Ceilings(matmul=500e12, bandwidth=2e12, source="test")


# ---- counting the real step ------------------------------------------------------------------

# ATen's views and allocations of storage nobody has written yet: nothing to launch, little to dispatch.
NO_KERNEL = {"view", "_unsafe_view", "t", "transpose", "expand", "split", "chunk", "slice", "select", "unsqueeze",
             "squeeze", "reshape", "alias", "detach", "split_with_sizes", "as_strided", "permute", "_reshape_alias",
             "unbind", "empty", "empty_like", "lift_fresh", "new_empty", "empty_strided", "new_empty_strided"}
MATMULS = {"mm", "addmm", "bmm", "linear", "matmul"}
INDEXED = {"gather", "scatter", "scatter_", "scatter_add", "scatter_add_"}


class Counted(TorchDispatchMode):
    """Every operator dispatched but ``NO_KERNEL``'s, and the bytes the elementwise ones read and write
    (inputs and outputs; an operator whose output is its input, such as a cast to the dtype it has,
    moves nothing; one writing into ``out=`` reads its other inputs and writes that; a gather or a
    scatter moves only the elements its index names)."""

    def __init__(self):
        super().__init__()
        self.operators = 0
        self.elementwise_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        if name in NO_KERNEL:
            return out
        self.operators += 1
        if name in INDEXED:
            index = next(a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.long)
            self.elementwise_bytes += index.numel() * (index.element_size() + 2 * args[0].element_size())
            return out
        given = {key: value for key, value in kwargs.items() if key != "out"}
        inputs = [t for t in tree_flatten((args, given))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        aliased = not name.endswith("_") and any(t.untyped_storage().data_ptr() in storages for t in outputs)
        if name not in MATMULS and not aliased:
            self.elementwise_bytes += sum(t.numel() * t.element_size() for t in inputs + outputs)
        return out


def native(arch, layers: int, precision: str, fused: bool = True) -> NativeLM:
    arch = dataclasses.replace(arch, num_layers=layers)
    module = NativeCausalLM(DecoderConfig.from_architecture(arch), fused)
    module.init_weights()
    module.to(policy(precision).weight_dtype)
    module.rope_cos.data, module.rope_sin.data = module.rope_cos.float(), module.rope_sin.float()
    return NativeLM(module, cache_dtype=torch.bfloat16)


@functools.lru_cache(maxsize=None)
def count_step(layers: int, precision: str, mode: str, tokens: int = 32, fused: bool = True,
               recompute: bool = False, block: str = "llama") -> Counted:
    """One step of fitbench's training loop (``make_step``) on the tiny ``block`` (``BLOCKS``), on the CPU,
    counted after two to warm up; remembered, as several tests count the same steps."""
    arch = BLOCKS[block]
    lm = native(arch, layers, precision, fused)
    lm.module.activation_checkpointing = recompute
    step = make_step(mode, lm, policy(precision), random_tokens(arch.vocab_size, 2, tokens + 1, torch.device("cpu"), 0),
                     torch.device("cpu"))
    step(), step()
    with Counted() as counted:
        step()
    return counted


def per_layer(count, *args, **kwargs) -> tuple[float, float]:
    """(operators, elementwise bytes) of one layer: the step with two layers less the step with one."""
    one, two = count(1, *args, **kwargs), count(2, *args, **kwargs)
    return two.operators - one.operators, two.elementwise_bytes - one.elementwise_bytes


def per_token(precision: str, mode: str, recompute: bool = False, block: str = "llama") -> float:
    """Elementwise bytes of one layer per token: a layer's bytes at 2 x 32 tokens less at 2 x 16, over
    the 32 tokens between (what each weight costs once a step, autocast's casts, falls out)."""
    def layer(tokens: int) -> float:
        return per_layer(lambda layers: count_step(layers, precision, mode, tokens, recompute=recompute,
                                                   block=block))[1]

    return (layer(32) - layer(16)) / (2 * 16)


def test_the_blocks_counted_are_the_variants_they_name():
    """Each tiny configuration builds the block it stands for: Falcon's two with grouped heads and two
    LayerNorms, and with one key/value head and one LayerNorm; GPT-2's with learned positions."""
    configs = {name: DecoderConfig.from_architecture(arch) for name, arch in BLOCKS.items()}
    assert (configs["falcon-grouped"].n_kv_heads, configs["falcon-grouped"].shared_norm) == (2, False)
    assert (configs["falcon-multi-query"].n_kv_heads, configs["falcon-multi-query"].shared_norm) == (1, True)
    assert configs["falcon-grouped"].parallel_attention and configs["falcon-multi-query"].parallel_attention
    assert (configs["gpt2"].positions, configs["gpt2"].mlp, configs["gpt2"].linear_bias) == ("learned", "gelu_tanh",
                                                                                           True)
    assert (configs["llama"].norm, configs["llama"].mlp) == ("rms", "swiglu")


@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("precision", ["bf16-pure", "bf16", "fp32"])
def test_a_layers_elementwise_traffic_is_what_the_real_forward_moves(precision, block):
    """``layer_traffic`` per token against the bytes of every elementwise operator of a layer's forward,
    counted in the native decoder's block (attention's kernel on the CPU reads and writes what a GPU's
    does)."""
    got = layer_traffic(BLOCKS[block], Widths.of(precision))
    assert got == pytest.approx(per_token(precision, "forward", block=block), rel=0.06)


@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("precision, recompute", [("bf16-pure", False), ("bf16", False), ("fp32", False),
                                                  ("bf16-pure", True)])
def test_a_layers_backward_moves_what_backward_traffic_says(precision, recompute, block):
    """A training step's elementwise bytes per layer, through the native decoder's Functions where its
    block has them, against its forward's: 1 + FUNCTIONS_BACKWARD_TRAFFIC (and
    FUNCTIONS_RECOMPUTED_TRAFFIC more when the layer is recomputed) of its family, counted in the real
    step."""
    family = BLOCKS[block].family
    forward = per_token(precision, "forward", block=block)
    training = per_token(precision, "train", recompute, block=block)
    widths = Widths.of(precision)
    passes = 1 + forecast.FUNCTIONS_BACKWARD_TRAFFIC[family][(widths.residual, widths.compute)]
    passes += forecast.FUNCTIONS_RECOMPUTED_TRAFFIC[family] if recompute else 0
    assert training / forward == pytest.approx(passes, rel=0.05)


# A decode step writes each layer's keys and values into the cache (``write_cache``): two operators
# that a forward pass, without a cache, does not launch.
CACHE_WRITES = 2


@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("fused", [True, False])
def test_a_native_layer_launches_layer_ops_operators(fused, block):
    """A layer's operators in a decode step are ``layer_ops``; in a forward pass, all but the cache writes;
    the edges of the decode step about ``EDGE_OPS``' of the block's family."""
    arch = BLOCKS[block]

    def decode(layers: int) -> Counted:
        lm = native(arch, layers, "bf16-pure", fused)
        cache = lm.module.new_cache(2, 64, torch.bfloat16)
        tokens, position = torch.zeros(2, 1, dtype=torch.long), torch.tensor([5])
        with torch.inference_mode():
            lm.module.decode_step(tokens, cache, position)
            with Counted() as counted:
                lm.module.decode_step(tokens, cache, position)
        return counted

    operators, _ = per_layer(decode)
    assert operators == forecast.layer_ops(arch, "native", fused)
    forward, _ = per_layer(lambda layers: count_step(layers, "bf16-pure", "forward", fused=fused, block=block))
    assert forward == operators - CACHE_WRITES
    assert decode(1).operators - operators == pytest.approx(forecast.EDGE_OPS[arch.family]["forward"], abs=4)


@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("fused", [True, False])
def test_autocast_adds_a_cast_of_each_weight_bias_and_norm_output(fused, block):
    """The operators a layer adds in a forward pass under bf16 autocast against the same pass in bf16:
    a cast of each matmul's weight, of each bias, and of each matmul input a norm wrote (q/k/v's, as one
    or three; the MLP's up, and Llama's gate, as one or two). The Falcon and GPT-2 blocks'
    ``autocast_casts``; Llama's keeps one per matmul, as its measured rows were forecast."""
    arch = BLOCKS[block]
    pure, autocast = (per_layer(lambda layers: count_step(layers, precision, "forward", fused=fused, block=block))[0]
                      for precision in ("bf16-pure", "bf16"))
    matmuls = forecast.layer_matmuls(arch, "native", fused)
    q_k_v = 1 if fused else 3
    biases = sum(m.bias for m in arch.layer_matrices) + (q_k_v - 1 if arch.layer_matrices[0].bias else 0)
    norm_outputs = q_k_v + (2 if arch.family == "llama" and not fused else 1)
    assert autocast - pure == matmuls + biases + norm_outputs
    expected = matmuls if arch.family == "llama" else autocast - pure
    assert forecast.autocast_casts(arch, "native", fused) == expected


@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("precision, fused", [("bf16-pure", True), ("bf16", True), ("bf16-pure", False),
                                              ("bf16", False)])
def test_a_training_step_launches_backward_ops_per_forward_operator(precision, fused, block):
    """A layer's training operators through the native decoder's Functions against the forecast's: its
    forward operators times 1 + FUNCTIONS_BACKWARD_OPS of its family, and each of autocast's casts twice
    (none for Llama: its norm writes the matmuls' dtype); the edges and each chunk of the loss besides."""
    arch = BLOCKS[block]
    operators, _ = per_layer(lambda layers: count_step(layers, precision, "train", fused=fused, block=block))
    forward_ops = forecast.layer_ops(arch, "native", fused)
    casts = forecast.autocast_casts(arch, "native", fused, functions=True) if Widths.of(precision).autocast else 0
    backward_ops = forecast.FUNCTIONS_BACKWARD_OPS[arch.family]["fused" if fused else "unfused"]
    assert operators == pytest.approx(forward_ops * (1 + backward_ops) + 2 * casts, rel=0.08)


@pytest.mark.parametrize("block", list(BLOCKS))
def test_a_recomputed_layer_launches_its_forward_again(block):
    arch = BLOCKS[block]
    plain, recomputed = (per_layer(lambda layers: count_step(layers, "bf16-pure", "train", recompute=recompute,
                                                             block=block))[0]
                         for recompute in (False, True))
    expected = forecast.layer_ops(arch, "native") * forecast.FUNCTIONS_RECOMPUTED_OPS[arch.family]
    assert recomputed - plain == pytest.approx(expected)


@pytest.mark.parametrize("block", list(BLOCKS))
def test_the_edges_and_each_loss_chunk_launch_their_operators(block, monkeypatch):
    import fitbench.models.loss

    monkeypatch.setattr(fitbench.models.loss, "LOSS_CHUNK_BYTES", 4 * BLOCKS[block].vocab_size * 8)  # 8 rows a chunk
    uncached = count_step.__wrapped__  # chunks of 8 rows are this test's alone
    few, many = (uncached(1, "bf16-pure", "train", tokens=tokens, block=block) for tokens in (16, 32))
    layer, _ = per_layer(lambda layers: uncached(layers, "bf16-pure", "train", tokens=16, block=block))
    chunks = 2 * 16 // 8
    assert (many.operators - few.operators) / chunks == forecast.LOSS_CHUNK_OPS
    edges = forecast.EDGE_OPS[BLOCKS[block].family]["training"]
    assert few.operators - layer - chunks * forecast.LOSS_CHUNK_OPS == edges


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_loss_moves_what_loss_traffic_says(dtype):
    """The fused training loss's elementwise bytes per token on logits a matmul formed (whose write
    ``loss_traffic`` counts): 64 rows less 32, over the 32 between."""
    vocab, hidden = 512, 64

    def count(rows: int) -> int:
        x = torch.randn(rows, hidden, dtype=dtype, requires_grad=True)
        w = torch.randn(hidden, vocab, dtype=dtype, requires_grad=True)
        with Counted() as counted:
            cross_entropy(x @ w, torch.randint(0, vocab, (rows,))).backward()
        return counted.elementwise_bytes

    compute = torch.finfo(dtype).bits // 8
    per_token = (count(64) - count(32)) / 32 + compute * vocab
    assert per_token == pytest.approx(forecast.loss_traffic(vocab, compute, True), rel=0.06)


@pytest.mark.parametrize("model", ["gpt2", "falcon-40b", "falcon-180b", "7B", "llama-3.1-8b"])
def test_a_transformers_layer_launches_what_the_probe_counted(model):
    """The forecast's operators per transformers layer (the installed version's, counted once on the
    probe model) against a layer of a model of other sizes, batch and prompt, built and run as the hf
    backend runs it: the count is the layer's, not the probe's sizes'."""
    base = resolve(model)

    def decode(layers: int) -> Counted:
        kv = 8 if base.num_kv_heads == base.num_heads else 1 if base.num_kv_heads == 1 else 2
        arch = dataclasses.replace(base, num_layers=layers, hidden_size=256, num_heads=8, num_kv_heads=kv,
                                   ffn_size=1024, vocab_size=512, max_seq_len=128)
        lm = load_model(arch, "hf", "cpu", torch.bfloat16)
        with torch.inference_mode():
            lm.prefill(torch.zeros(3, 8, dtype=torch.long), 32)
            lm.decode(torch.zeros(3, 1, dtype=torch.long))
            with Counted() as counted:
                lm.decode(torch.zeros(3, 1, dtype=torch.long))
        return counted

    operators, _ = per_layer(lambda layers: decode(layers + 1))
    assert operators == forecast.layer_ops(base, "hf")


def test_the_layer_operators_are_counted_once_per_transformers_version(tmp_path, monkeypatch):
    """``layer_operators`` counts once and keeps the count under the installed versions; the next
    planner reads the kept count (changed here, so that reading it back shows)."""
    import transformers

    from fitbench.models import hf_operators

    monkeypatch.setenv("FITBENCH_CACHE_DIR", str(tmp_path))
    hf_operators._operators.cache_clear()
    try:
        arch = resolve("falcon-40b")
        counted = hf_operators.layer_operators(arch)
        path = tmp_path / "hf-layer-operators.json"
        (versions, kept), = json.loads(path.read_text()).items()
        assert f"transformers {transformers.__version__}" in versions
        (key, entry), = kept.items()
        assert entry == {"operators": counted}
        path.write_text(json.dumps({versions: {key: {"operators": counted + 5}}}))
        hf_operators._operators.cache_clear()
        assert forecast.layer_ops(arch, "hf") == counted + 5
    finally:
        hf_operators._operators.cache_clear()


def test_the_counts_kept_for_older_versions_are_what_those_versions_launch():
    """``COUNTED_UNDER`` holds the counts of the versions committed rows ran; where the installed
    transformers is one of them (CI's oldest environment), counting again gives the table's."""
    import transformers

    from fitbench.models import hf_operators

    counted = hf_operators.COUNTED_UNDER.get(transformers.__version__)
    if counted is None:
        pytest.skip(f"transformers {transformers.__version__} is not among COUNTED_UNDER's versions")
    for key, operators in counted.items():
        model_type, kv_heads = key.split("|")
        assert hf_operators.count_layer_operators(model_type, int(kv_heads)) == operators, key


# ---- each term by hand on a small case ----------------------------------------------------------

def test_a_graphed_decode_step_reads_its_weights_and_cache_and_replays_its_kernels():
    """tiny, bf16, batch 2, 64-token prompt, 8 new tokens, through a graph of the eager step."""
    arch = resolve("tiny")
    got = forecast_step_time(arch, "infer", "bf16-pure", 2, 64, new_tokens=8, parallelism=Parallelism(),
                             gpu_name=H100, ceiling=ROUND, run=StepRun(decode="graph"))
    h, L, V = arch.hidden_size, arch.num_layers, arch.vocab_size
    # every parameter but the embedding table's unused rows (tied: the output projection reads them all)
    weights = 2 * arch.total_params
    cache = 2 * L * arch.num_kv_heads * arch.head_dim * 2 * 2 * (64 + 8)  # k and v, bf16, batch 2, 72 slots
    memory = (weights + cache) / 2e12
    matmuls = 2 * 2 * arch.matmul_params / (500e12 * forecast.MATMUL_EFFICIENCY)
    kernels = (43 * L + 12) * forecast.KERNEL_S
    assert memory > matmuls and V * h < arch.total_params
    assert got.seconds == pytest.approx(memory + kernels)
    assert got.host_s == 0 and got.launches == 43 * L + 12


def test_an_eager_decode_step_runs_its_host_and_device_side_by_side():
    arch = resolve("7B")
    graphed, eager = (forecast_step_time(arch, "infer", "bf16-pure", 1, 128, new_tokens=128,
                                         parallelism=Parallelism(), gpu_name=H100, ceiling=ROUND,
                                         run=StepRun(decode=decode)) for decode in ("graph", "eager"))
    launches = 43 * 32 + 12
    assert eager.host_s == pytest.approx(launches * forecast.HOST_OP_S["inference"])
    # eager decoding attends over the positions so far (128 + 64 on average), the graph over every slot
    cache = arch.kv_cache_bytes_per_token(2)
    assert graphed.device_s - eager.device_s == pytest.approx(cache * 64 / 2e12)
    assert eager.seconds == pytest.approx(side_by_side(eager.device_s, eager.host_s))
    hf = forecast_step_time(arch, "infer", "bf16-pure", 1, 128, new_tokens=128, parallelism=Parallelism(),
                            gpu_name=H100, ceiling=ROUND, run=StepRun("hf", decode="graph"))
    assert hf.host_s == pytest.approx(launches * forecast.HF_HOST_OP_S)  # transformers decodes eagerly


def test_transformers_stages_add_host_time_per_layer_and_newer_versions_run_the_clocks_one_after_the_other():
    """A decode step of transformers' layers over 2 stages: its operators' host time as on one GPU plus
    HF_STAGED_LAYER_HOST_S per layer (accelerate's hooks); under a transformers version from
    HF_SERIAL_DECODE_SINCE on, the step lasts device + host, else the two side by side."""
    arch = resolve("7B")
    staged = Parallelism(layout=Layout(pp=2))
    old, new = (forecast_step_time(arch, "infer", "bf16-pure", 1, 128, new_tokens=128, parallelism=staged,
                                   gpu_name=H100, ceiling=ROUND, run=StepRun("hf", transformers=version))
                for version in ("5.17.0", "5.24.0"))
    launches = 43 * 32 + 12
    assert old.host_s == pytest.approx(launches * 17.0e-6 + 32 * 374e-6)
    assert new.host_s == old.host_s and new.device_s == old.device_s
    assert old.seconds - old.communication_s == pytest.approx(side_by_side(old.device_s, old.host_s))
    assert new.seconds - new.communication_s == pytest.approx(old.device_s + old.host_s)
    one = forecast_step_time(arch, "infer", "bf16-pure", 1, 128, new_tokens=128, parallelism=Parallelism(),
                             gpu_name=H100, ceiling=ROUND, run=StepRun("hf", transformers="5.17.0"))
    assert one.host_s == pytest.approx(launches * 17.0e-6)  # one GPU: no hooks
    assert [forecast.hf_serial_decode(v) for v in ("4.57.1", "5.17.0", "5.23.2", "5.24.0", "5.30.0.dev0", "6.0")] \
        == [False, False, False, True, True, True]


def test_the_staged_transformers_host_time_is_the_median_of_the_pipelined_rows(monkeypatch):
    """Each committed pipelined decode row of transformers 5.17 (which overlaps host and device) solved
    for the host time per layer at which its forecast equals its measured step: the constant is their
    median, each inside 100 to 600 us; the 5.24 row, its clocks one after the other, solves within 10% of
    the 5.17 row of the same machine and configuration."""
    monkeypatch.setattr(forecast, "HF_STAGED_LAYER_HOST_S", forecast.HF_STAGED_LAYER_HOST_S)
    solved = {}
    for directory in ("2026-11-24-h200x2-model-parallel", "2026-11-27-h100x4-hf-versions",
                      "2026-11-27-h100x4-model-parallel"):
        for path in sorted((RESULTS / directory).rglob("results.jsonl")):
            for row in map(json.loads, path.read_text().splitlines()):
                spec = row["spec"]
                if row["status"] == "ok" and spec["backend"] == "hf" and spec["layout"]["pp"] > 1:
                    key = (str(path.parent.relative_to(RESULTS)), spec["batch_size"])
                    solved[key] = solve(constant("HF_STAGED_LAYER_HOST_S"), row, 0.0, 5e-3)
    version_517 = [value for (where, _), value in solved.items() if "hf-5.24" not in where]
    assert len(version_517) == 5
    assert all(100e-6 < value < 600e-6 for value in version_517), solved
    assert statistics.median(version_517) == pytest.approx(374e-6, rel=0.03)
    same_machine = solved[("2026-11-27-h100x4-hf-versions/hf-5.17/1", 1)]
    assert solved[("2026-11-27-h100x4-hf-versions/hf-5.24/1", 1)] == pytest.approx(same_machine, rel=0.1)


def test_a_compiled_decode_step_replays_fewer_kernels():
    arch = resolve("7B")
    graphed, compiled = (forecast_step_time(arch, "infer", "bf16-pure", 1, 512, new_tokens=128,
                                            parallelism=Parallelism(), gpu_name=H200, ceiling=ROUND,
                                            run=StepRun(decode=decode)) for decode in ("graph", "compiled"))
    assert graphed.terms["memory"] == compiled.terms["memory"]
    assert graphed.seconds - compiled.seconds == pytest.approx(
        (43 - forecast.COMPILED_LAYER_KERNELS) * 32 * forecast.KERNEL_S)


def rate_by_hand(fmt) -> float:
    """The weights' read rate on ``ROUND``'s ceilings (2 TB/s, 500 TFLOP/s): the bandwidth's share, or
    the arithmetic's rate where the format has one and it is lower."""
    share = fmt.efficiency * 2e12
    return min(share, fmt.bytes_per_matmul_flop * 500e12) if fmt.bytes_per_matmul_flop else share


@pytest.mark.parametrize("precision", ["int8-weight-only", "nf4", "fp8", "int4"])
def test_a_quantized_decode_step_reads_its_format_and_launches_its_kernels(precision):
    """Each format's terms by hand, 7B at batch 4 through a graph (nf4 dequantizes above one token)."""
    arch = resolve("7B")
    batch, prompt, new = 4, 256, 32
    got = forecast_step_time(arch, "infer", precision, batch, prompt, new_tokens=new, parallelism=Parallelism(),
                             gpu_name=H200, ceiling=ROUND, run=StepRun(decode="graph"))
    fmt = decode_format(precision, "graph", batch)
    assert fmt == (entry(precision).decode.eager_more_tokens or entry(precision).decode.eager)
    L, h, V = arch.num_layers, arch.hidden_size, arch.vocab_size
    weights = arch.layer_matmul_weights * L
    stored = sum(entry(precision).storage.matrix_bytes(m.rows, m.columns) for m in arch.layer_matrices) * L
    plain = 2 * (arch.total_params - weights - (V - batch) * h)  # norms, the output projection, 4 embedding rows
    cache = arch.kv_cache_bytes_per_token(2) * batch * (prompt + new)
    rate = rate_by_hand(fmt)
    memory = (stored + fmt.dequantized * weights) / rate + (plain + cache) / 2e12
    kernels = ((46 + 7 * fmt.extra_kernels) * L + 12) * forecast.KERNEL_S
    assert got.seconds == pytest.approx(memory + kernels)
    # compiled: the stored weights (and nf4's dequantized copy above one token) read at the compiled
    # format's rate, the compiled step's kernels
    compiled = forecast_step_time(arch, "infer", precision, batch, prompt, new_tokens=new, parallelism=Parallelism(),
                                  gpu_name=H200, ceiling=ROUND, run=StepRun(decode="compiled"))
    fmt = decode_format(precision, "compiled", batch)
    assert fmt == (entry(precision).decode.compiled_more_tokens or entry(precision).decode.compiled)
    rate = rate_by_hand(fmt)
    assert compiled.seconds == pytest.approx(
        (stored + fmt.dequantized * weights) / rate + (plain + cache) / 2e12
        + ((forecast.COMPILED_LAYER_KERNELS + 7 * fmt.extra_kernels) * L + 12) * forecast.KERNEL_S)


def test_bitsandbytes_four_bit_decodes_one_token_in_its_gemv_kernel():
    assert decode_format("nf4", "graph", 1) is entry("nf4").decode.eager
    assert decode_format("fp4", "eager", 8) is entry("fp4").decode.eager_more_tokens
    assert decode_format("bf16-pure", "graph", 8) is DENSE


def test_fp8_weight_only_past_one_token_is_its_batch_1_rate_times_its_kernels_slowdown():
    """No fp8-weight-only row past batch 1: its kernels' read rate at batch 8 over batch 1 in the kernel
    benchmark's log scales the efficiency solved from the batch-1 row."""
    log = (RESULTS / "2026-11-24-h200-engine-profiles/kernels/fp8-wo.log").read_text()
    b1, b8 = (float(re.search(rf"{batch}\s+[\d.]+ us\s+(\d+) GB/s", log).group(1)) for batch in ("b1", "b8"))
    one = decode_format("fp8-weight-only", "compiled", 1).efficiency
    assert decode_format("fp8-weight-only", "compiled", 8).efficiency == pytest.approx(one * b8 / b1, rel=0.03)


def test_compiled_int4_and_int8_weight_only_read_slower_past_one_token_and_fp8_does_not():
    """The compiled formats' kernels past batch 1 (``benchmarks/decode_kernels.py``): tinygemm and
    torchao's int8 weight-only read far slower, the fp8 matmul as fast; bf16 is the dense step's."""
    for precision in ("int4", "int8-weight-only"):
        one, more = (decode_format(precision, "compiled", tokens).read_rate(ROUND.bandwidth, ROUND.matmul)
                     for tokens in (1, 8))
        assert more < one / 2
    assert decode_format("fp8", "compiled", 1) is decode_format("fp8", "compiled", 32)
    assert decode_format("bf16-pure", "compiled", 8) is DENSE


def test_an_arithmetic_bound_format_reads_at_its_share_of_the_matmul_ceiling_below_the_bandwidths():
    """read_rate = min(efficiency x bandwidth, bytes_per_matmul_flop x matmul FLOP/s), by hand."""
    bound = DecodeFormat(0.5, bytes_per_matmul_flop=2e-3)
    assert bound.read_rate(2e12, 500e12) == pytest.approx(1e12)  # 0.5 x 2 TB/s against 2e-3 x 500 TFLOP/s
    assert bound.read_rate(4e12, 500e12) == pytest.approx(1e12)  # more bandwidth: the arithmetic's 1 TB/s
    assert bound.read_rate(1e12, 500e12) == pytest.approx(0.5e12)  # less: the bandwidth's share
    assert DecodeFormat(0.5).read_rate(4e12, 500e12) == pytest.approx(2e12)


def test_int4_solved_on_an_h200_forecasts_the_h100_rows_it_never_saw():
    """tinygemm's terms come from H200 rows; the H100 rows of the same steps, eager and compiled, are
    forecast within 6% (a bandwidth share solved on the H200 would put the compiled one 27% slow)."""
    row_error = error_script().row_error
    for directory in ("2026-11-22-h100-quantized-decode/decode", "2026-11-27-h100-int4-decode"):
        row = measured_row(directory, precision="int4")
        assert "H100" in row["device_name"]
        measured, forecast_s = row_error(row)
        assert forecast_s == pytest.approx(measured, rel=0.06)


def test_a_training_step_by_hand():
    """tiny, bf16-pure, 4 x 128, on round ceilings: each term worked out from the architecture."""
    arch = resolve("tiny")
    n, T = 4 * 128, 128
    got = forecast_step_time(arch, "train", "bf16-pure", 4, T, new_tokens=1, parallelism=Parallelism(),
                             gpu_name=H100, ceiling=ROUND)
    L, h, f, V = arch.num_layers, arch.hidden_size, arch.ffn_size, arch.vocab_size
    k = arch.num_kv_heads * arch.head_dim
    matmuls = 2 * n * arch.matmul_params * 3 / (500e12 * forecast.MATMUL_EFFICIENCY)
    attention = 2 * L * arch.num_heads * arch.head_dim * T * n * 3.5 / (500e12 * forecast.ATTENTION_EFFICIENCY)
    # per token and layer, bf16: two norms (42 h each), rotary 20 (h + k), attention's tensors 4 (h + k),
    # two residual adds 6 h each, SwiGLU 10 f; the Functions' training step about twice the forward; the
    # fused loss (6 x 2 + 20) V
    layer = 2 * 42 * h + 20 * (h + k) + 4 * (h + k) + 2 * 6 * h + 10 * f
    assert layer_traffic(arch, Widths.of("bf16-pure")) == layer
    memory = (n * L * layer * (1 + forecast.FUNCTIONS_BACKWARD_TRAFFIC["llama"][(2, 2)]) + n * (6 * 2 + 20) * V) / 2e12
    optimizer = 7 * 2 * arch.total_params / 2e12
    backward_ops = forecast.FUNCTIONS_BACKWARD_OPS["llama"]["fused"]
    launches = L * 43 * (1 + backward_ops) + forecast.EDGE_OPS["llama"]["training"] + forecast.LOSS_CHUNK_OPS
    device = matmuls + attention + memory + optimizer + launches * forecast.KERNEL_S
    host = launches * forecast.HOST_OP_S["training"] + optimizer
    assert got.launches == pytest.approx(launches)
    assert (got.device_s, got.host_s) == pytest.approx((device, host))
    assert got.seconds == pytest.approx(side_by_side(device, host))


def test_checkpointing_recomputes_the_forward_on_both_clocks():
    arch = resolve("1B")
    plain, recompute = (forecast_step_time(arch, "train", "bf16-pure", 4, 512, new_tokens=1,
                                           parallelism=Parallelism(), gpu_name=H100, ceiling=ROUND,
                                           activation_checkpointing=ac) for ac in (False, True))
    forward_flops = 2 * 4 * 512 * arch.matmul_params
    assert recompute.terms["matmuls"] - plain.terms["matmuls"] == pytest.approx(
        forward_flops / (500e12 * forecast.MATMUL_EFFICIENCY))
    recomputed_ops = 43 * forecast.FUNCTIONS_RECOMPUTED_OPS["llama"] * arch.num_layers
    assert recompute.launches - plain.launches == pytest.approx(recomputed_ops)
    assert recompute.host_s - plain.host_s == pytest.approx(
        recomputed_ops * forecast.HOST_OP_S["training"] + arch.num_layers * forecast.CHECKPOINT_HOST_S)


def test_a_compiled_training_step_keeps_a_share_of_the_traffic_and_launches_fused_kernels():
    arch = resolve("1B")
    eager, compiled = (forecast_step_time(arch, "train", "bf16-pure", 8, 2048, new_tokens=1,
                                          parallelism=Parallelism(), gpu_name=H200, ceiling=ROUND,
                                          run=StepRun(compiled=compiled)) for compiled in (False, True))
    # eagerly through the native decoder's Functions; compiled, inductor fuses the plain operators
    forward = 8 * 2048 * arch.num_layers * layer_traffic(arch, Widths.of("bf16-pure")) / 2e12
    eager_bytes = forward * (1 + forecast.FUNCTIONS_BACKWARD_TRAFFIC["llama"][(2, 2)])
    compiled_bytes = forward * (1 + forecast.BACKWARD_TRAFFIC[(2, 2)]) * forecast.COMPILED_TRAFFIC
    assert eager.terms["memory"] - compiled.terms["memory"] == pytest.approx(eager_bytes - compiled_bytes)
    eager_ops = 43 * (1 + forecast.FUNCTIONS_BACKWARD_OPS["llama"]["fused"])
    compiled_ops = forecast.COMPILED_LAYER_KERNELS * (1 + forecast.BACKWARD_OPS)
    assert eager.launches - compiled.launches == pytest.approx((eager_ops - compiled_ops) * arch.num_layers)


def test_fp32_matmuls_run_at_the_cuda_cores_ceiling():
    arch = resolve("small")
    got = forecast_step_time(arch, "forward", "fp32", 8, 512, new_tokens=1, parallelism=Parallelism(),
                             gpu_name=H100, ceiling=ROUND)
    fp32 = 500e12 * datasheet.peak_flops(H100, "fp32") / datasheet.peak_flops(H100, "bf16")
    assert got.terms["matmuls"] == pytest.approx(2 * 8 * 512 * arch.matmul_params / fp32)


def test_side_by_side_is_the_longer_clock_unless_they_are_close():
    assert side_by_side(1.0, 0.0) == 1.0
    assert side_by_side(1.0, 1.0) == pytest.approx(2 ** (1 / forecast.OVERLAP_EXPONENT))
    assert side_by_side(1.0, 0.2) == pytest.approx(1.0, rel=0.01)


def test_tensor_parallel_decoding_pays_two_all_reduces_a_layer():
    arch = resolve("13B")
    links = BusBandwidth(100e9, 100e9, "test", 15e-6, 25e-6)
    one, two = (forecast_step_time(arch, "infer", "bf16-pure", 1, 512, new_tokens=64,
                                   parallelism=Parallelism("tp", tp), gpu_name=H200, ceiling=ROUND, links=links)
                for tp in (1, 2))
    activation = arch.hidden_size * 2
    all_reduce = 15e-6 + 2 * (2 - 1) / 2 * activation / 100e9
    logits = 25e-6 + (2 - 1) / 2 * arch.vocab_size * 2 / 100e9
    # two a layer and the embedding's, then the logits gathered
    assert two.communication_s == pytest.approx((2 * arch.num_layers + 1) * all_reduce + logits)
    assert two.terms["memory"] == pytest.approx(one.terms["memory"] / 2)


def test_a_tensor_parallel_forward_runs_the_residual_stream_whole_on_every_rank():
    """tiny, bf16-pure forward, 4 x 128 over TP 2, by hand: each rank moves half of the heads' and the
    MLP's elementwise bytes and all of the norms' and residual adds' (no sequence parallelism outside
    training), writes and sums the whole logits, and the logits are all-gathered."""
    arch = resolve("tiny")
    n, T = 4 * 128, 128
    links = BusBandwidth(100e9, 100e9, "test", 15e-6, 25e-6)
    got = forecast_step_time(arch, "forward", "bf16-pure", 4, T, new_tokens=1, parallelism=Parallelism("tp", 2),
                             gpu_name=H100, ceiling=ROUND, links=links)
    L, h, f, V = arch.num_layers, arch.hidden_size, arch.ffn_size, arch.vocab_size
    k = arch.num_kv_heads * arch.head_dim
    residual = 2 * 42 * h + 2 * 6 * h  # two bf16 norms, two residual adds
    split = 20 * (h + k) + 4 * (h + k) + 10 * f  # rotary, attention's tensors, SwiGLU
    assert forecast.residual_stream_traffic(arch, Widths.of("bf16-pure")) == residual
    assert got.terms["memory"] == pytest.approx((n * L * (residual + split / 2) + n * 2 * 2 * V) / 2e12)
    all_reduces = 2 * L * (15e-6 + 2 * (2 - 1) / 2 * n * h * 2 / 100e9)
    logits = 25e-6 + (2 - 1) / 2 * n * V * 2 / 100e9
    assert got.communication_s == pytest.approx(all_reduces + logits)
    # training splits the residual stream along the sequence too
    assert forecast.sequence_parallel("native", True, T, 2) and not forecast.sequence_parallel("native", False, T, 2)
    assert not forecast.sequence_parallel("hf", True, T, 2) and not forecast.sequence_parallel("native", True, 127, 2)



@pytest.mark.parametrize("block", ["falcon-grouped", "gpt2"])
def test_tensor_parallel_training_splits_a_rotary_blocks_residual_stream_along_the_sequence(block):
    """The tiny Falcon and GPT-2 blocks, bf16-pure training, 4 x 128 over TP 2, by hand: each rank moves
    half of the heads' and the MLP's elementwise bytes; the residual stream (two LayerNorms, 4 h each,
    two residual adds, 6 h each) split along the sequence for Falcon's rotary positions, whole for
    GPT-2's learned ones; every operator recorded under DTensor (BACKWARD_TRAFFIC); the out-of-place loss
    over the whole logits. transformers' layers keep the Llama block's bytes."""
    arch = BLOCKS[block]
    n, T = 4 * 128, 128
    got = forecast_step_time(arch, "train", "bf16-pure", 4, T, new_tokens=1, parallelism=Parallelism("tp", 2),
                             gpu_name=H100, ceiling=ROUND)
    L, h, f, V = arch.num_layers, arch.hidden_size, arch.ffn_size, arch.vocab_size
    k = arch.num_kv_heads * arch.head_dim
    residual = 2 * 4 * h + 2 * 6 * h
    rotary = 20 * (h + k) if arch.family == "falcon" else 0
    split = rotary + 4 * (h + k) + 4 * f  # rotary, attention's tensors, GELU
    per_rank = split / 2 + (residual / 2 if arch.family == "falcon" else residual)
    widths = Widths.of("bf16-pure")
    assert forecast.residual_stream_traffic(arch, widths) == residual
    assert forecast.residual_stream_traffic(arch, widths, "hf") == 2 * 42 * h + 2 * 6 * h
    memory = n * L * per_rank * (1 + forecast.BACKWARD_TRAFFIC[(2, 2)]) + n * (32 + 3 * 2) * V
    assert got.terms["memory"] == pytest.approx(memory / 2e12)

def test_a_compiled_fsdp_tp_step_launches_its_kernels_at_a_plain_operators_rate():
    """13B, bf16-pure, 2 x 2048 over FSDP 2 x TP 2: eagerly every operator goes through DTensor and each
    layer costs FSDP x TP's host time; compiled, the regions run on local shards, so their kernels cost
    a plain operator's host time and each layer FSDP2's own."""
    arch = resolve("13B")
    parallelism = Parallelism(layout=Layout(dp_shard=2, tp=2))
    eager, compiled = (forecast_step_time(arch, "train", "bf16-pure", 2, 2048, new_tokens=1, parallelism=parallelism,
                                          gpu_name=H100, ceiling=ROUND, run=StepRun(compiled=c)) for c in (False, True))
    optimizer = compiled.terms["optimizer"]
    assert eager.host_s == pytest.approx(eager.launches * forecast.DTENSOR_HOST_OP_S["training"] + optimizer
                                         + arch.num_layers * forecast.FSDP_TP_HOST_S_PER_LAYER)
    assert compiled.host_s == pytest.approx(compiled.launches * forecast.HOST_OP_S["training"] + optimizer
                                            + arch.num_layers * forecast.FSDP_HOST_S_PER_LAYER)


def test_offloaded_layers_stream_at_the_hooks_rate():
    arch = resolve("65B")
    offloaded = 50e9
    plain, off = (forecast_step_time(arch, "infer", "bf16-pure", 1, 128, new_tokens=4, parallelism=Parallelism(),
                                     gpu_name=H100, ceiling=ROUND, run=StepRun(decode="eager"),
                                     offloaded_bytes=offloaded_bytes) for offloaded_bytes in (0.0, offloaded))
    assert off.seconds - plain.seconds == pytest.approx(offloaded / forecast.OFFLOAD_STREAM_BANDWIDTH)


def test_ceilings_come_from_a_measurement_here_then_the_table_then_the_scaled_datasheet():
    measured = hardware_ceilings.Ceilings(device_name=H200, torch_version="2.11", matmul_flops={"bf16": 700e12},
                                 bandwidth=4.0e12, measured_at="now", method="test")
    assert (ceilings(H200, measured).matmul, ceilings(H200, measured).bandwidth) == (700e12, 4.0e12)
    assert ceilings(H200).bandwidth == forecast.MEASURED_CEILINGS[H200][1]
    a100 = "NVIDIA A100-SXM4-80GB"
    assert ceilings(a100).matmul == pytest.approx(datasheet.peak_flops(a100, "bf16") * 785.7 / 989.4)
    assert ceilings(a100).bandwidth == pytest.approx(datasheet.peak_bandwidth(a100) * 3.0 / 3.35)
    assert ROUND.peak(H100, "fp8") == pytest.approx(1000e12, rel=1e-3)


def test_how_a_step_runs_follows_the_spec_and_the_rows_decoding():
    def spec(**fields) -> RunSpec:
        return RunSpec(**{"model": "7B", "backend": "native", "mode": "infer", "precision": "bf16-pure",
                          "batch_size": 1, "seq_len": 128, "new_tokens": 8, "device": "cuda", "warmup_steps": 1,
                          "measure_steps": 1, **fields})

    assert step_run(spec()).decode == "compiled"
    assert step_run(spec(compile_decode=False)).decode == "graph"
    assert step_run(spec(cuda_graphs=False)).decode == "eager"
    assert step_run(spec(precision="int8")).decode == "eager"  # LLM.int8's kernels cannot be captured
    assert step_run(spec(backend="hf")).decode == "eager"
    # tensor-parallel ranks and pipeline stages compile their step as one GPU does
    assert step_run(spec(layout=Layout(tp=2))).decode == "compiled"
    assert step_run(spec(layout=Layout(pp=2))).decode == "compiled"
    assert step_run(spec(layout=Layout(pp=2), backend="hf")).decode == "eager"
    assert step_run(spec(layout=Layout(replicas=2))).decode == "compiled"  # each replica is one GPU's run
    assert step_run(spec(), {"cuda_graphs": True, "compiled": False}).decode == "graph"
    assert step_run(spec(), {"cuda_graphs": False, "reason": "x"}).decode == "eager"
    assert step_run(spec(mode="train", compile=True)) == StepRun("native", True)


def test_every_planned_row_carries_a_forecast_at_or_above_the_roofline():
    target = GpuTarget(H100, 1, 80e9, described=True)
    for mode, precision in (("train", "bf16"), ("forward", "bf16-pure"), ("infer", "bf16-pure"), ("infer", "int4")):
        spec = RunSpec(model="7B", backend="native", mode=mode, precision=precision, batch_size=2, seq_len=512,
                       new_tokens=32, device="cuda", warmup_steps=1, measure_steps=1)
        _, prediction = predict_spec(resolve("7B"), spec, target, DEFAULT, choose_precision=False,
                                     choose_recompute=False, runnable=(precision,))
        assert prediction["step_time_forecast_s"] > prediction["step_time_estimate_s"] > 0


def test_the_planner_forecasts_at_the_ceilings_measured_here(tmp_path, monkeypatch):
    monkeypatch.setenv("FITBENCH_CACHE_DIR", str(tmp_path))
    target = GpuTarget(H200, 1, 140e9, described=True)
    spec = RunSpec(model="7B", backend="native", mode="infer", precision="bf16-pure", batch_size=1, seq_len=512,
                   new_tokens=32, device="cuda", warmup_steps=1, measure_steps=1)

    def planned() -> float:
        return predict_spec(resolve("7B"), spec, target, DEFAULT, choose_precision=False, choose_recompute=False,
                            runnable=("bf16-pure",))[1]["step_time_forecast_s"]

    table = planned()
    hardware_ceilings.save_ceilings(hardware_ceilings.Ceilings(device_name=H200, torch_version=torch_version(),
                                             matmul_flops={"bf16": 785.7e12}, bandwidth=2.1e12, measured_at="now",
                                             method="test"))
    assert planned() > table * 1.3  # half the bandwidth: the weights take twice as long


# ---- each constant, solved again from its row ----------------------------------------------------

def benchmark_module(name: str):
    """A script of benchmarks/ as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / f"benchmarks/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def error_script():
    return benchmark_module("speed_error")


CONSTANTS = benchmark_module("forecast_constants")
SOURCES, measured_row, constant = CONSTANTS.SOURCES, CONSTANTS.measured_row, CONSTANTS.setter


def solve(set_value, row: dict, low: float, high: float) -> float:
    """The value at which the row's forecast equals its measured step (the forecast is monotonic in it)."""
    return CONSTANTS.solve(set_value, row, low, high, error_script().row_error)


@pytest.mark.parametrize("name, key, field, source, low, high", SOURCES,
                         ids=[f"{s[0]}{'' if s[1] is None else f'[{s[1]}]'}{'' if s[2] is None else f'.{s[2]}'}"
                              for s in SOURCES])
def test_each_constant_is_what_its_row_measured(name, key, field, source, low, high, monkeypatch):
    for kept in ("HOST_OP_S", "DTENSOR_HOST_OP_S"):  # restored after the test
        monkeypatch.setattr(forecast, kept, dict(getattr(forecast, kept)))
    monkeypatch.setattr(precisions, "ENTRIES", dict(precisions.ENTRIES))
    if name == "decode":
        value = getattr(getattr(precisions.ENTRIES[key[0]].decode, key[1]), field)
    else:
        value = getattr(forecast, name) if key is None else getattr(forecast, name)[key]
        value = getattr(value, field) if field else value
        monkeypatch.setattr(forecast, name, getattr(forecast, name))
    directory, fields = source
    solved = solve(constant(name, key, field), measured_row(directory, **fields), low, high)
    assert solved == pytest.approx(value, rel=0.03, abs=0.1 if field == "extra_kernels" else 0)


def test_the_nvlink_latency_is_the_median_of_the_tensor_parallel_decode_rows(monkeypatch):
    """Each committed native tensor-parallel decode row at batch 1 solved for the latency at which its
    forecast equals its measured step: NVLINK_LATENCY_S is their median, each inside 5 to 50 us."""
    default = collectives.NVLINK_LATENCY_S
    solved = []
    for directory in ("2026-11-24-h200x2-model-parallel", "2026-11-27-h100x4-vs-one-gpu",
                      "2026-11-27-h100x4-tp-compiled-decode"):
        for path in sorted((RESULTS / directory).rglob("results.jsonl")):
            for row in map(json.loads, path.read_text().splitlines()):
                spec = row["spec"]
                if (row["status"] == "ok" and spec["mode"] == "infer" and spec["backend"] == "native"
                        and spec["layout"]["tp"] > 1 and spec["batch_size"] == 1):
                    solved.append(solve(lambda value: monkeypatch.setattr(collectives, "NVLINK_LATENCY_S", value),
                                        row, 0.0, 2e-4))
    assert len(solved) == 8
    assert all(5e-6 < value < 50e-6 for value in solved), solved
    assert statistics.median(solved) == pytest.approx(default, rel=0.03)


def test_fsdp_host_time_per_layer_is_what_the_default_jobs_fsdp_rows_measured(monkeypatch):
    """The default job's two FSDP training rows on 4 H100s (1B and 3B, 4 x 512 tokens a rank), each solved
    for the host time per sharded layer at which its forecast equals its measured step: the constant is
    their mean, and they agree within 10% (a per-layer cost, not a per-model one)."""
    value = forecast.FSDP_HOST_S_PER_LAYER
    monkeypatch.setattr(forecast, "FSDP_HOST_S_PER_LAYER", value)
    solved = [solve(constant("FSDP_HOST_S_PER_LAYER"),
                    measured_row("2026-11-27-h100x4-replicas/default", model=model, mode="train"), 0.0, 0.05)
              for model in ("1B", "3B")]
    assert solved[0] == pytest.approx(solved[1], rel=0.1), solved
    assert statistics.mean(solved) == pytest.approx(value, rel=0.03), solved


def test_fsdp_host_time_per_layer_over_a_2d_mesh_is_the_median_of_the_fsdp_tp_rows(monkeypatch):
    """The committed eager FSDP x TP training rows on 4 H100s, each solved for the host time per sharded
    layer at which its forecast equals its measured step: the constant is their median."""
    value = forecast.FSDP_TP_HOST_S_PER_LAYER
    monkeypatch.setattr(forecast, "FSDP_TP_HOST_S_PER_LAYER", value)
    rows = [measured_row("2026-11-27-h100x4-vs-one-gpu/13b-fsdp2-tp2"),
            measured_row("2026-11-27-h100x4-vs-one-gpu-2/sharded/13B-fsdp-tp2"),
            measured_row("2026-11-27-h100x4-model-parallel/11"),
            measured_row("2026-11-27-h100x4-auto-vs-best/13b-train/fsdp-4-tp2"),
            measured_row("2026-11-27-h100x4-auto-vs-best/30b-train/fsdp-4-tp2-checkpointed")]
    solved = [solve(constant("FSDP_TP_HOST_S_PER_LAYER"), row, 0.0, 0.1) for row in rows]
    assert statistics.median(solved) == pytest.approx(value, rel=0.03), solved


DTENSOR_ROWS = {  # the committed eager rows of pure tensor parallelism, by the kind of step
    "training": ["2026-11-24-h200x2-model-parallel/13b-train-tp", "2026-11-27-h100x4-model-parallel/7",
                 "2026-11-27-h100x4-tp-steps/13b-train-tp4", "2026-11-27-h100x4-vs-one-gpu-2/sharded/30B"],
    "inference": ["2026-11-24-h200x2-model-parallel/13b-hf-tp-transformers-5.17",
                  "2026-11-27-h100x4-model-parallel/10"],
}


@pytest.mark.parametrize("kind", sorted(DTENSOR_ROWS))
def test_dtensor_host_time_is_the_middle_of_the_fastest_and_slowest_host(kind, monkeypatch):
    """Each committed eager TP row solved for DTensor's host seconds per operator: the constant is the
    geometric mean of the smallest and the largest value, and the hosts differ by less than 1.7x."""
    monkeypatch.setattr(forecast, "DTENSOR_HOST_OP_S", dict(forecast.DTENSOR_HOST_OP_S))
    value = forecast.DTENSOR_HOST_OP_S[kind]
    solved = [solve(constant("DTENSOR_HOST_OP_S", kind), measured_row(directory), 1e-6, 1e-3)
              for directory in DTENSOR_ROWS[kind]]
    assert max(solved) / min(solved) < 1.7, solved
    assert (min(solved) * max(solved)) ** 0.5 == pytest.approx(value, rel=0.03), solved


def test_the_overlap_exponent_is_what_the_rows_with_close_clocks_measured(monkeypatch):
    """Solved from each training row of the validation matrices whose two clocks come within 10% of each
    other, p is about OVERLAP_EXPONENT: their median within 20%, p inside their range."""
    monkeypatch.setattr(forecast, "OVERLAP_EXPONENT", forecast.OVERLAP_EXPONENT)
    solved = []
    for path in sorted((RESULTS / "2026-11-24-h200-validation").glob("matrix*-training/*/results.jsonl")):
        for row in map(json.loads, path.read_text().splitlines()):
            if row["status"] != "ok":
                continue
            spec = RunSpec.model_validate(row["spec"])
            clocks = forecast_spec(resolve(spec.model), spec, H200, ceilings(H200),
                                   run=StepRun(spec.backend, spec.compile, fused=False, functions=False,
                                               fused_loss=False))
            if abs(clocks.host_s / clocks.device_s - 1) < 0.1:
                solved.append(solve(constant("OVERLAP_EXPONENT"), row, 1.01, 20.0))
                forecast.OVERLAP_EXPONENT = 3.0
    assert len(solved) >= 4  # the matrices hold such rows
    assert statistics.median(solved) == pytest.approx(forecast.OVERLAP_EXPONENT, rel=0.2)
    assert min(solved) < forecast.OVERLAP_EXPONENT < max(solved)


def test_a_cpu_run_is_not_forecast():
    spec = RunSpec(model="tiny", backend="native", mode="train", precision="fp32", batch_size=1, seq_len=16,
                   new_tokens=1, device="cpu", warmup_steps=1, measure_steps=1)
    _, prediction = predict_spec(resolve("tiny"), spec, GpuTarget(None, 1, 8e9, described=False), None,
                                 choose_precision=False, choose_recompute=False, runnable=("fp32",))
    assert prediction["step_time_forecast_s"] is None and prediction["step_time_estimate_s"] > 0


def test_attention_efficiency_is_what_a_doubled_context_cost(monkeypatch):
    """The one constant matched on a difference: twice the context at the same tokens."""
    directory = "2026-11-23-h200-chunked-loss/long-sequences"
    short = measured_row(directory, model="llama-3.1-8b", batch_size=2, seq_len=4096)
    long = measured_row(directory, model="llama-3.1-8b", batch_size=1, seq_len=8192)
    row_error = error_script().row_error
    value = forecast.ATTENTION_EFFICIENCY
    monkeypatch.setattr(forecast, "ATTENTION_EFFICIENCY", value)
    low, high = 0.2, 1.5
    for _ in range(50):
        middle = (low + high) / 2
        forecast.ATTENTION_EFFICIENCY = middle
        (measured_short, short_s), (measured_long, long_s) = row_error(short), row_error(long)
        if long_s - short_s > measured_long - measured_short:
            low = middle
        else:
            high = middle
    assert (low + high) / 2 == pytest.approx(value, rel=0.03)


def test_the_error_script_recomputes_every_row_and_summarises_per_directory(capsys, monkeypatch):
    script = error_script()
    directory = RESULTS / "2026-11-24-h200-decode-formats"
    monkeypatch.setattr("sys.argv", ["speed_error.py", str(directory)])
    script.main()
    out = capsys.readouterr().out
    row = measured_row("2026-11-24-h200-decode-formats", precision="int8")
    measured, forecast_s = script.row_error(row)
    spec = RunSpec.model_validate(row["spec"])
    direct = forecast_spec(resolve(spec.model), spec, H200, ceilings(H200), run=StepRun(decode="eager", fused=True))
    assert forecast_s == pytest.approx(direct.seconds)
    assert f"| {row['label']} | infer | {1e3 * measured:.2f} ms | {1e3 * forecast_s:.2f} ms | " \
           f"{(forecast_s - measured) / measured:+.1%} |" in out
    assert "(5 rows)" in out and "| mode infer |" in out and "- worst: " in out


def test_rows_that_measure_no_speed_are_left_out_of_the_forecast_error(tmp_path):
    """speed_error.py leaves out a row recorded under the allocator's history (its warning, or a snapshot
    summary in its sweep directory) and a step at the GPU's capacity (retries counted, or, before the
    counter, an NVML peak at the GPU's memory); a counted zero keeps a row in however full the GPU."""
    from fitbench.worker.snapshot import RECORDING_WARNING

    not_a_speed = error_script().not_a_speed
    full = {"memory": {"gpus": [{"nvml_peak_used": 84.9e9}]}, "environment": {"gpus": [{"total_memory": 85.0e9}]}}
    assert not_a_speed({"warnings": [RECORDING_WARNING]}, tmp_path).startswith("measured while")
    assert not_a_speed(full, tmp_path).startswith("steps at the GPU's capacity")
    assert not_a_speed({**full, "allocator_retries": {"num_alloc_retries": 0}}, tmp_path) is None
    assert not_a_speed({"allocator_retries": {"num_alloc_retries": 3}}, tmp_path).endswith("the allocator retried")
    half = {"memory": {"gpus": [{"nvml_peak_used": 40e9}]}, "environment": {"gpus": [{"total_memory": 85.0e9}]}}
    assert not_a_speed(half, tmp_path) is None
    (tmp_path / "allocator-streams-rank0.json").write_text("{}")
    assert not_a_speed(half, tmp_path).startswith("measured while")


def test_a_one_shot_decode_step_pays_the_one_shot_latency_per_layer_sum_and_nccls_for_the_embedding():
    """tensor_parallel_decode_s with symmetric memory, by hand for the 13B preset at batch 1 over 4 ranks:
    2 L sums of B h c bytes at ONE_SHOT_LATENCY_S plus (g - 1) of them read over the link each, the
    embedding's sum and the logits' gather as NCCL's; at batch 64 (1.3 MB a sum, past ONE_SHOT_BYTES),
    all NCCL's, as without it."""
    from fitbench.planning.speed import tensor_parallel_decode_s
    from fitbench.spec import ONE_SHOT_BYTES

    arch, g = resolve("13B"), 4
    links = BusBandwidth(300e9, 350e9, "test", 20e-6, 15e-6)
    size = 1 * arch.hidden_size * 2
    gather = 15e-6 + (g - 1) / g * arch.vocab_size * 2 / 350e9
    nccl_sum = 20e-6 + 2 * (g - 1) / g * size / 300e9
    one_shot = 2 * arch.num_layers * (collectives.ONE_SHOT_LATENCY_S + (g - 1) * size / 300e9) + nccl_sum + gather
    assert tensor_parallel_decode_s(arch, 1, 2, g, links, one_shot=True) == pytest.approx(one_shot)
    nccl = (2 * arch.num_layers + 1) * 20e-6 + 2 * (g - 1) / g * (2 * arch.num_layers + 1) * size / 300e9 + gather
    assert tensor_parallel_decode_s(arch, 1, 2, g, links) == pytest.approx(nccl)
    assert 64 * arch.hidden_size * 2 > ONE_SHOT_BYTES
    assert tensor_parallel_decode_s(arch, 64, 2, g, links, one_shot=True) == \
        pytest.approx(tensor_parallel_decode_s(arch, 64, 2, g, links))


# ---- activation checkpointing of some layers -----------------------------------------------------

@pytest.mark.parametrize("precision", ["bf16-pure", "bf16"])
@pytest.mark.parametrize("checkpointed", [1, 10, 24, 31])
def test_recomputing_some_layers_costs_their_share_of_every_layers_recomputation(precision, checkpointed):
    """With the first C of L layers checkpointed every part of the recomputation (matmuls, attention,
    elementwise traffic, autocast copies, operators, the host's checkpoint time) is C / L of what
    checkpointing every layer adds; the matmul term by hand: 2 n N (3 + C / L) FLOPs at the measured
    peak times MATMUL_EFFICIENCY."""
    from fitbench.planning.sharding import Parallelism
    from fitbench.planning.speed import recomputed_share

    arch = resolve("7B")
    ceiling = forecast.ceilings(H100)
    n, L = 2 * 1024, arch.num_layers

    def step(**options) -> forecast.Forecast:
        return forecast.forecast_step_time(arch, "train", precision, 2, 1024, new_tokens=0, parallelism=Parallelism(),
                                           gpu_name=H100, ceiling=ceiling, **options)

    none, every = step(), step(activation_checkpointing=True)
    some = step(activation_checkpointing=True, checkpointed_layers=checkpointed)
    share = checkpointed / L
    assert recomputed_share(L, 1, checkpointed) == share
    for term in ("matmuls", "attention", "memory", "kernels"):
        assert some.terms[term] == pytest.approx(none.terms[term] + share * (every.terms[term] - none.terms[term]),
                                                 rel=1e-12), term
    assert some.host_s == pytest.approx(none.host_s + share * (every.host_s - none.host_s), rel=1e-12)
    assert some.launches == pytest.approx(none.launches + share * (every.launches - none.launches), rel=1e-12)
    peak = ceiling.peak(H100, "bf16") * forecast.MATMUL_EFFICIENCY
    assert some.terms["matmuls"] == pytest.approx(2 * n * arch.matmul_params * (3 + share) / peak, rel=1e-12)
    assert none.seconds < some.seconds < every.seconds
    # a count at or above the layers is every layer
    assert step(activation_checkpointing=True, checkpointed_layers=L).seconds == every.seconds


def test_the_busiest_pipeline_stage_sets_the_recomputed_share():
    """Per stage: 40 layers over 3 stages are 13, 14 and 13 (``pipeline_stages``); 5 per stage is 5 / 14 of
    the busiest stage's layers, 20 per stage all of them."""
    from fitbench.planning.speed import recomputed_share

    assert recomputed_share(40, 3, 5) == 5 / 14
    assert recomputed_share(40, 3, 20) == 1.0
    assert recomputed_share(40, 3, None) == 1.0
    assert recomputed_share(40, 1, 5) == 5 / 40


def test_speed_error_takes_a_calibrations_bandwidths_for_the_rows_of_its_machine():
    """The 4 x H100 host's calibration (305 and 250 GB/s) applies to a row of that GPU, torch and GPU
    count, with the interconnect's in-step latency; a row of 2 GPUs or another torch keeps the defaults."""
    script = error_script()
    stored = json.loads((RESULTS / "2026-11-27-h100x4-tp-steps/calibration.json").read_text())
    calibrations = {key: dataclasses.replace(DEFAULT, **fields) for key, fields in stored.items()}
    row = measured_row("2026-11-27-h100x4-tp-steps/13b-forward-tp4")
    calibration = script.calibration_for(row, calibrations)
    assert calibration.all_reduce_bus_bandwidth == pytest.approx(305.4e9, rel=1e-3)
    two = dict(row, environment=dict(row["environment"], gpus=row["environment"]["gpus"][:2]))
    other = dict(row, environment=dict(row["environment"], torch="2.10.0"))
    assert script.calibration_for(two, calibrations) is None and script.calibration_for(other, calibrations) is None
    # its bandwidths lengthen the row's 80 all-reduces of 8 x 1024 x 5120 bf16 activations and the logits' gather
    measured, default = script.row_error(row)
    _, calibrated = script.row_error(row, calibrations)
    activation, logits = 8 * 1024 * 5120 * 2, 8 * 1024 * 32000 * 2
    longer = 80 * 1.5 * activation * (1 / 305.4238e9 - 1 / 450e9) + 0.75 * logits * (1 / 249.924e9 - 1 / 450e9)
    assert calibrated - default == pytest.approx(longer, rel=1e-3)


def test_a_constant_refit_without_its_gpu_is_the_median_of_the_other_gpus_rows_that_ran_alike():
    """``out_of_sample.py`` holding out the H200 rows: KERNEL_S (solved from a 7B decode row on an H200) is
    solved again from each counted H100 row that decoded as that row did (native, bf16-pure, one GPU,
    graphed, eager layers) and that the constant can bring to its measured step; it takes their median."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        script = benchmark_module("out_of_sample")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    entry = next(e for e in SOURCES if e[0] == "KERNEL_S")
    source, before = measured_row(entry[3][0], **entry[3][1]), forecast.KERNEL_S
    value, count = script.refit(entry, source, "NVIDIA H200", RESULTS, "gpu")
    speed = error_script()
    of = RunSpec.model_validate(source["spec"])
    by_hand = []
    for path in sorted(RESULTS.rglob("results.jsonl")):
        for row in (json.loads(line) for line in path.read_text().splitlines()):
            spec = RunSpec.model_validate(row["spec"])
            if (row["status"] != "ok" or "H100" not in row["environment"]["gpus"][0]["name"]
                    or (spec.mode, spec.precision, spec.backend, spec.layout, spec.compile, spec.cuda_graphs,
                        spec.compile_decode, spec.offload, spec.activation_checkpointing)
                    != (of.mode, of.precision, of.backend, of.layout, of.compile, of.cuda_graphs, of.compile_decode,
                        of.offload, of.activation_checkpointing)
                    or speed.row_error(row) is None or speed.not_a_speed(row, path.parent)):
                continue
            state = CONSTANTS.saved()
            try:
                ends = []
                for bound in (entry[4], entry[5]):
                    constant("KERNEL_S")(bound)
                    measured, forecast_s = speed.row_error(row)
                    ends.append(forecast_s - measured)
                if ends[0] * ends[1] < 0:
                    by_hand.append(solve(constant("KERNEL_S"), row, entry[4], entry[5]))
            finally:
                CONSTANTS.restore(state)
    assert count == len(by_hand) > 0
    assert value == pytest.approx(statistics.median(by_hand))
    assert forecast.KERNEL_S == before  # the refit leaves the forecast's constant as it was


def test_a_gpus_rows_out_of_sample_take_the_median_calibration_of_the_other_gpus_rows_of_their_kind():
    """``repredict.py --out-of-sample``: for an H200 training row, the CUDA context and workspaces read back
    from the H100's training rows, their medians by hand; none where the other GPUs have no row of the kind."""
    script = benchmark_module("repredict")
    read_back = [("H100", "training", 500e6, 10e6), ("H100", "training", 700e6, 30e6),
                 ("H100", "training", 600e6, 20e6), ("H100", "eager", 100e6, 1e6), ("H200", "training", 9e9, 9e9)]
    calibration = script.out_of_sample_calibration(read_back, "H200", "training")
    assert (calibration.context("train"), calibration.workspace("train")) == (600e6, 20e6)
    assert calibration.context("infer", decode_graph=False) == 600e6  # the row's own kind stands for all
    assert script.out_of_sample_calibration(read_back, "H100", "eager") is None
    assert script.out_of_sample_calibration(read_back, "H200", "inference") is None


def test_a_training_row_whose_plan_counted_the_out_of_place_loss_is_listed_apart():
    """``repredict.py``: a training row whose own plan's "loss chain" is the out-of-place chunked loss's,
    4 n V + max(c n V + 4 r V, 8 r V) by hand, ran that loss whatever its date; one planned with today's
    fused loss (``loss_chain_bytes``) did not, and neither did a row of another mode."""
    from fitbench.models.loss import loss_chain_bytes, loss_chunk_rows
    from fitbench.spec import RunSpec

    script = benchmark_module("repredict")
    spec = RunSpec(model="small", backend="native", mode="train", precision="bf16", batch_size=8, seq_len=1024,
                   new_tokens=1, device="cuda", warmup_steps=1, measure_steps=1)
    n, vocab = 8 * 1024, resolve("small").vocab_size
    r = min(loss_chunk_rows(vocab), n)
    old = 4 * n * vocab + max(2 * n * vocab + 4 * r * vocab, 8 * r * vocab)

    def row(loss_chain: float) -> dict:
        return {"prediction": {"terms": [{"name": "loss chain", "bytes": loss_chain}]},
                "started_at": "2026-12-01T00:00:00+00:00"}

    assert script.out_of_place_loss(row(old), spec)
    assert "out-of-place" in script.superseded(row(old), spec)
    assert not script.out_of_place_loss(row(loss_chain_bytes(n, vocab, 2)), spec)
    assert script.superseded(row(loss_chain_bytes(n, vocab, 2)), spec) is None
    assert not script.out_of_place_loss(row(old), spec.model_copy(update={"mode": "infer"}))


def test_the_compiled_nf4_decode_solved_from_llama_forecasts_the_native_falcon_it_never_saw():
    """The compiled nf4 step's read efficiency is solved from Llama-2-70B's row alone; the native Falcon-40B's
    row of the same run, another family and size, is then forecast within 5% of its measured step."""
    row = measured_row("2026-12-05-preregistered/h200x1/falcon40b-nf4-1-native", precision="nf4")
    measured, forecast_s = error_script().row_error(row)
    assert row["decode"]["compiled"] and abs(forecast_s - measured) / measured < 0.05
