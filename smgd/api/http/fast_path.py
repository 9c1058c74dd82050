"""smgd's HTTP/1.1 fast path: common requests served beside hypercorn, without h11.

Per request, h11's parsing and response head and hypercorn's stream machinery (a scope, a
channel and a task through ``spawn_app``, the ASGI send path through ``HTTPStream`` and
``H11Protocol``) took about half of a short request's CPU (docs/performance.md). When a burst
of requests arrives at once, as it does whenever many streams end in the same engine step,
that CPU is what the last request of the burst waits for: it sets TTFT at high concurrency.

A connection of smgd's worker loop (:class:`smgd.api.http.worker_loop.DirectSendTCPServer`)
reads into a :class:`FastPath` first. A request head of the common shape
(:func:`smgd.api.http.h1.parse_head`) starts the ASGI app at once: a scope like hypercorn's,
the body's messages in an inbox of its own (``receive`` is the inbox's, and the dispatcher
takes a queued body without a scheduler pass), and a ``send`` that writes the response head
(:func:`smgd.api.http.h1.response_head`) and the body's chunks straight to the socket through
the connection's direct write. Streams then write their events themselves
(:mod:`smgd.api.http.direct`), exactly as on hypercorn's path; a stream's first event takes
its response head along (the direct writer holds it), one write instead of two.

Everything else goes to hypercorn: the first time the buffer starts with a head that is not
of the common shape, the connection hands the buffered bytes to hypercorn's protocol and stays
with it. h11 has seen nothing of the connection until then, so it starts from a request
boundary in its first state, and answers (or refuses) the request as it always did.

A connection's fast-path requests run one after another in one task of its own (a task and
a cancel scope per request cost ~6 % of a short request's CPU), which the client's disconnect
cancels; a request that ends with the next one already buffered starts it there, without
waking the read loop.

What the fast path keeps from hypercorn: one request at a time per connection (a pipelined
request waits in the buffer until the response before it has ended); ``keep-alive`` (the worker
loop's reaper, :mod:`smgd.api.http.keep_alive`); a request's ``Connection: close`` and
``keep_alive_max_requests`` (then ``connection: close`` and the connection ends); the ``date``
and ``server`` headers of ``config``; closing after a response whose request body did not fully
arrive, after an app error, and once the server shuts down. A client that goes away ends the
request (``http.disconnect`` in its inbox, and the connection's ``on_disconnect``). With
``logging.access_log`` on, hypercorn writes the access log, so every request takes its path.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections import deque
from itertools import chain
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote

import trio
from hypercorn.events import Closed, RawData

from smgd.api.core.errors import http_error
from smgd.api.http.direct import CANCELLED_ON_DISCONNECT, RETRACT_HEAD, DirectWriter
from smgd.api.http.h1 import NEED_DATA, UNSUPPORTED, Head, parse_head, response_head

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from hypercorn.config import Config
    from hypercorn.events import Event

__all__ = ["LINGER_S", "Connection", "FastPath", "ServerHeaders"]

log = logging.getLogger("smgd.http")

_CHUNK_END = b"0\r\n\r\n"
# How long a connection that answered before its request's body ended (a 413) keeps reading
# and dropping that body before it closes: long enough for a client on the same host or LAN
# to finish sending and read the answer, short enough that a client that never stops sending
# holds nothing for long.
LINGER_S = 2.0
_ASGI = {"spec_version": "2.1", "version": "3.0"}


class Connection(Protocol):
    """What the fast path uses of its connection
    (:class:`smgd.api.http.worker_loop.DirectSendTCPServer`, which is above this module)."""

    app: Any
    config: Config
    context: Any
    idle_task: Any
    stream: Any
    client: tuple[str, int] | None
    server_addr: tuple[str, int] | None
    requests: int
    disconnected: bool
    on_disconnect: Callable[[], None] | None
    direct_writer: DirectWriter | None

    @property
    def task_group(self) -> Any: ...

    async def idle_timeout(self) -> None: ...

    def spawn(self, func: Callable[..., Awaitable[None]], *args: Any) -> None: ...

    def request_state(self) -> dict[str, Any]: ...

    def begin_request_now(self) -> bool:
        """Note a request's start (what ``idle_task.stop`` and ``context.mark_request`` do)
        without a checkpoint; False where that needs one (a per-worker request limit)."""
        ...

    async def protocol_send(self, event: Event) -> None: ...


class ServerHeaders:
    """``config.response_headers("h11")`` (``date``, ``server``), built once per second."""

    __slots__ = ("_config", "_headers", "_second")

    def __init__(self, config: Config) -> None:
        self._config = config
        self._second = -1
        self._headers: list[tuple[bytes, bytes]] = []

    def get(self) -> list[tuple[bytes, bytes]]:
        second = int(time.time())
        if second != self._second:
            self._headers = self._config.response_headers("h11")
            self._second = second
        return self._headers


class FastPath:
    """The fast path of one connection: its read buffer and the request that runs."""

    __slots__ = (
        "_body_left",
        "_closed",
        "_conn",
        "_fresh",
        "_headers",
        "_inbox",
        "_job",
        "_linger_until",
        "_lot",
        "_serving",
        "_waiting",
        "buffer",
        "busy",
        "close_asked",
        "ending",
        "off",
        "wake_scope",
    )

    def __init__(self, conn: Connection, headers: ServerHeaders) -> None:
        self._conn = conn
        self._headers = headers
        self.buffer = bytearray()
        self.busy = False  # a request's task runs
        self.off = False  # the connection went to hypercorn for good
        # The connection closes after the response just sent: nothing read from then on is
        # a request (RFC 9112 §9.6), and the rest of a request body still arriving is dropped
        # until the client closes or _linger_until passes (then the connection ends).
        self.ending = False
        self.close_asked = False  # the running request said `Connection: close`
        self._linger_until = math.inf
        self._body_left = 0  # bytes of the running request's body still to arrive
        self._inbox: _Inbox | None = None  # the running request's ASGI receive
        # The read loop's cancel scope (one for many requests: entering a trio scope per
        # request cost ~3 % of a short request's CPU), and whether the loop waits in it for
        # the socket, where a request's end may wake it (:meth:`wake_read_loop`).
        self.wake_scope: trio.CancelScope | None = None
        self._waiting = False
        # No read yet: a new connection's first request is nearly always there already.
        self._fresh = True
        # The connection's requests run one after another in one task (:meth:`_serve`),
        # started with the first: a task and a cancel scope per request cost ~6 % of a short
        # request's CPU. ``_job`` is the request it is to run next; it parks in ``_lot``.
        self._job: tuple[dict[str, Any], _Inbox] | None = None
        self._lot = trio.lowlevel.ParkingLot()
        self._serving = False
        self._closed = False  # no request comes any more: the request task ends

    async def receive(self, max_bytes: int) -> bytes:
        """The connection's next read. While a request runs, :meth:`wake_read_loop` may end
        it early, cancelling ``wake_scope``: the read loop then calls :meth:`advance` in a
        new scope before reading on. While ``ending``, what arrives is to be dropped, and b""
        (the end) comes at the linger deadline."""
        stream = self._conn.stream
        if self.ending:
            with trio.move_on_at(self._linger_until):
                return bytes(await stream.receive_some(max_bytes))
            return b""
        if not self.busy:
            # Between requests: wait for the socket, then read (as a busy connection does,
            # below). trio's receive_some reads first, and a kept connection's next request
            # is rarely there yet: a failed read (a system call and an exception), and after
            # the read that succeeds a scheduler pass for its checkpoint, per request. A new
            # connection's first read is tried at once: its request is usually in already.
            if self._fresh:
                self._fresh = False
                data = _read_now(stream, max_bytes)
                if data is not None:
                    return data
            return await _receive_later(stream, max_bytes)
        self._waiting = True
        try:
            return await _receive_later(stream, max_bytes)
        finally:
            self._waiting = False

    def wake_read_loop(self) -> None:
        """Make the read loop look at the buffer (or the linger deadline) at once, if it waits
        for the socket under a running request."""
        if self._waiting and self.wake_scope is not None:
            self.wake_scope.cancel()

    async def advance(self) -> None:
        """Move buffered bytes on: into the running request's body, or into a new request;
        sets ``off`` when the buffer starts with a head for hypercorn."""
        while True:
            if self.ending:
                self.buffer.clear()
                return
            if self.busy:
                if not (self._body_left and self.buffer):
                    return
                take = min(len(self.buffer), self._body_left)
                chunk = bytes(self.buffer[:take])
                del self.buffer[:take]
                self._body_left -= take
                assert self._inbox is not None
                more = self._body_left > 0
                # Waits while the app's queue is full (hypercorn's backpressure); the request
                # may end meanwhile, so the loop looks at `busy` again.
                try:
                    message = {"type": "http.request", "body": chunk, "more_body": more}
                    await self._inbox.put(message)
                except trio.BrokenResourceError:
                    # The request ended without reading its whole body (a 413): the
                    # connection is closing, the rest of the body is dropped.
                    self.buffer.clear()
                    self._body_left = 0
                    return
                continue
            if not self.buffer:
                return
            head = parse_head(self.buffer, self._conn.config.h11_max_incomplete_size)
            if head == NEED_DATA:
                return
            if head == UNSUPPORTED or not isinstance(head, Head):
                self.off = True
                return
            await self._start(head)

    @property
    def body_pending(self) -> bool:
        """The running request's body has not all arrived yet."""
        return self._body_left > 0

    def take_buffer(self) -> bytes:
        data = bytes(self.buffer)
        self.buffer.clear()
        return data

    def close(self) -> None:
        """No request comes on the fast path any more (the read loop ended, or the connection
        went to hypercorn): the request task ends once its request, if any, has."""
        self._closed = True
        self._lot.unpark_all()

    def disconnected(self) -> None:
        """The client closed its side (or the read failed): the running request hears it."""
        self.close()
        inbox = self._inbox
        if inbox is not None:
            # Where it cannot be queued, the app reads no more, or it sees the connection's
            # own flag (``disconnected``, ``on_disconnect``).
            with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError):
                inbox.put_nowait({"type": "http.disconnect"})

    async def _start(self, head: Head) -> None:
        conn = self._conn
        await conn.idle_task.stop()
        await conn.context.mark_request()
        self._begin(head)

    def _begin(self, head: Head) -> None:
        """Start ``head``'s request (its start already noted): its body's first part from the
        buffer in its inbox, its ASGI app next in the connection's request task."""
        conn = self._conn
        end = head.size + head.length
        body = bytes(self.buffer[head.size : end])
        del self.buffer[:end]
        self._body_left = head.length - len(body)
        self.close_asked = head.close
        first = {"type": "http.request", "body": body, "more_body": self._body_left > 0}
        # Room for the first message at least, which is queued before the app runs.
        self._inbox = inbox = _Inbox(max(1, conn.config.max_app_queue_size), first)
        self.busy = True
        raw_path, _, query = head.target.partition(b"?")
        scope = {
            "type": "http",
            "http_version": "1.1",
            "asgi": _ASGI,
            "method": head.method.decode("ascii"),
            "scheme": "http",
            "path": unquote(raw_path.decode("ascii")),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": conn.config.root_path,
            "headers": head.headers,
            "client": conn.client,
            "server": conn.server_addr,
            "state": conn.request_state(),
            "extensions": {CANCELLED_ON_DISCONNECT: True, RETRACT_HEAD: True},
        }
        conn.requests += 1
        conn.direct_writer = None  # the previous request's: this one's app makes its own
        self._job = (scope, inbox)
        if not self._serving:
            self._serving = True
            conn.spawn(self._serve)
        else:
            self._lot.unpark()

    async def _serve(self) -> None:
        """The connection's request task: runs its fast-path requests in turn until one ends
        the connection or none comes any more. The client's disconnect cancels it
        (``on_disconnect``): the request that runs then is cancelled, as the app expects of
        a request marked :data:`CANCELLED_ON_DISCONNECT`."""
        conn = self._conn
        with trio.CancelScope() as scope:
            conn.on_disconnect = scope.cancel
            try:
                while True:
                    job = self._job
                    if job is None:
                        if self._closed:
                            return
                        await self._lot.park()
                        continue
                    # A request whose client closed (or half-closed) before this task ran
                    # still runs: the app finds the connection gone and records the request
                    # as its client's disconnect (smgd.api.http.dispatch), not nothing.
                    self._job = None
                    if not await self._run(*job):
                        return
            finally:
                if conn.on_disconnect == scope.cancel:
                    conn.on_disconnect = None

    async def _run(self, scope: Any, inbox: _Inbox) -> bool:
        """One request, from its app's start to the end of its answer; whether the
        connection stays for another."""
        conn = self._conn
        response = _Response(conn, self._headers, self)
        keep = False
        try:
            try:
                await conn.app(
                    scope,
                    inbox.receive,
                    response.send,
                    trio.to_thread.run_sync,
                    trio.from_thread.run,
                )
            except Exception:  # never trio.Cancelled (a BaseException): that one propagates
                log.exception("error in the ASGI app")
                if not response.started:
                    await response.send_error()
            keep = (
                response.ended
                and self._body_left == 0
                and not response.close
                and not conn.disconnected
                and not conn.context.terminated.is_set()
            )
        finally:
            # A body still arriving has nowhere to go: the read loop's send fails at once.
            inbox.close()
            lingering = False
            if not keep:
                # Before `busy` goes: from here on nothing read is a request.
                self.ending = True
                lingering = self._body_left > 0 and not conn.disconnected
                self.buffer.clear()
                self._body_left = 0
            self.busy = False
            self._inbox = None
            if not keep:
                with trio.CancelScope(shield=True):
                    await self._close(lingering=lingering)
        if not keep:
            return False
        await conn.idle_task.restart(conn.task_group, conn.idle_timeout)
        if self.buffer and self._waiting and not self._start_buffered():
            self.wake_read_loop()  # a request for hypercorn waits: the read loop moves it
        return True

    def _start_buffered(self) -> bool:
        """At a request's end, start the next one already in the buffer (the client sent it
        before reading the end of the answer, as a client does that reuses its connection at
        once: about half the requests of a busy keep-alive connection). The read loop stays
        where it waits, for the socket; waking it to do this was a cancel and an exception
        through trio's wait per such request. False when the read loop must see the buffer (a
        head for hypercorn, or a start that needs a checkpoint); True when it need not (the
        request started, or its head is still incomplete: the loop reads the rest)."""
        head = parse_head(self.buffer, self._conn.config.h11_max_incomplete_size)
        if head == NEED_DATA:
            return True
        if not isinstance(head, Head) or not self._conn.begin_request_now():
            return False
        self._begin(head)
        return True

    async def _close(self, *, lingering: bool) -> None:
        """End the connection. ``lingering``: the request's body is still arriving (the app
        answered before reading it all, as with a 413): closing now would make the kernel
        reset the connection on the bytes still coming, and the reset can reach the client
        before it read the answer. So only the sending side is shut now; the read loop drops
        what still arrives until the client closes or :data:`LINGER_S` passed."""
        if not lingering:
            await self._conn.protocol_send(Closed())
            return
        self._linger_until = trio.current_time() + LINGER_S
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await self._conn.stream.send_eof()
        self.wake_read_loop()  # to read on under the linger deadline


