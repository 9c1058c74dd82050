"""Async send/recv for sync pyzmq sockets under trio, plus socket-monitor events.

pyzmq has no trio integration, so :class:`TrioSocket` drives a plain ``zmq.Socket`` in
``NOBLOCK`` mode and parks on the socket's ``ZMQ_FD`` with :func:`trio.lowlevel.wait_readable`.

The ZMQ_FD contract (the reason this module exists, and the source of every hang):

* The FD is not the data; it is libzmq's mailbox signal. It becomes readable when the socket's
  state *may* have changed, for reads and writes alike (it never polls writable). The truth is
  ``getsockopt(EVENTS)`` (``POLLIN`` / ``POLLOUT``).
* It is edge-triggered: reading ``EVENTS`` *and any send or recv* process the mailbox and clear
  the signal. So after any operation on the socket, a message may already be queued while the
  FD stays quiet forever. Rule: only park on the FD right after ``EVENTS`` said "not ready",
  with no socket call in between; after waking, re-check ``EVENTS`` (wakeups can be spurious).
* Consequently only one task may touch a socket while another is parked on it: a concurrent
  ``*_nowait`` call would eat the edge the parked task is waiting for. Every operation here
  therefore raises :class:`trio.BusyResourceError` while another task is parked.

Cancellation: a cancel can only land while parked, before the recv/send call that would move
data; once data moved, the result is returned through a cancel-shielded checkpoint. A cancelled
recv never loses a message; a cancelled send either sent the whole multipart message or nothing.
"""

from __future__ import annotations

import math
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from smgd.errors import TransportError, errno_name

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence

__all__ = [
    "MonitorEvent",
    "MonitorStream",
    "SocketStatistics",
    "TrioSocket",
    "monitor_events",
    "open_monitor",
    "open_socket",
]

SendFrame = bytes | memoryview | zmq.Frame

# Default cap for recv_multipart_batch: the reader decodes ~3 µs per message, so 256 bounds one
# batch to ~1 ms of loop time before consumers run. Engines send one message per step, so a
# real batch is rarely above a few dozen; the cap only matters when the reader fell far behind.
DEFAULT_BATCH = 256

# ROUTER with ROUTER_MANDATORY reports POLLOUT when *any* peer's pipe has room, yet a send to a
# peer whose pipe is full fails with EAGAIN, and the FD will not signal when that one pipe
# drains. We cannot wait on it, so we poll. 1 ms keeps CPU near zero while a peer is stalled
# and adds at most 1 ms to a send that was stuck anyway; the send deadline still applies.
_MISLEADING_READY_POLL_S = 0.001


# pyzmq's constants are enum.IntFlag members: ``int & IntFlag`` builds a new member through
# the enum machinery (~1 µs), and EVENTS is tested on every wakeup. Plain ints here.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)


@dataclass(frozen=True, slots=True)
class SocketStatistics:
    """``waits``: how many times an operation parked on the FD (backpressure / idle)."""

    waits: int
    busy: bool


