"""vLLM's offline engine (``vllm.LLM``) on a model directory, as one measurement: it starts the engine
with random weights and no tokenizer, generates from token-id prompts, and writes what vLLM reports of
its memory. Run by the Python of vLLM's environment (``FITBENCH_VLLM_PYTHON``: vLLM pins its own torch
and transformers), as a script, so it imports nothing of fitbench:

    $FITBENCH_VLLM_PYTHON fitbench/worker/vllm_engine.py OPTIONS.json RESULT.json

OPTIONS: ``model`` (a directory with a ``config.json``), ``dtype``, ``tensor_parallel_size``,
``pipeline_parallel_size``, ``max_model_len``, ``gpu_memory_utilization``, ``kv_cache_memory_bytes``
(or null), ``enforce_eager``, ``batch`` prompts of ``prompt_tokens`` ids each, ``new_tokens`` each.

RESULT: ``tokens`` (the ids generated per prompt), ``start_s`` (``LLM()`` to ready); ``repeats`` times
(default 3) the batch timed twice, generating one token (``first_token_s``: the prefill and the first
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
import random
import sys
import time


def measure(options: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    began = time.perf_counter()
    llm = LLM(model=options["model"], load_format="dummy", skip_tokenizer_init=True, dtype=options["dtype"],
              tensor_parallel_size=options["tensor_parallel_size"],
              pipeline_parallel_size=options["pipeline_parallel_size"], max_model_len=options["max_model_len"],
              gpu_memory_utilization=options["gpu_memory_utilization"],
              kv_cache_memory_bytes=options.get("kv_cache_memory_bytes"), enforce_eager=options["enforce_eager"],
              enable_prefix_caching=False, seed=0)
    started = time.perf_counter()
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(100, 4000) for _ in range(options["prompt_tokens"])])
               for _ in range(options["batch"])]
    new_tokens = options["new_tokens"]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0, detokenize=False)
    first = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0, detokenize=False)
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
