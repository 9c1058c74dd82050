"""smgd's hypercorn worker loop: direct socket writes, their fallback, and shutdown."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.protocol import ProtocolWrapper

from smgd.api.http import worker_loop
from smgd.daemon import DRAIN_MARGIN_S

from .http_helpers import SendPathCounter, dechunk

CHUNKS = 200
# Larger than any loopback socket buffer, so os.write takes only part of it.
BIG = 32 * 1024 * 1024


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    if scope["path"] == "/big":
        body = bytes(range(256)) * (BIG // 256)
        await send({"type": "http.response.body", "body": body, "more_body": True})
    else:
        for i in range(CHUNKS):
            await send({"type": "http.response.body", "body": b"%d;" % i, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _config() -> Config:
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.graceful_timeout = 1
    return config


async def _serve(
    nursery: trio.Nursery,
    asgi_app: Any,
    config: Config,
    stop: trio.Event | None = None,
) -> int:
    """Start ``worker_loop.serve`` in ``nursery`` (stopping on ``stop``, if given); its port."""
    trigger = None if stop is None else stop.wait
    binds = await nursery.start(
        partial(worker_loop.serve, asgi_app, config, shutdown_trigger=trigger)
    )
    return int(binds[0].rsplit(":", 1)[1])


async def _request(stream: trio.SocketStream, path: str = "/stream", extra: str = "") -> bytes:
    """One request on an open connection: a 200 response; its dechunked body."""
    await stream.send_all(f"GET {path} HTTP/1.1\r\nhost: x\r\n{extra}\r\n".encode())
    data = bytearray()
    while not data.endswith(b"\r\n0\r\n\r\n"):
        chunk = await stream.receive_some(1 << 20)
        assert chunk, "connection closed before the body ended"
        data += chunk
    head, _, chunked = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    return dechunk(chunked)


async def _get(port: int, path: str) -> bytes:
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        return await _request(stream, path)


async def test_chunks_arrive_whole_and_in_order_mostly_by_direct_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counts = SendPathCounter(monkeypatch)
    async with trio.open_nursery() as nursery:
        port = await _serve(nursery, app, _config())
        body = await _get(port, "/stream")
        nursery.cancel_scope.cancel()
    assert body == b"".join(b"%d;" % i for i in range(CHUNKS))
    # Head + 200 chunks + end were written; hypercorn's own path saw only the odd one out
    # (connection events, a write that met a full buffer), not one per chunk.
    assert counts.count < CHUNKS // 4


async def test_a_partial_write_is_finished_by_hypercorns_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counts = SendPathCounter(monkeypatch)
    async with trio.open_nursery() as nursery:
        port = await _serve(nursery, app, _config())
        body = await _get(port, "/big")
        nursery.cancel_scope.cancel()
    assert body == bytes(range(256)) * (BIG // 256)
    assert counts.count >= 1  # the rest of the partial write went the slow way


async def test_the_shutdown_trigger_stops_accepting_and_serve_returns() -> None:
    stop = trio.Event()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, app, _config(), stop)
            assert await _get(port, "/stream")
            stop.set()
        # serve() returned by itself (the nursery was not cancelled): the listener is closed.
        with pytest.raises(OSError, match=r"refused|all attempts"):
            await trio.open_tcp_stream("127.0.0.1", port)


def test_write_now_is_zero_for_a_stream_without_a_socket() -> None:
    conn = worker_loop.DirectSendTCPServer(None, Config(), None, {}, object())
    assert conn.socket_fileno() == -1
    assert worker_loop._write_now(conn.socket_fileno, b"x") == 0


# -- keep-alive: smgd's KeepAliveTimer in place of hypercorn's per-request idle task --------

KEEP_ALIVE_S = 10.0


async def _closed_by_server(stream: trio.SocketStream) -> bool:
    try:
        return await stream.receive_some(1 << 16) == b""
    except trio.BrokenResourceError:
        return True


def _keep_alive_config() -> Config:
    config = _config()
    config.keep_alive_timeout = KEEP_ALIVE_S
    config.graceful_timeout = 100  # longer than any response here
    return config


async def test_an_idle_connection_closes_after_keep_alive_timeout_counted_from_its_last_request(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        port = await _serve(nursery, app, _keep_alive_config())
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            await _request(stream)
            await trio.sleep(KEEP_ALIVE_S - 1)  # idle, but not long enough
            assert await _request(stream)  # still open; this request restarts the count
            last = trio.current_time()
            assert await _closed_by_server(stream)
            waited = trio.current_time() - last
        assert KEEP_ALIVE_S <= waited < KEEP_ALIVE_S + 1
        nursery.cancel_scope.cancel()


async def slow_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A response that takes three keep-alive timeouts to finish."""
    if scope["type"] == "lifespan":
        await app(scope, receive, send)
        return
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for i in range(3):
        await trio.sleep(KEEP_ALIVE_S)
        await send({"type": "http.response.body", "body": b"%d;" % i, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def test_a_request_longer_than_keep_alive_timeout_is_not_cut(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        port = await _serve(nursery, slow_app, _keep_alive_config())
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            with trio.fail_after(10 * KEEP_ALIVE_S):
                assert await _request(stream) == b"0;1;2;"  # the idle timer was armed first
                assert await _request(stream) == b"0;1;2;"
        nursery.cancel_scope.cancel()


async def test_shutdown_closes_an_idle_connection_at_once_and_a_busy_one_when_it_ends(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        port = await _serve(nursery, slow_app, _keep_alive_config(), stop)
        idle = await trio.open_tcp_stream("127.0.0.1", port)
        async with idle:
            assert await _request(idle) == b"0;1;2;"  # then it waits for its next request
            busy = await trio.open_tcp_stream("127.0.0.1", port)
            bodies: list[bytes] = []
            ended = trio.Event()

            async def busy_request() -> None:
                bodies.append(await _request(busy))
                ended.set()

            nursery.start_soon(busy_request)
            await trio.sleep(1)
            start = trio.current_time()
            stop.set()
            assert await _closed_by_server(idle)
            assert trio.current_time() - start < 1
            await ended.wait()
            # The busy connection's response ran to its end, then the connection closed.
            assert bodies == [b"0;1;2;"]
            assert await _closed_by_server(busy)
            assert trio.current_time() - start < 3 * KEEP_ALIVE_S
            await busy.aclose()


async def test_a_connection_the_server_closes_leaves_no_task_behind(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    # "connection: close" makes hypercorn close after the response, while its keep-alive timer
    # is stopped (a request ran). A timer task left waiting would hold the connection's task
    # group open, and shutdown would wait out the whole graceful timeout for it.
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        port = await _serve(nursery, app, _keep_alive_config(), stop)
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            assert await _request(stream, extra="connection: close\r\n")
            assert await _closed_by_server(stream)
        start = trio.current_time()
        stop.set()
    assert trio.current_time() - start < 1  # serve() returned without waiting


class _EofCounter:
    """Counts the EOFs the server's side of each connection sends (the client's are not)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.clients: set[int] = set()
        self.server_eofs = 0
        original = trio.SocketStream.send_eof

        async def send_eof(stream: trio.SocketStream) -> None:
            if id(stream) not in self.clients:
                self.server_eofs += 1
            await original(stream)

        monkeypatch.setattr(trio.SocketStream, "send_eof", send_eof)

    async def connect(self, port: int) -> trio.SocketStream:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        self.clients.add(id(stream))
        return stream


@pytest.mark.parametrize(("ender", "server_eofs"), [("client", 0), ("server", 1)])
async def test_a_connections_server_side_sends_an_eof_only_when_it_ends_it_and_once(
    monkeypatch: pytest.MonkeyPatch, ender: str, server_eofs: int
) -> None:
    # The client sent its EOF: the server has nothing left to read, and closing the socket
    # sends its FIN; a shutdown() first would be a system call for nothing. "connection:
    # close": hypercorn closes the connection after the response (its protocol_send(Closed())),
    # and the connection's run closes it again at its end; the EOF goes out once.
    eofs = _EofCounter(monkeypatch)
    async with trio.open_nursery() as nursery:
        port = await _serve(nursery, app, _config())
        async with await eofs.connect(port) as stream:
            if ender == "client":
                assert await _request(stream)
                await stream.send_eof()
            else:
                assert await _request(stream, extra="connection: close\r\n")
            with trio.fail_after(5):
                assert await _closed_by_server(stream)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert eofs.server_eofs == server_eofs


class _ProtocolCounter:
    """Counts the hypercorn protocols the connections build."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.built = 0
        counter = self

        class Counted(ProtocolWrapper):
            def __init__(self, *args: Any) -> None:
                counter.built += 1
                super().__init__(*args)

        monkeypatch.setattr(worker_loop, "ProtocolWrapper", Counted)


@pytest.mark.parametrize(
    ("extra", "built"),
    [
        ("", 0),  # every request on the fast path
        ("te: trailers\r\n", 1),  # a header the fast path leaves to h11: handed over
    ],
)
@pytest.mark.parametrize("ender", ["client", "idle"])
async def test_hypercorns_protocol_is_built_only_for_a_request_handed_to_it(
    monkeypatch: pytest.MonkeyPatch,
    socket_autojump_clock: trio.testing.MockClock,
    extra: str,
    built: int,
    ender: str,
) -> None:
    # Two requests, then the client's EOF or the keep-alive timeout: the connection closes
    # and its tasks end either way, with hypercorn's protocol built only when a request
    # needed it.
    protocols = _ProtocolCounter(monkeypatch)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        port = await _serve(nursery, app, _keep_alive_config(), stop)
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            for _ in range(2):
                assert await _request(stream, extra=extra) == b"".join(
                    b"%d;" % i for i in range(CHUNKS)
                )
            if ender == "client":
                await stream.send_eof()
            with trio.fail_after(KEEP_ALIVE_S + 1):
                assert await _closed_by_server(stream)
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        stop.set()
    assert trio.current_time() - start < 1  # no connection task was left behind
    assert protocols.built == built


# -- requests h11 refuses: the error envelope as the body, then the connection closes -------


async def _raw_answer(port: int, request: bytes) -> tuple[bytes, bytes]:
    """Send ``request`` bytes; (status line and headers, body) of the answer, read to EOF."""
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(request)
        data = bytearray()
        with trio.fail_after(5):
            while chunk := await stream.receive_some(1 << 16):  # EOF: the server closed it
                data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    return head, body


BIG_HEADER = b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (1 << 17) + b"\r\n\r\n"
BOTH_LENGTHS = (
    b"POST /stream HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n"
    b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n"
)


@pytest.mark.parametrize(
    ("request_bytes", "status", "message"),
    [
        (b"NOT AN HTTP REQUEST\r\n\r\n", 400, "malformed HTTP/1.1 request"),
        (BIG_HEADER, 431, "larger than 65536 bytes"),
        (b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\n", 501, "only chunked"),
        (BOTH_LENGTHS, 400, "both Content-Length and Transfer-Encoding"),
        # One that fits h11's incomplete-head limit in its first read and ends in the next:
        (b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n", 431,
         "larger than 65536 bytes"),
        # HTTP/2 with prior knowledge, and a version that does not exist: smgd speaks 1.1.
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505, "HTTP/2.0 is not supported"),
        (b"GET / HTTP/9.9\r\nhost: x\r\n\r\n", 505, "HTTP/9.9 is not supported"),
    ],
)  # fmt: skip
async def test_a_request_h11_refuses_gets_the_error_envelope_and_the_connection_closes(
    request_bytes: bytes, status: int, message: str
) -> None:
    config = _config()
    config.h11_max_incomplete_size = 1 << 16
    async with trio.open_nursery() as nursery:
        port = await _serve(nursery, app, config)
        head, body = await _raw_answer(port, request_bytes)
        nursery.cancel_scope.cancel()
    assert head.startswith(b"HTTP/1.1 %d " % status), head
    headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"connection"] == b"close"
    error = json.loads(body)["error"]
    assert message in error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] is None
    assert error["code"] is None


async def test_an_upgrade_to_h2c_is_ignored_and_answered_in_http_1_1() -> None:
    request = (
        b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: Upgrade, HTTP2-Settings\r\n"
        b"upgrade: h2c\r\nhttp2-settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\r\n"
    )
    async with trio.open_nursery() as nursery:
        port = await _serve(nursery, app, _config())
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            await stream.send_all(request)
            data = bytearray()
            with trio.fail_after(5):
                while b"\r\n\r\n" not in data:
                    data += await stream.receive_some(1 << 16)
        nursery.cancel_scope.cancel()
    assert data.startswith(b"HTTP/1.1 200 "), bytes(data)  # no 101 Switching Protocols


# -- the graceful deadline: responses still running are asked to end, then cut ---------------

GRACEFUL_S = 10.0


def endless_app(ended: trio.Event | None) -> Any:
    """A response that runs until ``ended`` is set (then writes "end;"), or forever."""

    async def serve_one(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await app(scope, receive, send)
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"start;", "more_body": True})
        if ended is None:
            await trio.sleep_forever()
        else:
            await ended.wait()
        await send({"type": "http.response.body", "body": b"end;", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return serve_one


async def _read_to_eof(stream: trio.SocketStream) -> bytes:
    data = bytearray()
    try:
        while chunk := await stream.receive_some(1 << 16):
            data += chunk
    except trio.BrokenResourceError:
        pass
    return bytes(data)


@pytest.mark.parametrize("ends", [True, False])
async def test_responses_running_at_the_graceful_deadline_are_ended_then_cut(
    socket_autojump_clock: trio.testing.MockClock, ends: bool
) -> None:
    ended = trio.Event()
    called_at: list[float] = []

    def end_responses() -> None:
        called_at.append(trio.current_time())
        if ends:
            ended.set()  # the app ends its responses (smgd's: an error event and [DONE])

    config = _config()
    config.graceful_timeout = GRACEFUL_S
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(
                worker_loop.serve,
                endless_app(ended if ends else None),
                config,
                shutdown_trigger=stop.wait,
                end_responses=end_responses,
            )
        )
        port = int(binds[0].rsplit(":", 1)[1])
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            assert b"start;" in await stream.receive_some(1 << 16)
            stop.set()
            stopped_at = trio.current_time()
            data = await _read_to_eof(stream)
            closed_at = trio.current_time()
    assert called_at == [pytest.approx(stopped_at + GRACEFUL_S)]
    if ends:
        # The response ended on the call: its last chunk and the body's end were written.
        assert data.endswith(b"4\r\nend;\r\n0\r\n\r\n")
        assert closed_at - called_at[0] < worker_loop.END_GRACE_S
    else:
        # It did not end: cut END_GRACE_S after the call, no end of body.
        assert not data.endswith(b"0\r\n\r\n")
        assert closed_at - called_at[0] == pytest.approx(worker_loop.END_GRACE_S, abs=0.1)


def test_the_daemon_waits_for_the_http_server_longer_than_its_end_grace() -> None:
    assert DRAIN_MARGIN_S > worker_loop.END_GRACE_S


async def addresses_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await app(scope, receive, send)
        return
    await receive()
    body = json.dumps({"client": scope["client"], "server": scope["server"]}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body, "more_body": False})


@pytest.mark.parametrize("fast", [True, False])
async def test_a_requests_scope_names_both_ends_of_its_connection(
    monkeypatch: pytest.MonkeyPatch, fast: bool
) -> None:
    """The fast path's scope carries the addresses hypercorn read from the socket."""
    if not fast:
        monkeypatch.setattr(worker_loop.DirectSendTCPServer, "_fast_path", lambda server: None)
    async with trio.open_nursery() as nursery:
        port = await _serve(nursery, addresses_app, _config())
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            ends = json.loads(await _request(stream, "/addr"))
            here = stream.socket.getsockname()
        nursery.cancel_scope.cancel()
    assert ends == {"client": ["127.0.0.1", here[1]], "server": ["127.0.0.1", port]}
