"""SGLang wire codec against vectors made by SGLang's own encoder (tests/vectors/sglang.json)."""

from __future__ import annotations

import json
import math
from array import array
from pathlib import Path
from typing import Any

import msgspec
import pytest
from msgspec.msgpack import Ext

from smgd.errors import InvalidRequest, WireError
from smgd.wire.common import (
    Finish,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    Structured,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
)
from smgd.wire.sglang.arrays import ext_to_ids, exts_to_ids, ids_to_ext
from smgd.wire.sglang.decode import decode_any, decode_output, decode_request
from smgd.wire.sglang.encode import (
    encode_abort,
    encode_flush_cache,
    encode_generate,
    encode_get_internal_state,
    encode_health_check,
    encode_message,
    encode_shutdown,
    new_health_check_rid,
)
from smgd.wire.sglang.engine_side import (
    OutputItem,
    encode_abort_echo,
    encode_batch_output,
    encode_health_output,
)
from smgd.wire.sglang.jsonform import frames_to_json, json_to_frames
from smgd.wire.sglang.structs import (
    TOP_K_ALL,
    AbortReq,
    BatchTokenIDOutput,
    BatchTokenizedGenerateReqInput,
    FlushCacheReqOutput,
    HealthCheckOutput,
    OtherMessage,
    TokenizedGenerateReqInput,
)

VECTORS: list[dict[str, Any]] = json.loads(
    (Path(__file__).parent / "vectors" / "sglang.json").read_text()
)["vectors"]
BY_NAME = {v["name"]: v for v in VECTORS}


def frame(name: str) -> bytes:
    return bytes.fromhex(BY_NAME[name]["hex"])


def live(kind: str) -> dict[str, Any]:
    """The first frame of this type captured from the real scheduler."""
    return next(v for v in VECTORS if v["source"] == "captured_live" and v["type"] == kind)


def with_key(key: str) -> list[dict[str, Any]]:
    return [v for v in VECTORS if key in v]


def _ids(v: dict[str, Any]) -> list[str]:
    return [x["name"] for x in v] if isinstance(v, list) else []


@pytest.mark.parametrize("vec", [v for v in VECTORS if v["roundtrip"]], ids=lambda v: v["name"])
def test_decode_then_encode_is_byte_identical(vec: dict[str, Any]) -> None:
    raw = bytes.fromhex(vec["hex"])
    msg = decode_any(raw)
    if isinstance(msg, OtherMessage):
        assert msg.tag == vec["type"]
        again = msgspec.msgpack.encode([msg.tag, *msg.fields])
    else:
        assert type(msg).__name__ == vec["type"]
        again = encode_message(msg)
    assert again == raw


@pytest.mark.parametrize("vec", VECTORS, ids=lambda v: v["name"])
def test_json_form_round_trips_through_text(vec: dict[str, Any]) -> None:
    raw = bytes.fromhex(vec["hex"])
    obj = frames_to_json([raw])
    assert obj["type"] == vec["type"]
    text = json.dumps(obj)  # what the CLI prints
    assert json_to_frames(json.loads(text)) == [raw]


def _common(spec: dict[str, Any]) -> GenerateRequest:
    sampling = dict(spec["sampling"])
    if "logit_bias" in sampling:
        sampling["logit_bias"] = {int(k): v for k, v in sampling["logit_bias"].items()}
    if "stop_token_ids" in sampling:
        sampling["stop_token_ids"] = tuple(sampling["stop_token_ids"])
    if "structured" in sampling:
        sampling["structured"] = msgspec.convert(sampling["structured"], Structured)
    return GenerateRequest(
        rid=spec["rid"],
        prompt_ids=spec["prompt_ids"],
        stream=spec["stream"],
        sampling=SamplingParams(**sampling),
        priority=spec.get("priority"),
    )


@pytest.mark.parametrize("vec", with_key("smgd_request"), ids=lambda v: v["name"])
def test_encode_generate_matches_tokenizer_manager(vec: dict[str, Any]) -> None:
    assert encode_generate(_common(vec["smgd_request"])) == bytes.fromhex(vec["hex"])


