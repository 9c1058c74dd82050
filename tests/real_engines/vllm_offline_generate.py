"""vLLM's own offline ``LLM.generate`` on token-id prompts: the reference smgd must match.

Run by the vLLM venv's python (smgd's venv has no vLLM); reads a JSON job on stdin, writes
one JSON line prefixed ``RESULT`` on stdout (vLLM's own logs go to stderr)::

    echo '{"model": DIR, "engine": {...}, "requests": [{"prompt_ids": [1, 2],
           "max_tokens": 16, "ignore_eos": false}]}' | $VLLM_PYTHON vllm_offline_generate.py

``engine`` holds ``LLM(...)`` keyword arguments (dtype, max_model_len, kv_cache_memory_bytes,
...), so the caller keeps them identical to the daemon's engine flags. Greedy sampling
(temperature 0) for every request. The result line is
``{"outputs": [{"token_ids", "text", "finish_reason"}], "import_s", "init_s", "generate_s"}``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

RESULT_PREFIX = "RESULT "


def main() -> int:
    job = json.load(sys.stdin)
    # vLLM logs to stdout by default; stdout carries only the result line here.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    # In-process engine core and worker: two fewer process spawns, each of which re-imports
    # vLLM (10-25 s on this 2-core box). Same model code and sampler as the headless core.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    t0 = time.monotonic()
    vllm = importlib.import_module("vllm")
    t1 = time.monotonic()
    llm = vllm.LLM(model=job["model"], **job.get("engine", {}))
    t2 = time.monotonic()
    prompts = [{"prompt_token_ids": r["prompt_ids"]} for r in job["requests"]]
    params = [
        vllm.SamplingParams(
            temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=r.get("ignore_eos", False)
        )
        for r in job["requests"]
    ]
    results = llm.generate(prompts, params, use_tqdm=False)
    t3 = time.monotonic()
    outputs = [
        {
            "token_ids": list(res.outputs[0].token_ids),
            "text": res.outputs[0].text,
            "finish_reason": res.outputs[0].finish_reason,
        }
        for res in results
    ]
    line = {
        "outputs": outputs,
        "import_s": round(t1 - t0, 2),
        "init_s": round(t2 - t1, 2),
        "generate_s": round(t3 - t2, 3),
    }
    print(RESULT_PREFIX + json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":  # required: vLLM may spawn workers with multiprocessing
    sys.exit(main())
