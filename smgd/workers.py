"""Several worker processes behind one port: ``server.workers = N`` (N > 1).

One process is one event loop on one core, and smgd's HTTP path costs CPU per request and per
SSE event (docs/performance.md). With ``workers = N`` the ``smgd serve`` process becomes a
small supervisor and N ordinary smgd daemons do the work:

- **Engines are partitioned, nothing is shared.** Worker ``k`` owns ``engines[i]`` for every
  ``i % N == k``: their sockets, their launched processes, their streams. No token crosses a
  process boundary it did not cross before (no relay, no extra hop), and every wire works,
  SGLang's single-front-end scheduler included. The price: every served model needs an engine
  in every worker (checked when the config loads), and routing policies (prefix affinity) act
  within one worker.
- **One port.** The supervisor binds one ``SO_REUSEPORT`` listening socket per worker on
  ``server.host:server.port``; the kernel spreads new connections over them by flow hash, so a
  burst of connections lands evenly (a shared socket would hand most of a burst to whichever
  worker wakes first, and keep-alive connections stay where they landed). A restarted worker
  gets its socket back, with the connections queued on it meanwhile. Under systemd socket
  activation every worker shares the activated sockets instead (and a worker's accept loop
  takes up to 256 waiting connections per wakeup, so a burst there lands on whichever wakes
  first).
- **Signals.** SIGTERM/SIGINT go to every worker (each drains its own streams); a second one
  stops them at once. SIGHUP goes to every worker, and each reloads its share of the new
  config. A reload through worker 0's admin listener (``smgd reload``, ``POST /admin/reload``)
  is applied there, then the supervisor (SIGUSR1) reloads the others.
- **Workers that die** are restarted with backoff (1 s doubling to 30 s) until a stop.
- **systemd.** The supervisor alone talks to systemd: READY=1 once every worker is started
  (not when engines are ready; ``/readiness`` tells that per worker), WATCHDOG=1 from its own
  loop, STOPPING=1 on a stop.

Only worker 0 binds the admin listener. ``/metrics``, ``/readiness`` and ``/get_load`` on the
public port cover every worker, whichever accepted the connection (:mod:`smgd.worker_peers`).
A worker reads its place (``k/N``) and its listening fds from the environment the supervisor
gives it, through the leaf :mod:`smgd.worker_id`.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from smgd.errors import TransportError
from smgd.sdnotify import notify, take_listen_fds, watchdog
from smgd.worker_id import WORKER_ENV, WORKER_FDS_ENV
from smgd.worker_peers import METRICS_DIR_ENV, METRICS_FD_ENV, bind_sockets

if TYPE_CHECKING:
    from smgd.config import Config

__all__ = ["reload_others", "reuseport_sockets", "serve_workers", "watch_supervisor"]

log = logging.getLogger("smgd.workers")

# A worker that dies is restarted after this delay, doubling up to the cap: a crash loop costs
# little while a one-off failure recovers in a second. Reset once a worker stayed up a minute.
RESTART_INITIAL_S = 1.0
RESTART_MAX_S = 30.0
RESTART_RESET_S = 60.0
# Same as the single-process listener (smgd.api.http.server): bursts of connects from many clients.
LISTEN_BACKLOG = 4096
# Environment a worker must not see: systemd's notification, watchdog and activation variables
# are the supervisor's (a worker answering them would confuse systemd).
_SUPERVISOR_ONLY = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_PID", "LISTEN_FDS")


# How often a worker checks that its supervisor is still there. A worker left behind by a
# SIGKILLed supervisor drains and exits within this long (plus its drain).
ORPHAN_CHECK_S = 1.0


async def watch_supervisor(parent: int) -> None:
    """In a worker: drain and exit (as on SIGTERM) once the supervisor is gone."""
    while os.getppid() == parent:  # noqa: ASYNC110 - no event tells a process its parent died
        await trio.sleep(ORPHAN_CHECK_S)
    log.warning("the supervisor (pid %d) is gone: draining", parent)
    os.kill(os.getpid(), signal.SIGTERM)


def reload_others() -> None:
    """Worker 0 applied a reload: ask the supervisor to reload every other worker."""
    os.kill(os.getppid(), signal.SIGUSR1)


# --------------------------------------------------------------------------- the supervisor


def reuseport_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` listening sockets on one address (port 0: the first one's ephemeral port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]
            sock.listen(LISTEN_BACKLOG)
            sock.set_inheritable(True)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise TransportError(f"cannot listen on {where}: {exc.strerror or exc}") from None
    return sockets


@dataclass
class _Supervisor:
    argv: list[str]
    count: int
    fds: list[list[int]]  # per worker: its listening fds
    metrics_dir: str  # the workers' metrics sockets (smgd.worker_peers)
    metrics_fds: list[int]  # per worker: its own metrics socket
    stopping: bool = False

    def __post_init__(self) -> None:
        self.procs: dict[int, trio.Process] = {}

    def env(self, index: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _SUPERVISOR_ONLY}
        env[WORKER_ENV] = f"{index}/{self.count}"
        env[WORKER_FDS_ENV] = ",".join(map(str, self.fds[index]))
        env[METRICS_DIR_ENV] = self.metrics_dir
        env[METRICS_FD_ENV] = str(self.metrics_fds[index])
        return env

    async def keep(self, index: int, started: trio.MemorySendChannel[int]) -> None:
        """Run worker ``index``; restart it when it dies, until a stop."""
        delay = RESTART_INITIAL_S
        first = True
        while not self.stopping:
            since = trio.current_time()
            # Own session: a terminal's Ctrl-C reaches the supervisor only, which forwards it
            # once (a worker seeing it twice would skip its drain).
            proc = await trio.lowlevel.open_process(
                self.argv,
                env=self.env(index),
                pass_fds=[*self.fds[index], self.metrics_fds[index]],
                start_new_session=True,
            )
            self.procs[index] = proc
            log.info("worker %d started (pid %d)", index, proc.pid)
            if first:
                first = False
                started.send_nowait(index)
            try:
                code = await proc.wait()
            finally:
                self.procs.pop(index, None)
                if proc.returncode is None:  # the supervisor itself is being cancelled
                    with trio.CancelScope(shield=True):
                        proc.kill()
                        await proc.wait()
            if self.stopping:
                log.info("worker %d exited with code %d", index, code)
                return
            if trio.current_time() - since > RESTART_RESET_S:
                delay = RESTART_INITIAL_S
            log.warning("worker %d exited with code %d; restarting in %.0f s", index, code, delay)
            await trio.sleep(delay)
            delay = min(delay * 2, RESTART_MAX_S)

    def signal_all(self, signum: int, *, skip: int | None = None) -> None:
        for index, proc in list(self.procs.items()):
            if index != skip and proc.returncode is None:
                proc.send_signal(signum)


async def _signals(sup: _Supervisor) -> None:
    with trio.open_signal_receiver(
        signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1
    ) as signals:
        async for signum in signals:
            if signum == signal.SIGHUP:
                log.info("SIGHUP: reloading every worker")
                sup.signal_all(signal.SIGHUP)
            elif signum == signal.SIGUSR1:
                sup.signal_all(signal.SIGHUP, skip=0)  # worker 0 reloaded already
            else:
                if not sup.stopping:
                    notify("STOPPING=1")
                    log.info("%s: stopping %d workers", signal.Signals(signum).name, sup.count)
                sup.stopping = True
                sup.signal_all(signum)


async def serve_workers(
    config: Config,
    *,
    config_path: str | None,
    overrides: list[str],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The supervisor: bind, start ``server.workers`` workers, forward signals, restart."""
    count = config.server.workers
    activated = take_listen_fds()
    sockets: list[socket.socket] = []
    if activated:
        fds = [activated] * count
        binds = [f"fd://{fd}" for fd in activated]
    else:
        sockets = reuseport_sockets(config.server.host, config.server.port, count)
        fds = [[s.fileno()] for s in sockets]
        host, port = sockets[0].getsockname()[:2]
        binds = [f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"]
    argv = [sys.executable, "-m", "smgd", "serve"]
    if config_path is not None:
        argv += ["--config", config_path]
    for item in overrides:
        argv += ["--set", item]
    # Private to this supervisor (mode 0700): only its workers read each other's metrics.
    metrics_dir = tempfile.mkdtemp(prefix="smgd-workers-")
    metrics_sockets = bind_sockets(metrics_dir, count)
    sup = _Supervisor(
        argv=argv,
        count=count,
        fds=fds,
        metrics_dir=metrics_dir,
        metrics_fds=[s.fileno() for s in metrics_sockets],
    )
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_signals, sup)
            nursery.start_soon(watchdog)
            send, receive = trio.open_memory_channel[int](count)
            async with trio.open_nursery() as workers:
                for index in range(count):
                    workers.start_soon(sup.keep, index, send)
                for _ in range(count):
                    await receive.receive()
                notify("READY=1")
                task_status.started(binds)
            nursery.cancel_scope.cancel()  # every worker is gone: stop the signal task too
    finally:
        for sock in [*sockets, *metrics_sockets]:
            sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
