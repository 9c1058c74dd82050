"""The root task tree of one daemon (docs/design.md, "The task tree"), and ``smgd serve``.

::

    run_daemon                       root nursery
    ├── signal task                  SIGTERM/SIGINT → drain (a second: stop now); SIGHUP → reload
    ├── admin server                 reload / drain / engine state (worker 0 only, with workers)
    ├── EngineSet (smgd.supervise)   one supervisor per engine: launch, watch, relaunch, reload
    ├── HTTP server                  smgd's hypercorn worker loop serving the app
    ├── supervisor watch             a worker drains when its supervisor is gone (workers only)
    ├── readiness barrier            logs (and sd_notifies) once every required engine is ready
    ├── drain task                   drain event → STOPPING=1 → HTTP server done → cancel all
    └── watchdog                     WATCHDOG=1 every half WATCHDOG_USEC (only under systemd)

Drain: readiness turns 503 and new requests get 503; in-flight streams run on for up to
``server.drain_timeout_s``; then everything is cancelled (streams end with an error event,
launched engines are stopped) and the process exits 0.

This module owns the gateway's ``started_at``, ``draining`` and ``drain_event``; the admin
listener drains and reloads through the functions :func:`run_daemon` hands it.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import trio

from smgd.api.http.server import bind_public, serve_admin, serve_http
from smgd.errors import ConfigError, SmgdError, TransportError
from smgd.gateway import Gateway
from smgd.gc_tuning import tune_gc
from smgd.limits import raise_open_files_limit
from smgd.logs import announce, setup_logging
from smgd.sdnotify import notify, watchdog
from smgd.supervise import EngineSet
from smgd.worker_id import current_worker, for_worker, report_started
from smgd.workers import reload_others, serve_workers, watch_supervisor

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from smgd.config import Config
    from smgd.reload import ReloadResult

log = logging.getLogger("smgd")

# Extra time past settle + drain timeout before the drain stops waiting for the HTTP server.
DRAIN_MARGIN_S = 2.0
# The readiness barrier looks for an engine not in the router yet this often (its supervisor
# puts it there as soon as it starts, so this is a look or two), and waits this long on one
# client before checking whether a relaunch replaced it (a replaced client never turns ready).
BARRIER_POLL_S = 0.05
BARRIER_RECHECK_S = 1.0


@dataclass(frozen=True)
class Running:
    """What :func:`run_daemon` reports once it serves: its state, addresses and actions."""

    gateway: Gateway
    binds: list[str]  # the public listener's URLs
    admin_binds: list[str]  # the admin listener's URLs ([] in a worker other than 0)
    reload: Callable[[], Awaitable[ReloadResult]]  # what POST /admin/reload does
    drain: Callable[[], None]  # what POST /admin/drain and SIGTERM do


async def readiness_barrier(gateway: Gateway) -> None:
    required = [e.name for e in gateway.config.engines if e.required]
    for name in required:
        while (client := gateway.router.get(name)) is None or not client.ready:
            if client is None:
                await trio.sleep(BARRIER_POLL_S)
            else:
                with trio.move_on_after(BARRIER_RECHECK_S):
                    await client.wait_ready()
    log.info("ready: %d engine(s) serving", len(required))
    notify("READY=1")


def begin_drain(gateway: Gateway) -> None:
    """Start the drain (idempotent): readiness and new requests turn 503, the drain task runs."""
    gateway.draining = True
    gateway.drain_event.set()


async def _reload_all_workers(engines: EngineSet) -> ReloadResult:
    """Worker 0's admin reload: apply it here, then have the supervisor reload the others."""
    result = await engines.reload()
    if result.ok:
        reload_others()
    return result


async def _signal_task(
    gateway: Gateway,
    engines: EngineSet,
    cancel_all: Callable[[], None],
    *,
    task_status: trio.TaskStatus[None],
) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        task_status.started()
        async for signum in signals:
            if signum == signal.SIGHUP:
                log.info("SIGHUP: reloading %s", engines.config_path)
                engines.nursery.start_soon(engines.reload)
                continue
            if gateway.draining:
                log.warning("second signal (%s): stopping now", signal.Signals(signum).name)
                cancel_all()
                return
            log.info("%s: draining", signal.Signals(signum).name)
            begin_drain(gateway)