class TrioSocket:
    """A sync ``zmq.Socket`` driven from trio. One task owns it at a time (see module doc)."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.socket = sock
        # Bound once: EVENTS is read around every park, and pyzmq types getsockopt loosely.
        self._getsockopt: Callable[[int], int] = sock.getsockopt  # type: ignore[assignment]
        self._fd = self._getsockopt(zmq.FD)
        self._busy: str | None = None  # name of the in-progress async op, for the error text
        self._closed = False
        self._waits = 0
        # True while the last call on the socket was the receive loop's EVENTS read that said
        # "no message": the FD is armed, so the next receive may park on it at once instead
        # of reading EVENTS again (see _recv_batch). Any other operation clears it.
        self._in_armed = False

    # -- ownership ---------------------------------------------------------------------------
    def _check_free(self, what: str) -> None:
        self._in_armed = False  # every operation may process the mailbox and eat the edge
        if self._closed:
            raise trio.ClosedResourceError("zmq socket is closed")
        if self._busy is not None:
            raise trio.BusyResourceError(
                f"zmq socket: {what} while another task is in {self._busy}; "
                "exactly one task may own a zmq socket (the FD is edge-triggered)"
            )

    async def _park(self, flag: int, ready_but_failed: bool) -> bool:
        """Wait until an op that just raised EAGAIN may succeed; returns the new
        ``ready_but_failed`` state. Must be called right after that op (no socket call between).
        """
        if self._getsockopt(_EVENTS) & flag:
            # EVENTS says ready although the op just failed. Usually the state changed in
            # between (retry at once); if it happens twice in a row it is ROUTER_MANDATORY with
            # one full peer pipe, which the FD never reports: poll instead of spinning.
            if ready_but_failed:
                self._waits += 1
                await trio.sleep(_MISLEADING_READY_POLL_S)
                if self._closed:  # closed while we slept (no FD wait to report it)
                    raise trio.ClosedResourceError("zmq socket was closed")
            return True
        # EVENTS was just read and said "not ready", which re-armed the edge: parking is safe.
        self._waits += 1
        while True:
            await trio.lowlevel.wait_readable(self._fd)
            # Wakeups are "something changed", not "your flag is set": re-check before acting.
            if self._getsockopt(_EVENTS) & flag:
                return False

    # -- receive -------------------------------------------------------------------------------
    @overload
    def recv_multipart_nowait(self, *, copy: Literal[False] = False) -> list[zmq.Frame]: ...
    @overload
    def recv_multipart_nowait(self, *, copy: Literal[True]) -> list[bytes]: ...
    def recv_multipart_nowait(self, *, copy: bool = False) -> list[zmq.Frame] | list[bytes]:
        """One queued message, or :class:`trio.WouldBlock`."""
        self._check_free("recv_multipart_nowait")
        try:
            return self.socket.recv_multipart(_NOBLOCK, copy=copy)
        except zmq.Again:
            raise trio.WouldBlock from None
        except zmq.ZMQError as exc:
            raise _transport_error("recv", exc) from exc

    @overload
    async def recv_multipart(self, *, copy: Literal[False] = False) -> list[zmq.Frame]: ...
    @overload
    async def recv_multipart(self, *, copy: Literal[True]) -> list[bytes]: ...
    async def recv_multipart(self, *, copy: bool = False) -> list[zmq.Frame] | list[bytes]:
        """Receive one multipart message (zero-copy ``zmq.Frame`` parts unless ``copy``)."""
        batch = await self._recv_batch(1, copy)
        return batch[0]  # type: ignore[no-any-return]

    @overload
    async def recv_multipart_batch(
        self, max_n: int = DEFAULT_BATCH, *, copy: Literal[False] = False
    ) -> list[list[zmq.Frame]]: ...
    @overload
    async def recv_multipart_batch(
        self, max_n: int = DEFAULT_BATCH, *, copy: Literal[True]
    ) -> list[list[bytes]]: ...
    async def recv_multipart_batch(
        self, max_n: int = DEFAULT_BATCH, *, copy: bool = False
    ) -> list[list[zmq.Frame]] | list[list[bytes]]:
        """Wait for at least one message, then return all queued ones (up to ``max_n``).

        The hot path: one wakeup per engine step however many messages it produced.
        """
        return await self._recv_batch(max_n, copy)

    async def _recv_batch(self, max_n: int, copy: bool) -> list[Any]:
        if max_n < 1:
            raise ValueError("max_n must be >= 1")
        await trio.lowlevel.checkpoint_if_cancelled()
        # Armed by the previous batch's last EVENTS read: park first, check after. This saves
        # three of the five EVENTS reads an engine step cost (~2 µs each warm in pyzmq 27, which
        # converts the option to an enum per call, and several times that on the first wakeup
        # after an idle step; docs/performance.md, "Issue 21, eighth pass").
        armed = self._in_armed
        self._check_free("recv_multipart_batch")
        self._busy = "recv_multipart_batch"
        recv = self.socket.recv_multipart
        events = self._getsockopt
        batch: list[Any] = []
        ready_but_failed = False
        waits_before = self._waits
        try:
            while True:
                if armed:
                    # EVENTS said "no message" and nothing touched the socket since, so a
                    # message that arrived meanwhile has signalled the FD. Wakeups can be
                    # spurious: EVENTS is read again below before any receive.
                    self._waits += 1
                    await trio.lowlevel.wait_readable(self._fd)
                    armed = False
                try:
                    # Drain while EVENTS says a message is queued, up to max_n: no recv that
                    # fails with EAGAIN (an exception per wakeup) to find the end. A cancel
                    # cannot land in here: no awaits.
                    while len(batch) < max_n:
                        if not events(_EVENTS) & _POLLIN:
                            armed = True  # this read re-armed the FD
                            break
                        batch.append(recv(_NOBLOCK, copy=copy))
                except zmq.Again:
                    armed = False  # a recv after EVENTS said POLLIN: re-check before parking
                except zmq.ZMQError as exc:
                    if not batch:
                        raise _transport_error("recv", exc) from exc
                    # Hand over what we have; the broken socket fails the next call.
                    armed = False
                if batch:
                    break
                if not armed:
                    ready_but_failed = await self._park(_POLLIN, ready_but_failed)
        finally:
            self._busy = None
        self._in_armed = armed
        if self._waits == waits_before:
            # Never yielded: keep trio's "every await is a schedule point" promise, shielded
            # so the messages we already took off the socket cannot be lost to a cancel.
            await trio.lowlevel.cancel_shielded_checkpoint()
        return batch

    # -- send ----------------------------------------------------------------------------------
    def send_multipart_nowait(self, frames: Sequence[SendFrame]) -> None:
        """Queue one multipart message now, or raise :class:`trio.WouldBlock` (nothing sent)."""
        self._check_free("send_multipart_nowait")
        if not self._try_send(frames):
            raise trio.WouldBlock

    def _try_send(self, frames: Sequence[SendFrame]) -> bool:
        # libzmq checks the HWM on the first part only and then queues the remaining parts
        # atomically, so EAGAIN means nothing was sent.
        try:
            self.socket.send_multipart(frames, _NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            # e.g. EHOSTUNREACH from ROUTER_MANDATORY to an unknown/dead peer.
            raise _transport_error("send", exc) from exc
        return True

    async def send_multipart(
        self, frames: Sequence[SendFrame], *, deadline: float | None = None
    ) -> None:
        """Send one multipart message, waiting for room (HWM / no peer) until ``deadline``.

        ``deadline`` is absolute trio time (``trio.current_time()`` based). Past it, raise
        :class:`TransportError` (``code="send_deadline"``) with nothing sent.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_free("send_multipart")
        self._busy = "send_multipart"
        waits_before = self._waits
        try:
            if not self._try_send(frames):
                ready_but_failed = False
                with trio.move_on_at(math.inf if deadline is None else deadline) as scope:
                    while True:
                        ready_but_failed = await self._park(_POLLOUT, ready_but_failed)
                        if self._try_send(frames):
                            break
                if scope.cancelled_caught:
                    raise TransportError(
                        "zmq send deadline passed: the peer is not taking messages",
                        code="send_deadline",
                    )
        finally:
            self._busy = None
        if self._waits == waits_before:
            await trio.lowlevel.cancel_shielded_checkpoint()

    # -- lifecycle ------------------------------------------------------------------------------
    def statistics(self) -> SocketStatistics:
        return SocketStatistics(waits=self._waits, busy=self._busy is not None)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close with linger 0 (pending outgoing messages are dropped). Idempotent.

        A task parked on this socket gets :class:`trio.ClosedResourceError`.
        """
        if self._closed:
            return
        self._closed = True
        trio.lowlevel.notify_closing(self._fd)
        self.socket.close(linger=0)


def _transport_error(op: str, exc: zmq.ZMQError) -> TransportError:
    """Wrap a libzmq error; ``code`` names the errno (``"EHOSTUNREACH"`` = dead vLLM peer)."""
    return TransportError(f"zmq {op} failed: {exc.strerror}", code=errno_name(exc.errno or 0))


@asynccontextmanager
async def open_socket(
    socket_type: int, *, context: zmq.Context[zmq.Socket[bytes]] | None = None
) -> AsyncIterator[TrioSocket]:
    """A new ``TrioSocket`` (linger 0), closed on exit. Bind/connect via ``.socket``."""
    ctx = context if context is not None else zmq.Context.instance()
    sock = ctx.socket(socket_type)
    # linger 0 everywhere: at shutdown we drop unsent messages instead of blocking the
    # process (and Context.term) on a dead engine.
    sock.setsockopt(zmq.LINGER, 0)
    tsock = TrioSocket(sock)
    try:
        yield tsock
    finally:
        tsock.close()


# -- socket monitor ------------------------------------------------------------------------------
MonitorKind = Literal[
    "connected",
    "connect_delayed",
    "connect_retried",
    "listening",
    "bind_failed",
    "accepted",
    "accept_failed",
    "closed",
    "close_failed",
    "disconnected",
    "monitor_stopped",
    "handshake_failed",
    "handshake_succeeded",
    "other",
]

_KINDS: dict[int, MonitorKind] = {
    zmq.EVENT_CONNECTED: "connected",
    zmq.EVENT_CONNECT_DELAYED: "connect_delayed",
    zmq.EVENT_CONNECT_RETRIED: "connect_retried",
    zmq.EVENT_LISTENING: "listening",
    zmq.EVENT_BIND_FAILED: "bind_failed",
    zmq.EVENT_ACCEPTED: "accepted",
    zmq.EVENT_ACCEPT_FAILED: "accept_failed",
    zmq.EVENT_CLOSED: "closed",
    zmq.EVENT_CLOSE_FAILED: "close_failed",
    zmq.EVENT_DISCONNECTED: "disconnected",
    zmq.EVENT_MONITOR_STOPPED: "monitor_stopped",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_failed",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake_failed",
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "handshake_succeeded",
}


@dataclass(frozen=True, slots=True)
class MonitorEvent:
    """One libzmq socket event. ``value`` is the event's number (an fd, errno or interval)."""

    kind: MonitorKind
    endpoint: str
    value: int = 0


