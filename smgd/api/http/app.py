"""The quart-trio application: ``create_app(gateway)``.

Cross-cutting HTTP behaviour lives here; endpoints are in :mod:`~smgd.api.handlers.openai`,
:mod:`~smgd.api.handlers.native` and :mod:`~smgd.api.handlers.ops`.

- Request ids: ``X-Request-Id`` is accepted (1-128 of ``[A-Za-z0-9._:/+=@-]``, else 400; of a
  list ``a, b``, as proxies merge repeated headers, the first) or minted, echoed on every
  response, and used in the request's log line.
- API keys (``Authorization: Bearer``, the scheme name in any case) guard the inference
  endpoints only; keys come from the env var named by ``server.api_keys_env`` (comma-separated)
  and/or ``server.api_keys_file`` (one per line). A configured source without a key is a
  config error at start and a refused reload, never "no auth". Keys are never logged.
- While draining, new inference requests get 503 + ``Retry-After``.
- Bodies above ``server.max_body_bytes`` get 413. Quart's ``RESPONSE_TIMEOUT`` is disabled
  (it wraps the whole streamed body, so it would cut every stream longer than 60 s).
- Every error is the OpenAI envelope (:mod:`smgd.api.core.errors`).
- Metrics (:mod:`smgd.metrics`): one private registry per app, in ``app.extensions``; every
  response is counted by route template and status, every error answered before a stream
  started by cause, and each generation request once when it ends (``RECORDER_KEY``).
"""

from __future__ import annotations

import logging
import os
import time
from functools import partial
from typing import TYPE_CHECKING

import trio
from prometheus_client import generate_latest
from quart import Response, g, has_request_context, request
from werkzeug.exceptions import HTTPException

from smgd.api.core.errors import error_body, error_headers, http_error
from smgd.api.core.execute import RECORDER_KEY
from smgd.api.core.pacer import LoadPacer
from smgd.api.core.pipeline import new_request_id
from smgd.api.core.prepare import ApiContext, api
from smgd.api.handlers import native, openai, ops
from smgd.api.http.asgi_connection import InlineHTTPConnection
from smgd.api.http.dispatch import HotRoutes, SmgdApp, check_access, client_request_id
from smgd.config import load_admin_token, load_api_keys
from smgd.errors import InvalidRequest, SmgdError
from smgd.metrics import REGISTRY_KEY, RequestMetrics, build_registry
from smgd.worker_peers import PEERS_KEY, serve_own, worker_peers

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping

    from smgd.api.core.pipeline import RequestState
    from smgd.config import Config
    from smgd.gateway import Gateway

__all__ = ["create_app", "load_api_keys"]

log = logging.getLogger("smgd.api")

# Time to receive a whole request body. The largest allowed body (max_body_bytes, 8 MiB by
# default) arrives in milliseconds on a local socket; 60 s only cuts stalled uploads.
BODY_TIMEOUT_S = 60
# Worker threads tokenizing big prompts at once: every core but one (at least one thread), so
# tokenization never takes the core the event loop streams every response from. Two threads
# on the 2-core target left the loop competing with them for CPU.
TOKENIZE_THREADS = max(1, (os.cpu_count() or 1) - 1)


def _error_response(err: SmgdError) -> Response:
    rid = g.get("request_id")
    return Response(error_body(err), status=err.status, headers=error_headers(err, rid))


