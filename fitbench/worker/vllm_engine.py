"""vLLM's offline engine (``vllm.LLM``) on a model directory, as one measurement: it starts the engine
with random weights and no tokenizer, generates from token-id prompts, and writes what vLLM reports of
its memory. Run by the Python of vLLM's environment (``FITBENCH_VLLM_PYTHON``: vLLM pins its own torch
and transformers), as a script, so it imports nothing of fitbench:

    $FITBENCH_VLLM_PYTHON fitbench/worker/vllm_engine.py OPTIONS.json RESULT.json

OPTIONS: ``model`` (a directory with a ``config.json``), ``dtype``, ``quantization`` (optional),
``tensor_parallel_size``, ``pipeline_parallel_size``, ``max_model_len``, ``gpu_memory_utilization``,
``kv_cache_memory_bytes`` (or null), ``enforce_eager``, ``max_num_seqs`` and ``max_num_batched_tokens``
(optional: vLLM's defaults), ``batch`` prompts of ``prompt_tokens`` ids each drawn from ``seed``
(default 0), ``new_tokens`` each; ``warmup`` untimed rounds (default 0); ``barrier`` (optional): a
``directory``, the ``parties`` and this engine's ``index``, for replicas, each an engine of its own,
which wait for one another there after their warm-up so that their timed rounds run side by side.

RESULT: ``tokens`` (the ids generated per prompt), ``start_s`` (``LLM()`` to ready), ``device_name``
(vLLM's platform's), ``vllm_version``; ``repeats`` times (default 3) the batch timed twice, generating one token (``first_token_s``: the prefill and the first
token of every prompt) and ``new_tokens`` (``generate_s``), with prefix caching off so that a repeat
prefills again; ``token_latency_s`` = (generate - first token) / (new_tokens - 1) per repeat, the
time of one decode step of the batch; and vLLM's cache figures as its scheduler holds them (``vllm/config/cache.py``): ``num_gpu_blocks``
(the KV blocks; named for the GPU on every platform), ``block_size``, ``kv_cache_size_tokens`` and
``kv_cache_max_concurrency`` (at ``max_model_len``).

``LLM()`` starts its engine core in a process of its own, by spawn on a CPU: the work is under
``if __name__ == "__main__"``.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

BARRIER_TIMEOUT_S = 1800.0


def wait_for_replicas(barrier: dict) -> None:
    """Mark this engine ready in the barrier's directory and wait until every party has."""
    directory = barrier["directory"]
    with open(os.path.join(directory, f"ready-{barrier['index']}"), "w"):
        pass
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while sum(name.startswith("ready-") for name in os.listdir(directory)) < barrier["parties"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other replicas' engines were not ready within {BARRIER_TIMEOUT_S:g} s")
        time.sleep(0.05)


def measure(options: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    limits = {name: options[name] for name in ("max_num_seqs", "max_num_batched_tokens", "quantization")
              if options.get(name) is not None}
    began = time.perf_counter()
    llm = LLM(model=options["model"], load_format="dummy", skip_tokenizer_init=True, dtype=options["dtype"],
              tensor_parallel_size=options["tensor_parallel_size"],
              pipeline_parallel_size=options["pipeline_parallel_size"], max_model_len=options["max_model_len"],
              gpu_memory_utilization=options["gpu_memory_utilization"],
              kv_cache_memory_bytes=options.get("kv_cache_memory_bytes"), enforce_eager=options["enforce_eager"],
              enable_prefix_caching=False, seed=0, **limits)
    started = time.perf_counter()
    rng = random.Random(options.get("seed", 0))
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(100, 4000) for _ in range(options["prompt_tokens"])])
               for _ in range(options["batch"])]
    new_tokens = options["new_tokens"]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0, detokenize=False)
    first = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0, detokenize=False)
    for _ in range(options.get("warmup", 0)):
        llm.generate(prompts, first, use_tqdm=False)
        llm.generate(prompts, params, use_tqdm=False)
    if options.get("barrier"):
        wait_for_replicas(options["barrier"])
    first_token_s, generate_s = [], []
    for _ in range(options.get("repeats", 3)):
        before = time.perf_counter()
        llm.generate(prompts, first, use_tqdm=False)
        middle = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        first_token_s.append(middle - before)
        generate_s.append(time.perf_counter() - middle)
    cache = llm.llm_engine.vllm_config.cache_config
    return {"tokens": [list(output.outputs[0].token_ids) for output in outputs], "start_s": started - began,
            "device_name": current_platform.get_device_name(0), "vllm_version": vllm.__version__,
            "first_token_s": first_token_s, "generate_s": generate_s,
            "token_latency_s": [(whole - one) / (new_tokens - 1) for whole, one in zip(generate_s, first_token_s)]
            if new_tokens > 1 else [],
            "num_gpu_blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
            "kv_cache_size_tokens": getattr(cache, "kv_cache_size_tokens", None),
            "kv_cache_max_concurrency": getattr(cache, "kv_cache_max_concurrency", None)}


if __name__ == "__main__":
    with open(sys.argv[1]) as handle:
        result = measure(json.load(handle))
    with open(sys.argv[2], "w") as handle:
        json.dump(result, handle)
