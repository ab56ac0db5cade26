"""The documents a sweep's rows become on request: an analysis through Ollama, an HTML report and an
Excel workbook (``fitbench.report``), written by ``fitbench run`` and ``fitbench report``."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from fitbench.cli.console import console, warn
from fitbench.results.terminal import NO_STEPS, Steps
from fitbench.util.errors import UserError

if TYPE_CHECKING:
    from fitbench.results.directories import Sweeps

DEFAULT_OLLAMA_URL = "http://localhost:11434"


def ollama_server(given: str | None) -> str:
    """The Ollama server to ask: ``--ollama-url`` where given, else the ``OLLAMA_HOST`` its own client
    reads (``host``, ``host:port`` or a URL; the scheme http and the port 11434 where left out), else
    ``DEFAULT_OLLAMA_URL``."""
    if given is not None:
        return given
    host = os.environ.get("OLLAMA_HOST", "").strip()
    if not host:
        return DEFAULT_OLLAMA_URL
    url = host if "://" in host else f"http://{host}"
    return url if re.search(r":\d+(/|$)", url.split("://", 1)[1]) else url.rstrip("/") + ":11434"


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
                    gpu_hour_price: float | None = None, analysis_directory: str | Path | None = None) -> None:
    """The analysis, HTML report and workbook that the options ask for, of ``sweeps`` (the rows of each
    directory, as ``fitbench.results.directories`` read them), telling their stages to ``steps``;
    nothing, and no import of ``fitbench.report`` (the ``report`` extra's libraries), where none is. A
    page or a workbook needs a row in each directory. ``analysis.md`` goes into ``analysis_directory``
    (``fitbench run``'s own results directory), else beside the HTML page or the workbook, else into the
    working directory: never into a results directory a report only reads."""
    text = None
    if ollama_url is not None or ollama_model is not None:
        if not ollama_model:
            raise UserError("ollama-model: --ollama-url needs --ollama-model, the model that writes the analysis "
                            "(e.g. gpt-oss-20b).")
        analysis_module = report_module("analysis", "ollama-url")
        url = analysis_module.check_url(ollama_server(ollama_url))
        timeout = analysis_module.DEFAULT_TIMEOUT_S if ollama_timeout is None else ollama_timeout
        console.print(f"asking {escape(ollama_model)} at {escape(url)} for an analysis ...")
        analysis = analysis_module.analyse(sweeps.rows, url, ollama_model, timeout, label=sweeps.label)
        if analysis.warning:
            warn(analysis.warning)
        else:
            text = analysis.text
            place = analysis_directory if analysis_directory is not None else Path(html or xlsx or ".").parent
            console.print(f"analysis: {analysis_module.write_analysis(analysis, place, ollama_model)}")
    if html or xlsx:
        for sweep in sweeps.sweeps:
            sweep.require_rows("report")
    if html:
        page = report_module("html", "html").write_html(sweeps, html, text, steps, gpu_hour_price, ollama_model)
        console.print(f"html: {page}")
    if xlsx:
        console.print(f"xlsx: {report_module('excel', 'xlsx').write_xlsx(sweeps, xlsx, steps, gpu_hour_price)}")
