"""Direct SSE writes (smgd.api.http.direct) through smgd's real worker loop, over real sockets."""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import h11
import httpx
import pytest
import trio
import trio.testing
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import RawData
from hypercorn.protocol.h11 import H11Protocol

from smgd.api.core.pacer import LoadPacer
from smgd.api.core.sse import KEEPALIVE
from smgd.api.http import worker_loop
from smgd.api.http.app import create_app
from smgd.api.http.direct import DirectWriter, direct_writer
from smgd.config import ServerConfig
from smgd.engines.delivery import DELIVERY, HELD_MAX

from .fake_engine import MODEL, Behaviour, DiesBeforeFirstToken, FakeEngine, open_gateway
from .http_helpers import SendPathCounter, dechunk, post_bytes


@asynccontextmanager
async def serving(*engines: FakeEngine, server: ServerConfig | None = None) -> AsyncIterator[int]:
    async with open_gateway(*engines, server=server) as gateway:
        app = create_app(gateway, environ={})
        config = HypercornConfig()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        config.graceful_timeout = 1
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(worker_loop.serve, app, config)
            yield int(binds[0].rsplit(":", 1)[1])
            nursery.cancel_scope.cancel()


async def post_sse(
    port: int,
    path: str,
    body: dict[str, Any],
    *,
    rcvbuf: int | None = None,
    pause_s: float = 0.0,
    read_events: int | None = None,
) -> list[Any]:
    """POST, read the whole chunked SSE body (or ``read_events`` events, then hang up)."""
    sock = trio.socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect(("127.0.0.1", port))
    stream = trio.SocketStream(sock)
    async with stream:
        await stream.send_all(post_bytes(path, body))
        if pause_s:
            await trio.sleep(pause_s)  # a client that does not read: the server's writes back up
        data = bytearray()
        while not data.endswith(b"\r\n0\r\n\r\n"):
            chunk = await stream.receive_some(65536)
            assert chunk, "the server closed the connection before the body ended"
            data += chunk
            if read_events is not None and data.count(b"data: ") >= read_events:
                return []
    header, _, raw = bytes(data).partition(b"\r\n\r\n")
    assert header.startswith(b"HTTP/1.1 200"), header
    assert b"transfer-encoding: chunked" in header.lower()
    events = []
    for block in dechunk(raw).split(b"\n\n"):
        if block.startswith(b"data: "):
            text = block[6:]
            events.append(text.decode() if text == b"[DONE]" else json.loads(text))
    return events


def _text(events: list[Any]) -> str:
    return "".join(
        c.get("text") or (c.get("delta") or {}).get("content") or ""
        for e in events
        if isinstance(e, dict)
        for c in e.get("choices", [])
    )


def _completion(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": max_tokens, "stream": True, **extra}


async def post_raw(port: int, path: str, body: dict[str, Any]) -> tuple[bytes, float]:
    """POST; the whole dechunked body and the seconds from the request to its end."""
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        sent_at = trio.current_time()
        await stream.send_all(post_bytes(path, body))
        data = bytearray()
        while not data.endswith(b"\r\n0\r\n\r\n"):
            chunk = await stream.receive_some(65536)
            assert chunk, "the server closed the connection before the body ended"
            data += chunk
        took = trio.current_time() - sent_at
    head, _, raw = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return dechunk(raw), took


def _saturate(monkeypatch: pytest.MonkeyPatch, window_s: float) -> None:
    """Every pacer reads its loop as saturated: direct streams hold output ``window_s``."""

    def saturated(pacer: LoadPacer, lag_s: float, periods: int = 1, busy: float = 1.0) -> float:
        pacer.lag_s = pacer.sustained_lag_s = 1.0
        pacer.window_s = pacer.direct_window_s = window_s
        return pacer.window_s

    monkeypatch.setattr(LoadPacer, "observe", saturated)


async def _reference_text(port: int, tokens: int, http_timeout_s: float = 5.0) -> str:
    """The whole text of a non-streamed completion: what a streamed one must add up to."""
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", timeout=http_timeout_s
    ) as client:
        response = await client.post("/v1/completions", json=_completion(tokens, stream=False))
    text: str = response.json()["choices"][0]["text"]
    return text


