"""What ``fitbench plan`` says beside its numbers (``fitbench.planning.explain``): why it chose what it chose
in one sentence, the requirements table marking what fits only inside the margin the plan keeps free
(where the two used to disagree in silence), a marketed size named beside the card's real one, each
rejection reason once, one JSON shape, and a non-zero exit when nothing fits."""

import json
import re

from conftest import cli
from fitbench.hardware.datasheet import gpu_spec
from fitbench.planning.planner import RETRY_MARGIN
from fitbench.util.units import format_bytes

H100 = "NVIDIA H100 80GB HBM3"
# Llama-3.1-405B decoding on H100s: bf16-pure needs 10 of them, and fits only inside the retry margin.
EDGE = ["plan", "--models", "llama-3.1-405b", "--mode", "infer", "--gpu", "H100-80GB"]


def test_the_requirements_table_marks_the_rows_the_plan_passes_over(capsys):
    code, out, err = cli([*EDGE, "--requirements", "--json"], capsys)
    assert code == 0, err
    rows = {row["precision"]: row for row in json.loads(out)}
    bf16 = rows["bf16-pure"]
    assert bf16["min_gpus"] == 10 and bf16["clear_of_retry_margin"] is False
    memory = gpu_spec(H100).total_memory
    assert bf16["peak_per_gpu_bytes"] > (1 - RETRY_MARGIN) * memory  # inside the margin, by hand
    code, out, err = cli([*EDGE, "--requirements"], capsys)
    text = " ".join(out.split())
    row = [cell.strip() for cell in next(line for line in out.splitlines() if "bf16-pure" in line).split("│")]
    assert row[-3].endswith("*") and row[-2] == str(bf16["min_gpus_clear_of_retry_margin"])
    assert f"*: fits only inside the {RETRY_MARGIN:.1%} of each GPU's memory ({format_bytes(RETRY_MARGIN * memory)})" \
           in text


def test_the_requirements_and_the_plan_agree_on_every_count(capsys):
    """The count clear of the margin is the fewest on which `plan` keeps the precision: on it the plan
    chooses bf16-pure, on every count below it (10, where bf16-pure fits only inside the margin) a later
    rung; the same for int8 against nf4."""
    import fitbench

    code, out, err = cli([*EDGE, "--requirements", "--json"], capsys)
    rows = {row["precision"]: row for row in json.loads(out)}
    bf16 = rows["bf16-pure"]
    assert bf16["min_gpus"] == 10 < bf16["min_gpus_clear_of_retry_margin"]
    assert bf16["how_clear_of_retry_margin"].startswith("bf16-pure, ")
    for precision, ladder in (("bf16-pure", ["bf16-pure", "int8", "nf4"]), ("int8", ["int8", "nf4"])):
        clear = rows[precision]["min_gpus_clear_of_retry_margin"]
        for gpus in range(rows[precision]["min_gpus"], clear + 1):
            plan = fitbench.plan("llama-3.1-405b", "infer", gpu="H100-80GB", gpus=gpus, precisions=ladder)
            if plan.chosen is not None and plan.chosen.candidate.gpus == gpus:
                assert (plan.chosen.candidate.precision == precision) == (gpus == clear), (gpus, plan.chosen.candidate)
        kept = fitbench.plan("llama-3.1-405b", "infer", gpu="H100-80GB", gpus=clear, precisions=ladder).chosen
        assert kept.candidate.precision == precision and kept.clear


def test_the_plan_on_those_gpus_says_why_it_took_the_next_rung(capsys):
    code, out, err = cli([*EDGE, "--gpus", "10"], capsys)
    assert code == 0, err
    text = " ".join(out.split())
    memory = gpu_spec(H100).total_memory
    why = re.search(r"Why (int8, [^:]*): (.*?\.) ", text)
    assert why, text
    assert why.group(2).startswith(f"the precision ladder bf16-pure > int8 > nf4 is tried in order, keeping "
                                   f"{RETRY_MARGIN:.1%} of each GPU's memory ({format_bytes(RETRY_MARGIN * memory)}) "
                                   f"free against the caching allocator's retries; bf16-pure fits only inside that "
                                   f"margin (bf16-pure, pipeline x 10, batch 1:")
    assert f"chosen: {why.group(1)}" in text and "int8 is the first that fits clear of it" in why.group(2)


def test_each_rejection_reason_is_printed_once(capsys):
    code, out, err = cli([*EDGE, "--gpus", "10"], capsys)
    text = " ".join(out.split())
    reasons = [line for line in re.split(r" (?=rejected: )", text) if line.startswith("rejected: ")]
    assert text.count("needs 426.4 GB per GPU; 85.0 GB available") == 1  # int8 on 1 GPU and every replicas layout
    assert "int8, 1 GPU, batch 1; int8, replicas x 2, batch 1" in text
    assert len(reasons) == len({reason.split(": ", 2)[-1] for reason in reasons})


def test_a_marketed_size_is_named_beside_the_card_it_describes(capsys):
    code, out, err = cli(["plan", "--models", "7B", "--mode", "infer", "--gpu-memory", "80GB", "--gpus", "1"], capsys)
    text = " ".join(out.split())
    h100 = gpu_spec(H100).total_memory
    assert "--gpu-memory 80GB plans for 80.0 GB per GPU, as given" in text
    assert f"{H100} gives a process {format_bytes(h100)} (--gpu H100-80GB)" in text
    code, out, err = cli(["plan", "--models", "7B", "--mode", "infer", "--gpu-memory", "85.0GB", "--gpus", "1"],
                         capsys)
    assert "as given" not in out  # a size no card is sold as: no note


def test_json_is_a_list_for_one_model_as_for_several(capsys):
    for models in (["7B"], ["7B", "13B"]):
        code, out, err = cli(["plan", "--models", *models, "--mode", "infer", "--gpu", "H100-80GB", "--json"], capsys)
        assert code == 0, err
        plans = json.loads(out)
        assert isinstance(plans, list) and [plan["model"] for plan in plans] == models


def test_nothing_fits_exits_1(capsys):
    code, out, err = cli(["plan", "--models", "llama-2-70b", "--mode", "infer", "--gpus", "1", "--gpu-memory", "20GB",
                          "--precision", "bf16-pure"], capsys)
    assert code == 1 and "nothing fits" in out
    code, out, err = cli(["plan", "--models", "llama-2-70b", "--mode", "infer", "--gpus", "1", "--gpu-memory", "20GB",
                          "--precision", "bf16-pure", "--json"], capsys)
    assert code == 1 and json.loads(out)[0]["chosen"] is None
