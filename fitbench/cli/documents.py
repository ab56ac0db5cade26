"""The documents a sweep's rows become on request: an analysis through Ollama, an HTML report and an
Excel workbook (``fitbench.report``), written by ``fitbench run`` and ``fitbench report``."""

from __future__ import annotations

from rich.markup import escape

from fitbench.cli.console import console, warn
from fitbench.results.row import Row
from fitbench.results.terminal import NO_STEPS, Steps
from fitbench.util.errors import UserError

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


def write_documents(directory: str, rows: list[Row], html: str | None = None, xlsx: str | None = None,
                    ollama_url: str | None = None, ollama_model: str | None = None, steps: Steps = NO_STEPS) -> None:
    """The analysis, HTML report and workbook of the sweep in ``directory`` that the options ask for,
    telling their stages to ``steps``; nothing, and no import of ``fitbench.report`` (the ``report``
    extra's libraries), where none is."""
    text = None
    if ollama_url is not None or ollama_model is not None:
        if not ollama_model:
            raise UserError("ollama-model: --ollama-url needs --ollama-model, the model that writes the analysis "
                            "(e.g. gpt-oss-20b).")
        analysis_module = report_module("analysis", "ollama-url")
        url = analysis_module.check_url(ollama_url if ollama_url is not None else DEFAULT_OLLAMA_URL)
        console.print(f"asking {escape(ollama_model)} at {escape(url)} for an analysis ...")
        analysis = analysis_module.analyse(rows, url, ollama_model)
        if analysis.warning:
            warn(analysis.warning)
        else:
            text = analysis.text
            console.print(f"analysis: {analysis_module.write_analysis(analysis, directory, ollama_model)}")
    if html:
        console.print(f"html: {report_module('html', 'html').write_html(directory, html, text, steps)}")
    if xlsx:
        console.print(f"xlsx: {report_module('excel', 'xlsx').write_xlsx(directory, xlsx, steps)}")
