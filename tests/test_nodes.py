"""Plans over several nodes: the link between nodes (its defaults, --inter-node-bandwidth, a calibration
measured over nodes), which collectives cross it and in what form (fitbench.planning.nodes), layouts that
fill whole nodes, and the ranking that keeps the heavy traffic inside nodes."""

import json
import socket
from dataclasses import replace

import pytest

from conftest import cli
from fitbench.launch.calibrate import COLLECTIVE_RUNS, measure_across_nodes, with_inter_node
from fitbench.models.registry import resolve
from fitbench.planning.calibration import DEFAULT, load_calibration, save_calibration
from fitbench.planning.collectives import BusBandwidth, bus_bandwidth
from fitbench.planning.forecast import ceilings, forecast_step_time
from fitbench.planning.sharding import Parallelism
from fitbench.planning.nodes import (FABRICS, INTER_NODE_LATENCY_S, AcrossNodes, Nodes, inter_node_link, job_nodes,
                                 layout_links, parse_inter_node_bandwidth, placement_problem)
from fitbench.planning.planner import GpuTarget, node_counts, plan
from fitbench.spec import Layout

H100 = "NVIDIA H100 80GB HBM3"
INTRA = BusBandwidth(400e9, 380e9, "test", 20e-6, 15e-6)
INTER = BusBandwidth(40e9, 30e9, "test", 30e-6, 25e-6)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FITBENCH_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("text, rate", [("ndr", 50e9), ("HDR", 25e9), ("100gbe", 12.5e9), ("400Gb/s", 50e9),
                                        ("50GB/s", 50e9), ("200 Gbit/s", 25e9), ("1.5TB/s", 1.5e12)])
def test_a_bandwidth_between_nodes_is_a_fabric_or_a_figure_with_its_unit(text, rate):
    assert parse_inter_node_bandwidth(text) == pytest.approx(rate)


@pytest.mark.parametrize("text", ["400", "400gb/s", "fast", "0GB/s", "-5GB/s", "50 GB"])
def test_a_bandwidth_without_a_clear_unit_is_refused(text):
    with pytest.raises(ValueError, match="400Gb/s"):
        parse_inter_node_bandwidth(text)


def test_the_link_between_nodes_is_given_else_measured_else_the_fabric_default():
    assert inter_node_link(H100).all_reduce == FABRICS["ndr"][0] and "NDR" in inter_node_link(H100).source
    assert inter_node_link("NVIDIA A100-SXM4-80GB").all_reduce == FABRICS["hdr"][0]
    assert inter_node_link(H100).all_reduce_latency == INTER_NODE_LATENCY_S
    measured = with_inter_node(DEFAULT, INTER)
    assert inter_node_link(H100, measured) == INTER
    given = inter_node_link(H100, measured, 10e9)
    assert (given.all_reduce, given.all_gather, given.all_reduce_latency) == (10e9, 10e9, INTER.all_reduce_latency)


def test_placement_fills_nodes_alike_and_keeps_tensor_parallelism_inside_one():
    assert placement_problem(Layout(pp=43), 8) and "do not spread evenly over the 6 nodes" in placement_problem(
        Layout(pp=43), 8)
    assert placement_problem(Layout(pp=42), 8) is None  # 6 nodes of 7
    assert "straddle nodes of 6 ranks" in placement_problem(Layout(tp=4, pp=3), 8)  # 2 nodes of 6
    assert placement_problem(Layout(tp=2, pp=6), 8) is None
    assert "more than the 8 GPUs" in placement_problem(Layout(tp=16), 8)
    assert placement_problem(Layout(tp=3, pp=2), 8) is None  # one node: nothing to straddle
    assert node_counts(8, 24) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 18, 21, 24]
    assert job_nodes(8, 8, INTER) is None and job_nodes(12, 8, INTER) == Nodes(2, 6, INTER)


