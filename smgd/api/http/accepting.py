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
100 ms instead of ending the server; smgd logs it once when it starts and once when accepts
succeed again (trio logs every retry).
"""

from __future__ import annotations

import errno
import logging
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

Handler = Callable[[trio.SocketStream], Awaitable[object]]


async def serve_sockets(
    handler: Handler, sockets: list[socket.socket], *, handler_nursery: trio.Nursery
) -> None:
    """Accept on every listening socket until cancelled; each connection's ``handler`` runs
    in ``handler_nursery`` and its stream is closed when it returns. The sockets are closed
    when this returns."""
    async with trio.open_nursery() as nursery:
        for sock in sockets:
            nursery.start_soon(_accept_from, sock, handler, handler_nursery)


async def _accept_from(sock: socket.socket, handler: Handler, handlers: trio.Nursery) -> None:
    sock.setblocking(False)
    failures = 0  # accepts refused in a row for want of descriptors or memory
    try:
        while True:
            await trio.lowlevel.wait_readable(sock)
            for _ in range(ACCEPT_BATCH):
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno in SKIPPED_ERRNOS:
                        continue
                    if exc.errno not in CAPACITY_ERRNOS:
                        raise
                    if failures == 0:  # once per episode: it retries ten times a second
                        log.error(
                            "accept failed: %s (%s); new connections wait until it succeeds, "
                            "retrying every %.1f s (raise the open-files limit: "
                            "docs/troubleshooting.md)",
                            errno.errorcode.get(exc.errno or 0, "?"),
                            exc.strerror,
                            CAPACITY_RETRY_S,
                        )
                    failures += 1
                    await trio.sleep(CAPACITY_RETRY_S)
                    break
                if failures:
                    log.warning("accepting connections again, after %d failed tries", failures)
                    failures = 0
                handlers.start_soon(_handle, conn, handler)
    finally:
        sock.close()


async def _handle(conn: socket.socket, handler: Handler) -> None:
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(conn))
    try:
        await handler(stream)
    finally:
        await trio.aclose_forcefully(stream)
