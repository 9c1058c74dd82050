"""InlineHTTPConnection and read_body: the body before the handler, in the request's own task."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing
from quart import request
from quart_trio import QuartTrio

from smgd.api.http.asgi_connection import QUEUED_BODY_KEY, InlineHTTPConnection, read_body


def _scope(method: str = "POST", path: str = "/echo") -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"test")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "extensions": {},
    }


def _app() -> QuartTrio:
    app = QuartTrio("t")
    app.asgi_http_class = InlineHTTPConnection
    app.config["MAX_CONTENT_LENGTH"] = 64
    app.config["BODY_TIMEOUT"] = 5

    @app.post("/echo")
    async def echo() -> dict[str, Any]:
        queued: Any = request.scope.get(QUEUED_BODY_KEY)
        data = await request.get_data()
        return {
            "body": data.decode() if isinstance(data, bytes) else data,
            "queued": None if queued is None else queued.decode(),
            "task": id(trio.lowlevel.current_task()),
        }

    return app


def _request(app: QuartTrio, scope: dict[str, Any]) -> Any:
    return app.asgi_http_class(app, scope)  # type: ignore[arg-type]


def _queued(*messages: dict[str, Any]) -> tuple[trio.MemorySendChannel[Any], Any]:
    send, recv = trio.open_memory_channel[Any](16)
    for message in messages:
        send.send_nowait(message)
    return send, recv.receive


def _part(data: bytes, more: bool) -> dict[str, Any]:
    return {"type": "http.request", "body": data, "more_body": more}


async def test_a_queued_body_is_read_whole_without_a_scheduler_pass() -> None:
    app = _app()
    async with app.app_context():
        conn = _request(app, _scope())
        req = conn._create_request_from_scope(None)
        _, receive = _queued(
            _part(b'{"a":', True), _part(b" 1}", False), {"type": "http.disconnect"}
        )
        with trio.testing.assert_no_checkpoints():
            outcome = await read_body(req, receive, 64)
        assert outcome == "complete"
        assert req.scope[QUEUED_BODY_KEY] == b'{"a": 1}'
        assert await req.get_data() == b'{"a": 1}'
        # The disconnect after the body stays queued for the reader task.
        assert (await receive())["type"] == "http.disconnect"


async def test_a_body_still_arriving_is_awaited_through_any_receive() -> None:
    app = _app()
    parts = [_part(b"ab", True), _part(b"cd", False)]

    async def receive() -> dict[str, Any]:  # not a memory channel: every message awaited
        await trio.lowlevel.checkpoint()
        return parts.pop(0)

    async with app.app_context():
        req = _request(app, _scope())._create_request_from_scope(None)
        assert await read_body(req, receive, None) == "complete"
        assert req.scope[QUEUED_BODY_KEY] == b"abcd"


async def test_a_body_over_the_limit_stops_reading_and_is_not_kept() -> None:
    app = _app()
    async with app.app_context():
        req = _request(app, _scope())._create_request_from_scope(None)
        _, receive = _queued(_part(b"x" * 40, True), _part(b"y" * 40, True), _part(b"", False))
        assert await read_body(req, receive, 64) == "too_large"
        assert QUEUED_BODY_KEY not in req.scope
        # The last part is left for the reader task.
        assert (await receive())["more_body"] is False


async def test_a_disconnect_before_the_body_ends_is_reported() -> None:
    app = _app()
    async with app.app_context():
        req = _request(app, _scope())._create_request_from_scope(None)
        _, receive = _queued(_part(b"ab", True), {"type": "http.disconnect"})
        assert await read_body(req, receive, 64) == "disconnected"


async def _call(app: QuartTrio, scope: dict[str, Any], receive: Any) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)  # type: ignore[arg-type]
    return sent


def _json_body(sent: list[dict[str, Any]]) -> Any:
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return json.loads(body)


async def test_the_handler_runs_in_the_requests_own_task_with_the_body_kept() -> None:
    app = _app()
    async with app.test_app():  # lifespan: quart-trio's app nursery
        _, receive = _queued(_part(b"hello", False))
        caller = id(trio.lowlevel.current_task())
        sent = await _call(app, _scope(), receive)
    assert sent[0]["status"] == 200
    out = _json_body(sent)
    assert out == {"body": "hello", "queued": "hello", "task": caller}


async def test_a_stalled_body_gets_408_after_the_body_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = _app()
    send_part, receive = _queued(_part(b"hel", True))  # the rest never comes
    async with app.test_app():
        start = trio.current_time()
        sent = await _call(app, _scope(), receive)
        waited = trio.current_time() - start
    assert sent[0]["status"] == 408
    assert 5 <= waited < 6  # one BODY_TIMEOUT, not two
    send_part.close()


async def test_a_client_gone_before_the_body_ends_gets_no_handler() -> None:
    app = _app()
    calls: list[str] = []

    @app.before_request
    async def _seen() -> None:
        calls.append(request.path)

    _, receive = _queued(_part(b"he", True), {"type": "http.disconnect"})
    async with app.test_app():
        sent = await _call(app, _scope(), receive)
    assert sent == []
    assert calls == []


@pytest.mark.parametrize("size", [64, 65])
async def test_the_body_limit_is_quarts_413(size: int) -> None:
    app = _app()
    _, receive = _queued(_part(b"x" * size, False))
    async with app.test_app():
        sent = await _call(app, _scope(), receive)
    assert sent[0]["status"] == (200 if size <= 64 else 413)
