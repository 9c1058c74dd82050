"""Write tests/vectors/vllm_embed.json: vLLM's embedding (pooling) messages, by vLLM's OWN encoder.

Run it with the vLLM venv's python (see .ci/vllm-env.sh); smgd is not imported:

    $VLLM_PYTHON tests/vectors/make_vllm_embed_vectors.py [OUT]

Requests are what vLLM's front end sends for ``/v1/embeddings`` on a ``--runner pooling``
engine: ``EmbeddingRequest.to_pooling_params()`` (task ``embed``), then
``PoolingParams.verify(model_config)`` (which sets ``use_activation`` and
``skip_reading_prefix_cache``), in an ``EngineCoreRequest`` without sampling params.
Outputs are ``EngineCoreOutput`` with a float32 ``pooling_output`` tensor, as the engine core
finishes a pooling request (one output, ``new_token_ids`` empty, finish STOP). Everything is
encoded by ``vllm.v1.serial_utils.MsgpackEncoder``. Same layout as vllm.json: ``name``,
``socket``, ``frames_hex``, ``expect``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

ARRIVAL = 1764680000.25
TS = 12345.5
OUT_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_embed.json")
IDS = [323, 607, 83, 338, 15, 743]


def main(argv: list[str]) -> None:
    out = argv[0] if argv else OUT_DEFAULT

    import torch  # type: ignore[import-not-found,unused-ignore]
    import vllm  # type: ignore[import-not-found,unused-ignore]
    from vllm.config import PoolerConfig  # type: ignore[import-not-found,unused-ignore]
    from vllm.pooling_params import PoolingParams  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.engine import (  # type: ignore[import-not-found,unused-ignore]
        EngineCoreOutput,
        EngineCoreOutputs,
        EngineCoreRequest,
        EngineCoreRequestType,
        FinishReason,
    )
    from vllm.v1.metrics.stats import PrefillStats  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.serial_utils import MsgpackEncoder  # type: ignore[import-not-found,unused-ignore]

    enc = MsgpackEncoder()
    vectors: list[dict[str, Any]] = []

    class _ModelConfig:  # what PoolingParams.verify reads of a pooling model's ModelConfig
        pooler_config = PoolerConfig()
        served_model_name = "tiny"
        embedding_size = 64
        is_matryoshka = True
        matryoshka_dimensions = None

    def add(name: str, socket: str, frames: list[Any], expect: Any = None) -> None:
        v: dict[str, Any] = {
            "name": name,
            "socket": socket,
            "source": "syn",
            "frames_hex": [bytes(f).hex() for f in frames],
        }
        if expect is not None:
            v["expect"] = expect
        vectors.append(v)

    def embed_request(name: str, rid: str, ids: list[int], dimensions: int | None) -> None:
        params = PoolingParams(task="embed", dimensions=dimensions, use_activation=None)
        params.verify(_ModelConfig())
        req = EngineCoreRequest(
            request_id=rid,
            prompt_token_ids=ids,
            mm_features=None,
            sampling_params=None,
            pooling_params=params.clone(),
            arrival_time=ARRIVAL,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )
        add(
            name,
            "input",
            [EngineCoreRequestType.ADD.value, *enc.encode(req)],
            {"request_id": rid, "prompt_token_ids": ids, "dimensions": dimensions},
        )

    embed_request("in_embed", "embd-A", IDS, None)
    embed_request("in_embed_dimensions", "embd-B", IDS, 16)

    def add_out(name: str, *outputs: EngineCoreOutput) -> None:
        outs = EngineCoreOutputs(outputs=list(outputs), timestamp=TS, weight_version="default")
        expect = {
            o.request_id: {
                "embedding": None if o.pooling_output is None else o.pooling_output.tolist(),
                "finish_reason": None if o.finish_reason is None else str(o.finish_reason),
                "num_prompt_tokens": o.prefill_stats.num_prompt_tokens if o.prefill_stats else None,
            }
            for o in outs.outputs
        }
        add(name, "output", list(enc.encode(outs)), expect)

    gen = torch.Generator().manual_seed(7)
    # 8 floats = 32 bytes: inline (ext 3); 64 floats = 256 bytes: an aux frame.
    small = torch.nn.functional.normalize(torch.randn(8, generator=gen), dim=-1)
    big = torch.nn.functional.normalize(torch.randn(64, generator=gen), dim=-1)
    prefill = PrefillStats(num_prompt_tokens=6, num_computed_tokens=6, num_cached_tokens=0)
    add_out(
        "out_embed_inline",
        EngineCoreOutput(
            "embd-A",
            [],
            pooling_output=small,
            finish_reason=FinishReason.STOP,
            prefill_stats=prefill,
        ),
    )
    add_out(
        "out_embed_aux_two",
        EngineCoreOutput(
            "embd-A",
            [],
            pooling_output=big,
            finish_reason=FinishReason.STOP,
            prefill_stats=prefill,
        ),
        EngineCoreOutput(
            "embd-B",
            [],
            pooling_output=small[:4].clone(),
            finish_reason=FinishReason.STOP,
            prefill_stats=PrefillStats(num_prompt_tokens=3, num_computed_tokens=3),
        ),
    )

    with open(out, "w") as f:
        json.dump({"vllm": vllm.__version__, "vectors": vectors}, f, indent=1)
        f.write("\n")
    print(f"wrote {len(vectors)} vectors to {out}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
