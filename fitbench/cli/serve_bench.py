"""``fitbench serve-bench``: a serving benchmark of an OpenAI-compatible server (``fitbench.serving``).

Named for what people who serve models type: vLLM's ``vllm bench serve``, in fitbench's one word per
command."""

from __future__ import annotations

import argparse
import math
import shlex
from pathlib import Path

from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from fitbench.cli.command import Command
from fitbench.cli.console import console, warn
from fitbench.cli.options import quiet_option, seconds
from fitbench.cli.parser import Parser
from fitbench.util.endpoints import http_url_problem
from fitbench.util.errors import UserError, excerpt

SAVED_KEY = "serve_bench"
EXAMPLES = """examples:
  fitbench serve-bench --base-url http://127.0.0.1:8000/v1 --rates 1 4 16 inf --requests 200 --out serve-a
  fitbench serve-bench --base-url http://127.0.0.1:11434/v1 --model llama3.2 --concurrency 1 4 --endpoint chat
  fitbench serve-bench --start-vllm tiny --rates 2 inf --requests 20 --slo ttft:500ms tpot:50ms --out serve-tiny
  fitbench serve-bench --resume serve-a
"""


def rate(text: str) -> float:
    """A request rate per second above 0, or ``inf``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected requests per second or inf, got {excerpt(text)}") from None
    if not value > 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"expected requests per second above 0, or inf, got {excerpt(text)}")
    return value


def share(text: str) -> float:
    """A share above 0 and at most 1."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a share above 0 and at most 1, got {excerpt(text)}")
    return value


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {excerpt(text)}")
    return value


def serve_options(parser: argparse.ArgumentParser) -> None:
    """The server, the load, the lengths, the targets, and where rows go."""
    add = parser.add_argument
    add("--base-url", metavar="URL", help="the server's OpenAI API, with its /v1: http://127.0.0.1:8000/v1 (vLLM, "
                                          "SGLang: /v1 of port 30000, TGI, llama.cpp's server, Ollama: port 11434)")
    add("--model", help="the model name sent in each request (default: the first the server lists at /v1/models)")
    add("--start-vllm", metavar="PRESET", dest="start_vllm",
        help="start vLLM's server on a preset itself (random weights, no download, token-id prompts), run, stop "
             "it; its Python is $FITBENCH_VLLM_PYTHON, else this one")
    add("--precision", default=None,
        help="with --start-vllm: fitbench's precision as vLLM's dtype and quantization: bf16, bf16-pure, fp16, fp32, "
             "fp8 (vLLM's dynamic FP8), nf4 (bitsandbytes in flight); default bf16")
    add("--tp", type=positive, default=None,
        help="with --start-vllm: vLLM's tensor_parallel_size (default: the planner's, the fewest GPUs present whose "
             "KV cache holds the longest request; 1 on a CPU)")
    add("--pp", type=positive, default=None, help="with --start-vllm: vLLM's pipeline_parallel_size (default 1)")
    add("--gpu-memory-utilization", dest="memory_utilization", type=share, default=0.9, metavar="SHARE",
        help="with --start-vllm: the share of each GPU's memory vLLM takes, of the host's on its CPU build "
             "(default 0.9, vLLM's)")
    add("--enforce-eager", dest="eager", action="store_true",
        help="with --start-vllm: no CUDA graphs and no compilation (starts in seconds on a CPU)")
    add("--server-timeout", type=seconds, default=600.0, metavar="SECONDS",
        help="with --start-vllm: how long the server may take to become healthy (default 600)")
    add("--rates", nargs="+", type=rate, default=None, metavar="RATE",
        help="request rates per second, Poisson arrivals; inf sends every request at once (default inf when no "
             "--concurrency)")
    add("--concurrency", nargs="+", type=positive, default=None, metavar="N",
        help="fixed concurrencies: N clients each sending its next request when its last ends")
    add("--requests", type=positive, default=100, metavar="N", help="requests per rate or concurrency (default 100)")
    add("--prompt-tokens", default="128", metavar="LEN",
        help="prompt length: 128, or uniform:64:256 drawn per request (default 128)")
    add("--output-tokens", default="64", metavar="LEN",
        help="output length (max_tokens, with ignore_eos): 64, or uniform:16:128 (default 64)")
    add("--prompt-format", choices=("text", "ids"), default=None,
        help="text (words; every server) or ids (token ids; vLLM, SGLang); default text, ids with --start-vllm")
    add("--endpoint", choices=("completions", "chat"), default="completions",
        help="/v1/completions or /v1/chat/completions (default completions)")
    add("--no-ignore-eos", dest="ignore_eos", action="store_false",
        help="let the model stop early instead of generating every output token asked")
    add("--slo", nargs="+", default=[], metavar="FIGURE:TIME",
        help="goodput targets: ttft, tpot or e2e, in s or ms (--slo ttft:200ms tpot:50ms)")
    add("--request-timeout", type=seconds, default=600.0, metavar="SECONDS",
        help="a request not answered whole in this time fails as a timeout (default 600)")
    add("--seed", type=int, default=0, help="seeds the lengths, prompts and arrival times (default 0)")
    add("--out", help="the results directory (default serve-results/<time>)")
    add("--resume", metavar="DIR", help="run the points of a saved serving benchmark that have no row yet")