def test_a_group_across_nodes_reduces_inside_then_between_then_gathers_inside():
    # fsdp 4 x tp 4 on two nodes of 8: each data-parallel group has 2 members on each of 2 nodes
    links = layout_links(Layout(dp_shard=4, tp=4), INTRA, Nodes(2, 8, INTER))
    assert links.tensor == INTRA and links.data == AcrossNodes(INTRA, INTER, 2, 2)
    S = 1e9
    expected = (INTRA.reduce_scatter_s(S, 2) + INTER.all_reduce_s(S / 2, 2) + INTRA.all_gather_s(S, 2))
    assert links.data.all_reduce_s(S, 4) == pytest.approx(expected)
    assert links.data.all_reduce_s(S, 4) == pytest.approx(
        INTRA.all_gather_latency * 2 + INTER.all_reduce_latency + 2 * 0.5 * S / INTRA.all_gather
        + 2 * 0.5 * (S / 2) / INTER.all_reduce)
    assert links.data.all_gather_s(S, 4, messages=3) == pytest.approx(
        INTER.all_gather_s(S / 2, 2, 3) + INTRA.all_gather_s(S, 2, 3))
    assert links.data.reduce_scatter_s(S, 4) == pytest.approx(INTRA.reduce_scatter_s(S, 2)
                                                              + INTER.reduce_scatter_s(S / 2, 2))
    # a whole node per tensor-parallel group: the data-parallel level is between nodes alone
    alone = layout_links(Layout(dp_shard=2, tp=8), INTRA, Nodes(2, 8, INTER)).data
    assert alone.all_reduce_s(S, 2) == pytest.approx(INTER.all_reduce_s(S, 2))


def test_pipeline_boundaries_between_nodes_take_the_link_between_them():
    arch = resolve("llama-2-70b")
    ceiling = ceilings(H100)
    run = dict(new_tokens=1, gpu_name=H100, ceiling=ceiling, links=INTRA)
    layout = Layout(tp=4, pp=4)  # 2 stages per node: one of 3 boundaries crosses
    one = forecast_step_time(arch, "train", "bf16-pure", 8, 512, parallelism=Parallelism(layout=layout), **run)
    two = forecast_step_time(arch, "train", "bf16-pure", 8, 512, parallelism=Parallelism(layout=layout),
                             nodes=Nodes(2, 8, INTER), **run)
    assert layout_links(layout, INTRA, Nodes(2, 8, INTER)).boundaries_across == 1
    microbatch = 8 // Parallelism(layout=layout).microbatches_of(8) * 512 * arch.hidden_size * 2
    # forward and backward: one send each way crosses, over the slower link
    difference = 2 * (INTER.send_recv_s(microbatch) - INTRA.send_recv_s(microbatch))
    assert two.seconds - one.seconds == pytest.approx(difference, rel=1e-6)
    assert two.communication_s - one.communication_s == pytest.approx(difference, rel=1e-6)


def test_a_slow_link_between_nodes_moves_the_choice_to_the_layout_that_crosses_with_little():
    arch = resolve("llama-2-70b")

    def chosen(bandwidth):
        target = GpuTarget(H100, 16, 80e9, described=True, node_gpus=8, inter_node_bandwidth=bandwidth)
        result = plan(arch, "train", target, seq_len=512, new_tokens=1, batch_sizes=[4], precisions=["bf16-pure"])
        assert result.inter_node_link and "GB/s" in result.inter_node_link
        return result.chosen.candidate.layout

    # at NDR's 50 GB/s the shards' gathers cross nodes; at 1 GB/s only the pipeline's activations do
    assert chosen(None).dp_shard == 16
    slow = chosen(1e9)
    assert slow.pp > 1 and slow.data_parallel == 1


