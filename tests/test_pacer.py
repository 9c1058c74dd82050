"""Adaptive coalescing: the window follows the loop's lag, bounded, zero when idle."""

from __future__ import annotations

import pytest
import trio
import trio.lowlevel
import trio.testing

from smgd.api.pacer import LAG_HIGH_S, LAG_LOW_S, LoadPacer


def test_idle_loop_never_coalesces() -> None:
    pacer = LoadPacer(max_window_s=0.15)
    for _ in range(100):
        pacer.observe(0.0005)
    assert pacer.window_s == 0.0


def test_window_grows_with_lag_and_is_bounded() -> None:
    pacer = LoadPacer(max_window_s=0.15)
    windows = []
    span = LAG_HIGH_S - LAG_LOW_S
    for lag in (LAG_LOW_S + 0.2 * span, LAG_LOW_S + 0.5 * span, LAG_LOW_S + 0.8 * span, 0.050):
        for _ in range(300):  # let the average settle
            pacer.observe(lag)
        windows.append(pacer.window_s)
    assert windows == sorted(windows)
    assert windows[0] > 0
    assert windows[-1] == pytest.approx(0.15)
    assert windows[1] == pytest.approx(0.5 * 0.15, rel=1e-3)


def test_one_slow_iteration_does_not_open_the_window() -> None:
    pacer = LoadPacer(max_window_s=0.15)
    pacer.observe(0.030)
    assert pacer.window_s <= 0.15 * 0.15  # smoothed to 1.5 ms: barely above LAG_LOW_S
    for _ in range(50):
        pacer.observe(0.0)
    assert pacer.window_s == 0.0


def test_disabled_pacer_returns_at_once() -> None:
    async def main() -> None:
        pacer = LoadPacer(max_window_s=0)
        with trio.fail_after(1):
            await pacer.run()
        assert pacer.window_s == 0.0

    trio.run(main)


async def test_run_measures_lag_from_a_busy_loop(autojump_clock: trio.testing.MockClock) -> None:
    pacer = LoadPacer(max_window_s=0.1)

    async def hog() -> None:
        # Each iteration keeps the loop busy 30 ms of (virtual) time before yielding.
        while True:
            autojump_clock.jump(0.030)
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        nursery.start_soon(hog)
        await trio.sleep(5)
        nursery.cancel_scope.cancel()
    assert pacer.window_s == pytest.approx(0.1)
