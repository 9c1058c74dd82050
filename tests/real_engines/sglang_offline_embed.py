"""SGLang's own embedding front end, offline: the reference smgd's ``/v1/embeddings`` must match.

Run by the SGLang venv's python (with the CPU shims on PYTHONPATH); reads a JSON job on stdin,
writes one line prefixed ``RESULT`` on stdout::

    echo '{"model": DIR, "engine": {...}, "requests": [{"input": ..., "encoding_format": ...,
           "dimensions": ...}]}' | $SGLANG_PYTHON sglang_offline_embed.py

SGLang's OpenAI server (``launch_server``) imports ``jsonschema``, which the CPU venv the tests
share does not hold, so the oracle is the same path without the HTTP layer: ``sglang.Engine``
(``is_embedding``: its TokenizerManager and scheduler), each request turned into an
``EmbeddingReqInput`` as ``OpenAIServingEmbedding._convert_to_internal_request`` does (text for
strings, ``input_ids`` for token ids, ``dimensions``), and the answer built by that class's own
``_build_embedding_response`` (the float lists, or base64 of little-endian float32). The result
line is ``{"responses": [{"data": [...], "usage": {...}} | {"error": str}]}``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

RESULT_PREFIX = "RESULT "


def main() -> int:
    job = json.load(sys.stdin)
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    sglang = importlib.import_module("sglang")
    io = importlib.import_module("sglang.srt.managers.io_struct")
    serving = importlib.import_module("sglang.srt.entrypoints.openai.serving_embedding")
    engine = sglang.Engine(model_path=job["model"], is_embedding=True, **job["engine"])
    builder = serving.OpenAIServingEmbedding.__new__(serving.OpenAIServingEmbedding)
    builder.tokenizer_manager = engine.tokenizer_manager
    responses: list[dict[str, Any]] = []
    try:
        for request in job["requests"]:
            given = request["input"]
            is_text = isinstance(given, str) or (
                isinstance(given, list) and isinstance(given[0], str)
            )
            kwargs = {"text": given} if is_text else {"input_ids": given}
            obj = io.EmbeddingReqInput(**kwargs, dimensions=request.get("dimensions"))
            try:
                ret = engine.loop.run_until_complete(
                    engine.tokenizer_manager.generate_request(obj, None).__anext__()
                )
            except ValueError as exc:  # what the server answers with a 400
                responses.append({"error": str(exc)})
                continue
            ret = ret if isinstance(ret, list) else [ret]
            fmt = request.get("encoding_format", "float")
            response = builder._build_embedding_response(ret, fmt).model_dump()
            responses.append({"data": response["data"], "usage": response["usage"]})
    finally:
        engine.shutdown()
    print(RESULT_PREFIX + json.dumps({"responses": responses}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
