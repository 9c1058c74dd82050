"""smgd's hypercorn worker loop: hypercorn's HTTP/1.1 protocol with a direct socket write.

hypercorn's own ``serve()`` writes every chunk through ``TCPServer.protocol_send``: a
``trio.Lock`` acquire and a ``SocketStream.send_all``, each of which yields to the scheduler
once even when the kernel takes the whole write at once (trio's checkpoint rule). On an SSE
stream that is two extra scheduler passes per event, ~30 µs of CPU on this machine (measured
with a bare hypercorn app: 105 → 72 µs per 250-byte event), paid for every token on every
stream.

:class:`DirectSendTCPServer` writes straight to the socket with ``os.write`` when no other
write of that connection is in progress, and falls back to hypercorn's path for the rest of a
partial write, on ``EAGAIN`` and on any error (which hypercorn then handles as a closed
connection). Ordering is kept: the lock is checked and the write done with no ``await``
between. A streaming task still yields once per event, waiting for the engine's next output.

:func:`serve` is the worker loop that uses it: lifespan, listeners on hypercorn's sockets
(host:port binds and ``fd://`` binds for socket activation; plain TCP only, smgd serves no
TLS) with smgd's accept loop (:mod:`smgd.api.http.accepting`, which takes every waiting
connection at each wakeup, where trio's takes one per scheduler pass), graceful shutdown on
``shutdown_trigger`` within ``config.graceful_timeout``. It is built from hypercorn's own parts
(``Lifespan``, ``WorkerContext``, ``TCPServer``). Requests of the common shape are read by
smgd's fast path (:mod:`smgd.api.http.fast_path`) before hypercorn's protocol sees them; the
first one that is not moves the connection to hypercorn's parsing and ASGI interface,
unchanged.

Graceful shutdown ends responses properly even when they outlast it: at the graceful
deadline ``end_responses`` asks the app to end what still runs (smgd's streams send their
error event and ``[DONE]``), and only :data:`END_GRACE_S` later are the connections that are
still busy cancelled, which cuts their bodies.

Two parts are done differently. Keep-alive: hypercorn starts a new idle-timeout task, through
``nursery.start`` and two lock round-trips, every time a connection goes idle, i.e. once per
request (~10 % of smgd's CPU in a profile of short requests, C=256, 8 tokens each); here one
task closes the idle connections of the whole loop (:mod:`smgd.api.http.keep_alive`). A
connection's run: :meth:`DirectSendTCPServer.run` is hypercorn's ``TCPServer.run`` for the
plain TCP stream smgd serves, without its TLS handshake attempt (a cancel scope and a caught
``AttributeError`` per connection), and its close sends no EOF to a client whose own EOF
arrived already (the close sends the FIN then; one system call fewer).

Requests h11 cannot parse (a malformed request line, headers over ``h11_max_incomplete_size``,
a transfer coding other than chunked) and requests with both ``Content-Length`` and
``Transfer-Encoding`` are answered by :class:`H11Protocol`: the OpenAI error envelope as the
body (hypercorn's own answer has none), then the connection is closed.

Several of these hooks are private to hypercorn (``H11Protocol._create_stream`` and
``_send_error_response``, ``TCPServer._read_data``, ``_close`` and ``_initiate_server_close``,
the idle task's ``restart``/``stop``, what ``TCPServer.run`` sets up): tests/test_pins.py names
each and pins the hypercorn and h11 versions they were checked against.
"""

from __future__ import annotations

import os
from functools import partial
from typing import TYPE_CHECKING, Any

import h11
import trio
from hypercorn.events import Closed, RawData
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h11 import H11Protocol as HypercornH11Protocol
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import parse_socket_addr, repr_socket_addr, wrap_app

from smgd.api.core.errors import http_error
from smgd.api.http.accepting import serve_sockets
from smgd.api.http.direct import BODY_END, CONNECTION_KEY, DirectWriter
from smgd.api.http.fast_path import FastPath, ServerHeaders
from smgd.api.http.keep_alive import KeepAlive, KeepAliveReaper

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from hypercorn.config import Config, Sockets
    from hypercorn.events import Event

__all__ = ["END_GRACE_S", "DirectSendTCPServer", "H11Protocol", "serve"]

# hypercorn's TCPServer reads at most this much per receive (its own MAX_RECV).
_MAX_RECV = 1 << 16
# From the graceful deadline (end_responses) to the cancel of connections still busy: the
# time the responses just ended have to write their last bytes (an SSE error event, [DONE],
# the chunk terminator: a few hundred bytes, milliseconds on any live connection). A client
# that reads nothing for a whole second loses its end. smgd's daemon waits for the server
# DRAIN_MARGIN_S past the graceful deadline, which must stay larger (tests check it).
END_GRACE_S = 1.0