# --------------------------------------------------------------------------- unit


class _SocketConn:
    """The parts of smgd's connection a :class:`DirectWriter` uses, on a plain socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.stream: Any = self
        self.send_lock: trio.Lock | None = None
        self.socket = sock
        self.socket_fileno = sock.fileno
        self.body_end_written = False


def _writer_on_a_socket_pair() -> tuple[DirectWriter, socket.socket, socket.socket]:
    """A writer on one end of a fresh socket pair: (writer, its end, the reading end)."""
    left, right = socket.socketpair()
    left.setblocking(False)
    return DirectWriter(_SocketConn(left)), left, right


def test_direct_writer_applies_only_to_http11_on_smgds_own_loop() -> None:
    with socket.socket() as sock:
        state = {"smgd.connection": _SocketConn(sock)}
        assert direct_writer({"type": "http", "http_version": "1.1", "state": state}) is not None
        assert direct_writer({"type": "http", "http_version": "1.0", "state": state}) is None
        assert direct_writer({"type": "http", "http_version": "2", "state": state}) is None
        assert direct_writer({"type": "http", "http_version": "1.1", "state": {}}) is None
        assert direct_writer({"type": "http", "http_version": "1.1"}) is None


def test_direct_writer_frames_chunks_and_keeps_order_behind_a_backlog() -> None:
    writer, left, right = _writer_on_a_socket_pair()
    assert writer._conn.direct_writer is writer  # what the connection's protocol_send holds
    assert writer.write(b"abc")
    assert right.recv(100) == b"3\r\nabc\r\n"
    writer.hold()  # a send through hypercorn's path is under way
    assert not writer.write(b"xy")  # waits behind it
    assert bytes(writer.backlog) == b"2\r\nxy\r\n"
    writer.release()
    assert not writer.write(b"z")  # the backlog is still there: behind it, in order
    assert bytes(writer.backlog) == b"2\r\nxy\r\n1\r\nz\r\n"
    with pytest.raises(BlockingIOError):  # nothing of them went out
        right.recv(100, socket.MSG_DONTWAIT)
    left.close()
    right.close()


def _recorded_writes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every ``os.write`` from here on, in order (each still done)."""
    writes: list[bytes] = []
    real_write = os.write

    def recording(fd: int, data: Any) -> int:
        writes.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", recording)
    return writes


def test_a_held_head_goes_out_with_the_first_chunk_in_one_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    writer, left, right = _writer_on_a_socket_pair()
    writes = _recorded_writes(monkeypatch)
    writer.hold_head(b"HEAD")
    assert writer.head_held
    assert writes == []  # nothing yet: the head waits for the first chunk
    assert writer.write(b"abc")
    assert writer.write(b"d")
    assert writes == [b"HEAD3\r\nabc\r\n", b"1\r\nd\r\n"]
    assert not writer.head_held
    assert right.recv(100) == b"HEAD3\r\nabc\r\n1\r\nd\r\n"
    left.close()
    right.close()


def test_a_held_head_stays_first_when_a_send_is_under_way() -> None:
    writer, left, right = _writer_on_a_socket_pair()
    writer.hold_head(b"HEAD")
    writer.hold()  # a send through hypercorn's path starts, and ends: the head stays held
    writer.release()
    assert writer.head_held
    writer.hold()
    assert not writer.write(b"x")  # behind the send under way, with the head before it
    assert bytes(writer.backlog) == b"HEAD1\r\nx\r\n"
    writer.release()
    assert not writer.write(b"y")  # the backlog is still there: behind it, in order
    assert bytes(writer.backlog) == b"HEAD1\r\nx\r\n1\r\ny\r\n"
    with pytest.raises(BlockingIOError):
        right.recv(100, socket.MSG_DONTWAIT)
    left.close()
    right.close()


