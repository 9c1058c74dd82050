"""A wave of request starts spread over scheduler passes, so the engine hears of its first
requests while the rest are still being prepared.

trio runs every task that is runnable at the start of a scheduler pass in that pass, and a task
woken during a pass in the next one. When many streams end on the same engine step, their
clients' next requests arrive together: their request tasks become runnable in one pass and run
back to back, each preparing its request (parse, tokenize, sampling: ~0.3-0.5 ms here), and the
engine's sender, woken by the first submit, runs only after the last. So a wave's first request
reaches the engine no sooner than its last, and every TTFT of the wave is the whole wave's
preparation (docs/performance.md, "Issue 21, fourteenth pass").

:class:`StartGate` lets request starts through while the pass's starts have taken less than a
budget of time, and parks the rest in order. Parked starts are let through in later passes, as
many per pass as fit the budget in the pass before, so between two slices of the wave the
sender sends what was prepared and the reader delivers the first tokens. The budget is
:data:`MIN_BUDGET_S`, or the time the rest of the loop took since the previous slice, if that
is more: a loop busy with something else (the reader delivering a step to thousands of
streams) still gives requests at least half its time, which is what it did without the gate.

A saturated loop (one that waited for I/O less than :data:`SATURATED_IDLE_SHARE` of the last
second) gets no gate: there, spreading a wave only delays its requests behind work the loop
cannot keep up with anyway (measured: C = 1,024 and 10,000 streams lost delivered share and
TTFT p99 with it), while a loop with headroom, where waves are what sets TTFT, gains.

A request alone, or the first of its pass, goes through without waiting: the gate costs a lone
request a clock read and a few comparisons. Pass boundaries and idle time come from a trio
instrument (``before_io_wait`` / ``after_io_wait``, once per pass each; trio calls an
instrument only for the hooks it defines).

Sans-IO: :class:`Slices` and :class:`IdleShare` decide (clock readings, a pass count and the
idle time in; "go", "wait" and "saturated" out); the trio parts are :class:`PassCounter` and
:class:`StartGate`.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["IDLE_WINDOW_S", "MIN_BUDGET_S", "IdleShare", "PassCounter", "Slices", "StartGate"]

# Request-start time allowed per scheduler pass when the rest of the loop is quick. 5 ms of
# starts delay the engine's reader and sender by that much at most (a quarter of a 20 ms engine
# step), while a 256-request wave (~100 ms of preparation here) reaches the engine in ~20
# slices instead of one.
MIN_BUDGET_S = 0.005
# A loop that waited for I/O less than this share of the last IDLE_WINDOW_S is saturated, and
# the gate steps aside: spreading a wave then only delays its requests behind work the loop
# cannot keep up with anyway, and costs passes. Measured with the gate on (2026-12-06):
# `smgd bench` at C = 256 idles 0.71-0.75 of each second with its waves (the gate helps:
# TTFT p50 126-183 -> 68-84 ms), at C = 1,024 0.00-0.07 (the gate cost delivered share and
# TTFT p99), with 10,000 streams ~0.
SATURATED_IDLE_SHARE = 0.25
# Long enough that one wave (C = 256: ~0.15 s of work) does not read as saturation.
IDLE_WINDOW_S = 1.0


class IdleShare:
    """Whether the loop is saturated, from its idle time per :data:`IDLE_WINDOW_S`; sans-IO.

    ``update(now, idle_s)`` with the loop's cumulative idle time; ``saturated`` is the last
    whole window's verdict (False until one is whole)."""

    __slots__ = ("_idle_at_start", "_start", "saturated")

    def __init__(self) -> None:
        self._start: float | None = None
        self._idle_at_start = 0.0
        self.saturated = False

    def update(self, now: float, idle_s: float) -> bool:
        if self._start is None:
            self._start, self._idle_at_start = now, idle_s
        elif (span := now - self._start) >= IDLE_WINDOW_S:
            share = (idle_s - self._idle_at_start) / span
            self.saturated = share < SATURATED_IDLE_SHARE
            self._start, self._idle_at_start = now, idle_s
        return self.saturated


