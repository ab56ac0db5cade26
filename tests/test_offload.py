"""Offload (``fitbench.models.offload``): the spec field, the build against the plain model, accelerate's
placement against the planner's split, and the refusals. On the CPU the offloaded layers go to disk
through accelerate's real hooks; GPU placements are computed on the meta device, which needs no GPU.

The whole run, from the fallback ladder to the result row, is in ``test_fallback.py``'s sweeps.
"""

import json

import pytest
import torch
from pydantic import ValidationError

from fitbench.cli import build_parser
from fitbench.config import SweepConfig, expand, load_yaml, merge_sources
from fitbench.models.backends import NativeLM
from fitbench.models.native import build_native, meta_model
from fitbench.models.offload import OffloadCapacityError, build_offloaded, capacity_problem, place_layers
from fitbench.models.registry import resolve
from fitbench.planning.calibration import DEFAULT
from fitbench.planning.memory import estimate_memory
from fitbench.planning.planner import offload_split
from fitbench.worker import worker
from fitbench.worker.weight_bytes import decode_weight_bytes, weight_storage_bytes
from fitbench.spec import RunSpec
from fitbench.util.errors import UserError

TINY = resolve("tiny")  # 4 layers, tied embeddings, grouped-query attention
CPU = torch.device("cpu")
GPU = torch.device("cuda:0")  # only ever a name here: placement runs on the meta device


def spec(**fields) -> RunSpec:
    base = dict(model="tiny", backend="native", mode="infer", precision="bf16-pure", batch_size=1, seq_len=16,
                new_tokens=4, device="cpu", warmup_steps=1, measure_steps=1)
    return RunSpec(**{**base, **fields})


# ---- the spec ------------------------------------------------------------------------------------

def test_keys_of_configurations_without_offload_are_unchanged():
    # The key this configuration had before offload existed: earlier results still match it.
    assert spec().key == "959c202ed963"
    assert spec(offload=True).key != spec().key
    assert spec(offload=True).label == "tiny infer bf16-pure 1x16+4 offload [native]"
    assert "offload" not in spec().label


@pytest.mark.parametrize("fields, words", [
    ({"mode": "train", "precision": "bf16"}, ["--mode infer or forward", "train"]),
    ({"mode": "forward-backward"}, ["forward-backward"]),
    ({"precision": "nf4"}, ["nf4", "bf16-pure"]),
    ({"backend": "hf"}, ["--backend native"]),
    ({"compile": True}, ["--compile"]),
])
def test_spec_refuses_offload_where_it_cannot_run(fields, words):
    with pytest.raises(ValidationError) as error:
        spec(offload=True, **fields)
    for word in words:
        assert word in str(error.value)
    spec(**fields)  # the same configuration without offload is fine


def test_offload_from_the_command_line_and_the_config_file(tmp_path):
    options = vars(build_parser().parse_args(["run", "--offload", "--mode", "infer", "forward"]))
    assert options["offload"] is True
    (tmp_path / "c.yaml").write_text("models: [tiny]\nmode: [infer, forward]\noffload: true\n")
    config = merge_sources({}, load_yaml(tmp_path / "c.yaml"), {})
    assert config.offload is True
    specs = expand(config, device="cpu", default_models=[])
    assert [(s.mode, s.precision, s.offload) for s in specs] == [("infer", "fp32", True), ("forward", "fp32", True)]
    assert not any(s.offload for s in expand(SweepConfig(models=["tiny"]), device="cpu", default_models=[]))
    with pytest.raises(UserError, match="offload: "):
        expand(config.model_copy(update={"precision": ["int8"]}), device="cpu", default_models=[])


# ---- the build -----------------------------------------------------------------------------------

def layer_memory_for(resident: int, dtype: torch.dtype) -> float:
    """Room for ``resident`` layers and the one in flight, as accelerate reckons it."""
    layer = TINY.params_per_layer * torch.finfo(dtype).bits // 8
    return (resident + 1) * layer + layer // 2