async def _drain_then_cancel(gateway: Gateway, cancel_all: Callable[[], None]) -> None:
    await gateway.drain_event.wait()
    notify("STOPPING=1")
    server = gateway.config.server
    # The HTTP server finishes its own graceful shutdown: after the settle window it stops
    # accepting and waits (up to drain_timeout_s, its graceful_timeout) for every response to
    # be written to the end, [DONE] included. Cancelling on engine idleness instead would cut
    # those tails. The margin only guards against a server that never returns.
    with trio.move_on_after(server.drain_settle_s + server.drain_timeout_s + DRAIN_MARGIN_S):
        await gateway.http_done.wait()
    left = sum(e.in_flight for e in gateway.router.engines())
    if left:
        log.warning("drain timeout: aborting %d request(s)", left)
    cancel_all()


async def run_daemon(
    config: Config,
    *,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    install_signals: bool = True,
    task_status: trio.TaskStatus[Running] = trio.TASK_STATUS_IGNORED,
) -> None:
    gateway = Gateway.from_config(config, started_at=trio.current_time())
    # The ports before any engine: a port that is taken must not launch one for nothing.
    listener = bind_public(gateway)
    try:
        async with trio.open_nursery() as nursery:
            engines = EngineSet(
                gateway, nursery, config_path=config_path, overrides=list(overrides or [])
            )
            worker = current_worker()
            # Worker 0's admin listener answers for every worker: its reload reaches them all.
            first_worker = worker is not None and worker.index == 0
            reload = partial(_reload_all_workers, engines) if first_worker else engines.reload
            drain = partial(begin_drain, gateway)
            if install_signals:
                await nursery.start(_signal_task, gateway, engines, nursery.cancel_scope.cancel)
            admin_binds: list[str] = []
            if worker is None or worker.index == 0:  # one admin listener for all workers
                admin_binds = await nursery.start(serve_admin, gateway, reload, drain)
            async with engines.lock:  # a reload asked for meanwhile waits for these
                for engine_config in config.engines:
                    await engines.start(engine_config)
            binds: list[str] = await nursery.start(serve_http, gateway, listener)
            if worker is not None:
                nursery.start_soon(watch_supervisor, os.getppid())
            nursery.start_soon(readiness_barrier, gateway)
            nursery.start_soon(_drain_then_cancel, gateway, nursery.cancel_scope.cancel)
            nursery.start_soon(watchdog)
            task_status.started(Running(gateway, binds, admin_binds, reload, drain))
    finally:
        listener.close()  # already closed by the server if it ran; not if an engine failed


def _first_smgd_error(exc: BaseException) -> SmgdError | None:
    if isinstance(exc, SmgdError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _first_smgd_error(inner)
            if found is not None:
                return found
    if isinstance(exc, OSError):
        return TransportError(str(exc))
    return None


def serve_main(
    config: Config, *, config_path: str | None = None, overrides: list[str] | None = None
) -> int:
    setup_logging(config.logging)
    tune_gc()
    raise_open_files_limit()
    worker = current_worker()
    as_supervisor = worker is None and config.server.workers > 1  # of N worker processes
    if worker is not None:
        config = for_worker(config, worker)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            if as_supervisor:
                binds = await nursery.start(
                    partial(
                        serve_workers,
                        config,
                        config_path=config_path,
                        overrides=list(overrides or []),
                    )
                )
            elif worker is not None:
                await nursery.start(
                    partial(run_daemon, config, config_path=config_path, overrides=overrides)
                )
                report_started()
                return  # the supervisor prints the banner once every worker serves
            else:
                running: Running = await nursery.start(
                    partial(run_daemon, config, config_path=config_path, overrides=overrides)
                )
                binds = running.binds
            if not binds:
                return  # stopped before it served (a SIGTERM while the workers started)
            for url in binds:
                announce(f"smgd listening on {url}", url=url)
            model = config.engines[0].models[0] if config.engines else "MODEL"
            base = binds[0] if binds else f"http://{config.server.host}:{config.server.port}"
            announce(
                "try: curl -N " + base + "/v1/completions -H 'Content-Type: application/json' "
                f'-d \'{{"model": "{model}", "prompt": "Hello, smgd!", '
                '"max_tokens": 32, "stream": true}\''
            )

    try:
        trio.run(main)
    except BaseException as exc:  # top level: turn it into a message and an exit code
        error = _first_smgd_error(exc)
        if error is None:
            if isinstance(exc, KeyboardInterrupt):
                return 0
            raise
        announce(f"smgd: {_describe(error)}", level=logging.ERROR)
        return 2 if isinstance(error, ConfigError) else 1
    return 0


def _describe(error: SmgdError) -> str:
    return error.one_line() if isinstance(error, ConfigError) else error.message