def test_control_encoders_match_sglang() -> None:
    assert encode_abort(BY_NAME["abort_one"]["abort_rid"]) == frame("abort_one")
    assert encode_health_check(BY_NAME["tgri_health_check"]["health_rid"]) == frame(
        "tgri_health_check"
    )
    assert encode_flush_cache() == frame("flush_cache")
    assert encode_shutdown() == frame("shutdown")
    assert encode_get_internal_state() == frame("get_internal_state")


def test_greedy_is_rewritten_and_stop_lists_are_empty() -> None:
    req = _common(BY_NAME["tgri_greedy_stream"]["smgd_request"])
    msg = decode_request(encode_generate(req))
    assert isinstance(msg, TokenizedGenerateReqInput)
    sp = msg.sampling_params
    assert (sp.temperature, sp.top_k, sp.is_normalized) == (1.0, 1, True)
    assert sp.stop_strs == []
    assert sp.stop_regex_strs == []
    assert sp.stop_token_ids is None
    assert msg.time_stats is None


def test_eos_ids_are_not_sent_and_top_k_minus_one_is_all() -> None:
    req = GenerateRequest(
        rid="r" * 32,
        prompt_ids=[1, 2],
        sampling=SamplingParams(max_tokens=3, temperature=0.5, eos_token_ids=(2,)),
    )
    msg = decode_request(encode_generate(req))
    assert isinstance(msg, TokenizedGenerateReqInput)
    assert msg.sampling_params.stop_token_ids is None
    assert msg.sampling_params.top_k == TOP_K_ALL
    assert msg.return_logprob is False


@pytest.mark.parametrize(
    ("sampling", "param"),
    [
        ({"top_p": 0.0}, "top_p"),
        ({"temperature": math.inf}, "temperature"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"ignore_eos": True, "stop_token_ids": (5,)}, "stop_token_ids"),
        ({"seed": 1 << 63}, "seed"),
    ],
)
def test_values_the_scheduler_cannot_take_are_refused(sampling: dict[str, Any], param: str) -> None:
    req = GenerateRequest(
        rid="r" * 32, prompt_ids=[1], sampling=SamplingParams(max_tokens=3, **sampling)
    )
    with pytest.raises(InvalidRequest) as info:
        encode_generate(req)
    assert info.value.param == param


def test_empty_abort_rid_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        encode_abort("")


def test_health_check_rid_needs_prefix() -> None:
    with pytest.raises(ValueError, match="HEALTH_CHECK"):
        encode_health_check("abc")
    assert new_health_check_rid().startswith("HEALTH_CHECK_")


def _finish(fj: dict[str, Any] | None) -> Finish | None:
    if fj is None:
        return None
    if fj["type"] == "length":
        return Finish(reason=FinishReason.LENGTH)
    if fj["type"] == "stop":
        return Finish(reason=FinishReason.STOP, matched_token=fj["matched"])
    return Finish(reason=FinishReason.ABORT, message=fj["message"], status_code=fj["status_code"])


def _expected_delta(e: dict[str, Any]) -> TokenDelta:
    logprobs = None
    if e["logprobs"] is not None:
        tops = e["top"] or [None] * len(e["logprobs"])
        logprobs = [
            TokenLogprob(
                token_id=i, logprob=v, top=[TopLogprob(a, b) for a, b in top] if top else None
            )
            for (i, v), top in zip(e["logprobs"], tops, strict=True)
        ]
    return TokenDelta(
        rid=e["rid"],
        token_ids=e["token_ids"],
        logprobs=logprobs,
        finish=_finish(e["finish"]),
        prompt_tokens=e["prompt_tokens"],
        completion_tokens=e["completion_tokens"],
        cached_tokens=e["cached_tokens"],
    )


@pytest.mark.parametrize("vec", with_key("expect"), ids=lambda v: v["name"])
def test_batch_output_translates_to_common_deltas(vec: dict[str, Any]) -> None:
    got = decode_output(bytes.fromhex(vec["hex"]))
    assert got == [_expected_delta(e) for e in vec["expect"]]


