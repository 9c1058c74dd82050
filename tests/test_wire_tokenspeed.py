"""smgd/wire/tokenspeed/ against vectors written by TokenSpeed 0.1.1's own encoders.

``tests/vectors/tokenspeed.json`` comes from ``tests/vectors/make_tokenspeed_vectors.py``: every
``hex`` is TokenSpeed's bytes, ``fields`` TokenSpeed's own view of them, ``engine_view`` what
TokenSpeed's decoder made of a request (including smgd's own ``encode_add`` frames, pushed
through TokenSpeed's real ``MsgpackRecvSocket``).
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from smgd.errors import InvalidRequest, WireError
from smgd.wire.common import (
    FinishReason,
    GenerateRequest,
    SamplingParams,
    Structured,
    TokenLogprob,
)
from smgd.wire.tokenspeed.decode import (
    decode_handshake,
    decode_hello,
    decode_identity,
    decode_init,
    decode_output,
    decode_ready,
    decode_registration,
    decode_request,
    split_routed,
)
from smgd.wire.tokenspeed.encode import (
    GREEDY_SEED,
    TOP_K_DISABLED,
    encode_abort,
    encode_add,
    encode_init,
    encode_request,
)
from smgd.wire.tokenspeed.engine_side import (
    OutputRow,
    encode_engine_dead,
    encode_hello,
    encode_identity,
    encode_output,
    encode_ready,
    encode_registration,
    finish_to_wire,
)
from smgd.wire.tokenspeed.jsonform import frames_to_json, json_to_frames
from smgd.wire.tokenspeed.structs import (
    REQ_ADD,
    TAG_OUTPUT,
    TAG_REQUEST,
    AbortRequest,
    BatchTokenIDOutSlim,
    ReadyResponse,
    TokenizedGenerateReqInput,
)

DOC = json.loads((Path(__file__).parent / "vectors" / "tokenspeed.json").read_text())
VECTORS: list[dict[str, Any]] = DOC["vectors"]
BY_NAME = {v["name"]: v for v in VECTORS}


def frame(name: str) -> bytes:
    return bytes.fromhex(BY_NAME[name]["hex"])


def of_type(*types: str) -> list[dict[str, Any]]:
    return [v for v in VECTORS if v["type"] in types]


def ids(vectors: list[dict[str, Any]]) -> list[str]:
    return [v["name"] for v in vectors]


def reencode(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)


def as_fields(obj: Any) -> Any:
    """A struct → {field: value}, recursively (to_builtins would give array_like lists)."""
    if isinstance(obj, msgspec.Struct):
        return {name: as_fields(getattr(obj, name)) for name in obj.__struct_fields__}
    if isinstance(obj, list):
        return [as_fields(x) for x in obj]
    return obj


def common_request(spec: dict[str, Any]) -> GenerateRequest:
    sampling = dict(spec["sampling"])
    if "stop_token_ids" in sampling:
        sampling["stop_token_ids"] = tuple(sampling["stop_token_ids"])
    if "logit_bias" in sampling:
        sampling["logit_bias"] = {int(k): v for k, v in sampling["logit_bias"].items()}
    if "structured" in sampling:
        sampling["structured"] = msgspec.convert(sampling["structured"], Structured)
    return GenerateRequest(
        rid=spec["rid"],
        prompt_ids=spec["prompt_ids"],
        stream=spec["stream"],
        sampling=SamplingParams(**sampling),
    )


# --------------------------------------------------------------------------- vectors


def test_vector_file_covers_every_message_type() -> None:
    assert {v["type"] for v in VECTORS} == {
        "RequestTypeFrame", "TokenizedGenerateReqInput", "SamplingParams", "AbortPayload",
        "BatchTokenIDOutSlim", "WireReadyMessage", "WireHandshakeInitMessage",
        "WireEngineCoreReadyResponse", "EngineIdentity", "EngineCoreDeadSentinel",
    }  # fmt: skip


@pytest.mark.parametrize("vec", VECTORS, ids=ids(VECTORS))
def test_json_form_round_trips_byte_identically(vec: dict[str, Any]) -> None:
    raw = bytes.fromhex(vec["hex"])
    obj = frames_to_json([raw])
    assert obj["type"] == vec["type"]
    text = json.dumps(obj, ensure_ascii=False)  # what `smgd wire decode` prints
    assert json_to_frames(json.loads(text)) == [raw]


@pytest.mark.parametrize(
    "vec", of_type("TokenizedGenerateReqInput"), ids=ids(of_type("TokenizedGenerateReqInput"))
)
def test_request_vectors_decode_to_tokenspeed_fields_and_reencode(vec: dict[str, Any]) -> None:
    raw = bytes.fromhex(vec["hex"])
    msg = decode_request([REQ_ADD, raw])
    assert isinstance(msg, TokenizedGenerateReqInput)
    ours = as_fields(msg)
    if "fields" in vec:
        theirs = {k: v for k, v in vec["fields"].items() if k != "_tag"}
        if ours["sampling_params"]["stop_token_ids"] is not None:
            ours["sampling_params"]["stop_token_ids"].sort()  # a set on TokenSpeed's side
        assert ours == theirs
    assert encode_request(msg) == [REQ_ADD, raw]


@pytest.mark.parametrize(
    "vec", of_type("BatchTokenIDOutSlim"), ids=ids(of_type("BatchTokenIDOutSlim"))
)
def test_output_vectors_rebuild_byte_identically_with_encode_output(vec: dict[str, Any]) -> None:
    raw = bytes.fromhex(vec["hex"])
    batch = msgspec.msgpack.decode(raw, type=BatchTokenIDOutSlim)
    rows = [
        OutputRow(
            rid=rid,
            output_ids=batch.output_ids[i],
            finished_reason=batch.finished_reasons[i],
            prompt_tokens=batch.prompt_tokens[i],
            completion_tokens=batch.completion_tokens[i],
            cached_tokens=batch.cached_tokens[i],
            logprob_vals=[float(x) for x in batch.output_token_logprobs_val[i]],
            logprob_ids=batch.output_token_logprobs_idx[i],
        )
        for i, rid in enumerate(batch.rids or [])
    ]
    load = {
        k: getattr(batch, k)
        for k in ("engine_index", "num_running", "num_waiting", "kv_active_pages", "kv_total_pages")
    }
    assert encode_output(rows, **load) == [raw]


@pytest.mark.parametrize("name", [v["name"] for v in VECTORS if "smgd_request" in v])
def test_encode_add_matches_tokenspeeds_own_encoding(name: str) -> None:
    req = common_request(BY_NAME[name]["smgd_request"])
    assert encode_add(req) == [b"\x00", frame(name)]


def test_engine_view_of_smgd_greedy_request_pins_seed_zero() -> None:
    view = BY_NAME["live_add_greedy"]["engine_view"]["sampling_params"]
    assert (view["temperature"], view["top_k"], view["seed"]) == (1.0, 1, GREEDY_SEED)
    assert view["stop_strs"] == []
    assert view["is_normalized"] is True


def test_engine_view_of_unseeded_request_derives_seed_from_rid() -> None:
    vec = BY_NAME["live_add_sampled_unseeded"]
    sent = decode_request([REQ_ADD, frame("live_add_sampled_unseeded")])
    assert isinstance(sent, TokenizedGenerateReqInput)
    assert sent.sampling_params.seed is None
    view = vec["engine_view"]
    assert view["sampling_params"]["seed"] == zlib.crc32(b"s-1")
    assert view["sampling_params"]["top_k"] == TOP_K_DISABLED
    assert view["validation_error"] is None


def test_engine_view_of_a_json_object_request() -> None:
    """response_format json_object lands in TokenSpeed's json_schema field as SGLang spells it."""
    view = BY_NAME["live_add_json_object"]["engine_view"]["sampling_params"]
    assert (view["json_schema"], view["regex"], view["ebnf"]) == ('{"type": "object"}', None, None)


