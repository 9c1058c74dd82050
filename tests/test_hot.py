"""The generation routes served without Quart (smgd.api.http.dispatch): same answers, fewer
layers."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
import trio
import trio.testing
from quart import request

from smgd.api.http.app import create_app
from smgd.api.http.dispatch import HOT_ROUTES, SmgdApp, read_body
from smgd.config import ServerConfig
from smgd.metrics import REGISTRY_KEY

from .fake_engine import MODEL, Behaviour, FakeEngine, open_gateway
from .test_direct import _post_bytes, serving

Message = dict[str, Any]


class Answer:
    """One ASGI response, collected from its messages."""

    def __init__(self, messages: list[Message]) -> None:
        starts = [m for m in messages if m["type"] == "http.response.start"]
        assert len(starts) == 1, messages
        self.status: int = starts[0]["status"]
        self.headers = {k.decode(): v.decode() for k, v in starts[0]["headers"]}
        bodies = [m for m in messages if m["type"] == "http.response.body"]
        assert bodies, "the response has no body message"
        assert bodies[-1].get("more_body", False) is False, "the body never ended"
        self.body = b"".join(m.get("body", b"") for m in bodies)


def _scope(path: str, headers: dict[str, str], length: int) -> dict[str, Any]:
    raw = [(b"host", b"x"), (b"content-type", b"application/json")]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    raw.append((b"content-length", str(length).encode()))
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": raw,
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8080),
        "extensions": {},
    }


async def asgi_post(
    app: Any,
    path: str,
    body: bytes,
    headers: dict[str, str] | None = None,
    *,
    parts: int = 1,
) -> Answer:
    """POST ``body`` to the ASGI callable ``app``, in ``parts`` body messages; the answer."""
    send_in, receive_from = trio.open_memory_channel[Message](math.inf)
    step = max(1, math.ceil(len(body) / parts))
    pieces = [body[i : i + step] for i in range(0, len(body), step)] or [b""]
    for i, piece in enumerate(pieces):
        send_in.send_nowait(
            {"type": "http.request", "body": piece, "more_body": i < len(pieces) - 1}
        )
    messages: list[Message] = []

    async def send(message: Message) -> None:
        messages.append(message)

    await app(_scope(path, headers or {}, len(body)), receive_from.receive, send)
    return Answer(messages)


def _normalized(answer: Answer) -> tuple[int, dict[str, str], Any]:
    """Status, headers and body with what differs between any two calls (the unix second in
    `created`, /generate's latency, a minted request id) replaced. The events of an n > 1
    stream interleave (and merge) as the engine's steps fall, so there each choice's events
    are compared in turn."""
    text = re.sub(rb'"created":\d+', b'"created":0', answer.body)
    text = re.sub(rb'"(e2e_latency)":[0-9.e-]+', rb'"\1":0', text)
    headers = dict(answer.headers)
    if "content-length" in headers:
        assert int(headers.pop("content-length")) == len(answer.body)
    if re.fullmatch(r"[0-9a-f]{32}", headers.get("x-request-id", "")):
        text = text.replace(headers["x-request-id"].encode(), b"<minted>")
        headers["x-request-id"] = "<minted>"
    if headers.get("content-type", "").startswith("text/event-stream"):
        events = [e[len(b"data: ") :] for e in text.split(b"\n\n") if e.startswith(b"data: ")]
        chunks = [json.loads(e) for e in events if e != b"[DONE]"]
        indexes = {c["index"] for chunk in chunks for c in chunk.get("choices", [])}
        if len(indexes) > 1:
            per_choice = {
                i: (
                    "".join(
                        c.get("text", "") for k in chunks for c in k["choices"] if c["index"] == i
                    ),
                    [c["finish_reason"] for k in chunks for c in k["choices"] if c["index"] == i],
                )
                for i in sorted(indexes)
            }
            rest = [k for k in chunks if not k.get("choices")]
            return answer.status, headers, (per_choice, rest, events[-1])
    return answer.status, headers, text


RID = {"X-Request-Id": "parity-1"}
STREAM = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "stream": True}
CASES: list[tuple[str, bytes, dict[str, str]]] = [
    ("/v1/completions", json.dumps(STREAM).encode(), RID),
    (
        "/v1/completions",
        json.dumps({**STREAM, "stream_options": {"include_usage": True}, "n": 2}).encode(),
        RID,
    ),
    ("/v1/completions", json.dumps({**STREAM, "stream": False, "echo": True}).encode(), RID),
    (
        "/v1/chat/completions",
        json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        ).encode(),
        RID,
    ),
    (
        "/v1/chat/completions",
        json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "stream": True,
            }
        ).encode(),
        RID,
    ),
    ("/generate", json.dumps({"text": "Hello", "rid": "native-7"}).encode(), RID),
    ("/generate", json.dumps({"text": "Hello", "rid": "bad rid!"}).encode(), RID),
    ("/generate", json.dumps({"input_ids": [1, 2], "stream": True}).encode(), RID),
    ("/v1/completions", b'{"model": "tiny", "prompt": ', RID),
    ("/v1/completions", b"[1, 2]", RID),
    ("/v1/completions", json.dumps({**STREAM, "model": "nope"}).encode(), RID),
    ("/v1/completions", json.dumps({**STREAM, "temperature": 3}).encode(), RID),
    ("/v1/completions", json.dumps({**STREAM, "max_tokens": 10**9}).encode(), RID),
    ("/v1/completions", json.dumps(STREAM).encode(), {"X-Request-Id": "no spaces allowed"}),
    ("/v1/completions", json.dumps(STREAM).encode(), {"X-Request-Id": "first, second"}),
    ("/v1/completions", json.dumps(STREAM).encode(), {}),
    ("/v1/completions", b"x" * 5000, RID),  # over the 4 KiB limit below: 413
]


async def test_hot_routes_answer_exactly_as_quarts_routes() -> None:
    """Every case through the hot path and through Quart's own routes: the same status,
    headers and bytes, and the same request metrics (two apps, one registry each)."""
    async with open_gateway(FakeEngine(behaviour=Behaviour(step_s=0.001))) as gateway:
        gateway.config.server.max_body_bytes = 4096
        hot_app = create_app(gateway, environ={})
        quart_app = create_app(gateway, environ={})
        async with hot_app.test_app(), quart_app.test_app():
            statuses = set()
            for path, body, headers in CASES:
                hot = await asgi_post(hot_app, path, body, headers)
                via_quart = await asgi_post(quart_app.asgi_app, path, body, headers)
                assert _normalized(hot) == _normalized(via_quart), (path, body[:80])
                statuses.add(hot.status)
            assert statuses == {200, 400, 404, 413}  # the cases cover answers and refusals
            hot_metrics = _request_metrics(hot_app)
            assert hot_metrics == _request_metrics(quart_app)
            assert hot_metrics  # the families compared are not empty


def _request_metrics(app: Any) -> list[tuple[str, dict[str, str], float]]:
    """The samples of the per-request counters (not the gauges, which both apps share)."""
    samples = []
    for family in app.extensions[REGISTRY_KEY].collect():
        if family.name in ("smgd_http_requests", "smgd_requests_aborted"):
            samples += [(s.name, s.labels, s.value) for s in family.samples]
    return sorted(samples, key=repr)


async def test_auth_and_drain_refusals_match_quarts() -> None:
    env = {"SMGD_KEYS": "k1,k2"}
    async with open_gateway(server=ServerConfig(api_keys_env="SMGD_KEYS")) as gateway:
        hot_app = create_app(gateway, environ=env)
        quart_app = create_app(gateway, environ=env)
        body = json.dumps({**STREAM, "stream": False}).encode()
        async with hot_app.test_app(), quart_app.test_app():
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k1"}):
                hot = await asgi_post(hot_app, "/v1/completions", body, {**RID, **headers})
                via_quart = await asgi_post(
                    quart_app.asgi_app, "/v1/completions", body, {**RID, **headers}
                )
                assert hot.status == 401
                assert hot.headers["www-authenticate"] == "Bearer"
                assert _normalized(hot) == _normalized(via_quart)
            ok = await asgi_post(hot_app, "/generate", body, {"Authorization": "Bearer k2"})
            assert ok.status == 400  # past the key check: /generate wants `text`
            gateway.draining = True
            for path in HOT_ROUTES:
                hot = await asgi_post(hot_app, path, body, {**RID, "Authorization": "Bearer k1"})
                via_quart = await asgi_post(
                    quart_app.asgi_app, path, body, {**RID, "Authorization": "Bearer k1"}
                )
                assert hot.status == 503
                assert "retry-after" in hot.headers
                assert _normalized(hot) == _normalized(via_quart)


async def test_hot_routes_skip_quarts_request_hooks_and_others_do_not() -> None:
    async with open_gateway() as gateway:
        app = create_app(gateway, environ={})
        assert isinstance(app, SmgdApp)
        seen: list[str] = []

        @app.before_request
        async def _count() -> None:
            seen.append(request.path)

        body = json.dumps({**STREAM, "stream": False}).encode()
        async with app.test_app():
            assert (await asgi_post(app, "/v1/completions", body)).status == 200
            assert seen == []
            assert (await asgi_post(app.asgi_app, "/v1/completions", body)).status == 200
            assert seen == ["/v1/completions"]
            assert (await asgi_post(app, "/v1/tokenize", body)).status == 200
            assert seen == ["/v1/completions", "/v1/tokenize"]


async def test_a_body_in_several_messages_is_read_whole() -> None:
    async with open_gateway() as gateway:
        app = create_app(gateway, environ={})
        body = json.dumps({**STREAM, "stream": False, "prompt": "Hello " * 300}).encode()
        async with app.test_app():
            whole = await asgi_post(app, "/v1/completions", body, RID)
            split = await asgi_post(app, "/v1/completions", body, RID, parts=7)
        assert whole.status == 200
        assert _normalized(split) == _normalized(whole)


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
        app: Any = create_app(gateway, environ={})  # called with test channels, not hypercorn's
        send_in, receive_from = trio.open_memory_channel[Message](math.inf)
        send_in.send_nowait(_part(b'{"model":', True))
        messages: list[Message] = []

        async def send(message: Message) -> None:
            messages.append(message)

        async with app.test_app():
            start = trio.current_time()
            await app(_scope("/v1/completions", RID, 100), receive_from.receive, send)
        answer = Answer(messages)
        assert trio.current_time() - start == pytest.approx(app.config["BODY_TIMEOUT"])
        assert answer.status == 408
        assert json.loads(answer.body)["error"]["code"] is None
        assert answer.headers["x-request-id"] == "parity-1"


# --------------------------------------------------------------------------- worker loop


async def test_a_client_gone_before_its_first_token_aborts_the_engine_at_once() -> None:
    """On smgd's worker loop no task watches the request's messages: the connection's read
    loop cancels the request when the client hangs up (a 30 s prefill is not waited out)."""
    fake = FakeEngine(behaviour=Behaviour(first_step_s=30))
    async with serving(fake) as port:
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", port))
        stream = trio.SocketStream(sock)
        await stream.send_all(_post_bytes("/v1/completions", STREAM))
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


async def test_a_connection_serves_hot_requests_one_after_another() -> None:
    """The disconnect callback belongs to one request at a time: after a finished request a
    second one on the same connection is served, then a hang-up aborts only that one."""
    fake = FakeEngine(behaviour=Behaviour(step_s=0.001))
    async with serving(fake) as port:
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", port))
        stream = trio.SocketStream(sock)
        with trio.fail_after(5):
            await stream.send_all(_post_bytes("/v1/completions", STREAM))
            data = b""
            while not data.endswith(b"\r\n0\r\n\r\n"):
                data += await stream.receive_some(65536)
            fake.behaviour = Behaviour(first_step_s=30)
            await stream.send_all(_post_bytes("/v1/completions", STREAM))
            assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200")
        await trio.testing.wait_all_tasks_blocked()
        await stream.aclose()
        first, second = fake.requests
        with trio.fail_after(5):
            await fake.wait_abort(second.rid)
        assert first.rid not in fake.aborts