def test_the_plan_for_nodes_names_the_link_between_them_and_refuses_a_bad_one(capsys):
    argv = ["plan", "--models", "llama-2-70b", "--mode", "infer", "--gpu", "H100-80GB", "--gpus-per-node", "8",
            "--nodes", "2"]
    code, printed, errors = cli([*argv, "--inter-node-bandwidth", "200Gb/s"], capsys)
    assert code == 0, errors
    assert "between nodes: --inter-node-bandwidth 25 GB/s per GPU" in printed
    code, printed, errors = cli(argv, capsys)
    assert code == 0 and "between nodes: default: InfiniBand NDR" in printed
    code, printed, errors = cli([*argv[:-4], "--gpus", "4"], capsys)  # one node: no link between nodes
    assert code == 0 and "between nodes" not in printed
    code, printed, errors = cli([*argv, "--inter-node-bandwidth", "400"], capsys)
    assert code == 2 and errors.count("\n") == 1 and "inter-node-bandwidth" in errors and "400Gb/s" in errors


def test_requirements_in_nodes_fill_whole_nodes_alike(capsys):
    argv = ["plan", "--models", "llama-3.1-405b", "falcon-180b", "--gpu", "H100-80GB", "--gpus-per-node", "8",
            "--requirements", "--mode", "train", "infer"]
    code, out, err = cli([*argv, "--json"], capsys)
    assert code == 0, err
    rows = [row for row in json.loads(out) if row["min_gpus"]]
    assert any(row["min_nodes"] > 1 for row in rows)
    for row in rows:
        layout, per_node = Layout(**row["layout"]), row["gpus_per_node_used"]
        assert row["min_gpus"] == row["min_nodes"] * per_node and per_node <= 8, row
        assert layout.world_size == row["min_gpus"] and per_node % layout.tp == 0, row
        assert f"#SBATCH --nodes={row['min_nodes']}" in row["sbatch"]
        assert f"#SBATCH --gpus-per-node={per_node}" in row["sbatch"]
        if row["min_nodes"] > 1:  # fewer nodes would not do: no layout fits on one node fewer
            assert row["min_gpus"] > (row["min_nodes"] - 1) * 8
    code, out, err = cli(argv, capsys)
    assert code == 0, err
    assert "min nodes" in out and "GPUs used per node" in out and " of 8 " in out


def test_calibrate_over_nodes_needs_an_allocation(capsys, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    code, _, errors = cli(["calibrate", "--device", "cpu", "--nodes", "2"], capsys)
    assert code == 2 and "SLURM allocation" in errors and errors.count("\n") == 1


@pytest.mark.slow
def test_two_agents_of_two_nodes_measure_the_link_between_them(tmp_path):
    """Two torchrun agents on this host as two nodes of two gloo ranks each: both levels fitted, every
    figure positive, the calibration that keeps them read back by the planner."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    inside, between = measure_across_nodes(2, 2, "cpu", tmp_path, endpoint=f"localhost:{port}",
                                           agents=lambda agent: [agent, agent], timeout_s=240)
    for level in (inside, between):
        assert min(level.all_reduce, level.all_gather, level.all_reduce_latency, level.all_gather_latency) > 0
    assert "between 2 nodes" in between.source and "inside a node" in inside.source
    # the fitted line grows with the message from its latency: the large message's bytes add to the small one's
    small, large = (size for size, _, _ in COLLECTIVE_RUNS["gloo"])
    for level in (inside, between):
        assert level.all_reduce_s(large, 2) > level.all_reduce_s(small, 2) > level.all_reduce_latency
    save_calibration(H100, with_inter_node(DEFAULT, between))
    loaded = load_calibration(H100)
    assert inter_node_link(H100, loaded) == between
    assert bus_bandwidth(H100, loaded) == bus_bandwidth(H100)  # the level inside a node is not replaced


def test_a_sweep_plans_its_jobs_over_its_nodes_with_the_link_it_names():
    from fitbench.config import SweepConfig
    from fitbench.sweep import cluster_target

    target = GpuTarget(H100, 16, 80e9, described=False)
    over_two = cluster_target(target, SweepConfig(models=["tiny"], gpus=16, nodes=2, launcher="slurm",
                                                  inter_node_bandwidth="hdr"))
    assert (over_two.node_gpus, over_two.inter_node_bandwidth) == (8, 25e9)
    here = cluster_target(replace(target, count=1), SweepConfig(models=["tiny"]))
    assert (here.node_gpus, here.inter_node_bandwidth) == (target.node_gpus, None)