def _bench(args: argparse.Namespace, base_url: str, precision: str):
    from fitbench.serving.bench import Point, ServeBench, served_model
    from fitbench.serving.metrics import parse_slo
    from fitbench.serving.workload import parse_lengths

    rates = args.rates if args.rates or args.concurrency else [math.inf]
    points = tuple(Point(rate=value) for value in rates or ()) + tuple(
        Point(concurrency=value) for value in args.concurrency or ())
    return ServeBench(base_url=base_url, model=args.model or served_model(base_url), points=points,
                      requests=args.requests, prompt=parse_lengths(args.prompt_tokens, "prompt-tokens"),
                      output=parse_lengths(args.output_tokens, "output-tokens"),
                      prompt_format=args.prompt_format or ("ids" if args.start_vllm else "text"),
                      endpoint=args.endpoint, seed=args.seed, slo=parse_slo(args.slo), ignore_eos=args.ignore_eos,
                      request_timeout=args.request_timeout, precision=precision,
                      command=shlex.join(["fitbench", *args.argv]))


def _checked(args: argparse.Namespace) -> argparse.Namespace:
    """The options, those of a resumed benchmark read back; a UserError for what contradicts."""
    from fitbench.results.store import ResultStore

    if args.resume:
        if args.out:
            raise UserError(f"--resume and --out contradict: --resume {excerpt(args.resume)} writes to the directory "
                            f"it resumes. Give --resume alone.")
        saved = ResultStore(args.resume).load_sweep()
        if not isinstance(saved, dict) or not isinstance(saved.get(SAVED_KEY), list):
            raise UserError(f"resume: {excerpt(args.resume)} holds no serving benchmark (no sweep.json of "
                            f"`fitbench serve-bench`). Pass the --out directory of an earlier one.")
        resumed = _options_parser().parse_args(saved[SAVED_KEY])
        resumed.argv, resumed.out, resumed.resume = ["serve-bench", *saved[SAVED_KEY]], args.resume, args.resume
        resumed.quiet = args.quiet
        return resumed
    if bool(args.base_url) == bool(args.start_vllm):
        raise UserError("base-url: give the server's address (--base-url http://127.0.0.1:8000/v1), or --start-vllm "
                        "PRESET for fitbench to start vLLM's server itself; one of the two.")
    if args.base_url and args.precision:
        raise UserError("precision: --precision sets how --start-vllm starts vLLM; a server at --base-url runs "
                        "what it was started with. Leave --precision out, or give --start-vllm.")
    if args.base_url and (problem := http_url_problem(args.base_url)):
        raise UserError(f"base-url: {problem}; give the server's OpenAI API, e.g. http://127.0.0.1:8000/v1.")
    if args.start_vllm:
        from fitbench.models.registry import resolve
        from fitbench.models.vllm_options import precision_options

        resolve(args.start_vllm)  # an unknown preset is refused before anything starts
        if isinstance(refusal := precision_options(args.precision or "bf16"), str):
            raise UserError(f"precision: {refusal}")
        if args.prompt_format == "text":
            raise UserError("prompt-format: vLLM started by --start-vllm has no tokenizer (random weights, no "
                            "download), so its prompts are token ids; leave --prompt-format out, or give ids.")
    return args


