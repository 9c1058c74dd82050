"""SGLang's own offline ``Engine.generate`` (its TokenizerManager and scheduler): the reference
for the SGLang half of test_surface_real.py.

Run by the SGLang venv's python with the CPU shims on ``PYTHONPATH`` and
``SGLANG_USE_CPU_ENGINE=1``; reads a JSON job on stdin (``model``, ``engine``: ``Engine(...)``
keyword arguments, ``requests``: ``input_ids``, ``sampling_params`` and any of
``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``); writes one line
``RESULT {json}``: per request, ``output_ids`` and ``meta_info`` (its logprob fields).
"""

from __future__ import annotations

import importlib
import json
import sys

RESULT_PREFIX = "RESULT "
KEEP = (
    "input_token_logprobs", "input_top_logprobs", "output_token_logprobs",
    "output_top_logprobs", "finish_reason",
)  # fmt: skip


def main() -> int:
    job = json.load(sys.stdin)
    sglang = importlib.import_module("sglang")
    engine = sglang.Engine(model_path=job["model"], **job.get("engine", {}))
    try:
        outputs = []
        for r in job["requests"]:
            out = engine.generate(**r)
            meta = out["meta_info"]
            outputs.append(
                {"output_ids": out["output_ids"], "meta_info": {k: meta.get(k) for k in KEEP}}
            )
    finally:
        engine.shutdown()
    print(RESULT_PREFIX + json.dumps({"outputs": outputs}), flush=True)
    return 0


if __name__ == "__main__":  # required: SGLang spawns its scheduler with multiprocessing
    sys.exit(main())