def test_abort_echo_and_controls() -> None:
    (delta,) = decode_output(frame("abort_from_scheduler_with_reason"))  # type: ignore[misc]
    assert delta.finish == Finish(
        reason=FinishReason.ABORT, message="Input too long", status_code=400
    )
    (queued,) = decode_output(frame("abort_from_scheduler_queued"))  # type: ignore[misc]
    assert queued.finish is not None
    assert queued.finish.reason is FinishReason.ABORT
    assert queued.token_ids == []
    health = decode_output(frame("health_check_output"))
    assert isinstance(health, HealthCheckOutput)
    assert (health.rid or "").startswith("HEALTH_CHECK")
    flush = decode_output(frame("flush_cache_output"))
    assert isinstance(flush, FlushCacheReqOutput)
    assert flush.success is True
    other = decode_output(frame("configure_logging_echo"))
    assert isinstance(other, OtherMessage)
    assert other.tag == "ConfigureLoggingReq"


def test_time_stats_stay_opaque_bytes() -> None:
    msg = decode_any(frame("btid_1req_finished_length"))
    assert isinstance(msg, BatchTokenIDOutput)
    assert msg.time_stats is not None
    assert isinstance(msg.time_stats.data, bytes)
    assert msg.time_stats.data[:1] == b"\x80"
    assert frames_to_json([frame("btid_1req_finished_length")])["time_stats"] == {
        "type": "PickleWrapper",
        "data": {"hex": msg.time_stats.data.hex()},
    }


def test_json_form_names_fields_and_lists_tokens() -> None:
    obj = frames_to_json([frame("tgri_greedy_stream")])
    spec = BY_NAME["tgri_greedy_stream"]["smgd_request"]
    assert obj["input_ids"] == spec["prompt_ids"]
    assert obj["sampling_params"]["max_new_tokens"] == 8
    assert obj["sampling_params"]["top_k"] == 1
    out = frames_to_json([frame("btid_2req_stop_token_and_running")])
    assert out["output_ids"] == [
        e["token_ids"] for e in BY_NAME["btid_2req_stop_token_and_running"]["expect"]
    ]


def _raw(name: str) -> list[Any]:
    value = msgspec.msgpack.decode(frame(name))
    assert isinstance(value, list)
    return value


def test_omitted_trailing_defaults_are_tolerated() -> None:
    value = _raw("tgri_greedy_stream")[:14]  # tag + the 13 required fields
    msg = decode_request(msgspec.msgpack.encode(value))
    assert isinstance(msg, TokenizedGenerateReqInput)
    assert msg.sampling_logprobs_mode == "selected"
    assert msg.lora_name is None
    out = _raw("btid_1req_finished_length")[:34]  # the 33 required columns
    (delta,) = decode_output(msgspec.msgpack.encode(out))  # type: ignore[misc]
    assert delta.finish == Finish(reason=FinishReason.LENGTH)


def test_missing_required_field_is_a_wire_error() -> None:
    with pytest.raises(WireError):
        decode_request(msgspec.msgpack.encode(_raw("tgri_greedy_stream")[:13]))
    with pytest.raises(WireError):
        decode_output(msgspec.msgpack.encode(_raw("btid_1req_finished_length")[:10]))


def test_extra_trailing_fields_are_tolerated() -> None:
    value = [*_raw("btid_2req_stop_token_and_running"), "future", [1, 2]]
    got = decode_output(msgspec.msgpack.encode(value))
    assert got == decode_output(frame("btid_2req_stop_token_and_running"))
    req = [*_raw("abort_one"), True]
    assert decode_request(msgspec.msgpack.encode(req)) == decode_request(frame("abort_one"))
    assert frames_to_json([msgspec.msgpack.encode(req)])["_extra"] == [True]