def test_a_held_head_sent_alone_or_taken_goes_out_once() -> None:
    writer, left, right = _writer_on_a_socket_pair()
    writer.hold_head(b"HEAD")
    writer.send_head()  # its deadline: alone
    writer.send_head()  # gone already: nothing
    assert writer.write(b"a")
    assert right.recv(100) == b"HEAD1\r\na\r\n"
    writer.hold_head(b"NEXT")
    assert writer.take_unsent() == b"NEXT"  # the caller sends it, before its own bytes
    assert writer.take_unsent() == b""
    assert writer.write(b"b")
    assert right.recv(100) == b"1\r\nb\r\n"
    left.close()
    right.close()


async def test_a_writer_waiting_for_a_head_sent_elsewhere_writes_after_it() -> None:
    # hypercorn's path: h11 writes the head, sent by the dispatcher at the first event (or its
    # deadline). Until it went, chunks queue and ask the task to flush, whose flush has the
    # head sent first; then chunks are written directly again.
    left, right = socket.socketpair()
    left.setblocking(False)
    conn = _SocketConn(left)
    # What hypercorn's waiting send path (TCPServer.protocol_send, the flush's) uses.
    conn.stream = trio.SocketStream(trio.socket.from_stdlib_socket(left))
    conn.send_lock = trio.Lock()
    writer = DirectWriter(conn)
    heads: list[bytes] = []

    async def send_head() -> None:
        left.send(b"HEAD")  # as the server's own path writes it
        heads.append(b"HEAD")

    writer.wait_for_head(send_head)
    writer.hold()  # a send through hypercorn's path starts and ends: still waiting
    writer.release()
    assert not writer.write(b"a")  # queued: the task is asked to flush
    assert not writer.finish(b"b")
    with pytest.raises(BlockingIOError):
        right.recv(100, socket.MSG_DONTWAIT)
    await writer.flush()
    assert heads == [b"HEAD"]
    assert right.recv(100) == b"HEAD1\r\na\r\n1\r\nb\r\n0\r\n\r\n"
    assert writer.write(b"c")  # directly from here on
    await writer.flush()  # nothing to send: the head is not sent twice
    assert heads == [b"HEAD"]
    assert right.recv(100) == b"1\r\nc\r\n"
    left.close()
    right.close()


def test_a_head_the_kernel_did_not_take_whole_stays_first_for_the_next_send() -> None:
    writer, left, right = _writer_on_a_socket_pair()
    left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    earlier = b""
    with contextlib.suppress(BlockingIOError):
        while True:  # a client that has not read earlier answers: its socket is full
            earlier += b"e" * left.send(b"e" * 65536)
    head = b"HEAD" * 1024
    writer.hold_head(head)
    writer.send_head()  # its deadline: the kernel takes none of it
    assert not writer.head_held
    assert bytes(writer.backlog) == head
    assert not writer.write(b"x")  # behind it
    assert writer.take_unsent() == head + b"1\r\nx\r\n"  # for the response's next send
    assert not writer.backlog and not writer.head_held
    assert writer.take_unsent() == b""
    received = b""
    while len(received) < len(earlier):
        received += right.recv(65536)
    assert received == earlier  # nothing of the head went out before it
    left.close()
    right.close()


def test_direct_writer_stops_on_a_broken_socket() -> None:
    writer, left, right = _writer_on_a_socket_pair()
    right.close()
    for _ in range(100):  # the peer is gone: the write fails, once the buffer notices
        if not writer.write(b"z" * 65536):
            break
    assert writer.broken or writer.backlog
    left.close()


def test_writes_during_a_delivery_go_out_at_its_end_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    one, left1, right1 = _writer_on_a_socket_pair()
    two, left2, right2 = _writer_on_a_socket_pair()
    one.hold_head(b"HEAD")
    writes = _recorded_writes(monkeypatch)
    with DELIVERY:  # an engine reader's delivery
        assert one.write(b"a")  # held, not refused: the task need not act
        assert two.write(b"b")
        assert one.finish(b"c")
        assert writes == []  # nothing before the delivery's end
        assert one._conn.body_end_written
    # In the order the writers first held, each writer's bytes in one write, in its order.
    assert writes == [b"HEAD1\r\na\r\n1\r\nc\r\n0\r\n\r\n", b"1\r\nb\r\n"]
    assert (one.writes, two.writes) == (1, 1)
    assert right1.recv(100) == b"HEAD1\r\na\r\n1\r\nc\r\n0\r\n\r\n"
    assert right2.recv(100) == b"1\r\nb\r\n"
    assert two.write(b"d")  # after the delivery: at once
    assert writes[-1] == b"1\r\nd\r\n"
    for sock in (left1, right1, left2, right2):
        sock.close()


