"""The generation routes served without Quart's request machinery.

``POST /v1/completions``, ``/v1/chat/completions`` and ``/generate`` carry nearly all of a
gateway's traffic, and what each costs *per request* sets how long a burst of new requests
takes: when 256 streams end and restart together, TTFT is the time the whole burst needs, and
delivery at C = 256 follows TTFT (docs/performance.md). Through Quart a request costs a nursery
and two tasks (quart-trio's message reader and handler), a request context, the before/after
hooks, werkzeug's URL matching, request and response objects and Quart's send loop; profiled
at C = 256 with 8-token requests that was about a third of smgd's CPU.

:class:`SmgdApp` (the app :func:`smgd.api.http.app.create_app` builds) sends these three routes to
:class:`HotRoutes` and everything else to Quart. The handlers are the same functions Quart's
routes call (:func:`~smgd.api.handlers.openai.completion_reply` and the others take an explicit
:class:`~smgd.api.core.prepare.Call`), and everything around them is kept, in the same order:

- the body is read first, without a scheduler pass when it is already queued; over
  ``MAX_CONTENT_LENGTH`` → 413, not complete within ``BODY_TIMEOUT`` → 408, the client gone
  before its end → nothing is answered;
- ``X-Request-Id`` (checked, or minted) is echoed on every response; API keys and drain
  (:func:`check_access`) as for Quart's routes (:mod:`smgd.api.http.app`);
- errors are the OpenAI envelope with the same status and headers; the ``smgd_http_requests``
  and ``smgd_requests_refused`` counts are kept as Quart's hooks keep them;
- a client that disconnects cancels the request (the engine request is aborted): on smgd's
  own worker loop the connection calls back when its read loop ends
  (``DirectSendTCPServer.on_disconnect``), so no task per request waits for it; elsewhere
  (Quart's test client, another ASGI server) a task watches ``receive`` as quart-trio does.

On smgd's worker loop nothing between the body's arrival and the engine submit waits: the
handler, the response head (a direct socket write) and the submit run in one scheduler pass.
"""

from __future__ import annotations

import hmac
import logging
import math
from typing import TYPE_CHECKING, Any, Literal

import trio
from quart_trio import QuartTrio
from werkzeug.exceptions import RequestTimeout

from smgd.api.core.errors import error_body, error_headers, http_error
from smgd.api.core.pipeline import check_request_id, new_request_id
from smgd.api.core.prepare import Call, decode_body
from smgd.api.handlers import native, openai
from smgd.api.http.asgi_connection import nowait_receiver
from smgd.api.http.direct import CONNECTION_KEY, direct_writer
from smgd.errors import Draining, InvalidRequest, SmgdError, Unauthorized

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping

    from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable

    from smgd.api.core.prepare import ApiContext, Recorder, Reply
    from smgd.api.http.worker_loop import DirectSendTCPServer
    from smgd.metrics import RequestMetrics

    Handler = Callable[[Call, dict[str, Any]], Awaitable[Reply]]

__all__ = ["AUTH_PATHS", "HOT_ROUTES", "HotRoutes", "SmgdApp", "check_access", "client_request_id"]

log = logging.getLogger("smgd.api")

HOT_ROUTES: Mapping[str, Handler] = {
    "/v1/chat/completions": openai.chat_reply,
    "/v1/completions": openai.completion_reply,
    "/generate": native.generate_reply,
}
# Paths whose requests need an API key (when keys are configured).
AUTH_PATHS = ("/v1/", "/generate", "/tokenize", "/detokenize")

BodyOutcome = Literal["complete", "too_large", "timeout", "disconnected"]


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


def check_access(ctx: ApiContext, path: str, authorization: str | None) -> None:
    """401 without a valid key on a guarded path; 503 for a generation while draining."""
    if path.startswith(AUTH_PATHS):
        if ctx.api_keys and not authorized(ctx.api_keys, authorization):
            raise Unauthorized("Invalid or missing API key (Authorization: Bearer <key>)")
        if path in HOT_ROUTES and ctx.gateway.draining:
            raise Draining("smgd is shutting down; retry on another instance")


