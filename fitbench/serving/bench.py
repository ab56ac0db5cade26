"""A serving benchmark: the points of a sweep (request rates, then concurrencies) run one after the
other against one OpenAI-compatible server, each point's requests (``fitbench.serving.workload``)
sent by ``fitbench.serving.client`` and summed up by ``fitbench.serving.metrics`` into one row of the
results store (``fitbench.results.store``), appended as soon as the point ends.

A point's row is a row like a sweep's: its ``spec`` names the model, ``mode`` ``serve``, the
precision the server was started with (``served`` when fitbench did not start it), ``batch_size``
the concurrency (0 at a request rate), ``seq_len`` and ``new_tokens`` the mean prompt and output
lengths asked, and the point; its ``key`` hashes the spec, so ``--resume`` skips the points that have
a row and ``fitbench compare`` pairs the same point of two runs. ``timing`` holds each latency's
statistics (``ttft``, ``tpot``, ``itl``, ``e2e``), the inter-token latencies as ``token_latency`` and
their raw ``samples.token_latency`` (what ``compare`` tests, as for an ``infer`` row's per-token latencies);
``throughput`` the throughputs, output tokens per second as ``decode_tokens_per_s``; ``serving`` the
counts, failures, goodput and every request's record. The row is ``ok`` when a request completed,
``error`` when none did; failed requests are counted in it either way.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

import httpx

from fitbench.results.row import Row
from fitbench.results.store import ResultStore
from fitbench.serving.client import Outcome, send
from fitbench.serving.metrics import summary
from fitbench.serving.workload import Lengths, requests
from fitbench.util.errors import UserError

# Connections beyond this many at once wait for a free one in httpx's pool: a point's concurrency,
# never the client, must bound what the server sees.
CONNECTIONS_MAX = 4096
MODELS_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Point:
    """A point of the sweep: Poisson arrivals at ``rate`` requests per second (``inf``: all at once),
    or ``concurrency`` clients in a closed loop; exactly one of the two is set."""

    rate: float | None = None
    concurrency: int | None = None

    def text(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        return "rate inf" if math.isinf(self.rate) else f"rate {self.rate:g}/s"


@dataclass(frozen=True)
class ServeBench:
    """What a serving benchmark sends and where (``fitbench serve-bench``'s options)."""

    base_url: str
    model: str
    points: tuple[Point, ...]
    requests: int
    prompt: Lengths
    output: Lengths
    prompt_format: str = "ids"
    endpoint: str = "completions"
    seed: int = 0
    slo: dict[str, float] = field(default_factory=dict)
    ignore_eos: bool = True
    request_timeout: float = 600.0
    precision: str = "served"
    command: str | None = None

    def spec(self, point: Point) -> dict[str, Any]:
        """The identity of ``point``'s row (the module's docstring)."""
        return {"model": self.model, "mode": "serve", "precision": self.precision,
                "batch_size": point.concurrency or 0, "seq_len": round(self.prompt.mean),
                "new_tokens": round(self.output.mean),
                "rate": None if point.rate is None else ("inf" if math.isinf(point.rate) else point.rate),
                "concurrency": point.concurrency, "requests": self.requests, "prompt_tokens": self.prompt.text(),
                "output_tokens": self.output.text(), "prompt_format": self.prompt_format,
                "endpoint": self.endpoint, "ignore_eos": self.ignore_eos, "seed": self.seed}


def spec_key(spec: dict[str, Any]) -> str:
    """The first 16 hex digits of the SHA-256 of the spec as sorted JSON."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def served_model(base_url: str) -> str:
    """The first model the server lists at ``GET {base_url}/models``; a UserError when none answers."""
    url = base_url.rstrip("/") + "/models"
    try:
        response = httpx.get(url, timeout=MODELS_TIMEOUT_S, trust_env=False)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as error:
        raise UserError(f"base-url: no OpenAI-compatible server lists its models at {url} ({error}). Start the "
                        f"server, or give its address with its /v1 (--base-url http://127.0.0.1:8000/v1), or name "
                        f"the model with --model.") from None


async def _run_point(bench: ServeBench, point: Point, on_request: Callable[[Outcome], None]) -> list[Outcome]:
    batch = requests(bench.requests, bench.prompt, bench.output, bench.prompt_format, point.rate, bench.seed)
    limits = httpx.Limits(max_connections=CONNECTIONS_MAX, max_keepalive_connections=CONNECTIONS_MAX)
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        async def one(request) -> Outcome:
            outcome = await send(client, bench.base_url, request, bench.model, bench.endpoint, bench.ignore_eos,
                                 bench.request_timeout)
            on_request(outcome)
            return outcome

        if point.concurrency is not None:
            queue = list(reversed(batch))
            outcomes: list[Outcome] = []

            async def client_loop() -> None:
                while queue:
                    outcomes.append(await one(queue.pop()))

            await asyncio.gather(*(client_loop() for _ in range(point.concurrency)))
            return sorted(outcomes, key=lambda outcome: outcome.index)
        start = time.perf_counter()

        async def at_its_time(request) -> Outcome:
            await asyncio.sleep(max(0.0, start + request.send_at - time.perf_counter()))
            return await one(request)

        return list(await asyncio.gather(*(at_its_time(request) for request in batch)))


def point_row(bench: ServeBench, point: Point, outcomes: list[Outcome], started_at: str, wall_s: float,
              server: dict[str, Any] | None = None) -> dict[str, Any]:
    """The row of ``point`` from its outcomes (the module's docstring says what goes where)."""
    spec = bench.spec(point)
    figures = summary(outcomes, bench.slo)
    latency = figures.pop("latency")
    start = min(outcome.sent for outcome in outcomes)
    failures = ", ".join(f"{count} {kind}" for kind, count in figures["failures"].items())
    warnings = [f"{figures['failed']} of {figures['requests']} requests failed: {failures}"] if figures["failed"] else []
    first_error = next((outcome.error for outcome in outcomes if not outcome.ok), None)
    itl_samples = [gap for outcome in outcomes if outcome.ok for gap in outcome.itl]
    timing = {name: stats for name, stats in latency.items() if stats}
    if latency["itl"]:
        timing.update(token_latency=latency["itl"], samples={"token_latency": itl_samples})
    throughput = {"decode_tokens_per_s": figures["output_tokens_per_s"], "tokens_per_s": figures["total_tokens_per_s"],
                  "requests_per_s": figures["requests_per_s"]}
    if "goodput_requests_per_s" in figures:
        throughput["goodput_requests_per_s"] = figures["goodput_requests_per_s"]
    serving = {**figures, "point": point.text(), "base_url": bench.base_url,
               "outcomes": [outcome.as_dict(start) for outcome in outcomes]}
    if server:
        serving["server"] = server
    row = Row(key=spec_key(spec), label=f"{bench.model} serve {point.text()}", spec=spec,
              status="ok" if figures["completed"] else "error", started_at=started_at,
              finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), wall_s=wall_s,
              command=bench.command, warnings=warnings or None, timing=timing or None, throughput=throughput,
              serving=serving, **({} if figures["completed"] else {"error": f"no request completed; the first: "
                                                                             f"{first_error}"}))
    return row.as_dict()


def run_bench(bench: ServeBench, store: ResultStore, on_request: Callable[[Outcome], None] = lambda outcome: None,
              on_row: Callable[[dict[str, Any]], None] = lambda row: None,
              server: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Run every point of ``bench`` that ``store`` has no row of, appending each row as its point ends;
    the rows written. An interruption (Ctrl-C) ends the point in flight without a row: the rows of the
    points before it are on disk, and ``--resume`` runs it again."""
    done = store.finished_keys()
    written = []
    for point in bench.points:
        if spec_key(bench.spec(point)) in done:
            continue
        started_at, began = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.perf_counter()
        outcomes = asyncio.run(_run_point(bench, point, on_request))
        row = point_row(bench, point, outcomes, started_at, time.perf_counter() - began, server)
        store.append(row)
        written.append(row)
        on_row(row)
    return written