def create_app(gateway: Gateway, *, environ: Mapping[str, str] | None = None) -> SmgdApp:
    server = gateway.config.server
    app = SmgdApp("smgd")
    app.asgi_http_class = InlineHTTPConnection  # fewer scheduler passes per request
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = BODY_TIMEOUT_S
    app.config["MAX_CONTENT_LENGTH"] = server.max_body_bytes
    app.extensions["smgd"] = ApiContext(
        gateway=gateway,
        api_keys=load_api_keys(gateway.config, environ),
        tokenize_limiter=trio.CapacityLimiter(TOKENIZE_THREADS),
        keepalive_s=server.keepalive_interval_s,
        created=int(time.time()),
        pacer=LoadPacer(max_window_s=server.coalesce_max_ms / 1000),
    )

    background: list[trio.CancelScope] = []
    peers = worker_peers(os.environ if environ is None else environ)
    if peers is not None:
        app.extensions[PEERS_KEY] = peers

    async def _in_background(run: Callable[[], Awaitable[None]]) -> None:
        with trio.CancelScope() as scope:
            background.append(scope)
            await run()

    @app.before_serving
    async def _start_background() -> None:
        pacer = app.extensions["smgd"].pacer
        if pacer is not None:
            app.nursery.start_soon(_in_background, pacer.run)
        if peers is not None:
            registry = app.extensions[REGISTRY_KEY]
            answers = {
                "metrics": partial(generate_latest, registry),
                "readiness": partial(ops.readiness_answer, gateway),
                "load": partial(ops.load_answer, gateway),
            }
            app.nursery.start_soon(_in_background, partial(serve_own, peers.own_fd, answers))

    @app.after_serving
    async def _stop_background() -> None:
        # Background tasks would otherwise hold the app's shutdown for its 5 s timeout.
        for scope in background:
            scope.cancel()

    def on_reload(config: Config) -> Callable[[], None]:
        # A key source that yields no key (or an unreadable file) refuses the whole reload, so
        # it can never leave auth open. The admin token is checked too: it applies at restart,
        # and a config that could not restart must not be accepted now.
        keys = load_api_keys(config, environ)
        load_admin_token(config, environ)

        def apply() -> None:
            ctx = app.extensions["smgd"]
            ctx.api_keys = keys
            ctx.keepalive_s = config.server.keepalive_interval_s
            app.config["MAX_CONTENT_LENGTH"] = config.server.max_body_bytes

        return apply

    gateway.reload_hooks.append(on_reload)
    app.register_blueprint(openai.blueprint)
    app.register_blueprint(native.blueprint)
    app.register_blueprint(ops.blueprint)
    metrics = RequestMetrics()
    app.extensions[REGISTRY_KEY] = build_registry(gateway, metrics)

    def record(state: RequestState, now: float) -> None:
        metrics.record(state, now, draining=gateway.draining)
        if has_request_context():
            g.smgd_recorded = True  # the error handler must not count this request again

    app.extensions[RECORDER_KEY] = record
    app.hot = HotRoutes(app, app.extensions["smgd"], metrics, record)

    @app.before_request
    async def _before() -> None:
        header = request.headers.get("X-Request-Id")
        g.request_id = new_request_id()
        if header is not None:
            g.request_id = client_request_id(header)
        check_access(api(), request.path, request.headers.get("Authorization"))

    @app.after_request
    async def _after(response: Response) -> Response:
        rid = g.get("request_id")
        if rid is not None:
            response.headers["X-Request-Id"] = rid
        rule = request.url_rule
        metrics.http(
            rule.rule if rule is not None else "unmatched", request.method, response.status_code
        )
        return response

    @app.errorhandler(SmgdError)
    async def _smgd_error(err: SmgdError) -> Response:
        if err.status >= 500:
            log.warning("%s: %s %s", g.get("request_id"), err.status, err.message)
        if not g.get("smgd_recorded"):
            metrics.refused(err, draining=gateway.draining)
        return _error_response(err)

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        message = exc.description or exc.name
        if status == 413:
            message = f"the request body is larger than {server.max_body_bytes} bytes"
        if status in (400, 413):
            metrics.refused(InvalidRequest(message), draining=gateway.draining)
        headers = {"Content-Type": "application/json"}
        if rid := g.get("request_id"):
            headers["X-Request-Id"] = rid
        return Response(http_error(status, message), status=status, headers=headers)

    @app.errorhandler(Exception)
    async def _internal(exc: Exception) -> Response:
        log.exception("%s: unhandled error", g.get("request_id"), exc_info=exc)
        err = SmgdError(f"internal error: {type(exc).__name__}")
        metrics.refused(err, draining=gateway.draining)
        return _error_response(err)

    return app
