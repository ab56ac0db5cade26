"""A short written analysis of a sweep by a language model served through Ollama.

The model gets the machine's GPUs (each device's name, count and memory, from the rows'
environment), the rows as a compact table (one line per configuration: its label, layout and GPUs,
status, headline figures with their spread: the CV and the p90 and p99 latencies, measured and
predicted peak, and the last line of its error) and the planner's notes (why each other layout or
precision was rejected, what it chose itself), and is asked what fits, each row's bottleneck and what
to try next. It goes through the official ``ollama`` client's ``chat``, streamed or not
(``stream``). The analysis is an extra: a server that cannot be reached, a model it does not have,
an answer later than ``timeout`` seconds (for the whole answer: each read waits at most that long,
and a streamed answer is cut when the total passes it) or any other failure of the exchange leaves
``Analysis.text`` None and says why in ``Analysis.warning``; the report is written without it. Only a
URL that is no URL (``fitbench.util.endpoints``) is bad input. The page renders its Markdown
(``fitbench.report.html.markdown_html``) under the name of the model that wrote it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import ollama
import pydantic

from fitbench.report.output import write_output
from fitbench.results.report import device_count, headline, latency_percentiles, layout_name
from fitbench.results.row import Row
from fitbench.util.endpoints import http_url_problem
from fitbench.util.errors import UserError
from fitbench.util.units import format_bytes, format_seconds

ANALYSIS_FILE = "analysis.md"
DEFAULT_TIMEOUT_S = 120.0
NOTES_PER_ROW = 3  # the planner's rejections quoted per row: the first few say why the others fell
SYSTEM = ("You are an expert in benchmarking large language models on GPUs. You are given the results of a "
          "fitbench sweep, one configuration per line, and the planner's notes. Write a short analysis in "
          "Markdown, at most 250 words: what fits and runs well, the bottleneck of each configuration "
          "(compute, memory bandwidth, memory capacity, communication or overheads) with the figure that shows "
          "it, and what to try next. Quote only figures given; do not invent any.")


@dataclass(frozen=True)
class Analysis:
    """The model's text, or None and a warning saying why there is none."""

    text: str | None
    warning: str | None = None


def check_url(url: str, option: str = "--ollama-url") -> str:
    problem = http_url_problem(url)
    if problem:
        raise UserError(f"{option[2:]}: {problem}; give the address of an Ollama server, like "
                        f"http://localhost:11434.")
    return url.strip()


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def hardware(rows: list[Row]) -> str:
    """The devices the rows ran on, each with its count and memory: ``4 x NVIDIA H100 80GB HBM3 (85.0 GB
    each)``; the CPU where no GPU is named."""
    seen = Counter()
    for row in rows:
        gpus = (row.environment or {}).get("gpus") or []
        for name, memory in {(gpu.get("name"), gpu.get("total_memory")) for gpu in gpus if gpu.get("name")}:
            seen[(name, memory)] = max(seen[(name, memory)], sum(gpu.get("name") == name for gpu in gpus))
    if not seen:
        cpus = {(row.environment or {}).get("cpu_model") for row in rows} - {None}
        return "CPU: " + (", ".join(sorted(cpus)) or "unknown")
    return "; ".join(f"{count} x {name} ({format_bytes(memory)} each)" for (name, memory), count in seen.items())


def _spread(row: Row) -> str:
    kind = "token" if row.spec["mode"] == "infer" else "step"
    values = latency_percentiles(row).get(kind)
    return "-" if not values else f"{format_seconds(values[90])} / {format_seconds(values[99])}"


def prompt(rows: list[Row], label: Callable[[Row], str] = lambda row: row.label) -> str:
    """The hardware, then the rows as compact lines, each named by ``label`` (a report of several
    directories adds a repeated configuration's directory), then the planner's notes."""
    lines = [f"GPUs of the machine: {hardware(rows)} (each row's layout says how many it used)", "",
             "configuration | layout (GPUs) | status | time (median) | CV | p90 / p99 | tokens/s | MFU | "
             "decode % of bandwidth roofline | measured peak per GPU | predicted peak | error"]
    notes = []
    for row in rows:
        head = headline(row)
        error = (row.error or "").strip().splitlines()
        lines.append(" | ".join([
            label(row), f"{layout_name(row)} ({device_count(row)})", row.status, format_seconds(head["time"]),
            "-" if head["cv"] is None else f"{head['cv']:.1f}%", _spread(row),
            "-" if head["tokens_per_s"] is None else f"{head['tokens_per_s']:,.0f}", _percent(head["mfu"]),
            "-" if head["roofline"] is None else f"{head['roofline']:.0f}%", format_bytes(head["measured_peak"]),
            format_bytes(head["predicted_peak"]), error[-1][:200] if error else "-"]))
        prediction = row.prediction or {}
        for rejected in (prediction.get("rejected") or [])[:NOTES_PER_ROW]:
            notes.append(f"- {label(row)}: rejected {rejected}")
        if prediction.get("chosen_by_planner"):
            notes.append(f"- {label(row)}: the planner chose its {', '.join(map(str, prediction['chosen_by_planner']))}")
    return "\n".join(lines) + ("\n\nPlanner's notes:\n" + "\n".join(notes) if notes else "")


def analyse(rows: list[Row], url: str, model: str, timeout: float = DEFAULT_TIMEOUT_S, stream: bool = True,
            label: Callable[[Row], str] = lambda row: row.label) -> Analysis:
    """The analysis of ``rows`` (each named by ``label``) by ``model`` on the Ollama server at ``url``
    (the module's docstring)."""
    url = check_url(url)
    where = f"the Ollama server at {url} (model {model})"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt(rows, label)}]
    client = ollama.Client(host=url, timeout=timeout)
    started = time.monotonic()
    try:
        if stream:
            parts = []
            for chunk in client.chat(model=model, messages=messages, stream=True):
                parts.append(chunk.message.content or "")
                if time.monotonic() - started > timeout:
                    return Analysis(None, f"{where} answered for longer than {timeout:g} s; the report is "
                                          f"written without its analysis")
            text = "".join(parts)
        else:
            text = client.chat(model=model, messages=messages, stream=False).message.content or ""
    except ollama.ResponseError as error:
        return Analysis(None, f"{where} refused the request ({error.status_code}: {error.error}); the report is "
                              f"written without its analysis" + (f" (`ollama pull {model}` fetches the model)"
                                                                   if error.status_code == 404 else ""))
    except (ConnectionError, httpx.ConnectError):  # the client turns the latter into the former unless streaming
        return Analysis(None, f"{where} cannot be reached; the report is written without its analysis (is "
                              f"`ollama serve` running there?)")
    except httpx.TimeoutException:
        return Analysis(None, f"{where} did not answer within {timeout:g} s; the report is written without its "
                              f"analysis")
    except (httpx.HTTPError, pydantic.ValidationError, ValueError) as error:
        return Analysis(None, f"{where} gave no usable answer ({type(error).__name__}: {str(error)[:200]}); the "
                              f"report is written without its analysis")
    if not text.strip():
        return Analysis(None, f"{where} answered with no text; the report is written without its analysis")
    return Analysis(text.strip())


def write_analysis(analysis: Analysis, directory: str | Path, model: str) -> Path | None:
    """``analysis.md`` in ``directory`` when there is an analysis, headed by the model that wrote it."""
    if analysis.text is None:
        return None
    return write_output(Path(directory) / ANALYSIS_FILE, f"# Analysis by {model}\n\n{analysis.text}\n",
                        "--ollama-model")
