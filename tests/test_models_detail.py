"""GET /v1/models/{model} (OpenAI's models.retrieve): the card /v1/models lists, ids holding
"/" included; an unknown id, an unknown path and a wrong method each answer the error envelope.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import trio
from hypercorn.config import Config as HypercornConfig

from smgd.api.http import worker_loop
from smgd.api.http.app import create_app

from .asgi_client import lifespan, request
from .fake_engine import MODEL, FakeEngine, open_gateway

SLASHED = "org/tiny-v2"
RID = {"X-Request-Id": "r1"}


def _error(body: bytes) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def test_each_listed_card_is_retrieved_by_its_id() -> None:
    engine = FakeEngine(models=(MODEL, SLASHED))
    async with open_gateway(engine) as gateway:
        app = create_app(gateway, environ={})
        async with lifespan(app):
            listed = json.loads((await request(app, "GET", "/v1/models", b"", RID)).body)["data"]
            assert [card["id"] for card in listed] == [MODEL, SLASHED]
            for card in listed:
                answer = await request(app, "GET", f"/v1/models/{card['id']}", b"", RID)
                assert answer.status == 200
                assert json.loads(answer.body) == card
                assert card["max_model_len"] == engine.config.mock.max_model_len
            head = await request(app, "HEAD", f"/v1/models/{SLASHED}", b"", RID)
    assert head.status == 200


async def test_the_metrics_count_the_route_template_not_the_id() -> None:
    async with open_gateway(FakeEngine(models=(MODEL, SLASHED))) as gateway:
        app = create_app(gateway, environ={})
        async with lifespan(app):
            for model in (MODEL, SLASHED, "nope"):
                await request(app, "GET", f"/v1/models/{model}", b"", RID)
            text = (await request(app, "GET", "/metrics", b"", RID)).body.decode()
    samples = [line for line in text.splitlines() if line.startswith("smgd_http_requests_total{")]
    template = [line for line in samples if 'route="/v1/models/{model}"' in line]
    assert any('status="200"' in line and line.endswith(" 2.0") for line in template), samples
    assert any('status="404"' in line and line.endswith(" 1.0") for line in template), samples
    assert not [line for line in samples if SLASHED in line or "nope" in line]


@pytest.mark.parametrize("path", ["/v1/models/nope", "/v1/models/org/nope", "/v1/models/tiny/"])
async def test_an_unknown_model_is_404_model_not_found(path: str) -> None:
    async with open_gateway() as gateway:
        app = create_app(gateway, environ={})
        async with lifespan(app):
            answer = await request(app, "GET", path, b"", RID)
    assert answer.status == 404
    assert answer.header("content-type") == "application/json"
    model = path.removeprefix("/v1/models/")
    assert _error(answer.body) == {
        "message": f"The model `{model}` does not exist.",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }


async def test_the_model_route_needs_a_key_like_the_list() -> None:
    async with open_gateway() as gateway:
        app = create_app(gateway, environ={"KEYS": "k1"})
        app.ctx.api_keys = (b"k1",)
        async with lifespan(app):
            refused = await request(app, "GET", f"/v1/models/{MODEL}", b"", RID)
            allowed = await request(
                app, "GET", f"/v1/models/{MODEL}", b"", {**RID, "Authorization": "Bearer k1"}
            )
    assert refused.status == 401
    assert allowed.status == 200


@pytest.mark.parametrize(
    ("method", "path", "status", "message"),
    [
        ("GET", "/v1/nope", 404, "Invalid URL (GET /v1/nope)"),
        ("POST", "/nope", 404, "Invalid URL (POST /nope)"),
        ("GET", "/v1/models/", 404, "Invalid URL (GET /v1/models/)"),
        ("GET", "/v1/completions/", 404, "Invalid URL (GET /v1/completions/)"),
        ("GET", "/" + "a" * 300, 404, "Invalid URL (GET /" + "a" * 199 + "...)"),
        (
            "POST",
            "/v1/models/tiny",
            405,
            "Method POST is not allowed for /v1/models/tiny (it takes GET, HEAD, OPTIONS)",
        ),
        (
            "GET",
            "/v1/completions",
            405,
            "Method GET is not allowed for /v1/completions (it takes OPTIONS, POST)",
        ),
    ],
)
async def test_unknown_paths_and_methods_answer_the_envelope(
    method: str, path: str, status: int, message: str
) -> None:
    async with open_gateway() as gateway:
        app = create_app(gateway, environ={})
        async with lifespan(app):
            answer = await request(app, method, path, b"", RID)
    assert answer.status == status
    assert answer.header("content-type") == "application/json"
    error = _error(answer.body)
    assert error["message"] == message
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


# --------------------------------------------------------------------------- the OpenAI SDK


@pytest.fixture
async def base_url() -> AsyncIterator[str]:
    engine = FakeEngine(models=(MODEL, SLASHED))
    async with open_gateway(engine) as gateway, trio.open_nursery() as nursery:
        config = HypercornConfig()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        config.graceful_timeout = 1.0
        binds = await nursery.start(worker_loop.serve, create_app(gateway, environ={}), config)
        yield binds[0] + "/v1"
        nursery.cancel_scope.cancel()


async def test_the_openai_sdk_retrieves_models(base_url: str) -> None:
    def calls() -> tuple[list[Any], Any, Any, openai.NotFoundError]:
        with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            listed = list(client.models.list())
            plain = client.models.retrieve(MODEL)
            slashed = client.models.retrieve(SLASHED)
            with pytest.raises(openai.NotFoundError) as info:
                client.models.retrieve("nope")
            return listed, plain, slashed, info.value

    listed, plain, slashed, missing = await trio.to_thread.run_sync(calls)
    assert [m.id for m in listed] == [MODEL, SLASHED]
    assert plain.id == MODEL and plain.object == "model" and plain.owned_by == "smgd"
    assert slashed.id == SLASHED
    assert slashed.model_dump() == listed[1].model_dump()
    assert plain.model_extra is not None and plain.model_extra["max_model_len"] > 0
    assert missing.status_code == 404 and missing.code == "model_not_found"


# --------------------------------------------------------------------------- on the wire


async def _exchange(port: int, data: bytes) -> bytes:
    """Send ``data``; the answers, read to the (last) Content-Length, the connection's close,
    or 1 s of quiet."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        got = bytearray()
        with trio.move_on_after(1):
            while chunk := await stream.receive_some(65536):
                got += chunk
                head, sep, body = bytes(got).rpartition(b"\r\n\r\n")
                length = re.search(rb"content-length: (\d+)", head.rsplit(b"HTTP/1.1 ", 1)[-1])
                if sep and length and len(body) >= int(length.group(1)):
                    break
    return bytes(got)


