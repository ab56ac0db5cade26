"""The documents a sweep's rows become on request: an analysis through Ollama, an HTML report and an
Excel workbook (``fitbench.report``), written by ``fitbench run`` and ``fitbench report``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from fitbench.cli.console import console, warn
from fitbench.results.terminal import NO_STEPS, Steps
from fitbench.util.errors import UserError

if TYPE_CHECKING:
    from fitbench.results.directories import Sweeps

DEFAULT_OLLAMA_URL = "http://localhost:11434"


def report_module(name: str, option: str):
    """``fitbench.report.<name>``, whose libraries come with the ``report`` extra: one paragraph naming
    ``option`` and the install command where they are missing, not a traceback."""
    import importlib

    try:
        return importlib.import_module(f"fitbench.report.{name}")
    except ModuleNotFoundError as missing:
        if missing.name and missing.name.startswith("fitbench"):
            raise
        raise UserError(f"{option}: needs {missing.name}, which comes with fitbench's report extra; install it "
                        f"with pip install 'fitbench[report]' (or pip install {missing.name}).") from None


def write_documents(sweeps: Sweeps, html: str | None = None, xlsx: str | None = None,
                    ollama_url: str | None = None, ollama_model: str | None = None,
                    ollama_timeout: float | None = None, steps: Steps = NO_STEPS,
                    gpu_hour_price: float | None = None) -> None:
    """The analysis, HTML report and workbook that the options ask for, of ``sweeps`` (the rows of each
    directory, as ``fitbench.results.directories`` read them), telling their stages to ``steps``;
    nothing, and no import of ``fitbench.report`` (the ``report`` extra's libraries), where none is. A
    page or a workbook needs a row in each directory. ``analysis.md`` goes into the directory, or, for
    several, beside the HTML page or the workbook (the working directory without either)."""
    text = None
    if ollama_url is not None or ollama_model is not None:
        if not ollama_model:
            raise UserError("ollama-model: --ollama-url needs --ollama-model, the model that writes the analysis "
                            "(e.g. gpt-oss-20b).")
        analysis_module = report_module("analysis", "ollama-url")
        url = analysis_module.check_url(ollama_url if ollama_url is not None else DEFAULT_OLLAMA_URL)
        timeout = analysis_module.DEFAULT_TIMEOUT_S if ollama_timeout is None else ollama_timeout
        console.print(f"asking {escape(ollama_model)} at {escape(url)} for an analysis ...")
        analysis = analysis_module.analyse(sweeps.rows, url, ollama_model, timeout, label=sweeps.label)
        if analysis.warning:
            warn(analysis.warning)
        else:
            text = analysis.text
            place = sweeps.sweeps[0].directory if not sweeps.several else Path(html or xlsx or ".").parent
            console.print(f"analysis: {analysis_module.write_analysis(analysis, place, ollama_model)}")
    if html or xlsx:
        for sweep in sweeps.sweeps:
            sweep.require_rows("report")
    if html:
        console.print(f"html: {report_module('html', 'html').write_html(sweeps, html, text, steps, gpu_hour_price)}")
    if xlsx:
        console.print(f"xlsx: {report_module('excel', 'xlsx').write_xlsx(sweeps, xlsx, steps, gpu_hour_price)}")
