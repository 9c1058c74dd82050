"""The admin listener: reload, drain, engine state. Never on the public listener.

By default it listens on a unix socket, ``<run_dir>/admin.sock``, inside the 0700 run
directory, so only smgd's user can reach it. ``[admin] port > 0`` moves it to TCP on
``admin.host`` (loopback by default); ``admin.token_env`` then names an env var holding a bearer
token that every admin request must carry (an unset or empty one is a config error at start).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from quart import Response, request
from quart_trio import QuartTrio

from smgd.api.hot import authorized
from smgd.api.server import listen_tcp
from smgd.config import load_admin_token, run_dir

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from smgd.gateway import Gateway
    from smgd.reload import ReloadResult


def admin_socket_path(gateway: Gateway) -> str:
    return str(run_dir(gateway.config) / "admin.sock")


def admin_bind(gateway: Gateway) -> str:
    admin = gateway.config.admin
    if admin.port > 0:
        return f"{admin.host}:{admin.port}"
    return f"unix:{admin_socket_path(gateway)}"


def _json(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status=status, content_type="application/json")


def _error(message: str, status: int, kind: str) -> Response:
    return _json({"error": {"message": message, "type": kind, "param": None, "code": None}}, status)


def create_admin_app(
    gateway: Gateway, reload: Callable[[], Awaitable[ReloadResult]], drain: Callable[[], None]
) -> QuartTrio:
    app = QuartTrio("smgd-admin")
    app.config["RESPONSE_TIMEOUT"] = None
    # Configured but unset or empty is a ConfigError here (and already at start): never open.
    token = load_admin_token(gateway.config)

    @app.before_request
    async def _auth() -> Response | None:
        if token is not None and not authorized((token,), request.headers.get("Authorization")):
            return _error("invalid or missing admin token", 401, "authentication_error")
        return None

    @app.post("/admin/reload")
    async def reload_route() -> Response:
        result = await reload()
        return _json(result, 200 if result.ok else 400)

    @app.post("/admin/drain")
    async def drain_route() -> Response:
        drain()
        return _json({"draining": True})

    @app.get("/admin/engines")
    async def engines() -> Response:
        stats = [engine.statistics() for engine in gateway.router.engines()]
        return _json(
            {
                "draining": gateway.draining,
                "uptime_s": trio.current_time() - gateway.started_at,
                "reloads_total": gateway.reloads_total,
                "reload_failures_total": gateway.reload_failures_total,
                "engines": stats,
            }
        )

    return app


async def serve_admin(
    gateway: Gateway,
    reload: Callable[[], Awaitable[ReloadResult]],
    drain: Callable[[], None],
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    from smgd.ipc import prepare_ipc_endpoint

    bind = admin_bind(gateway)
    if bind.startswith("unix:"):
        prepare_ipc_endpoint(bind[len("unix:") :])  # 0700 dir, stale socket cleared, live refused
    cfg = HypercornConfig()
    cfg.bind = [bind]
    admin = gateway.config.admin
    if admin.port > 0:
        # Bound here, so a taken port is an error naming the address; hypercorn owns the fd.
        cfg.bind = [f"fd://{listen_tcp(admin.host, admin.port, cfg.backlog).detach()}"]
    cfg.graceful_timeout = 1.0  # admin requests are short
    cfg.accesslog = None
    cfg.errorlog = logging.getLogger("hypercorn.error")  # through smgd's log format, once
    await serve(
        create_admin_app(gateway, reload, drain),
        cfg,
        shutdown_trigger=trio.sleep_forever,
        task_status=task_status,
    )