class H11Protocol(HypercornH11Protocol):
    """hypercorn's HTTP/1.1 protocol; a request it refuses gets an error envelope as its body.

    h11 refuses a request with only a status (400 malformed, 431 headers too large, 501 an
    unsupported transfer coding), and hypercorn answers that status with an empty body, which
    an OpenAI client reports as an unreadable error. This answer carries the envelope.

    A request with both ``Content-Length`` and ``Transfer-Encoding`` is refused too (h11 would
    frame it by its chunks and keep the connection): a proxy in front that framed it by its
    length would see a different request, the start of request smuggling. RFC 9112 §6.1: a
    server may refuse it, and must close the connection after answering it.
    """

    async def _check_protocol(self, event: h11.Request) -> None:
        """smgd serves HTTP/1.1 only (and 1.0): hypercorn's switch to HTTP/2 here, on an
        ``Upgrade: h2c`` or on HTTP/2's connection preface, is not taken. Its request
        handling assumes one request per connection at a time (a client's disconnect cancels
        *the* request; HTTP/2's per-stream resets would reach none), so a stream reset or a
        connection closed under many streams left their handlers and engine requests running.
        The upgrade is ignored, which a server may do (RFC 9110 §7.8): the request is answered
        in HTTP/1.1. The preface is refused in :meth:`_create_stream`."""

    async def _create_stream(self, request: h11.Request) -> None:
        if request.http_version not in (b"1.1", b"1.0"):
            # HTTP/2's preface (``PRI * HTTP/2.0``, prior knowledge) or a version that does
            # not exist: h11 parses any ``HTTP/d.d``.
            version = request.http_version.decode("ascii", "replace")
            await self._send_error_response(
                505, f"HTTP/{version} is not supported: smgd speaks HTTP/1.1"
            )
            await self.send(Closed())
            return
        limit = self.config.h11_max_incomplete_size
        if _head_size(request) > limit:
            # h11 bounds a head that arrives in parts only; one that came whole is held to
            # the same limit here.
            await self._send_error_response(431)
            await self.send(Closed())
            return
        names = {name for name, _ in request.headers}
        if b"content-length" in names and b"transfer-encoding" in names:
            message = "a request may not have both Content-Length and Transfer-Encoding"
            await self._send_error_response(400, message)
            await self.send(Closed())
            return
        await super()._create_stream(request)

    async def _send_error_response(self, status_code: int, message: str | None = None) -> None:
        body = http_error(status_code, message or self._refusal(status_code))
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            (b"connection", b"close"),
            *self.config.response_headers("h11"),
        ]
        await self._send_h11_event(h11.Response(status_code=status_code, headers=headers))
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())

    def _refusal(self, status: int) -> str:
        if status == 431:
            limit = self.config.h11_max_incomplete_size
            return f"the request line and headers are larger than {limit} bytes"
        if status == 501:
            return "the request's Transfer-Encoding is not supported (only chunked is)"
        return "malformed HTTP/1.1 request"


def _head_size(request: h11.Request) -> int:
    """About the bytes of ``request``'s request line and headers, as they came (each line's
    separators counted; h11 stripped optional whitespace, which is not)."""
    line = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers) + 2


