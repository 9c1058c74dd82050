"""vLLM wire codec against golden vectors from vLLM's own encoder (tests/vectors/vllm.json).

The vectors were written by tests/vectors/make_vllm_vectors.py with vLLM 0.32.0's classes and
``MsgpackEncoder`` (``source: syn``) or captured from a live engine core (``source: live``).
``expect`` entries were computed from vLLM's own objects, not from this codec.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec
import pytest

from smgd.errors import WireError
from smgd.wire.common import (
    FinishReason,
    GenerateRequest,
    SamplingParams,
    Structured,
    StructuredKind,
)
from smgd.wire.vllm.decode import (
    decode_engine_outputs,
    decode_handshake,
    decode_init,
    decode_outputs,
    decode_ready_response,
    decode_request,
    is_engine_dead,
)
from smgd.wire.vllm.encode import (
    encode_abort,
    encode_add,
    encode_init,
    encode_request_message,
    encode_start_dp_wave,
    encode_utility,
    structured_outputs,
    to_vllm_sampling,
)
from smgd.wire.vllm.engine_side import (
    encode_engine_dead,
    encode_hello,
    encode_outputs,
    encode_ready,
    encode_ready_response,
    logprobs_lists,
)
from smgd.wire.vllm.jsonform import frames_to_json, json_to_frames
from smgd.wire.vllm.structs import (
    ENGINE_CORE_DEAD,
    AddRequest,
    EngineCoreOutput,
    EngineCoreOutputs,
    Hello,
    LogprobsLists,
    PrefillStats,
    Ready,
    Tensor,
    UtilityRequest,
    VllmFinishReason,
)
from smgd.wire.vllm.structs import SamplingParams as VllmSamplingParams
from smgd.wire.vllm.tensors import make_tensor, tensor_values

DOC = json.loads((Path(__file__).parent / "vectors" / "vllm.json").read_text())
VECTORS: list[dict[str, Any]] = DOC["vectors"]
BY_NAME = {v["name"]: v for v in VECTORS}
ARRIVAL = 1764680000.25  # make_vllm_vectors.ARRIVAL


def frames_of(v: dict[str, Any]) -> list[bytes]:
    return [bytes.fromhex(h) for h in v["frames_hex"]]


def named(name: str) -> list[bytes]:
    return frames_of(BY_NAME[name])


def typed_round_trip(v: dict[str, Any]) -> list[bytes]:
    """Decode a vector with the typed decoders and encode it again."""
    frames = frames_of(v)
    if v["socket"] == "handshake":
        kind = frames_to_json(frames)["type"]
        if kind == "INIT":
            init = decode_init(frames)
            return encode_init(
                init.addresses.inputs,
                init.addresses.outputs,
                coordinator_input=init.addresses.coordinator_input,
                coordinator_output=init.addresses.coordinator_output,
                frontend_stats_publish_address=init.addresses.frontend_stats_publish_address,
                parallel_config=init.parallel_config,
            )
        msg = decode_handshake(frames)
        encode = encode_hello if isinstance(msg, Hello) else encode_ready
        if msg.parallel_config_hash is not None:
            return encode_ready(
                local=msg.local,
                headless=msg.headless,
                parallel_config_hash=msg.parallel_config_hash,
            )
        return encode(local=msg.local, headless=msg.headless)
    if v["socket"] == "input":
        if len(frames) == 1:
            return encode_ready_response(decode_ready_response(frames))
        return encode_request_message(decode_request(frames))
    if is_engine_dead(frames):
        return encode_engine_dead()
    return encode_outputs(decode_engine_outputs(frames), aux=frames[1:])


def test_vectors_cover_every_message_kind() -> None:
    kinds = {frames_to_json(frames_of(v))["type"] for v in VECTORS}
    assert kinds >= {
        "HELLO",
        "READY",
        "INIT",
        "READY_RESPONSE",
        "ADD",
        "ABORT",
        "UTILITY",
        "START_DP_WAVE",
        "OUTPUTS",
        "ENGINE_CORE_DEAD",
    }
    assert DOC["vllm_version"].startswith("0.32.0")


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"] for v in VECTORS])
def test_json_form_round_trips_byte_identically(vec: dict[str, Any]) -> None:
    frames = frames_of(vec)
    text = json.dumps(frames_to_json(frames))  # must be plain JSON
    assert json_to_frames(json.loads(text)) == frames


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"] for v in VECTORS])
def test_typed_decode_encode_is_byte_identical(vec: dict[str, Any]) -> None:
    assert typed_round_trip(vec) == frames_of(vec)


@pytest.mark.parametrize(
    "vec",
    [v for v in VECTORS if v["socket"] == "output" and "expect" in v],
    ids=lambda v: v["name"],
)
def test_decode_outputs_translates_like_vllm(vec: dict[str, Any]) -> None:
    expect = vec["expect"]
    batch = decode_outputs(frames_of(vec))
    assert not batch.engine_dead
    assert batch.engine_index == expect["engine_index"]
    assert [d.rid for d in batch.deltas] == list(expect["requests"])
    for delta in batch.deltas:
        want = expect["requests"][delta.rid]
        assert delta.token_ids == want["new_token_ids"]
        assert delta.prompt_tokens == want["num_prompt_tokens"]
        assert delta.cached_tokens == want["num_cached_tokens"]
        finish, stop = want["finish_reason"], want["stop_reason"]
        if finish is None:
            assert delta.finish is None
        else:
            assert delta.finish is not None
            mapped = {"stop": "stop", "repetition": "stop"}.get(finish, finish)
            assert delta.finish.reason.value == mapped
            if finish == "stop":
                assert delta.finish.matched_token == (stop if isinstance(stop, int) else None)
                assert delta.finish.matched_text == (stop if isinstance(stop, str) else None)
        if "logprobs" in want:
            assert delta.logprobs is not None
            ids, vals = want["logprobs"]["token_ids"], want["logprobs"]["logprobs"]
            assert [r.token_id for r in delta.logprobs] == [row[0] for row in ids]
            assert [r.logprob for r in delta.logprobs] == [row[0] for row in vals]
            tops = [[(t.token_id, t.logprob) for t in r.top or []] for r in delta.logprobs]
            assert tops == [
                list(zip(i[1:], x[1:], strict=True)) for i, x in zip(ids, vals, strict=True)
            ]
        if "prompt_logprobs" in want:
            assert batch.prompt_logprobs is not None
            rows = batch.prompt_logprobs[delta.rid]
            assert [r.token_id for r in rows] == [
                r[0] for r in want["prompt_logprobs"]["token_ids"]
            ]
            assert [r.logprob for r in rows] == [r[0] for r in want["prompt_logprobs"]["logprobs"]]
            # the delta carries them too, with each row's top-K alternatives
            assert delta.prompt_logprobs == rows
            pids, pvals = want["prompt_logprobs"]["token_ids"], want["prompt_logprobs"]["logprobs"]
            assert [[(t.token_id, t.logprob) for t in r.top or ()] for r in rows] == [
                list(zip(i[1:], x[1:], strict=True)) for i, x in zip(pids, pvals, strict=True)
            ]
    if "load" in expect:
        assert batch.load is not None
        assert batch.load.running == expect["load"]["running"]
        assert batch.load.waiting == expect["load"]["waiting"]
        assert batch.load.kv_usage == expect["load"]["kv_usage"]
    else:
        assert batch.load is None
    if "utility" in expect:
        assert batch.utility is not None
        assert batch.utility.call_id == expect["utility"]["call_id"]
        assert batch.utility.failure_message == expect["utility"]["failure_message"]
        assert batch.utility.ok == (expect["utility"]["failure_message"] is None)
        assert batch.utility.result == expect["utility"]["result"]
    else:
        assert batch.utility is None
    finished = expect.get("finished_requests")
    assert (sorted(batch.finished_requests) if batch.finished_requests else None) == finished


def test_engine_core_dead_sentinel() -> None:
    batch = decode_outputs(named("out_engine_core_dead"))
    assert batch.engine_dead
    assert batch.deltas == []
    assert frames_to_json(named("out_engine_core_dead")) == {"type": "ENGINE_CORE_DEAD"}


def test_error_finish_is_an_engine_error() -> None:
    (delta,) = decode_outputs(named("out_finish_error")).deltas
    assert delta.finish is not None
    assert delta.finish.reason is FinishReason.ERROR
    assert delta.finish.status_code == 500


def test_repetition_is_reported_as_stop_with_the_reason() -> None:
    (delta,) = decode_outputs(named("out_finish_repetition")).deltas
    assert delta.finish is not None
    assert delta.finish.reason is FinishReason.STOP
    assert delta.finish.matched_text is None
    assert delta.finish.message == "repetition_detected"


def test_logprobs_are_sliced_to_each_requests_k() -> None:
    frames = named("out_logprobs_aux")
    assert len(frames) > 1  # the big arrays travel in aux frames
    want = BY_NAME["out_logprobs_aux"]["expect"]["requests"]
    batch = decode_outputs(frames, logprobs_k={"req-LP": 2, "req-LP20": 0})
    lp, lp20 = batch.deltas
    assert lp.logprobs is not None
    assert lp20.logprobs is not None
    ids = want["req-LP"]["logprobs"]["token_ids"][0]
    assert [t.token_id for t in lp.logprobs[0].top or []] == ids[1:3]
    assert all(r.top is None for r in lp20.logprobs)
    want20 = want["req-LP20"]["logprobs"]["token_ids"]
    assert [r.token_id for r in lp20.logprobs] == [row[0] for row in want20]
    assert len(lp20.logprobs) == len(want20) == 3


# -- requests -------------------------------------------------------------------------------


def test_encode_add_is_what_vllms_front_end_sends_for_greedy() -> None:
    req = GenerateRequest(
        rid="req-greedy",
        prompt_ids=[323, 607, 83, 338, 15, 743, 1373, 310],
        sampling=SamplingParams(max_tokens=16, temperature=0.0, eos_token_ids=(2,)),
    )
    assert encode_add(req, arrival_time=ARRIVAL) == named("in_add_greedy")


def _sampling_of(name: str) -> VllmSamplingParams:
    msg = decode_request(named(name))
    assert isinstance(msg, AddRequest)
    assert msg.request.sampling_params is not None
    return msg.request.sampling_params


ENGINE_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "_eos_token_id",
    "_all_stop_token_ids",
    "logit_bias",
)


def test_sampling_translation_matches_vllm_with_extra_eos_and_stop_ids() -> None:
    ours = to_vllm_sampling(
        SamplingParams(
            max_tokens=32,
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            seed=42,
            stop_token_ids=(7, 9, 7),
            presence_penalty=0.5,
            frequency_penalty=0.25,
            repetition_penalty=1.1,
            min_tokens=2,
            eos_token_ids=(2, 5),
        )
    )
    theirs = _sampling_of("in_add_sampled")
    for field in ENGINE_FIELDS:
        assert getattr(ours, field) == getattr(theirs, field), field
    assert theirs.stop == ["\n\n", "END"]
    assert ours.stop == []


def test_ignore_eos_leaves_the_eos_id_unset_like_vllm() -> None:
    ours = to_vllm_sampling(
        SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, eos_token_ids=(2,))
    )
    theirs = _sampling_of("in_add_tail_fields")
    for field in ENGINE_FIELDS:
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours._eos_token_id is None
    assert ours._all_stop_token_ids == [2]


def test_logprobs_request_translation() -> None:
    ours = to_vllm_sampling(
        SamplingParams(
            max_tokens=3, temperature=0.0, logprobs=5, prompt_logprobs=3, eos_token_ids=(2,)
        )
    )
    theirs = _sampling_of("in_add_logprobs")
    for field in (*ENGINE_FIELDS, "prompt_logprobs"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert theirs.prompt_logprobs == 3


def test_priority_goes_where_vllms_front_end_puts_it() -> None:
    theirs = decode_request(named("in_add_tail_fields"))
    assert isinstance(theirs, AddRequest)
    req = GenerateRequest(
        rid="r", prompt_ids=[1], sampling=SamplingParams(max_tokens=1), priority=-1
    )
    ours = decode_request(encode_add(req))
    assert isinstance(ours, AddRequest)
    assert ours.request.priority == theirs.request.priority == -1


SO_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "n": {"enum": [0, 1]}},
    "required": ["city", "n"],
}
TRICKY_CHOICES = ("yes", "no way", 'say "hi"\n', "tab\tback\\slash\x01")


@pytest.mark.parametrize(
    ("name", "rid", "structured", "backend", "extra"),
    [
        ("in_add_so_json_schema", "req-so-json",
         Structured(kind=StructuredKind.JSON, param="response_format", spec=SO_SCHEMA), "auto",
         {"temperature": 0.0}),
        ("in_add_so_json_object", "req-so-obj",
         Structured(kind=StructuredKind.JSON_OBJECT, param="response_format"), "auto", {}),
        ("in_add_so_regex", "req-so-re",
         Structured(kind=StructuredKind.REGEX, param="guided_regex", spec="[a-z]{1,5}"), "auto",
         {}),
        ("in_add_so_choice", "req-so-choice",
         Structured(kind=StructuredKind.CHOICE, param="guided_choice", choices=TRICKY_CHOICES),
         "auto", {}),
        ("in_add_so_grammar", "req-so-gram",
         Structured(kind=StructuredKind.GRAMMAR, param="structured_outputs.grammar",
                    spec='root ::= "a" | "b"'), "auto", {}),
        ("in_add_so_json_text_xgrammar", "req-so-text",
         Structured(kind=StructuredKind.JSON, param="structured_outputs.json",
                    spec='{"type": "string", "maxLength": 4}', disable_any_whitespace=True,
                    whitespace_pattern="[ ]?"), "xgrammar", {"seed": 7}),
    ],
)  # fmt: skip
def test_structured_outputs_are_what_vllms_front_end_sends(
    name: str, rid: str, structured: Structured, backend: str, extra: dict[str, Any]
) -> None:
    """Byte for byte what vLLM's front end sends after validating the constraint against the
    engine's backend: ``_backend`` set (the engine core builds that backend), ``auto`` marked
    as chosen automatically, a choice turned into its EBNF grammar for xgrammar."""
    sampling = SamplingParams(max_tokens=24, eos_token_ids=(2,), structured=structured, **extra)
    req = GenerateRequest(rid=rid, prompt_ids=[323, 607, 83, 338, 15, 743, 1373, 310],
                          sampling=sampling)  # fmt: skip
    assert encode_add(req, arrival_time=ARRIVAL, structured_backend=backend) == named(name)


def test_a_choice_stays_a_list_for_backends_that_take_one() -> None:
    choice = Structured(kind=StructuredKind.CHOICE, param="guided_choice", choices=("a", "b"))
    fields = structured_outputs(choice, "guidance")
    assert (fields["choice"], fields["grammar"]) == (["a", "b"], None)
    assert (fields["_backend"], fields["_backend_was_auto"]) == ("guidance", False)


def test_abort_utility_and_wave_frames_match_vllm() -> None:
    assert encode_abort(["req-1", "req-2"]) == named("in_abort")
    msg = decode_request(named("in_utility_reset_prefix_cache"))
    assert isinstance(msg, UtilityRequest)
    assert (msg.method, msg.args, msg.client_index) == ("reset_prefix_cache", [False, False], 0)
    assert encode_utility(msg.call_id, "reset_prefix_cache", (False, False)) == named(
        "in_utility_reset_prefix_cache"
    )
    assert encode_start_dp_wave(4, 1) == named("in_start_dp_wave")
    with pytest.raises(ValueError, match="non-empty"):
        encode_abort([])
    with pytest.raises(ValueError, match="non-empty"):
        encode_abort([""])
    with pytest.raises(ValueError, match="64-bit"):
        encode_utility(-1, "is_sleeping")


def test_request_always_has_all_22_fields() -> None:
    req = GenerateRequest(
        rid="r", prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=4, temperature=0.0)
    )
    body = msgspec.msgpack.decode(encode_add(req, client_index=1)[1])
    assert len(body) == 22
    assert body[11] == 1  # client_index picks outputs[1]


# -- handshake ------------------------------------------------------------------------------


def test_handshake_messages() -> None:
    hello = decode_handshake(named("hs_hello_local"))
    assert isinstance(hello, Hello)
    assert (hello.local, hello.headless) == (True, False)
    assert encode_hello() == named("hs_hello_local")
    ready = decode_handshake(named("hs_ready_dp"))
    assert isinstance(ready, Ready)
    assert ready.parallel_config_hash == "ab12cd"
    init = encode_init(
        ["ipc:///tmp/smgd/vllm-0-input.sock"], ["ipc:///tmp/smgd/vllm-0-output.sock"]
    )
    assert init == named("hs_init")
    assert decode_init(init).addresses.outputs == ["ipc:///tmp/smgd/vllm-0-output.sock"]
    with pytest.raises(WireError, match="status"):
        decode_handshake(
            [msgspec.msgpack.encode({"status": "BYE", "local": True, "headless": False})]
        )


def test_ready_response_gives_engine_info() -> None:
    resp = decode_ready_response(named("in_ready_response"))
    want = BY_NAME["in_ready_response"]["expect"]
    info = resp.engine_info(vocab_size=2048)
    assert info.max_model_len == want["max_model_len"]
    assert info.max_num_seqs == want["max_num_seqs"]
    assert info.kv_cache_tokens == want["kv_cache_size_tokens"]
    assert info.version == "0.32.0"


# -- mock-engine side -----------------------------------------------------------------------


def test_encode_outputs_moves_big_arrays_to_aux_frames_like_vllm() -> None:
    frames = named("out_logprobs_aux")
    outs = decode_engine_outputs(frames)

    def inline(t: Tensor) -> Tensor:
        return make_tensor(t.dtype, t.shape, tensor_values(t, frames))

    for o in outs.outputs:
        for lp in (o.new_logprobs, o.new_prompt_logprobs_tensors):
            if lp is not None:
                for name in lp.__struct_fields__:
                    value = getattr(lp, name)
                    if isinstance(value, Tensor):
                        setattr(lp, name, inline(value))
    assert encode_outputs(outs) == frames


def test_mock_builders_decode_back() -> None:
    outs = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput(
                "r1",
                [7],
                new_logprobs=logprobs_lists([[7, 8, 9]], [[-0.5, -1.0, -2.0]], [1]),
                finish_reason=VllmFinishReason.STOP,
                stop_reason=7,
                prefill_stats=PrefillStats(num_prompt_tokens=3, num_cached_tokens=1),
            )
        ],
        timestamp=1.5,
    )
    (delta,) = decode_outputs(encode_outputs(outs)).deltas
    assert delta.finish is not None
    assert delta.finish.matched_token == 7
    assert (delta.prompt_tokens, delta.cached_tokens) == (3, 1)
    assert delta.logprobs is not None
    assert [(t.token_id, t.logprob) for t in delta.logprobs[0].top or []] == [(8, -1.0), (9, -2.0)]


# -- version skew and garbage ---------------------------------------------------------------


def _with_body(frames: list[bytes], edit: Any) -> list[bytes]:
    body = msgspec.msgpack.decode(frames[0])
    edit(body)
    return [msgspec.msgpack.encode(body), *frames[1:]]


def test_extra_trailing_fields_are_tolerated_and_kept_in_json() -> None:
    error = {"code": "kv_load_failed", "message": "KV load failed", "retryable": True}

    def edit(body: list[Any]) -> None:
        body[1][0].append(error)  # vLLM 0.33's 19th EngineCoreOutput field
        body.append("future-field")  # a 10th EngineCoreOutputs field

    frames = _with_body(named("out_finish_error"), edit)
    (delta,) = decode_outputs(frames).deltas
    assert delta.finish is not None
    assert delta.finish.reason is FinishReason.ERROR
    assert delta.finish.message == "KV load failed"
    assert decode_engine_outputs(frames).outputs[0].request_id == "req-err"
    as_json = frames_to_json(frames)
    assert as_json["_extra"] == ["future-field"]
    assert as_json["outputs"][0]["_extra"] == [error]
    assert json_to_frames(json.loads(json.dumps(as_json))) == frames


def test_short_arrays_take_defaults_and_round_trip_in_json() -> None:
    req = [
        "req-min",
        [5, 6],
        None,
        {"temperature": 0.0, "max_tokens": 4},
        None,
        ARRIVAL,
        None,
        None,
        None,
    ]
    frames = [b"\x00", msgspec.msgpack.encode(req)]
    msg = decode_request(frames)
    assert isinstance(msg, AddRequest)
    assert msg.request.client_index == 0
    assert msg.request.session_id is None
    assert msg.request.sampling_params is not None
    assert msg.request.sampling_params.max_tokens == 4
    as_json = frames_to_json(frames)
    assert "client_index" not in as_json["request"]
    assert json_to_frames(as_json) == frames


def test_float32_and_wide_headers_survive_the_json_form() -> None:
    # A foreign encoder (e.g. rmp-serde) may write float32; msgspec writes map16 headers for
    # big omit_defaults structs even with few keys.
    frames = named("out_step_one_token")
    body = bytearray(frames[0])
    ts = body.index(b"\xcb")  # first float64 is the timestamp
    f32 = bytes([0xCA]) + bytes(4)
    patched = bytes(body[:ts]) + f32 + bytes(body[ts + 9 :])
    as_json = frames_to_json([patched])
    assert as_json["timestamp"] == {"f32": 0.0}
    assert json_to_frames(as_json) == [patched]
    add = named("in_add_greedy")
    assert add[1].find(b"\xde\x00") > 0  # the sampling map has a wide header
    assert frames_to_json(add)["request"]["sampling_params"]["__wide__"] == 16


def test_json_form_is_readable() -> None:
    add = frames_to_json(named("in_add_greedy"))
    assert add["type"] == "ADD"
    assert add["request"]["sampling_params"]["temperature"] == 0.0
    out = frames_to_json(named("out_logprobs_aux"))
    arr = out["outputs"][0]["new_prompt_logprobs_tensors"]["logprob_token_ids"]
    assert arr["dtype"] == "int32"
    assert arr["shape"] == [22, 21]
    assert arr["aux"] >= 1
    assert len(arr["data"]) == 22
    assert len(arr["data"][0]) == 21
    bias = frames_to_json(named("in_add_bias_extra"))["request"]["sampling_params"]
    assert bias["logit_bias"] == {"5": -100.0, "9": 2.5}
    embeds = frames_to_json(named("in_add_prompt_embeds_inline"))["request"]
    assert embeds["prompt_embeds"]["dtype"] == "bfloat16"
    assert embeds["prompt_embeds"]["data"] == [[1.0] * 4] * 2


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "empty"),
        ([b"\xc1"], "decode"),
        ([b"\x99\x00"], "decode"),
        ([b"\x93\x01\x02"], "decode"),
        ([b"ENGINE_CORE_DEAD", b"x"], "decode"),
    ],
)
def test_garbage_outputs_raise_wire_error(frames: list[bytes], match: str) -> None:
    with pytest.raises(WireError, match=match):
        decode_outputs(frames)


def test_garbage_elsewhere_raises_wire_error() -> None:
    with pytest.raises(WireError, match="type byte"):
        decode_request([b"\x09", b"\x90"])
    with pytest.raises(WireError, match="EngineCoreRequest"):
        decode_request([b"\x00", msgspec.msgpack.encode(["r", "not-a-list"])])
    with pytest.raises(WireError, match="one frame"):
        decode_ready_response([b"a", b"b"])
    with pytest.raises(WireError):
        frames_to_json([b"\xc1"])
    with pytest.raises(WireError, match="trailing"):
        frames_to_json([b"\x90\x90"])
    with pytest.raises(WireError, match="non-minimal"):
        frames_to_json([b"\x91\xcd\x00\x01"])
    with pytest.raises(WireError, match="type"):
        json_to_frames({"request": {}})
    with pytest.raises(WireError, match="unknown fields"):
        json_to_frames({"type": "START_DP_WAVE", "wave": 1, "bogus": 2})
    # an array pointing at an aux frame the message does not have
    frames = named("out_logprobs_aux")
    with pytest.raises(WireError, match="aux frame"):
        decode_outputs(frames[:1])
    with pytest.raises(WireError, match="aux frame"):
        frames_to_json(frames[:1])


def test_ragged_logprob_arrays_are_a_wire_error() -> None:
    lp = LogprobsLists(
        make_tensor("<i4", [1, 3], [[1, 2, 3]]),
        make_tensor("<f4", [1, 2], [[-1.0, -2.0]]),
        make_tensor("<i8", [1], [1]),
    )
    outs = EngineCoreOutputs(outputs=[EngineCoreOutput("r", [1], new_logprobs=lp)])
    with pytest.raises(WireError, match="same shape"):
        decode_outputs(encode_outputs(outs))


def test_array_helpers_round_trip_every_dtype() -> None:
    cases: list[tuple[str, list[Any]]] = [
        ("<i4", [[1, -2], [3, 4]]),
        ("<f4", [[0.5, -math.inf]]),
        ("<i8", [1 << 40]),
        ("float16", [1.5, -2.0]),
        ("bfloat16", [1.0, -3.5]),
        ("bool", [True, False]),
        ("uint8", [255, 0]),
    ]
    for dtype, values in cases:
        shape = [len(values), len(values[0])] if isinstance(values[0], list) else [len(values)]
        t = make_tensor(dtype, shape, values)
        assert tensor_values(t, [b""]) == values
    with pytest.raises(WireError, match="dtype"):
        tensor_values(Tensor("complex64", [1], msgspec.msgpack.Ext(3, b"\0" * 8)), [])


# -- frames captured from a live engine core (tests/real_engines/test_vllm_raw.py) -----------

LIVE = [v for v in VECTORS if v["source"] == "live"]


def test_live_captures_are_present() -> None:
    names = {v["name"] for v in LIVE}
    assert {"live_hello", "live_init", "live_ready", "live_ready_response"} <= names
    assert "live_engine_core_dead" in names
    assert any(len(v["frames_hex"]) > 1 for v in LIVE if v["socket"] == "output")  # aux frames


def test_live_finishes_translate_as_requested() -> None:
    # what test_vllm_raw asked the engine for: greedy to max_tokens, forced EOS, stop id 7
    def finish_of(name: str) -> Any:
        (delta,) = decode_outputs(named(name)).deltas
        return delta.finish

    assert finish_of("live_out_greedy-1_finish").reason is FinishReason.LENGTH
    eos = finish_of("live_out_eos_finish")
    assert eos.reason is FinishReason.STOP
    assert eos.matched_token is None  # EOS reports no matched stop token
    assert finish_of("live_out_stop-id_finish").matched_token == 7


def test_live_steps_carry_load_when_the_engine_logs_stats() -> None:
    steps = [
        decode_outputs(frames_of(v))
        for v in LIVE
        if v["socket"] == "output" and v["name"] != "live_engine_core_dead"
    ]
    token_steps = [b for b in steps if b.deltas]
    assert token_steps
    assert all(b.load is not None for b in token_steps)
    assert any(b.load is not None and b.load.running == 1 for b in token_steps)


def test_decode_outputs_accepts_zero_copy_memoryviews() -> None:
    frames = named("out_logprobs_aux")
    views = [memoryview(f) for f in frames]
    assert decode_outputs(views) == decode_outputs(frames)
    assert decode_outputs([memoryview(ENGINE_CORE_DEAD)]).engine_dead


def test_queue_time_is_the_first_queued_to_scheduled_gap() -> None:
    # make_vllm_vectors: QUEUED at TS - 0.01, SCHEDULED at TS - 0.005, on the first output
    queue_times = decode_outputs(named("out_first_prefill_events")).queue_times
    assert queue_times is not None and queue_times.keys() == {"req-A"}
    assert queue_times["req-A"] == pytest.approx(0.005)
    # a QUEUED event alone (no SCHEDULED yet) is no queue time
    assert decode_outputs(named("out_scheduler_stats")).queue_times is None
    assert decode_outputs(named("out_stats_only")).queue_times is None


def test_live_engine_reports_each_requests_queue_time_once() -> None:
    """The real engine (log_stats on) puts QUEUED and SCHEDULED on each request's first
    output: every request that produced tokens gets exactly one queue time."""
    produced: set[str] = set()
    times: dict[str, list[float]] = {}
    for v in LIVE:
        if v["socket"] != "output" or v["name"] == "live_engine_core_dead":
            continue
        batch = decode_outputs(frames_of(v))
        produced |= {d.rid for d in batch.deltas if d.token_ids}
        for rid, waited in (batch.queue_times or {}).items():
            times.setdefault(rid, []).append(waited)
    assert produced and set(times) == produced
    assert all(len(t) == 1 and 0 <= t[0] < 1 for t in times.values())
