"""Adaptive coalescing: the window follows the loop's lag, bounded, zero when idle."""

from __future__ import annotations

from functools import partial

import pytest
import trio
import trio.lowlevel
import trio.testing

from smgd.api.core.pacer import (
    DIRECT_LAG_S,
    LAG_HIGH_S,
    LAG_LOW_S,
    PROBE_S,
    QUIET_PROBE_S,
    REST_BUSY,
    REST_PROBE_S,
    LoadPacer,
)
from smgd.engines.delivery import DELIVERY


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


@pytest.mark.parametrize(
    ("on_cpu", "window_s"),
    [
        # The loop's thread was on a CPU all along: its own work made it late.
        (True, 0.1),
        # The same late wakeups, but the thread used no CPU meanwhile: the lateness is other
        # processes' (an engine on the same cores); fewer events would not shorten it.
        (False, 0.0),
    ],
)
async def test_run_measures_lag_from_a_busy_loop(
    autojump_clock: trio.testing.MockClock, on_cpu: bool, window_s: float
) -> None:
    pacer = LoadPacer(max_window_s=0.1, cpu_clock=trio.current_time if on_cpu else lambda: 0.0)

    async def hog() -> None:
        # Each iteration keeps the loop late by 30 ms of (virtual) time before yielding.
        while True:
            autojump_clock.jump(0.030)
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        nursery.start_soon(hog)
        await trio.sleep(5)
        nursery.cancel_scope.cancel()
    assert pacer.window_s == pytest.approx(window_s)
    assert (pacer.lag_s > 0) is on_cpu


def test_only_the_busy_share_of_a_lag_counts() -> None:
    busy, half, starved = (LoadPacer(max_window_s=0.15) for _ in range(3))
    for _ in range(200):
        busy.observe(LAG_HIGH_S * 2, busy=1.0)
        half.observe(LAG_HIGH_S * 2, busy=0.5)
        starved.observe(LAG_HIGH_S * 2, busy=0.0)
    assert busy.window_s == pytest.approx(0.15)
    assert half.lag_s == pytest.approx(LAG_HIGH_S, rel=1e-3)
    assert starved.window_s == 0.0


def _loaded(max_window_s: float) -> LoadPacer:
    """A pacer whose window is fully open (as after a long lag)."""
    pacer = LoadPacer(max_window_s=max_window_s)
    for _ in range(200):
        pacer.observe(LAG_HIGH_S * 2)
    assert pacer.window_s == pytest.approx(max_window_s)
    return pacer


async def test_hold_returns_at_once_when_the_loop_is_idle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pacer = LoadPacer(max_window_s=0.1, cpu_clock=trio.current_time)
    start = trio.current_time()
    await pacer.hold()
    assert trio.current_time() == start


async def test_holders_wake_together_at_the_first_tick_after_their_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pacer = _loaded(0.05)
    pacer.observe = lambda lag_s, periods=1, busy=1.0: pacer.window_s  # type: ignore[method-assign]  # keep it open
    woke: list[float] = []
    all_woke = trio.Event()

    async def holder() -> None:
        await pacer.hold()
        woke.append(trio.current_time())
        if len(woke) == 50:
            all_woke.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        await trio.sleep(0.001)  # the pacer task is ticking now
        start = trio.current_time()
        for _ in range(50):
            nursery.start_soon(holder)
        await trio.testing.wait_all_tasks_blocked()
        assert pacer.holding == 50
        with trio.fail_after(1):
            await all_woke.wait()
        nursery.cancel_scope.cancel()
    assert len(set(woke)) == 1  # one bucket, one unpark_all
    assert 0.05 <= woke[0] - start <= 0.05 + 2 * PROBE_S