class _Inbox:
    """A fast-path request's ASGI ``receive``: its body's messages, then ``http.disconnect``.

    What trio's memory channel did for hypercorn's requests, for one reader (the app) and one
    writer (the read loop), without the channel's three objects per request: opening, using
    and closing one cost ~8 µs against ~1 here, ~3 % of a short request's CPU. Bounded like
    hypercorn's (``max_app_queue_size``): the read loop waits for room (:meth:`put`). Once
    the request ended (:meth:`close`), a put fails with ``trio.BrokenResourceError``.
    """

    __slots__ = ("_capacity", "_closed", "_messages", "_readable", "_writable")

    def __init__(self, capacity: int, first: dict[str, Any]) -> None:
        self._messages: deque[dict[str, Any]] = deque((first,))
        self._capacity = capacity
        self._closed = False
        self._readable: trio.Event | None = None  # set when the app waits for a message
        self._writable: trio.Event | None = None  # set when the read loop waits for room

    def put_nowait(self, message: dict[str, Any]) -> None:
        if self._closed:
            raise trio.BrokenResourceError("the request ended")
        if len(self._messages) >= self._capacity:
            raise trio.WouldBlock
        self._messages.append(message)
        if self._readable is not None:
            self._readable.set()
            self._readable = None

    async def put(self, message: dict[str, Any]) -> None:
        """Queue ``message``, waiting while the queue is full (the app reads slowly)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                self.put_nowait(message)
            except trio.WouldBlock:
                self._writable = room = trio.Event()
                await room.wait()
                continue
            await trio.lowlevel.cancel_shielded_checkpoint()
            return

    def receive_nowait(self) -> dict[str, Any]:
        if not self._messages:
            raise trio.WouldBlock
        message = self._messages.popleft()
        if self._writable is not None:
            self._writable.set()
            self._writable = None
        return message

    async def receive(self) -> dict[str, Any]:
        """The next message, waiting for it; a message taken is never lost to a cancel."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                message = self.receive_nowait()
            except trio.WouldBlock:
                self._readable = arrived = trio.Event()
                await arrived.wait()
                continue
            await trio.lowlevel.cancel_shielded_checkpoint()
            return message

    def close(self) -> None:
        """The request ended: nothing more is read; a waiting put fails."""
        self._closed = True
        self._messages.clear()
        if self._writable is not None:
            self._writable.set()
            self._writable = None