class Slices:
    """Which request starts go in the current pass; sans-IO.

    :meth:`arrive` for each start as it runs (a clock reading and the pass count in): True if
    it goes in this pass, False if this pass's budget is spent. :meth:`to_wake` in a pass with
    starts waiting: how many to wake for the next pass, as many as went in the last whole
    slice (the current pass's may not be whole yet: trio runs a pass's tasks in no set order),
    and at least one, so a wave always moves.
    """

    __slots__ = ("_fit", "_last_fit", "_pass", "_slice_end")

    def __init__(self) -> None:
        self._pass = -1  # the pass the current slice belongs to
        self._slice_end = 0.0  # when the current slice's budget runs out
        self._fit = 0  # starts that went in the current slice
        self._last_fit = 1  # ... and in the slice before it

    def arrive(self, now: float, pass_no: int, *, woken: bool = False) -> bool:
        """``woken``: the start waited for this pass (a wave is being let through, so the
        time since the last slice is the rest of the loop's, not idle time)."""
        if pass_no != self._pass:  # the first start of a pass opens its slice, and goes
            other_s = now - self._slice_end if woken else 0.0
            self._pass = pass_no
            self._slice_end = now + max(MIN_BUDGET_S, other_s)
            self._last_fit = self._fit
            self._fit = 1
            return True
        if now < self._slice_end:
            self._fit += 1
            return True
        return False

    def to_wake(self, pass_no: int) -> int:
        return max(1, self._last_fit if pass_no == self._pass else self._fit)


class PassCounter(trio.abc.Instrument):
    """Counts trio's scheduler passes (one ``before_io_wait`` per pass), and the time the loop
    spent waiting for I/O (idle) in them."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._wait_start = 0.0
        self.passes = 0
        self.idle_s = 0.0

    def before_io_wait(self, timeout: float) -> None:
        self.passes += 1
        self._wait_start = self._clock()

    def after_io_wait(self, timeout: float) -> None:
        self.idle_s += self._clock() - self._wait_start


class StartGate:
    """Request starts in order, a slice of them per scheduler pass (see the module's doc).

    ``await gate.enter()`` before preparing a request. A start that waits is woken by the
    gate's pump, a system task that runs once per pass while starts wait."""

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._slices = Slices()
        self._idle = IdleShare()
        self._counter: PassCounter | None = None
        self._waiting: collections.deque[trio.Event] = collections.deque()
        self._pumping = False
        self.waited = 0  # starts that waited for a later pass (tests, docs)

    def _counted(self) -> PassCounter:
        counter = self._counter
        if counter is None:
            counter = self._counter = PassCounter(self._clock)
            trio.lowlevel.add_instrument(counter)
        return counter

    async def enter(self) -> None:
        """Return when this request may start: at once, or in a later pass, in order."""
        counter, now = self._counted(), self._clock()
        if not self._waiting and (
            self._idle.update(now, counter.idle_s) or self._slices.arrive(now, counter.passes)
        ):
            return
        self.waited += 1
        turn = trio.Event()
        self._waiting.append(turn)
        while True:
            if not self._pumping:
                self._pumping = True
                trio.lowlevel.spawn_system_task(self._pump, name="smgd start gate")
            try:
                await turn.wait()
            except BaseException:
                if not turn.is_set():
                    self._waiting.remove(turn)  # cancelled while it waited: it goes nowhere
                raise
            counter, now = self._counted(), self._clock()
            if self._slices.arrive(now, counter.passes, woken=True) or self._idle.saturated:
                return
            # Woken into a pass whose budget is spent already: first in line for the next.
            turn = trio.Event()
            self._waiting.appendleft(turn)

    def close(self) -> None:
        """Stop counting passes (the run goes on without the gate)."""
        if self._counter is not None:
            trio.lowlevel.remove_instrument(self._counter)
            self._counter = None

    async def _pump(self) -> None:
        try:
            while self._waiting:
                await trio.lowlevel.checkpoint()  # a pass: the sender and the reader run
                counter = self._counted()
                self._idle.update(self._clock(), counter.idle_s)
                n = (
                    len(self._waiting)
                    if self._idle.saturated
                    else self._slices.to_wake(counter.passes)
                )
                for _ in range(min(n, len(self._waiting))):
                    self._waiting.popleft().set()
        finally:
            self._pumping = False
