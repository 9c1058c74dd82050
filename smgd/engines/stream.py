"""Per-request output stream: the coalescing slot between an engine's reader task and a consumer.

The reader task calls :meth:`RequestStream.push` / :meth:`fail` synchronously and never waits:
deltas accumulate in one pending :class:`TokenDelta` (bounded by max_tokens), and the consumer
takes *all* pending output in one :meth:`receive`. A consumer that keeps up gets one delta per
engine step; one that lags gets fewer, fuller deltas, with nothing dropped. At most one wakeup
per request per engine step.
"""

from __future__ import annotations

import enum
import sys
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from collections.abc import Callable

    from smgd.errors import EngineError
    from smgd.wire.common import TokenDelta


class StreamState(enum.Enum):
    OPEN = "open"
    FINISHED = "finished"  # a finish arrived; pending output may still be unread
    FAILED = "failed"
    CLOSED = "closed"  # the consumer closed it (abort sent by the owner)


# The members as module constants, for the reader's per-token path: on Python 3.11 reading a
# member off its enum class goes through a descriptor (~150 ns a read, measured; ~35 ns on
# 3.12), and push() tests the state twice per token.
_OPEN = StreamState.OPEN
_FINISHED = StreamState.FINISHED


class RequestStream:
    """Output of one engine request, as the consumer sees it."""

    __slots__ = (
        "_error", "_pending", "_waiter", "engine", "limit", "queued_s", "rid", "sent_at", "sink",
        "state", "tokens",
    )  # fmt: skip

    def __init__(
        self, rid: str, engine: str, *, prompt_tokens: int = 0, limit: int = sys.maxsize
    ) -> None:
        self.rid = rid
        self.engine = engine
        # Time it queued: for an admission slot before it was sent, then in the engine's own
        # queue where the wire reports it (vLLM's events, added on its first output).
        self.queued_s = 0.0
        # trio time it was sent to the engine: what timeouts.request_s counts from.
        self.sent_at = 0.0
        # Prompt plus output tokens so far (the engine client counts them per delta): the
        # KV-cache estimate for wires that do not report their usage.
        self.tokens = prompt_tokens
        # The most ``tokens`` may reach: the prompt plus the request's max_tokens. An engine
        # that sends more is cut there by its client (EngineClient.deliver).
        self.limit = limit
        self.state = StreamState.OPEN
        self._pending: TokenDelta | None = None
        self._error: BaseException | None = None
        self._waiter: trio.Event | None = None
        # Set by a consumer in direct mode (smgd.api.http.direct): called with each delta on the
        # reader task; True = consumed there. It must not raise. A finish still wakes the
        # consumer, which ends the stream.
        self.sink: Callable[[TokenDelta], bool] | None = None

    # ---- producer side (reader task; synchronous, never blocks)
    def push(self, delta: TokenDelta) -> None:
        if self.state is not _OPEN:
            return
        if delta.finish is not None:
            self.state = _FINISHED
        sink = self.sink
        if sink is not None and self._pending is None and sink(delta):
            if self.state is not _OPEN:
                self._wake()
            return
        if self._pending is None:
            self._pending = delta
        else:
            self._pending.merge(delta)
        self._wake()

    def fail(self, error: BaseException) -> None:
        if self.state is not StreamState.OPEN:
            return
        self._error = error
        self.state = StreamState.FAILED
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None:
            self._waiter.set()
            self._waiter = None

    def notify(self) -> None:
        """Wake the consumer without output (a direct-mode sink asking it to act)."""
        self._wake()

    # ---- consumer side
    @property
    def finished(self) -> bool:
        return self.state is not StreamState.OPEN and self._pending is None

    def receive_nowait(self) -> TokenDelta | None:
        """All pending output, or None if there is none yet. Raises the failure if failed."""
        if self._pending is not None:
            delta, self._pending = self._pending, None
            return delta
        if self.state is StreamState.FAILED:
            assert self._error is not None
            # A fresh traceback on every raise: raising one object again appends to its old one.
            raise self._error.with_traceback(None)
        if self.state is not StreamState.OPEN:
            raise trio.EndOfChannel
        return None

    async def receive(self) -> TokenDelta:
        """Wait for output and return everything pending, merged into one delta.

        Raises ``trio.EndOfChannel`` after the final delta was returned, or the engine's
        :class:`~smgd.errors.EngineError` if the engine failed.
        """
        # Cancellation safety: a cancel may land before anything is taken, never after. Once
        # the pending delta is taken, the checkpoint is shielded so it cannot be lost.
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            delta = self.receive_nowait()
            if delta is not None:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return delta
            if self._waiter is not None:
                raise trio.BusyResourceError("another task is already receiving on this stream")
            self._waiter = event = trio.Event()
            try:
                await event.wait()
            finally:
                if self._waiter is event:
                    self._waiter = None

    async def wait(self) -> None:
        """Sleep until the stream is woken: output, a failure, a finish, or :meth:`notify`.

        Returns at once (after a checkpoint) when output or an end is already there. Takes
        nothing: the caller checks its own conditions, then :meth:`receive_nowait`.
        """
        if self._pending is not None or self.state is not StreamState.OPEN:
            await trio.lowlevel.checkpoint()
            return
        if self._waiter is not None:
            raise trio.BusyResourceError("another task is already waiting on this stream")
        self._waiter = event = trio.Event()
        try:
            await event.wait()
        finally:
            if self._waiter is event:
                self._waiter = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenDelta:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None


def fail_all(streams: dict[str, RequestStream], error: Callable[[], EngineError]) -> int:
    """Fail every stream with an error of its own from ``error()``; return how many failed.

    One object per stream, not one shared: each consumer raises its error, and a raise
    appends that frame's traceback to the object. A shared error would grow by every
    consumer's frames and keep all of them (and their requests) alive as long as any holds it.
    """
    count = 0
    for stream in list(streams.values()):
        if stream.state is StreamState.OPEN:
            stream.fail(error())
            count += 1
    streams.clear()
    return count