def generation(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full logits of ``tokens``, and the logits of a prefill and two decode steps through the KV cache."""
    lm = NativeLM(model, cache_dtype=model.model.embed_tokens.weight.dtype)
    with torch.inference_mode():
        steps = [lm.prefill(tokens, tokens.shape[1] + 2)]
        for _ in range(2):
            steps.append(lm.decode(steps[-1].argmax(dim=-1, keepdim=True)))
        return model(tokens), torch.stack(steps)


@pytest.mark.parametrize("dtype, resident", [(torch.float32, 0), (torch.float32, 2), (torch.bfloat16, 1)])
def test_offloaded_model_has_the_plain_models_weights_and_logits(dtype, resident, tmp_path):
    tokens = torch.randint(0, TINY.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    plain = build_native(TINY, CPU, dtype)
    torch.manual_seed(0)
    model, offload = build_offloaded(TINY, CPU, dtype, layer_memory_for(resident, dtype), 0, tmp_path)
    assert (offload.resident_layers, offload.offloaded_layers) == (resident, 4 - resident)
    # The same random draws: every weight equal, those that went to disk as read back for a forward.
    for index, (block, expected) in enumerate(zip(model.model.layers, plain.model.layers)):
        for name, weight in expected.state_dict().items():
            stored = block._hf_hook.weights_map[name] if index >= resident else block.state_dict()[name]
            assert torch.equal(stored, weight), (index, name)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "rope_cos", "rope_sin"):
        assert torch.equal(model.get_buffer(name) if "rope" in name else model.get_parameter(name),
                           plain.get_buffer(name) if "rope" in name else plain.get_parameter(name))
    # The same computation, to the last bits that fp32 kernels may round differently.
    for got, expected in zip(generation(model, tokens), generation(plain, tokens)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_offloaded_layers_stay_on_disk_and_stream_in_for_their_forward(tmp_path):
    model, offload = build_offloaded(TINY, CPU, torch.float32, layer_memory_for(2, torch.float32), 0, tmp_path)
    layer = 4 * TINY.params_per_layer
    assert offload.as_dict() == {"tier": "disk", "resident_layers": 2, "offloaded_layers": 2,
                                 "resident_bytes": 4 * TINY.total_params - 2 * layer, "offloaded_bytes": 2 * layer,
                                 "max_memory": {"cpu": layer_memory_for(2, torch.float32)}}
    index = json.loads((tmp_path / "index.json").read_text())
    assert {name.split(".")[2] for name in index} == {"2", "3"}  # only the offloaded layers were written
    assert sum((tmp_path / f"{name}.dat").stat().st_size for name in index) == 2 * layer

    def devices(module) -> set[str]:
        return {p.device.type for p in module.parameters()}

    for _ in range(2):  # before the first forward and after one
        assert [devices(block) for block in model.model.layers] == [{"cpu"}, {"cpu"}, {"meta"}, {"meta"}]
        assert devices(model.model.embed_tokens) == devices(model.lm_head) == devices(model.model.norm) == {"cpu"}
        assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
        generation(model, torch.zeros(1, 4, dtype=torch.long))
    for index, block in enumerate(model.model.layers):
        hook = getattr(block, "_hf_hook", None)
        assert (hook is not None and hook.offload) == (index >= 2)
    # The KV cache is allocated where the rotary tables are: on the device, for every layer.
    cache = model.new_cache(1, 8, torch.float32)
    assert model.rope_cos.device == cache.device == CPU and len(cache.layer_keys) == 4
    # A decode step reads the offloaded layers' weights as it reads the resident ones'.
    plain = build_native(TINY, CPU, torch.float32)
    for autocast in (None, torch.bfloat16):
        assert decode_weight_bytes(model, offload.resident_bytes + offload.offloaded_bytes, 2, TINY.vocab_size,
                                          autocast) == \
            decode_weight_bytes(plain, weight_storage_bytes(plain), 2, TINY.vocab_size, autocast)


def test_without_offloaded_layers_no_hooks_and_no_files(tmp_path):
    model, offload = build_offloaded(TINY, CPU, torch.float32, 1e12, 0, tmp_path)
    assert (offload.resident_layers, offload.offloaded_layers, offload.offloaded_bytes) == (4, 0, 0)
    assert not any(hasattr(part, "_hf_hook") for part in model.modules())
    assert not any(tmp_path.iterdir())


# ---- placement: accelerate against the planner ----------------------------------------------------

def placed_on(device: torch.device, arch, layer_memory: float, host: float = 1e15) -> list:
    return list(place_layers(meta_model(arch, torch.bfloat16), device, layer_memory, host).values())


def test_accelerate_keeps_on_the_cpu_the_layers_the_planner_predicts():
    layer = 2 * TINY.params_per_layer
    plain = estimate_memory(TINY, "infer", "bf16-pure", 1, 16, new_tokens=4).peak_bytes
    everything = estimate_memory(TINY, "infer", "bf16-pure", 1, 16, new_tokens=4, resident_layers=0).peak_bytes
    for budget in range(int(everything) - layer // 3, int(plain) + layer, layer // 3):
        split = offload_split(TINY, "infer", "bf16-pure", 1, 16, new_tokens=4, budget=budget)
        places = placed_on(CPU, TINY, split.layer_memory)
        resident = places.count("cpu")
        assert places == ["cpu"] * resident + ["disk"] * (4 - resident), budget
        assert resident == split.resident_layers, budget
        # the most layers whose predicted peak is within the budget
        peak = estimate_memory(TINY, "infer", "bf16-pure", 1, 16, new_tokens=4, resident_layers=resident).peak_bytes
        assert peak <= budget or split.layer_memory < split.layer_bytes
        if resident < 4:
            more = estimate_memory(TINY, "infer", "bf16-pure", 1, 16, new_tokens=4, resident_layers=resident + 1)
            assert more.peak_bytes > budget


@pytest.mark.parametrize("model, memory", [("65B", 80e9), ("llama-2-70b", 80e9), ("120B", 141e9)])
def test_accelerate_keeps_on_a_gpu_the_layers_the_planner_predicts(model, memory):
    arch = resolve(model)
    split = offload_split(arch, "infer", "bf16-pure", 1, 128, new_tokens=128, budget=memory, calibration=DEFAULT)
    assert 0 < split.resident_layers < arch.num_layers
    places = placed_on(GPU, arch, split.layer_memory)
    assert places == [0] * split.resident_layers + ["cpu"] * (arch.num_layers - split.resident_layers)


def test_offload_beyond_host_memory_is_refused_before_anything_is_allocated(tmp_path):
    arch = resolve("65B")  # 34 of 80 layers (55 GB) offloaded on an 80 GB GPU
    split = offload_split(arch, "infer", "bf16-pure", 1, 128, new_tokens=128, budget=80e9, calibration=DEFAULT)
    assert placed_on(GPU, arch, split.layer_memory, host=20e9).count("disk") > 0
    with pytest.raises(OffloadCapacityError, match="fit neither on the GPU nor in the host memory") as error:
        build_offloaded(arch, GPU, torch.bfloat16, split.layer_memory, 20e9, tmp_path)
    assert worker.classify(error.value) == "refused"
    assert not any(tmp_path.iterdir())


def test_disk_offload_needs_the_space(tmp_path):
    layers = {"model.layers.0": "disk"}
    assert capacity_problem(CPU, layers, 1, tmp_path) is None
    assert "GB free under" in capacity_problem(CPU, layers, 10**18, tmp_path)