def test_engine_rejects_logprobs_on_a_server_without_them() -> None:
    view = BY_NAME["live_add_logprobs_disabled_server"]["engine_view"]
    assert view["return_logprob"] is True
    assert "enable-output-logprobs" in view["validation_error"]


# --------------------------------------------------------------------------- requests


def test_encode_add_greedy_form() -> None:
    req = GenerateRequest(
        rid="g",
        prompt_ids=[1, 2],
        sampling=SamplingParams(
            max_tokens=5, temperature=0.0, top_k=50, seed=99, stop_token_ids=(7, 7)
        ),
    )
    frames = encode_add(req)
    assert frames[0] == b"\x00"
    msg = decode_request(frames)
    assert isinstance(msg, TokenizedGenerateReqInput)
    sp = msg.sampling_params
    assert (sp.temperature, sp.top_k, sp.seed, sp.stop_token_ids) == (1.0, 1, 0, [7])
    assert (sp.max_new_tokens, sp.n, sp.is_normalized, sp.stop, sp.stop_strs) == (
        5,
        1,
        False,
        None,
        None,
    )
    assert msg.rid == "g"
    assert msg.input_ids == [1, 2]
    assert len(msgspec.msgpack.decode(frames[1])) == 25  # the 0.1.1 full form


def test_encode_add_sampled_form() -> None:
    sampling = SamplingParams(max_tokens=3, temperature=0.5, top_p=1, logprobs=0, logit_bias={9: 1})
    msg = decode_request(
        encode_add(GenerateRequest(rid="s", prompt_ids=[1], sampling=sampling, stream=False))
    )
    assert isinstance(msg, TokenizedGenerateReqInput)
    sp = msg.sampling_params
    assert (sp.temperature, sp.top_k, sp.seed, sp.stop_token_ids) == (
        0.5,
        TOP_K_DISABLED,
        None,
        None,
    )
    assert isinstance(sp.top_p, float)  # float64 on the wire even when given an int
    assert sp.logit_bias == {"9": 1.0}
    assert (msg.return_logprob, msg.stream, msg.logprob_start_len) == (True, False, -1)


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"top_k": 128}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"logprobs": 5}, "top_logprobs"),
        ({"min_tokens": 9}, "min_tokens"),
    ],
)
def test_encode_add_refuses_what_the_engine_would_reject(
    change: dict[str, Any], param: str
) -> None:
    req = GenerateRequest(rid="x", prompt_ids=[1], sampling=SamplingParams(max_tokens=4, **change))
    with pytest.raises(InvalidRequest) as info:
        encode_add(req)
    assert info.value.param == param


