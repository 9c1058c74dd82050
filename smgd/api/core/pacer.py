"""Adaptive coalescing: fewer, fuller SSE events when the event loop is loaded, none when idle.

An SSE event costs about the same CPU whatever it carries: ~80 µs on the ordinary path, while
a second to fourth token in the same event adds 1-3 µs each (16 streams, a fake engine in the
same process whose step is included; docs/design.md). So when one process serves hundreds of
streams the way to keep up is to send several tokens per event. :class:`LoadPacer` measures
how late the trio loop wakes a sleeping task (its *lag*: how long runnable work keeps the loop
busy) and turns that into a per-stream *window*: after sending an event, a stream waits
``window_s`` before taking its next output, and everything the engine produced meanwhile goes
out as one event (nothing is dropped: :class:`~smgd.engines.stream.RequestStream` coalesces).
An idle loop has no lag, so every token goes out as soon as it is decoded; the first token of a
stream is never delayed.

The window is proportional to the smoothed lag between ``LAG_LOW_S`` and ``LAG_HIGH_S``; more
window means fewer events, less lag: the loop settles where it keeps up.

Waiting out a window (:meth:`LoadPacer.hold`) parks the stream in a bucket of the pacer's own
10 ms tick instead of sleeping: a ``trio.sleep`` per event per stream costs a deadline, a
cancellation and a ``Cancelled`` raised and caught, which under load (hundreds of streams, the
only time windows open) is a tenth of smgd's CPU. The pacer task wakes a whole bucket with one
``unpark_all`` at its tick; a window is rounded up to the next tick.

Streams written directly by the engine's reader task (:mod:`smgd.api.http.direct`) have no task to
park: they hold output themselves and ask for a callback at a tick (:meth:`LoadPacer.call_at`),
and only once the loop is saturated (:attr:`LoadPacer.direct_window_s`).

While the loop keeps up (its lag within the noise of an idle loop, no stream parked on a tick)
the pacer probes ten times less often (``QUIET_PROBE_S``): an idle or lightly loaded daemon
should not wake 100 times a second for a measurement that says "no window". While the loop's
thread also used almost no CPU (``REST_BUSY``) it probes once a second (``REST_PROBE_S``), and
a streamed request that starts meanwhile (:meth:`LoadPacer.expect_load`) brings the next probe
back within ``QUIET_PROBE_S``: on this machine every wakeup of an otherwise idle trio loop costs
0.1-4 ms of CPU, so ten probes a second were what an idle daemon spent. While it rests and no
request is in flight at all (``idle``), it does not probe: there is no load to see, and the
next streamed request's ``expect_load`` wakes it.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import trio

from smgd.engines.delivery import DELIVERY

if TYPE_CHECKING:
    from collections.abc import Callable

# How often the loop's lag is sampled while it lags. 10 ms resolves the 20 ms engine steps we
# care about; one wakeup per 10 ms is nothing next to the work of a loaded loop.
PROBE_S = 0.010
# How often it is sampled while it keeps up. Measured on this 2-core machine, probing every
# 10 ms cost an idle daemon 2-3 % of a core (0.1 % with the pacer off, 0.5 % at 100 ms), and
# a third of its CPU per token at one stream (C = 1 in `smgd bench`: 880-1250 -> 680-720 µs;
# C = 16: 103-109 -> 84-87 µs). At 100 ms, load that arrives is seen at most 100 ms late; the
# window needs ~200 ms of lagging samples to open anyway (SMOOTHING), the direct gate ~1 s
# (SUSTAINED_SMOOTHING).
QUIET_PROBE_S = 0.100
# How often it is sampled while it keeps up and its thread was on a CPU for under REST_BUSY of
# the last probe's time. Measured on this 2-core VM (2026-12-05, `perf stat -e task-clock` of an
# idle `smgd serve`): 10 wakeups a second at QUIET_PROBE_S cost 4.5 ms of CPU a second, ~450 µs
# each (a bare trio loop sleeping 100 ms: ~320 µs per wakeup; `time.sleep`: ~50), and that is all
# an idle daemon spent. Behind a slow engine (SGLang's CPU scheduler: 25-130 tokens/s) it was
# tens of µs per token. A second is the longest a load that arrives between requests goes
# unseen: streamed requests pull the probe in (expect_load), and the direct gate needs about a
# second of lag anyway (SUSTAINED_SMOOTHING).
REST_PROBE_S = 1.0
# The busy share under which the loop rests: a loop on a CPU for a tenth of the time is far
# from the saturation windows are for (16 streams on the mock: 3-4 %; 256: ~20 %, and probed
# as before).
REST_BUSY = 0.1
# Below this lag the loop is keeping up: no coalescing. 1 ms is above the scheduling noise of an
# idle or lightly loaded loop (16 streams stay at one token per event) and far below one step.
LAG_LOW_S = 0.001
# At this lag the window is at its maximum. Measured with `smgd bench` at C=256 (20 ms steps):
# a 20 ms ceiling settled at ~3 tokens per event and 77 µs of CPU per token; 5-8 ms settles at
# ~4 tokens per event and 58-65 µs per token with the same delivered throughput.
LAG_HIGH_S = 0.006
# Smoothed lag at which direct-mode streams (smgd.api.http.direct) start to coalesce too: the same
# point where the ordinary window is fully open. Measured with `smgd bench` (20 ms steps): with
# the ordinary 1 ms threshold, the lag of each burst of 256 new requests opened direct windows
# at C=256 (ITL p99 28 -> 123 ms) for no CPU saved. Gated here, C=256 stays at ~1 token per
# event, and at C=1024 on a 1024 batch smgd delivers 1.13x the tok/s of `smgd-flat`
# (coalescing off) at 0.72x its CPU per token, in the same run.
DIRECT_LAG_S = LAG_HIGH_S
# EWMA weight of a new lag sample: ~20 samples (200 ms) to follow a change, so a single slow
# iteration (a GC pause, a big prompt) barely opens the window.
SMOOTHING = 0.05
# EWMA weight for the *sustained* lag that gates direct-mode coalescing: ~100 samples (over a
# second under load) to follow a change. A burst of new requests (C = 256 streams that end and
# restart together) lags the loop for 100-250 ms, long enough to move the 200 ms average past
# DIRECT_LAG_S; holding direct events then stretched inter-token gaps to the full window and
# slowed the burst itself. Measured with `smgd bench --targets smgd,smgd-flat --concurrency 256
# --rounds 3` (2026-12-03): gated on the 200 ms average, smgd delivered 91.9 % with TTFT p50
# 230 ms and ITL p99 161 ms, smgd-flat 93.8 %, 170 ms and 36 ms for the same CPU per token.
# Overload (C = 1024 on a 1024 batch) keeps the loop lagged for as long as it lasts, and the
# slow average reaches the gate within about a second.
SUSTAINED_SMOOTHING = 0.01


class LoadPacer:
    """``cpu_clock``: CPU seconds of the thread the trio loop runs on (tests with a mock clock
    pass trio's clock, a loop that is always on a CPU). ``idle``: whether nothing is in flight
    (default: never), which lets a resting pacer sleep until a streamed request starts."""

    def __init__(
        self,
        *,
        max_window_s: float,
        cpu_clock: Callable[[], float] = time.thread_time,
        idle: Callable[[], bool] = lambda: False,
    ) -> None:
        self.max_window_s = max_window_s
        self._cpu_clock = cpu_clock
        # True while no request is in flight on any engine (the app asks its engines): a
        # resting pacer then sleeps until expect_load instead of probing once a second.
        self._idle = idle
        self._last_lag_s = 0.0  # of the latest probe
        self.lag_s = 0.0
        self.sustained_lag_s = 0.0  # the slow average (SUSTAINED_SMOOTHING)
        self.window_s = 0.0
        # The window for direct-mode streams: open only while the loop stays saturated.
        #
        # A direct event skips the task switch and the ASGI stack (~63 against ~80 µs of CPU
        # per event, measured as in the module's docstring). Holding it back still saves CPU,
        # but stretches inter-token gaps: worth it once the loop cannot keep up at all, not
        # below that, nor in a burst of new requests, which lags the loop for a moment and
        # which held events only slowed (:data:`SUSTAINED_SMOOTHING`). So the gate is the slow
        # average of the lag, not the window's. An attribute set by :meth:`observe`, not a
        # property: every direct-mode token reads it (a property costs ~0.1 µs a read).
        self.direct_window_s = 0.0
        # Tick number (time // PROBE_S) -> streams to wake at that tick. At most
        # max_window_s / PROBE_S + 1 buckets exist at once (16 for the 150 ms default).
        self._buckets: dict[int, trio.lowlevel.ParkingLot] = {}
        # Tick number -> callbacks due then (direct-mode streams holding output, see
        # :meth:`call_at`); run by the pacer task, synchronously, at that tick.
        self._due: dict[int, list[Callable[[], None]]] = {}
        self._ticking = False
        # The cancel scope of the pacer task's current probe while it is a long one (quiet or
        # resting), which a tick due sooner pulls in.
        self._long_probe: trio.CancelScope | None = None
        self._busy = 1.0  # the loop thread's CPU share over the last probe

    @property
    def ticking(self) -> bool:
        """True while the pacer task runs (only then do :meth:`call_at` callbacks fire)."""
        return self._ticking

    def call_at(self, when: float, callback: Callable[[], None]) -> bool:
        """Run ``callback`` at the first tick at or after trio time ``when``; False if not ticking.

        For code that runs outside a task of its own (a direct-mode sink on the engine's reader
        task): holding output back needs no sleep, no task and no wakeup of its own. The
        callback runs on the pacer task and must not raise.
        """
        if not self._ticking:
            return False
        tick = math.ceil(when / PROBE_S)
        due = self._due.get(tick)
        if due is None:
            self._due[tick] = [callback]
            self._wake_by(tick * PROBE_S)
        else:
            due.append(callback)
        return True

    async def hold(self) -> None:
        """Wait out the current window (at once when the loop is not loaded).

        Without a running pacer task (tests, or one that ended) this falls back to a sleep,
        so a stream can never wait for a tick that will not come.
        """
        window = self.window_s
        if window <= 0:
            await trio.lowlevel.checkpoint()
            return
        if not self._ticking:
            await trio.sleep(window)
            return
        tick = math.ceil((trio.current_time() + window) / PROBE_S)
        lot = self._buckets.get(tick)
        if lot is None:
            lot = self._buckets[tick] = trio.lowlevel.ParkingLot()
            self._wake_by(tick * PROBE_S)
        await lot.park()

    def _release(self, now: float) -> None:
        due = [tick for tick in self._buckets if tick * PROBE_S <= now]
        for tick in due:
            self._buckets.pop(tick).unpark_all()
        for tick in [tick for tick in self._due if tick * PROBE_S <= now]:
            # Held output of direct streams, released together: their writes too (the
            # reader's reason, smgd.engines.delivery).
            with DELIVERY:
                for callback in self._due.pop(tick):
                    callback()

    @property
    def holding(self) -> int:
        """Streams parked right now (for tests and the status page)."""
        return sum(len(lot) for lot in self._buckets.values()) + sum(map(len, self._due.values()))

    def _wake_by(self, when: float) -> None:
        """Make sure the pacer task wakes by trio time ``when`` (it may be in a long probe)."""
        probe = self._long_probe
        if probe is not None and when < probe.deadline:
            probe.deadline = when

    def expect_load(self) -> None:
        """A streamed request starts: a resting pacer probes again within ``QUIET_PROBE_S``.

        One comparison per request; without it, a burst that arrives at a resting loop would be
        seen up to ``REST_PROBE_S`` late.
        """
        if self._long_probe is not None:
            self._wake_by(trio.current_time() + QUIET_PROBE_S)

    def _probe_s(self, now: float) -> float:
        """The next probe's length: short under lag, long while quiet, longest while resting,
        and without end while resting with nothing in flight (expect_load ends it); never past
        the tick of the first callback due (:meth:`call_at`).

        A callback due does not make the loop any less quiet: every streamed request asks
        for one a second ahead (the deadline of its held response head, smgd.api.http.
        dispatch), and had it kept the probes short, one stream at a time (C = 1) would have
        kept the pacer waking 100 times a second for most of its life."""
        if not self._quiet():
            return PROBE_S
        if self._busy >= REST_BUSY:
            length = QUIET_PROBE_S
        else:
            length = math.inf if self.idle else REST_PROBE_S
        if self._due:
            length = min(length, max(PROBE_S, min(self._due) * PROBE_S - now))
        return length

    @property
    def idle(self) -> bool:
        """Nothing is in flight on any engine (as the ``idle`` callable says)."""
        return self._idle()

    def _quiet(self) -> bool:
        """The loop keeps up (no window, its last wakeup on time) and no stream is parked.

        An idle trio loop wakes a sleeper ~0.5 ms late here (timer granularity), so "on time"
        is the window's own threshold, LAG_LOW_S.
        """
        return self.lag_s <= LAG_LOW_S and self._last_lag_s <= LAG_LOW_S and not self._buckets

    def observe(self, lag_s: float, periods: int = 1, busy: float = 1.0) -> float:
        """Fold in a probe ``periods`` x ``PROBE_S`` long that woke ``lag_s`` late; return the
        new window (pure, for tests).

        A long probe sees only its own end: it counts as ``periods - 1`` samples on time and
        one of ``lag_s``, so the averages decay with time, not with the number of probes, and
        one late wakeup weighs the same whatever the probe's length.

        ``busy``: the share of the probe's wall time the loop's thread spent on a CPU. Only
        that share of the lag is the loop's own work, which fewer events would shorten. The
        rest is time the process waited for a CPU that other processes held (a CPU engine
        on the same cores: vLLM's took 1.9 of this machine's 2 cores), and holding tokens
        back saves none of that: it only stretched inter-token gaps (ITL p99 240-550 ms
        against vLLM's 6-21 ms on the real vLLM engine, 30 tokens per event at C = 16).
        """
        lag_s = max(lag_s, 0.0) * min(max(busy, 0.0), 1.0)
        self._last_lag_s = lag_s
        if periods > 1:
            self.lag_s *= (1.0 - SMOOTHING) ** (periods - 1)
            self.sustained_lag_s *= (1.0 - SUSTAINED_SMOOTHING) ** (periods - 1)
        self.lag_s += SMOOTHING * (lag_s - self.lag_s)
        self.sustained_lag_s += SUSTAINED_SMOOTHING * (lag_s - self.sustained_lag_s)
        fraction = (self.lag_s - LAG_LOW_S) / (LAG_HIGH_S - LAG_LOW_S)
        self.window_s = self.max_window_s * min(max(fraction, 0.0), 1.0)
        self.direct_window_s = self.window_s if self.sustained_lag_s >= DIRECT_LAG_S else 0.0
        return self.window_s

    async def run(self) -> None:
        if self.max_window_s <= 0:
            return
        self._ticking = True
        try:
            while True:
                start = trio.current_time()
                cpu_start = self._cpu_clock()
                length = self._probe_s(start)
                with trio.CancelScope(deadline=start + length) as probe:
                    # A stream that parks or asks for a callback during a long probe pulls its
                    # deadline in (_wake_by), so no tick is ever late.
                    self._long_probe = probe if length > PROBE_S else None
                    await trio.sleep_forever()
                self._long_probe = None
                now = trio.current_time()
                wall = now - start
                self._busy = busy = (self._cpu_clock() - cpu_start) / wall if wall > 0 else 1.0
                periods = max(1, round((probe.deadline - start) / PROBE_S))
                self.observe(now - probe.deadline, periods, busy)
                self._release(now)
        finally:
            # Nobody may stay parked on a pacer that stopped ticking.
            self._ticking = False
            self._long_probe = None
            self._release(math.inf)
