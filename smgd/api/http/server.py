"""The HTTP listeners: the public API (:func:`serve_http`) and the admin one (:func:`serve_admin`).

The public app (:func:`smgd.api.http.app.create_app`) runs under smgd's worker loop,
:func:`smgd.api.http.worker_loop.serve` (hypercorn's parts, with a direct socket write for
each response chunk); the admin app, whose requests are few and short, under
``hypercorn.trio.serve``.

The public listener binds ``server.host:server.port``, unless systemd socket activation passed
listening sockets (``LISTEN_PID`` is this process, ``LISTEN_FDS >= 1``): then hypercorn serves
those fds (``fd://3`` ...) and the host and port in the config are not used.

Binding (:func:`bind_public`) is separate from serving (:func:`serve_http`): the daemon binds
before it launches any engine, so a port that is taken fails at once, naming the address,
without launching an engine for nothing.

The admin listener is a unix socket by default, ``<run_dir>/admin.sock``, inside the 0700 run
directory, so only smgd's user can reach it. ``[admin] port > 0`` moves it to TCP on
``admin.host`` (loopback by default); ``admin.token_env`` then names an env var holding a
bearer token that every admin request must carry (an unset or empty one is a config error at
start).
"""

from __future__ import annotations

import errno
import logging
import socket
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import hypercorn.trio
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets

from smgd.api.http.app import create_admin_app, create_app
from smgd.api.http.worker_loop import serve
from smgd.config import run_dir
from smgd.errors import TransportError, errno_name
from smgd.ipc import prepare_ipc_endpoint
from smgd.sdnotify import take_listen_fds
from smgd.worker_id import worker_listen_fds

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from smgd.config import ServerConfig
    from smgd.gateway import Gateway
    from smgd.reload import ReloadResult

log = logging.getLogger("smgd.http")


def public_binds(server: ServerConfig, fds: Sequence[int] = ()) -> list[str]:
    """hypercorn binds for the public listener: the activated fds if any, else host:port."""
    if fds:
        return [f"fd://{fd}" for fd in fds]
    host = f"[{server.host}]" if ":" in server.host else server.host
    return [f"{host}:{server.port}"]


def hypercorn_config(gateway: Gateway, listen_fds: Sequence[int] = ()) -> HypercornConfig:
    server = gateway.config.server
    cfg = HypercornConfig()
    cfg.bind = public_binds(server, listen_fds)
    # hypercorn's default 3 s graceful timeout would cut LLM streams; drain owns the deadline.
    cfg.graceful_timeout = server.drain_timeout_s
    cfg.accesslog = (
        logging.getLogger("hypercorn.access") if gateway.config.logging.access_log else None
    )
    cfg.errorlog = logging.getLogger("hypercorn.error")
    # Streams idle between tokens for long prefills; keep-alive of idle connections is separate.
    cfg.keep_alive_timeout = 75
    # hypercorn's default listen backlog is 100; a gateway takes bursts of connects from many
    # clients at once. The kernel caps the value at net.core.somaxconn.
    cfg.backlog = 4096
    cfg.h11_max_incomplete_size = 64 * 1024  # request line + headers; bodies are limited by the app
    return cfg


@dataclass
class PublicListener:
    """The bound public listening sockets and the hypercorn config that serves them."""

    config: HypercornConfig
    sockets: list[socket.socket]

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def bind_public(gateway: Gateway) -> PublicListener:
    """Bind the public listener (or take the worker's / systemd's fds); raises TransportError
    naming the address when it cannot (port taken, no permission, address not local)."""
    # A worker serves the sockets its supervisor bound (smgd.workers); else systemd's, if any.
    fds = worker_listen_fds()
    if fds:
        log.debug("worker: serving the supervisor's fd(s) %s", ", ".join(map(str, fds)))
    else:
        fds = take_listen_fds()
        if fds:
            log.info("socket activation: serving fd(s) %s", ", ".join(map(str, fds)))
    cfg = hypercorn_config(gateway, fds)
    if fds:
        sockets = [socket.socket(fileno=fd) for fd in fds]
    else:
        server = gateway.config.server
        sockets = [listen_tcp(server.host, server.port, cfg.backlog, key="server.port")]
    for sock in sockets:
        sock.setblocking(False)
    return PublicListener(cfg, sockets)


def listen_tcp(host: str, port: int, backlog: int, *, key: str) -> socket.socket:
    """A listening TCP socket on ``host:port``; TransportError naming the address if not, and
    ``key`` (the config key of the port: ``server.port``, ``admin.port``) if it is taken."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        hint = (
            f" (another process listens there: stop it, or choose another {key})"
            if exc.errno == errno.EADDRINUSE
            else ""
        )
        raise TransportError(
            f"cannot listen on {where}: {exc.strerror or exc}{hint}", code=errno_name(exc.errno)
        ) from None
    return sock


async def _stop_accepting(gateway: Gateway) -> None:
    """hypercorn's shutdown trigger: drain started, then the settle window passed."""
    await gateway.drain_event.wait()
    await trio.sleep(gateway.config.server.drain_settle_s)


async def serve_http(
    gateway: Gateway,
    listener: PublicListener | None = None,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the app on ``listener`` (bound here if None) until the drain closes it."""
    app = create_app(gateway)
    if listener is None:
        listener = bind_public(gateway)
    try:
        await serve(
            app,
            listener.config,
            sockets=Sockets([], listener.sockets, []),
            shutdown_trigger=partial(_stop_accepting, gateway),
            end_responses=app.end_responses,
            task_status=task_status,
        )
    finally:
        listener.close()
        gateway.http_done.set()


def admin_socket_path(gateway: Gateway) -> str:
    return str(run_dir(gateway.config) / "admin.sock")


def admin_bind(gateway: Gateway) -> str:
    admin = gateway.config.admin
    if admin.port > 0:
        return f"{admin.host}:{admin.port}"
    return f"unix:{admin_socket_path(gateway)}"


async def serve_admin(
    gateway: Gateway,
    reload: Callable[[], Awaitable[ReloadResult]],
    drain: Callable[[], None],
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the admin app (with the daemon's ``reload`` and ``drain``) until cancelled."""
    bind = admin_bind(gateway)
    if bind.startswith("unix:"):
        prepare_ipc_endpoint(bind[len("unix:") :])  # 0700 dir, stale socket cleared, live refused
    cfg = HypercornConfig()
    cfg.bind = [bind]
    admin = gateway.config.admin
    if admin.port > 0:
        # Bound here, so a taken port is an error naming the address; hypercorn owns the fd.
        sock = listen_tcp(admin.host, admin.port, cfg.backlog, key="admin.port")
        cfg.bind = [f"fd://{sock.detach()}"]
    cfg.graceful_timeout = 1.0  # admin requests are short
    cfg.accesslog = None
    cfg.errorlog = logging.getLogger("hypercorn.error")  # through smgd's log format, once
    await hypercorn.trio.serve(
        create_admin_app(gateway, reload, drain),
        cfg,
        shutdown_trigger=trio.sleep_forever,
        task_status=task_status,
    )
