"""One streamed request to an OpenAI-compatible server, timed as it arrives.

The request is ``POST {base_url}/completions`` (``prompt``: ids or text) or ``/chat/completions``
(``messages``: the text as one user message), with ``stream: true``, ``max_tokens`` and
``stream_options.include_usage`` (OpenAI's API reference, "Create completion"); ``ignore_eos`` asks
servers that know it (vLLM, SGLang, llama.cpp's) to generate the whole ``max_tokens``, others ignore
it. With token-id prompts, ``return_token_ids`` asks vLLM for each event's token ids, the only output
of a server without a tokenizer (vLLM's ``--skip-tokenizer-init``, which streams empty text). The
answer is Server-Sent Events (the WHATWG HTML standard, 9.2): ``data: {json}`` lines, ended by
``data: [DONE]``.

Times are ``time.perf_counter`` readings in seconds:

- ``ttft``: from the send to the first event that carries output (text, or token ids where the server
  streams ids only);
- ``chunk_times``: the arrival of each event that carries output; vLLM sends one per token, a server
  that batches tokens into events sends fewer, and the inter-token latencies are then the gaps between
  events, as ``vllm bench serve`` counts them;
- ``e2e``: from the send to the end of the stream.

Tokens: ``output_tokens`` is the server's ``usage.completion_tokens`` where it reports usage, else the
number of events that carried output; ``prompt_tokens`` likewise from ``usage.prompt_tokens``, else the
number asked.

A request fails, and says why in ``error``, when the server answers with an HTTP error status, the
connection fails or drops before ``[DONE]``, an event is not JSON or carries an ``error``, no output
arrives, or it outlives its timeout. It is counted, never dropped (``fitbench.serving.metrics``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import httpx

from fitbench.serving.workload import Request


@dataclass
class Outcome:
    """What one request gave: see the module's docstring for each field; ``error`` is None when it
    succeeded, else ``kind: detail`` (``kind`` one of ``ERROR_KINDS``)."""

    index: int
    sent: float
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    ended: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def itl(self) -> list[float]:
        """The gaps between successive output events, in seconds."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def as_dict(self, start: float) -> dict:
        """The row's raw record of this request: ``sent`` and ``ended`` in seconds after ``start`` (the
        run's first send), ``chunk_times`` in seconds after its own send."""
        fields = asdict(self)
        fields["sent"], fields["ended"] = round(self.sent - start, 6), round((self.ended or self.sent) - start, 6)
        fields["chunk_times"] = [round(t - self.sent, 6) for t in self.chunk_times]
        return fields


# http: the server answered with an error status; connection: it could not be reached or the
# connection broke; dropped: the stream ended before [DONE]; protocol: an event that is not what the
# API says; empty: no output at all; timeout: the request outlived --request-timeout.
ERROR_KINDS = ("http", "connection", "dropped", "protocol", "empty", "timeout")


def request_body(request: Request, model: str, endpoint: str, ignore_eos: bool) -> dict:
    """The JSON of ``request`` for ``endpoint`` (``completions`` or ``chat``)."""
    body: dict = {"model": model, "max_tokens": request.output_tokens, "stream": True,
                  "stream_options": {"include_usage": True}, "temperature": 0.0}
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "chat":
        text = request.prompt if isinstance(request.prompt, str) else " ".join(map(str, request.prompt))
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = request.prompt
        if not isinstance(request.prompt, str):
            body["return_token_ids"] = True
    return body


def _output(event: dict, endpoint: str) -> bool:
    """Whether a streamed event carries output: text, or token ids where the server sends ids only."""
    for choice in event.get("choices") or []:
        piece = (choice.get("delta") or {}).get("content") if endpoint == "chat" else choice.get("text")
        if piece or choice.get("token_ids"):
            return True
    return False


async def send(client: httpx.AsyncClient, base_url: str, request: Request, model: str, endpoint: str,
               ignore_eos: bool, timeout: float) -> Outcome:
    """Send ``request`` and time its stream, to its end (``ended``) whether it succeeded or failed; never
    raises for what the server or the network does."""
    outcome = Outcome(request.index, time.perf_counter(), request.prompt_tokens)
    await _stream(client, base_url, request, model, endpoint, ignore_eos, timeout, outcome)
    outcome.ended = time.perf_counter()
    return outcome


async def _stream(client: httpx.AsyncClient, base_url: str, request: Request, model: str, endpoint: str,
                  ignore_eos: bool, timeout: float, outcome: Outcome) -> None:
    path = "/chat/completions" if endpoint == "chat" else "/completions"
    usage = None
    try:
        async with client.stream("POST", base_url.rstrip("/") + path,
                                 json=request_body(request, model, endpoint, ignore_eos),
                                 timeout=httpx.Timeout(timeout)) as response:
            if response.status_code >= 400:
                text = (await response.aread()).decode(errors="replace").strip()
                outcome.error = f"http: {response.status_code} {text[:200]}"
                return
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    event = json.loads(data)
                except json.JSONDecodeError:
                    outcome.error = f"protocol: an event is not JSON: {data[:80]!r}"
                    return
                if not isinstance(event, dict) or event.get("error"):
                    outcome.error = f"protocol: the server sent an error event: {data[:200]}"
                    return
                if _output(event, endpoint):
                    now = time.perf_counter()
                    outcome.chunk_times.append(now)
                    if outcome.ttft is None:
                        outcome.ttft = now - outcome.sent
                if event.get("usage"):
                    usage = event["usage"]
            outcome.e2e = time.perf_counter() - outcome.sent
    except httpx.TimeoutException:
        outcome.error = f"timeout: no answer within {timeout:g} s"
        return
    except (httpx.RemoteProtocolError, httpx.ReadError) as error:
        outcome.error = f"dropped: the connection broke mid-answer ({type(error).__name__}: {error})"
        return
    except httpx.HTTPError as error:
        outcome.error = f"connection: {type(error).__name__}: {error}"
        return
    if not done:
        outcome.error = "dropped: the stream ended before data: [DONE]"
    elif not outcome.chunk_times:
        outcome.error = "empty: the answer carried no output"
    else:
        outcome.output_tokens = int((usage or {}).get("completion_tokens") or len(outcome.chunk_times))
        outcome.prompt_tokens = int((usage or {}).get("prompt_tokens") or request.prompt_tokens)
