"""Keep-alive for a worker loop's connections: one task closes every connection left idle.

hypercorn starts an idle-timeout task for a connection (through ``nursery.start`` and two lock
round-trips) every time the connection goes idle. smgd's first replacement kept one task per
connection, waiting in a cancel scope whose deadline it moved lazily; that task, its scope,
its wait on the shutdown event and the cancel that ended it with the connection were still
about a fifth of what a new connection cost the daemon (docs/performance.md, "Issue 21,
seventeenth pass"), and a burst of new connections (10,000 streams that start together) pays
it 10,000 times before a first token.

Here a worker loop has one :class:`KeepAliveReaper`. Every connection's timeout is the same
(``keep_alive_timeout``), so the order in which connections went idle is the order of their
deadlines: the reaper keeps the idle ones in a dict in that order and sleeps until the first
deadline. A connection going idle or busy costs a dict update. When the reaper wakes it closes
the connections whose deadline passed (a connection that was busy meanwhile has left the dict,
and one that went idle again has moved to its end).

At shutdown (:meth:`KeepAliveReaper.terminate`) every idle connection closes at once, and a
busy one as soon as its request ends, as hypercorn's own idle task does.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import trio

__all__ = ["IdleConnection", "KeepAlive", "KeepAliveReaper"]


class IdleConnection(Protocol):
    """A connection the reaper closes (:class:`smgd.api.http.worker_loop.DirectSendTCPServer`)."""

    def close_idle(self) -> None:
        """Close the connection unless a request came since it was found idle; must not block
        (it starts the close in the connection's own task group)."""
        ...


class KeepAliveReaper:
    """Closes the connections that stay idle ``timeout`` seconds, and the idle ones at shutdown.

    Run it with ``nursery.start(reaper.run)`` in a nursery that outlives the connections; a
    reaper that never runs closes nothing for idleness (a connection built by hand in a test).
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        # Idle connection -> when it closes. Insertion order is deadline order: one timeout for
        # all, and a connection that goes idle again is removed and re-inserted at the end.
        self._idle: dict[IdleConnection, float] = {}
        self._terminated = False
        self._lot = trio.lowlevel.ParkingLot()  # the reaper waits here for its next deadline
        # When the waiting reaper wakes by itself: inf while nothing is idle. It is woken only
        # then, for the first idle connection: a later deadline than the one it waits for
        # needs no wakeup (it looks again when it wakes), and a wakeup per request would
        # cost a connection that alternates between one request and idleness a task switch.
        self._wakes_at = math.inf

    @property
    def idle_count(self) -> int:
        return len(self._idle)

    def idle(self, conn: IdleConnection) -> None:
        """``conn`` went idle: it closes ``timeout`` from now unless it is busy again first."""
        if self._terminated:
            conn.close_idle()
            return
        idle = self._idle
        idle.pop(conn, None)
        idle[conn] = deadline = trio.current_time() + self.timeout
        if self._wakes_at == math.inf:
            self._wakes_at = deadline
            self._lot.unpark()

    def busy(self, conn: IdleConnection) -> None:
        """``conn`` is busy (a request started) or gone: it does not close for idleness."""
        self._idle.pop(conn, None)

    def terminate(self) -> None:
        """Shutdown: every idle connection closes now, and every other one once it is idle."""
        self._terminated = True
        self._lot.unpark_all()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self._wakes_at = first = next(iter(self._idle.values()), math.inf)
            with trio.move_on_at(first):
                await self._lot.park()
            self._close_due(trio.current_time())

    def _close_due(self, now: float) -> None:
        idle = self._idle
        while idle:
            conn, deadline = next(iter(idle.items()))
            if deadline > now and not self._terminated:
                return
            del idle[conn]
            conn.close_idle()


class KeepAlive:
    """One connection's keep-alive, as its ``idle_task``: hypercorn's ``TCPServer`` calls
    :meth:`restart` when the connection goes idle and :meth:`stop` when a request arrives (the
    calls it makes on its own ``TrioSingleTask``); smgd's fast path calls :meth:`busy` where it
    cannot await, and the connection :meth:`close` when its reading ended."""

    __slots__ = ("_conn", "_reaper", "idle")

    def __init__(self, reaper: KeepAliveReaper, conn: IdleConnection) -> None:
        self._reaper = reaper
        self._conn = conn
        self.idle = False  # between a request's end (or the connection's start) and the next

    async def restart(self, task_group: Any, action: Any) -> None:
        """The connection went idle (``task_group`` and ``action``, hypercorn's timeout task and
        where to run it, are not used)."""
        self.idle = True
        self._reaper.idle(self._conn)

    async def stop(self) -> None:
        """A request arrived: no timeout while it runs."""
        self.busy()

    def busy(self) -> None:
        """:meth:`stop`, where the caller cannot await (it has no checkpoint either)."""
        self.idle = False
        self._reaper.busy(self._conn)

    def close(self) -> None:
        """The connection's reading ended: nothing is closed for idleness any more."""
        self.busy()
