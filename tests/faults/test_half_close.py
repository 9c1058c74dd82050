"""Fault suite: clients that half-close after their request, and clients that reset mid-stream.

A client that sends its whole request and then shuts its sending side (``shutdown(SHUT_WR)``:
``nc -N``, some health checkers) looks, to a server reading the socket, exactly like one that
closed: the read ends. smgd treats both as the client going away, as nginx does (its 499):
the request is cancelled, its engine request aborted, and the request leaves a trace, its
log line saying ``client disconnected (499)`` and a 499 in ``smgd_http_requests_total`` when
no byte of its answer went out (docs/reference/http-api.md, "Client disconnects"). A route
that runs no engine work (``/health``) answers a half-closing client all the same.
"""

from __future__ import annotations

import re
import socket
import struct
from typing import TYPE_CHECKING

import pytest
import trio

from ..http_helpers import post_bytes
from .harness import Daemon, daemon_toml, mock_engine_toml, serve, until

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow

STEP_MS = 5.0
TOKENS = 4000  # 20 s of steps: a request the client left must not run until its end
# A request aborted on the engine leaves it within a few steps; one left running holds the
# gauge at 1 for TOKENS steps (20 s), far past this.
ABORTED_WITHIN_S = 3.0
READ_S = 5.0  # the daemon's answer to a client gone (its close) comes in milliseconds
HEALTH_PROBES = 10  # each got nothing about half the time: all 10 answered by chance ~0.3 %


def _metric(metrics: str, name: str, **labels: str) -> float:
    """The value of ``name``'s series with ``labels`` (0 when absent); prometheus_client
    writes a series' labels sorted by name."""
    want = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    for line in metrics.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _aborts(daemon: Daemon) -> list[str]:
    """The engine rids the mock engine logged an abort for."""
    return re.findall(r"\[e0\] .*smgd\.mock: abort (\S+)", daemon.log())


async def _raw(daemon: Daemon) -> trio.SocketStream:
    host, port = daemon.url.removeprefix("http://").rsplit(":", 1)
    return await trio.open_tcp_stream(host, int(port))


async def _read_to_eof(conn: trio.SocketStream) -> bytes:
    data = bytearray()
    with trio.fail_after(READ_S):
        while chunk := await conn.receive_some(65536):
            data += chunk
    return bytes(data)


async def _until_idle(daemon: Daemon) -> None:
    """Until no engine request is in flight: every request the clients left was aborted."""
    async with daemon.client() as client:

        async def idle() -> bool:
            metrics = (await client.get("/metrics")).text
            return _metric(metrics, "smgd_engine_requests_inflight", engine="e0") == 0

        await until(idle, ABORTED_WITHIN_S)


async def _first_event(conn: trio.SocketStream) -> bytes:
    data = bytearray()
    with trio.fail_after(READ_S):
        while b"data: " not in data:
            chunk = await conn.receive_some(65536)
            assert chunk, f"closed before the first event: {bytes(data)!r}"
            data += chunk
    return bytes(data)


def _completion(stream: bool) -> bytes:
    body = {"model": "m", "prompt": "half closed", "max_tokens": TOKENS, "stream": stream}
    return post_bytes("/v1/completions", body)


async def test_a_client_that_half_closes_after_its_request_gets_it_dropped_and_logged(
    tmp_path: Path,
) -> None:
    """Non-streamed and streamed (before and after its first event), each request half-closed
    by its client: the client reads the connection's end and nothing else (no answer head,
    or the stream cut after what had gone out), the engine is left with nothing in flight
    within a few steps (it would run 20 s), each request's log line says
    ``client disconnected (499)``, and the two left before any byte of their answer count as
    499 in ``smgd_http_requests_total``, the one left mid-stream as the 200 it had begun.
    Health probes half-closed the same way each get their 200."""
    config = daemon_toml(mock_engine_toml("e0", "m", step_ms=STEP_MS))
    async with serve(tmp_path, config) as daemon:
        # Not streamed: the request is whole, then the client shuts its sending side.
        conn = await _raw(daemon)
        await conn.send_all(_completion(stream=False))
        await conn.send_eof()
        assert await _read_to_eof(conn) == b""
        await conn.aclose()
        # Streamed, half-closed at once (before its first event: no head went out).
        conn = await _raw(daemon)
        await conn.send_all(_completion(stream=True))
        await conn.send_eof()
        assert await _read_to_eof(conn) == b""
        await conn.aclose()
        # Streamed, half-closed once its first event came: the stream stops there, unended.
        conn = await _raw(daemon)
        await conn.send_all(_completion(stream=True))
        begun = await _first_event(conn)
        assert begun.startswith(b"HTTP/1.1 200 "), begun
        await conn.send_eof()
        rest = begun + await _read_to_eof(conn)
        assert not rest.endswith(b"0\r\n\r\n"), "the stream ended as if served"
        await conn.aclose()
        await _until_idle(daemon)

        async def three_lines() -> bool:
            return daemon.log().count("client disconnected") == 3

        await until(three_lines, READ_S)
        for line in daemon.log().splitlines():
            if "client disconnected" in line:
                assert "(499)" in line, line
        async with daemon.client() as client:
            metrics = (await client.get("/metrics")).text
        route = {"route": "/v1/completions", "method": "POST"}
        assert _metric(metrics, "smgd_http_requests_total", **route, status="499") == 2, metrics
        assert _metric(metrics, "smgd_http_requests_total", **route, status="200") == 1, metrics
        # The one whose engine request ran counts as the client's disconnect; the others, if
        # the client's end was read before they reached the engine, never ran there.
        aborts = _metric(metrics, "smgd_aborts_total", reason="client_disconnect")
        assert 1 <= aborts <= 3, metrics

        async def engine_told() -> bool:  # the mock's log comes through smgd's, a bit later
            return len(_aborts(daemon)) == aborts

        await until(engine_told, READ_S)
        # A route that runs no engine work answers a half-closing client (a health checker's
        # `nc -N`) every time: it got nothing when the daemon read the end first.
        for _ in range(HEALTH_PROBES):
            conn = await _raw(daemon)
            await conn.send_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            await conn.send_eof()
            answer = await _read_to_eof(conn)
            assert answer.startswith(b"HTTP/1.1 200 "), answer
            await conn.aclose()
        # The daemon serves on.
        async with daemon.client() as client:
            body = {"model": "m", "prompt": "again", "max_tokens": 3}
            reply = await client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text


async def test_a_client_that_resets_mid_stream_gets_its_request_aborted_and_logged(
    tmp_path: Path,
) -> None:
    """A streamed request whose client resets the connection (``SO_LINGER`` 0, then close)
    once its first event came: the engine request is aborted (the mock logs it; nothing is
    left in flight) and the request's log line says ``client disconnected (499)``."""
    config = daemon_toml(mock_engine_toml("e0", "m", step_ms=STEP_MS))
    async with serve(tmp_path, config) as daemon:
        conn = await _raw(daemon)
        await conn.send_all(_completion(stream=True))
        await _first_event(conn)
        conn.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.socket.close()  # an RST, not a FIN
        await _until_idle(daemon)

        async def logged() -> bool:
            return "client disconnected (499)" in daemon.log()

        async def engine_told() -> bool:
            return len(_aborts(daemon)) == 1

        await until(logged, READ_S)
        await until(engine_told, READ_S)
        assert "Traceback" not in daemon.log()
