"""The HTTP server: hypercorn's HTTP/1.1 protocol serving the quart-trio app (nursery.start).

The worker loop is :func:`smgd.api.http_worker.serve` (hypercorn's parts, with a direct socket
write for each response chunk), not ``hypercorn.trio.serve``.

The public listener binds ``server.host:server.port``, unless systemd socket activation passed
listening sockets (``LISTEN_PID`` is this process, ``LISTEN_FDS >= 1``): then hypercorn serves
those fds (``fd://3`` ...) and the host and port in the config are not used.

Binding (:func:`bind_public`) is separate from serving (:func:`serve_http`): the daemon binds
before it launches any engine, so a port that is taken fails at once, naming the address,
without launching an engine for nothing.
"""

from __future__ import annotations

import errno
import logging
import socket
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets

from smgd.api.http_worker import serve
from smgd.errors import TransportError, errno_name
from smgd.sdnotify import take_listen_fds
from smgd.worker_id import worker_listen_fds

if TYPE_CHECKING:
    from collections.abc import Sequence

    from smgd.config import ServerConfig
    from smgd.gateway import Gateway

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
        sockets = [listen_tcp(server.host, server.port, cfg.backlog)]
    for sock in sockets:
        sock.setblocking(False)
    return PublicListener(cfg, sockets)


def listen_tcp(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket on ``host:port``; TransportError naming the address if not."""
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
            " (another process listens there: stop it, or choose another server.port)"
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
    from smgd.api.app import create_app

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
