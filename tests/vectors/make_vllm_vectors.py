"""Write tests/vectors/vllm.json: golden vLLM wire messages made by vLLM's OWN encoders.

Run it with the vLLM venv's python (see .ci/vllm-env.sh); smgd is not imported:

    $VLLM_PYTHON tests/vectors/make_vllm_vectors.py [--live CAPTURE.json ...] [OUT]

Synthetic vectors build vLLM's real classes (EngineCoreRequest, SamplingParams,
EngineCoreOutputs, ...) and encode them exactly as vLLM's front end and engine core do:
``vllm.v1.serial_utils.MsgpackEncoder`` for input/output messages and ``msgspec.msgpack.encode``
for handshake maps. ``--live`` merges frames captured from a live engine core by
tests/real_engines/test_vllm_raw.py (run with SMGD_VLLM_CAPTURE=CAPTURE.json).

Each vector: ``name``, ``socket`` (handshake | input | output), ``source`` (syn | live),
``frames_hex`` (identity frame excluded; input messages start with the type byte) and, for
outputs, ``expect``: what vLLM's own objects say the message carries, for translation tests.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

ARRIVAL = 1764680000.25  # fixed, so vectors are reproducible
TS = 12345.5  # fixed engine monotonic timestamp
OUT_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm.json")


def main(argv: list[str]) -> None:
    live: list[str] = []
    out = OUT_DEFAULT
    args = list(argv)
    while args:
        a = args.pop(0)
        if a == "--live":
            live.append(args.pop(0))
        else:
            out = a

    import msgspec
    import numpy as np  # type: ignore[import-not-found,unused-ignore]
    import torch  # type: ignore[import-not-found,unused-ignore]
    import vllm  # type: ignore[import-not-found,unused-ignore]
    from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.engine import (  # type: ignore[import-not-found,unused-ignore]
        EngineCoreEvent,
        EngineCoreEventType,
        EngineCoreOutput,
        EngineCoreOutputs,
        EngineCoreReadyResponse,
        EngineCoreRequest,
        EngineCoreRequestType,
        FinishReason,
        UtilityOutput,
    )
    from vllm.v1.engine.core import EngineCoreProc  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.engine.utils import EngineHandshakeMetadata, EngineZmqAddresses  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.metrics.stats import PrefillStats, SchedulerStats  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.outputs import LogprobsLists, LogprobsTensors  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.serial_utils import MsgpackEncoder, UtilityResult  # type: ignore[import-not-found,unused-ignore]

    enc = MsgpackEncoder()
    vectors: list[dict[str, Any]] = []

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

    # ---- handshake -----------------------------------------------------------------------
    for status in ("HELLO", "READY"):
        for local, headless in ((True, False), (False, True)):
            msg = {"status": status, "local": local, "headless": headless}
            add(
                f"hs_{status.lower()}_{'local' if local else 'remote'}",
                "handshake",
                [msgspec.msgpack.encode(msg)],
            )
    add(
        "hs_ready_dp",
        "handshake",
        [
            msgspec.msgpack.encode(
                {
                    "status": "READY",
                    "local": True,
                    "headless": False,
                    "parallel_config_hash": "ab12cd",
                }
            )
        ],
    )
    init = EngineHandshakeMetadata(
        addresses=EngineZmqAddresses(
            inputs=["ipc:///tmp/smgd/vllm-0-input.sock"],
            outputs=["ipc:///tmp/smgd/vllm-0-output.sock"],
        ),
        parallel_config={},
    )
    add("hs_init", "handshake", [msgspec.msgpack.encode(init)])
    init_dp = EngineHandshakeMetadata(
        addresses=EngineZmqAddresses(
            inputs=["ipc:///i0", "ipc:///i1"],
            outputs=["ipc:///o0", "ipc:///o1"],
            coordinator_input="tcp://127.0.0.1:5001",
            coordinator_output="tcp://127.0.0.1:5002",
            frontend_stats_publish_address="ipc:///stats",
        ),
        parallel_config={
            "data_parallel_master_ip": "127.0.0.1",
            "data_parallel_master_port": 29500,
            "_data_parallel_master_port_list": [29501, 29502],
            "data_parallel_size": 2,
        },
    )
    add("hs_init_dp", "handshake", [msgspec.msgpack.encode(init_dp)])
    ready = EngineCoreReadyResponse(
        max_model_len=512,
        num_gpu_blocks=512,
        block_size=128,
        dp_stats_address=None,
        dtype="float32",
        vllm_version="0.32.0",
        world_size=1,
        data_parallel_size=1,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        decode_context_parallel_size=1,
        data_parallel_rank=0,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        instance_id="1796218978759021006",
        supports_lora=False,
        max_loras=0,
        kv_cache_size_tokens=65536,
        kv_cache_max_concurrency=128.0,
        effective_attention_block_size=128,
    )
    add(
        "in_ready_response",
        "input",
        [msgspec.msgpack.encode(ready)],
        {"max_model_len": 512, "max_num_seqs": 8, "kv_cache_size_tokens": 65536},
    )

    # ---- requests (input socket) -----------------------------------------------------------
    def request(rid: str, sp: SamplingParams | None, **kw: Any) -> EngineCoreRequest:
        base: dict[str, Any] = {
            "request_id": rid,
            "prompt_token_ids": [323, 607, 83, 338, 15, 743, 1373, 310],
            "mm_features": None,
            "sampling_params": sp,
            "pooling_params": None,
            "arrival_time": ARRIVAL,
            "lora_request": None,
            "cache_salt": None,
            "data_parallel_rank": None,
        }
        base.update(kw)
        return EngineCoreRequest(**base)

    def add_req(name: str, req: EngineCoreRequest) -> None:
        add(
            name,
            "input",
            [EngineCoreRequestType.ADD.value, *enc.encode(req)],
            {"request_id": req.request_id, "prompt_token_ids": req.prompt_token_ids},
        )

    sp = SamplingParams(temperature=0.0, max_tokens=16)
    sp.update_from_generation_config({}, eos_token_id=2)
    add_req("in_add_greedy", request("req-greedy", sp))

    sp = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=42,
        stop=["\n\n", "END"],
        stop_token_ids=[7, 9, 7],
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.1,
        max_tokens=32,
        min_tokens=2,
        output_kind=RequestOutputKind.DELTA,
    )
    sp.update_from_generation_config({"eos_token_id": [2, 5]}, eos_token_id=2)
    add_req("in_add_sampled", request("req-sampled", sp))

    sp = SamplingParams(temperature=0.0, max_tokens=3, logprobs=5, prompt_logprobs=3)
    sp.update_from_generation_config({}, eos_token_id=2)
    add_req("in_add_logprobs", request("req-lp", sp))

    sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    sp.update_from_generation_config({}, eos_token_id=2)
    add_req(
        "in_add_tail_fields",
        request(
            "req-tail",
            sp,
            cache_salt="salt-1",
            data_parallel_rank=0,
            client_index=1,
            current_wave=3,
            priority=-1,
            trace_headers={"traceparent": "00-abc-def-01"},
            resumable=True,
            external_req_id="ext-1",
            reasoning_ended=True,
            reasoning_parser_kwargs={"chat_template_kwargs": {"thinking": False}},
            abort_immediately=False,
            session_id="session-1",
        ),
    )

    sp = SamplingParams(
        max_tokens=4,
        logit_bias={5: -100.0, 9: 2.5},
        allowed_token_ids=[1, 2, 3, 5, 9],
        bad_words=["foo"],
        extra_args={"k": 1, "nested": {"a": [1, 2]}},
    )
    add_req("in_add_bias_extra", request("req-bias", sp))

    sp = SamplingParams(
        max_tokens=20,
        structured_outputs=StructuredOutputsParams(json={"type": "object"}),
    )
    add_req("in_add_structured", request("req-json", sp))

    # Structured outputs as the front end sends them: _validate_structured_outputs picks the
    # backend (_backend, _backend_was_auto) and, for xgrammar, turns a choice into a grammar.
    from vllm.config import StructuredOutputsConfig  # type: ignore[import-not-found,unused-ignore]

    class _ModelConfig:  # what _validate_structured_outputs reads of a ModelConfig
        is_diffusion = False

    def so_req(name: str, rid: str, so: Any, backend: str = "auto", **kw: Any) -> None:
        sp = SamplingParams(max_tokens=24, structured_outputs=so, **kw)
        sp.update_from_generation_config({}, eos_token_id=2)
        config = StructuredOutputsConfig(backend=backend)
        sp._validate_structured_outputs(_ModelConfig(), config, tokenizer=object())
        add_req(name, request(rid, sp))

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "n": {"enum": [0, 1]}},
        "required": ["city", "n"],
    }
    so_req("in_add_so_json_schema", "req-so-json", StructuredOutputsParams(json=schema),
           temperature=0.0)  # fmt: skip
    so_req("in_add_so_json_object", "req-so-obj", StructuredOutputsParams(json_object=True))
    so_req("in_add_so_regex", "req-so-re", StructuredOutputsParams(regex="[a-z]{1,5}"))
    so_req(
        "in_add_so_choice",
        "req-so-choice",
        StructuredOutputsParams(choice=["yes", "no way", 'say "hi"\n', "tab\tback\\slash\x01"]),
    )
    so_req(
        "in_add_so_grammar", "req-so-gram", StructuredOutputsParams(grammar='root ::= "a" | "b"')
    )
    so_req(
        "in_add_so_json_text_xgrammar",
        "req-so-text",
        StructuredOutputsParams(
            json='{"type": "string", "maxLength": 4}',
            disable_any_whitespace=True,
            whitespace_pattern="[ ]?",
        ),
        backend="xgrammar",
        seed=7,
    )

    sp = SamplingParams(
        max_tokens=2,
        prompt_logprobs=1,
        prompt_logprob_token_ids=np.array([[3, 4], [5, -1]], dtype=np.int64),
    )
    add_req("in_add_prompt_logprob_ids", request("req-plids", sp))

    sp = SamplingParams(max_tokens=2)
    add_req(
        "in_add_prompt_embeds_aux",
        request(
            "req-embeds",
            sp,
            prompt_token_ids=None,
            prompt_embeds=torch.arange(4 * 64, dtype=torch.float32).reshape(4, 64) / 7,
        ),
    )
    add_req(
        "in_add_prompt_embeds_inline",
        request(
            "req-embeds-small",
            sp,
            prompt_token_ids=None,
            prompt_embeds=torch.ones(2, 4, dtype=torch.bfloat16),
        ),
    )
    add_req("in_add_no_sampling", request("req-none", None))

    add("in_abort", "input", [EngineCoreRequestType.ABORT.value, *enc.encode(["req-1", "req-2"])])
    add("in_abort_one", "input", [EngineCoreRequestType.ABORT.value, *enc.encode(["req-B"])])
    calls: list[tuple[str, tuple[Any, ...]]] = [
        ("get_supported_tasks", ()),
        ("is_sleeping", ()),
        ("reset_prefix_cache", (False, False)),
        ("pause_scheduler", ("abort", True)),
        ("resume_scheduler", ()),
        ("sleep", (1, "abort")),
        ("collective_rpc", ("echo", 5.0, ("x",), {"k": "v"})),
    ]
    for i, (method, call_args) in enumerate(calls):
        call_id = 5923996443447005681 + i * 977
        add(
            f"in_utility_{method}",
            "input",
            [EngineCoreRequestType.UTILITY.value, *enc.encode((0, call_id, method, call_args))],
        )
    add(
        "in_start_dp_wave",
        "input",
        [EngineCoreRequestType.START_DP_WAVE.value, *enc.encode((4, 1))],
    )

    # ---- outputs (output socket) -----------------------------------------------------------
    def expect_of(outs: EngineCoreOutputs) -> dict[str, Any]:
        reqs = {}
        for o in outs.outputs:
            reqs[o.request_id] = {
                "new_token_ids": list(o.new_token_ids),
                "finish_reason": None if o.finish_reason is None else str(o.finish_reason),
                "stop_reason": o.stop_reason,
                "num_prompt_tokens": o.prefill_stats.num_prompt_tokens if o.prefill_stats else None,
                "num_cached_tokens": o.prefill_stats.num_cached_tokens if o.prefill_stats else None,
            }
            if o.new_logprobs is not None:
                reqs[o.request_id]["logprobs"] = {
                    "token_ids": np.asarray(o.new_logprobs.logprob_token_ids).tolist(),
                    "logprobs": np.asarray(o.new_logprobs.logprobs).tolist(),
                }
            if o.new_prompt_logprobs_tensors is not None:
                t = o.new_prompt_logprobs_tensors
                reqs[o.request_id]["prompt_logprobs"] = {
                    "token_ids": t.logprob_token_ids.tolist(),
                    "logprobs": t.logprobs.tolist(),
                }
        e: dict[str, Any] = {"engine_index": outs.engine_index, "requests": reqs}
        if outs.scheduler_stats is not None:
            s = outs.scheduler_stats
            e["load"] = {
                "running": s.num_running_reqs,
                "waiting": s.num_waiting_reqs,
                "kv_usage": s.kv_cache_usage,
            }
        if outs.utility_output is not None:
            u = outs.utility_output
            e["utility"] = {
                "call_id": u.call_id,
                "failure_message": u.failure_message,
                "result": None if u.result is None else u.result.result,
            }
        if outs.finished_requests is not None:
            e["finished_requests"] = sorted(outs.finished_requests)
        return e

    def add_out(name: str, outs: EngineCoreOutputs) -> None:
        add(name, "output", list(enc.encode(outs)), expect_of(outs))

    def outs(*o: EngineCoreOutput, **kw: Any) -> EngineCoreOutputs:
        kw.setdefault("timestamp", TS)
        kw.setdefault("weight_version", "default")
        return EngineCoreOutputs(outputs=list(o), **kw)

    prefill = PrefillStats(num_prompt_tokens=8, num_computed_tokens=8, num_cached_tokens=0)
    events = [
        EngineCoreEvent(EngineCoreEventType.QUEUED, TS - 0.01),
        EngineCoreEvent(EngineCoreEventType.SCHEDULED, TS - 0.005),
    ]
    add_out("out_step_one_token", outs(EngineCoreOutput("req-A", [656])))
    add_out(
        "out_first_prefill_events",
        outs(EngineCoreOutput("req-A", [629], events=events, prefill_stats=prefill)),
    )
    add_out(
        "out_multi_request",
        outs(
            EngineCoreOutput("req-A", [629], prefill_stats=prefill),
            EngineCoreOutput("req-B", [1265], prefill_stats=PrefillStats(6, 6, 4, 4, 0, 0)),
            EngineCoreOutput("req-C", [17, 18]),
        ),
    )
    add_out("out_finish_eos", outs(EngineCoreOutput("req-A", [2], finish_reason=FinishReason.STOP)))
    add_out(
        "out_finish_stop_token",
        outs(EngineCoreOutput("req-A", [7], finish_reason=FinishReason.STOP, stop_reason=7)),
    )
    add_out(
        "out_finish_stop_str",
        outs(EngineCoreOutput("req-A", [11], finish_reason=FinishReason.STOP, stop_reason="END")),
    )
    add_out(
        "out_finish_length",
        outs(EngineCoreOutput("req-A", [1656], finish_reason=FinishReason.LENGTH)),
    )
    add_out(
        "out_finish_abort",
        outs(
            EngineCoreOutput("q-long", [], finish_reason=FinishReason.ABORT),
            finished_requests={"q-long"},
        ),
    )
    add_out(
        "out_finish_error",
        outs(
            EngineCoreOutput("req-err", [], finish_reason=FinishReason.ERROR),
            finished_requests={"req-err"},
        ),
    )
    add_out(
        "out_finish_repetition",
        outs(
            EngineCoreOutput(
                "req-rep",
                [5],
                finish_reason=FinishReason.REPETITION,
                stop_reason="repetition_detected",
            )
        ),
    )

    rng = np.random.default_rng(7)

    def lp_lists(rows: int, cols: int, first: int) -> LogprobsLists:
        ids = rng.integers(0, 2048, size=(rows, cols)).astype(np.int32)
        ids[:, 0] = first
        vals = -np.sort(rng.random((rows, cols)).astype(np.float32) * 9, axis=1)
        return LogprobsLists(ids, vals, np.ones(rows, dtype=np.int64))

    add_out(
        "out_logprobs_inline",
        outs(EngineCoreOutput("req-LP", [1520], new_logprobs=lp_lists(1, 3, 1520))),
    )
    p_ids = torch.from_numpy(rng.integers(0, 2048, size=(22, 21)).astype(np.int32))
    p_vals = -torch.rand(22, 21, dtype=torch.float32) * 9
    add_out(
        "out_logprobs_aux",
        outs(
            EngineCoreOutput(
                "req-LP",
                [1520],
                new_logprobs=lp_lists(1, 21, 1520),
                new_prompt_logprobs_tensors=LogprobsTensors(
                    p_ids, p_vals, torch.arange(22, dtype=torch.int32)
                ),
                prefill_stats=prefill,
            ),
            EngineCoreOutput("req-LP20", [405, 406, 407], new_logprobs=lp_lists(3, 21, 405)),
        ),
    )
    add_out(
        "out_utility_ok",
        outs(
            utility_output=UtilityOutput(5923996443447005681, result=UtilityResult(["generate"])),
            weight_version=None,
        ),
    )
    add_out(
        "out_utility_none",
        outs(
            utility_output=UtilityOutput(5923996443447006658, result=UtilityResult(None)),
            weight_version=None,
        ),
    )
    add_out(
        "out_utility_failure",
        outs(
            utility_output=UtilityOutput(
                5923996443447007635,
                failure_message="Call to no_such_method method failed: 'EngineCoreProc' "
                "object has no attribute 'no_such_method'",
            ),
            weight_version=None,
        ),
    )
    stats = SchedulerStats(
        num_running_reqs=2, num_waiting_reqs=1, step_counter=9, kv_cache_usage=0.25
    )
    add_out(
        "out_scheduler_stats",
        outs(EngineCoreOutput("req-A", [656], events=events[:1]), scheduler_stats=stats),
    )
    add_out("out_stats_only", outs(scheduler_stats=SchedulerStats(kv_cache_usage=0.0)))
    add_out("out_wave_complete", outs(engine_index=1, wave_complete=3))
    add_out("out_start_wave", outs(engine_index=1, start_wave=4))
    add_out("out_engine_index_2", outs(EngineCoreOutput("req-Z", [1]), engine_index=2))
    add("out_engine_core_dead", "output", [EngineCoreProc.ENGINE_CORE_DEAD])

    for path in live:
        with open(path) as f:
            captured = json.load(f)
        for v in captured["vectors"]:
            v["source"] = "live"
            vectors.append(v)

    doc = {
        "engine": "vllm",
        "vllm_version": vllm.__version__,
        "msgspec_version": msgspec.__version__,
        "note": "generated by tests/vectors/make_vllm_vectors.py; frames exclude the identity",
        "vectors": vectors,
    }
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {len(vectors)} vectors to {out}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