def _read_now(stream: Any, max_bytes: int) -> bytes | None:
    """What the socket holds now, without waiting (None when nothing; b"" at its end); errors
    as ``receive_some``'s. No checkpoint: called on its own only for a connection's first
    read, once."""
    fd = stream.socket.fileno()
    if fd < 0:
        raise trio.ClosedResourceError("the connection's socket was closed")
    try:
        return os.read(fd, max_bytes)
    except BlockingIOError:
        return None
    except OSError as exc:
        raise trio.BrokenResourceError(f"the connection broke: {exc}") from exc


async def _receive_later(stream: Any, max_bytes: int) -> bytes:
    """``stream.receive_some(max_bytes)`` for a read that is rarely served at once: the next
    request on a connection, whose client sends it once it has read the last answer (or
    while a request runs, the answer not sent yet).

    It waits for the socket before reading, where trio's ``receive_some`` reads first and
    waits on ``EAGAIN``: that read is a system call and an exception per request for nothing
    (with trio's wrappers about 5 µs here), and the read that succeeds is followed by a
    checkpoint, a scheduler pass. Errors end the read as ``receive_some``'s would.
    """
    sock = stream.socket
    while True:
        fd = sock.fileno()
        if fd < 0:
            raise trio.ClosedResourceError("the connection's socket was closed")
        await trio.lowlevel.wait_readable(fd)
        data = _read_now(stream, max_bytes)
        if data is not None:
            return data  # else woken with nothing to read after all


