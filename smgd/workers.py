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
- **One port.** The supervisor binds one ``SO_REUSEPORT`` socket per worker on
  ``server.host:server.port``; the kernel spreads new connections over the listening ones by
  flow hash, so a burst of connections lands evenly (a shared socket would hand most of a burst
  to whichever worker wakes first, and keep-alive connections stay where they landed). A worker
  starts listening on its socket once it serves, and the supervisor closes it when the worker
  dies: no connection waits on a worker that is starting, restarting, or cannot start (a
  restart reads the file on disk, which may be one a reload refused). Under systemd socket
  activation every worker shares the activated sockets instead (and a worker's accept loop
  takes up to 256 waiting connections per wakeup, so a burst there lands on whichever wakes
  first).
- **Signals.** SIGTERM/SIGINT go to every worker (each drains its own streams); a second one
  stops them at once. SIGHUP goes to every worker, and each reloads its share of the new
  config. A reload through worker 0's admin listener (``smgd reload``, ``POST /admin/reload``)
  is applied there, then the supervisor (SIGUSR1) reloads the others.
- **Workers that die** are restarted with backoff (1 s doubling to 30 s) until a stop, which
  does not wait the backoff out. A worker that cannot start the first time (it exits before it
  serves) stops smgd: the others are stopped and the supervisor exits 1, as one process would.
- **systemd.** The supervisor alone talks to systemd: READY=1 once every worker serves (its
  engines started; whether they are ready, ``/readiness`` tells per worker), WATCHDOG=1 from its own
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
from itertools import chain
from typing import TYPE_CHECKING

import trio

from smgd.errors import SmgdError, TransportError
from smgd.sdnotify import notify, take_listen_fds, watchdog
from smgd.worker_id import WORKER_ENV, WORKER_FDS_ENV, WORKER_STARTED_FD_ENV
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


def reuseport_sockets(
    host: str, port: int, count: int, *, listen: bool = True
) -> list[socket.socket]:
    """``count`` sockets bound to one address (port 0: the first one's ephemeral port),
    listening unless ``listen`` is False (a worker's: it listens once it serves)."""
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
            if listen:
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
    # Per worker: its listening sockets. Its own SO_REUSEPORT socket, bound here and listening
    # only once the worker serves; or, under socket activation, systemd's, shared by all.
    listeners: list[list[socket.socket]]
    address: tuple[str, int] | None  # where a dead worker's socket is bound again (None: shared)
    metrics_dir: str  # the workers' metrics sockets (smgd.worker_peers)
    metrics_fds: list[int]  # per worker: its own metrics socket
    stopping: bool = False

    def __post_init__(self) -> None:
        self.procs: dict[int, trio.Process] = {}
        self.stopped = trio.Event()

    def stop(self) -> None:
        """No worker is started or restarted any more (a backoff wait ends at once)."""
        self.stopping = True
        self.stopped.set()

    def env(self, index: int, started_fd: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _SUPERVISOR_ONLY}
        env[WORKER_ENV] = f"{index}/{self.count}"
        env[WORKER_FDS_ENV] = ",".join(str(s.fileno()) for s in self.listeners[index])
        env[WORKER_STARTED_FD_ENV] = str(started_fd)
        env[METRICS_DIR_ENV] = self.metrics_dir
        env[METRICS_FD_ENV] = str(self.metrics_fds[index])
        return env

    def close_listener(self, index: int) -> None:
        """A worker died: close its own socket, so that the kernel hands new connections to
        the others instead of queueing them where nobody accepts (for as long as the restart
        takes, or forever if it cannot start). Connections queued on it at the death are
        reset before any byte of an answer: safe for a client or a balancer to retry."""
        if self.address is None:
            return  # systemd's sockets, shared: the other workers accept from them
        for sock in self.listeners[index]:
            sock.close()

    def rebind_listener(self, index: int) -> None:
        """A fresh socket for a worker about to start again (TransportError if it cannot)."""
        if self.address is None or self.listeners[index][0].fileno() != -1:
            return  # shared, or still open: the first start
        self.listeners[index] = reuseport_sockets(*self.address, 1, listen=False)

    async def keep(
        self, index: int, started: trio.MemorySendChannel[tuple[int, int | None]]
    ) -> None:
        """Run worker ``index``; restart it when it dies, until a stop. Its first start is
        reported on ``started``: (index, None) once it serves, (index, exit code) if it died
        before (then it is not restarted: smgd as a whole could not start)."""
        delay = RESTART_INITIAL_S
        first = True
        while not self.stopping:
            since = trio.current_time()
            try:
                self.rebind_listener(index)
            except TransportError as exc:
                log.error("worker %d not restarted: %s; retrying in %.0f s", index, exc, delay)
                delay = await self._back_off(delay)
                continue
            read_end, write_end = os.pipe()
            try:
                # Own session: a terminal's Ctrl-C reaches the supervisor only, which forwards
                # it once (a worker seeing it twice would skip its drain).
                proc = await trio.lowlevel.open_process(
                    self.argv,
                    env=self.env(index, write_end),
                    pass_fds=[
                        *(s.fileno() for s in self.listeners[index]),
                        self.metrics_fds[index],
                        write_end,
                    ],
                    start_new_session=True,
                )
            except BaseException:
                os.close(read_end)
                raise
            finally:
                os.close(write_end)  # the worker's copy is the only one: its death ends the pipe
            self.procs[index] = proc
            log.info("worker %d started (pid %d)", index, proc.pid)
            try:
                serving = await _serves(read_end)
                if first:
                    first = False
                    if not serving:
                        code = await proc.wait()
                        started.send_nowait((index, code))
                        return
                    started.send_nowait((index, None))
                code = await proc.wait()
            finally:
                self.procs.pop(index, None)
                if proc.returncode is None:  # the supervisor itself is being cancelled
                    with trio.CancelScope(shield=True):
                        proc.kill()
                        await proc.wait()
            self.close_listener(index)
            if self.stopping:
                log.info("worker %d exited with code %d", index, code)
                return
            if trio.current_time() - since > RESTART_RESET_S:
                delay = RESTART_INITIAL_S
            log.warning("worker %d exited with code %d; restarting in %.0f s", index, code, delay)
            delay = await self._back_off(delay)

    async def _back_off(self, delay: float) -> float:
        """Wait ``delay`` before a restart (a stop ends the wait); the next delay."""
        with trio.move_on_after(delay):
            await self.stopped.wait()
        return min(delay * 2, RESTART_MAX_S)

    def signal_all(self, signum: int, *, skip: int | None = None) -> None:
        for index, proc in list(self.procs.items()):
            if index != skip and proc.returncode is None:
                proc.send_signal(signum)


