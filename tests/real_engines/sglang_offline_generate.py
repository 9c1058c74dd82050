"""SGLang's own offline ``Engine.generate`` on token-id prompts: the reference smgd must match.

Run by the SGLang venv's python with the CPU shims on ``PYTHONPATH`` (smgd's venv has no
SGLang); reads a JSON job on stdin, writes one JSON line prefixed ``RESULT`` on stdout::

    echo '{"engine": {"model_path": DIR, ...}, "requests": [{"input_ids": [1, 2],
           "max_new_tokens": 8, "lora_path": "sql"}]}' | $SGLANG_PYTHON sglang_offline_generate.py

``engine`` holds ``sglang.Engine(...)`` keyword arguments (ServerArgs field names), so the
caller keeps them identical to the daemon's launch flags. ``Engine`` runs SGLang's own
TokenizerManager, scheduler and detokenizer: ``lora_path`` (an adapter's name) is resolved by
its LoRA registry. Greedy sampling. The result line is ``{"outputs": [[ids...], ...]}``.
SGLang's HTTP server is not used: it needs ``jsonschema``, which the cached SGLang venv lacks.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

RESULT_PREFIX = "RESULT "


def main() -> int:
    job = json.load(sys.stdin)
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    sglang = importlib.import_module("sglang.srt.entrypoints.engine")
    engine = sglang.Engine(**job["engine"], log_level="error")
    try:
        requests = job["requests"]
        results = engine.generate(
            input_ids=[r["input_ids"] for r in requests],
            sampling_params=[
                {"temperature": 0.0, "max_new_tokens": r["max_new_tokens"]} for r in requests
            ],
            lora_path=[r.get("lora_path") for r in requests],
        )
        outputs = [list(r["output_ids"]) for r in results]
    finally:
        engine.shutdown()
    print(RESULT_PREFIX + json.dumps({"outputs": outputs}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
