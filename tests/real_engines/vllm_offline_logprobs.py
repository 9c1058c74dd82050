"""vLLM's own offline ``LLM.generate`` with prompt logprobs, logprobs and min_tokens: the
reference for test_surface_real.py.

Run by the vLLM venv's python; reads a JSON job on stdin (``model``, ``engine``: ``LLM(...)``
keyword arguments, ``requests``: ``prompt_ids``, ``max_tokens`` and any of ``logprobs``,
``prompt_logprobs``, ``min_tokens``), greedy sampling; writes one line ``RESULT {json}`` with,
per request, ``token_ids``, ``prompt_logprobs`` (``null`` or ``[[token id, logprob, rank],
...]`` per prompt position, in vLLM's dict order) and ``logprobs`` (the same per output token).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

RESULT_PREFIX = "RESULT "


def _rows(entries: Any) -> Any:
    if entries is None:
        return None
    return [
        None if d is None else [[tid, lp.logprob, lp.rank] for tid, lp in d.items()]
        for d in entries
    ]


def main() -> int:
    job = json.load(sys.stdin)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm = importlib.import_module("vllm")
    llm = vllm.LLM(model=job["model"], **job.get("engine", {}))
    prompts = [{"prompt_token_ids": r["prompt_ids"]} for r in job["requests"]]
    params = [
        vllm.SamplingParams(
            temperature=0.0,
            max_tokens=r["max_tokens"],
            min_tokens=r.get("min_tokens", 0),
            logprobs=r.get("logprobs"),
            prompt_logprobs=r.get("prompt_logprobs"),
        )
        for r in job["requests"]
    ]
    results = llm.generate(prompts, params, use_tqdm=False)
    outputs = [
        {
            "token_ids": list(res.outputs[0].token_ids),
            "prompt_logprobs": _rows(res.prompt_logprobs),
            "logprobs": _rows(res.outputs[0].logprobs),
        }
        for res in results
    ]
    print(RESULT_PREFIX + json.dumps({"outputs": outputs}), flush=True)
    return 0


if __name__ == "__main__":  # required: vLLM may spawn workers with multiprocessing
    sys.exit(main())