def test_a_held_write_the_kernel_refuses_goes_to_the_backlog_and_wakes_the_task() -> None:
    writer, left, right = _writer_on_a_socket_pair()
    woken: list[int] = []
    writer.wake = lambda: woken.append(len(writer.backlog))
    earlier = b""
    with contextlib.suppress(BlockingIOError):
        while True:  # a client that has not read earlier answers: its socket is full
            earlier += b"e" * left.send(b"e" * 65536)
    with DELIVERY:  # an engine reader's delivery
        assert writer.write(b"x")
        assert writer.write(b"yz")  # the same stream twice in one delivery (a lagging reader)
        assert woken == []
    assert bytes(writer.backlog) == b"1\r\nx\r\n2\r\nyz\r\n"  # both, in order
    assert woken and woken[0] > 0  # woken with the backlog there, for it to flush
    assert not writer.write(b"w")  # behind the backlog, as any later chunk
    received = b""
    while len(received) < len(earlier):
        received += right.recv(65536)
    assert received == earlier  # nothing of the held chunks went out of order
    left.close()
    right.close()


def test_two_chunks_of_one_stream_in_one_delivery_go_out_in_one_write_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A reader that fell behind delivers two messages with a row for the same stream at once:
    # one write for both, so no second write can overtake the rest of a first one the kernel
    # took only in part (the client may read in between: it runs on another core).
    writer, left, right = _writer_on_a_socket_pair()
    calls: list[bytes] = []

    def partial(fd: int, data: Any) -> int:
        calls.append(bytes(data))
        return 3

    monkeypatch.setattr(os, "write", partial)
    with DELIVERY:  # an engine reader's delivery
        assert writer.write(b"abc")
        assert writer.write(b"de")
        assert DELIVERY.held == [writer]  # the writer once
    assert calls == [b"3\r\nabc\r\n2\r\nde\r\n"]
    assert bytes(writer.backlog) == b"abc\r\n2\r\nde\r\n"  # the rest, in order
    left.close()
    right.close()


def test_a_delivery_holds_at_most_held_max_writes_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # A pacer tick at 10,000 streams releases thousands at once: their writes go out in
    # batches of HELD_MAX, in order, while the delivery stays open.
    pairs = [_writer_on_a_socket_pair() for _ in range(HELD_MAX + 1)]
    writes = _recorded_writes(monkeypatch)
    try:
        with DELIVERY:  # an engine reader's delivery
            for k, (writer, _, _) in enumerate(pairs[: HELD_MAX - 1]):
                assert writer.write(b"%d" % k)
            assert writes == []
            assert pairs[HELD_MAX - 1][0].write(b"x")  # the HELD_MAX-th: all go out, in order
            expected = [b"%x\r\n%d\r\n" % (len(b"%d" % k), k) for k in range(HELD_MAX - 1)]
            assert writes == [*expected, b"1\r\nx\r\n"]
            assert DELIVERY.open and DELIVERY.held == []
            assert pairs[HELD_MAX][0].write(b"last")  # held again: the delivery is open
            assert len(writes) == HELD_MAX
        assert writes[HELD_MAX:] == [b"4\r\nlast\r\n"]
    finally:
        for _, left, right in pairs:
            left.close()
            right.close()


def test_a_held_write_to_a_closed_client_marks_the_writer_broken_and_wakes_the_task() -> None:
    writer, left, right = _writer_on_a_socket_pair()
    woken: list[bool] = []
    writer.wake = lambda: woken.append(writer.broken)
    right.close()
    with DELIVERY:  # an engine reader's delivery
        assert writer.write(b"z")
    assert writer.broken
    assert woken == [True]
    assert not writer.write(b"after")  # broken: refused at once, delivery or not
    left.close()