async def test_a_stopped_pacer_releases_every_holder(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pacer = _loaded(0.15)
    pacer.observe = lambda lag_s, periods=1, busy=1.0: pacer.window_s  # type: ignore[method-assign]
    released = 0

    async def holder() -> None:
        nonlocal released
        await pacer.hold()
        released += 1

    async with trio.open_nursery() as outer:
        async with trio.open_nursery() as ticking:
            ticking.start_soon(pacer.run)
            await trio.sleep(0.001)
            for _ in range(3):
                outer.start_soon(holder)
            await trio.sleep(0.002)
            assert pacer.holding == 3
            ticking.cancel_scope.cancel()  # the pacer stops long before the window ends
        start = trio.current_time()
    assert released == 3
    assert trio.current_time() == start  # released at the stop, not after the window


async def test_hold_without_a_running_pacer_sleeps_the_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pacer = _loaded(0.08)
    start = trio.current_time()
    await pacer.hold()
    assert trio.current_time() - start == pytest.approx(0.08)


async def test_call_at_runs_callbacks_at_the_first_tick_after_their_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pacer = LoadPacer(max_window_s=0.1, cpu_clock=trio.current_time)
    assert not pacer.call_at(trio.current_time(), lambda: None)  # not ticking: refused
    fired: list[tuple[str, float]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        await trio.sleep(0.001)
        start = trio.current_time()
        assert pacer.ticking
        assert pacer.call_at(start + 0.035, lambda: fired.append(("a", trio.current_time())))
        assert pacer.call_at(start + 0.031, lambda: fired.append(("b", trio.current_time())))
        assert pacer.call_at(start + 0.070, lambda: fired.append(("c", trio.current_time())))
        assert pacer.holding == 3
        await trio.sleep(0.05)
        assert [name for name, _ in fired] == ["a", "b"]  # c is not due yet
        assert all(0.035 <= t - start <= 0.035 + 2 * PROBE_S for _, t in fired)
        assert fired[0][1] == fired[1][1]  # same tick, one pass
        nursery.cancel_scope.cancel()
    # Stopping ran the last one at once rather than leaving it pending forever.
    assert [name for name, _ in fired] == ["a", "b", "c"]
    assert fired[2][1] - start < 0.070
    assert pacer.holding == 0


def test_direct_streams_coalesce_only_once_the_loop_is_saturated() -> None:
    pacer = LoadPacer(max_window_s=0.1)
    for _ in range(1000):
        pacer.observe((LAG_LOW_S + DIRECT_LAG_S) / 2)  # loaded, not saturated
    assert pacer.window_s > 0
    assert pacer.direct_window_s == 0
    for _ in range(1000):
        pacer.observe(DIRECT_LAG_S * 2)
    assert pacer.direct_window_s == pacer.window_s == pytest.approx(0.1)


def test_a_burst_opens_the_window_but_not_the_direct_one() -> None:
    """256 requests arriving together lag the loop for ~200 ms (here five 40 ms iterations):
    ordinary streams coalesce, direct ones keep one event per token."""
    pacer = LoadPacer(max_window_s=0.15)
    for _ in range(5):
        pacer.observe(0.040)
    assert pacer.lag_s >= DIRECT_LAG_S  # the 200 ms average alone would open direct windows
    assert pacer.window_s == pytest.approx(0.15)
    assert pacer.direct_window_s == 0
    for _ in range(60):  # the burst is over: the gate never opened and the window closes
        pacer.observe(0.0)
        assert pacer.direct_window_s == 0
    assert pacer.window_s == 0


def test_sustained_overload_opens_the_direct_window_within_a_second() -> None:
    pacer = LoadPacer(max_window_s=0.15)
    elapsed = 0.0
    while pacer.direct_window_s == 0:
        pacer.observe(0.030)  # a loop that cannot keep up: every 10 ms sleep wakes 30 ms late
        elapsed += PROBE_S + 0.030
        assert elapsed < 1.0
    assert pacer.direct_window_s == pytest.approx(0.15)


def test_a_long_probe_weighs_as_periods_on_time_and_one_late_wakeup() -> None:
    once, stepwise = LoadPacer(max_window_s=0.15), LoadPacer(max_window_s=0.15)
    for pacer in (once, stepwise):
        for _ in range(300):
            pacer.observe(0.030)  # both saturated, direct gate open
    once.observe(0.002, periods=10)
    for _ in range(9):
        stepwise.observe(0.0)
    stepwise.observe(0.002)
    assert once.lag_s == pytest.approx(stepwise.lag_s)
    assert once.sustained_lag_s == pytest.approx(stepwise.sustained_lag_s)
    assert once.window_s == pytest.approx(stepwise.window_s)
    assert once.lag_s < 0.030 * 0.7  # and it did decay (0.95 ** 10 = 0.6)
    # One late wakeup weighs the same at the end of a long probe as of a short one.
    idle_long, idle_short = LoadPacer(max_window_s=0.15), LoadPacer(max_window_s=0.15)
    idle_long.observe(0.030, periods=10)
    idle_short.observe(0.030)
    assert idle_long.lag_s == pytest.approx(idle_short.lag_s)


class _ProbeCounter:
    """Wraps a pacer's observe to record when each probe ended and how long it was."""

    def __init__(self, pacer: LoadPacer) -> None:
        self.at: list[float] = []
        self.periods: list[int] = []
        real = pacer.observe

        def counted(lag_s: float, periods: int = 1, busy: float = 1.0) -> float:
            self.at.append(trio.current_time())
            self.periods.append(periods)
            return real(lag_s, periods, busy)

        pacer.observe = counted  # type: ignore[method-assign]


async def test_a_quiet_loop_is_probed_ten_times_less_often(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pacer = LoadPacer(max_window_s=0.15, cpu_clock=trio.current_time)
    probes = _ProbeCounter(pacer)
    hogging = trio.Event()
    stop_hogging = trio.Event()

    async def hog() -> None:
        await hogging.wait()
        # Each iteration keeps the loop busy 4.3 ms: a wakeup comes 0-8.6 ms late, depending on
        # where its deadline falls (not a divisor of the probe, so that varies) and on trio's
        # order within the batch; on average far above LAG_LOW_S.
        while not stop_hogging.is_set():
            autojump_clock.jump(0.0043)
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        nursery.start_soon(hog)
        await trio.sleep(1.0 + PROBE_S / 2)
        assert len(probes.at) == round(1.0 / QUIET_PROBE_S)
        assert set(probes.periods) == {round(QUIET_PROBE_S / PROBE_S)}
        hogging.set()  # load: a late wakeup switches to the short probe
        await trio.sleep(0.5)
        probes.at.clear()
        await trio.sleep(1.0)
        assert len(probes.at) >= 1.0 / (PROBE_S + 0.0086)  # short probes, however late
        assert pacer.window_s > 0
        stop_hogging.set()  # the lag decays under LAG_LOW_S, then the probes grow long again
        await trio.sleep(2.0)
        probes.at.clear()
        await trio.sleep(1.0)
        assert len(probes.at) == pytest.approx(1.0 / QUIET_PROBE_S, abs=1)
        assert pacer.window_s == 0
        nursery.cancel_scope.cancel()


def _quiet_pacer(max_window_s: float, *, resting: bool) -> tuple[LoadPacer, _ProbeCounter]:
    """A pacer on a loop that keeps up; ``resting``: one whose thread is never on a CPU."""
    clock = _CpuClock() if resting else trio.current_time
    pacer = LoadPacer(max_window_s=max_window_s, cpu_clock=clock)
    return pacer, _ProbeCounter(pacer)


def _fired_at(pacer: LoadPacer, when: float) -> list[float]:
    """Ask ``pacer`` for a callback at ``when``: the list of the times it ran."""
    fired: list[float] = []
    assert pacer.call_at(when, lambda: fired.append(trio.current_time()))
    return fired


async def test_a_ticks_callbacks_hold_their_writes_until_all_of_them_ran(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Direct streams released at one tick write together after the last of them (the engine
    # reader's delivery, smgd.engines.delivery), and nothing is left held after the tick.
    pacer = LoadPacer(max_window_s=0.1, cpu_clock=trio.current_time)
    written: list[str] = []
    written_before: list[int] = []

    class Writer:
        def __init__(self, name: str) -> None:
            self.name = name

        def write_held(self) -> None:
            written.append(self.name)

    def release(name: str) -> None:
        written_before.append(len(written))
        if DELIVERY.open:  # as a direct writer does
            DELIVERY.held.append(Writer(name))
        else:
            written.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        await trio.sleep(0.001)
        start = trio.current_time()
        for name in ("a", "b", "c"):
            assert pacer.call_at(start + 0.015, partial(release, name))
        await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert written == ["a", "b", "c"]
    assert written_before == [0, 0, 0]  # each release ran with none written yet
    assert not DELIVERY.open and not DELIVERY.held


@pytest.mark.parametrize("resting", [False, True])
async def test_a_hold_or_callback_during_a_quiet_probe_is_not_late(
    autojump_clock: trio.testing.MockClock, resting: bool
) -> None:
    # A stream that holds while the pacer sleeps a long quiet probe (or, with its thread
    # idle, a rest probe of a second) must wake at its window's tick, not at the end of the
    # probe. (The window is forced open, the loop kept quiet.)
    pacer, probes = _quiet_pacer(0.03, resting=resting)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        await trio.sleep(QUIET_PROBE_S + 0.001)  # inside the second quiet probe
        assert probes.periods == [round(QUIET_PROBE_S / PROBE_S)]
        pacer.window_s = 0.03
        start = trio.current_time()
        fired = _fired_at(pacer, start + 0.015)
        await pacer.hold()
        held = trio.current_time() - start
        nursery.cancel_scope.cancel()
    assert 0.03 <= held <= 0.03 + 2 * PROBE_S
    assert len(fired) == 1
    assert 0.015 <= fired[0] - start <= 0.015 + 2 * PROBE_S


@pytest.mark.parametrize("resting", [False, True])
async def test_a_callback_due_later_leaves_a_quiet_loop_probed_as_rarely_and_runs_on_time(
    autojump_clock: trio.testing.MockClock, resting: bool
) -> None:
    # Every streamed request asks for a callback a second ahead (its held head's deadline).
    # A quiet loop stays probed every QUIET_PROBE_S (or resting, once a second) meanwhile,
    # not every PROBE_S, and the callback still runs at its tick.
    pacer, probes = _quiet_pacer(0.15, resting=resting)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        await trio.sleep(3 * REST_PROBE_S + PROBE_S / 2)  # settled: quiet, or resting
        probes.at.clear()
        start = trio.current_time()
        fired = _fired_at(pacer, start + 1.0)
        await trio.sleep(1.0 + 2 * PROBE_S)
        nursery.cancel_scope.cancel()
    assert len(fired) == 1
    assert 1.0 <= fired[0] - start <= 1.0 + PROBE_S
    # Quiet: ten probes in the second (at most one more, to end at the tick); resting: the
    # rest probe under way, then one that ends at the tick (not a hundred of PROBE_S).
    assert len(probes.at) <= (2 if resting else round(1.0 / QUIET_PROBE_S) + 1)


class _CpuClock:
    """The loop thread's CPU clock of a test: it advances only when the test says so."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds


async def test_a_loop_that_barely_uses_a_cpu_is_probed_once_a_second(
    autojump_clock: trio.testing.MockClock,
) -> None:
    assert REST_BUSY < 0.4  # the share the work below keeps the thread on a CPU
    cpu = _CpuClock()
    pacer = LoadPacer(max_window_s=0.15, cpu_clock=cpu)
    probes = _ProbeCounter(pacer)
    working = trio.Event()

    async def work() -> None:
        # Once set: the loop's thread is on a CPU for 4 of every 10 ms (above REST_BUSY),
        # yet never late (the work is spread out, no wakeup waits for it).
        await working.wait()
        while True:
            await trio.sleep(0.010)
            cpu.seconds += 0.004

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        nursery.start_soon(work)
        await trio.sleep(5 * REST_PROBE_S + QUIET_PROBE_S + PROBE_S / 2)
        # One quiet probe finds the thread idle; from then on it rests.
        assert probes.periods == [round(QUIET_PROBE_S / PROBE_S)] + 5 * [
            round(REST_PROBE_S / PROBE_S)
        ]
        working.set()  # seen at the end of the rest probe under way, then probed as before
        await trio.sleep(REST_PROBE_S)
        probes.periods.clear()
        await trio.sleep(1.0)
        assert probes.periods == round(1.0 / QUIET_PROBE_S) * [round(QUIET_PROBE_S / PROBE_S)]
        assert pacer.window_s == 0  # busy is not late: nothing is held back
        nursery.cancel_scope.cancel()


async def test_a_streamed_request_wakes_a_resting_pacer_within_a_quiet_probe(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pacer = LoadPacer(max_window_s=0.15, cpu_clock=_CpuClock())
    probes = _ProbeCounter(pacer)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        await trio.sleep(QUIET_PROBE_S + 0.2)  # 0.1 s into the first rest probe
        assert probes.periods == [round(QUIET_PROBE_S / PROBE_S)]
        start = trio.current_time()
        pacer.expect_load()
        await trio.sleep(QUIET_PROBE_S - 0.001)
        assert len(probes.at) == 1  # not before its time
        await trio.sleep(0.002)
        assert probes.at[1:] == [pytest.approx(start + QUIET_PROBE_S)]
        pacer.expect_load()  # a probe already due sooner is left alone
        nursery.cancel_scope.cancel()


async def test_with_nothing_in_flight_a_resting_pacer_sleeps_until_a_stream_starts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    in_flight = 0
    pacer = LoadPacer(max_window_s=0.15, cpu_clock=_CpuClock(), idle=lambda: in_flight == 0)
    probes = _ProbeCounter(pacer)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        await trio.sleep(3600.0)
        # One quiet probe found the thread idle and nothing in flight: no probe since.
        assert probes.periods == [round(QUIET_PROBE_S / PROBE_S)]
        start = trio.current_time()
        in_flight = 1
        pacer.expect_load()
        await trio.sleep(QUIET_PROBE_S - 0.001)
        assert len(probes.at) == 1
        await trio.sleep(0.002)
        assert probes.at[1:] == [pytest.approx(start + QUIET_PROBE_S)]
        # While something is in flight the resting pacer probes once a second again...
        await trio.sleep(3 * REST_PROBE_S)
        assert probes.at[2:] == [
            pytest.approx(start + QUIET_PROBE_S + k * REST_PROBE_S) for k in (1, 2, 3)
        ]
        assert pacer.window_s == 0
        # ...and once it ends, the probe under way is the last one.
        in_flight = 0
        await trio.sleep(REST_PROBE_S + 0.001)
        probes.at.clear()
        await trio.sleep(3600.0)
        assert probes.at == []
        nursery.cancel_scope.cancel()