@pytest.mark.parametrize(
    "payload",
    [["NoSuchReq", None, None], {"type": "AbortReq"}, "AbortReq", [1, 2]],
    ids=["unknown-tag", "map", "str", "no-tag"],
)
def test_unknown_or_malformed_frames_are_wire_errors(payload: Any) -> None:
    raw = msgspec.msgpack.encode(payload)
    with pytest.raises(WireError):
        decode_output(raw)
    with pytest.raises(WireError):
        decode_request(raw)


def test_truncated_bytes_are_a_wire_error() -> None:
    with pytest.raises(WireError):
        decode_output(frame("btid_mixed_logprobs")[:-7])


def test_plain_list_input_ids_are_refused_like_sglang() -> None:
    value = _raw("tgri_greedy_stream")
    value[4] = [1, 2, 3]
    with pytest.raises(WireError):
        decode_request(msgspec.msgpack.encode(value))


_LOGPROB_COL = 17  # array index of output_token_logprobs_val (tag at 0)


@pytest.mark.parametrize(
    ("column", "mutate"),
    [
        (_LOGPROB_COL, lambda col: [col[0][:1], col[1]]),  # values shorter than ids
        (_LOGPROB_COL + 1, lambda col: [[*col[0], 5], col[1]]),  # indices longer
        (_LOGPROB_COL, lambda col: col[:1]),  # column shorter than rids
        (_LOGPROB_COL + 4, lambda col: [[col[0][0]], col[1]]),  # top values ragged
        (_LOGPROB_COL + 5, lambda col: [[col[0][0], col[0][1][:1]], col[1]]),  # top pair ragged
        (_LOGPROB_COL + 1, lambda col: [[None, col[0][1]], col[1]]),  # a missing index
    ],
)
def test_ragged_logprob_columns_are_wire_errors(column: int, mutate: Any) -> None:
    value = _raw("btid_mixed_logprobs")
    assert decode_output(msgspec.msgpack.encode(value))  # intact: decodes
    value[column] = mutate(value[column])
    with pytest.raises(WireError):
        decode_output(msgspec.msgpack.encode(value))


def test_mock_side_encoders_round_trip_through_decode_output() -> None:
    lp = [TokenLogprob(token_id=5, logprob=-0.5, top=[TopLogprob(5, -0.5), TopLogprob(6, -1.0)])]
    raw = encode_batch_output(
        [
            OutputItem("a" * 32, [5], None, 3, 1, 0, lp),
            ("b" * 32, [70000, 2], Finish(reason=FinishReason.STOP, matched_token=2), 4, 9, 2),
        ]
    )
    assert decode_output(raw) == [
        TokenDelta(
            rid="a" * 32,
            token_ids=[5],
            logprobs=lp,
            prompt_tokens=3,
            completion_tokens=1,
            cached_tokens=0,
        ),
        TokenDelta(
            rid="b" * 32,
            token_ids=[70000, 2],
            prompt_tokens=4,
            completion_tokens=9,
            cached_tokens=2,
            finish=Finish(reason=FinishReason.STOP, matched_token=2),
        ),
    ]
    abort = Finish(reason=FinishReason.ABORT, message="gone", status_code=503)
    assert decode_output(encode_abort_echo("c" * 32, abort)) == [
        TokenDelta(rid="c" * 32, token_ids=[], finish=abort)
    ]
    assert decode_output(encode_health_output()) == HealthCheckOutput()
    assert encode_health_output() == bytes.fromhex(live("HealthCheckOutput")["hex"])


def test_mock_output_has_sglang_shape() -> None:
    raw = encode_batch_output([("a" * 32, [1], Finish(reason=FinishReason.LENGTH), 3, 4, 0)])
    value = msgspec.msgpack.decode(raw)
    assert value[0] == "BatchTokenIDOutput"
    assert len(value) == 54
    assert value[3] == [{"type": "length", "length": 4}]


def test_decode_request_reads_what_smgd_sends() -> None:
    msg = decode_request(frame("abort_one"))
    assert msg == AbortReq(rid=BY_NAME["abort_one"]["abort_rid"])
    batch = decode_request(frame("batch_tgri_two"))
    assert isinstance(batch, BatchTokenizedGenerateReqInput)
    assert len(batch.batch) == 2
    assert ext_to_ids(batch.batch[0].input_ids) == [1, 2]