class DirectSendTCPServer(TCPServer):
    def __init__(
        self,
        app: Any,
        config: Config,
        context: Any,
        state: Any,
        stream: Any,
        fileno: Callable[[], int] | None = None,
        *,
        server_headers: ServerHeaders | None = None,
        keep_alive: KeepAliveReaper | None = None,
    ) -> None:
        # A state dict of its own, naming this connection: hypercorn copies it into every
        # request's scope, where smgd.api.http.direct finds the connection to write to.
        super().__init__(
            app, config, context, ConnectionState({**state, CONNECTION_KEY: self}), stream
        )
        self._server_headers = server_headers or ServerHeaders(config)
        # The socket's descriptor, -1 once closed (a closed descriptor's number is reused by
        # the next connection, so it is asked for at every write, never kept): the accept
        # loop's, a C call; trio's socket's for a connection made otherwise.
        if fileno is None:
            sock = getattr(stream, "socket", None)  # tests run some on socketless streams
            fileno = _no_socket if sock is None else sock.fileno
        self.socket_fileno = fileno
        self.requests = 0  # served on the fast path (for keep_alive_max_requests)
        self.client: tuple[str, int] | None = None
        self.server_addr: tuple[str, int] | None = None
        # A direct stream wrote its body's terminator itself (DirectWriter.finish): the one
        # h11 writes when the response completes must not reach the client a second time.
        self.body_end_written = False
        # Requests (smgd.api.http.dispatch) run with no task reading ASGI messages; the one
        # running sets this to stop when its client goes away, and the read loop calls it
        # when it ends.
        self.on_disconnect: Callable[[], None] | None = None
        # The writer of the latest request with direct writes (smgd.api.http.direct).
        self.direct_writer: DirectWriter | None = None
        self.disconnected = False
        # The loop's reaper closes this connection when it stays idle; without one (a
        # connection built by hand) a reaper nobody runs: nothing closes it for idleness.
        reaper = keep_alive or KeepAliveReaper(config.keep_alive_timeout)
        self._keep_alive = KeepAlive(reaper, self)
        self._fast: FastPath | None = None  # the fast path, until hypercorn takes over
        self._protocol: ProtocolWrapper | None = None  # built when needed (``protocol``)
        self._eof_received = False  # the client's EOF was read: it has sent all it will
        self._stream_closed = False
        # TCPServer only calls restart() and stop() on it, which KeepAlive has.
        self.idle_task = self._keep_alive  # type: ignore[assignment]

    @property
    def protocol(self) -> ProtocolWrapper:
        """hypercorn's protocol for the connection, built when something first asks for it:
        a request the fast path hands over, or a connection served without the fast path.
        A connection whose every request the fast path served never builds one: the wrapper,
        hypercorn's protocol and h11's state machine, and their handling of the close, cost
        ~70 of a connection's ~400 µs of CPU (docs/performance.md, "eighteenth pass")."""
        wrapper = self._protocol
        if wrapper is None:
            self.protocol = ProtocolWrapper(
                self.app,
                self.config,
                self.context,
                self._task_group,
                ConnectionState(self.state),
                False,  # ssl
                self.client,
                self.server_addr,
                self.protocol_send,
                "http/1.1",
            )
            wrapper = self._protocol
            assert wrapper is not None
        return wrapper

    @protocol.setter
    def protocol(self, wrapper: ProtocolWrapper) -> None:
        # An HTTP/1.1 protocol becomes smgd's H11Protocol (same state, one method more): only
        # the class changes, so hypercorn's constructor stays the one that runs. Its
        # initiate() does nothing for HTTP/1.1 (tests/test_pins.py), so none is awaited.
        if type(wrapper.protocol) is HypercornH11Protocol:
            wrapper.protocol.__class__ = H11Protocol
        self._protocol = wrapper

    async def run(self) -> None:
        """Serve the connection until it closes: what ``TCPServer.run`` does for a plain TCP
        stream (smgd serves no TLS), without its TLS handshake attempt under a timeout."""
        sock = self.stream.socket
        try:
            try:
                self.client = parse_socket_addr(sock.family, sock.getpeername())
                self.server_addr = parse_socket_addr(sock.family, sock.getsockname())
                async with TaskGroup() as task_group:
                    self._task_group = task_group
                    await self._keep_alive.restart(task_group, self._idle_timeout)
                    await self._read_data()
            except OSError:
                pass  # the client went away (a reset, or gone before its addresses were read)
            finally:
                await self._close()
        finally:
            self._let_go()

    async def _close(self) -> None:
        # Called by run() at the end and by hypercorn's protocol_send(Closed()) before that:
        # once is enough (a second EOF fails and is caught; a second close is a checkpoint).
        if self._stream_closed:
            return
        self._stream_closed = True
        if self._eof_received:
            # Nothing of the client's is left unread: closing the socket sends the FIN. The
            # close alone, without SocketStream.aclose()'s checkpoint: a pass of the scheduler
            # per connection, at the end of a task that ends right after.
            self.stream.socket.close()
            return
        await super()._close()

    def close_idle(self) -> None:
        """The keep-alive reaper found the connection idle: close it, unless a request comes
        first (the close runs in a task of the connection's task group, shielded)."""
        if not self.disconnected and not self._stream_closed:
            self._task_group.spawn(self._close_if_idle)

    async def _close_if_idle(self) -> None:
        if self._keep_alive.idle and not self.disconnected:
            with trio.CancelScope(shield=True):
                await self._initiate_server_close()

    def _let_go(self) -> None:
        """The connection is over: drop what refers back to it.

        Its protocol (whose ``send`` is this object's bound method), its state (which names it
        for the requests), its keep-alive handle and its task group all lead back here, so each
        closed connection would otherwise be a reference cycle left for the cyclic GC, and its
        middle generation runs rarely (``GC_THRESHOLDS``, smgd/gc_tuning.py). Nothing runs on the
        connection any more: ``run`` has closed the stream and its task group ended.
        """
        self._keep_alive.close()  # out of the reaper's table, whatever ended the connection
        self.state.clear()
        attributes = vars(self)
        for name in (
            "_protocol",
            "_keep_alive",
            "idle_task",
            "_task_group",
            "on_disconnect",
            "direct_writer",
            "_fast",
        ):
            attributes.pop(name, None)

    async def protocol_send(self, event: Event) -> None:
        if type(event) is RawData and self.body_end_written and event.data == BODY_END:
            self.body_end_written = False
            return
        if type(event) is RawData and not self.send_lock.locked():
            data = event.data
            sent = _write_now(self.socket_fileno, data)
            if sent == len(data):
                return
            if sent:
                event = RawData(data=data[sent:])
        if type(event) is Closed and self._protocol is None:
            await self._close()  # TCPServer's, but for telling a protocol never built
            return
        writer = self.direct_writer
        if writer is None or type(event) is not RawData:
            await super().protocol_send(event)
            return
        # A direct stream's chunks must not overtake (or split) what goes out here.
        writer.hold()
        try:
            await super().protocol_send(event)
        finally:
            writer.release()

    async def _read_data(self) -> None:
        try:
            if self.config.read_timeout:
                await super()._read_data()
            else:
                await self._read_until_closed()
        finally:
            # No request can arrive any more: the keep-alive reaper closes nothing from here
            # on (close_idle), and _let_go takes the connection out of its table.
            self.disconnected = True
            if self.on_disconnect is not None:
                self.on_disconnect()

    # -- what smgd.api.http.fast_path uses of the connection ------------------------------
    @property
    def task_group(self) -> Any:
        return self._task_group

    async def idle_timeout(self) -> None:
        await self._idle_timeout()

    def spawn(self, func: Callable[..., Awaitable[None]], *args: Any) -> None:
        self._task_group.spawn(func, *args)

    def begin_request_now(self) -> bool:
        if self.context.max_requests is not None:
            return False  # hypercorn's mark_request may set an event: async
        self._keep_alive.busy()
        return True

    def request_state(self) -> dict[str, Any]:
        """A request's copy of the connection's state (as hypercorn's streams make one)."""
        return dict(self.state)

    def _fast_path(self) -> FastPath | None:
        """A fast path for this connection: HTTP/1.1 over TCP, unless hypercorn must see
        every request (its access log)."""
        if self.config.accesslog is not None:
            return None
        return FastPath(self, self._server_headers)

    async def _read_until_closed(self) -> None:
        """hypercorn's read loop, without the per-receive ``fail_after(inf)`` when there is no
        read timeout (a cancel scope per request, ~3 % of the CPU of short requests), and with
        smgd's fast path (:mod:`smgd.api.http.fast_path`) in front of hypercorn's protocol
        until a request comes that only hypercorn serves.

        The fast path may wake the loop while it waits for the socket under a running request
        (:meth:`FastPath.wake_read_loop`, rare): the loop runs in a cancel scope that the
        wake cancels, and goes on in a new one."""
        self._fast = self._fast_path()
        try:
            while True:
                with trio.CancelScope() as wake:
                    if self._fast is not None:
                        self._fast.wake_scope = wake
                    if await self._read_until_woken(wake):
                        break  # the connection's reading ended
        finally:
            if self._fast is not None:
                self._fast.disconnected()
        await self._protocol_closed()

    async def _protocol_closed(self) -> None:
        """Tell hypercorn's protocol the connection closed, if it was ever built: one that
        never was has no request of its own to end."""
        if self._protocol is not None:
            await self._protocol.handle(Closed())

    async def _initiate_server_close(self) -> None:
        # TCPServer's, without building a protocol only to tell it of the close.
        await self._protocol_closed()
        await self.stream.aclose()

    async def _read_until_woken(self, wake: trio.CancelScope) -> bool:
        """Read and hand on until the reading ends (True) or ``wake`` is cancelled: at the
        wait for the socket (Cancelled, caught by the caller's scope), or after the wait had
        its bytes already (False; they are in the buffer). In that second case no checkpoint
        may follow in the scope, whose cancel would strike there: in the middle of hypercorn's
        handling of the bytes, or of a body's send to the app."""
        while True:
            fast = self._fast
            if fast is not None:
                await fast.advance()
                if fast.off:  # hypercorn's from here on, from this request's first byte
                    data = fast.take_buffer()
                    fast.close()
                    self._fast = None
                    await self.protocol.handle(RawData(data))
                    continue
            received: bytes | bytearray
            try:
                if fast is not None:
                    received = await fast.receive(_MAX_RECV)
                else:
                    received = await self.stream.receive_some(_MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                return True
            if not received:
                # The client's EOF (or a linger deadline, fast.receive: the EOF went out then).
                self._eof_received = True
            if fast is not None and wake.cancel_called:
                # Woken after the bytes came: they wait in the buffer (an end of the stream
                # is read again, a socket's end stays), the caller goes on in a new scope.
                fast.buffer += received
                return False
            if fast is not None:
                if not received:
                    # The client's EOF (between requests, during one, or after a closing
                    # answer): the connection ends (a running request is cancelled, run()
                    # closes the socket), as hypercorn's protocol would end it, without
                    # building one to be told.
                    return True
                if not fast.ending:  # after a closing answer it is dropped (a 413's body)
                    fast.buffer += received
                continue
            await self.protocol.handle(RawData(bytes(received)))
            if not received:
                return True


def _no_socket() -> int:
    return -1  # a connection on a stream without a socket (tests) has no descriptor


def _write_now(fileno: Callable[[], int], data: bytes) -> int:
    """Bytes the kernel took right away (0 on EAGAIN, error, a closed socket or none:
    ``fileno`` is the connection's ``socket_fileno``)."""
    fd = fileno()
    if fd < 0:
        return 0
    try:
        return os.write(fd, data)
    except OSError:  # EAGAIN, EPIPE, ECONNRESET...: hypercorn's path handles (or raises) it
        return 0


async def _raise_on(trigger: Callable[[], Awaitable[None]]) -> None:
    await trigger()
    raise _Shutdown


class _Shutdown(Exception):
    """Raised inside the serving nursery to stop accepting (never escapes :func:`serve`)."""


async def _end_at(deadline: float, end_responses: Callable[[], None]) -> None:
    await trio.sleep_until(deadline)
    end_responses()


async def serve(
    app: Any,
    config: Config,
    *,
    sockets: Sockets | None = None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    end_responses: Callable[[], None] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI ``app`` until ``shutdown_trigger`` returns; started with nursery.start.

    ``sockets``: already-bound listening sockets (else ``config.create_sockets()``).
    ``end_responses``: called at the graceful deadline, to end the app's responses still
    running (a connection still busy :data:`END_GRACE_S` later is cancelled).
    ``task_status.started`` gets the ``http://host:port`` of every listener.
    """
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
    lifespan_state: dict[str, Any] = {}
    lifespan = Lifespan(wrapped, config, lifespan_state)
    context = WorkerContext(None)
    reaper = KeepAliveReaper(config.keep_alive_timeout)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        # In the outer nursery: it runs until the connections are done, then is cancelled.
        await lifespan_nursery.start(reaper.run)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as handlers:
            if sockets is None:
                sockets = config.create_sockets()
            # Given sockets listen already (smgd's own, systemd's: listen again only sets the
            # backlog), except a worker's: its supervisor binds them and the worker starts
            # listening here, once it serves, so that no connection waits on a worker that is
            # still starting, or could not (smgd.workers).
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
            binds = []
            for sock in sockets.insecure_sockets:
                bind = repr_socket_addr(sock.family, sock.getsockname())
                binds.append(f"http://{bind}")
                await config.log.info(f"Running on http://{bind}")
            task_status.started(binds)
            server = partial(
                DirectSendTCPServer,
                wrapped,
                config,
                context,
                ConnectionState(lifespan_state),
                server_headers=ServerHeaders(config),
                keep_alive=reaper,
            )
            try:
                async with trio.open_nursery() as accepting:
                    if shutdown_trigger is not None:
                        accepting.start_soon(_raise_on, shutdown_trigger)
                    accepting.start_soon(_raise_on, context.terminate.wait)
                    accepting.start_soon(
                        partial(
                            serve_sockets,
                            server,
                            list(sockets.insecure_sockets),
                            handler_nursery=handlers,
                        )
                    )
            except* _Shutdown:
                pass
            finally:
                # Stop accepting; connections in flight get the graceful timeout to finish.
                await context.terminated.set()
                reaper.terminate()  # idle connections close now, busy ones when they are idle
                deadline = trio.current_time() + config.graceful_timeout
                if end_responses is not None:
                    # In the outer nursery, cancelled once the handlers are done: it must
                    # not keep them waiting for a deadline they have all beaten.
                    lifespan_nursery.start_soon(_end_at, deadline, end_responses)
                    deadline += END_GRACE_S
                handlers.cancel_scope.deadline = deadline
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