class _Response:
    """The ASGI ``send`` of one fast-path request."""

    __slots__ = ("_chunked", "_conn", "_fast", "_head", "_headers", "close", "ended", "started")

    def __init__(self, conn: Connection, headers: ServerHeaders, fast: FastPath) -> None:
        self._conn = conn
        self._headers = headers
        self._fast = fast
        self._head = b""  # a whole response's head, until its body
        self._chunked = False
        self.started = False
        self.ended = False
        self.close = False

    async def send(self, message: Any) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            extra = self._headers.get()
            conn = self._conn
            # The connection ends with this response: when the client asked for it, after
            # its last allowed request, when the request's body has not all arrived (the app
            # answered early, as with a 413), or once the server shuts down. The client is
            # told so.
            if (
                self._fast.close_asked
                or conn.requests >= conn.config.keep_alive_max_requests
                or self._fast.body_pending
                or conn.context.terminated.is_set()
            ):
                self.close = True
                extra = [*extra, (b"connection", b"close")]
            headers = message.get("headers", [])
            # One scan of all names and values in C: a Python test per name and value cost
            # ~4 µs for a streamed response's four headers, ~1 this way.
            every = b"".join(chain.from_iterable(headers))
            if b"\r" in every or b"\n" in every:
                name = next(n for n, v in headers if b"\r" in n + v or b"\n" in n + v)
                raise ValueError(f"a response header has a line break: {name!r}")
            head, self._chunked = response_head(message["status"], headers, extra)
            self.started = True
            writer = conn.direct_writer
            if self._chunked and writer is not None:
                # This request's direct writer (the app made it): a stream's first event
                # takes the head along, one write instead of two per streamed request.
                writer.hold_head(head)
            elif self._chunked:
                await conn.protocol_send(RawData(data=head))
            else:
                self._head = head  # goes out with the body, in one write
        elif kind == RETRACT_HEAD:
            writer = self._conn.direct_writer
            if not (self.started and self._chunked and writer is not None and writer.drop_head()):
                raise RuntimeError("no held response head to retract")
            self.started = self._chunked = self.close = False
        elif kind == "http.response.body":
            if not self.started or self.ended:
                raise RuntimeError("http.response.body outside a response")
            body: bytes = message.get("body", b"")
            more = message.get("more_body", False)
            if self._chunked:
                # The direct writer's head (and what of it the kernel did not take) first.
                writer = self._conn.direct_writer
                unsent = writer.take_unsent() if writer is not None else b""
                if body or unsent:
                    frame = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
                    await self._conn.protocol_send(RawData(data=unsent + frame))
                if not more:
                    await self._conn.protocol_send(RawData(data=_CHUNK_END))
            elif body or self._head:
                data, self._head = self._head + body, b""
                await self._conn.protocol_send(RawData(data=data))
            if not more:
                self.ended = True

    async def send_error(self) -> None:
        body = http_error(500, "internal error")
        await self.send(
            {
                "type": "http.response.start",
                "status": 500,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", b"%d" % len(body)),
                ],
            }
        )
        await self.send({"type": "http.response.body", "body": body, "more_body": False})
        self.close = True