class SmgdApp(QuartTrio):
    """quart-trio's app, with the generation routes served by :class:`HotRoutes`."""

    hot: HotRoutes | None = None  # set by create_app once the metrics exist

    def end_responses(self) -> None:
        """The drain's deadline passed: end every request still running, each properly.

        Streams send their error event (``code: "drain_timeout"``) and ``[DONE]``; the HTTP
        server (:func:`smgd.api.http.worker_loop.serve`) lets them write it before it closes.
        """
        ctx: ApiContext = self.extensions["smgd"]
        timeout = ctx.gateway.config.server.drain_timeout_s
        ended = ctx.cutoff.cut(
            "smgd is shutting down: the request was still running when the drain timeout "
            f"({timeout:g} s) ran out"
        )
        if ended:
            log.warning("drain timeout: ending %d request(s) with an error", ended)

    async def __call__(
        self, scope: Any, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        hot = self.hot
        if hot is not None and scope["type"] == "http" and scope["method"] == "POST":
            handler = HOT_ROUTES.get(scope["path"])
            if handler is not None:
                await hot.serve(handler, scope, receive, send)
                return
        await self.asgi_app(scope, receive, send)


class _HTTPError(Exception):
    """A request refused before its handler for a reason that is not a :class:`SmgdError`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class HotRoutes:
    """Serves :data:`HOT_ROUTES` for one app."""

    def __init__(
        self, app: QuartTrio, ctx: ApiContext, metrics: RequestMetrics, recorder: Recorder
    ) -> None:
        self._app = app
        self._ctx = ctx
        self._metrics = metrics
        self._recorder = recorder

    async def serve(
        self,
        handler: Handler,
        scope: Any,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
    ) -> None:
        config = self._app.config
        outcome, data = await read_body(
            receive, config["MAX_CONTENT_LENGTH"], config["BODY_TIMEOUT"]
        )
        if outcome == "disconnected":
            return  # gone before the body's end: nothing to answer
        conn: DirectSendTCPServer | None = (scope.get("state") or {}).get(CONNECTION_KEY)
        if conn is None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                await self._answer(handler, scope, outcome, data, send)
                nursery.cancel_scope.cancel()
            return
        if conn.disconnected:
            return
        with trio.CancelScope() as request_scope:
            conn.on_disconnect = request_scope.cancel
            try:
                await self._answer(handler, scope, outcome, data, send)
            finally:
                conn.on_disconnect = None

    async def _answer(
        self,
        handler: Handler,
        scope: Any,
        outcome: BodyOutcome,
        data: bytes,
        send: ASGISendCallable,
    ) -> None:
        path: str = scope["path"]
        request_id = new_request_id()
        call: Call | None = None
        try:
            header = _header(scope, b"x-request-id")
            if header is not None:
                request_id = client_request_id(header)
            check_access(self._ctx, path, _header(scope, b"authorization"))
            if outcome == "too_large":
                limit = self._app.config["MAX_CONTENT_LENGTH"]
                raise _HTTPError(413, f"the request body is larger than {limit} bytes")
            if outcome == "timeout":
                raise _HTTPError(408, RequestTimeout.description or "request timeout")
            body = decode_body(data)
            call = Call(
                ctx=self._ctx,
                request_id=request_id,
                nursery=self._app.nursery,
                writer=direct_writer(scope),
                recorder=self._recorder,
            )
            reply = await handler(call, body)
        except SmgdError as err:
            if call is not None:
                request_id = call.request_id  # /generate's `rid`, once it was checked
            if err.status >= 500:
                log.warning("%s: %s %s", request_id, err.status, err.message)
            if call is None or not call.recorded:
                self._metrics.refused(err, draining=self._ctx.gateway.draining)
            headers = error_headers(err, request_id)
            await self._send_whole(send, path, err.status, error_body(err), headers)
            return
        except _HTTPError as exc:
            if exc.status == 413:
                refusal = InvalidRequest(exc.message)
                self._metrics.refused(refusal, draining=self._ctx.gateway.draining)
            headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
            body_bytes = http_error(exc.status, exc.message)
            await self._send_whole(send, path, exc.status, body_bytes, headers)
            return
        except Exception as exc:  # never trio.Cancelled (a BaseException): that one propagates
            log.exception("%s: unhandled error", request_id, exc_info=exc)
            internal = SmgdError(f"internal error: {type(exc).__name__}")
            self._metrics.refused(internal, draining=self._ctx.gateway.draining)
            headers = error_headers(internal, request_id)
            await self._send_whole(send, path, internal.status, error_body(internal), headers)
            return
        headers = {**reply.headers, "X-Request-Id": call.request_id}
        if isinstance(reply.body, bytes):
            await self._send_whole(send, path, 200, reply.body, headers)
            return
        self._metrics.http(path, "POST", 200)
        events = reply.body
        try:
            await send(_start(200, headers))
            async for chunk in events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await events.aclose()  # the stream's own finally: engine abort, request log

    async def _send_whole(
        self,
        send: ASGISendCallable,
        path: str,
        status: int,
        body: bytes,
        headers: Mapping[str, str],
    ) -> None:
        self._metrics.http(path, "POST", status)
        await send(_start(status, {**headers, "Content-Length": str(len(body))}))
        await send({"type": "http.response.body", "body": body, "more_body": False})


def _start(status: int, headers: Mapping[str, str]) -> Any:
    return {
        "type": "http.response.start",
        "status": status,
        "headers": [(k.lower().encode(), v.encode("latin-1")) for k, v in headers.items()],
    }


def _header(scope: Any, name: bytes) -> str | None:
    """The first value of request header ``name`` (lower case), decoded as werkzeug does."""
    for key, value in scope["headers"]:
        if key.lower() == name:
            text: str = value.decode("latin-1")
            return text
    return None


async def read_body(
    receive: ASGIReceiveCallable, limit: int | None, wait_s: float | None
) -> tuple[BodyOutcome, bytes]:
    """The request's whole body, read up to its end, ``limit`` bytes or ``wait_s`` seconds.

    Messages already queued (hypercorn queues a small request's body and its end as two
    messages before the request's task first runs) are taken without a scheduler pass or a
    cancel scope; only a body still on its way is awaited, under the timeout.
    """
    body = _Body(limit)
    nowait = nowait_receiver(receive)
    if nowait is not None:
        while True:
            try:
                message = nowait()
            except trio.WouldBlock:
                break
            if (outcome := body.add(message)) is not None:
                return outcome, body.data(outcome)
    with trio.move_on_after(math.inf if wait_s is None else wait_s):
        while True:
            if (outcome := body.add(await receive())) is not None:
                return outcome, body.data(outcome)
    return "timeout", b""


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


async def _cancel_on_disconnect(receive: ASGIReceiveCallable, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return
