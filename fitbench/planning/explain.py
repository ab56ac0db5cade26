"""What ``fitbench plan`` says about its choice beside the numbers: why it chose what it chose, in one
sentence; the rejected candidates grouped by their reason; and, where a size given as ``--gpu-memory``
names a known card's marketed size, the memory that card really gives a process.

The choice follows ``fitbench.planning.planner.plan``: the precision ladder is tried in order (quality
first), and the first rung with a candidate that fits with ``RETRY_MARGIN`` of each GPU's memory kept
free (``Assessment.clear``) wins, at its fastest forecast; only where nothing is clear of the margin
does a candidate inside it win. So a precision that fits only inside the margin (the requirements
table's ``inside the margin`` rows) is passed over for a later rung that is clear of it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from fitbench.hardware.datasheet import gpu_spec
from fitbench.planning.planner import GPU_ALIASES, Assessment, Plan
from fitbench.util.units import format_bytes


def why_chosen(plan: Plan, ladder: list[str], margin: float) -> str | None:
    """One sentence: the ladder's order, the share of memory kept free (``margin``, ``retry_margin``'s),
    what each rung before the chosen one lacked, and that the chosen layout is its rung's fastest
    forecast. None where nothing was chosen."""
    chosen = plan.chosen
    if chosen is None:
        return None
    memory = plan.target.memory
    kept = (f"keeping {margin:.1%} of each GPU's memory ({format_bytes(margin * memory)}) free against the caching "
            f"allocator's retries" if margin else "with no memory kept free (a CPU has no caching allocator)")
    precision = chosen.candidate.precision
    passed = []
    for rung in ladder[:ladder.index(precision)] if precision in ladder else []:
        fitting = [a for a in plan.feasible if a.candidate.precision == rung]
        if not fitting:
            passed.append(f"{rung} fits no layout of these GPUs")
        elif not any(a.clear for a in fitting):
            least = min(fitting, key=lambda a: a.predicted_peak)
            passed.append(f"{rung} fits only inside that margin ({least.candidate.label}: "
                          f"{format_bytes(least.predicted_peak)} of {format_bytes(memory)})")
    rivals = [a for a in plan.feasible if a.candidate.precision == precision and a.clear == chosen.clear]
    first = ("the first that fits clear of it" if chosen.clear
             else "the first that fits at all, inside the margin, since nothing fits clear of it")
    return (f"Why {chosen.candidate.label}: the precision ladder {' > '.join(ladder)} is tried in order, {kept}; "
            + "".join(f"{reason}; " for reason in passed)
            + f"{precision} is {first}, and of its {len(rivals)} layout(s) that do, this one has the fastest forecast "
              f"({chosen.forecast_tokens_per_s:,.0f} tokens/s).")


def grouped_rejections(rejected: Iterable[Assessment]) -> list[str]:
    """Each reason once, after the candidates it rejects, in the order first met: ``int8, 1 GPU, batch 1;
    int8, replicas x 2, batch 1: needs 426.4 GB per GPU; 85.0 GB available``. A reason names its own
    candidate's layout (``cannot launch tp x 2: ...``); it is read as ``this layout`` so that the
    layouts refused for one cause share a line."""
    groups: dict[str, list[str]] = {}
    for assessment in rejected:
        label = assessment.candidate.label
        why = (assessment.reason or "rejected")
        why = why[len(label):].lstrip(":").strip() if why.startswith(label) else why
        layout = assessment.candidate.layout.label
        if layout:
            why = re.sub(rf"(?<![\w-]){re.escape(layout)}(?![\w-])", "this layout", why)
        groups.setdefault(why, []).append(label)
    return [f"{'; '.join(labels)}: {why}" for why, labels in groups.items()]


def marketed_memory_note(gpu_memory: str | None, memory: float) -> str | None:
    """Where ``--gpu-memory`` was given as a known card's marketed size (``80GB``) and that card gives a
    process another amount (an H100 80GB: 85.0 GB, its 79.2 GiB, ``fitbench.hardware.datasheet``), both
    named, and how to plan for the card itself. None otherwise."""
    if not gpu_memory:
        return None
    size = re.sub(r"\s+", "", gpu_memory).upper()
    cards = {}
    for alias, name in GPU_ALIASES.items():
        spec = gpu_spec(name)
        if spec and re.search(rf"(?<!\d){re.escape(size)}", alias) and abs(spec.total_memory - memory) > 0.01 * memory:
            cards.setdefault(name, (alias, spec.total_memory))
    if not cards:
        return None
    named = "; ".join(f"{name} gives a process {format_bytes(total)} (--gpu {alias})" for name, (alias, total)
                      in cards.items())
    return (f"--gpu-memory {gpu_memory} plans for {format_bytes(memory)} per GPU, as given; the cards sold as "
            f"{size} differ: {named}")


def requirements_note(rows: list[dict], margin: float, memory: float, gpu_memory: str | None) -> str | None:
    """What the requirements table's ``*`` means, where a row has it (its fewest GPUs fit only inside
    ``margin``: ``fitbench plan`` on that many chooses a later rung or more GPUs where it can), and the
    marketed-size note; None where neither applies."""
    parts = []
    if any(row.get("clear_of_retry_margin") is False for row in rows):
        parts.append(f"*: fits only inside the {margin:.1%} of each GPU's memory ({format_bytes(margin * memory)}) "
                     f"that `fitbench plan` keeps free against the caching allocator's retries; on that many GPUs "
                     f"`fitbench plan` takes the next precision of the ladder that fits clear of it, where one does, "
                     f"and keeps this one from the count in the last column.")
    marketed = marketed_memory_note(gpu_memory, memory)
    if marketed:
        parts.append(marketed)
    return " ".join(parts) or None
