"""The documents a sweep's rows become on request: an analysis through Ollama, an HTML report and an
Excel workbook (``fitbench.report``), written by ``fitbench run`` and ``fitbench report``."""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from fitbench.cli.console import console, warn
from fitbench.errors import UserError

DEFAULT_OLLAMA_URL = "http://localhost:11434"


def write_documents(directory: str, rows: list[dict[str, Any]], html: str | None = None, xlsx: str | None = None,
                    ollama_url: str | None = None, ollama_model: str | None = None) -> None:
    """The analysis, HTML report and workbook of the sweep in ``directory`` that the options ask for."""
    from fitbench.report.analysis import analyse, check_url, write_analysis

    text = None
    if ollama_url is not None or ollama_model is not None:
        if not ollama_model:
            raise UserError("ollama-model: --ollama-url needs --ollama-model, the model that writes the analysis "
                            "(e.g. gpt-oss-20b).")
        url = check_url(ollama_url if ollama_url is not None else DEFAULT_OLLAMA_URL)
        console.print(f"asking {escape(ollama_model)} at {escape(url)} for an analysis ...")
        analysis = analyse(rows, url, ollama_model)
        if analysis.warning:
            warn(analysis.warning)
        else:
            text = analysis.text
            console.print(f"analysis: {write_analysis(analysis, directory, ollama_model)}")
    if html:
        from fitbench.report.html import write_html

        console.print(f"html: {write_html(directory, html, text)}")
    if xlsx:
        from fitbench.report.excel import write_xlsx

        console.print(f"xlsx: {write_xlsx(directory, xlsx)}")
