"""The worker loop's keep-alive reaper (smgd.api.http.keep_alive), on connections of its own.

The connections here only record when the reaper closes them; tests/test_http_worker.py
checks the same behaviour on real connections of the worker loop.
"""

from __future__ import annotations

import trio
import trio.testing

from smgd.api.http.keep_alive import KeepAlive, KeepAliveReaper

TIMEOUT = 10.0


class _Conn:
    def __init__(self, name: str, closed: list[tuple[str, float]]) -> None:
        self.name = name
        self._closed = closed

    def close_idle(self) -> None:
        self._closed.append((self.name, trio.current_time()))


async def test_an_idle_connection_closes_at_its_deadline_and_not_before(
    autojump_clock: trio.testing.MockClock,
) -> None:
    closed: list[tuple[str, float]] = []
    reaper = KeepAliveReaper(TIMEOUT)
    async with trio.open_nursery() as nursery:
        await nursery.start(reaper.run)
        start = trio.current_time()
        reaper.idle(_Conn("a", closed))
        await trio.sleep(TIMEOUT - 0.5)
        assert closed == []
        await trio.sleep(1)
        assert closed == [("a", start + TIMEOUT)]
        assert reaper.idle_count == 0
        nursery.cancel_scope.cancel()


async def test_each_connection_closes_at_its_own_deadline_counted_from_its_last_idle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    closed: list[tuple[str, float]] = []
    reaper = KeepAliveReaper(TIMEOUT)
    a, b, c = _Conn("a", closed), _Conn("b", closed), _Conn("c", closed)
    async with trio.open_nursery() as nursery:
        await nursery.start(reaper.run)
        start = trio.current_time()
        reaper.idle(a)
        await trio.sleep(2)
        reaper.idle(b)
        reaper.idle(c)
        await trio.sleep(2)
        reaper.busy(b)  # a request: b does not close while it runs
        reaper.idle(a)  # a went idle again (after a request): its count starts again
        await trio.sleep(3 * TIMEOUT)
        assert closed == [("c", start + 2 + TIMEOUT), ("a", start + 4 + TIMEOUT)]
        nursery.cancel_scope.cancel()


async def test_a_reaper_with_nothing_idle_wakes_for_the_next_idle_connection(
    autojump_clock: trio.testing.MockClock,
) -> None:
    closed: list[tuple[str, float]] = []
    reaper = KeepAliveReaper(TIMEOUT)
    async with trio.open_nursery() as nursery:
        await nursery.start(reaper.run)
        await trio.sleep(100)  # waits with nothing due
        reaper.idle(_Conn("a", closed))
        idle_at = trio.current_time()
        await trio.sleep(TIMEOUT + 1)
        reaper.idle(_Conn("b", closed))  # after the table emptied again
        await trio.sleep(TIMEOUT + 1)
        assert closed == [("a", idle_at + TIMEOUT), ("b", idle_at + 2 * TIMEOUT + 1)]
        nursery.cancel_scope.cancel()


async def test_terminate_closes_the_idle_at_once_and_the_busy_when_they_go_idle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    closed: list[tuple[str, float]] = []
    reaper = KeepAliveReaper(TIMEOUT)
    idle, busy = _Conn("idle", closed), _Conn("busy", closed)
    async with trio.open_nursery() as nursery:
        await nursery.start(reaper.run)
        reaper.idle(idle)
        reaper.idle(busy)
        reaper.busy(busy)
        await trio.sleep(1)
        stop = trio.current_time()
        reaper.terminate()
        await trio.sleep(0.5)
        assert closed == [("idle", stop)]
        reaper.idle(busy)  # its request ended: it closes now, not a timeout later
        assert closed == [("idle", stop), ("busy", stop + 0.5)]
        nursery.cancel_scope.cancel()


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
    closed: list[tuple[str, float]] = []
    reaper = KeepAliveReaper(TIMEOUT)
    conn = _Conn("a", closed)
    keep_alive = KeepAlive(reaper, conn)
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
    async with trio.open_nursery() as nursery:
        await nursery.start(reaper.run)
        await trio.sleep(2 * TIMEOUT)
        nursery.cancel_scope.cancel()
    assert closed == []


class _Steps(trio.abc.Instrument):
    """Counts the scheduler steps of tasks whose name ends with ``suffix``."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith(self.suffix):
            self.steps += 1


async def test_a_connection_between_requests_and_idleness_does_not_wake_the_reaper(
    autojump_clock: trio.testing.MockClock,
) -> None:
    closed: list[tuple[str, float]] = []
    reaper = KeepAliveReaper(TIMEOUT)
    conn = _Conn("a", closed)
    steps = _Steps("KeepAliveReaper.run")
    async with trio.open_nursery() as nursery:
        await nursery.start(reaper.run)
        trio.lowlevel.add_instrument(steps)
        try:
            for _ in range(100):  # 100 requests, 10 ms apart, over one second
                reaper.idle(conn)
                await trio.sleep(0.005)
                reaper.busy(conn)
                await trio.sleep(0.005)
        finally:
            trio.lowlevel.remove_instrument(steps)
        nursery.cancel_scope.cancel()
    # Woken once, for the first idle connection (then it waits for that deadline, 10 s away).
    assert steps.steps == 1
    assert closed == []
