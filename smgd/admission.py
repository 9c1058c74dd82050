"""Per-engine admission: a cap on in-flight requests and a bounded, timed wait queue.

A request holds its slot for the whole stream (not just until the first token), because an
engine's load is its running streams. Beyond the cap, requests wait in FIFO order (trio's
CapacityLimiter is fair) for at most ``queue_timeout_s``; beyond ``max_queue`` waiters, or past
the timeout, they are refused with :class:`~smgd.errors.Overloaded` (HTTP 429 + Retry-After).
"""

from __future__ import annotations

import math
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

from smgd.errors import Overloaded

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


class Admission:
    def __init__(self, *, max_inflight: int, max_queue: int, queue_timeout_s: float) -> None:
        # 0 = unlimited; an infinite limiter keeps one code path.
        self._limiter = trio.CapacityLimiter(max_inflight if max_inflight > 0 else math.inf)
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.rejected_total = 0

    def reconfigure(self, *, max_inflight: int, max_queue: int, queue_timeout_s: float) -> None:
        """New limits (a reload). A raised cap admits waiters at once; a lowered one admits
        nobody until enough held slots are released. Waiters keep the timeout they started with."""
        self._limiter.total_tokens = max_inflight if max_inflight > 0 else math.inf
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s

    @property
    def queue_depth(self) -> int:
        return self._limiter.statistics().tasks_waiting

    @property
    def in_use(self) -> int:
        return int(self._limiter.borrowed_tokens)

    def try_acquire(self, owner: object) -> bool:
        """Take a free in-flight slot for ``owner`` at once; False when none is free."""
        try:
            self._limiter.acquire_on_behalf_of_nowait(owner)
        except trio.WouldBlock:
            return False
        return True

    async def wait_acquire(self, owner: object) -> float:
        """Queue for a slot for ``owner`` (after :meth:`try_acquire` said no); the seconds it
        waited. Raises :class:`~smgd.errors.Overloaded` when the queue is full or the wait
        runs out."""
        queued_at = trio.current_time()
        if self.queue_depth >= self.max_queue:
            self.rejected_total += 1
            raise Overloaded(f"engine queue is full ({self.max_queue} waiting)", code="queue_full")
        with trio.move_on_after(self.queue_timeout_s) as scope:
            await self._limiter.acquire_on_behalf_of(owner)
        if scope.cancelled_caught:
            self.rejected_total += 1
            raise Overloaded(
                f"no engine capacity within {self.queue_timeout_s:g} s", code="queue_timeout"
            )
        return trio.current_time() - queued_at

    def release(self, owner: object) -> None:
        """Give back the slot ``owner`` holds."""
        self._limiter.release_on_behalf_of(owner)

    @asynccontextmanager
    async def slot(self, owner: object) -> AsyncIterator[float]:
        """Hold one in-flight slot for ``owner`` for the duration of the block; the block gets
        the seconds it waited in the queue (0.0 when a slot was free, the clock unread)."""
        waited = 0.0 if self.try_acquire(owner) else await self.wait_acquire(owner)
        try:
            yield waited
        finally:
            self.release(owner)