def test_encode_add_checks_prompt_length_against_max_model_len() -> None:
    req = GenerateRequest(rid="x", prompt_ids=[1] * 8, sampling=SamplingParams(max_tokens=1))
    assert encode_add(req, max_model_len=9)
    with pytest.raises(InvalidRequest):
        encode_add(req, max_model_len=8)


def test_minimum_prefix_request_decodes_and_shorter_does_not() -> None:
    six = reencode([TAG_REQUEST, "r", None, None, [1, 2], []])
    msg = decode_request([b"\x00", six])
    assert isinstance(msg, TokenizedGenerateReqInput)
    assert (msg.rid, msg.input_ids, msg.sampling_params.top_k, msg.stream) == (
        "r",
        [1, 2],
        -1,
        False,
    )
    assert json_to_frames(frames_to_json([b"\x00", six])) == [b"\x00", six]
    with pytest.raises(WireError):
        decode_request([b"\x00", reencode([TAG_REQUEST, "r", None, None, [1, 2]])])


def test_abort_frames() -> None:
    assert encode_abort(["req-1"]) == [b"\x01", frame("abort_one")]
    assert encode_abort(iter(["a", "b-2", "水"])) == [b"\x01", frame("abort_many")]
    assert decode_request([b"\x01", frame("abort_many")]) == AbortRequest(rids=["a", "b-2", "水"])
    with pytest.raises(ValueError, match="rid"):
        encode_abort([""])
    with pytest.raises(ValueError, match="rid"):
        encode_abort([])


# --------------------------------------------------------------------------- outputs


def test_decode_output_two_requests_one_stop_with_load() -> None:
    batch = decode_output([frame("out_two_reqs_one_stop_with_load")])
    a, b = batch.deltas
    assert (a.rid, a.token_ids, a.finish, a.prompt_tokens, a.completion_tokens) == (
        "a",
        [11, 12],
        None,
        3,
        5,
    )
    assert b.finish is not None
    assert b.finish.reason is FinishReason.STOP
    assert (b.token_ids, b.cached_tokens) == ([2], 32)
    assert batch.load is not None
    assert (batch.load.running, batch.load.waiting, batch.load.kv_usage) == (7, 2, 0.12)
    assert not batch.engine_dead


