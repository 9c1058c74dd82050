"""The one request envelope: every route of an app, public or admin, through one dispatcher.

An app is a table of routes (path → :class:`Route`: its handler, its method, whether a drain
refuses it) served by a :class:`Dispatcher`, an ASGI application. Each handler is
``Call -> Reply`` (:mod:`smgd.api.handlers`); around it the dispatcher does, for every request
and in this order:

1. reads the body, without a scheduler pass when it is already queued; a client gone before
   its end gets no answer;
2. with CORS on (:mod:`smgd.api.http.cors`), reads ``Origin``: the CORS headers go on every
   answer below, and a preflight to a route's path is answered there, before the key check;
3. takes the client's ``X-Request-Id`` (400 if malformed; of a list ``a, b``, as proxies merge
   repeated headers, the first) or mints one, and echoes it on every response;
4. checks the API key where the path needs one (401) and refuses generation routes while
   smgd drains (503 + ``Retry-After``);
5. routes: an exact path, else a path template's prefix (``/v1/models/{model}``); an
   absolute-form target (``http://host/v1/models``) by its path; an unknown path is 404
   (``Invalid URL (GET /x)``), a method the route does not take 405 (with ``Allow``);
   ``OPTIONS`` is answered with ``Allow``, ``HEAD`` as ``GET`` (the server sends no body);
6. a body over ``max_body_bytes`` is 413, one not complete within :data:`BODY_TIMEOUT_S` 408;
7. runs the handler: every error is the OpenAI envelope with its status and headers
   (:mod:`smgd.api.core.errors`), an unexpected exception a logged 500;
8. counts the response in ``smgd_http_requests`` (route template, method, status; an unknown
   route or method is ``unmatched``) and an error answered before any engine output in
   ``smgd_aborts`` by cause (a generation request that ran is recorded once, by its
   :class:`~smgd.api.core.pipeline.RequestState`).

Why smgd's own dispatcher and not a framework's: ``POST /v1/completions``,
``/v1/chat/completions`` and ``/generate`` carry nearly all of a gateway's traffic, and what
each costs *per request* sets how long a burst of new requests takes: when 256 streams end and
restart together, TTFT is the time the whole burst needs (docs/performance.md). Through Quart
a request cost a nursery and two tasks (quart-trio's message reader and handler), a request
context, the before/after hooks, werkzeug's URL matching, request and response objects and
Quart's send loop: profiled at C = 256 with 8-token requests, a third of smgd's CPU. Here it is
a dict lookup, a few header reads and the handler, and on smgd's worker loop nothing between
the body's arrival and the engine submit waits: the handler, the response head (a direct
socket write) and the submit run in one scheduler pass.

A client that disconnects cancels its request (a generation's engine request is aborted): on
smgd's worker loop the connection calls back when its read loop ends
(``DirectSendTCPServer.on_disconnect``), so no task per request waits for it: it cancels the
fast path's request task (a request marked ``CANCELLED_ON_DISCONNECT``) or the scope the
dispatcher opens for the request (one through hypercorn's protocol); under another ASGI server
(the admin listener's, the tests') a task watches ``receive``.
"""

from __future__ import annotations

import hmac
import logging
import math
from typing import TYPE_CHECKING, Any, Literal

import trio

from smgd.api.core.errors import error_body, error_headers, http_error
from smgd.api.core.execute import StreamFailed
from smgd.api.core.pipeline import check_request_id, new_request_id
from smgd.api.core.prepare import Call
from smgd.api.http.direct import (
    CANCELLED_ON_DISCONNECT,
    CONNECTION_KEY,
    RETRACT_HEAD,
    DirectWriter,
    direct_writer,
)
from smgd.errors import Draining, PayloadTooLarge, SmgdError, Unauthorized

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping

    from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable

    from smgd.api.core.prepare import ApiContext, Handler, Recorder
    from smgd.api.http.cors import CorsPolicy
    from smgd.api.http.worker_loop import DirectSendTCPServer
    from smgd.metrics import RequestMetrics

__all__ = [
    "BODY_TIMEOUT_S",
    "Dispatcher",
    "Route",
    "authorized",
    "client_request_id",
    "origin_path",
    "read_body",
]