def serve_bench(args: argparse.Namespace) -> int:
    """Benchmark an OpenAI-compatible server under load: each request rate (Poisson arrivals) and each
    concurrency sends --requests streamed requests and gives one row: time to first token, time per
    output token, inter-token and end-to-end latency (mean, p50, p90, p99), request and token throughput,
    goodput against --slo, and every failed request counted by kind. Rows go to --out as each point ends;
    `fitbench report` and `fitbench compare` read them, and --resume runs the points left."""
    from datetime import datetime, timezone

    from fitbench.results.store import ResultStore
    from fitbench.serving.workload import parse_lengths

    args = _checked(args)
    out = args.out or str(Path("serve-results") / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"))
    store = ResultStore(out, on_bad_line=warn)
    store.lock()
    if not args.resume:
        if (store.directory / "sweep.json").exists():
            raise UserError(f"out: {excerpt(out, 200)} already holds a sweep (sweep.json); a new one would replace it. "
                            f"`fitbench serve-bench --resume {excerpt(out, 200)}` finishes it, or give another --out.")
        parse_lengths(args.prompt_tokens, "prompt-tokens"), parse_lengths(args.output_tokens, "output-tokens")
    try:
        if args.start_vllm:
            from fitbench.models.vllm_options import precision_options
            from fitbench.serving.vllm_server import vllm_server

            longest = parse_lengths(args.prompt_tokens, "prompt-tokens").high + \
                parse_lengths(args.output_tokens, "output-tokens").high
            log = store.directory / "logs" / "vllm-server.log"
            console.print(f"starting vLLM's server on {escape(args.start_vllm)} (log: {log})")
            precision = args.precision or "bf16"
            options = precision_options(precision)
            tp, pp = (args.tp or 1, args.pp or 1) if args.tp or args.pp else \
                _planned_layout(args.start_vllm, precision, longest, args.memory_utilization)
            with vllm_server(args.start_vllm, log, longest, dtype=options["dtype"], tp=tp, pp=pp,
                             memory_utilization=args.memory_utilization, eager=args.eager,
                             quantization=options.get("quantization"), ready_timeout=args.server_timeout) as server:
                rows = _run(args, store, server["base_url"], precision, server)
        else:
            rows = _run(args, store, args.base_url, "served", None)
    except KeyboardInterrupt:
        console.print(f"fitbench: interrupted; the rows of the points that finished are in {store.path}, and "
                      f"`fitbench serve-bench --resume {out}` runs the rest.")
        return 130
    finally:
        store.unlock()
    return _summary(store, rows)


def _planned_layout(preset: str, precision: str, longest: int, utilization: float) -> tuple[int, int]:
    """vLLM's tensor- and pipeline-parallel sizes for ``preset`` on this machine's GPUs, as the planner
    chooses them (``fitbench.planning.vllm_memory.server_layout``), said on the console; one rank on a
    machine without a GPU (vLLM's CPU build). A UserError when no degree among the GPUs present holds
    the model and one request of ``longest`` tokens."""
    from fitbench.hardware.devices import detect_gpus
    from fitbench.models.registry import resolve
    from fitbench.planning.vllm_memory import server_layout
    from fitbench.util.units import format_bytes

    gpus = detect_gpus()
    if not gpus:
        return 1, 1
    found = server_layout(resolve(preset), gpus[0].total_memory, len(gpus), longest, precision, utilization)
    if found is None:
        raise UserError(f"tp: {preset} in {precision} does not fit vLLM's share ({utilization:g}) of {len(gpus)} GPUs "
                        f"of {format_bytes(gpus[0].total_memory)} with room for one request of {longest} tokens, by "
                        f"the planner's model of vLLM's memory; give --tp and --pp yourself, a lower --precision, or "
                        f"shorter --prompt-tokens and --output-tokens.")
    degree, memory = found
    console.print(f"layout: tensor_parallel_size {degree}, the planner's (fitbench.planning.vllm_memory): "
                  f"{memory.blocks:,} KV blocks per GPU, {memory.concurrency(longest):.1f} requests of {longest} "
                  f"tokens at once")
    return degree, 1


def _run(args: argparse.Namespace, store, base_url: str, precision: str, server: dict | None) -> list[dict]:
    from fitbench.serving.bench import run_bench, spec_key

    bench = _bench(args, base_url, precision)
    if not args.resume:
        store.save_sweep({"command": bench.command, SAVED_KEY: args.argv[1:]})
    done = store.finished_keys()
    left = [point for point in bench.points if spec_key(bench.spec(point)) not in done]
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True,
                  disable=args.quiet or not console.is_terminal) as progress:
        task = progress.add_task(f"{len(left)} point(s)", total=len(left) * bench.requests)
        failed = [0]

        def on_request(outcome) -> None:
            failed[0] += not outcome.ok
            progress.update(task, advance=1, description=f"{len(left)} point(s), {failed[0]} failed")

        def on_row(row: dict) -> None:
            if args.quiet:
                return
            serving = row["serving"]
            console.print(f"{escape(row['label'])}: {serving['completed']} of {serving['requests']} completed, "
                          f"{serving['output_tokens_per_s']:.1f} output tokens/s"
                          + (f", {serving['failed']} failed ({escape(', '.join(serving['failures']))})"
                             if serving["failed"] else ""), soft_wrap=True)

        return run_bench(bench, store, on_request, on_row, server)


def _summary(store, rows: list[dict]) -> int:
    from fitbench.results.report import write_csv

    csv_path = write_csv(list(store.typed_rows()), store.directory)
    console.print(f"rows: {store.path}  table: {csv_path}")
    bad = [row for row in rows if row["status"] != "ok"]
    for row in bad:
        console.print(f"{escape(row['label'])}: {escape(row.get('error') or row['status'])}", soft_wrap=True)
    return 1 if bad else 0


def _options_parser() -> Parser:
    """The parser of this command's options alone, to read a resumed benchmark's saved arguments."""
    parser = Parser(prog="fitbench serve-bench")
    for group in COMMAND.options:
        group(parser)
    return parser


COMMAND = Command("serve-bench", "benchmark an OpenAI-compatible server (vLLM, SGLang, TGI, llama.cpp, Ollama) "
                                 "under load", serve_bench,
                  (serve_options, quiet_option("no progress bar and no line per point: only where the rows are and "
                                               "the points that failed")), EXAMPLES)
