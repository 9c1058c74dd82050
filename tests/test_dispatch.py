"""The one request envelope (smgd.api.http.dispatch): body reading, the app's lifespan, and
disconnects on smgd's worker loop. What each route answers is pinned in test_http_answers.py."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from smgd.api.core.prepare import Reply, json_reply
from smgd.api.http.app import create_app
from smgd.api.http.dispatch import BODY_TIMEOUT_S, HEAD_HOLD_S, Route, origin_path, read_body
from smgd.config import ServerConfig

from .asgi_client import connect, http_scope, lifespan, request
from .fake_engine import MODEL, Behaviour, FakeEngine, open_app, open_gateway
from .http_helpers import dechunk, post_bytes
from .test_direct import serving

Message = dict[str, Any]

RID = {"X-Request-Id": "rid-1"}
STREAM = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "stream": True}


async def test_a_body_in_several_messages_is_read_whole() -> None:
    async with open_gateway() as gateway:
        app = create_app(gateway, environ={})
        body = json.dumps({**STREAM, "stream": False, "prompt": "Hello " * 300}).encode()
        async with lifespan(app):
            whole = await request(app, "POST", "/v1/completions", body, RID)
            split = await request(app, "POST", "/v1/completions", body, RID, parts=7)
        assert whole.status == 200
        assert json.loads(split.body)["choices"] == json.loads(whole.body)["choices"]


# --------------------------------------------------------------------------- read_body


def _queue(*messages: Message) -> Any:
    send, receive = trio.open_memory_channel[Message](math.inf)
    for message in messages:
        send.send_nowait(message)
    return send, receive.receive


def _part(body: bytes, more: bool) -> Message:
    return {"type": "http.request", "body": body, "more_body": more}


async def test_read_body_takes_a_queued_body_without_a_checkpoint() -> None:
    _send, receive = _queue(_part(b'{"a": 1}', False))
    with trio.CancelScope() as scope:
        scope.cancel()  # any checkpoint in read_body would raise Cancelled here
        assert await read_body(receive, 100, 60) == ("complete", b'{"a": 1}')


async def test_read_body_joins_queued_parts_without_a_checkpoint_and_leaves_the_rest() -> None:
    # hypercorn queues a body as its data, then an empty end message.
    _send, receive = _queue(
        _part(b"ab", True), _part(b"cd", True), _part(b"", False), {"type": "http.disconnect"}
    )
    with trio.CancelScope() as scope:
        scope.cancel()
        assert await read_body(receive, 100, 60) == ("complete", b"abcd")
    assert (await receive())["type"] == "http.disconnect"


async def test_read_body_waits_for_a_body_still_on_its_way(
    autojump_clock: trio.abc.Clock,
) -> None:
    send, receive = _queue(_part(b"ab", True))

    async def rest() -> None:
        await trio.sleep(5)
        send.send_nowait(_part(b"cd", False))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(rest)
        assert await read_body(receive, 100, 60) == ("complete", b"abcd")
    assert trio.current_time() == pytest.approx(5)


@pytest.mark.parametrize(
    ("messages", "outcome"),
    [
        ([_part(b"x" * 11, False)], "too_large"),
        ([_part(b"x" * 6, True), _part(b"x" * 6, False)], "too_large"),
        ([_part(b"x" * 10, False)], "complete"),
        ([_part(b"abc", True), {"type": "http.disconnect"}], "disconnected"),
        ([{"type": "http.disconnect"}], "disconnected"),
    ],
)
async def test_read_body_outcomes(messages: list[Message], outcome: str) -> None:
    _send, receive = _queue(*messages)
    assert (await read_body(receive, 10, 60))[0] == outcome


async def test_a_stalled_body_times_out_after_the_body_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    _send, receive = _queue(_part(b'{"a":', True))
    start = trio.current_time()
    assert await read_body(receive, 100, 60) == ("timeout", b"")
    assert trio.current_time() - start == pytest.approx(60)


async def test_a_stalled_body_gets_408_through_the_app(autojump_clock: trio.abc.Clock) -> None:
    async with open_gateway() as gateway:
        app = create_app(gateway, environ={})
        async with lifespan(app):
            start = trio.current_time()
            async with connect(app, http_scope("POST", "/v1/completions", RID)) as conn:
                conn.send(b'{"model":', more=True)  # the rest never comes
                body = await conn.read_all()
        assert trio.current_time() - start == pytest.approx(BODY_TIMEOUT_S)
        assert conn.status == 408
        assert json.loads(body)["error"]["code"] is None
        assert dict(conn.headers)["x-request-id"] == "rid-1"


async def test_the_body_limit_applies_to_every_route_after_routing() -> None:
    async with open_gateway(server=ServerConfig(max_body_bytes=100)) as gateway:
        app = create_app(gateway, environ={})
        async with lifespan(app):
            big = b"x" * 101
            health = await request(app, "GET", "/health", big, RID)
            unknown = await request(app, "GET", "/nope", big, RID)
            at_limit = await request(app, "GET", "/health", big[:100], RID)
    assert health.status == 413
    assert json.loads(health.body)["error"]["message"] == (
        "the request body is larger than 100 bytes"
    )
    assert unknown.status == 404  # an unknown path says so, whatever its body
    assert at_limit.status == 200


async def test_a_client_gone_before_its_body_ends_gets_no_answer_and_no_handler() -> None:
    calls: list[str] = []

    async def handler(call: Any) -> Reply:
        calls.append(call.request_id)
        return json_reply({})

    async with open_gateway() as gateway:
        app = create_app(gateway, environ={})
        app.routes = {"/x": Route("POST", handler)}
        async with lifespan(app):
            async with connect(app, http_scope("POST", "/x", RID)) as conn:
                conn.send(b"he", more=True)
                conn.disconnect()
                assert await conn.read_all() == b""
            assert conn.status is None
            assert (await request(app, "POST", "/x", b"{}", RID)).status == 200
    assert calls == ["rid-1"]  # the second request only


async def test_a_client_gone_before_its_answer_is_logged_and_counted_as_499(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A route with no log line of its own (not a generation): the dispatcher writes one, for
    # a client gone before its body ended and for one gone while its handler ran, and counts
    # each as nginx's 499.
    caplog.set_level(logging.INFO, logger="smgd.api")
    running = trio.Event()

    async def handler(call: Any) -> Reply:
        running.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async with open_gateway() as gateway:
        app = create_app(gateway, environ={})
        app.routes = {**app.routes, "/x": Route("POST", handler)}
        async with lifespan(app):
            async with connect(app, http_scope("POST", "/x", RID)) as conn:
                conn.send(b"he", more=True)
                conn.disconnect()
                assert await conn.read_all() == b""
            async with connect(app, http_scope("POST", "/x", RID)) as conn:
                conn.send(b"{}")
                await running.wait()
                conn.disconnect()
                assert await conn.read_all() == b""
            metrics = (await request(app, "GET", "/metrics", b"", RID)).body.decode()
    lines = [r.getMessage() for r in caplog.records if "client disconnected" in r.getMessage()]
    assert lines == [
        "- POST /x: client disconnected before its request body ended (499)",
        "rid-1 POST /x: client disconnected before its response (499)",
    ]
    assert 'smgd_http_requests_total{method="POST",route="/x",status="499"} 2.0' in metrics


async def test_the_lifespan_runs_the_background_tasks_and_the_app_nursery() -> None:
    async with open_gateway() as gateway:
        app = create_app(gateway, environ={})
        pacer = app.ctx.pacer
        assert pacer is not None
        assert app.nursery is None
        async with lifespan(app):
            await trio.testing.wait_all_tasks_blocked()
            assert pacer.ticking  # the pacer task runs
            assert app.nursery is not None
        assert not pacer.ticking  # and stops with the app
        assert app.nursery is None


async def test_a_streamed_request_tells_the_pacer_that_load_arrives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with open_gateway() as gateway:
        app = create_app(gateway, environ={})
        pacer = app.ctx.pacer
        assert pacer is not None
        calls: list[str] = []
        monkeypatch.setattr(pacer, "expect_load", lambda: calls.append("load"))
        async with lifespan(app):
            body = json.dumps({**STREAM, "stream": False}).encode()
            assert (await request(app, "POST", "/v1/completions", body, RID)).status == 200
            assert calls == []  # a whole answer holds no stream back: nothing to pace
            body = json.dumps(STREAM).encode()
            assert (await request(app, "POST", "/v1/completions", body, RID)).status == 200
            assert calls == ["load"]


async def test_the_pacer_is_idle_exactly_while_no_request_is_in_flight() -> None:
    # A slow first token keeps the request in flight long enough to look at.
    engine = FakeEngine(behaviour=Behaviour(first_step_s=0.5))
    async with open_gateway(engine) as gateway:
        app = create_app(gateway, environ={})
        pacer = app.ctx.pacer
        assert pacer is not None
        async with lifespan(app), trio.open_nursery() as nursery:
            assert pacer.idle
            answered = trio.Event()

            async def ask() -> None:
                body = json.dumps(STREAM).encode()
                assert (await request(app, "POST", "/v1/completions", body, RID)).status == 200
                answered.set()

            nursery.start_soon(ask)
            with trio.fail_after(5):
                while engine.in_flight == 0:  # noqa: ASYNC110 - the engine's own counter
                    await trio.sleep(0.01)
            assert not pacer.idle
            with trio.fail_after(5):
                await answered.wait()
            assert pacer.idle


async def test_a_handler_error_that_is_not_smgds_is_a_500_and_the_app_keeps_serving() -> None:
    async def broken(call: Any) -> Reply:
        raise KeyError("x")

    async with open_gateway() as gateway:
        app = create_app(gateway, environ={})
        app.routes = {**app.routes, "/broken": Route("GET", broken)}
        async with lifespan(app):
            answer = await request(app, "GET", "/broken", b"", RID)
            assert (await request(app, "GET", "/health")).status == 200
    assert answer.status == 500
    assert json.loads(answer.body)["error"] == {
        "message": "internal error: KeyError",
        "type": "internal_error",
        "param": None,
        "code": None,
    }


async def test_a_websocket_is_refused() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "websocket.connect"}

    async with open_gateway() as gateway:
        app = create_app(gateway, environ={})
        scope = {"type": "websocket", "path": "/v1/completions"}
        await app(scope, receive, send)  # type: ignore[arg-type]
    assert [m["type"] for m in sent] == ["websocket.close"]


# --------------------------------------------------------------------------- worker loop


async def test_a_client_gone_before_its_first_token_aborts_the_engine_at_once() -> None:
    """On smgd's worker loop no task watches the request's messages: the connection's read
    loop cancels the request when the client hangs up (a 30 s prefill is not waited out)."""
    fake = FakeEngine(behaviour=Behaviour(first_step_s=30))
    async with serving(fake) as port:
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", port))
        stream = trio.SocketStream(sock)
        await stream.send_all(post_bytes("/v1/completions", STREAM))
        with trio.fail_after(5):
            head = await stream.receive_some(65536)
        assert head.startswith(b"HTTP/1.1 200")  # the head goes out before the first token
        await trio.testing.wait_all_tasks_blocked()  # the engine sender has sent the request
        [req] = fake.requests
        await stream.aclose()
        hung_up = trio.current_time()
        with trio.fail_after(5):
            await fake.wait_abort(req.rid)
        assert fake.abort_times[req.rid] - hung_up < 1.0
        assert fake.in_flight == 0


async def test_a_connection_serves_requests_one_after_another() -> None:
    """The disconnect callback belongs to one request at a time: after a finished request a
    second one on the same connection is served, then a hang-up aborts only that one."""
    fake = FakeEngine(behaviour=Behaviour(step_s=0.001))
    async with serving(fake) as port:
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", port))
        stream = trio.SocketStream(sock)
        with trio.fail_after(5):
            await stream.send_all(post_bytes("/v1/completions", STREAM))
            data = b""
            while not data.endswith(b"\r\n0\r\n\r\n"):
                data += await stream.receive_some(65536)
            fake.behaviour = Behaviour(first_step_s=30)
            await stream.send_all(post_bytes("/v1/completions", STREAM))
            assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200")
        await trio.testing.wait_all_tasks_blocked()
        await stream.aclose()
        first, second = fake.requests
        with trio.fail_after(5):
            await fake.wait_abort(second.rid)
        assert first.rid not in fake.aborts


# --------------------------------------------------------------------------- absolute form


async def _exchange(port: int, request: bytes) -> tuple[int, bytes]:
    """One request on a new connection: the response's status and whole body."""
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(request)
        data = b""
        with trio.fail_after(5):
            while b"\r\n\r\n" not in data:
                data += await stream.receive_some(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length: *(\d+)", head)
            assert length is not None, head
            while len(body) < int(length.group(1)):
                body += await stream.receive_some(65536)
    return int(head.split(b" ", 2)[1]), body


def _get_bytes(target: str, headers: str = "") -> bytes:
    return f"GET {target} HTTP/1.1\r\nhost: x\r\n{headers}\r\n".encode()


async def test_an_absolute_form_target_is_routed_by_its_path() -> None:
    """RFC 9112 §3.2.2: a server accepts ``GET http://host/path`` (what a client talking to
    smgd as a proxy sends); hypercorn hands the whole URL on as the ASGI path."""
    async with serving(FakeEngine()) as port:
        origin = f"http://127.0.0.1:{port}"
        listed = await _exchange(port, _get_bytes(origin + "/v1/models"))
        upper = await _exchange(port, _get_bytes(f"HTTPS://example.com/v1/models/{MODEL}"))
        whole = {**STREAM, "stream": False}
        posted = await _exchange(port, post_bytes(origin + "/v1/completions", whole))
        unknown = await _exchange(port, _get_bytes(origin + "/nope"))
        bare = await _exchange(port, _get_bytes(origin))
    assert listed[0] == 200
    assert [m["id"] for m in json.loads(listed[1])["data"]] == [MODEL]
    assert upper[0] == 200 and json.loads(upper[1])["id"] == MODEL
    assert posted[0] == 200 and json.loads(posted[1])["object"] == "text_completion"
    # what does not route is quoted by its path, as an origin-form target is
    assert unknown[0] == 404
    assert json.loads(unknown[1])["error"]["message"] == "Invalid URL (GET /nope)"
    assert bare[0] == 404
    assert json.loads(bare[1])["error"]["message"] == "Invalid URL (GET /)"


async def test_an_absolute_form_target_needs_the_key_its_path_needs(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    async with serving(FakeEngine(), server=ServerConfig(api_keys_file=str(keys))) as port:
        target = f"http://127.0.0.1:{port}/v1/models"
        without = await _exchange(port, _get_bytes(target))
        wrong = await _exchange(port, _get_bytes(target, "authorization: Bearer k2\r\n"))
        right = await _exchange(port, _get_bytes(target, "authorization: Bearer k1\r\n"))
    assert (without[0], wrong[0], right[0]) == (401, 401, 200)


@pytest.mark.parametrize(
    ("target", "path"),
    [
        ("http://127.0.0.1:8080/v1/models", "/v1/models"),
        ("Http://[::1]:8080/v1/models/org/m", "/v1/models/org/m"),
        ("https://example.com", "/"),
        ("/v1/models", "/v1/models"),
        ("*", "*"),
        ("ftp://example.com/v1/models", "ftp://example.com/v1/models"),
        ("http:/v1/models", "http:/v1/models"),
    ],
)
def test_origin_path_reduces_only_http_absolute_form(target: str, path: str) -> None:
    assert origin_path(target) == path


@pytest.mark.parametrize(("first_s", "head_s"), [(0.25, 0.25), (3.0, HEAD_HOLD_S)])
async def test_a_streamed_head_waits_for_the_first_event_for_at_most_the_hold(
    autojump_clock: trio.abc.Clock, first_s: float, head_s: float
) -> None:
    """Under a server that writes a head once given it (here the tests' client), the
    dispatcher holds a stream's head for its first event, or HEAD_HOLD_S at the most."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}
    payload = json.dumps(body).encode()
    async with open_app(FakeEngine(behaviour=Behaviour(first_step_s=first_s))) as (app, _):
        began = trio.current_time()
        async with connect(app, http_scope("POST", "/v1/completions", length=len(payload))) as conn:
            conn.send(payload)
            first = await conn.receive()
            first_at = trio.current_time() - began
            rest = await conn.read_all()
    assert conn.status == 200 and conn.started_at is not None
    assert conn.started_at - began == pytest.approx(head_s)
    assert first_at == pytest.approx(first_s)
    assert first.startswith(b"data: {") and rest.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize(("first_s", "head_s"), [(0.25, 0.25), (3.0, HEAD_HOLD_S)])
async def test_a_streamed_head_h11_writes_waits_for_the_first_direct_event_at_most_the_hold(
    socket_autojump_clock: trio.testing.MockClock, first_s: float, head_s: float
) -> None:
    """On hypercorn's HTTP/1.1 path (here a chunked request body) h11 writes a head as soon
    as it is given one, and the engine's reader writes the events itself: the dispatcher
    holds the head for the first event, or HEAD_HOLD_S at the most, and the writer waits."""
    payload = json.dumps(STREAM).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)
    )
    fake = FakeEngine(behaviour=Behaviour(first_step_s=first_s, step_s=0.01))
    async with serving(fake) as port, await trio.open_tcp_stream("127.0.0.1", port) as stream:
        began = trio.current_time()
        await stream.send_all(request)
        data = bytearray()
        head_at = None
        while not data.endswith(b"\r\n0\r\n\r\n"):
            data += await stream.receive_some(65536)
            if head_at is None:
                head_at = trio.current_time() - began
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert head_at == pytest.approx(head_s, abs=0.05)
    assert dechunk(body).endswith(b"data: [DONE]\n\n")