async def _serves(read_end: int) -> bool:
    """Whether the worker behind the pipe's other end reported that it serves (True), or died
    before (the pipe ended, False). Closes ``read_end``."""
    async with trio.lowlevel.FdStream(read_end) as pipe:
        return bool(await pipe.receive_some(1))


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
                sup.stop()
                sup.signal_all(signum)


async def serve_workers(
    config: Config,
    *,
    config_path: str | None,
    overrides: list[str],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The supervisor: bind, start ``server.workers`` workers, forward signals, restart.

    Started (with the public address) once every worker serves; with no address if a stop
    came first. Raises :class:`~smgd.errors.SmgdError` when a worker could not start (its own
    error went to stderr), after stopping the others: what one process would do.
    """
    count = config.server.workers
    activated = take_listen_fds()
    if activated:
        shared = [socket.socket(fileno=fd) for fd in activated]
        for sock in shared:
            sock.set_inheritable(True)
        listeners = [shared] * count
        address = None
        binds = [f"fd://{fd}" for fd in activated]
    else:
        server = config.server
        listeners = [[s] for s in reuseport_sockets(server.host, server.port, count, listen=False)]
        host, port = listeners[0][0].getsockname()[:2]
        address = (host, port)
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
        listeners=listeners,
        address=address,
        metrics_dir=metrics_dir,
        metrics_fds=[s.fileno() for s in metrics_sockets],
    )
    failed: tuple[int, int] | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_signals, sup)
            nursery.start_soon(watchdog)
            send, receive = trio.open_memory_channel[tuple[int, int | None]](count)
            async with trio.open_nursery() as workers:
                for index in range(count):
                    workers.start_soon(sup.keep, index, send)
                for _ in range(count):
                    index, code = await receive.receive()
                    if code is None:
                        continue
                    if sup.stopping:  # a SIGTERM while they started: no address to announce
                        task_status.started([])
                        break
                    # One could not start: smgd could not, as one process would say. The others
                    # stop (drained: they have no stream yet).
                    failed = (index, code)
                    sup.stop()
                    sup.signal_all(signal.SIGTERM)
                    break
                else:
                    notify("READY=1")
                    task_status.started(binds)
            nursery.cancel_scope.cancel()  # every worker is gone: stop the signal task too
    finally:
        for sock in [*chain.from_iterable(listeners), *metrics_sockets]:
            sock.close()  # systemd's shared sockets come once per worker: a close is idempotent
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if failed is not None:
        index, code = failed
        raise SmgdError(f"worker {index} could not start (exit code {code}; its error is above)")