@pytest.mark.parametrize(
    ("request_head", "status", "message"),
    [
        (b"GET * HTTP/1.1", 404, "Invalid URL (GET *)"),
        (b"OPTIONS * HTTP/1.1", 404, "Invalid URL (OPTIONS *)"),
        (b"GET /v1/models/org%2Fnope HTTP/1.1", 404, "The model `org/nope` does not exist."),
        (
            b"GET /health HTTP/1.1\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
            b"sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==",
            404,
            "Invalid URL (WebSocket /health): smgd serves no WebSocket endpoint",
        ),
        (b"GET /a b HTTP/1.1", 400, "malformed HTTP/1.1 request"),
    ],
)
async def test_what_the_server_answers_on_the_wire_is_the_envelope(
    base_url: str, request_head: bytes, status: int, message: str
) -> None:
    port = int(base_url.rsplit(":", 1)[1].split("/", 1)[0])
    got = await _exchange(port, request_head + b"\r\nhost: x\r\n\r\n")
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), got
    assert b"content-type: application/json" in head
    assert _error(body)["message"] == message


async def test_a_head_to_an_unknown_path_is_a_404_without_a_body(base_url: str) -> None:
    # A GET behind it on the same connection: its answer must follow the 404's head at once.
    port = int(base_url.rsplit(":", 1)[1].split("/", 1)[0])
    got = await _exchange(
        port, b"HEAD /nope HTTP/1.1\r\nhost: x\r\n\r\nGET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    )
    head, _, rest = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404 ")
    assert rest.startswith(b"HTTP/1.1 200 "), got
