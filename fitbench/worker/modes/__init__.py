"""The modes' measuring loops: what the worker runs on a built, parallelized model. ``train``,
``forward`` and ``forward-backward`` time steps (``fitbench.worker.modes.steps``), ``infer`` times
generations (``fitbench.worker.modes.generation``). Each takes the spec (with this rank's data seed),
the architecture, the ``Built`` model, the precision's policy, the clock and device, the ``Peaks``
(``fitbench.worker.modes.peaks``) for MFU, the weight bytes, the tokens, and ``run_stages``' barrier and counter; each returns the
timing, the throughput, the names of the noisy figures, the compile seconds and the ``Verdict``.
"""

from __future__ import annotations


def measure_mode(mode: str):
    """The measuring loop of ``mode``."""
    if mode == "infer":
        from fitbench.worker.modes.generation import measure_generation

        return measure_generation
    from fitbench.worker.modes.steps import measure_steps

    return measure_steps
