"""smgd's HTTP/1.1 fast path (smgd.api.http.fast_path) through the real worker loop and sockets.

Requests are written as exact bytes on raw trio streams; answers are read with h11's client
(a strict reader: an invalid response fails the test). Whether a request took the fast path
or hypercorn's is told by the h11 events hypercorn sends: the fast path sends none.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import h11
import msgspec
import pytest
import trio
import trio.testing
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed
from hypercorn.protocol.h11 import H11Protocol

from smgd.api.core.pacer import LoadPacer
from smgd.api.http import dispatch, fast_path, worker_loop
from smgd.api.http.app import create_app
from smgd.config import ServerConfig
from smgd.wire.common import GenerateRequest

from .fake_engine import MODEL, Behaviour, DiesBeforeFirstToken, FakeEngine, open_gateway
from .http_helpers import SendPathCounter, dechunk
from .test_direct import _completion, _recorded_writes, post_sse, serving

TIMEOUT_S = 10


class H11Events:
    """Records every event hypercorn's H11Protocol sends (none for a fast-path request)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[Any] = []
        original = H11Protocol._send_h11_event

        async def recording(protocol: H11Protocol, event: Any) -> None:
            self.sent.append(event)
            await original(protocol, event)

        monkeypatch.setattr(H11Protocol, "_send_h11_event", recording)

    def responses(self) -> list[int]:
        return [e.status_code for e in self.sent if isinstance(e, h11.Response)]


@pytest.fixture
def h11_events(monkeypatch: pytest.MonkeyPatch) -> H11Events:
    """The h11 events hypercorn sends during the test."""
    return H11Events(monkeypatch)


class Answer:
    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def header(self, name: bytes) -> bytes | None:
        values = [v for n, v in self.headers if n == name]
        assert len(values) <= 1, (name, values)
        return values[0] if values else None

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[Any]:
        """The SSE events of a streamed body ([DONE] as a string)."""
        events: list[Any] = []
        for block in self.body.split(b"\n\n"):
            if block.startswith(b"data: "):
                text = block[6:]
                events.append(text.decode() if text == b"[DONE]" else json.loads(text))
        return events


class Client:
    """A raw connection: exact bytes out, responses read in order by h11's client."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._h11 = h11.Connection(h11.CLIENT)

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def response(self, method: str = "POST") -> Answer:
        """The next response on the connection (to a request of ``method``)."""
        conn = self._h11
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        # The bytes went out already; h11's client only needs to know what it answers.
        conn.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
        conn.send(h11.EndOfMessage())
        status = 0
        headers: list[tuple[bytes, bytes]] = []
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await self.stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status, headers = event.status_code, list(event.headers)
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return Answer(status, headers, bytes(body))
            else:
                raise AssertionError(f"unexpected {event!r}")

    async def rest(self) -> bytes:
        """What the server sends after what was read, until it closes the connection."""
        after = bytearray(self._h11.trailing_data[0])
        try:
            while chunk := await self.stream.receive_some(65536):
                after += chunk
        except trio.BrokenResourceError:  # reset: closed with bytes of ours unread
            pass
        return bytes(after)

    async def closed_by_server(self) -> bool:
        """Whether the server closed the connection (after what was read): the next read
        ends (or is reset) without another byte."""
        if self._h11.trailing_data[0]:
            return False
        try:
            return await self.stream.receive_some(65536) == b""
        except trio.BrokenResourceError:  # reset: it closed with bytes of ours unread
            return True


def _post(
    path: str, body: dict[str, Any], *, extra: bytes = b"", version: bytes = b"HTTP/1.1"
) -> bytes:
    payload = json.dumps(body).encode()
    head = b"POST %s %s\r\nhost: x\r\ncontent-type: application/json\r\n" % (
        path.encode(),
        version,
    )
    return head + extra + b"content-length: %d\r\n\r\n" % len(payload) + payload


def _get(path: str, *, extra: bytes = b"") -> bytes:
    return b"GET %s HTTP/1.1\r\nhost: x\r\n%s\r\n" % (path.encode(), extra)


def _plain(tokens: int) -> dict[str, Any]:
    return _completion(tokens, stream=False)


def _chunked(body: dict[str, Any]) -> bytes:
    payload = json.dumps(body).encode()
    half = len(payload) // 2
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n" % (half, payload[:half])
        + b"%x\r\n%s\r\n" % (len(payload) - half, payload[half:])
        + b"0\r\n\r\n"
    )


def _engine() -> FakeEngine:
    return FakeEngine(behaviour=Behaviour(step_s=0.001))


async def _connect(port: int) -> Client:
    return Client(await trio.open_tcp_stream("127.0.0.1", port))


@asynccontextmanager
async def _client(
    engine: FakeEngine | None = None, *, server: ServerConfig | None = None
) -> AsyncIterator[Client]:
    """A connection to smgd serving ``engine`` (``_engine()`` by default), open for the
    block, all of it within TIMEOUT_S."""
    async with serving(engine if engine is not None else _engine(), server=server) as port:
        with trio.fail_after(TIMEOUT_S):
            client = await _connect(port)
            async with client.stream:
                yield client


def _usage(answer: Answer) -> int:
    tokens: int = answer.json()["usage"]["completion_tokens"]
    return tokens


# --------------------------------------------------------------------------- pipelining


async def test_requests_pipelined_in_one_write_are_answered_whole_and_in_order(
    h11_events: H11Events,
) -> None:
    async with _client() as client:
        await client.send(
            _post("/v1/completions", _plain(3), extra=b"x-request-id: first\r\n")
            + _get("/health", extra=b"x-request-id: second\r\n")
            + _post("/v1/completions", _completion(5), extra=b"x-request-id: third\r\n")
            + _post("/v1/completions", _plain(7), extra=b"x-request-id: fourth\r\n")
        )
        first = await client.response()
        second = await client.response("GET")
        third = await client.response()
        fourth = await client.response()
        # and the connection is still open for another
        await client.send(_get("/health"))
        fifth = await client.response("GET")
    assert [a.status for a in (first, second, third, fourth, fifth)] == [200] * 5
    ids = [a.header(b"x-request-id") for a in (first, second, third, fourth)]
    assert ids == [b"first", b"second", b"third", b"fourth"]
    assert _usage(first) == 3
    assert second.json() == {"status": "ok"}
    events = third.events()
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert _usage(fourth) == 7
    assert fifth.json() == {"status": "ok"}
    assert h11_events.sent == []  # every one of them on the fast path


async def test_a_pipelined_request_for_h11_waits_for_the_fast_one_before_it(
    h11_events: H11Events,
) -> None:
    async with _client() as client:
        await client.send(
            _post("/v1/completions", _completion(20), extra=b"x-request-id: fast\r\n")
            + _chunked(_plain(4))
        )
        fast = await client.response()
        slow = await client.response()
    assert fast.status == 200 and fast.header(b"x-request-id") == b"fast"
    assert fast.events()[-1] == "[DONE]"
    assert slow.status == 200 and _usage(slow) == 4
    assert h11_events.responses() == [200]  # only the second went through h11


class ReadLoopWakes:
    """Counts the times a request's end woke its connection's read loop from its wait for
    the socket (to make it look at the buffer)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = fast_path.FastPath.wake_read_loop

        def counting(fast: fast_path.FastPath) -> None:
            scope = fast.wake_scope
            before = scope is not None and scope.cancel_called
            original(fast)
            if scope is not None and scope.cancel_called and not before:
                self.count += 1

        monkeypatch.setattr(fast_path.FastPath, "wake_read_loop", counting)