log = logging.getLogger("smgd.api")

# Time to receive a whole request body. The largest allowed body (max_body_bytes, 8 MiB by
# default) arrives in milliseconds on a local socket; 60 s only cuts stalled uploads.
BODY_TIMEOUT_S = 60.0
# The route label of a response to a path or method no route serves (one label, however many
# paths clients try: the metric's cardinality stays bounded).
UNMATCHED = "unmatched"
_NO_EXTENSIONS: dict[str, Any] = {}  # a scope's "extensions" is optional in ASGI
_RETRACT: Any = {"type": RETRACT_HEAD}  # smgd's own ASGI message (not in ASGI's types)
# The longest a streamed response's head waits for its first event on the fast path, which
# writes both at once (smgd.api.http.direct): the head alone is a write of its own, with a
# wakeup of the client, ~9 % of a two-token request's CPU (docs/performance.md, sixteenth
# pass). A second covers the first event of a wave of 1,024 requests on a saturated 2-core
# host (TTFT p50 0.3-0.5 s there), yet a client still hears within it that its request was
# taken (status and headers) however long the engine's queue is. The pacer's 10 ms ticks run
# the deadline: no timer of its own per request.
HEAD_HOLD_S = 1.0
# The most of a request's path a 404 or 405 quotes back (a path may be kilobytes long).
QUOTED_PATH_CHARS = 200
TIMED_OUT = (
    "The server closed the network connection because the browser didn't finish the request "
    "within the specified time."
)

BodyOutcome = Literal["complete", "too_large", "timeout", "disconnected"]
# The status counted for a request whose client went away before any byte of its response:
# nginx's "client closed request", which operators already filter and alert on. No client
# ever sees it.
CLIENT_CLOSED = 499


class Route:
    """One path's handler: the method it takes (``GET`` also answers ``HEAD``), and whether a
    drain refuses it (a generation: no new one starts once smgd drains)."""

    __slots__ = ("allow", "generation", "handler", "methods", "served")

    def __init__(
        self, method: Literal["GET", "POST"], handler: Handler, *, generation: bool = False
    ) -> None:
        self.handler = handler
        self.methods = frozenset(("GET", "HEAD") if method == "GET" else (method,))
        self.served = self.methods | {"OPTIONS"}  # counted under the route's own label
        self.allow = ", ".join(sorted(self.served))  # the Allow header of an OPTIONS answer
        self.generation = generation


def not_found(method: str, path: str) -> str:
    """A 404's message: OpenAI's words for a path no route serves."""
    return f"Invalid URL ({method} {_quoted(path)})"


def not_allowed(method: str, path: str, allow: str) -> str:
    """A 405's message: the method, the path, and what it takes."""
    return f"Method {method} is not allowed for {_quoted(path)} (it takes {allow})"


def _quoted(path: str) -> str:
    if len(path) <= QUOTED_PATH_CHARS:
        return path
    return path[:QUOTED_PATH_CHARS] + "..."


