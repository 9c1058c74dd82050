"""Generate tests/vectors/sglang.json with SGLang's OWN msgpack encoder.

Run with the SGLang venv's python (``eval "$(bash .ci/sglang-env.sh)"``)::

    PYTHONPATH=smgd/launchers/cpu_shims $SGLANG_PYTHON tests/vectors/make_sglang_vectors.py \
        [--live captured.json]

Requests are built the way SGLang's TokenizerManager builds them (GenerateReqInput ->
normalize_batch_and_arguments -> SamplingParams(**) -> normalize(None) -> verify ->
TokenizedGenerateReqInput(...), time_stats left None); outputs the way the scheduler's output
streamer fills BatchTokenIDOutput. Each entry is ``{name, type, direction, source, hex,
roundtrip, ...}``; ``smgd_request`` (the engine-neutral request smgd would send for the same
thing) and ``expect`` (values the codec must translate to) come from the same inputs.
``--live FILE`` merges frames captured from a real scheduler by tests/real_engines (their
``SMGD_SGLANG_CAPTURE`` output). This script never imports smgd.
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

from sglang.srt.managers import io_struct as io
from sglang.srt.managers.schedule_batch import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_MATCHED_TOKEN,
)
from sglang.srt.sampling.sampling_params import SamplingParams

assert io._USE_PICKLE_IPC is False, "SGLANG_USE_PICKLE_IPC=0 did not take effect"

OUT = Path(__file__).with_name("sglang.json")
VOCAB = 1024  # the tiny test model's vocabulary (verify() checks logit_bias against it)
RID = "0123456789abcdef0123456789abcdef"  # uuid4().hex shape: 32 chars, str8 on the wire
RID2 = "fedcba9876543210fedcba9876543210"
RID3 = "00112233445566778899aabbccddeeff"
entries: list[dict] = []


def add(name: str, obj: object, direction: str, **extra: object) -> None:
    frame = io.msgpack_encode(obj)
    decoded = io.msgpack_decode(frame)
    roundtrip = io.msgpack_encode(decoded) == frame
    entries.append(
        {
            "name": name,
            "type": type(obj).__name__,
            "direction": direction,
            "source": "constructed",
            "hex": frame.hex(),
            "roundtrip": roundtrip,
            **extra,
        }
    )


class _LoadedTokenizer:
    """Stands for the tokenizer of a TokenizerManager that has one: normalize() reads it only
    to encode stop strings, and these requests have none."""


def tokenized(
    rid: str, ids: list[int], sampling: dict, *, with_tokenizer: bool = False, **kw: object
) -> io.TokenizedGenerateReqInput:
    """What TokenizerManager._create_tokenized_object builds for GenerateReqInput(**kw)."""
    obj = io.GenerateReqInput(rid=rid, input_ids=ids, sampling_params=sampling, **kw)
    obj.normalize_batch_and_arguments()
    sp = SamplingParams(**dict(obj.sampling_params))
    # skip-tokenizer-init: no tokenizer (min_new_tokens needs one)
    sp.normalize(_LoadedTokenizer() if with_tokenizer else None)
    sp.verify(VOCAB)
    return io.TokenizedGenerateReqInput(
        input_text=None,
        input_ids=array("q", obj.input_ids),
        mm_inputs=None,
        sampling_params=sp,
        return_logprob=obj.return_logprob,
        logprob_start_len=obj.logprob_start_len,
        top_logprobs_num=obj.top_logprobs_num,
        token_ids_logprob=obj.token_ids_logprob,
        return_sampling_mask=obj.return_sampling_mask,
        sampling_logprobs_mode=obj.sampling_logprobs_mode or "selected",
        return_flat_raw_top_logprobs=obj.return_flat_raw_top_logprobs,
        stream=obj.stream,
        rid=obj.rid,
        http_worker_ipc=obj.http_worker_ipc,
        bootstrap_host=obj.bootstrap_host,
        bootstrap_port=obj.bootstrap_port,
        bootstrap_room=obj.bootstrap_room,
        lora_id=obj.lora_id,
        lora_name=obj.lora_path,
        input_embeds=None,
        positional_embed_overrides=obj.positional_embed_overrides,
        session_id=obj.session_id,
        session_params=None,
        custom_logit_processor=obj.custom_logit_processor,
        require_reasoning=obj.require_reasoning,
        return_hidden_states=obj.return_hidden_states,
        return_routed_experts=obj.return_routed_experts,
        routed_experts_start_len=obj.routed_experts_start_len,
        return_indexer_topk=obj.return_indexer_topk,
        routed_dp_rank=obj.routed_dp_rank,
        disagg_prefill_dp_rank=obj.disagg_prefill_dp_rank,
        priority=obj.priority,
        kv_hints=obj.kv_hints,
        extra_key=obj.extra_key,
        cache_salt=obj.cache_salt,
        routing_key=obj.routing_key,
        token_type_ids=None,
        need_wait_for_mm_inputs=obj.need_wait_for_mm_inputs,
        num_items_assigned=obj.num_items_assigned,
        multi_item_delimiter_indices=obj.multi_item_delimiter_indices,
        token_indices_to_pool=obj.token_indices_to_pool,
        encoder_urls=obj.encoder_urls,
    )


def smgd_request(
    rid: str, ids: list[int], stream: bool, *, priority: int | None = None, **sampling: object
) -> dict:
    out = {"rid": rid, "prompt_ids": ids, "stream": stream, "sampling": sampling}
    if priority is not None:
        out["priority"] = priority
    return out


def structured() -> None:
    """Constrained requests with the grammar field SGLang's OpenAI front end writes: the
    response_format json_schema goes through ``convert_json_schema_to_str`` (json.dumps),
    json_object is the literal schema its serving code writes, regex / ebnf pass as given."""
    from sglang.utils import convert_json_schema_to_str

    prompt = [1, 385, 600, 436, 943, 14, 10, 385]
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "n": {"enum": [0, 1]}},
        "required": ["city", "n"],
        "title": "Ünïcode",
    }
    cases = [
        ("json_schema", {"json_schema": convert_json_schema_to_str(schema)},
         {"kind": "json", "param": "response_format", "spec": schema}),
        ("json_object", {"json_schema": '{"type": "object"}'},
         {"kind": "json_object", "param": "response_format"}),
        ("json_text", {"json_schema": '{"type":"string"}'},
         {"kind": "json", "param": "sampling_params.json_schema", "spec": '{"type":"string"}'}),
        ("regex", {"regex": "[a-z]{1,5}"},
         {"kind": "regex", "param": "guided_regex", "spec": "[a-z]{1,5}"}),
        ("ebnf", {"ebnf": 'root ::= "a" | "b"'},
         {"kind": "grammar", "param": "sampling_params.ebnf", "spec": 'root ::= "a" | "b"'}),
    ]  # fmt: skip
    for name, field, spec in cases:
        add(
            f"tgri_structured_{name}",
            tokenized(RID, prompt, {"max_new_tokens": 16, "temperature": 0.0, **field}),
            "router_to_scheduler",
            smgd_request=smgd_request(
                RID, prompt, False, max_tokens=16, temperature=0.0, structured=spec
            ),
        )


def requests() -> None:
    prompt = [1, 385, 600, 436, 943, 14, 10, 385]
    # Prompt logprobs (from the first token, top-2; the output's top-1 rides on the same
    # count), a priority, and min_new_tokens as a TokenizerManager with its tokenizer sends it.
    add(
        "tgri_prompt_logprobs_priority_min_new_tokens",
        tokenized(
            RID,
            prompt,
            {"max_new_tokens": 8, "min_new_tokens": 3, "temperature": 0.0},
            with_tokenizer=True,
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=2,
            priority=-4,
        ),
        "router_to_scheduler",
        smgd_request=smgd_request(
            RID,
            prompt,
            False,
            priority=-4,
            max_tokens=8,
            min_tokens=3,
            temperature=0.0,
            logprobs=1,
            prompt_logprobs=2,
        ),
    )
    add(
        "tgri_greedy_stream",
        tokenized(RID, prompt, {"max_new_tokens": 8, "temperature": 0.0}, stream=True),
        "router_to_scheduler",
        smgd_request=smgd_request(RID, prompt, True, max_tokens=8, temperature=0.0),
    )
    add(
        "tgri_sampled_stop_token_ids_dups",
        tokenized(
            RID,
            prompt,
            {
                "max_new_tokens": 16,
                "temperature": 0.7,
                "top_p": 0.9,
                "top_k": 40,
                "stop_token_ids": [436, 7, 436, 1000, 7],
            },
            stream=True,
        ),
        "router_to_scheduler",
        smgd_request=smgd_request(
            RID,
            prompt,
            True,
            max_tokens=16,
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            stop_token_ids=[436, 7, 436, 1000, 7],
        ),
    )
    add(
        "tgri_logprobs_penalties_seed",
        tokenized(
            RID,
            prompt,
            {
                "max_new_tokens": 4,
                "temperature": 1.3,
                "min_p": 0.05,
                "frequency_penalty": 0.5,
                "presence_penalty": -0.25,
                "repetition_penalty": 1.1,
                "sampling_seed": 1234,
                "ignore_eos": True,
            },
            stream=False,
            return_logprob=True,
            top_logprobs_num=3,
        ),
        "router_to_scheduler",
        smgd_request=smgd_request(
            RID,
            prompt,
            False,
            max_tokens=4,
            temperature=1.3,
            min_p=0.05,
            frequency_penalty=0.5,
            presence_penalty=-0.25,
            repetition_penalty=1.1,
            seed=1234,
            ignore_eos=True,
            logprobs=3,
        ),
    )
    add(
        "tgri_logprobs_token_ids_logprob",
        tokenized(
            RID,
            prompt,
            {"max_new_tokens": 2},
            stream=True,
            return_logprob=True,
            top_logprobs_num=0,
            token_ids_logprob=[5, 6],
        ),
        "router_to_scheduler",
    )
    add("tgri_all_defaults", tokenized(RID, [5], {}), "router_to_scheduler")
    add(
        "tgri_max_new_tokens_none_topk_minus1",
        tokenized(RID, prompt, {"max_new_tokens": None, "top_k": -1, "temperature": 0.5}),
        "router_to_scheduler",
    )
    structured()
    hc_rid = "HEALTH_CHECK_" + RID
    add(
        "tgri_health_check",
        tokenized(hc_rid, [0], {"max_new_tokens": 1, "temperature": 0.0}, log_metrics=False),
        "router_to_scheduler",
        health_rid=hc_rid,
    )
    big = [70000 + 997 * i for i in range(300)]
    add(
        "tgri_300_ids_over_65535",
        tokenized(RID, big, {"max_new_tokens": 3, "temperature": 0.0}, stream=True),
        "router_to_scheduler",
        smgd_request=smgd_request(RID, big, True, max_tokens=3, temperature=0.0),
    )
    add(
        "tgri_logit_bias_custom_priority",
        tokenized(
            RID,
            prompt,
            {
                "max_new_tokens": 5,
                "logit_bias": {"12": -100.0, "34": 2.5},
                "custom_params": {"k": [1, "x"]},
                "stream_interval": 2,
                "temperature": 0.8,
            },
            priority=3,
            extra_key="tenant-a",
            routing_key="route-1",
        ),
        "router_to_scheduler",
    )
    add(
        "tgri_logit_bias_smgd",
        tokenized(RID, prompt, {"max_new_tokens": 5, "logit_bias": {"12": -100.0, "34": 2.5}}),
        "router_to_scheduler",
        smgd_request=smgd_request(
            RID, prompt, False, max_tokens=5, logit_bias={"12": -100.0, "34": 2.5}
        ),
    )
    add(
        "batch_tgri_two",
        io.BatchTokenizedGenerateReqInput(
            batch=[
                tokenized(RID, [1, 2], {"max_new_tokens": 1}),
                tokenized(RID2, [3], {"max_new_tokens": 2, "temperature": 0.0}),
            ]
        ),
        "router_to_scheduler",
    )
    add("abort_one", io.AbortReq(rid=RID), "router_to_scheduler", abort_rid=RID)
    add("abort_all", io.AbortReq(rid="", abort_all=True), "router_to_scheduler")
    add(
        "abort_with_message", io.AbortReq(rid=RID, abort_message="timed out"), "router_to_scheduler"
    )
    add("flush_cache", io.FlushCacheReqInput(), "router_to_scheduler", smgd="flush")
    add("get_internal_state", io.GetInternalStateReq(), "router_to_scheduler")
    add("shutdown", io.ShutdownReq(), "router_to_scheduler", smgd="shutdown")


def time_stats(n: int) -> io.PickleWrapper:
    # The real scheduler pickles list[SchedulerReqTimeStats]; any pickle is equally opaque.
    return io.PickleWrapper(pickle.dumps([{"wait_queue_entry_time": 1.5}] * n))


def btid(rows: list[dict], logprobs: bool = False) -> io.BatchTokenIDOutput:
    """BatchTokenIDOutput the way the scheduler's output streamer fills it (skip-tokenizer)."""
    n = len(rows)
    finished = [r.get("finish") for r in rows]
    lp = (lambda key, empty: [r.get(key, empty) for r in rows]) if logprobs else None
    return io.BatchTokenIDOutput(
        rids=[r["rid"] for r in rows],
        http_worker_ipcs=[None] * n,
        finished_reasons=[f.to_json() if f else None for f in finished],
        decoded_texts=[""] * n,
        decode_ids=[array("q", r["ids"]) for r in rows],
        read_offsets=[r.get("read_offset", 0) for r in rows],
        output_ids=[array("q", r["ids"]) for r in rows],
        skip_special_tokens=[True] * n,
        spaces_between_special_tokens=[True] * n,
        no_stop_trim=[False] * n,
        prompt_tokens=[r["prompt"] for r in rows],
        reasoning_tokens=[0] * n,
        completion_tokens=[r["completion"] for r in rows],
        cached_tokens=[r.get("cached", 0) for r in rows],
        input_token_logprobs_val=lp("in_val", []) if lp else None,
        input_token_logprobs_idx=lp("in_idx", []) if lp else None,
        output_token_logprobs_val=lp("lp_val", []) if lp else None,
        output_token_logprobs_idx=lp("lp_idx", []) if lp else None,
        input_top_logprobs_val=lp("in_top_val", []) if lp else None,
        input_top_logprobs_idx=lp("in_top_idx", []) if lp else None,
        output_top_logprobs_val=lp("top_val", []) if lp else None,
        output_top_logprobs_idx=lp("top_idx", []) if lp else None,
        input_token_ids_logprobs_val=lp("x", []) if lp else None,
        input_token_ids_logprobs_idx=lp("x", []) if lp else None,
        output_token_ids_logprobs_val=lp("x", []) if lp else None,
        output_token_ids_logprobs_idx=lp("x", []) if lp else None,
        output_token_entropy_val=None,
        output_token_sampling_mask=None,
        output_hidden_states=None,
        routed_experts=None,
        indexer_topk=None,
        placeholder_tokens_idx=None,
        placeholder_tokens_val=None,
        retraction_counts=[0] * n,
        weight_versions=[
            [("default", 0, r["completion"])] if r.get("finish") else None for r in rows
        ]
        if any(finished)
        else None,
        cached_tokens_details=[
            {"device": r.get("cached", 0), "host": 0} if r.get("cached") else None for r in rows
        ],
        dp_ranks=[None] * n,
        time_stats=time_stats(n),
        image_tokens=[0] * n,
        audio_tokens=[0] * n,
        video_tokens=[0] * n,
        spec_verify_ct=[],
        spec_num_correct_drafts=[],
        spec_num_block_accept_tokens=[],
        spec_num_cap_tokens=[],
        spec_correct_drafts_histogram=[],
        spec_cap_lens_histogram=[],
    )


