"""smgd's two apps: the public API (:func:`create_app`) and the admin listener's
(:func:`create_admin_app`), each a route table served by the one envelope
(:class:`~smgd.api.http.dispatch.Dispatcher`).

The public app:

- API keys (``Authorization: Bearer``, the scheme name in any case) guard the inference and
  model endpoints (:data:`KEY_PATHS`); keys come from the env var named by
  ``server.api_keys_env`` (comma-separated) and/or ``server.api_keys_file`` (one per line). A
  configured source without a key is a config error at start and a refused reload, never
  "no auth". Keys are never logged.
- While draining, new generation requests get 503 + ``Retry-After``.
- Bodies above ``server.max_body_bytes`` get 413.
- CORS (``server.cors_*``, :mod:`smgd.api.http.cors`) for pages on other origins; off when no
  origin is listed. It applies in place on reload, with the API keys.
- Metrics (:mod:`smgd.metrics`): one private registry per app (``app.ctx.registry``); every
  response is counted by route and status, every error answered before a stream started by
  cause, and each generation request once when it ends.
- With several workers (:mod:`smgd.worker_peers`), it answers its peers' questions (readiness,
  load, metrics) from a background task.

The admin app: reload, drain and engine state (:mod:`smgd.api.handlers.admin`), every route
behind ``admin.token_env``'s token when one is configured.
"""

from __future__ import annotations

import os
import time
from functools import partial
from typing import TYPE_CHECKING

import trio
from prometheus_client import generate_latest

from smgd.api.core.pacer import LoadPacer
from smgd.api.core.prepare import ApiContext
from smgd.api.handlers import admin, embeddings, lora, native, openai, ops
from smgd.api.http.cors import CorsPolicy
from smgd.api.http.dispatch import Dispatcher, Route
from smgd.config import load_admin_token, load_api_keys
from smgd.metrics import RequestMetrics, build_registry
from smgd.worker_peers import serve_own, worker_peers

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping

    from smgd.api.core.pipeline import RequestState
    from smgd.config import Config
    from smgd.gateway import Gateway
    from smgd.reload import ReloadResult

__all__ = ["KEY_PATHS", "PREFIX_ROUTES", "ROUTES", "admin_routes", "create_admin_app", "create_app"]

# Worker threads tokenizing big prompts at once: every core but one (at least one thread), so
# tokenization never takes the core the event loop streams every response from. Two threads
# on the 2-core target left the loop competing with them for CPU.
TOKENIZE_THREADS = max(1, (os.cpu_count() or 1) - 1)

ROUTES: Mapping[str, Route] = {
    "/v1/chat/completions": Route("POST", openai.chat_reply, generation=True),
    "/v1/completions": Route("POST", openai.completion_reply, generation=True),
    "/generate": Route("POST", native.generate_reply, generation=True),
    "/v1/embeddings": Route("POST", embeddings.embeddings_reply, generation=True),
    "/health": Route("GET", ops.health),
    "/liveness": Route("GET", ops.health),
    "/readiness": Route("GET", ops.readiness),
    "/v1/models": Route("GET", ops.models),
    "/v1/tokenize": Route("POST", ops.tokenize),
    "/tokenize": Route("POST", ops.tokenize),
    "/v1/detokenize": Route("POST", ops.detokenize),
    "/detokenize": Route("POST", ops.detokenize),
    "/metrics": Route("GET", ops.metrics),
    "/get_load": Route("GET", ops.get_load),
    "/v1/load_lora_adapter": Route("POST", lora.load_lora_adapter),
    "/v1/unload_lora_adapter": Route("POST", lora.unload_lora_adapter),
}
# Routes by path template: the model id may hold "/" ("org/model").
PREFIX_ROUTES: Mapping[str, Route] = {
    "/v1/models/{model}": Route("GET", ops.retrieve_model),
}
# Paths whose requests need an API key (when keys are configured): everything that reads a
# model or runs one. Probes and metrics stay open for load balancers and scrapers.
KEY_PATHS = ("/v1/", "/generate", "/tokenize", "/detokenize")