def test_decode_output_length_with_logprobs_and_engine_index() -> None:
    batch = decode_output([frame("out_length_with_logprobs")])
    (d,) = batch.deltas
    assert d.finish is not None
    assert d.finish.reason is FinishReason.LENGTH
    assert d.logprobs == [
        TokenLogprob(token_id=10, logprob=-0.5),
        TokenLogprob(token_id=11, logprob=-0.25),
    ]
    assert batch.engine_index == 1
    assert batch.load is not None
    assert batch.load.kv_usage == 0.25


def test_bare_abort_is_a_4xx_rejection() -> None:
    (d,) = decode_output([frame("out_abort_empty_tokens")]).deltas
    assert d.finish is not None
    assert d.finish.reason is FinishReason.ABORT
    assert d.finish.status_code is not None
    assert 400 <= d.finish.status_code < 500
    assert d.token_ids == []


def test_outputs_for_rids_smgd_aborted_are_dropped() -> None:
    batch = decode_output([frame("out_two_reqs_one_stop_with_load")], aborted={"a"})
    assert [d.rid for d in batch.deltas] == ["b"]


def test_real_send_socket_output_decodes() -> None:
    batch = decode_output([frame("live_output_from_send_socket")])
    assert [d.rid for d in batch.deltas] == ["f-0", "f-1", "f-2"]
    reasons = [d.finish.reason if d.finish else None for d in batch.deltas]
    assert reasons == [None, FinishReason.STOP, FinishReason.LENGTH]
    assert batch.deltas[0].token_ids == [500, 501]
    assert batch.engine_index == 7
    assert batch.load is not None
    assert (batch.load.running, batch.load.waiting, batch.load.kv_usage) == (4, 1, 0.25)


def test_no_load_snapshot_means_no_load() -> None:
    batch = decode_output([frame("out_single_midstream")])
    assert batch.load is None
    assert batch.deltas[0].token_ids == [791]


@pytest.mark.parametrize(("length", "engine_index"), [(9, 0), (10, 1)])
def test_older_senders_without_the_tail_decode(length: int, engine_index: int) -> None:
    full = msgspec.msgpack.decode(frame("out_length_with_logprobs"))
    batch = decode_output([reencode(full[:length])])
    assert batch.engine_index == engine_index
    assert batch.load is None
    assert batch.deltas[0].token_ids == [10, 11]


def test_extra_trailing_fields_are_tolerated_and_kept_in_json() -> None:
    full = msgspec.msgpack.decode(frame("out_length_with_logprobs"))
    newer = reencode([*full, [["details"]], [0]])
    assert decode_output([newer]).deltas[0].token_ids == [10, 11]
    obj = frames_to_json([newer])
    assert obj["_extra"] == [[["details"]], [0]]
    assert json_to_frames(obj) == [newer]


def test_dead_sentinel() -> None:
    assert decode_output([frame("live_engine_core_dead")]).engine_dead
    assert encode_engine_dead() == [frame("engine_core_dead")]


def test_aux_frames_on_output_are_ignored() -> None:
    batch = decode_output([memoryview(frame("out_single_midstream")), b"\x00" * 300])
    assert batch.deltas[0].rid == "req-1"


def test_finish_to_wire_for_mocks() -> None:
    (d,) = decode_output([frame("out_abort_empty_tokens")]).deltas
    assert [finish_to_wire(x) for x in (None, d.finish)] == ["", "abort"]


# --------------------------------------------------------------------------- handshake


def test_handshake_messages_match_tokenspeed() -> None:
    assert encode_hello() == frame("handshake_hello") == frame("live_hello")
    assert encode_ready() == frame("handshake_ready") == frame("live_ready")
    assert decode_hello(frame("live_hello")).headless is True
    assert decode_ready(frame("live_ready")).status == "READY"
    with pytest.raises(WireError, match="READY"):
        decode_ready(frame("live_hello"))
    with pytest.raises(WireError, match="HELLO"):
        decode_hello(frame("live_ready"))


