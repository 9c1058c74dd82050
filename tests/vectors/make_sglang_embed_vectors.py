"""Generate tests/vectors/sglang_embed.json: SGLang's embedding messages, by SGLang's OWN encoder.

Run with the SGLang venv's python (``eval "$(bash .ci/sglang-env.sh)"``)::

    PYTHONPATH=smgd/launchers/cpu_shims $SGLANG_PYTHON tests/vectors/make_sglang_embed_vectors.py

Requests are built the way SGLang's TokenizerManager builds them for an ``EmbeddingReqInput``
(normalize_batch_and_arguments -> SamplingParams(**sampling_params) -> normalize(None) ->
verify -> TokenizedEmbeddingReqInput(...)); outputs the way the scheduler's output streamer
fills ``BatchEmbeddingOutput`` (``embeddings`` = ``tensor.tolist()`` of a float32 vector). Each
entry is ``{name, type, direction, hex, roundtrip}`` plus ``smgd_request`` (the
``wire.common.EmbedRequest`` smgd would send for the same thing) or ``expect`` (what the codec
must translate the output to). This script never imports smgd.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from array import array
from pathlib import Path

os.environ["SGLANG_USE_PICKLE_IPC"] = "0"  # msgpack mode: must be set before sglang imports
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

import torch  # type: ignore[import-not-found,unused-ignore]
from sglang.srt.managers import io_struct as io  # type: ignore[import-not-found,unused-ignore]
from sglang.srt.managers.schedule_batch import (  # type: ignore[import-not-found,unused-ignore]
    FINISH_ABORT,
    FINISH_LENGTH,
)
from sglang.srt.sampling.sampling_params import (  # type: ignore[import-not-found,unused-ignore]
    SamplingParams,
)

assert io._USE_PICKLE_IPC is False, "SGLANG_USE_PICKLE_IPC=0 did not take effect"

OUT = Path(__file__).with_name("sglang_embed.json")
VOCAB = 1024  # the tiny test model's vocabulary
RID = "0123456789abcdef0123456789abcdef"
RID2 = "fedcba9876543210fedcba9876543210"
IDS = [1, 385, 600, 436, 943, 14]
entries: list[dict] = []


def add(name: str, obj: object, direction: str, **extra: object) -> None:
    frame = io.msgpack_encode(obj)
    decoded = io.msgpack_decode(frame)
    entries.append(
        {
            "name": name,
            "type": type(obj).__name__,
            "direction": direction,
            "hex": frame.hex(),
            "roundtrip": io.msgpack_encode(decoded) == frame,
            **extra,
        }
    )


def tokenized(rid: str, ids: list[int], **kw: object) -> io.TokenizedEmbeddingReqInput:
    """What TokenizerManager._create_tokenized_object builds for EmbeddingReqInput(**kw)."""
    obj = io.EmbeddingReqInput(rid=rid, input_ids=ids, **kw)
    obj.normalize_batch_and_arguments()
    sp = SamplingParams(**dict(obj.sampling_params or {}))
    sp.normalize(None)
    sp.verify(VOCAB)
    return io.TokenizedEmbeddingReqInput(
        input_text=None,
        input_ids=array("q", obj.input_ids),
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=sp,
        positional_embed_overrides=None,
        rid=obj.rid,
        priority=obj.priority,
        dimensions=obj.dimensions,
        lora_id=obj.lora_id,
        lora_name=obj.lora_path,
        http_worker_ipc=obj.http_worker_ipc,
        return_pooled_hidden_states=obj.return_pooled_hidden_states,
        multi_item_delimiter_indices=None,
        token_indices_to_pool=None,
        decision_layout=None,
    )


def requests() -> None:
    add(
        "embed_plain",
        tokenized(RID, IDS),
        "router_to_scheduler",
        smgd_request={"rid": RID, "prompt_ids": IDS},
    )
    add(
        "embed_dimensions",
        tokenized(RID, IDS, dimensions=16),
        "router_to_scheduler",
        smgd_request={"rid": RID, "prompt_ids": IDS, "dimensions": 16},
    )
    add(
        "embed_long_ids",
        tokenized(RID2, [70000 + i for i in range(40)]),
        "router_to_scheduler",
        smgd_request={"rid": RID2, "prompt_ids": [70000 + i for i in range(40)]},
    )
    health = "HEALTH_CHECK_" + RID
    add(
        "embed_health_check",
        tokenized(health, [0], sampling_params={"max_new_tokens": 1, "temperature": 0.0}),
        "router_to_scheduler",
        health_rid=health,
    )
    add(
        "embed_batch",
        io.BatchTokenizedEmbeddingReqInput(batch=[tokenized(RID, IDS), tokenized(RID2, [5, 6])]),
        "router_to_scheduler",
    )


def time_stats(n: int) -> io.PickleWrapper:
    return io.PickleWrapper(pickle.dumps([{"wait_queue_entry_time": 1.5}] * n))


def output(rows: list[dict]) -> io.BatchEmbeddingOutput:
    n = len(rows)
    return io.BatchEmbeddingOutput(
        rids=[r["rid"] for r in rows],
        http_worker_ipcs=[None] * n,
        time_stats=time_stats(n),
        finished_reasons=[r["finish"].to_json() for r in rows],
        embeddings=[r["embedding"] for r in rows],
        prompt_tokens=[r["prompt"] for r in rows],
        cached_tokens=[r.get("cached", 0) for r in rows],
        cached_tokens_details=[None] * n,
        placeholder_tokens_idx=None,
        placeholder_tokens_val=None,
        retraction_counts=[0] * n,
        pooled_hidden_states=None,
    )


def outputs() -> None:
    gen = torch.Generator().manual_seed(7)
    vec = torch.nn.functional.normalize(torch.randn(2, 8, generator=gen), dim=-1)
    rows = [
        {"rid": RID, "finish": FINISH_LENGTH(1), "embedding": vec[0].tolist(), "prompt": 6},
        {
            "rid": RID2,
            "finish": FINISH_LENGTH(1),
            "embedding": vec[1].tolist(),
            "prompt": 2,
            "cached": 1,
        },
    ]
    for name, batch in (("embed_out_one", rows[:1]), ("embed_out_two", rows)):
        add(
            name,
            output(batch),
            "scheduler_to_router",
            expect=[
                {
                    "rid": r["rid"],
                    "embedding": r["embedding"],
                    "prompt_tokens": r["prompt"],
                    "cached_tokens": r.get("cached", 0),
                    "finish": r["finish"].to_json(),
                }
                for r in batch
            ],
        )
    abort = FINISH_ABORT("Input length (600 tokens) exceeds the maximum", 400)
    add(
        "embed_out_abort",
        output([{"rid": RID, "finish": abort, "embedding": [], "prompt": 600}]),
        "scheduler_to_router",
        expect=[
            {
                "rid": RID,
                "embedding": None,
                "prompt_tokens": 600,
                "cached_tokens": 0,
                "finish": abort.to_json(),
            }
        ],
    )
    sparse = output([{"rid": RID, "finish": FINISH_LENGTH(1), "embedding": {5: 0.5}, "prompt": 2}])
    add("embed_out_sparse", sparse, "scheduler_to_router")


def main() -> int:
    requests()
    outputs()
    bad = [e["name"] for e in entries if not e["roundtrip"]]
    OUT.write_text(json.dumps({"sglang": "0.5.23", "vectors": entries}, indent=1) + "\n")
    print(f"wrote {len(entries)} vectors to {OUT}; not round-tripping: {bad}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