async def _behind_a_stream(second: bytes, *, then: bytes = b"") -> list[Answer]:
    """A stream (~0.5 s), then, once it runs (the read loop waits for the socket under it),
    ``second`` sent whole, and after their answers ``then`` (a GET, if any); every answer."""
    engine = FakeEngine(behaviour=Behaviour(step_s=0.005))
    async with _client(engine) as client:
        await client.send(_post("/v1/completions", _completion(100)))
        await trio.testing.wait_all_tasks_blocked()  # every task waits: the engine has it
        assert len(engine.requests) == 1
        await client.send(second)
        answers = [await client.response(), await client.response()]
        if then:
            await client.send(then)
            answers.append(await client.response("GET"))
    assert answers[0].events()[-1] == "[DONE]"
    return answers


async def test_a_request_waiting_behind_a_stream_starts_at_its_end_without_waking_the_read_loop(
    h11_events: H11Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    wakes = ReadLoopWakes(monkeypatch)
    _, plain, health = await _behind_a_stream(
        _post("/v1/completions", _plain(4), extra=b"x-request-id: next\r\n"),
        then=_get("/health"),  # and the connection reads on as before
    )
    assert (plain.status, plain.header(b"x-request-id"), _usage(plain)) == (200, b"next", 4)
    assert health.json() == {"status": "ok"}
    assert wakes.count == 0
    assert h11_events.sent == []


async def test_a_request_for_h11_waiting_behind_a_stream_wakes_the_read_loop_to_hand_it_over(
    h11_events: H11Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    wakes = ReadLoopWakes(monkeypatch)
    _, chunked = await _behind_a_stream(_chunked(_plain(3)))
    assert (chunked.status, _usage(chunked)) == (200, 3)
    assert wakes.count == 1
    assert h11_events.responses() == [200]


async def test_a_wake_that_comes_after_the_read_loops_bytes_strikes_nowhere_else(
    h11_events: H11Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The race: the read loop's wait for the socket has its bytes (the rest of a request for
    # h11) and, before the loop runs, the stream before it ends and wakes it. The wake's
    # cancel must not strike at the loop's next checkpoint (inside hypercorn's handling).
    paths: list[fast_path.FastPath] = []
    woken = trio.Event()
    original_init = fast_path.FastPath.__init__
    original_receive = fast_path._receive_later
    original_wake = fast_path.FastPath.wake_read_loop

    def waking(fast: fast_path.FastPath) -> None:
        original_wake(fast)
        woken.set()

    def recording_init(fast: fast_path.FastPath, *args: Any) -> None:
        original_init(fast, *args)
        paths.append(fast)

    async def racing(stream: Any, max_bytes: int) -> bytes:
        data = await original_receive(stream, max_bytes)
        (fast,) = paths
        if fast.buffer.startswith(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type"):
            with trio.CancelScope(shield=True):  # the stream ends meanwhile, and wakes us
                await woken.wait()
            assert not fast.busy
            assert fast.wake_scope is not None and fast.wake_scope.cancel_called
        return data

    monkeypatch.setattr(fast_path.FastPath, "__init__", recording_init)
    monkeypatch.setattr(fast_path.FastPath, "wake_read_loop", waking)
    monkeypatch.setattr(fast_path, "_receive_later", racing)
    chunked = _chunked(_plain(3))
    head_end = chunked.index(b"\r\n\r\n") + 4
    engine = FakeEngine(behaviour=Behaviour(step_s=0.005))
    async with _client(engine) as client:
        await client.send(_post("/v1/completions", _completion(40)))
        await trio.testing.wait_all_tasks_blocked()
        await client.send(chunked[:head_end])  # the read loop buffers the head
        await trio.testing.wait_all_tasks_blocked()
        await client.send(chunked[head_end:])  # its wait has these when the wake comes
        streamed = await client.response()
        answer = await client.response()
    assert streamed.events()[-1] == "[DONE]"
    assert (answer.status, _usage(answer)) == (200, 3)
    assert h11_events.responses() == [200]


async def test_a_connection_reads_its_requests_under_one_cancel_scope(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A scope per request's wait for the socket cost ~3 % of a short request's CPU; the read
    # loop enters a new one only after a wake.
    scopes: list[object] = []
    original = fast_path.FastPath._begin

    def recording(fast: fast_path.FastPath, head: Any) -> None:
        scopes.append(fast.wake_scope)
        original(fast, head)

    monkeypatch.setattr(fast_path.FastPath, "_begin", recording)
    async with _client() as client:
        for tokens in range(1, 9):
            await client.send(_post("/v1/completions", _plain(tokens)))
            assert _usage(await client.response()) == tokens
    assert len(scopes) == 8
    assert scopes[0] is not None and all(scope is scopes[0] for scope in scopes)


@pytest.mark.parametrize("cut", ["head", "body"])
async def test_a_request_half_sent_behind_a_stream_is_served_when_its_rest_comes(
    h11_events: H11Events, cut: str
) -> None:
    # At the stream's end the buffer holds part of the next request: its head (the loop
    # reads the rest before anything starts) or its head and part of its body (it starts,
    # and the rest of its body follows on its channel).
    second = _post("/v1/completions", _plain(5), extra=b"x-request-id: halves\r\n")
    split = second.index(b"\r\n\r\n") - 5 if cut == "head" else len(second) - 6
    engine = FakeEngine(behaviour=Behaviour(step_s=0.002))
    async with _client(engine) as client:
        await client.send(_post("/v1/completions", _completion(20)) + second[:split])
        streamed = await client.response()
        await trio.sleep(0.02)  # the stream's end has seen the half in the buffer
        await client.send(second[split:])
        halves = await client.response()
    assert streamed.events()[-1] == "[DONE]"
    assert (halves.status, halves.header(b"x-request-id"), _usage(halves)) == (200, b"halves", 5)
    assert h11_events.sent == []


# --------------------------------------------------------------------------- hand-off to h11


async def test_a_chunked_request_moves_the_connection_to_h11_for_good(
    h11_events: H11Events,
) -> None:
    async with _client() as client:
        await client.send(_post("/v1/completions", _plain(2)))
        first = await client.response()
        after_first = len(h11_events.sent)
        await client.send(_chunked(_plain(3)))
        second = await client.response()
        after_second = h11_events.responses()
        await client.send(_post("/v1/completions", _plain(4)))
        third = await client.response()
    assert [first.status, second.status, third.status] == [200, 200, 200]
    assert [_usage(first), _usage(second), _usage(third)] == [2, 3, 4]
    assert after_first == 0  # the first on the fast path
    assert after_second == [200]  # the chunked one through h11
    assert h11_events.responses() == [200, 200]  # and the third too: the connection stays


async def test_an_http10_request_is_answered_by_h11_which_closes(h11_events: H11Events) -> None:
    async with _client() as client:
        await client.send(_post("/v1/completions", _plain(3), version=b"HTTP/1.0"))
        answer = await client.response()
        assert await client.closed_by_server()
    assert answer.status == 200 and _usage(answer) == 3
    assert h11_events.responses() == [200]


@pytest.mark.parametrize("body", [_completion(3), _plain(3)], ids=["streamed", "whole"])
@pytest.mark.parametrize("value", [b"close", b"Close"])
async def test_connection_close_is_served_on_the_fast_path_as_h11_serves_it(
    monkeypatch: pytest.MonkeyPatch, h11_events: H11Events, body: dict[str, Any], value: bytes
) -> None:
    """The answer says ``connection: close`` and the connection ends after it, as on h11's
    path."""
    request = _post("/v1/completions", body, extra=b"connection: %b\r\n" % value)

    async def answer() -> tuple[int, list[bytes], Any]:
        async with _client() as client:
            await client.send(request)
            got = await client.response()
            assert got.header(b"connection") == b"close"
            assert await client.closed_by_server()
        status, names, content = _normal(got)
        return status, sorted(names), content  # (h11 puts `connection` elsewhere)

    fast = await answer()
    assert h11_events.sent == []
    monkeypatch.setattr(worker_loop.DirectSendTCPServer, "_fast_path", lambda server: None)
    assert await answer() == fast
    assert h11_events.responses() == [200]


async def test_a_request_sent_after_connection_close_is_not_answered(
    h11_events: H11Events,
) -> None:
    """Nothing the client sends after a ``Connection: close`` request is a request (RFC 9112
    §9.6): the connection ends after the first answer."""
    closing = _post("/v1/completions", _plain(3), extra=b"connection: close\r\n")
    async with _client() as client:
        await client.send(closing + _post("/v1/completions", _plain(2)))
        first = await client.response()
        assert await client.closed_by_server()
    assert first.status == 200 and _usage(first) == 3
    assert h11_events.sent == []


async def test_an_http10_get_is_answered(h11_events: H11Events) -> None:
    async with _client() as client:
        await client.send(b"GET /health HTTP/1.0\r\n\r\n")
        answer = await client.response("GET")
        assert await client.closed_by_server()
    assert answer.status == 200 and answer.json() == {"status": "ok"}
    assert h11_events.responses() == [200]


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /a b c HTTP/1.1\r\nhost: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nhost: x\r\nbad header\r\n\r\n",
    ],
    ids=["no-request-line", "spaces-in-target", "header-without-colon"],
)
async def test_a_malformed_request_gets_h11s_400_with_the_error_envelope(
    h11_events: H11Events, request_bytes: bytes
) -> None:
    async with _client() as client:
        await client.send(request_bytes)
        answer = await client.response("GET")
        assert await client.closed_by_server()
    assert answer.status == 400
    assert answer.header(b"content-type") == b"application/json"
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert h11_events.responses() == [400]


async def test_a_malformed_request_after_a_fast_one_is_refused_by_h11(
    h11_events: H11Events,
) -> None:
    async with _client() as client:
        await client.send(_get("/health") + b"GARBAGE\r\n\r\n")
        ok = await client.response("GET")
        refused = await client.response("GET")
        assert await client.closed_by_server()
    assert ok.status == 200 and refused.status == 400
    assert "error" in refused.json()
    assert h11_events.responses() == [400]


# --------------------------------------------------------------------------- reads


async def test_a_head_and_body_that_arrive_in_pieces_are_read_whole(
    h11_events: H11Events,
) -> None:
    request = _post("/v1/completions", _plain(6))
    head_end = request.index(b"\r\n\r\n") + 4
    pieces = [
        request[:10],  # part of the request line
        request[10 : head_end - 1],  # the head but its last byte
        request[head_end - 1 : head_end],  # the head's end alone
        request[head_end : head_end + 5],  # a bit of the body
        request[head_end + 5 :],  # the rest
    ]
    async with _client() as client:
        for piece in pieces:
            await client.send(piece)
            await trio.sleep(0.02)  # each its own read on the server
        answer = await client.response()
        # then another on the same connection, whole
        await client.send(request)
        again = await client.response()
    assert answer.status == 200 and _usage(answer) == 6
    assert again.status == 200 and _usage(again) == 6
    assert h11_events.sent == []


async def test_a_large_body_in_many_reads_is_read_whole(h11_events: H11Events) -> None:
    # A prompt of ~600 KB, sent in 4 KB writes: many more body messages than the app's queue
    # (hypercorn's max_app_queue_size) holds.
    prompt = "hello world " * 50_000
    request = _post("/v1/completions", {**_plain(2), "prompt": prompt})
    assert len(request) > 600_000
    async with _client() as client:
        for start in range(0, len(request), 4096):
            await client.send(request[start : start + 4096])
        answer = await client.response()
    # Refused for its length, which the whole prompt (to its last character) was read for.
    assert answer.status == 400, answer.body
    error = answer.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"your prompt is {len(prompt)} characters" in error["message"]
    assert h11_events.sent == []


@pytest.mark.parametrize("declared", [5000, 10**12])
async def test_a_declared_length_over_the_limit_gets_413_before_the_body(
    h11_events: H11Events, declared: int
) -> None:
    # Only the head has arrived: the answer does not wait for a body it would refuse
    # (it waited for the body timeout, 60 s, then said 408).
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % declared
    )
    async with _client(server=ServerConfig(max_body_bytes=1000)) as client:
        await client.send(head + b'{"prompt": ')
        with trio.fail_after(2):
            answer = await client.response()
    assert answer.status == 413 and answer.header(b"connection") == b"close"
    assert "1000" in answer.json()["error"]["message"]
    assert h11_events.sent == []


async def test_a_body_over_the_limit_gets_413_and_the_connection_closes(
    h11_events: H11Events,
) -> None:
    limit = 1000
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 5000\r\n\r\n"
    )
    async with _client(server=ServerConfig(max_body_bytes=limit)) as client:
        # more than the limit, less than the whole body
        await client.send(head + b'{"prompt": "' + b"a" * 2000)
        answer = await client.response()
        assert await client.closed_by_server()
    assert answer.status == 413
    assert answer.header(b"connection") == b"close"  # the client is told
    assert answer.header(b"content-type") == b"application/json"
    assert answer.header(b"content-length") == b"%d" % len(answer.body)
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert str(limit) in error["message"]
    assert h11_events.sent == []  # refused on the fast path


# --------------------------------------------------------------------------- answers


async def test_a_fast_answer_has_the_usual_headers(h11_events: H11Events) -> None:
    async with _client() as client:
        await client.send(_post("/v1/completions", _plain(3)))
        plain = await client.response()
        await client.send(_post("/v1/completions", _completion(3)))
        streamed = await client.response()
    for answer in (plain, streamed):
        assert answer.status == 200
        date = answer.header(b"date")
        assert date is not None and date.endswith(b" GMT")
        assert answer.header(b"x-request-id")
        assert answer.header(b"server") is not None
        assert answer.header(b"connection") is None  # keep-alive, HTTP/1.1's default
    assert plain.header(b"content-type") == b"application/json"
    assert plain.header(b"content-length") == b"%d" % len(plain.body)
    assert plain.header(b"transfer-encoding") is None
    content_type = streamed.header(b"content-type")
    assert content_type is not None and content_type.startswith(b"text/event-stream")
    assert streamed.header(b"content-length") is None
    assert streamed.header(b"transfer-encoding") == b"chunked"
    assert streamed.events()[-1] == "[DONE]"
    assert plain.header(b"x-request-id") != streamed.header(b"x-request-id")
    assert h11_events.sent == []


@pytest.mark.parametrize("path", ["/health", "/v1/models"])
async def test_a_get_is_served_on_the_fast_path(h11_events: H11Events, path: str) -> None:
    async with _client() as client:
        await client.send(_get(path))
        answer = await client.response("GET")
    assert answer.status == 200
    assert answer.header(b"content-type") == b"application/json"
    body = answer.json()
    if path == "/health":
        assert body == {"status": "ok"}
    else:
        assert [m["id"] for m in body["data"]] == [MODEL]
    assert h11_events.sent == []


async def test_an_unknown_path_gets_404_with_the_envelope_on_the_fast_path(
    h11_events: H11Events,
) -> None:
    async with _client() as client:
        await client.send(_get("/nope") + _get("/health"))
        missing = await client.response("GET")
        ok = await client.response("GET")
    assert missing.status == 404 and "error" in missing.json()
    assert ok.status == 200  # a refusal keeps the connection
    assert h11_events.sent == []


async def test_keep_alive_max_requests_closes_the_connection_after_the_last(
    monkeypatch: pytest.MonkeyPatch,
    h11_events: H11Events,
) -> None:
    monkeypatch.setattr(HypercornConfig, "keep_alive_max_requests", 3)
    async with _client() as client:
        answers = []
        for _ in range(3):
            await client.send(_get("/health"))
            answers.append(await client.response("GET"))
        assert await client.closed_by_server()
    assert [a.status for a in answers] == [200, 200, 200]
    assert [a.header(b"connection") for a in answers] == [None, None, b"close"]
    assert h11_events.sent == []


# --------------------------------------------------------------------------- the inbox


def _body(n: int) -> dict[str, Any]:
    return {"type": "http.request", "body": b"%d" % n, "more_body": True}


async def test_the_inbox_hands_messages_over_in_order_within_its_capacity() -> None:
    inbox = fast_path._Inbox(2, _body(0))
    inbox.put_nowait(_body(1))
    with pytest.raises(trio.WouldBlock):  # full: hypercorn's backpressure
        inbox.put_nowait(_body(2))
    assert inbox.receive_nowait() == _body(0)
    assert await inbox.receive() == _body(1)
    with pytest.raises(trio.WouldBlock):
        inbox.receive_nowait()


async def test_the_inbox_makes_a_full_put_and_an_empty_receive_wait() -> None:
    inbox = fast_path._Inbox(1, _body(0))
    got: list[dict[str, Any]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(inbox.put, _body(1))
        await trio.testing.wait_all_tasks_blocked()  # waits for room
        got.append(await inbox.receive())
        got.append(await inbox.receive())  # the waiting put's, once it had room
        nursery.start_soon(lambda: _append(got, inbox.receive()))
        await trio.testing.wait_all_tasks_blocked()  # waits for a message
        inbox.put_nowait(_body(2))
    assert got == [_body(0), _body(1), _body(2)]


async def _append(got: list[dict[str, Any]], message: Any) -> None:
    got.append(await message)


async def test_a_closed_inbox_fails_every_put_the_waiting_one_too() -> None:
    inbox = fast_path._Inbox(1, _body(0))
    failed: list[BaseException] = []

    async def put() -> None:
        try:
            await inbox.put(_body(1))
        except trio.BrokenResourceError as exc:
            failed.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(put)
        await trio.testing.wait_all_tasks_blocked()  # waits for room
        inbox.close()  # the request ended without reading its body
    assert len(failed) == 1
    with pytest.raises(trio.BrokenResourceError):
        inbox.put_nowait({"type": "http.disconnect"})


# --------------------------------------------------------------------------- the held head


async def test_a_streams_head_goes_out_with_its_first_event_in_one_write(
    monkeypatch: pytest.MonkeyPatch, h11_events: H11Events
) -> None:
    writes = _recorded_writes(monkeypatch)
    async with _client() as client:
        for _ in range(2):  # and again on the same connection, with a writer of its own
            await client.send(_post("/v1/completions", _completion(3)))
            answer = await client.response()
            assert answer.status == 200
            assert answer.header(b"transfer-encoding") == b"chunked"
            assert answer.events()[-1] == "[DONE]"
    heads = [w for w in writes if w.startswith(b"HTTP/1.1 ")]
    assert len(heads) == 2
    for head in heads:  # the head, then in the same write the first event's chunk
        assert b"\r\n\r\n" in head and b'data: {"id":' in head, head
    assert h11_events.sent == []


@pytest.mark.parametrize("pacer_ticks", [True, False])
async def test_a_head_waits_at_most_head_hold_s_for_the_first_event(
    socket_autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    pacer_ticks: bool,
) -> None:
    if not pacer_ticks:  # no deadline can be set: the head goes at once, as it used to
        monkeypatch.setattr(LoadPacer, "call_at", lambda pacer, when, callback: False)
    hold_s = dispatch.HEAD_HOLD_S if pacer_ticks else 0.0
    engine = FakeEngine(behaviour=Behaviour(first_step_s=5.0, step_s=0.01))  # a long prefill
    async with _client(engine) as client:
        sent_at = trio.current_time()
        await client.send(_post("/v1/completions", _completion(2)))
        first = await client.stream.receive_some(65536)
        waited = trio.current_time() - sent_at
        rest = bytearray()
        while not rest.endswith(b"\r\n0\r\n\r\n"):
            rest += await client.stream.receive_some(65536)
        took = trio.current_time() - sent_at
    assert first.startswith(b"HTTP/1.1 200 ") and first.endswith(b"\r\n\r\n"), first
    # The pacer's first 10 ms tick at or after the deadline sends it (the loop's lag aside).
    assert hold_s <= waited < hold_s + 0.1, waited
    assert b"data: [DONE]" in dechunk(bytes(rest)) and took >= 5.0


async def test_a_stream_of_two_choices_sends_its_head_with_its_first_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # n = 2 streams through the dispatcher's send, not directly: that send takes the held
    # head along.
    writes = _recorded_writes(monkeypatch)
    async with _client() as client:
        await client.send(_post("/v1/completions", _completion(3, n=2)))
        answer = await client.response()
    events = answer.events()
    assert answer.status == 200 and events[-1] == "[DONE]"
    assert {e["choices"][0]["index"] for e in events[:-1]} == {0, 1}
    heads = [w for w in writes if w.startswith(b"HTTP/1.1 ")]
    assert len(heads) == 1 and b"data: " in heads[0], heads


class _QueueFull(FakeEngine):
    """An engine whose admission refuses every request: its queue is full."""

    def __init__(self) -> None:
        super().__init__()
        self.config = msgspec.structs.replace(self.config, max_inflight=1, max_queue=0)
        self.admission.reconfigure(max_inflight=1, max_queue=0, queue_timeout_s=1.0)
        assert self.admission.try_acquire("a request that holds the only slot")


class _DiesInALongPrefill(FakeEngine):
    async def _drive(self, req: GenerateRequest) -> None:
        await trio.sleep(3 * dispatch.HEAD_HOLD_S)
        self.die("crashed during prefill")


@pytest.mark.parametrize(
    ("engine", "status", "kind"),
    [(DiesBeforeFirstToken, 502, "engine_error"), (_QueueFull, 429, "rate_limit_error")],
)
async def test_a_stream_that_fails_before_its_first_event_is_answered_with_its_status(
    engine: type[FakeEngine], status: int, kind: str
) -> None:
    # Its head was still held for the first event: nothing of a 200 went out, so the client
    # (or a balancer, which retries a 429 or a 5xx) gets the error's own status.
    async with _client(engine()) as client:
        await client.send(_post("/v1/completions", _completion(3)))
        answer = await client.response()  # a strict reader: one whole response
        assert answer.status == status
        error = answer.json()["error"]
        assert error["type"] == kind and error["message"]
        assert answer.header(b"x-request-id")
        assert (answer.header(b"retry-after") is not None) == (status == 429)
        assert answer.header(b"transfer-encoding") is None
        # The connection serves on: the next request is answered on it, in order (the dead
        # engine's: 503, no ready engine).
        await client.send(_post("/v1/completions", _completion(3)))
        again = await client.response()
        assert again.status == (503 if status == 502 else status) and again.json()["error"]


async def test_a_stream_that_fails_after_its_head_went_alone_sends_an_error_event(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    # The head went out alone after HEAD_HOLD_S (a long prefill): a 200 is on the wire, so
    # the failure is the stream's error event.
    async with _client(_DiesInALongPrefill()) as client:
        await client.send(_post("/v1/completions", _completion(3)))
        answer = await client.response()
    events = answer.events()
    assert answer.status == 200
    assert events[0]["error"]["type"] == "engine_error" and events[-1] == "[DONE]", events


# The shapes of request smgd hands to hypercorn's h11 (smgd.api.http.h1), each with the
# bytes of a streamed one: h11 writes a head as soon as it is given one, so the dispatcher
# holds it there, and the direct writer waits for it.
_H11_SHAPES = ("chunked", "expect", "connection")


def _for_h11(shape: str, body: dict[str, Any]) -> bytes:
    if shape == "chunked":
        return _chunked(body)
    if shape == "expect":
        return _post("/v1/completions", body, extra=b"expect: 100-continue\r\n")
    return _post("/v1/completions", body, extra=b"connection: keep-alive, x-trace\r\n")


async def _send_for_h11(client: Client, shape: str, body: dict[str, Any]) -> None:
    """Send a request of ``shape``; one with ``Expect: 100-continue`` sends its body once the
    interim 100 came, as a client that waits for it does."""
    request = _for_h11(shape, body)
    if shape != "expect":
        await client.send(request)
        return
    head_end = request.index(b"\r\n\r\n") + 4
    await client.send(request[:head_end])
    interim = bytearray()
    while b"\r\n\r\n" not in interim:
        chunk = await client.stream.receive_some(65536)
        assert chunk, "closed before the interim answer"
        interim += chunk
    assert interim.startswith(b"HTTP/1.1 100 "), interim
    rest = interim[interim.index(b"\r\n\r\n") + 4 :]
    if rest:  # (an empty one would tell h11's client the connection ended)
        client._h11.receive_data(bytes(rest))
    await client.send(request[head_end:])


@pytest.mark.parametrize("shape", _H11_SHAPES)
@pytest.mark.parametrize(
    ("engine", "status", "kind"),
    [(DiesBeforeFirstToken, 502, "engine_error"), (_QueueFull, 429, "rate_limit_error")],
)
async def test_a_stream_h11_reads_that_fails_before_its_first_event_gets_its_status(
    h11_events: H11Events, shape: str, engine: type[FakeEngine], status: int, kind: str
) -> None:
    # h11 would write a 200 head at once, and the engine's reader writes the events past the
    # dispatcher: the dispatcher holds the head, the writer waits for it, and a stream that
    # fails before its first event is answered whole with its status, as on the fast path.
    async with _client(engine()) as client:
        await _send_for_h11(client, shape, _completion(3))
        answer = await client.response()  # a strict reader: one whole response
        assert answer.status == status, answer.body
        error = answer.json()["error"]
        assert error["type"] == kind and error["message"]
        assert set(error) == {"message", "type", "param", "code"}
        assert answer.header(b"content-type") == b"application/json"
        assert answer.header(b"x-request-id")
        assert (answer.header(b"retry-after") is not None) == (status == 429)
        assert answer.header(b"transfer-encoding") is None
        # The connection serves on (it stays with h11): the next request is answered on it.
        await client.send(_chunked(_completion(3)))
        again = await client.response()
        assert again.status == (503 if status == 502 else status) and again.json()["error"]
    assert h11_events.responses() == [status, again.status]  # no 200 went out first


async def test_a_stream_of_two_choices_h11_reads_that_fails_first_gets_its_status(
    h11_events: H11Events,
) -> None:
    # n = 2 streams through the dispatcher's send (no direct writes), held all the same.
    async with _client(_QueueFull()) as client:
        await client.send(_chunked(_completion(3, n=2)))
        answer = await client.response()
    assert answer.status == 429 and answer.json()["error"]["code"] == "queue_full"
    assert h11_events.responses() == [429]


@pytest.mark.parametrize("shape", _H11_SHAPES)
async def test_a_stream_h11_reads_is_written_directly_after_its_head(
    monkeypatch: pytest.MonkeyPatch, h11_events: H11Events, shape: str
) -> None:
    # The first event waits for the head (h11 writes it, the stream's task flushes the event
    # behind it); every event after it goes straight to the socket.
    fallbacks = SendPathCounter(monkeypatch)
    engine = FakeEngine(behaviour=Behaviour(step_s=0.002))
    async with _client(engine) as client:
        await _send_for_h11(client, shape, _completion(40))
        answer = await client.response()
        await trio.testing.wait_all_tasks_blocked()  # h11 ends the body after the client has it
    events = answer.events()
    assert answer.status == 200 and answer.header(b"transfer-encoding") == b"chunked"
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert len(events) > 30
    sent = [type(event) for event in h11_events.sent]
    assert sent[-2:] == [h11.Response, h11.EndOfMessage] and h11.Data not in sent
    # hypercorn's waiting send path carried the connection's own events and the first event
    # (flushed behind the head), none of the rest.
    assert fallbacks.count <= 5, fallbacks.count


async def test_a_stream_h11_reads_that_fails_after_its_head_went_alone_sends_an_error_event(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    # The head went out alone after HEAD_HOLD_S (a long prefill): a 200 is on the wire, so
    # the failure is the stream's error event.
    async with _client(_DiesInALongPrefill()) as client:
        sent_at = trio.current_time()
        await client.send(_chunked(_completion(3)))
        head = await client.stream.receive_some(65536)
        waited = trio.current_time() - sent_at
        client._h11.receive_data(head)
        answer = await client.response()
    assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n"), head
    assert dispatch.HEAD_HOLD_S <= waited < dispatch.HEAD_HOLD_S + 0.1, waited
    events = answer.events()
    assert answer.status == 200
    assert events[0]["error"]["type"] == "engine_error" and events[-1] == "[DONE]", events


# --------------------------------------------------------------------------- disconnects


async def test_a_client_hanging_up_mid_stream_aborts_the_engine_request(
    h11_events: H11Events,
) -> None:
    engine = FakeEngine(behaviour=Behaviour(step_s=0.005))
    async with serving(engine) as port:
        await post_sse(port, "/v1/completions", _completion(1000), read_events=10)
        with trio.fail_after(2):
            await engine.wait_abort(engine.requests[-1].rid)
    assert h11_events.sent == []
    assert len(engine.requests) == 1


async def test_a_client_hanging_up_mid_stream_on_h11_after_a_fast_request_aborts_it(
    h11_events: H11Events,
) -> None:
    # The fast path's request task watched for the disconnect until the connection went to
    # h11; from then on the request through h11 is the one a hang-up cancels.
    engine = FakeEngine(behaviour=Behaviour(step_s=0.005))
    async with serving(engine) as port:
        with trio.fail_after(TIMEOUT_S):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            client = Client(stream)
            await client.send(_post("/v1/completions", _plain(2)))
            assert _usage(await client.response()) == 2
            await client.send(_chunked(_completion(1000)))
            received = b""
            while received.count(b"data: ") < 5:
                received += await stream.receive_some(65536)
            await stream.aclose()
            await engine.wait_abort(engine.requests[-1].rid)
    assert h11_events.responses() == [200]
    assert len(engine.requests) == 2


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(_post("/v1/completions", _plain(1000)), id="fast-path-whole"),
        pytest.param(_post("/v1/completions", _completion(1000)), id="fast-path-stream"),
        pytest.param(_chunked(_completion(1000)), id="h11-stream"),
    ],
)
async def test_a_client_half_closing_after_its_request_is_dropped_with_a_trace(
    caplog: pytest.LogCaptureFixture, request_bytes: bytes
) -> None:
    # shutdown(SHUT_WR) after a whole request reads, on the server, as a close: the request
    # is dropped (nginx's 499), whether its handler ran (its engine request is aborted, its
    # line says so) or the end was read first (the dispatcher's line); never without a trace.
    caplog.set_level(logging.INFO, logger="smgd.api")
    engine = FakeEngine(behaviour=Behaviour(step_s=0.005))
    async with serving(engine) as port:
        with trio.fail_after(TIMEOUT_S):
            async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                await stream.send_all(request_bytes)
                await stream.send_eof()
                assert await stream.receive_some(65536) == b""  # the close, and nothing else
            for request in engine.requests:
                await engine.wait_abort(request.rid)
            client = await _connect(port)
            async with client.stream:
                await client.send(_get("/metrics"))
                metrics = (await client.response("GET")).body.decode()
    lines = [r.getMessage() for r in caplog.records if "client disconnected" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].endswith("(499)"), lines
    # No byte of an answer went out: a 499, and no 200.
    series = 'smgd_http_requests_total{method="POST",route="/v1/completions",status="%s"}'
    assert series % "499" + " 1.0" in metrics, metrics
    assert series % "200" not in metrics, metrics


async def test_a_request_whose_clients_end_is_read_before_its_task_runs_leaves_a_trace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The request and the half-close are both in when the server first reads: the read loop
    # starts the request's task, then finds the end at once, in the same scheduler batch as
    # that task's first step (trio runs a batch in random order). Whichever runs first, the
    # request leaves its line; it used to be dropped unseen when the read loop went first.
    caplog.set_level(logging.INFO, logger="smgd.api")
    engine = FakeEngine(behaviour=Behaviour(step_s=0.005))
    connections = 20
    async with serving(engine) as port:
        with trio.fail_after(TIMEOUT_S):
            for _ in range(connections):
                # Blocking calls, no checkpoint: all is sent before the server accepts.
                sock = socket.create_connection(("127.0.0.1", port))
                sock.sendall(_post("/v1/completions", _plain(1000)))
                sock.shutdown(socket.SHUT_WR)
                sock.setblocking(False)
                async with trio.SocketStream(trio.socket.from_stdlib_socket(sock)) as stream:
                    assert await stream.receive_some(65536) == b""
            for request in engine.requests:
                await engine.wait_abort(request.rid)
    lines = [r.getMessage() for r in caplog.records if "client disconnected" in r.getMessage()]
    assert len(lines) == connections, lines


async def test_a_half_closing_health_checker_gets_its_answer_every_time(
    h11_events: H11Events,
) -> None:
    # As above, the request and its half-close are in before the server reads, and either the
    # request's task or the read of the end runs first. A route that starts no engine work
    # (here /health, answered at once) is answered either way: a health checker that
    # half-closes (`nc -N`) reads its 200, never nothing in about half its probes.
    probes = 20
    answers: list[bytes] = []
    async with serving(_engine()) as port:
        with trio.fail_after(TIMEOUT_S):
            for _ in range(probes):
                sock = socket.create_connection(("127.0.0.1", port))  # blocking: no checkpoint
                sock.sendall(_get("/health"))
                sock.shutdown(socket.SHUT_WR)
                sock.setblocking(False)
                async with trio.SocketStream(trio.socket.from_stdlib_socket(sock)) as stream:
                    data = bytearray()
                    while chunk := await stream.receive_some(65536):
                        data += chunk
                answers.append(bytes(data).split(b"\r\n", 1)[0])
    assert answers == [b"HTTP/1.1 200 OK"] * probes, answers
    assert h11_events.sent == []


async def test_a_connections_fast_requests_run_one_after_another_in_one_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tasks: list[object] = []
    original = fast_path.FastPath._run

    async def recording(fast: fast_path.FastPath, scope: Any, receive: Any) -> bool:
        tasks.append(trio.lowlevel.current_task())
        return await original(fast, scope, receive)

    monkeypatch.setattr(fast_path.FastPath, "_run", recording)
    async with _client() as client:
        for tokens in range(1, 6):
            await client.send(_post("/v1/completions", _plain(tokens)))
            assert _usage(await client.response()) == tokens
        await client.send(
            _post("/v1/completions", _plain(6)) + _post("/v1/completions", _completion(7))
        )
        assert _usage(await client.response()) == 6
        streamed = await client.response()
    assert streamed.status == 200 and streamed.events()[-1] == "[DONE]"
    assert len(tasks) == 7
    assert all(task is tasks[0] for task in tasks)


async def test_a_client_hanging_up_before_its_body_ends_starts_no_engine_request() -> None:
    engine = _engine()
    request = _post("/v1/completions", _completion(5))
    async with serving(engine) as port:
        with trio.fail_after(TIMEOUT_S):
            async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                await stream.send_all(request[:-10])
                await trio.sleep(0.05)
            # the server is still well: another connection is answered
            events = await post_sse(port, "/v1/completions", _completion(2))
    assert events[-1] == "[DONE]"
    assert len(engine.requests) == 1  # only the second


async def test_a_stream_answers_whole_when_the_client_sends_more_meanwhile(
    h11_events: H11Events,
) -> None:
    # A pipelined request arriving while a stream runs waits for the stream's end.
    engine = FakeEngine(behaviour=Behaviour(step_s=0.005))
    async with _client(engine) as client:
        await client.send(_post("/v1/completions", _completion(30)))
        await trio.sleep(0.03)  # the stream is under way
        await client.send(_get("/health"))
        streamed = await client.response()
        health = await client.response("GET")
    events = streamed.events()
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert health.status == 200
    assert h11_events.sent == []


# --------------------------------------------------------------------------- keep-alive timer


async def test_an_idle_connection_after_a_fast_request_closes_at_the_keep_alive_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(HypercornConfig, "keep_alive_timeout", 0.2)
    async with _client() as client:
        await client.send(_get("/health"))
        answer = await client.response("GET")
        answered_at = trio.current_time()
        assert await client.closed_by_server()
        idle_s = trio.current_time() - answered_at
    assert answer.status == 200
    assert 0.1 < idle_s < 2, idle_s


async def test_a_fast_request_longer_than_the_keep_alive_timeout_is_not_cut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(HypercornConfig, "keep_alive_timeout", 0.1)
    engine = FakeEngine(behaviour=Behaviour(step_s=0.01))
    async with _client(engine) as client:
        started = trio.current_time()
        await client.send(_post("/v1/completions", _completion(40)))  # ~0.4 s
        streamed = await client.response()
        took = trio.current_time() - started
        await client.send(_get("/health"))  # within the timeout: still open
        health = await client.response("GET")
    assert took > 0.3
    assert streamed.events()[-1] == "[DONE]"
    assert health.status == 200


# --------------------------------------------------------------------------- more of h11's


async def test_expect_100_continue_is_h11s_and_gets_its_interim_answer(
    h11_events: H11Events,
) -> None:
    payload = json.dumps(_plain(3)).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(payload)
    )
    async with _client() as client:
        await client.send(head)
        interim = bytearray()
        while b"\r\n\r\n" not in interim:
            chunk = await client.stream.receive_some(65536)
            assert chunk
            interim += chunk
        assert interim.startswith(b"HTTP/1.1 100 ")
        rest = interim[interim.index(b"\r\n\r\n") + 4 :]
        await client.send(payload)
        if rest:  # (an empty one would tell h11 the connection ended)
            client._h11.receive_data(bytes(rest))
        answer = await client.response()
    assert answer.status == 200 and _usage(answer) == 3
    assert h11_events.responses() == [200]


async def test_a_head_over_h11s_limit_in_pieces_gets_431_with_the_envelope(
    h11_events: H11Events,
) -> None:
    head = _get("/health", extra=b"x-big: " + b"b" * 20_000 + b"\r\n")
    async with _client() as client:
        await client.send(head[:17_000])  # over 16 KiB, no end of head yet
        answer = await client.response("GET")
        assert await client.closed_by_server()
    assert answer.status == 431
    assert "16384 bytes" in answer.json()["error"]["message"]
    assert h11_events.responses() == [431]


# --------------------------------------------------------------------------- same answers


def _normal(answer: Answer) -> tuple[int, list[bytes], Any]:
    """An answer without what differs from one request to the next (ids, times)."""
    names = [n for n, _ in answer.headers]
    if answer.header(b"content-type") == b"application/json":
        body: Any = answer.json()
        if isinstance(body, dict):
            for key in ("id", "created"):
                body.pop(key, None)
            # A model card's `created` is its server's start: the two servers compared here
            # started apart, sometimes in different seconds.
            for card in body.get("data") or ():
                if isinstance(card, dict):
                    card.pop("created", None)
    else:
        body = [
            {k: v for k, v in e.items() if k not in ("id", "created")} if isinstance(e, dict) else e
            for e in answer.events()
        ]
    return answer.status, names, body


SAME_ANSWERS: list[tuple[bytes, str]] = [
    (_get("/health"), "GET"),
    (_get("/v1/models"), "GET"),
    (_get("/nope"), "GET"),
    (_post("/v1/completions", _plain(4)), "POST"),
    (_post("/v1/completions", _completion(4)), "POST"),
    (_post("/v1/completions", {"model": "other", "prompt": "x"}), "POST"),
    (_post("/v1/completions", {"model": MODEL}), "POST"),
    (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\n{{{", "POST"),
    (_get("/v1/completions"), "GET"),
    (_get("/health?x=%20y", extra=b"x-request-id: abc\r\n"), "GET"),
    (_get("http://x/v1/models"), "GET"),
    (_get("/v1/%6Dodels"), "GET"),
    (
        _post(
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        ),
        "POST",
    ),
]


async def test_the_fast_path_answers_as_hypercorn_does(
    monkeypatch: pytest.MonkeyPatch, h11_events: H11Events
) -> None:
    async def answers() -> list[tuple[int, list[bytes], Any]]:
        got = []
        async with _client() as client:
            for request, method in SAME_ANSWERS:
                await client.send(request)
                got.append(_normal(await client.response(method)))
        return got

    fast = await answers()
    assert h11_events.sent == []
    monkeypatch.setattr(worker_loop.DirectSendTCPServer, "_fast_path", lambda server: None)
    slow = await answers()
    assert len(h11_events.responses()) == len(SAME_ANSWERS)
    for (request, _), a, b in zip(SAME_ANSWERS, fast, slow, strict=True):
        assert a == b, request


async def test_a_body_whose_end_arrives_with_the_next_request_serves_both(
    h11_events: H11Events,
) -> None:
    first = _post("/v1/completions", _plain(3), extra=b"x-request-id: one\r\n")
    cut = len(first) - 7
    async with _client() as client:
        await client.send(first[:cut])
        await trio.sleep(0.05)  # the request runs, waiting for the rest of its body
        await client.send(
            first[cut:] + _post("/v1/completions", _plain(5), extra=b"x-request-id: two\r\n")
        )
        one = await client.response()
        two = await client.response()
    assert (one.status, one.header(b"x-request-id"), _usage(one)) == (200, b"one", 3)
    assert (two.status, two.header(b"x-request-id"), _usage(two)) == (200, b"two", 5)
    assert h11_events.sent == []


# --------------------------------------------------------------------------- nothing left behind


@asynccontextmanager
async def serving_until(engine: FakeEngine, stop: trio.Event, limit: int) -> AsyncIterator[int]:
    """smgd's app on the worker loop until ``stop``; a long graceful timeout, so a connection
    task left behind would keep ``serve`` from returning."""
    async with open_gateway(engine, server=ServerConfig(max_body_bytes=limit)) as gateway:
        app = create_app(gateway, environ={})
        config = HypercornConfig()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        config.graceful_timeout = 30
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                lambda task_status: worker_loop.serve(
                    app, config, shutdown_trigger=stop.wait, task_status=task_status
                )
            )
            yield int(binds[0].rsplit(":", 1)[1])


HUGE_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"content-length: 50000000\r\n\r\n"
)


async def _pour_and_read(port: int) -> tuple[Answer, bytes]:
    """A body far over the limit, sent on and on; the answer, and what follows it until the
    server closes the connection."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)

    async def pour() -> None:
        try:
            await stream.send_all(HUGE_HEAD)
            for _ in range(300):
                await stream.send_all(b"a" * 65536)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async with stream, trio.open_nursery() as nursery:
        nursery.start_soon(pour)
        client = Client(stream)
        answer = await client.response()
        after = await client.rest()
        nursery.cancel_scope.cancel()
    return answer, after


@pytest.mark.parametrize("queue", [1, 10])
async def test_a_413_while_the_body_pours_in_leaves_no_task_behind(
    monkeypatch: pytest.MonkeyPatch, queue: int
) -> None:
    # The client keeps sending a body far over the limit; the app refuses it after its first
    # messages and the connection closes. The read loop, which was handing on the body, must
    # not be left waiting on the ended request's queue.
    monkeypatch.setattr(HypercornConfig, "max_app_queue_size", queue)
    stop = trio.Event()
    with trio.fail_after(TIMEOUT_S):
        async with serving_until(_engine(), stop, 200_000) as port:
            answer, _ = await _pour_and_read(port)
            assert answer.status == 413
            await trio.sleep(0.1)
            start = trio.current_time()
            stop.set()
    assert trio.current_time() - start < 1  # serve() returned without waiting


def _slow_close(monkeypatch: pytest.MonkeyPatch) -> None:
    """The connection's close takes a while (as it can: send_eof and aclose are checkpoints;
    this only widens the window), during which the read loop may read on."""
    original = worker_loop.DirectSendTCPServer.protocol_send

    async def protocol_send(server: worker_loop.DirectSendTCPServer, event: Any) -> None:
        if isinstance(event, Closed):
            await trio.sleep(0.05)
        await original(server, event)

    monkeypatch.setattr(worker_loop.DirectSendTCPServer, "protocol_send", protocol_send)


async def test_nothing_follows_a_413_for_a_body_still_pouring_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _slow_close(monkeypatch)
    async with serving(_engine(), server=ServerConfig(max_body_bytes=200_000)) as port:
        with trio.fail_after(TIMEOUT_S):
            answer, after = await _pour_and_read(port)
    assert answer.status == 413
    assert after == b""  # the body's bytes are no request: the connection just closes


async def test_the_rest_of_a_refused_body_is_never_run_as_a_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A body over the limit is refused (413) before its end; its remaining bytes happen to
    # read as a request. They are body, not a request: nothing may run them.
    _slow_close(monkeypatch)
    engine = _engine()
    smuggled = _post("/v1/completions", _plain(2), extra=b"x-request-id: smuggled\r\n")
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (
        1500 + len(smuggled)
    )
    async with _client(engine, server=ServerConfig(max_body_bytes=1000)) as client:
        await client.send(head + b"a" * 1500)
        refused = await client.response()
        await client.send(smuggled)  # the body's last bytes
        after = await client.rest()
        await client.stream.aclose()
        await trio.sleep(0.1)  # closed, the server still up: time to run what it would
    assert refused.status == 413
    assert engine.requests == []
    assert after == b""


async def test_no_request_is_served_after_a_response_that_closes_the_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # RFC 9112 §9.6: a server that sends "close" closes after that response and does not
    # process any further request on the connection.
    _slow_close(monkeypatch)
    monkeypatch.setattr(HypercornConfig, "keep_alive_max_requests", 1)
    engine = _engine()
    async with _client(engine) as client:
        await client.send(_get("/health"))
        last = await client.response("GET")
        await client.send(_post("/v1/completions", _plain(2)))  # too late
        after = await client.rest()
        await client.stream.aclose()
        await trio.sleep(0.1)  # closed, the server still up: time to run what it would
    assert last.status == 200 and last.header(b"connection") == b"close"
    assert engine.requests == []
    assert after == b""


async def test_a_client_sending_on_after_a_413_is_cut_off_at_the_linger_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fast_path, "LINGER_S", 0.3)
    cut_s: float | None = None
    async with _client(server=ServerConfig(max_body_bytes=1000)) as client:
        await client.send(HUGE_HEAD + b"a" * 2000)
        answer = await client.response()
        answered_at = trio.current_time()
        assert await client.closed_by_server()  # its sending side, at once
        # The client sends on: the server reads and drops it until the deadline,
        # then closes for good (a send then meets the reset).
        with trio.move_on_after(3):
            try:
                while True:
                    await client.stream.send_all(b"a" * 1024)
                    await trio.sleep(0.01)
            except trio.BrokenResourceError:
                cut_s = trio.current_time() - answered_at
    assert answer.status == 413 and answer.header(b"connection") == b"close"
    assert cut_s is not None, "still open 3 s after the answer"
    assert 0.2 < cut_s < 2, cut_s


@pytest.mark.parametrize("pause_s", [0.0, 0.5])
async def test_a_client_that_stops_sending_after_a_413_is_closed_after_linger_s(
    monkeypatch: pytest.MonkeyPatch, pause_s: float
) -> None:
    # Lingering ends LINGER_S after the answer at the latest (at once when the client closes).
    monkeypatch.setattr(fast_path, "LINGER_S", 0.3)
    stop = trio.Event()
    with trio.fail_after(TIMEOUT_S):
        async with serving_until(_engine(), stop, 1000) as port:
            client = await _connect(port)
            async with client.stream:
                await client.send(HUGE_HEAD + b"a" * 2000)
                answer = await client.response()
                assert await client.closed_by_server()
                if pause_s:
                    await trio.sleep(pause_s)
                    # closed for good meanwhile: what is sent now meets a reset
                    with pytest.raises(trio.BrokenResourceError):
                        for _ in range(50):
                            await client.stream.send_all(b"a" * 1024)
                            await trio.sleep(0.01)
            await trio.sleep(0.1)
            start = trio.current_time()
            stop.set()
    assert answer.status == 413
    assert trio.current_time() - start < 1  # nothing left behind


async def test_connections_that_ended_in_every_way_leave_no_task_behind() -> None:
    stop = trio.Event()
    engine = FakeEngine(behaviour=Behaviour(step_s=0.005))
    with trio.fail_after(TIMEOUT_S):
        async with serving_until(engine, stop, 1000) as port:
            # a client hanging up mid-stream
            await post_sse(port, "/v1/completions", _completion(1000), read_events=5)
            await engine.wait_abort(engine.requests[-1].rid)
            # one hanging up before its body's end
            async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                await stream.send_all(_post("/v1/completions", _plain(2))[:-5])
                await trio.sleep(0.05)
            # one handed to h11 and closed by it
            client = await _connect(port)
            async with client.stream:
                await client.send(_get("/health") + b"GARBAGE\r\n\r\n")
                assert (await client.response("GET")).status == 200
                assert (await client.response("GET")).status == 400
                assert await client.closed_by_server()
            # one refused with 413 and closed
            client = await _connect(port)
            async with client.stream:
                await client.send(
                    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5000\r\n\r\n"
                    + b"a" * 2000
                )
                assert (await client.response()).status == 413
                assert await client.closed_by_server()
            await trio.sleep(0.1)
            start = trio.current_time()
            stop.set()
    assert trio.current_time() - start < 1


# -- the busy connection's read: wait for the socket, then read ---------------------------


async def test_a_busy_connections_read_returns_what_arrives_then_the_end() -> None:
    left, right = trio.socket.socketpair()
    ours, theirs = trio.SocketStream(left), trio.SocketStream(right)
    async with trio.open_nursery() as nursery:
        got: list[bytes] = []

        async def read() -> None:
            got.append(await fast_path._receive_later(ours, 1024))

        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # nothing sent yet: it waits, it does not spin or return early
        await theirs.send_all(b"GET / HTTP/1.1\r\n")
    assert got == [b"GET / HTTP/1.1\r\n"]
    await theirs.aclose()
    assert await fast_path._receive_later(ours, 1024) == b""  # the peer's end, as receive_some
    await ours.aclose()


class _Reads:
    """Counts os.read calls: the fast path's own reads of a socket (trio's receive_some makes
    none)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fds: list[int] = []
        read = os.read

        def counted(fd: int, n: int) -> bytes:
            self.fds.append(fd)
            return read(fd, n)

        monkeypatch.setattr(os, "read", counted)


@pytest.mark.parametrize("waiting", [False, True])
async def test_a_new_connections_first_read_takes_what_is_there_then_reads_wait_first(
    monkeypatch: pytest.MonkeyPatch, waiting: bool
) -> None:
    # A new connection's request is nearly always in when its task first reads: taken at
    # once, without a checkpoint. Between later requests the read waits for the socket, then
    # reads once: no read that fails first, no checkpoint after the one that succeeds.
    left, right = trio.socket.socketpair()
    ours, theirs = trio.SocketStream(left), trio.SocketStream(right)
    fast = fast_path.FastPath(SimpleNamespace(stream=ours), None)  # type: ignore[arg-type]
    reads = _Reads(monkeypatch)
    if not waiting:
        await theirs.send_all(b"GET / HTTP/1.1\r\n")
        with trio.testing.assert_no_checkpoints():
            assert await fast.receive(1024) == b"GET / HTTP/1.1\r\n"
        assert len(reads.fds) == 1
    for expected in [b"x"] if waiting else [b"y", b"z"]:
        reads.fds.clear()
        got: list[bytes] = []

        async def read(into: list[bytes]) -> None:
            into.append(await fast.receive(1024))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read, got)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []  # nothing there: it waits
            await theirs.send_all(expected)
        assert got == [expected]
        # A first read that found nothing (waiting) tried once before it waited.
        assert len(reads.fds) == (2 if waiting else 1)
        waiting = False
    await theirs.aclose()
    assert await fast.receive(1024) == b""  # the peer's end, as receive_some
    await ours.aclose()