def test_a_stalled_writer_is_not_held_by_a_delivery() -> None:
    writer, left, right = _writer_on_a_socket_pair()
    writer.hold()  # a send through hypercorn's path is under way
    with DELIVERY:  # an engine reader's delivery
        assert not writer.write(b"x")  # refused at once: the task flushes it after the send
        assert DELIVERY.held == []
    assert bytes(writer.backlog) == b"1\r\nx\r\n"
    writer.release()
    left.close()
    right.close()


async def test_a_send_on_the_connections_own_path_holds_its_direct_writer() -> None:
    # The connection's slow path (a partial write, h11's own sends) holds the writer: a direct
    # chunk written meanwhile waits behind it instead of overtaking it on the wire.
    writer, left, right = _writer_on_a_socket_pair()
    send, receive = trio.testing.lockstep_stream_pair()  # send_all waits for the reader
    conn = worker_loop.DirectSendTCPServer(None, HypercornConfig(), None, {}, send)
    conn.direct_writer = writer
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.protocol_send, RawData(data=b"head"))
        await trio.testing.wait_all_tasks_blocked()  # in send_all, holding the writer
        try:
            assert not writer.write(b"x")
            assert bytes(writer.backlog) == b"1\r\nx\r\n"
        finally:  # the send is shielded: it ends only once read, whatever the test found
            assert await receive.receive_some() == b"head"
    assert not writer.write(b"y")  # the backlog is the task's to flush: still behind it
    with pytest.raises(BlockingIOError):
        right.recv(100, socket.MSG_DONTWAIT)
    left.close()
    right.close()


# --------------------------------------------------------------------------- end to end


async def test_a_stream_is_written_directly_with_the_same_text_and_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = FakeEngine(behaviour=Behaviour(step_s=0.002))
    async with serving(engine) as port:
        fallbacks = SendPathCounter(monkeypatch)
        events = await post_sse(
            port, "/v1/completions", _completion(60, stream_options={"include_usage": True})
        )
        direct_count = fallbacks.count
        # The same request, not streamed (so never written directly), gives the same text.
        reference = await _reference_text(port, 60)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 60
    assert _text(events) == reference
    # 60 tokens in ~60 events, yet hypercorn's send path carried only connection events and
    # the end: everything before it went straight to the socket.
    assert len(events) > 40
    assert direct_count <= 8, direct_count


@pytest.mark.parametrize("fast_path", [True, False])
async def test_h11_carries_only_the_head_and_the_terminator_of_a_direct_stream(
    monkeypatch: pytest.MonkeyPatch, fast_path: bool
) -> None:
    # Every event is written past h11, and the last one goes out with the end in one chunk.
    # On smgd's fast path h11 carries nothing at all (the first event takes the head along);
    # on hypercorn's, the head (held for the first event, which the stream's task then
    # flushes behind it) and the end.
    sent: list[type] = []
    original = H11Protocol._send_h11_event

    async def recording(protocol: H11Protocol, event: Any) -> None:
        sent.append(type(event))
        await original(protocol, event)

    monkeypatch.setattr(H11Protocol, "_send_h11_event", recording)
    if not fast_path:
        monkeypatch.setattr(worker_loop.DirectSendTCPServer, "_fast_path", lambda server: None)
    engine = FakeEngine(behaviour=Behaviour(step_s=0.002))
    async with serving(engine) as port, await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(post_bytes("/v1/completions", _completion(20)))
        data = bytearray()
        while not data.endswith(b"\r\n0\r\n\r\n"):
            data += await stream.receive_some(65536)
        # The client has the whole body (the reader wrote its end); h11 ends it after that,
        # on a connection that stays open (one closed at once may cancel that first).
        await trio.testing.wait_all_tasks_blocked()
    body = dechunk(bytes(data).partition(b"\r\n\r\n")[2])
    assert body.endswith(b"data: [DONE]\n\n") and body.count(b"data: ") > 10
    assert sent == ([] if fast_path else [h11.Response, h11.EndOfMessage])


