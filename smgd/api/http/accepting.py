"""The accept loop: at each wakeup, every connection the kernel holds (up to a batch).

``trio.serve_listeners`` takes one connection per scheduler pass: ``SocketListener.accept``
yields after each accept (trio's checkpoint rule), so a burst of N connects enters the daemon
over N passes. Under load a pass runs every runnable task once and takes a millisecond or
more; at 10,000 streams connecting at once the last ones waited seconds in the kernel's
accept queue before smgd read their requests (TTFT p99 4.7-8.6 s in seven runs, up to 21 s in
others, with the daemon under one core). Taking every waiting connection at each wakeup
moves that wait into smgd, where the requests are served in turn: TTFT p99 4.1-7.8 s, p50
4.94 -> 4.49 s, delivered tokens 35 -> 49 % (docs/performance.md, "Issue 21, twelfth pass").

Errors are handled as trio's loop does: a connection the peer aborted before it was taken is
skipped, and running out of descriptors or memory (``EMFILE`` and the like) is retried every
100 ms instead of ending the server; smgd logs a shortage when it starts and when every
waiting connection has been taken again, at most once per 10 s (trio logs every retry).
"""

from __future__ import annotations

import errno
import logging
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    import socket

log = logging.getLogger("smgd.http")

# At most this many connections taken per wakeup. One costs 26-43 µs of CPU here (the accept,
# trio's socket and stream, its task's start; 2,000 queued connections, three runs), so a
# full batch holds the scheduler for ~10 ms, half an engine step, and only during a burst of
# connects (clients keep their connections); a burst of 10,000 leaves the kernel's queue in
# ~40 passes instead of 10,000.
ACCEPT_BATCH = 256

# The accept failed for a reason the next connection shares (descriptors, memory): wait
# rather than spin. trio's serve_listeners uses the same set and delay.
CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
CAPACITY_RETRY_S = 0.1
# At most one report of a shortage this often: at the limit's edge a shortage can end and
# start again many times a second, as connections come and go.
REPORT_EVERY_S = 10.0

# The connection went away between its handshake and its accept: skip it (trio's list).
SKIPPED_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EPERM",
        "ECONNABORTED",
        "EPROTO",
        "ENETDOWN",
        "ENOPROTOOPT",
        "EHOSTDOWN",
        "ENONET",
        "EHOSTUNREACH",
        "EOPNOTSUPP",
        "ENETUNREACH",
    )
    if hasattr(errno, name)
)

# A connection's handler gets its stream and the ``fileno`` of the standard library socket
# trio's wraps: the same descriptor, -1 once the stream's socket is closed (trio closes that
# very object), and a call in C where trio's socket adds a Python frame, which a direct write
# pays per token (smgd.api.http.direct).
Handler = Callable[[trio.SocketStream, Callable[[], int]], Awaitable[object]]


async def serve_sockets(
    handler: Handler, sockets: list[socket.socket], *, handler_nursery: trio.Nursery
) -> None:
    """Accept on every listening socket until cancelled; each connection's ``handler`` runs
    in ``handler_nursery`` and its stream is closed when it returns. The sockets are closed
    when this returns."""
    async with trio.open_nursery() as nursery:
        for sock in sockets:
            nursery.start_soon(_accept_from, sock, handler, handler_nursery)


class Shortage:
    """When to log a shortage of descriptors (or memory) for accepts; sans-IO.

    A shortage lasts from the first failed accept until the kernel's queue is empty again
    (every waiting connection taken): at the edge of the limit, accepts succeed and fail by
    turns as descriptors come and go, and each turn is not news. A shortage is reported when
    it starts, unless the last report is under :data:`REPORT_EVERY_S` old (its failures are
    then counted into the next report), and its end is reported when its start was.
    """

    __slots__ = ("_failed", "_last_report", "_reported", "_this", "short")

    def __init__(self) -> None:
        self.short = False  # a shortage is on
        self._reported = False  # and its start was logged
        self._failed = 0  # failed accepts since the last report
        self._this = 0  # failed accepts in this shortage
        self._last_report = -math.inf

    def failed(self, now: float) -> int | None:
        """An accept failed: the failed accepts to report now (since the last report), or
        None."""
        self._failed += 1
        self._this += 1
        if self.short:
            return None
        self.short = True
        if now - self._last_report < REPORT_EVERY_S:
            return None
        self._reported, self._last_report = True, now
        failed, self._failed = self._failed, 0
        return failed

    def drained(self) -> int | None:
        """The queue is empty: the shortage's failed accepts, to report as its end, or None."""
        if not self.short:
            return None
        self.short = False
        this, self._this = self._this, 0
        if not self._reported:
            return None
        self._reported = False
        return this


async def _accept_from(sock: socket.socket, handler: Handler, handlers: trio.Nursery) -> None:
    sock.setblocking(False)
    shortage = Shortage()
    try:
        while True:
            await trio.lowlevel.wait_readable(sock)
            for _ in range(ACCEPT_BATCH):
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    ended = shortage.drained()
                    if ended is not None:
                        log.warning(
                            "accepting connections again: every waiting one taken, after %d "
                            "failed tries",
                            ended,
                        )
                    break
                except OSError as exc:
                    if exc.errno in SKIPPED_ERRNOS:
                        continue
                    if exc.errno not in CAPACITY_ERRNOS:
                        raise
                    failed = shortage.failed(trio.current_time())
                    if failed is not None:
                        log.error(
                            "accept failed: %s (%s)%s; new connections wait until it succeeds, "
                            "retrying every %.1f s (raise the open-files limit: "
                            "docs/troubleshooting.md)",
                            errno.errorcode.get(exc.errno or 0, "?"),
                            exc.strerror,
                            "" if failed == 1 else f", {failed} times since the last report",
                            CAPACITY_RETRY_S,
                        )
                    await trio.sleep(CAPACITY_RETRY_S)
                    break
                handlers.start_soon(_handle, conn, handler)
    finally:
        sock.close()


async def _handle(conn: socket.socket, handler: Handler) -> None:
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(conn))
    try:
        await handler(stream, conn.fileno)
    finally:
        # The socket's close alone, as trio.aclose_forcefully's would be, without its checkpoint
        # in a cancelled scope: a Cancelled raised and caught per connection, for a stream
        # that hypercorn has nearly always closed already (a cProfile of 3,000 streams
        # connecting at once charged it 13 % of a connection's time, its two requests
        # included: docs/performance.md, "sixteenth pass").
        stream.socket.close()
