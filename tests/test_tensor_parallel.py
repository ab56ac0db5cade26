"""Tensor parallelism of the native model: how heads split, what refuses, and one real torchrun job of four
CPU ranks (tests/tensor_parallel_job.py) whose TP logits, losses and gradients are compared with one process
holding the same weights, and whose FSDP x TP losses with one process training on the global batch."""

import json
import math
from collections import Counter

import pytest
import torch

import tensor_parallel_job as job
from conftest import Shape
from fitbench.models.backends import NativeLM, load_model
from fitbench.models.graphs import Replay
from fitbench.precisions import PRECISIONS, QUANTIZED_PRECISIONS, policy
from fitbench.worker.cross_entropy import chunked_cross_entropy
from fitbench.worker.loops import make_step, random_tokens
from fitbench.worker.parallel import data_seed
from fitbench.worker.tensor_parallel import data_parallel_rank, kv_heads_of_rank, split_heads
from fitbench.spec import Layout, LayoutError, RunSpec
from test_parallel import rows_of_job

slow = pytest.mark.slow


# ---- heads and refusals --------------------------------------------------------------------------------

def test_kv_heads_shard_when_the_degree_divides_them_and_are_kept_per_rank_otherwise():
    assert split_heads(32, 8, 8, 3) is None
    # one kv head, two ranks: both keep it
    assert [kv_heads_of_rank(8, 1, 2, r) for r in range(2)] == [[0], [0]]
    # 8 kv heads of 64 query heads on 16 ranks: four query heads each, all reading one kv head
    assert [kv_heads_of_rank(64, 8, 16, r) for r in range(16)] == [[r // 2] for r in range(16)]
    # 3 kv heads (4 query heads each) on 2 ranks: six query heads read kv heads 0, 0, 0, 0, 1, 1, which do
    # not group evenly, so the rank keeps one per query head
    assert split_heads(12, 3, 2, 0) == [0, 0, 0, 0, 1, 1]
    assert split_heads(12, 3, 2, 1) == [1, 1, 2, 2, 2, 2]
    # 4 kv heads on 8 ranks of 32 query heads: each rank's 4 query heads read one kv head
    assert split_heads(32, 4, 8, 5) == [2]


def test_query_heads_that_do_not_divide_by_the_degree_are_a_layout_error():
    with pytest.raises(LayoutError, match="8 query heads do not divide by 3.*pipeline"):
        split_heads(8, 4, 3, 0)


def tensor_parallel_problem(precision: str, mode: str, backend: str = "native", family: str = "llama") -> str | None:
    """What ``Layout`` says of tensor parallelism over two ranks."""
    return Layout(tp=2).problem(Shape(family=family), mode, precision, backend)


@pytest.mark.parametrize("precision", QUANTIZED_PRECISIONS)
def test_quantized_precisions_are_refused_with_pipeline_as_the_way_out(precision):
    for mode in ("infer", "train"):
        problem = tensor_parallel_problem(precision, mode)
        assert problem and precision in problem and "--strategy pipeline" in problem
        assert problem.count(". ") == 0 and not problem.endswith(".")


def test_floating_point_precisions_run_in_every_mode_on_both_backends_where_the_family_has_a_plan():
    for precision in set(PRECISIONS) - set(QUANTIZED_PRECISIONS):
        for mode in ("train", "forward-backward", "forward", "infer"):
            assert tensor_parallel_problem(precision, mode) is None
            assert tensor_parallel_problem(precision, mode, "hf", "llama") is None
    assert "--strategy pipeline" in tensor_parallel_problem("bf16", "infer", "hf", "falcon")


def test_the_tensor_parallel_ranks_of_a_data_parallel_group_draw_one_batch():
    layout = Layout(dp_shard=2, tp=2)
    assert [data_parallel_rank(layout, r) for r in range(4)] == [0, 0, 1, 1]
    assert [data_parallel_rank(Layout(tp=4), r) for r in range(4)] == [0] * 4


def test_a_tensor_parallel_generation_row_is_rank_0s_timing_with_mfu_over_every_gpu():
    from fitbench.worker.aggregate import combine

    def payload(ttft, mfu, gpu_peak):
        return {"status": "ok", "timing": {"time_to_first_token": {"median": ttft}, "samples": {}},
                "throughput": {"prefill_flops": 1e9, "prefill_mfu": mfu, "prefill_mfu_measured_peak": None,
                               "decode_tokens_per_s": 1 / ttft},
                "memory": {"gpus": [{"index": 0, "max_reserved": gpu_peak}], "host_peak_rss": gpu_peak // 10}}

    row = combine([payload(0.25, 40.0, 1000), payload(0.5, 20.0, 1100)], Layout(tp=2))
    assert row["timing"]["time_to_first_token"]["median"] == 0.25  # every rank took part; rank 0 timed it
    assert row["throughput"]["decode_tokens_per_s"] == 4.0
    assert row["throughput"]["prefill_mfu"] == 20.0  # rank 0's FLOP/s over two GPUs' peak
    assert row["throughput"]["prefill_mfu_measured_peak"] is None
    assert [gpu["rank"] for gpu in row["memory"]["gpus"]] == [0, 1]


# ---- one real job ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return rows_of_job(job, tmp_path_factory.mktemp("tensor-parallel"))


def reference(arch, fused: bool = False) -> NativeLM:
    """One process's model of the job's seed: unfused, the layout tensor-parallel training keeps, so that
    gradients compare by projection; ``fused``, as one GPU generates and as a TP generation stacks its shards."""
    torch.manual_seed(job.SEED)
    return load_model(arch, "native", "cpu", torch.float32, fused=fused)


def single_process_training_pass(arch) -> dict:
    lm = reference(arch)
    tokens = random_tokens(arch.vocab_size, job.BATCH, job.SEQ_LEN + 1, torch.device("cpu"), job.SEED)
    loss = chunked_cross_entropy(lm.logits(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    parameters = dict(lm.module.named_parameters())
    return {"loss": loss.item(), "gradients": {name: job.sample(parameters[name].grad) for name in job.GRADIENTS}}


def single_process_generation(arch, graphed: bool) -> list[list[float]]:
    lm = reference(arch)
    if graphed:
        lm = NativeLM(lm.module, lm.cache_dtype, cuda_graphs=True, capture=lambda step: Replay(step))
    prompt = random_tokens(arch.vocab_size, job.BATCH, job.PROMPT, torch.device("cpu"), job.SEED + 1)
    following = random_tokens(arch.vocab_size, job.BATCH, job.DECODE, torch.device("cpu"), job.SEED + 2)
    with torch.inference_mode():
        logits = [lm.prefill(prompt, job.PROMPT + job.DECODE)]
        logits += [lm.decode(following[:, i:i + 1]).clone() for i in range(job.DECODE)]
    return [job.sample(step) for step in logits]


# fp32 throughout. Tensor parallelism changes only the order of sums: a row-wise matmul's two halves
# summed by an all-reduce, the embedding's lookups summed with zeros, a norm's and a replicated
# projection's gradients summed over the ranks. Each order errs by a few units of 2^-24 relative to the
# magnitudes summed, which through 4 layers and a softmax stays near 1e-6 of the largest logit or
# gradient (measured: under 8e-7, and equal losses). A rank keeping its own weights, or a replicated kv
# projection whose gradients are not summed over the ranks, moves them by more than 1e-1.
RELATIVE = 1e-5


def close(measured: list[float], expected: list[float]) -> bool:
    scale = max(abs(value) for value in expected)
    return len(measured) == len(expected) and all(abs(m - e) <= RELATIVE * scale for m, e in zip(measured, expected))


@slow
def test_a_tensor_parallel_rank_never_holds_the_whole_model(ranks):
    """Each rank's parameters are about half of tiny's (its shards, and the norms whole), and the build's
    largest tensor is one whole weight, the embedding (the scratch every weight is drawn into), where
    building the whole model and sharding it would allocate every weight whole."""
    arch = job.VARIANTS["tiny"]
    whole = 4 * arch.total_params  # fp32
    largest_weight = 4 * arch.vocab_size * arch.hidden_size
    for row in ranks:
        build = row["build"]
        assert 0.45 * whole < build["parameter_bytes"] < 0.55 * whole, (row["rank"], build)
        assert build["largest_allocation"] == largest_weight, (row["rank"], build)
    assert largest_weight < 0.3 * whole  # so a whole-model build would show


@slow
@pytest.mark.parametrize("variant", list(job.VARIANTS))
def test_a_tensor_parallel_training_pass_equals_one_process(ranks, variant):
    arch = job.VARIANTS[variant]
    expected = single_process_training_pass(arch)
    for row in ranks:
        measured = row[variant]["train"]
        assert math.isclose(measured["loss"], expected["loss"], rel_tol=RELATIVE), (row["rank"], measured["loss"])
        for name in job.GRADIENTS:
            assert close(measured["gradients"][name], expected["gradients"][name]), (variant, row["rank"], name)
        # the logits gathered from their shards are plain tensors, which the fused loss writes over
        assert measured["loss_function"] == "FusedCrossEntropyBackward"
        applied = measured["applied"]
        assert (applied["tensor_parallel"], applied["sequence_parallel"]) == (2, True)
        assert applied["query_heads_per_rank"] == arch.num_heads // 2
    kv = ranks[0][variant]["train"]["applied"]
    assert kv["kv_heads"] == ("sharded" if arch.num_kv_heads % 2 == 0 else "replicated")


@slow
@pytest.mark.parametrize("variant", list(job.VARIANTS))
@pytest.mark.parametrize("path", ["infer", "infer_graphed", "infer_compiled"])
def test_tensor_parallel_prefill_and_decode_logits_equal_one_process(ranks, variant, path):
    arch = job.VARIANTS[variant]
    expected = single_process_generation(arch, graphed=path != "infer")
    for row in ranks:
        measured = row[variant][path]
        assert len(measured["logits"]) == 1 + job.DECODE
        for step, (got, want) in enumerate(zip(measured["logits"], expected)):
            assert close(got, want), (variant, path, row["rank"], step)
        # each rank caches the kv heads its query heads read: half of tiny's 4, the one of tiny-1kv
        assert measured["cache_kv_heads"] == max(arch.num_kv_heads // 2, 1)
        assert measured["decoding"]["cuda_graphs"] == (path != "infer")


@slow
def test_tensor_parallel_decode_compiles_with_its_collectives_in_the_graph(ranks):
    """Compiled under TP as on one GPU: one graph for the prefill's layer, one for the decode step's, one
    for the head, one for the step's embedding, no fallback; each layer graph holds its two all-reduces
    (attention, MLP), the head's its logits' all-gather, the embedding's its all-reduce, so nothing
    breaks the graph at a collective."""
    for row in ranks:
        measured = row["tiny"]["infer_compiled"]
        regions = measured["decoding"]["regions"]
        assert {name: region["graphs"] for name, region in regions.items()} == {"layer": 1, "layer_decode": 1,
                                                                                 "head": 1, "embed": 1}
        assert "compile_fallback" not in measured["decoding"]
        assert sorted(measured["traced_collectives"]) == [1, 1, 2, 2]


ALL_REDUCE, ALL_GATHER = "c10d.allreduce_.default", "c10d._allgather_base_.default"
# What a rank runs beyond one process's operators and its collectives, once per call whatever the depth:
# the embedding's zeroing of the tokens outside its rows (sub, lt, ge, or, masked_fill, unsqueeze,
# masked_fill_) and the gathered logits' layout (new_empty, view, movedim, flatten, alias). DTensor
# dispatch adds several per matmul, and each of those shards and redistributes on the host.
ONCE_PER_CALL = 12


@slow
@pytest.mark.parametrize("call", ["prefill", "decode_step"])
def test_tensor_parallel_generation_runs_one_process_ops_and_two_all_reduces_per_layer(ranks, call):
    """Megatron's split and nothing heavier: a rank's prefill and decode step (the one a CUDA graph
    captures) run plain operators on local tensors, one process's operators with an all-reduce after
    the attention's and the MLP's row-wise matmuls, one for the embedding and one gather of the logits;
    q, k, v and gate, up stacked into one matmul each, as the fused one-process model runs them."""
    arch = job.VARIANTS["tiny"]
    one = Counter(job.dispatched(reference(arch, fused=True), torch.device("cpu"))[call])
    for row in ranks:
        counts = Counter(row["dispatched"][call])
        collectives = Counter({op: n for op, n in counts.items() if "c10d" in op})
        assert collectives == {ALL_REDUCE: 2 * arch.num_layers + 1, ALL_GATHER: 1}, (row["rank"], collectives)
        assert not [op for op in counts if " on " in op], row["rank"]  # no operator on a DTensor
        assert not one - counts, (row["rank"], one - counts)
        extra = counts - one - collectives
        assert sum(extra.values()) <= ONCE_PER_CALL, (row["rank"], extra)


@slow
def test_fsdp_x_tp_losses_equal_one_process_on_the_global_batch(ranks):
    arch, device = job.VARIANTS["tiny"], torch.device("cpu")
    lm = reference(arch)
    groups = job.LAYOUT.data_parallel
    tokens = torch.cat([random_tokens(arch.vocab_size, job.BATCH, job.SEQ_LEN + 1, device, data_seed(job.SEED, g))
                        for g in range(groups)])
    step = make_step("train", lm, policy(job.PRECISION), tokens, device)
    expected = [step().item() for _ in range(job.STEPS)]
    assert expected[0] - expected[-1] > 100 * RELATIVE * expected[0]  # the steps did move the weights
    per_group = [ranks[g * job.LAYOUT.tp]["fsdp+tp"]["losses"] for g in range(groups)]
    for row in ranks:  # the two ranks of a tensor-parallel pair see one batch and one loss
        assert row["fsdp+tp"]["losses"] == per_group[data_parallel_rank(job.LAYOUT, row["rank"])]
    for i, want in enumerate(expected):
        mean = sum(losses[i] for losses in per_group) / groups
        assert math.isclose(mean, want, rel_tol=RELATIVE), (i, mean, want)
    applied = ranks[0]["fsdp+tp"]["applied"]
    assert (applied["strategy"], applied["tensor_parallel"], applied["fsdp_units"]) == \
        ("fsdp+tp", 2, arch.num_layers + 1)


@slow
def test_tensor_parallel_pipeline_stages_give_one_process_forward_prefill_and_decode_logits(ranks):
    """Layout(pp=2, tp=2): rank r holds stage r // 2 as tensor-parallel rank r % 2; the last stage's two
    ranks both hold the whole logits, equal to one process's."""
    arch = job.VARIANTS["tiny"]
    expected = single_process_generation(arch, graphed=False)
    lm = reference(arch)
    tokens = random_tokens(arch.vocab_size, job.BATCH, job.SEQ_LEN, torch.device("cpu"), job.SEED)
    with torch.inference_mode():
        forward = job.sample(lm.logits(tokens))
    assert [row["pipeline+tp"]["stage"] for row in ranks] == [0, 0, 1, 1]
    for row in ranks:
        measured = row["pipeline+tp"]
        applied = measured["applied"]
        assert (applied["strategy"], applied["stages"], applied["tensor_parallel"]) == ("tp+pipeline", 2, 2)
        assert measured["cache_kv_heads"] == arch.num_kv_heads // 2
        if measured["stage"] == 0:
            assert measured["logits"] is None
            continue
        assert close(measured["forward"], forward), row["rank"]
        assert len(measured["logits"]) == 1 + job.DECODE
        for step, (got, want) in enumerate(zip(measured["logits"], expected)):
            assert close(got, want), (row["rank"], step)
    # each rank holds half of its stage's layers' weights: the two stages' ranks together about half the model
    held = sum(ranks[r]["pipeline+tp"]["applied"]["stage"]["params"] for r in (0, 2))
    assert 0.45 * arch.total_params < held < 0.65 * arch.total_params, held


def test_tensor_parallel_pipeline_training_and_quantized_stages_are_refused():
    from fitbench.worker.build import build_pipelined
    from fitbench.worker.ranks import Rank
    from fitbench.spec import RunSpec

    rank = Rank(rank=0, local_rank=0, world_size=4, local_world_size=4, device=torch.device("cpu"), launched=True)

    def refusal(mode, precision):
        spec = RunSpec(model="tiny", backend="native", mode=mode, precision=precision, batch_size=2, seq_len=8,
                       new_tokens=2, device="cpu", warmup_steps=0, measure_steps=1, layout=job.PIPELINE)
        with pytest.raises(ValueError) as raised:
            build_pipelined(spec, job.VARIANTS["tiny"], policy(precision), rank)
        return str(raised.value)

    assert "--strategy fsdp" in refusal("train", "bf16") and "--tp" in refusal("train", "bf16")
    assert "--strategy pipeline" in refusal("infer", "nf4")


# ---- from the command line -------------------------------------------------------------------------------

def test_the_sweep_gives_every_mode_the_tensor_parallel_layout():
    from fitbench.config import SweepConfig, expand

    config = SweepConfig(models=["tiny"], mode=["infer", "train", "forward"], precision=["bf16"], gpus=2, strategy="tp")
    specs = expand(config, device="cpu", default_models=["tiny"])
    assert [(spec.mode, spec.layout) for spec in specs] == [(mode, Layout(tp=2)) for mode in config.mode]


@pytest.mark.parametrize("options, says", [
    (["--precision", "nf4"], "nf4 weights cannot be sharded"),
    (["--gpus", "3"], "3 ranks do not divide the model's 8"),
    (["--backend", "hf", "--gpus", "8"], "by whole kv heads"),
    (["--backend", "hf", "--models", "gpt2"], "no tensor-parallel plan for gpt2"),
    (["--backend", "hf", "--precision", "int8"], "int8 weights cannot be sharded"),
])
def test_what_tensor_parallelism_cannot_run_is_refused_before_launch(options, says, tmp_path, capsys, monkeypatch):
    from conftest import cli

    monkeypatch.chdir(tmp_path)
    argv = ["run", "--models", "tiny", "--device", "cpu", "--gpus", "2", "--strategy", "tp", "--mode", "infer",
            "--out", "r"]
    code, out, err = cli(argv + options, capsys)
    assert code == 2 and says in out + err and "Traceback" not in out + err, out + err
    assert not (tmp_path / "r" / "results.jsonl").exists()


@pytest.mark.parametrize("strategy, mode, layout", [
    ("fsdp", "train", Layout(dp_shard=2, tp=2)), ("fsdp", "forward-backward", Layout(dp_shard=2, tp=2)),
    ("fsdp", "infer", Layout(tp=2)), ("pipeline", "infer", Layout(pp=2, tp=2)),
    ("pipeline", "forward", Layout(pp=2, tp=2)),
])
def test_tp_makes_a_2d_layout_with_the_strategy(strategy, mode, layout):
    from fitbench.config import SweepConfig, expand

    config = SweepConfig(models=["tiny"], mode=[mode], precision=["bf16"], gpus=4, strategy=strategy, tp=2)
    [spec] = expand(config, device="cpu", default_models=["tiny"])
    assert spec.layout == layout


def test_the_seeds_tensor_parallel_size_is_tp_in_yaml(tmp_path):
    from fitbench.config import load_yaml, merge_sources

    path = tmp_path / "sweep.yaml"
    path.write_text("gpus: 4\nstrategy: pipeline\ntensor_parallel_size: 2\n")
    assert merge_sources({}, load_yaml(path), {}).tp == 2


@pytest.mark.parametrize("options, says", [
    (["--gpus", "4", "--strategy", "pipeline", "--tp", "2", "--mode", "train"], "--strategy fsdp --tp 2"),
    (["--gpus", "3", "--strategy", "fsdp", "--tp", "2"], "--tp 2 does not divide --gpus 3"),
    (["--gpus", "4", "--strategy", "ddp", "--tp", "2"], "FSDP shards the data-parallel dimension"),
    (["--gpus", "4", "--strategy", "replicas", "--tp", "2", "--mode", "infer"], "give --strategy replicas alone"),
    (["--gpus", "4", "--strategy", "auto", "--tp", "2"], "not --strategy auto"),
    (["--tp", "2"], "--gpus is 1"),
    (["--gpus", "4", "--strategy", "tp", "--tp", "2"], "must equal --gpus 4"),
    (["--gpus", "4", "--strategy", "pipeline", "--tp", "2", "--mode", "infer", "--precision", "nf4"],
     "leave --tp out"),
    (["--gpus", "6", "--strategy", "pipeline", "--tp", "3", "--mode", "infer"], "3 ranks do not divide the model's 8"),
    (["--gpus", "4", "--strategy", "fsdp", "--tp", "2", "--backend", "hf"], "use --backend native"),
])
def test_every_wrong_tp_combination_is_one_paragraph_and_exit_2(options, says, tmp_path, capsys, monkeypatch):
    from conftest import cli

    monkeypatch.chdir(tmp_path)
    code, out, err = cli(["run", "--models", "tiny", "--device", "cpu", "--out", "r"] + options, capsys)
    assert code == 2 and says in out + err and "Traceback" not in out + err, out + err
    assert "--tp" in out + err and not (tmp_path / "r" / "results.jsonl").exists()


def test_tp_x_pipeline_runs_inference_only():
    tiny = job.VARIANTS["tiny"]
    assert Layout(pp=2, tp=2).problem(tiny, "infer", "bf16", "native") is None
    assert Layout(pp=2, tp=2).problem(tiny, "forward", "bf16", "native") is None
    assert "--strategy fsdp --tp 2" in Layout(pp=2, tp=2).problem(tiny, "train", "bf16", "native")


def test_the_hf_backend_runs_over_stages_and_under_its_plans_alone():
    from fitbench.models.registry import resolve

    llama, falcon = resolve("tiny"), resolve("falcon-40b")
    assert Layout(pp=2).problem(falcon, "infer", "bf16", "hf") is None
    assert "train" in Layout(pp=2).problem(falcon, "train", "bf16", "hf")
    assert Layout(tp=2).problem(llama, "infer", "bf16", "hf") is None
    assert "--strategy pipeline" in Layout(tp=2).problem(falcon, "infer", "bf16", "hf")
    assert "alone" in Layout(pp=2, tp=2).problem(llama, "infer", "bf16", "hf")


@slow
def test_tensor_parallel_generation_from_the_command_line_writes_one_row_of_the_job(tmp_path, capsys, monkeypatch):
    """`fitbench run --gpus 2 --strategy tp --mode infer`: both ranks generate, and the row is the job's:
    two ranks, the layout tp 2, rank 0's latencies, each rank's memory, the heads each rank holds."""
    from conftest import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FITBENCH_INJECT", raising=False)
    code, out, err = cli(["run", "--models", "tiny", "--device", "cpu", "--gpus", "2", "--strategy", "tp",
                          "--mode", "infer", "--batch-size", "2", "--seq-len", "16", "--new-tokens", "4",
                          "--warmup-steps", "1", "--measure-steps", "2", "--out", "r"], capsys)
    assert code == 0, out + err
    [row] = [json.loads(line) for line in (tmp_path / "r" / "results.jsonl").read_text().splitlines()]
    assert row["status"] == "ok" and row["ranks"] == 2, row.get("error")
    assert row["layout"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 2, "pp": 1, "replicas": 1}
    assert "tp x 2" in row["label"]
    assert (row["parallel"]["kv_heads"], row["parallel"]["kv_heads_per_rank"]) == ("sharded", 2)
    assert not row["parallel"]["sequence_parallel"]  # generation keeps the sequence whole
    assert len(row["timing"]["samples"]["time_to_first_token"]) == 2
    assert row["weights"]["method"] == "parameter storage of this rank's shards"
    assert len(row["memory"]["host_peak_rss_per_rank"]) == 2
    assert row["weights"]["bytes"] < 0.6 * 4 * job.VARIANTS["tiny"].total_params  # half the fp32 weights, and norms


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism over NCCL needs two GPUs")


@two_gpus
@slow
def test_tensor_parallel_decoding_is_captured_in_a_cuda_graph_on_two_gpus(tmp_path, capsys, monkeypatch):
    """On GPUs the decode step, its NCCL all-reduces and all-gather included, is captured once in the
    untimed generation and replayed in the measured ones, on both ranks."""
    from conftest import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FITBENCH_INJECT", raising=False)
    code, out, err = cli(["run", "--models", "tiny", "--device", "cuda", "--gpus", "2", "--strategy", "tp",
                          "--mode", "infer", "--precision", "bf16-pure", "--batch-size", "2", "--seq-len", "32",
                          "--new-tokens", "8", "--warmup-steps", "1", "--measure-steps", "3", "--out", "r"], capsys)
    assert code == 0, out + err
    [row] = [json.loads(line) for line in (tmp_path / "r" / "results.jsonl").read_text().splitlines()]
    assert row["status"] == "ok" and row["ranks"] == 2, row.get("error")
    assert row["decode"]["cuda_graphs"] is True, row["decode"]
    assert [capture["generation"] for capture in row["decode"]["captures"]] == [1]
    assert sorted(gpu["rank"] for gpu in row["memory"]["gpus"]) == [0, 1]


def test_small_all_reduces_stay_nccls_where_the_group_spans_nodes_or_runs_on_cpus(monkeypatch):
    """Symmetric memory maps the group's GPUs into each other: a group larger than a node's ranks keeps
    NCCL's sums (checked before any GPU is asked about peer access), and CPU ranks record nothing."""
    from fitbench.worker.tensor_parallel import _peers_mapped, small_all_reduces

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not _peers_mapped(torch.device("cuda", 0), 4)
    spec = RunSpec(model="7B", backend="native", mode="infer", precision="bf16-pure", batch_size=1, seq_len=8,
                   new_tokens=2, device="cpu", warmup_steps=0, measure_steps=1, layout=Layout(tp=2))
    assert small_all_reduces(spec, None, torch.device("cpu")) == {}
