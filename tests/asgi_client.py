"""An in-process ASGI client for the HTTP tests: the app called as hypercorn calls it, no sockets.

:func:`lifespan` runs an app's ASGI lifespan around a block (startup before it, shutdown after
it); :func:`request` sends one whole request and collects the answer; :func:`connect` opens a
request whose body the test reads message by message, and may hang up on.

The app's ``send`` goes into a channel of :data:`CLIENT_BUFFER` messages, so a client that
stops reading stops the app's writes, as a full socket would.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

Message = dict[str, Any]
App = Any  # an ASGI application: (scope, receive, send) -> None

# Body messages the client holds before the app's next send waits (a socket's buffer, roughly).
CLIENT_BUFFER = 10


@asynccontextmanager
async def lifespan(app: App) -> AsyncIterator[None]:
    """Run ``app``'s lifespan: startup completes before the block, shutdown after it."""
    to_app, app_receives = trio.open_memory_channel[Message](math.inf)
    app_sends, from_app = trio.open_memory_channel[Message](math.inf)
    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app, scope, app_receives.receive, app_sends.send)
        to_app.send_nowait({"type": "lifespan.startup"})
        with trio.fail_after(5):
            started = await from_app.receive()
        assert started["type"] == "lifespan.startup.complete", started
        try:
            yield
        finally:
            to_app.send_nowait({"type": "lifespan.shutdown"})
            with trio.CancelScope(shield=True), trio.fail_after(5):
                stopped = await from_app.receive()
            assert stopped["type"] == "lifespan.shutdown.complete", stopped


def http_scope(
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    *,
    length: int | None = None,
    query: bytes = b"",
    http_version: str = "1.1",
) -> dict[str, Any]:
    """An ASGI HTTP scope as hypercorn builds it (header names lower case)."""
    raw = [(b"host", b"test")]
    raw += [(k.lower().encode(), v.encode("latin-1")) for k, v in (headers or {}).items()]
    if length is not None:
        raw.append((b"content-length", str(length).encode()))
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": http_version,
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": raw,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8080),
        "extensions": {},
    }


@dataclass
class Answer:
    """One response as the client saw it."""

    status: int
    headers: list[tuple[str, str]]  # in the order sent, names lower case
    body: bytes
    ended: bool  # the last body message said no more body

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name.lower()), None)


class Connection:
    """One request in flight: send its body, read its answer body message by message."""

    def __init__(self, app: App, scope: dict[str, Any]) -> None:
        self._app = app
        self._scope = scope
        self._to_app, self._app_receives = trio.open_memory_channel[Message](math.inf)
        self._app_sends, self._from_app = trio.open_memory_channel[Message](CLIENT_BUFFER)
        self.status: int | None = None
        self.headers: list[tuple[str, str]] = []
        self.ended = False
        self.started_at: float | None = None  # trio's clock when the response start came

    def send(self, data: bytes, *, more: bool = False) -> None:
        self._to_app.send_nowait({"type": "http.request", "body": data, "more_body": more})

    def disconnect(self) -> None:
        """Hang up: the app's next ``receive`` says so."""
        self._to_app.send_nowait({"type": "http.disconnect"})

    async def receive(self) -> bytes:
        """The next body message's bytes; EndOfChannel once the body ended (or none will come)."""
        while not self.ended:
            message = await self._from_app.receive()
            if message["type"] == "http.response.start":
                assert self.status is None, "two response starts"
                self.status = message["status"]
                self.started_at = trio.current_time()
                self.headers = [(k.decode(), v.decode("latin-1")) for k, v in message["headers"]]
            elif message["type"] == "http.response.body":
                assert self.status is not None, "a body before the response start"
                self.ended = not message.get("more_body", False)
                return bytes(message.get("body", b""))
        raise trio.EndOfChannel

    async def read_all(self) -> bytes:
        data = bytearray()
        while True:
            try:
                data += await self.receive()
            except trio.EndOfChannel:
                return bytes(data)

    async def _run(self) -> None:
        try:
            await self._app(self._scope, self._app_receives.receive, self._app_sends.send)
        finally:
            self._app_sends.close()  # the client's receive ends once it read what was sent


@asynccontextmanager
async def connect(app: App, scope: dict[str, Any]) -> AsyncIterator[Connection]:
    """A request to ``app``; leaving the block waits for the app's call to return."""
    conn = Connection(app, scope)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn._run)
        yield conn


async def request(
    app: App,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    *,
    parts: int = 1,
    query: bytes = b"",
) -> Answer:
    """Send one whole request (its body in ``parts`` messages) and read the whole answer."""
    scope = http_scope(method, path, headers, length=len(body), query=query)
    step = max(1, math.ceil(len(body) / parts))
    pieces = [body[i : i + step] for i in range(0, len(body), step)] or [b""]
    async with connect(app, scope) as conn:
        for i, piece in enumerate(pieces):
            conn.send(piece, more=i < len(pieces) - 1)
        data = await conn.read_all()
    assert conn.status is not None, "no response"
    return Answer(conn.status, conn.headers, data, conn.ended)
