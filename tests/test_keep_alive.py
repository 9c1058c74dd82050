"""The worker loop's keep-alive reaper (smgd.api.http.keep_alive), on connections of its own.

The connections here only record when the reaper closes them; tests/test_http_worker.py
checks the same behaviour on real connections of the worker loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio.testing

from smgd.api.http.keep_alive import KeepAlive, KeepAliveReaper

from .trio_helpers import TaskSteps

TIMEOUT = 10.0


class _Conn:
    def __init__(self, name: str, closed: list[tuple[str, float]]) -> None:
        self.name = name
        self._closed = closed

    def close_idle(self) -> None:
        self._closed.append((self.name, trio.current_time()))


class _Running:
    """A running reaper and what it closed: (connection name, when)."""

    def __init__(self) -> None:
        self.reaper = KeepAliveReaper(TIMEOUT)
        self.closed: list[tuple[str, float]] = []

    def conn(self, name: str) -> _Conn:
        return _Conn(name, self.closed)


@asynccontextmanager
async def _running() -> AsyncIterator[_Running]:
    running = _Running()
    async with trio.open_nursery() as nursery:
        await nursery.start(running.reaper.run)
        yield running
        nursery.cancel_scope.cancel()


async def test_an_idle_connection_closes_at_its_deadline_and_not_before(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with _running() as run:
        start = trio.current_time()
        run.reaper.idle(run.conn("a"))
        await trio.sleep(TIMEOUT - 0.5)
        assert run.closed == []
        await trio.sleep(1)
        assert run.closed == [("a", start + TIMEOUT)]
        assert run.reaper.idle_count == 0


async def test_each_connection_closes_at_its_own_deadline_counted_from_its_last_idle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with _running() as run:
        reaper = run.reaper
        a, b, c = run.conn("a"), run.conn("b"), run.conn("c")
        start = trio.current_time()
        reaper.idle(a)
        await trio.sleep(2)
        reaper.idle(b)
        reaper.idle(c)
        await trio.sleep(2)
        reaper.busy(b)  # a request: b does not close while it runs
        reaper.idle(a)  # a went idle again (after a request): its count starts again
        await trio.sleep(3 * TIMEOUT)
        assert run.closed == [("c", start + 2 + TIMEOUT), ("a", start + 4 + TIMEOUT)]


async def test_a_reaper_with_nothing_idle_wakes_for_the_next_idle_connection(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with _running() as run:
        await trio.sleep(100)  # waits with nothing due
        run.reaper.idle(run.conn("a"))
        idle_at = trio.current_time()
        await trio.sleep(TIMEOUT + 1)
        run.reaper.idle(run.conn("b"))  # after the table emptied again
        await trio.sleep(TIMEOUT + 1)
        assert run.closed == [("a", idle_at + TIMEOUT), ("b", idle_at + 2 * TIMEOUT + 1)]


async def test_terminate_closes_the_idle_at_once_and_the_busy_when_they_go_idle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with _running() as run:
        reaper = run.reaper
        idle, busy = run.conn("idle"), run.conn("busy")
        reaper.idle(idle)
        reaper.idle(busy)
        reaper.busy(busy)
        await trio.sleep(1)
        stop = trio.current_time()
        reaper.terminate()
        await trio.sleep(0.5)
        assert run.closed == [("idle", stop)]
        reaper.idle(busy)  # its request ended: it closes now, not a timeout later
        assert run.closed == [("idle", stop), ("busy", stop + 0.5)]


async def test_a_reaper_that_never_runs_closes_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    closed: list[tuple[str, float]] = []
    reaper = KeepAliveReaper(TIMEOUT)
    reaper.idle(_Conn("a", closed))
    await trio.sleep(10 * TIMEOUT)
    assert closed == []


async def test_a_connections_keep_alive_is_idle_between_requests_and_leaves_when_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with _running() as run:
        reaper = run.reaper
        keep_alive = KeepAlive(reaper, run.conn("a"))
        assert not keep_alive.idle
        await keep_alive.restart(None, None)  # what TCPServer calls when the connection is idle
        assert keep_alive.idle and reaper.idle_count == 1
        await keep_alive.stop()  # a request arrived
        assert not keep_alive.idle and reaper.idle_count == 0
        await keep_alive.restart(None, None)
        keep_alive.busy()
        assert not keep_alive.idle and reaper.idle_count == 0
        await keep_alive.restart(None, None)
        keep_alive.close()  # the connection's reading ended
        assert not keep_alive.idle and reaper.idle_count == 0
        await trio.sleep(2 * TIMEOUT)
        assert run.closed == []


async def test_a_connection_between_requests_and_idleness_does_not_wake_the_reaper(
    autojump_clock: trio.testing.MockClock,
) -> None:
    steps = TaskSteps("KeepAliveReaper.run")
    async with _running() as run:
        conn = run.conn("a")
        trio.lowlevel.add_instrument(steps)
        try:
            for _ in range(100):  # 100 requests, 10 ms apart, over one second
                run.reaper.idle(conn)
                await trio.sleep(0.005)
                run.reaper.busy(conn)
                await trio.sleep(0.005)
        finally:
            trio.lowlevel.remove_instrument(steps)
        assert run.closed == []
    # Woken once, for the first idle connection (then it waits for that deadline, 10 s away).
    assert steps.steps == 1