class MonitorStream:
    """Async iterator of :class:`MonitorEvent`; ends after ``monitor_stopped``."""

    def __init__(self, pair: TrioSocket) -> None:
        self._pair = pair
        self._stopped = False

    async def receive(self) -> MonitorEvent:
        msg = parse_monitor_message(await self._pair.recv_multipart(copy=True))
        kind = _KINDS.get(msg["event"], "other")
        endpoint = msg["endpoint"].decode("utf-8", "replace")
        return MonitorEvent(kind=kind, endpoint=endpoint, value=int(msg["value"]))

    def __aiter__(self) -> MonitorStream:
        return self

    async def __anext__(self) -> MonitorEvent:
        if self._stopped:
            raise StopAsyncIteration
        event = await self.receive()
        if event.kind == "monitor_stopped":
            self._stopped = True
        return event


@asynccontextmanager
async def open_monitor(
    sock: TrioSocket, events: int = zmq.EVENT_ALL
) -> AsyncIterator[MonitorStream]:
    """Monitor ``sock``. Enter it *before* the peer can attach: events are not replayed.

    The stream's own PAIR socket is owned by the task iterating it, not by ``sock``'s owner.
    """
    pair = TrioSocket(sock.socket.get_monitor_socket(events))
    try:
        yield MonitorStream(pair)
    finally:
        if not sock.closed:
            sock.socket.disable_monitor()
        pair.close()


async def monitor_events(
    sock: TrioSocket, events: int = zmq.EVENT_ALL
) -> AsyncGenerator[MonitorEvent, None]:
    """``async for event in monitor_events(sock)``; prefer :func:`open_monitor` when the loop
    may stop early, so the monitor is torn down deterministically."""
    async with open_monitor(sock, events) as stream:
        async for event in stream:
            yield event