async def test_the_end_and_terminator_go_out_with_the_last_event_and_h11_adds_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The reader writes last event + usage + [DONE] + the body's terminator in one write; h11's
    # own terminator is dropped, or the next response on the connection would be corrupt.
    writes = _recorded_writes(monkeypatch)
    engine = FakeEngine(behaviour=Behaviour(step_s=0.002))
    client = h11.Connection(h11.CLIENT)
    bodies: list[bytes] = []
    async with serving(engine) as port:
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", port))
        async with trio.SocketStream(sock) as stream:
            for _ in range(3):  # one keep-alive connection
                payload = json.dumps(_completion(6, stream_options={"include_usage": True}))
                headers = [("host", "x"), ("content-type", "application/json")]
                headers.append(("content-length", str(len(payload))))
                request = h11.Request(method="POST", target="/v1/completions", headers=headers)
                await stream.send_all(
                    client.send(request)
                    + client.send(h11.Data(data=payload.encode()))
                    + client.send(h11.EndOfMessage())
                )
                body = b""
                while True:
                    event = client.next_event()
                    if event is h11.NEED_DATA:
                        client.receive_data(await stream.receive_some(65536))
                    elif type(event) is h11.Response:
                        assert event.status_code == 200
                    elif type(event) is h11.Data:
                        body += event.data
                    elif type(event) is h11.EndOfMessage:
                        break
                bodies.append(body)
                client.start_next_cycle()
    assert all(b.endswith(b"data: [DONE]\n\n") and b.count(b"[DONE]") == 1 for b in bodies)
    ends = [w for w in writes if w.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")]
    assert len(ends) == 3, writes[-4:]
    assert b"0\r\n\r\n" not in writes  # never a terminator on its own


# Server-side types (h11 is on both sides: the test's httpx client has cycles of its own; the
# server's h11 objects hang off hypercorn's protocol objects, which would show).
_SERVER_SIDE = ("smgd.", "hypercorn.")


async def test_a_finished_direct_stream_leaves_no_reference_cycle_behind() -> None:
    # A request's objects caught in a cycle wait for the cyclic GC instead of being freed at
    # once; at C=256, M=8 a closure cycle in the direct sink (sink -> release -> sink) made the
    # GC ~13 % of smgd's CPU. Its connection's objects count too (each request here comes on a
    # connection of its own): the GC's middle generation runs rarely (GC_THRESHOLDS), so a
    # cycle per connection would pile up there.
    engine = FakeEngine(behaviour=Behaviour(step_s=0.002))
    async with serving(engine) as port:
        await post_sse(port, "/v1/completions", _completion(5))  # warm-up: imports, caches
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(3):
                events = await post_sse(port, "/v1/completions", _completion(5))
                assert events[-1] == "[DONE]"
                assert await _reference_text(port, 5)  # and the non-streamed path
            await trio.sleep(0.05)  # the streams' tasks finish after the client saw the end
            gc.collect()
            leaked = collections.Counter(
                f"{type(o).__module__}.{type(o).__qualname__}"
                for o in gc.garbage
                if type(o).__module__.startswith(_SERVER_SIDE)
            )
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert not leaked, leaked


async def test_a_stream_whose_engine_dies_before_its_first_token_moves_to_another() -> None:
    bad = DiesBeforeFirstToken("a")
    good = FakeEngine("b", behaviour=Behaviour(step_s=0.002))
    async with serving(bad, good) as port:
        events = await post_sse(port, "/v1/completions", _completion(12))
    assert len(bad.requests) == 1 and len(good.requests) == 1
    assert not any("error" in e for e in events if isinstance(e, dict))
    assert events[-2]["choices"][0]["finish_reason"] == "length"


async def test_a_loaded_loop_merges_direct_events_without_losing_a_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Keep the pacer saturated, its window at 30 ms between events, while the engine makes a
    # token every 2 ms: each direct event must carry several tokens.
    _saturate(monkeypatch, 0.03)
    engine = FakeEngine(behaviour=Behaviour(step_s=0.002))
    async with serving(engine) as port:
        reference = await _reference_text(port, 120)
        fallbacks = SendPathCounter(monkeypatch)
        events = await post_sse(
            port, "/v1/completions", _completion(120, stream_options={"include_usage": True})
        )
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 120
    assert _text(events) == reference
    # ~240 ms of output in 30 ms windows: far fewer events than tokens, still written directly.
    assert len(events) < 40, len(events)
    assert fallbacks.count <= 8, fallbacks.count


async def test_a_saturated_loop_never_holds_back_a_streams_first_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The window merges output that follows an event too closely; before the first event
    # there is nothing to follow, and holding the first token would only add to TTFT.
    _saturate(monkeypatch, 1.0)
    engine = FakeEngine(behaviour=Behaviour(step_s=0.002))
    async with serving(engine) as port:
        await trio.sleep(0.1)  # a few pacer ticks: it reads saturated from now on
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        request = post_bytes("/v1/completions", _completion(200))  # ~0.4 s of tokens
        async with stream:
            sent_at = trio.current_time()
            await stream.send_all(request)
            data = bytearray()
            while b'"text":"' not in data.replace(b'"text":""', b""):
                chunk = await stream.receive_some(65536)
                assert chunk, "the server closed the connection before the first token"
                data += chunk
            first_token_s = trio.current_time() - sent_at
    # Held, it would come with the finish (~0.4 s) or at the window (1 s).
    assert first_token_s < 0.2, first_token_s


async def test_a_client_that_does_not_read_gets_every_event_in_order_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = FakeEngine(behaviour=Behaviour(step_s=0.0005, tokens_per_step=1))
    tokens = 2000
    async with serving(engine) as port:
        reference = await _reference_text(port, tokens, http_timeout_s=30)
        fallbacks = SendPathCounter(monkeypatch)
        # A tiny receive buffer and a pause: the kernel soon refuses more, writes back up.
        events = await post_sse(
            port,
            "/v1/completions",
            _completion(tokens, stream_options={"include_usage": True}),
            rcvbuf=4096,
            pause_s=1.5,
        )
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == tokens
    assert _text(events) == reference  # none lost, none twice, in order
    # The backlog was flushed through hypercorn's waiting path (each flush takes all of it).
    assert fallbacks.count >= 1


async def test_a_stop_string_mid_stream_ends_it_and_aborts_the_engine() -> None:
    engine = FakeEngine(behaviour=Behaviour(step_s=0.002))
    async with serving(engine) as port:
        full = _text(await post_sse(port, "/v1/completions", _completion(40)))
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        cut = full[: full.index(stop)]
        events = await post_sse(port, "/v1/completions", _completion(40, stop=[stop]))
        with trio.fail_after(2):
            await engine.wait_abort(engine.requests[-1].rid)
    assert _text(events) == cut
    finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"]]
    assert finishes[-1] == "stop"


async def test_a_client_hanging_up_mid_stream_aborts_the_engine_request() -> None:
    engine = FakeEngine(behaviour=Behaviour(step_s=0.005))
    async with serving(engine) as port:
        await post_sse(port, "/v1/completions", _completion(1000), read_events=10)
        with trio.fail_after(2):
            await engine.wait_abort(engine.requests[-1].rid)


async def test_an_engine_death_mid_stream_ends_with_an_error_event() -> None:
    engine = FakeEngine(behaviour=Behaviour(step_s=0.002, die_after=20))
    async with serving(engine) as port:
        events = await post_sse(port, "/v1/completions", _completion(100))
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and "crashed" in errors[0]["message"]
    assert len(_text(events)) > 0


async def test_chat_streams_directly_with_role_first_and_usage_last() -> None:
    engine = FakeEngine(behaviour=Behaviour(step_s=0.002))
    async with serving(engine) as port:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 30,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events = await post_sse(port, "/v1/chat/completions", body)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["usage"]["completion_tokens"] == 30
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])