async def test_a_busy_connections_read_fails_as_receive_some_does() -> None:
    left, right = trio.socket.socketpair()
    ours, theirs = trio.SocketStream(left), trio.SocketStream(right)
    async with trio.open_nursery() as nursery:
        failures: list[BaseException] = []

        async def read() -> None:
            try:
                await fast_path._receive_later(ours, 1024)
            except trio.ClosedResourceError as exc:
                failures.append(exc)

        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        await ours.aclose()  # closed by another task while the read waits
    assert len(failures) == 1
    with pytest.raises(trio.ClosedResourceError):
        await fast_path._receive_later(ours, 1024)  # and on a socket already closed
    await theirs.aclose()


@pytest.mark.parametrize(
    ("name", "value"),
    [(b"x-request-id", b"abc\r\nset-cookie: x"), (b"x-note", b"a\nb"), (b"x-bad\r\nname", b"v")],
)
async def test_a_response_header_with_a_line_break_is_refused_naming_it(
    name: bytes, value: bytes
) -> None:
    """Nothing of such a head is sent: a line break in a name or value would end the header
    line there and let what follows it in as a header of its own."""
    sent: list[bytes] = []

    async def protocol_send(event: Any) -> None:
        sent.append(event.data)

    conn = SimpleNamespace(
        requests=1,
        config=SimpleNamespace(keep_alive_max_requests=100),
        context=SimpleNamespace(terminated=trio.Event()),
        direct_writer=None,
        protocol_send=protocol_send,
    )
    fast = SimpleNamespace(body_pending=False, close_asked=False)
    server = SimpleNamespace(get=lambda: [(b"server", b"smgd")])
    good = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

    response = fast_path._Response(conn, server, fast)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="line break") as refused:
        await response.send(
            {"type": "http.response.start", "status": 200, "headers": [*good, (name, value)]}
        )
    assert repr(name) in str(refused.value)
    assert not response.started and sent == []

    response = fast_path._Response(conn, server, fast)  # type: ignore[arg-type]
    await response.send({"type": "http.response.start", "status": 200, "headers": good})
    assert sent and sent[0].startswith(b"HTTP/1.1 200 ")


async def test_request_header_names_are_matched_whatever_their_case_on_both_paths(
    h11_events: H11Events,
) -> None:
    """The dispatcher compares header names as the readers hand them over: both must give
    them lower-cased, the fast path's and h11's alike."""
    chunked = _chunked(_plain(3)).replace(
        b"host: x\r\n", b"host: x\r\nX-REQUEST-ID: through-h11\r\n", 1
    )
    async with _client() as client:
        await client.send(_post("/v1/completions", _plain(2), extra=b"X-Request-ID: fast\r\n"))
        fast = await client.response()
        await client.send(chunked)
        slow = await client.response()
    assert [fast.status, slow.status] == [200, 200]
    assert h11_events.responses() == [200]  # the second went through h11
    assert [fast.header(b"x-request-id"), slow.header(b"x-request-id")] == [
        b"fast",
        b"through-h11",
    ]