def test_json_encode_rejects_bad_input() -> None:
    with pytest.raises(WireError):
        json_to_frames({"type": "NoSuchReq"})
    with pytest.raises(WireError):
        json_to_frames({"type": "AbortReq", "rid": "x", "bogus": 1})
    with pytest.raises(WireError):
        json_to_frames({"type": "AbortReq", "abort_all": True})  # gap: rid, ipc missing
    with pytest.raises(WireError):
        frames_to_json([frame("abort_one"), frame("abort_one")])


def test_ids_survive_int64_range() -> None:
    ids = [0, 1, 65536, (1 << 63) - 1, -(1 << 63)]
    assert ext_to_ids(ids_to_ext(ids)) == ids
    for one in ids:  # a single id, the decode step's usual output, has a path of its own
        assert ext_to_ids(ids_to_ext([one])) == [one]


def test_a_single_id_array_in_any_typecode_decodes() -> None:
    for typecode in "bBhHiIlLqQ":
        arr = array(typecode, [7])
        meta = msgspec.msgpack.encode(typecode)
        ext = Ext(1, len(meta).to_bytes(4, "big") + meta + arr.tobytes())
        assert ext_to_ids(ext) == [7]
    with pytest.raises(WireError):  # one int64 plus a stray byte
        ext_to_ids(Ext(1, bytes(ids_to_ext([7]).data) + b"\x00"))


def _typecode_ext(typecode: str, ids: list[int]) -> Ext:
    meta = msgspec.msgpack.encode(typecode)
    return Ext(1, len(meta).to_bytes(4, "big") + meta + array(typecode, ids).tobytes())


@pytest.mark.parametrize(
    "column",
    [
        [
            ids_to_ext([one]) for one in (0, 1, 65536, (1 << 63) - 1, -(1 << 63))
        ],  # the whole-column path
        [ids_to_ext([5])],
        [],
        [ids_to_ext([5]), ids_to_ext([]), ids_to_ext([6, 7])],  # lengths differ
        [ids_to_ext([5, 6]), ids_to_ext([])],  # 28 bytes in all, as two one-id payloads would be
        [ids_to_ext([5]), _typecode_ext("i", [7]), ids_to_ext([8])],
        [ids_to_ext([5]), _typecode_ext("b", [1, 2, 3, 4, 5, 6, 7, 8])],  # 14 bytes, not int64
        [ids_to_ext([5]), Ext(1, memoryview(bytes(ids_to_ext([9]).data)))],
    ],
)
def test_a_column_of_id_arrays_decodes_as_each_of_its_arrays(column: list[Any]) -> None:
    assert exts_to_ids(column) == [ext_to_ids(ext) for ext in column]


@pytest.mark.parametrize(
    "bad",
    [
        [ids_to_ext([5]), [6]],  # not an ext
        [ids_to_ext([5]), Ext(2, bytes(ids_to_ext([6]).data))],  # another ext code
        [ids_to_ext([5]), Ext(1, b"\x00\x00\x00\x02\xa1x" + bytes(8))],  # typecode "x"
    ],
)
def test_a_column_with_a_bad_entry_is_refused(bad: list[Any]) -> None:
    with pytest.raises(WireError):
        exts_to_ids(bad)


@pytest.mark.parametrize(
    "vec",
    [
        v
        for v in VECTORS
        if v["direction"] == "scheduler_to_router" and v["type"] != "PickleWrapper"
    ],
    ids=lambda v: v["name"],
)
def test_every_scheduler_frame_decodes_on_the_hot_path(vec: dict[str, Any]) -> None:
    got = decode_output(bytes.fromhex(vec["hex"]))
    if vec["type"] in ("BatchTokenIDOutput", "AbortReq"):
        assert isinstance(got, list)
        assert all(isinstance(d, TokenDelta) for d in got)
    else:
        assert type(got).__name__ in (vec["type"], "OtherMessage")