async def test_a_failure_behind_a_backlog_still_sends_every_earlier_byte_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from smgd.api.handlers import openai
    from smgd.api.http import direct

    engine = FakeEngine(behaviour=Behaviour(step_s=0.0, tokens_per_step=1))
    tokens = 2000
    async with serving(engine) as port:
        reference = await _reference_text(port, tokens, http_timeout_s=30)
        armed = [False]
        real_write, real_delta = direct.DirectWriter.write, openai.OpenAIRenderer.delta

        def write(self: DirectWriter, payload: bytes) -> bool:
            took = real_write(self, payload)
            armed[0] = armed[0] or not took  # the first event that went to the backlog
            return took

        def delta(self: Any, choice: Any, text: str) -> bytes:
            if armed[0]:  # the very next event, before the stream's task could flush
                raise RuntimeError("renderer broke")
            return real_delta(self, choice, text)

        monkeypatch.setattr(direct.DirectWriter, "write", write)
        monkeypatch.setattr(openai.OpenAIRenderer, "delta", delta)
        # Every event through delta(), not the sink's own frame for mid-stream text.
        monkeypatch.setattr(openai.OpenAIRenderer, "text_frame", lambda self, choice: None)
        # The client does not read at first, so written events wait in the backlog when the
        # renderer fails; they must reach the client whole, and before the error event.
        events = await post_sse(
            port, "/v1/completions", _completion(tokens), rcvbuf=4096, pause_s=1.0
        )
    assert armed[0]
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and "RuntimeError" in errors[0]["message"], errors
    assert events[-2] == {"error": errors[0]} and events[-1] == "[DONE]"
    text = _text(events)
    assert len(text) > 100 and reference.startswith(text)  # in order, nothing lost before it