def create_app(gateway: Gateway, *, environ: Mapping[str, str] | None = None) -> Dispatcher:
    """The public API over ``gateway`` (``environ``: where the API keys' env var is read)."""
    server = gateway.config.server
    peers = worker_peers(os.environ if environ is None else environ)
    metrics = RequestMetrics()
    registry = build_registry(gateway, metrics)
    pacer = LoadPacer(
        max_window_s=server.coalesce_max_ms / 1000,
        idle=lambda: not any(engine.in_flight for engine in gateway.router.engines()),
    )
    ctx = ApiContext(
        gateway=gateway,
        api_keys=load_api_keys(gateway.config, environ),
        tokenize_limiter=trio.CapacityLimiter(TOKENIZE_THREADS),
        keepalive_s=server.keepalive_interval_s,
        created=int(time.time()),
        max_body_bytes=server.max_body_bytes,
        pacer=pacer,
        registry=registry,
        peers=peers,
    )
    background: list[Callable[[], Awaitable[None]]] = [pacer.run]
    if peers is not None:
        answers = {
            "metrics": partial(generate_latest, registry),
            "readiness": partial(ops.readiness_answer, gateway),
            "load": partial(ops.load_answer, gateway),
        }
        background.append(partial(serve_own, peers.own_fd, answers))

    def record(state: RequestState, now: float) -> None:
        metrics.record(state, now, draining=gateway.draining)

    def on_reload(config: Config) -> Callable[[], None]:
        # A key source that yields no key (or an unreadable file) refuses the whole reload, so
        # it can never leave auth open. The admin token is checked too: it applies at restart,
        # and a config that could not restart must not be accepted now.
        keys = load_api_keys(config, environ)
        load_admin_token(config, environ)

        def apply() -> None:
            ctx.api_keys = keys
            ctx.keepalive_s = config.server.keepalive_interval_s
            ctx.max_body_bytes = config.server.max_body_bytes
            app.cors = cors

        cors = CorsPolicy.from_config(config.server)
        return apply

    gateway.reload_hooks.append(on_reload)
    app = Dispatcher(
        ROUTES,
        ctx,
        prefix_routes=PREFIX_ROUTES,
        cors=CorsPolicy.from_config(server),
        key_paths=KEY_PATHS,
        key_refusal="Invalid or missing API key (Authorization: Bearer <key>)",
        metrics=metrics,
        recorder=record,
        background=background,
    )
    return app


def admin_routes(
    reload: Callable[[], Awaitable[ReloadResult]], drain: Callable[[], None]
) -> dict[str, Route]:
    """The admin listener's routes, with the daemon's ``reload`` and ``drain``."""
    return {
        "/admin/reload": Route("POST", partial(admin.reload, reload)),
        "/admin/drain": Route("POST", partial(admin.drain, drain)),
        "/admin/engines": Route("GET", admin.engines),
    }


def create_admin_app(
    gateway: Gateway, reload: Callable[[], Awaitable[ReloadResult]], drain: Callable[[], None]
) -> Dispatcher:
    """The admin listener's app; a ConfigError when ``admin.token_env`` is set but empty."""
    token = load_admin_token(gateway.config)  # configured but unset or empty: never open
    server = gateway.config.server
    ctx = ApiContext(
        gateway=gateway,
        api_keys=() if token is None else (token,),
        tokenize_limiter=trio.CapacityLimiter(1),  # no admin route tokenizes
        keepalive_s=server.keepalive_interval_s,
        created=int(time.time()),
        max_body_bytes=server.max_body_bytes,
    )
    return Dispatcher(
        admin_routes(reload, drain),
        ctx,
        key_paths=("/",),
        key_refusal="invalid or missing admin token",
    )
