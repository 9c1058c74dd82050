"""Errors: the OpenAI envelope with the right status and `param`; auth; limits; request ids."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from smgd.api.core.prepare import MAX_JSON_DEPTH, decode_body
from smgd.config import ServerConfig
from smgd.errors import InvalidRequest
from smgd.sampling import nested_deeper
from tests.fake_engine import MODEL, FakeEngine, get, open_app, post

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def assert_envelope(body: dict[str, Any], *, param: str | None, kind: str) -> None:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["type"] == kind
    assert error["param"] == param
    # OpenAI's convention: a string naming the error, or null; never the HTTP status.
    assert error["code"] is None or isinstance(error["code"], str)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", {**CHAT, "temperature": 5}, 400, "temperature"),
        ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p"),
        ("/v1/chat/completions", {**CHAT, "n": 99}, 400, "n"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 10**6}, 400, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "stream": "yes"}, 400, "stream"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, 400,
         "response_format.json_schema"),
        ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, 400,
         "stream_options"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": None}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": 5}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": True}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": {"role": "user"}}, 400,
         "messages"),
        ("/v1/tokenize", {"model": MODEL, "messages": None}, 400, "messages"),
        ("/v1/tokenize", {"model": MODEL, "messages": 1.5}, 400, "messages"),
        ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
        ("/v1/completions", {"model": MODEL, "prompt": [5000]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [5, True]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [5, 6.0]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [[5], [False]]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [[5], []]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [5, "x"]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 3}, 400, "best_of"),
        ("/v1/completions", {"model": MODEL, "prompt": "x" * 30000}, 400, "prompt"),
        ("/generate", {"text": ["a", "b"]}, 400, "text"),
        ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 0}}, 400,
         "sampling_params.max_new_tokens"),
        ("/generate", {"text": "a", "logprob_start_len": 3}, 400, "logprob_start_len"),
        ("/generate", {"text": "a", "sampling_params": {"regex": "a+"}}, 400,
         "sampling_params.regex"),
    ],
)  # fmt: skip
async def test_bad_request_names_param(
    autojump_clock: trio.abc.Clock, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    fake = FakeEngine()
    async with open_app(fake) as (app, _):
        reply = await post(app, path, body)
    assert reply.status == status, reply.body
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    assert_envelope(reply.json(), param=param, kind=kind)
    assert fake.requests == []  # no bad input reaches an engine


async def test_context_length_code(autojump_clock: trio.abc.Clock) -> None:
    async with open_app(FakeEngine(max_model_len=64)) as (app, _):
        reply = await post(
            app, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 100}
        )
    assert reply.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b""])
async def test_invalid_json_is_400(autojump_clock: trio.abc.Clock, body: bytes) -> None:
    async with open_app(FakeEngine()) as (app, _):
        reply = await post(app, "/v1/chat/completions", body)
    assert reply.status == 400
    assert_envelope(reply.json(), param=None, kind="invalid_request_error")


# The reproduction of issue 18: 1000 levels of arrays under an ignored key.
NESTED = b'{"model": "tiny", "prompt": "hi", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"


@pytest.mark.parametrize(
    "path",
    [
        "/v1/completions",
        "/v1/chat/completions",
        "/generate",
        "/v1/tokenize",
        "/tokenize",
        "/v1/detokenize",
        "/detokenize",
    ],
)
async def test_deeply_nested_json_is_400_on_every_json_route(
    autojump_clock: trio.abc.Clock, path: str
) -> None:
    async with open_app(FakeEngine()) as (app, _):
        reply = await post(app, path, NESTED)
    assert reply.status == 400, reply.body
    assert_envelope(reply.json(), param=None, kind="invalid_request_error")
    assert "nested too deeply" in reply.json()["error"]["message"]


def _nested(levels: int, open_: str = "[", close: str = "]") -> bytes:
    """A body whose ``x`` holds ``levels`` nested arrays (the body itself is one more level)."""
    return ('{"x":' + open_ * levels + close * levels + "}").encode()


@pytest.mark.parametrize(("open_", "close"), [("[", "]"), ('{"a":', "}")])
def test_json_nested_past_the_limit_is_refused_on_every_python(open_: str, close: str) -> None:
    # At the limit: decoded. One level more: refused, whatever the interpreter's recursion
    # guard would allow (3.12 decodes a 1,000-deep body; 3.11 raises RecursionError).
    inner = MAX_JSON_DEPTH - 1  # the body's own object is the first level
    if open_ == "[":
        assert decode_body(_nested(inner))["x"] is not None
        too_deep = _nested(inner + 1)
    else:
        text = '{"x":' + open_ * inner + "1" + close * inner + "}"
        assert decode_body(text.encode())["x"] is not None
        too_deep = ('{"x":' + open_ * (inner + 1) + "1" + close * (inner + 1) + "}").encode()
    with pytest.raises(InvalidRequest, match="nested too deeply") as info:
        decode_body(too_deep)
    assert info.value.param is None


def test_nested_deeper_counts_levels_of_arrays_and_objects() -> None:
    # object > array > object > array: four levels
    assert not nested_deeper({"a": [1, {"b": []}]}, 4)
    assert nested_deeper({"a": [1, {"b": []}]}, 3)
    assert not nested_deeper({"a": "[[[[", "b": 1}, 1)  # brackets inside strings are text
    assert nested_deeper([[[]]], 2) and not nested_deeper([[[]]], 3)


async def test_body_too_large_is_413(autojump_clock: trio.abc.Clock) -> None:
    async with open_app(FakeEngine(), server=ServerConfig(max_body_bytes=1000)) as (app, _):
        reply = await post(app, "/v1/completions", {"model": MODEL, "prompt": "x" * 2000})
    assert reply.status == 413
    assert "1000 bytes" in reply.json()["error"]["message"]


async def test_unknown_route_is_enveloped_404(autojump_clock: trio.abc.Clock) -> None:
    async with open_app(FakeEngine()) as (app, _):
        reply = await get(app, "/v1/nope")
    assert reply.status == 404
    assert reply.json()["error"]["type"] == "not_found_error"


async def test_request_id_echoed_and_engine_rid_unique(autojump_clock: trio.abc.Clock) -> None:
    fake = FakeEngine()
    headers = {"X-Request-Id": "client-id-1"}
    async with open_app(fake) as (app, _):
        first = await post(app, "/v1/chat/completions", {**CHAT, "max_tokens": 1}, headers)
        second = await post(app, "/v1/chat/completions", {**CHAT, "max_tokens": 1}, headers)
    assert first.headers["x-request-id"] == second.headers["x-request-id"] == "client-id-1"
    assert first.json()["id"] == "chatcmpl-client-id-1"
    rids = [r.rid for r in fake.requests]
    assert len(set(rids)) == 2
    assert all(len(r) == 32 and int(r, 16) >= 0 for r in rids)  # fixed-length hex


async def test_request_id_minted_when_absent(autojump_clock: trio.abc.Clock) -> None:
    async with open_app(FakeEngine()) as (app, _):
        a = await post(app, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        b = await post(app, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert a.headers["x-request-id"] != b.headers["x-request-id"]
    assert a.json()["id"] == "cmpl-" + a.headers["x-request-id"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/tokenize"])
async def test_a_merged_request_id_header_uses_its_first_value(
    autojump_clock: trio.abc.Clock, path: str
) -> None:
    headers = {"X-Request-Id": "client-a, proxy-b"}  # how proxies merge a repeated header
    async with open_app(FakeEngine()) as (app, _):
        reply = await post(app, path, {**CHAT, "max_tokens": 1}, headers)
    assert reply.status == 200, reply.body
    assert reply.headers["x-request-id"] == "client-a"


@pytest.mark.parametrize("bad", ["x" * 129, "has space", "semi;colon", ", second"])
async def test_bad_request_id_header_is_400(autojump_clock: trio.abc.Clock, bad: str) -> None:
    fake = FakeEngine()
    async with open_app(fake) as (app, _):
        reply = await post(app, "/v1/completions", {"model": MODEL, "prompt": "x"},
                           {"X-Request-Id": bad})  # fmt: skip
    assert reply.status == 400
    assert reply.json()["error"]["param"] == "X-Request-Id"
    assert reply.headers["x-request-id"] != bad
    assert fake.requests == []


async def test_api_keys_guard_inference_only(autojump_clock: trio.abc.Clock) -> None:
    server = ServerConfig(api_keys_env="SMGD_TEST_KEYS")
    env = {"SMGD_TEST_KEYS": "k1, k2"}
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    async with open_app(FakeEngine(), server=server, environ=env) as (app, _):
        missing = await post(app, "/v1/completions", body)
        wrong = await post(app, "/v1/completions", body, {"Authorization": "Bearer k3"})
        ok = await post(app, "/v1/completions", body, {"Authorization": "Bearer k2"})
        models = await get(app, "/v1/models")
        health = await get(app, "/health")
    for reply in (missing, wrong, models):
        assert reply.status == 401
        assert_envelope(reply.json(), param=None, kind="authentication_error")
    assert ok.status == 200
    assert health.status == 200


async def test_api_keys_file(autojump_clock: trio.abc.Clock, tmp_path: Any) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# comment\nfilekey\n\n")
    server = ServerConfig(api_keys_file=str(keys))
    async with open_app(FakeEngine(), server=server) as (app, _):
        ok = await get(app, "/v1/models", {"Authorization": "Bearer filekey"})
        bad = await get(app, "/v1/models", {"Authorization": "Bearer # comment"})
    assert (ok.status, bad.status) == (200, 401)


async def test_draining_rejects_with_503(autojump_clock: trio.abc.Clock) -> None:
    fake = FakeEngine()
    async with open_app(fake) as (app, gateway):
        gateway.draining = True
        reply = await post(app, "/v1/completions", {"model": MODEL, "prompt": "x"})
        ready = await get(app, "/readiness")
        models = await get(app, "/v1/models")
    assert reply.status == 503
    assert reply.headers["retry-after"] == "5"
    assert ready.status == 503
    assert ready.json()["status"] == "draining"
    assert models.status == 200
    assert fake.requests == []