# --------------------------------------------------------------------------- keep-alive


@pytest.mark.parametrize(("interval_s", "fewest", "most"), [(0.05, 3, 8), (0.0, 0, 0)])
async def test_a_direct_stream_waiting_for_its_first_token_sends_keep_alives(
    interval_s: float, fewest: int, most: int
) -> None:
    # A 0.3 s prefill: one comment per interval until the first event (none when off).
    engine = FakeEngine(behaviour=Behaviour(first_step_s=0.3, step_s=0.001))
    server = ServerConfig(keepalive_interval_s=interval_s)
    async with serving(engine, server=server) as port:
        body, _ = await post_raw(port, "/v1/completions", _completion(3))
    before, _, events = body.partition(b"data: ")
    assert before == KEEPALIVE * before.count(KEEPALIVE)  # only comments before the first event
    assert fewest <= before.count(KEEPALIVE) <= most, body
    assert KEEPALIVE not in events  # the tokens then flowed without a pause
    assert events.endswith(b"data: [DONE]\n\n")


async def test_a_direct_stream_whose_tokens_flow_sends_no_keep_alive() -> None:
    # A token every 10 ms for 0.6 s with a 50 ms interval: the stream's task wakes at each
    # interval (the reader writes the events), and must see that events went out meanwhile.
    engine = FakeEngine(behaviour=Behaviour(step_s=0.01))
    async with serving(engine, server=ServerConfig(keepalive_interval_s=0.05)) as port:
        body, took = await post_raw(port, "/v1/completions", _completion(60))
    assert took > 0.3  # several intervals passed
    assert KEEPALIVE not in body
    assert body.count(b"data: ") > 30


# --------------------------------------------------------------------------- a finish is never held


@pytest.mark.parametrize(
    ("tokens", "events"),
    [
        # The finish comes 20 ms after the first event, inside the window: sent at once.
        (2, 2),
        # The second token is held (inside the window); the finish, 20 ms later, goes out at
        # once with it rather than at the window's end: three tokens in two events.
        (3, 2),
    ],
)
async def test_a_saturated_loop_never_holds_back_a_finish(
    monkeypatch: pytest.MonkeyPatch, tokens: int, events: int
) -> None:
    window_s = 1.0
    _saturate(monkeypatch, window_s)
    engine = FakeEngine(behaviour=Behaviour(step_s=0.02))
    async with serving(engine) as port:
        reference = await _reference_text(port, tokens)
        await trio.sleep(0.1)  # a few pacer ticks: it reads saturated from now on
        body, took = await post_raw(port, "/v1/completions", _completion(tokens))
    chunks = [json.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
    assert len(chunks) == events
    assert _text(chunks) == reference
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert took < window_s / 2, took  # held, the end would come at the window's end