def test_init_matches_tokenspeed_and_is_what_it_reads() -> None:
    inputs, outputs = ["ipc:///tmp/smgd-0/ts-in.sock"], ["ipc:///tmp/smgd-0/ts-out.sock"]
    assert encode_init(inputs, outputs) == [frame("handshake_init_ipc")]
    init = decode_init(frame("handshake_init_ipc"))
    assert (init.addresses.inputs, init.addresses.outputs) == (inputs, outputs)
    with pytest.raises(ValueError, match="output"):
        encode_init(inputs, [])


def test_identities_are_two_byte_little_endian() -> None:
    for index in (0, 1, 258):
        assert encode_identity(index) == frame(f"engine_identity_{index}")
        assert decode_identity(frame(f"engine_identity_{index}")) == index
    assert decode_identity(frame("live_identity_7")) == 7
    assert split_routed([b"\x07\x00", frame("live_hello")]) == (7, frame("live_hello"))
    with pytest.raises(WireError):
        split_routed([b"\x07", frame("live_hello")])
    with pytest.raises(ValueError, match="2 bytes"):
        encode_identity(1 << 16)


def test_registration_with_prefix_granularity() -> None:
    reg = decode_registration(frame("live_registration"))
    assert (reg.max_model_len, reg.granularity, reg.max_num_seqs) == (32768, 64, 256)
    info = reg.engine_info()
    assert (info.max_model_len, info.kv_cache_tokens, info.version) == (
        32768,
        262144,
        "tokenspeed-0.1.1",
    )
    resp = ReadyResponse(
        **{
            k: v
            for k, v in msgspec.to_builtins(reg).items()
            if k in ReadyResponse.__struct_fields__
        }
    )
    assert resp.prefix_granularity == 64


def test_registration_with_legacy_block_size_and_unknown_keys() -> None:
    theirs = msgspec.msgpack.decode(frame("registration_ready_response"))
    legacy = {("block_size" if k == "prefix_granularity" else k): v for k, v in theirs.items()}
    legacy["max_num_batched_tokens"] = -1
    legacy["some_future_key"] = {"x": 1}
    reg = decode_registration(reencode(legacy))
    assert (reg.granularity, reg.block_size, reg.prefix_granularity) == (64, 64, None)
    assert reg.max_num_batched_tokens == -1
    assert decode_registration({"max_model_len": 10}).granularity is None


def test_encode_registration_matches_tokenspeed() -> None:
    resp = ReadyResponse(
        max_model_len=32768, num_gpu_blocks=4096, prefix_granularity=64, dtype="bfloat16",
        vllm_version="tokenspeed-0.1.1", max_num_seqs=256, max_num_batched_tokens=8192,
        instance_id="tiny-model", kv_cache_size_tokens=262144,
    )  # fmt: skip
    assert encode_registration(resp) == frame("registration_ready_response")


# --------------------------------------------------------------------------- JSON form


def test_json_form_of_a_routed_request_message() -> None:
    frames = [
        b"\x03\x00",
        *encode_add(
            GenerateRequest(rid="q", prompt_ids=[5], sampling=SamplingParams(max_tokens=2))
        ),
    ]
    obj = frames_to_json(frames)
    assert (obj["type"], obj["request_type"], obj["identity"], obj["rid"]) == (
        "TokenizedGenerateReqInput",
        "ADD",
        3,
        "q",
    )
    assert obj["sampling_params"]["max_new_tokens"] == 2
    assert json_to_frames(obj) == frames


def test_json_form_keeps_non_finite_floats() -> None:
    rows = [OutputRow(rid="r", output_ids=[1], logprob_vals=[-math.inf], logprob_ids=[1])]
    frames = encode_output(rows)
    obj = frames_to_json(frames)
    assert json_to_frames(json.loads(json.dumps(obj))) == frames


def test_json_form_fills_gaps_with_defaults() -> None:
    frames = json_to_frames(
        {
            "type": "TokenizedGenerateReqInput",
            "request_type": "ADD",
            "rid": "x",
            "sampling_params": {"max_new_tokens": 3},
            "stream": True,
        }
    )
    msg = decode_request(frames)
    assert isinstance(msg, TokenizedGenerateReqInput)
    assert (msg.stream, msg.logprob_start_len, msg.sampling_params.max_new_tokens) == (True, -1, 3)
    assert len(msgspec.msgpack.decode(frames[1])) == 11


