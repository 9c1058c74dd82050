"""smgd's hypercorn worker loop: direct socket writes, their fallback, and shutdown."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from hypercorn.config import Config

from smgd.api import http_worker

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


async def _get(port: int, path: str) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        data = bytearray()
        while not data.endswith(b"\r\n0\r\n\r\n"):
            chunk = await stream.receive_some(1 << 20)
            assert chunk, "connection closed before the body ended"
            data += chunk
    head, _, chunked = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    return dechunk(chunked)


async def test_chunks_arrive_whole_and_in_order_mostly_by_direct_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counts = SendPathCounter(monkeypatch)
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(http_worker.serve, app, _config())
        port = int(binds[0].rsplit(":", 1)[1])
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
        binds = await nursery.start(http_worker.serve, app, _config())
        port = int(binds[0].rsplit(":", 1)[1])
        body = await _get(port, "/big")
        nursery.cancel_scope.cancel()
    assert body == bytes(range(256)) * (BIG // 256)
    assert counts.count >= 1  # the rest of the partial write went the slow way


async def test_the_shutdown_trigger_stops_accepting_and_serve_returns() -> None:
    stop = trio.Event()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                lambda **kw: http_worker.serve(app, _config(), shutdown_trigger=stop.wait, **kw)
            )
            port = int(binds[0].rsplit(":", 1)[1])
            assert await _get(port, "/stream")
            stop.set()
        # serve() returned by itself (the nursery was not cancelled): the listener is closed.
        with pytest.raises(OSError, match=r"refused|all attempts"):
            await trio.open_tcp_stream("127.0.0.1", port)


def test_write_now_is_zero_for_a_stream_without_a_socket() -> None:
    assert http_worker._write_now(object(), b"x") == 0
