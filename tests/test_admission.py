"""Admission: in-flight cap, FIFO queue, queue bound and timeout (autojump clock)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from smgd.admission import Admission
from smgd.errors import Overloaded


async def test_cap_queues_then_admits_in_order(autojump_clock: trio.testing.MockClock) -> None:
    adm = Admission(max_inflight=1, max_queue=10, queue_timeout_s=100)
    order: list[int] = []

    async def user(i: int) -> None:
        async with adm.slot(i):
            order.append(i)
            await trio.sleep(1)

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(user, i)
            await trio.testing.wait_all_tasks_blocked()
        assert adm.in_use == 1
        assert adm.queue_depth == 3
    assert order == [0, 1, 2, 3]
    assert trio.current_time() == pytest.approx(4.0)


async def test_full_queue_is_refused_at_once(autojump_clock: trio.testing.MockClock) -> None:
    adm = Admission(max_inflight=1, max_queue=1, queue_timeout_s=100)
    async with trio.open_nursery() as nursery:

        async def hold(i: int) -> None:
            async with adm.slot(i):
                await trio.sleep(10)

        nursery.start_soon(hold, 0)
        nursery.start_soon(hold, 1)
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        with pytest.raises(Overloaded, match="queue is full"):
            async with adm.slot(2):
                pass
        assert trio.current_time() == start
    assert adm.rejected_total == 1


async def test_queue_timeout(autojump_clock: trio.testing.MockClock) -> None:
    adm = Admission(max_inflight=1, max_queue=5, queue_timeout_s=3)
    async with trio.open_nursery() as nursery:

        async def hold() -> None:
            async with adm.slot("a"):
                await trio.sleep(10)

        nursery.start_soon(hold)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(Overloaded, match="within 3 s") as info:
            async with adm.slot("b"):
                pass
        assert trio.current_time() == pytest.approx(3.0)
        assert info.value.status == 429
        assert adm.queue_depth == 0


async def test_unlimited_never_waits() -> None:
    adm = Admission(max_inflight=0, max_queue=0, queue_timeout_s=0)
    async with adm.slot(1), adm.slot(2), adm.slot(3):
        assert adm.in_use == 3
