"""benchmarks/auto_vs_best.sh in its dry run: the plan runs on the CPU for a described GPU, and the
script prints one run per layout the plan lists as fitting, the choice with its strategy left to the
planner."""

import json
import os
import subprocess
import sys
from pathlib import Path

from fitbench.cli import build_parser

ROOT = Path(__file__).parent.parent
CASES = {"1b-infer-b1", "1b-infer-b16", "7b-infer-b1", "7b-infer-b16", "13b-train", "30b-train", "70b-infer-b1",
         "13b-forward"}


def test_the_dry_run_prints_the_choice_and_every_fitting_layout(tmp_path):
    environment = {**os.environ, "FITBENCH": f"{sys.executable} -m fitbench", "FITBENCH_GPU": "H100-80GB"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks/auto_vs_best.sh"), str(tmp_path), "4", "dry-run"],
                          capture_output=True, text=True, env=environment, timeout=300)
    assert done.returncode == 0, done.stderr
    commands = done.stdout.splitlines()
    assert not list(tmp_path.rglob("results.jsonl"))  # nothing ran
    assert {p.parent.name for p in tmp_path.glob("*/plan.json")} == CASES
    for case in CASES:
        (plan,) = json.loads((tmp_path / case / "plan.json").read_text())  # a list of one plan
        runs = [c.split() for c in commands if c.split("--out ")[1].startswith(f"{tmp_path / case}/")]
        # the choice and each other fitting layout, once each
        assert len(runs) == len(plan["feasible"]), case
        choice = [r for r in runs if r[-1].endswith("/choice")]
        assert len(choice) == 1 and "--strategy" not in choice[0] and choice[0][choice[0].index("--gpus") + 1] == "4"
        for run in runs:
            assert run[run.index("--precision") + 1] == "bf16-pure"
            assert run[run.index("--warmup-steps") + 1] == "2" and run[run.index("--measure-steps") + 1] == "5"
        strategies = {(r[r.index("--strategy") + 1] if "--strategy" in r else "single",
                       r[r.index("--gpus") + 1] if "--gpus" in r else "1",
                       r[r.index("--tp") + 1] if "--tp" in r else None,
                       "--activation-checkpointing" in r or "--checkpointed-layers" in r)
                      for r in runs if r is not choice[0]}
        assert len(strategies) == len(runs) - 1, case  # no layout twice
        # a plan's partial checkpointing runs as --checkpointed-layers N, every layer as --activation-checkpointing
        layers = sorted(str(a["candidate"]["checkpointed_layers"]) for a in plan["feasible"]
                        if a["candidate"]["checkpointed_layers"] is not None)
        assert sorted(r[r.index("--checkpointed-layers") + 1] for r in runs if "--checkpointed-layers" in r) == layers
        everything = sum(a["candidate"]["activation_checkpointing"] for a in plan["feasible"]) - len(layers)
        assert sum("--activation-checkpointing" in r for r in runs) == everything, case
        for run in runs:
            build_parser().parse_args(run[run.index("run"):])  # options fitbench run takes
    seventy = [c for c in commands if "/70b-infer-b1/" in c]
    assert any(c.endswith("/choice") for c in seventy) and any(c.endswith("/pipeline-2") for c in seventy)
    assert not any(c.endswith("/single-1") for c in seventy)  # 140 GB of weights fit no single 80 GB GPU


def test_alternatives_and_cases_narrow_the_runs_and_the_summary_counts_them(tmp_path):
    """ALTERNATIVES=1 runs the choice and the plan's first alternative, CASES only the cases named; the
    summary counts the alternatives measured against those the plan listed, and a case without a row is
    not within 10%."""
    environment = {**os.environ, "FITBENCH": f"{sys.executable} -m fitbench", "FITBENCH_GPU": "H100-80GB",
                   "ALTERNATIVES": "1", "CASES": "70b-infer-b1 13b-forward"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks/auto_vs_best.sh"), str(tmp_path), "4", "dry-run"],
                          capture_output=True, text=True, env=environment, timeout=300)
    assert done.returncode == 0, done.stderr
    commands = done.stdout.splitlines()
    assert {p.parent.name for p in tmp_path.glob("*/plan.json")} == {"70b-infer-b1", "13b-forward"}
    assert len(commands) == 4
    assert [c.rsplit("/", 1)[1] for c in commands if "/70b-infer-b1/" in c][0] == "choice"
    (plan,) = json.loads((tmp_path / "70b-infer-b1" / "plan.json").read_text())
    (tmp_path / "70b-infer-b1" / "choice").mkdir()
    summary = subprocess.run(["bash", str(ROOT / "benchmarks/auto_vs_best.sh"), str(tmp_path), "4", "summary"],
                             capture_output=True, text=True, env=environment, timeout=60)
    assert summary.returncode == 0, summary.stderr
    lines = {line.split(" | ")[0].strip("| "): line for line in summary.stdout.splitlines() if line.startswith("| ")}
    assert lines["70b-infer-b1"].endswith(f"| no | 0 / {len(plan['feasible']) - 1} |")
    assert "within 10% of the best measured layout in 0 of 2 cases" in summary.stdout


def test_a_limited_run_samples_the_fitting_layouts_rather_than_taking_the_plans_favourites(tmp_path):
    """ALTERNATIVES=3 runs 3 of 13B training's fitting layouts, the first of a shuffle seeded by SAMPLE_SEED
    (recomputed here from the plan), not the plan's first three; the same seed draws the same, another
    seed others."""
    import random

    def alternatives_run(seed: int, out: Path) -> list[tuple[str, str | None, bool]]:
        environment = {**os.environ, "FITBENCH": f"{sys.executable} -m fitbench", "FITBENCH_GPU": "H100-80GB",
                       "ALTERNATIVES": "3", "CASES": "13b-train", "SAMPLE_SEED": str(seed)}
        done = subprocess.run(["bash", str(ROOT / "benchmarks/auto_vs_best.sh"), str(out), "4", "dry-run"],
                              capture_output=True, text=True, env=environment, timeout=300)
        assert done.returncode == 0, done.stderr
        runs = [c.split() for c in done.stdout.splitlines() if not c.endswith("/choice")]
        return [(r[r.index("--gpus") + 1] if "--gpus" in r else "1", r[r.index("--tp") + 1] if "--tp" in r else None,
                 "--activation-checkpointing" in r or "--checkpointed-layers" in r) for r in runs]

    first = alternatives_run(0, tmp_path / "a")
    (plan,) = json.loads((tmp_path / "a" / "13b-train" / "plan.json").read_text())
    alternatives = [a["candidate"] for a in plan["feasible"] if a["candidate"] != plan["chosen"]["candidate"]]
    random.Random(0).shuffle(alternatives)

    def described(candidate) -> tuple[str, str | None, bool]:
        tp = candidate["layout"]["tp"]
        return (str(candidate["gpus"]), str(tp) if tp > 1 and candidate["strategy"] != "tp" else None,
                candidate["activation_checkpointing"])

    assert len(alternatives) > 3 and first == [described(c) for c in alternatives[:3]]
    assert alternatives_run(0, tmp_path / "b") == first
    assert any(alternatives_run(seed, tmp_path / f"s{seed}") != first for seed in (1, 2, 3))