class _Refusal(Exception):
    """A request refused for a reason that is not a :class:`SmgdError` (404, 405, 408)."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


class Dispatcher:
    """Serves a route table as an ASGI application (its lifespan included).

    ``prefix_routes``: routes by path template (``/v1/models/{model}``): a path that no route
    of ``routes`` serves and starts with a template's part before ``{`` goes to that route,
    the rest of the path (which may hold ``/``) in ``Call.path_tail``.
    ``key_paths``: prefixes of the paths that need one of ``ctx.api_keys`` (none needed while
    that is empty); ``key_refusal`` is the 401's message. ``cors``: the CORS policy
    (:mod:`smgd.api.http.cors`), None when off; replaced whole on reload. ``metrics`` counts
    responses and refusals, ``recorder`` the generation requests that ran. ``background``:
    tasks that run for the app's life, beside the requests.
    """

    def __init__(
        self,
        routes: Mapping[str, Route],
        ctx: ApiContext,
        *,
        key_paths: tuple[str, ...],
        key_refusal: str,
        prefix_routes: Mapping[str, Route] | None = None,
        cors: CorsPolicy | None = None,
        metrics: RequestMetrics | None = None,
        recorder: Recorder | None = None,
        background: Iterable[Callable[[], Awaitable[None]]] = (),
    ) -> None:
        self.routes = routes
        # (prefix, route template, route), longest prefix first.
        self._prefixes = sorted(
            ((t[: t.index("{")], t, r) for t, r in (prefix_routes or {}).items()),
            key=lambda item: -len(item[0]),
        )
        self.cors = cors
        self.ctx = ctx
        self._key_paths = key_paths
        self._key_refusal = key_refusal
        self._metrics = metrics
        self._recorder = recorder
        self._background = tuple(background)
        self.nursery: trio.Nursery | None = None  # the app-wide nursery, while it runs

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The app's life: its nursery (home of ``n > 1`` stream pumps) and background tasks,
        until cancelled. The ASGI lifespan runs it."""
        try:
            async with trio.open_nursery() as nursery:
                for task in self._background:
                    nursery.start_soon(task)
                self.nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self.nursery = None

    def end_responses(self) -> None:
        """The drain's deadline passed: end every request still running, each properly.

        Streams send their error event (``code: "drain_timeout"``) and ``[DONE]``; the HTTP
        server (:func:`smgd.api.http.worker_loop.serve`) lets them write it before it closes.
        """
        timeout = self.ctx.gateway.config.server.drain_timeout_s
        ended = self.ctx.cutoff.cut(
            "smgd is shutting down: the request was still running when the drain timeout "
            f"({timeout:g} s) ran out"
        )
        if ended:
            log.warning("drain timeout: ending %d request(s) with an error", ended)

    async def __call__(
        self, scope: Any, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        kind = scope["type"]
        if kind == "http":
            await self.serve(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        else:  # a websocket: no route takes one
            await _refuse_websocket(scope, send)

    async def _lifespan(self, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await nursery.start(self.run)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    nursery.cancel_scope.cancel()
                    break
        await send({"type": "lifespan.shutdown.complete"})

    async def serve(self, scope: Any, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        """One HTTP request, from its body to the end of its response."""
        limit = self.ctx.max_body_bytes
        outcome, data = await read_body(receive, limit, BODY_TIMEOUT_S, scope)
        if outcome == "disconnected":  # gone before the body's end: nothing to answer
            self._client_left(scope, "before its request body ended")
            return
        conn: DirectSendTCPServer | None = (scope.get("state") or {}).get(CONNECTION_KEY)
        if conn is None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                await self._answer(scope, outcome, data, limit, send)
                nursery.cancel_scope.cancel()
            return
        if conn.disconnected and self._runs_engine(scope):
            # Gone before the request was handled: its client closed (or half-closed, which
            # a read's end cannot tell from a close) right after sending it. An engine's work
            # for nobody is not started. Any other route's answer is at hand and costs
            # nothing: it is written, and a client that only half-closed (a health checker's
            # `nc -N`) reads it, whichever of the request's task and the read of the end
            # came first.
            self._client_left(scope, "before its request was handled")
            return
        if (scope.get("extensions") or _NO_EXTENSIONS).get(CANCELLED_ON_DISCONNECT):
            await self._answer(scope, outcome, data, limit, send)  # a scope of ours is spared
            return
        with trio.CancelScope() as request_scope:
            conn.on_disconnect = request_scope.cancel
            try:
                await self._answer(scope, outcome, data, limit, send)
            finally:
                conn.on_disconnect = None

    def _missed(self, path: str) -> tuple[Route | None, str, str, str]:
        """A path no route serves exactly: (route, the path, its template, the path's rest)
        of a prefix route, after an absolute-form target (``http://host/v1/models``) is
        reduced to its path (:func:`origin_path`); the route None when nothing serves it."""
        if not path.startswith("/"):
            path = origin_path(path)
            route = self.routes.get(path)
            if route is not None:
                return route, path, path, ""
        for prefix, template, route in self._prefixes:
            if path.startswith(prefix) and len(path) > len(prefix):
                return route, path, template, path[len(prefix) :]
        return None, path, path, ""

    def _check_access(self, path: str, route: Route | None, authorization: str | None) -> None:
        """401 without a valid key where one is needed; 503 for a generation while draining."""
        ctx = self.ctx
        needs_key = ctx.api_keys and path.startswith(self._key_paths)
        if needs_key and not authorized(ctx.api_keys, authorization):
            raise Unauthorized(self._key_refusal)
        if route is not None and route.generation and ctx.gateway.draining:
            raise Draining("smgd is shutting down; retry on another instance")

    async def _answer(
        self, scope: Any, outcome: BodyOutcome, data: bytes, limit: int, send: ASGISendCallable
    ) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        route = self.routes.get(path)
        template, tail = path, ""
        if route is None:  # (not on the hot path: the API's own paths are found above)
            route, path, template, tail = self._missed(path)
        label = template if route is not None and method in route.served else UNMATCHED
        request_id = new_request_id()
        call: Call | None = None
        writer: DirectWriter | None = None
        cors = self.cors
        origin: str | None = None
        extra: Mapping[str, str] | None = None  # CORS headers, on every answer
        try:
            if cors is not None:
                origin = _header(scope, b"origin")
                extra = cors.response_headers(origin)
            header = _header(scope, b"x-request-id")
            if header is not None:
                request_id = client_request_id(header)
            if cors is not None and method == "OPTIONS" and route is not None:
                preflight = _preflight(cors, scope, origin, route)
                if preflight is not None:  # before the key check: no key on a preflight
                    headers = {"Allow": route.allow, "X-Request-Id": request_id}
                    await self._send_whole(send, label, method, 204, b"", headers, preflight)
                    return
            self._check_access(path, route, _header(scope, b"authorization"))
            if route is None:
                raise _Refusal(404, not_found(method, path))
            if method not in route.methods:
                if method != "OPTIONS":  # a 405 must say what is allowed (RFC 9110 §15.5.6)
                    message = not_allowed(method, path, route.allow)
                    raise _Refusal(405, message, {"Allow": route.allow})
                headers = {"Allow": route.allow, "X-Request-Id": request_id}
                await self._send_whole(send, label, method, 200, b"", headers, extra)
                return
            if outcome == "too_large":
                raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
            if outcome == "timeout":
                raise _Refusal(408, TIMED_OUT)
            nursery = self.nursery
            assert nursery is not None, "a request before the app's lifespan started"
            writer = direct_writer(scope)
            call = Call(
                ctx=self.ctx,
                request_id=request_id,
                body=data,
                nursery=nursery,
                writer=writer,
                recorder=self._recorder,
                metrics=self._metrics,
                path_tail=tail,
            )
            try:
                reply = await route.handler(call)
            except trio.Cancelled:  # re-raised: only noted, when its client went away
                if _client_gone(scope):
                    logged = call.logged  # a generation's own line says so already
                    self._client_left(scope, "before its response", call.request_id, logged)
                raise
        except SmgdError as err:
            if call is not None:
                request_id = call.request_id  # /generate's `rid`, once it was checked
            if err.status >= 500:
                log.warning("%s: %s %s", request_id, err.status, err.message)
            if self._metrics is not None and (call is None or not call.recorded):
                self._metrics.refused(err, draining=self.ctx.gateway.draining)
            headers = error_headers(err, request_id)
            await self._send_whole(send, label, method, err.status, error_body(err), headers, extra)
            return
        except _Refusal as exc:
            headers = {
                "Content-Type": "application/json",
                **exc.headers,
                "X-Request-Id": request_id,
            }
            body = http_error(exc.status, exc.message)
            await self._send_whole(send, label, method, exc.status, body, headers, extra)
            return
        except Exception as exc:  # never trio.Cancelled (a BaseException): that one propagates
            log.exception("%s: unhandled error", request_id, exc_info=exc)
            internal = SmgdError(f"internal error: {type(exc).__name__}")
            if self._metrics is not None:
                self._metrics.refused(internal, draining=self.ctx.gateway.draining)
            headers = error_headers(internal, request_id)
            await self._send_whole(send, label, method, 500, error_body(internal), headers, extra)
            return
        headers = {**reply.headers, "X-Request-Id": call.request_id}
        if extra:
            headers.update(extra)
        if isinstance(reply.body, bytes):
            await self._send_whole(send, label, method, reply.status, reply.body, headers)
            return
        events = reply.body
        streamed = True  # counted as the stream's status (not if answered whole instead)
        ended = False  # the body's end went to the server
        held: _HeldStart | None = None
        start = _start(reply.status, headers)
        try:
            if RETRACT_HEAD in (scope.get("extensions") or _NO_EXTENSIONS):
                # The head goes to the server now: the engine's reader may write the events
                # itself, past this loop. The fast path holds it for the first event and
                # takes it back on request.
                await send(start)
                if writer is not None and writer.head_held:
                    self._bound_head(writer)
                failed = await _send_events(send, events)
                retracted = failed is not None and writer is not None and writer.head_held
                if retracted:
                    await send(_RETRACT)
            else:  # a server that writes a head at once, and cannot take it back: held here
                held = _HeldStart(send, start)
                if writer is not None:
                    # hypercorn's HTTP/1.1 path (a chunked body, Expect...): the engine's
                    # reader writes the events past this loop, so its writer waits until the
                    # head went (the first event's flush sends it, behind the deadline's
                    # send if that is under way: the held start's lock).
                    writer.wait_for_head(held.send)
                async with trio.open_nursery() as timer:
                    timer.start_soon(held.send_after, HEAD_HOLD_S)
                    failed = await _send_events(send, events, held)
                    retracted = failed is not None and held.retract()
                    if not retracted and not held.sent:  # (a direct stream's flush sent it)
                        await held.send()  # (or wait until the deadline's send has written it)
                    timer.cancel_scope.cancel()
            if failed is not None and retracted:
                # No byte of the response went out: the error is answered with its own status.
                streamed = False
                error = failed.error
                refusal = error_headers(error, call.request_id)
                body = error_body(error)
                await self._send_whole(send, label, method, error.status, body, refusal, extra)
                return
            if failed is not None:
                await send({"type": "http.response.body", "body": failed.event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            ended = True
        finally:
            if streamed and self._metrics is not None:
                status = reply.status
                if not ended and not _head_out(writer, held) and _client_gone(scope):
                    status = CLIENT_CLOSED  # gone before a byte of the response went out
                self._metrics.http(label, method, status)
            await events.aclose()  # the stream's own finally: engine abort, request log

    def _runs_engine(self, scope: Any) -> bool:
        """Whether the request's route runs engine requests (a generation or embeddings)."""
        route = self.routes.get(scope["path"])
        if route is None:
            route = self._missed(scope["path"])[0]
        return route is not None and route.generation

    def _client_left(
        self, scope: Any, when: str, request_id: str | None = None, logged: bool = False
    ) -> None:
        """The client went away ``when`` (before any byte of its response): counted in
        ``smgd_http_requests`` as nginx's 499, and logged at info unless the request wrote its
        own line (``logged``: a generation's, which says ``client disconnected (499)``)."""
        method: str = scope["method"]
        path: str = scope["path"]
        route = self.routes.get(path)
        template = path
        if route is None:
            route, path, template, _ = self._missed(path)
        label = template if route is not None and method in route.served else UNMATCHED
        if self._metrics is not None:
            self._metrics.http(label, method, CLIENT_CLOSED)
        if not logged:
            log.info(
                "%s %s %s: client disconnected %s (499)",
                request_id or "-", method, _quoted(path), when,
                extra={"request_id": request_id, "status": CLIENT_CLOSED,
                       "client_disconnected": True},
            )  # fmt: skip

    def _bound_head(self, writer: DirectWriter) -> None:
        """The held head goes out alone at the pacer's first tick after :data:`HEAD_HOLD_S`,
        if no event took it along by then; at once where no pacer ticks."""
        pacer = self.ctx.pacer
        due = trio.current_time() + HEAD_HOLD_S
        if pacer is None or not pacer.call_at(due, writer.send_head):
            writer.send_head()

    async def _send_whole(
        self,
        send: ASGISendCallable,
        label: str,
        method: str,
        status: int,
        body: bytes,
        headers: Mapping[str, str],
        extra: Mapping[str, str] | None = None,
    ) -> None:
        if self._metrics is not None:
            self._metrics.http(label, method, status)
        whole = {**headers, "Content-Length": str(len(body))}
        if extra:
            whole.update(extra)
        await send(_start(status, whole))
        await send({"type": "http.response.body", "body": body, "more_body": False})


class _HeldStart:
    """A streamed response's start, kept back until its first chunk (or :data:`HEAD_HOLD_S`)
    where the server writes a head as soon as it is given one (HTTP/1.0, as nginx proxies by
    default; requests hypercorn's h11 reads; the admin listener; the tests' client), so that
    a stream failing before its first event can still be answered with its own status, as on
    the fast path.

    Two tasks may send it (the request's, at its first chunk, and the deadline's): the lock
    keeps the request's chunks behind a start still being written by the other. Chunks the
    engine's reader writes directly (h11's HTTP/1.1 requests) wait for it in their writer
    (:meth:`DirectWriter.wait_for_head`), whose flush sends it."""

    __slots__ = ("_lock", "_message", "_send", "_taken", "sent")

    def __init__(self, send: ASGISendCallable, message: Any) -> None:
        self._send, self._message = send, message
        self._lock = trio.Lock()
        self._taken = False  # sent, being sent, or retracted: decided
        self.sent = False  # written whole: a chunk may follow

    async def send(self) -> None:
        """Send the start, unless it went or was retracted; returns once it is written."""
        async with self._lock:
            if not self._taken:
                self._taken = True
                await self._send(self._message)
                self.sent = True

    async def send_after(self, delay_s: float) -> None:
        await trio.sleep(delay_s)
        await self.send()

    def retract(self) -> bool:
        """Never send the start (another response will be sent); False if it went already."""
        if self._taken:
            return False
        self._taken = True
        return True


async def _send_events(
    send: ASGISendCallable, events: AsyncGenerator[bytes, None], held: _HeldStart | None = None
) -> StreamFailed | None:
    """Send the stream's chunks, the held start before the first; its failure, if it failed
    (the caller sends the start of a stream that ends without a chunk)."""
    try:
        async for chunk in events:
            if held is not None and not held.sent:
                await held.send()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except StreamFailed as failed:
        return failed
    return None


async def _refuse_websocket(scope: Any, send: ASGISendCallable) -> None:
    """A WebSocket handshake: a 404 with the error envelope where the server can send one
    (hypercorn can: ASGI's ``websocket.http.response``), else a refused handshake (403)."""
    if "websocket.http.response" not in (scope.get("extensions") or {}):
        await send({"type": "websocket.close", "code": 1000, "reason": ""})
        return
    path = _quoted(scope["path"])
    body = http_error(404, f"Invalid URL (WebSocket {path}): smgd serves no WebSocket endpoint")
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "websocket.http.response.start", "status": 404, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body, "more_body": False})


def origin_path(target: str) -> str:
    """The path of an absolute-form request target (``http://host:port/path``), which a
    server must accept (RFC 9112 §3.2.2; hypercorn hands it on whole as the ASGI path), or
    ``target`` when it is not one. An absolute-form target without a path is ``/``."""
    scheme, sep, rest = target.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return target
    slash = rest.find("/")
    return rest[slash:] if slash >= 0 else "/"


def authorized(keys: tuple[bytes, ...], header: str | None) -> bool:
    """``Authorization: Bearer <one of keys>``; the scheme name is case-insensitive (RFC 9110)."""
    scheme, _, credentials = (header or "").strip().partition(" ")
    given = credentials.strip().encode()
    if scheme.lower() != "bearer" or not given:
        return False
    ok = False
    for key in keys:  # compare with every key: the time taken does not reveal which matched
        ok |= hmac.compare_digest(given, key)
    return ok


def client_request_id(header: str) -> str:
    """The client's request id from an ``X-Request-Id`` header value (400 if malformed).

    A proxy that receives the header twice may merge the two into one list, ``a, b``
    (RFC 9110 §5.3): the first value is the original client's, and the one used.
    """
    return check_request_id(header.split(",", 1)[0].strip(), "X-Request-Id")


def _preflight(
    cors: CorsPolicy, scope: Any, origin: str | None, route: Route
) -> Mapping[str, str] | None:
    """A CORS preflight's answer headers; None when the request is no preflight from an
    allowed origin (then it is answered as any ``OPTIONS``)."""
    if origin is None or _header(scope, b"access-control-request-method") is None:
        return None
    requested = _header(scope, b"access-control-request-headers")
    return cors.preflight_headers(origin, route.allow, requested)


def _start(status: int, headers: Mapping[str, str]) -> Any:
    return {
        "type": "http.response.start",
        "status": status,
        "headers": [(k.lower().encode(), v.encode("latin-1")) for k, v in headers.items()],
    }


def _header(scope: Any, name: bytes) -> str | None:
    """The first value of request header ``name`` (lower case), decoded as latin-1.

    Header names arrive lower-cased from both of smgd's readers (the fast path's and h11's),
    as ASGI asks: compared as they are, without a ``lower()`` per header per lookup.
    """
    for key, value in scope["headers"]:
        if key == name:
            text: str = value.decode("latin-1")
            return text
    return None


async def read_body(
    receive: ASGIReceiveCallable, limit: int | None, wait_s: float | None, scope: Any = None
) -> tuple[BodyOutcome, bytes]:
    """The request's whole body, read up to its end, ``limit`` bytes or ``wait_s`` seconds.

    Messages already queued (hypercorn queues a small request's body and its end as two
    messages before the request's task first runs) are taken without a scheduler pass or a
    cancel scope; only a body still on its way is awaited, under the timeout. Messages after
    the body's end (a disconnect) stay queued. A body still on its way whose declared length
    (``scope``'s ``Content-Length``) is over ``limit`` is not waited for: too large at once.
    """
    body = _Body(limit)
    nowait = _nowait_receiver(receive)
    if nowait is not None:
        while True:
            try:
                message = nowait()
            except trio.WouldBlock:
                break
            if (outcome := body.add(message)) is not None:
                return outcome, body.data(outcome)
    if limit is not None and scope is not None:
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return "too_large", b""
    with trio.move_on_after(math.inf if wait_s is None else wait_s):
        while True:
            if (outcome := body.add(await receive())) is not None:
                return outcome, body.data(outcome)
    return "timeout", b""


def _nowait_receiver(receive: Any) -> Callable[[], Any] | None:
    """The ``receive_nowait`` beside ``receive``, if any: of the trio memory channel behind
    hypercorn's (it passes a channel's bound ``receive``: tests/test_pins.py checks it still
    does), or of the fast path's inbox (smgd.api.http.fast_path)."""
    source = getattr(receive, "__self__", None)
    nowait: Callable[[], Any] | None = getattr(source, "receive_nowait", None)
    return nowait


class _Body:
    """A request body as its ASGI messages arrive."""

    __slots__ = ("_limit", "_parts", "_size")

    def __init__(self, limit: int | None) -> None:
        self._limit = limit
        self._parts: list[bytes] = []
        self._size = 0

    def add(self, message: Any) -> BodyOutcome | None:
        """Take one message; the outcome once the body is settled, else None."""
        if message["type"] == "http.disconnect":
            return "disconnected"
        if message["type"] != "http.request":
            return None
        data = message.get("body", b"")
        if data:
            self._parts.append(data)
            self._size += len(data)
        if self._limit is not None and self._size > self._limit:
            return "too_large"
        return None if message.get("more_body", False) else "complete"

    def data(self, outcome: BodyOutcome) -> bytes:
        """The whole body once ``complete``; nothing for any other outcome."""
        if outcome != "complete":
            return b""
        parts = self._parts
        return parts[0] if len(parts) == 1 else b"".join(parts)


def _client_gone(scope: Any) -> bool:
    """Whether the request's client went away: on smgd's worker loop its connection says so;
    under another server only a disconnect cancels a request (:func:`_cancel_on_disconnect`)."""
    conn: DirectSendTCPServer | None = (scope.get("state") or {}).get(CONNECTION_KEY)
    return conn is None or conn.disconnected


def _head_out(writer: DirectWriter | None, held: _HeldStart | None) -> bool:
    """Whether a streamed response's head went to the server: it waits in the fast path's
    direct writer for the first event, or in ``held`` for hypercorn's path."""
    if held is not None:
        return held.sent
    return writer is None or not writer.head_held


async def _cancel_on_disconnect(receive: ASGIReceiveCallable, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return