def expect(rows: list[dict]) -> list[dict]:
    """The engine-neutral values each row must translate to (from the same inputs)."""
    out = []
    for r in rows:
        f = r.get("finish")
        fj = f.to_json() if f else None
        out.append(
            {
                "rid": r["rid"],
                "token_ids": r["ids"],
                "finish": fj,
                "prompt_tokens": r["prompt"],
                "completion_tokens": r["completion"],
                "cached_tokens": r.get("cached", 0),
                "logprobs": (
                    [[i, v] for i, v in zip(r["lp_idx"], r["lp_val"], strict=True)]
                    if r.get("lp_val")
                    else None
                ),
                "top": [
                    [list(p) for p in zip(ti, tv, strict=True)]
                    for ti, tv in zip(r["top_idx"], r["top_val"], strict=True)
                ]
                if r.get("top_val")
                else None,
            }
        )
    return out


def outputs() -> None:
    cases = {
        "btid_1req_first_chunk_stream": [
            {"rid": RID, "ids": [468], "prompt": 8, "completion": 1, "read_offset": 5}
        ],
        "btid_1req_finished_length": [
            {"rid": RID, "ids": [385], "prompt": 8, "completion": 8, "finish": FINISH_LENGTH(8)}
        ],
        "btid_2req_stop_token_and_running": [
            {
                "rid": RID,
                "ids": [468, 385, 600, 436],
                "prompt": 8,
                "completion": 4,
                "cached": 7,
                "finish": FINISH_MATCHED_TOKEN(436),
            },
            {"rid": RID2, "ids": [70001], "prompt": 3, "completion": 2},
        ],
        "btid_3req_abort_length_running": [
            {
                "rid": RID,
                "ids": [],
                "prompt": 8,
                "completion": 3,
                "finish": FINISH_ABORT("Aborted"),
            },
            {
                "rid": RID2,
                "ids": [9, 10],
                "prompt": 3,
                "completion": 16,
                "cached": 2,
                "finish": FINISH_LENGTH(16),
            },
            {"rid": RID3, "ids": [11], "prompt": 4, "completion": 1},
        ],
        "btid_abort_503": [
            {
                "rid": RID,
                "ids": [],
                "prompt": 8,
                "completion": 0,
                "finish": FINISH_ABORT("Request timed out", status_code=503),
            }
        ],
    }
    for name, rows in cases.items():
        add(name, btid(rows), "scheduler_to_router", expect=expect(rows))
    lp_rows = [
        {
            "rid": RID,
            "ids": [468, 385],
            "prompt": 8,
            "completion": 2,
            "lp_val": [-0.25, -1.5],
            "lp_idx": [468, 385],
            "top_val": [[-0.25, -2.0], [-1.5, -1.75]],
            "top_idx": [[468, 3], [385, 600]],
        },
        {"rid": RID2, "ids": [7], "prompt": 3, "completion": 1},
    ]
    add(
        "btid_mixed_logprobs",
        btid(lp_rows, logprobs=True),
        "scheduler_to_router",
        expect=expect(lp_rows),
    )
    add(
        "abort_from_scheduler_queued",
        io.AbortReq(rid=RID, weight_versions=[("default", 0, 0)]),
        "scheduler_to_router",
    )
    add(
        "abort_from_scheduler_with_reason",
        io.AbortReq(
            rid=RID,
            finished_reason=FINISH_ABORT("Input too long", 400).to_json(),
            weight_versions=[("default", 0, 0)],
        ),
        "scheduler_to_router",
    )
    add(
        "health_check_output",
        io.HealthCheckOutput(rid="HEALTH_CHECK_" + RID),
        "scheduler_to_router",
    )
    add("flush_cache_output", io.FlushCacheReqOutput(success=True), "scheduler_to_router")
    add(
        "get_internal_state_output",
        io.GetInternalStateReqOutput(
            internal_state={"max_total_num_tokens": 4096, "nested": {"a": [1, 2.5, None]}}
        ),
        "scheduler_to_router",
    )
    add("pickle_wrapper_toplevel", io.PickleWrapper(pickle.dumps(42)), "scheduler_to_router")
    add("configure_logging_echo", io.ConfigureLoggingReq(log_requests=True), "scheduler_to_router")


def main(argv: list[str]) -> int:
    requests()
    outputs()
    if "--live" in argv:
        live = json.loads(Path(argv[argv.index("--live") + 1]).read_text())
        for item in live:
            frame = bytes.fromhex(item["hex"])
            decoded = io.msgpack_decode(frame)
            item = {
                **item,
                "source": "captured_live",
                "type": type(decoded).__name__,
                "roundtrip": io.msgpack_encode(decoded) == frame,
            }
            entries.append(item)
    bad = [e["name"] for e in entries if not e["roundtrip"]]
    OUT.write_text(json.dumps({"sglang": "0.5.23", "vectors": entries}, indent=1) + "\n")
    print(f"wrote {len(entries)} vectors to {OUT}; not round-tripping: {bad}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