# --------------------------------------------------------------------------- garbage


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b"\xc1"],
        [b"not msgpack at all"],
        [reencode(["BatchTokenIDOut", [], [], [], [], [], [], [], []])],
        [reencode([TAG_REQUEST, "r", None, None, [1], []])],
        [reencode([TAG_OUTPUT, ["a", "b"], [[1]], [""], [1], [1], [0], [[]], [[]]])],
        [reencode([TAG_OUTPUT, ["a"], [[1]], [""], [1], [1], [0], [[-0.5]], [[]]])],
        [reencode([TAG_OUTPUT, ["a"], [["x"]], [""], [1], [1], [0], [[]], [[]]])],
    ],
    ids=[
        "empty",
        "reserved-byte",
        "text",
        "wrong-tag",
        "request-on-output",
        "ragged",
        "logprob-mismatch",
        "str-token",
    ],
)
def test_decode_output_garbage_is_a_wire_error(frames: list[bytes]) -> None:
    with pytest.raises(WireError):
        decode_output(frames)


@pytest.mark.parametrize(
    "frames",
    [
        [b"\x00"],
        [b"\x05", frame("abort_one")],
        [b"\x00", b"\xc1"],
        [b"\x01", reencode([1, 2])],
        [b"\x00", frame("abort_one")],
    ],
    ids=["one-frame", "unknown-type", "bad-payload", "abort-not-strings", "add-with-abort-payload"],
)
def test_decode_request_garbage_is_a_wire_error(frames: list[bytes]) -> None:
    with pytest.raises(WireError):
        decode_request(frames)


def test_handshake_garbage_is_a_wire_error() -> None:
    with pytest.raises(WireError):
        decode_hello(b"\xc1")
    with pytest.raises(WireError):
        decode_handshake(reencode({"status": "BYE"}))
    with pytest.raises(WireError):
        decode_registration(b"")
    with pytest.raises(WireError):
        decode_registration(reencode({"num_gpu_blocks": 3}))
    with pytest.raises(WireError):
        decode_registration(reencode({"max_model_len": "long"}))
    with pytest.raises(WireError):
        decode_init(reencode({"addresses": 3}))


@pytest.mark.parametrize(
    "obj",
    [
        {"type": "Nope"},
        {"rid": "x"},
        {"type": "TokenizedGenerateReqInput", "rid": "x", "sampling_params": {}, "bogus": 1},
        {"type": "TokenizedGenerateReqInput", "rid": "x", "stream": True},
        {"type": "TokenizedGenerateReqInput", "rid": 5, "sampling_params": {}},
        {"type": "AbortPayload", "rids": [1]},
        {"type": "RequestTypeFrame", "request_type": "PAUSE"},
        {"type": "BatchTokenIDOutSlim", "rids": ["a"], "aux": ["zz"]},
    ],
)
def test_json_to_frames_garbage_is_a_wire_error(obj: dict[str, Any]) -> None:
    with pytest.raises(WireError):
        json_to_frames(obj)


@pytest.mark.parametrize(
    "frames",
    [[], [b"\xc1\xc1\xc1"], [reencode({"hello": 1})], [reencode(["Unknown", 1])], [b"\x09", b"xx"]],
)
def test_frames_to_json_garbage_is_a_wire_error(frames: list[bytes]) -> None:
    with pytest.raises(WireError):
        frames_to_json(frames)


# SMG's cross-language output vector (crates/engine_zmq_client protocol/tokenspeed/output.rs,
# quoted in /work/shared/wire/smg_zmq.md §3.4): Rust, Python and smgd agree byte for byte.
SMG_PINNED_OUTPUT = (
    "9eb34261746368546f6b656e49444f7574536c696d91a57665632d3191920a0b91a66c656e677468910391029101"
    "9192cbbfe0000000000000cbbfd000000000000091920a0b01020564cd0190"
)


def test_smg_pinned_output_vector_equals_tokenspeeds() -> None:
    assert bytes.fromhex(SMG_PINNED_OUTPUT) == frame("out_length_with_logprobs")
