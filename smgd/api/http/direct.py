"""Direct SSE writes: an event goes from the engine's reader task straight to the client socket.

Through the ASGI stack, every SSE event of every stream costs a task switch (the engine's
reader wakes the stream's task), a trip through the response generator, the dispatcher's send
loop, hypercorn's ``app_send`` and h11's chunk writer, then the socket write. Under load that is
most of smgd's CPU per token (docs/performance.md). Once a stream's response has started, none
of it is needed: the bytes on the wire are one HTTP/1.1 chunk per event, and the connection
has nothing else to send until the stream ends.

So a stream on an HTTP/1.1 connection of smgd's own worker loop
(:mod:`smgd.api.http.worker_loop`) hands its engine stream a *sink* (``RequestStream.sink``) as
soon as the body starts (the dispatcher has handed the response head to the writer by then,
to hold or to wait for, so even the first event, the one that sets TTFT, goes through it): the
reader task applies each delta (detokenize, stop strings), renders the event and writes it as
a chunk with one ``os.write`` (:class:`DirectWriter`, which :mod:`smgd.api.core.execute` sees
as its ``EventWriter``); the writes of one engine message's rows are made together at the end
of its delivery (:mod:`smgd.engines.delivery`). The stream's task sleeps meanwhile and wakes
only when the writer needs it:

- the kernel did not take the whole chunk (a slow client): the rest waits in a backlog that
  the task flushes through hypercorn's ordinary, waiting send path, and every later event
  joins the backlog until it is empty (order is kept; nothing is dropped);
- the stream finished, or a stop string ended it: the reader writes the last event, the
  end (usage, ``[DONE]``) and the body's terminator in one write (:meth:`DirectWriter.finish`);
  the task then completes the response through h11, whose own terminator the connection drops;
- it failed: the task sends the error event the normal way, through h11;
- the socket broke: the task ends the response, which aborts the engine request.

On smgd's fast path (:mod:`smgd.api.http.fast_path`) the response head is not written alone:
the writer *holds* it (:meth:`DirectWriter.hold_head`) and the stream's first event takes it
along, one write where there were two. Every other send of the response takes it first
(:meth:`DirectWriter.take_unsent`), and the dispatcher bounds the wait (``HEAD_HOLD_S``).
On hypercorn's path (a request the fast path hands to h11: a chunked body, ``Expect``...) h11
makes the head's bytes, and neither h11 nor hypercorn's stream takes back a head they were
given, so the dispatcher holds it itself, as for HTTP/1.0, and the writer *waits for* it
(:meth:`DirectWriter.wait_for_head`): the first event queues and wakes the stream's task, whose
flush has the head sent through h11 first (a task switch per request, not per event); the
events after it are direct. A stream that fails before then is answered with its own status.

h11 keeps no count of chunked body bytes, so chunks written beside it leave its state as it
would be had it written them. Direct mode is off for anything but HTTP/1.1 (close-delimited
HTTP/1.0 bodies, HTTP/2 frames), and for connections not served by smgd's worker loop (the
test client, another ASGI server): those keep the ordinary path.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from hypercorn.events import RawData
from hypercorn.trio.tcp_server import TCPServer

from smgd.engines.delivery import DELIVERY as _DELIVERY
from smgd.engines.delivery import HELD_MAX

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping

__all__ = ["BODY_END", "CANCELLED_ON_DISCONNECT", "CONNECTION_KEY", "DirectWriter", "direct_writer"]

# The end of a chunked HTTP/1.1 body without trailers, as h11 writes it.
BODY_END = b"0\r\n\r\n"

# Where smgd's worker loop puts its connection object in the ASGI scope's "state" (hypercorn
# copies the connection's state dict into every request's scope).
CONNECTION_KEY = "smgd.connection"
# An ASGI scope extension the fast path (smgd.api.http.fast_path) sets: the request runs in
# its connection's request task, whose cancel scope the client's disconnect cancels, so the
# app needs no scope of its own for that.
CANCELLED_ON_DISCONNECT = "smgd.cancelled_on_disconnect"


# An ASGI message of smgd's own, which only a connection whose writer holds the response head
# (the fast path's, smgd.api.http.fast_path) takes: the head goes unsent, and the app may start
# another response, which it does when a stream failed before its first event
# (smgd.api.http.dispatch). Anything sent of the response already makes it an error. The fast
# path names it among its scope's extensions, as ASGI servers declare what they take beyond
# the spec; under any other server the dispatcher holds a stream's head back itself.
RETRACT_HEAD = "smgd.http.response.retract"


class DirectWriter:
    """HTTP/1.1 chunks written straight to one connection's socket, with an ordered backlog."""

    __slots__ = (
        "_busy", "_conn", "_fileno", "_head", "_head_sender", "_held", "_stalled", "backlog",
        "broken", "wake", "writes",
    )  # fmt: skip

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        # Looked up once: the write of every event needs it. fileno() is still called per
        # write, because after the connection closed it is -1 and the number may be reused.
        self._fileno: Callable[[], int] = conn.socket_fileno
        # Sends in hypercorn's send path on this connection right now: flush(), or the
        # connection's own (DirectSendTCPServer.protocol_send holds this writer meanwhile).
        self._busy = 0
        # Bytes wait in the backlog, or a send is under way: a new chunk queues behind them.
        # One flag of the writer's own, so a token's write reads neither the connection's
        # send lock nor the backlog (objects of their own, cold after an engine step).
        self._stalled = False
        self.backlog = bytearray()
        # The response head, while it waits to go out with the first chunk (hold_head).
        self._head = b""
        # Sends the response head through the server's own path, while nothing may be
        # written before it has been (wait_for_head).
        self._head_sender: Callable[[], Awaitable[None]] | None = None
        # Bytes held to the end of an engine reader's delivery (smgd.engines.delivery).
        self._held = b""
        self.broken = False
        self.writes = 0  # chunks the kernel took at once (keep-alive logic, tests)
        # Wakes the stream's task when a write held to a delivery's end left a backlog or
        # found the socket broken (set by the task while the stream is direct).
        self.wake: Callable[[], None] | None = None
        conn.direct_writer = self  # its latest request's: the one protocol_send must hold

    def hold(self) -> None:
        """A send through hypercorn's path starts: chunks queue until :meth:`release`."""
        self._busy += 1
        self._stalled = True

    def release(self) -> None:
        self._busy -= 1
        self._restall()

    def _restall(self) -> None:
        """A chunk must take the stalled branch while a send is under way, bytes wait in the
        backlog, or a head waits to go first (one flag, read by every chunk's write)."""
        self._stalled = (
            self._busy > 0
            or bool(self.backlog)
            or bool(self._head)
            or self._head_sender is not None
        )

    @property
    def head_held(self) -> bool:
        """A response head waits here for the first chunk (:meth:`hold_head`)."""
        return bool(self._head)

    def hold_head(self, head: bytes) -> None:
        """Keep the response ``head`` to write with the first chunk: one write, not two.

        Until then every chunk path goes through the stalled branch, which puts it first.
        Whoever sends anything else of this response must :meth:`take_unsent` before it.
        """
        self._head = head
        self._stalled = True

    def wait_for_head(self, send_head: Callable[[], Awaitable[None]]) -> None:
        """Write nothing until ``send_head`` has sent the response head through the server's
        own path (h11 makes its bytes there; the dispatcher holds it for the first event).

        Until then every chunk goes to the backlog, which asks the stream's task to
        :meth:`flush`, and the flush awaits ``send_head`` first (it returns once the head is
        written, by this call or by whoever sent it already). From then on chunks are
        written directly again. A chunk's write costs nothing more for it: the wait is one
        more reason for the stalled flag, which every write reads anyway.
        """
        self._head_sender = send_head
        self._stalled = True

    def drop_head(self) -> bool:
        """Forget the held head, unsent (the response is retracted); False if it went out."""
        if not self._head:
            return False
        self._head = b""
        self._restall()
        return True

    def take_unsent(self) -> bytes:
        """The held head and the backlog, cleared: bytes that must precede anything the
        caller is about to send through the connection's own path (which waits for the
        socket, so they are sent whole and in order)."""
        unsent = self._head + self.backlog if self.backlog else self._head
        self._head = b""
        self.backlog.clear()
        self._restall()
        return unsent

    def send_head(self) -> None:
        """Write the held head alone now (no chunk came in time); a no-op once it went.

        Synchronous, for a timer's callback: what the kernel does not take (a client that
        has not read earlier answers) waits in the backlog, which the next chunk's write
        hands to the stream's task to flush, or the response's next send takes first
        (:meth:`take_unsent`).
        """
        if self._head:
            self._send(b"")

    def write(self, payload: bytes) -> bool:
        """Send ``payload`` as one chunk now; False if it waits in the backlog or the socket broke.

        A False asks the owning task to :meth:`flush` (or to end the stream if ``broken``).
        During an engine reader's delivery the chunk is held to the delivery's end (True),
        which wakes the task through :attr:`wake` where a False would have been returned.
        """
        if self.broken:
            return False
        return self._send(b"%x\r\n%b\r\n" % (len(payload), payload))

    def finish(self, payload: bytes) -> bool:
        """Send ``payload`` as the body's last chunk followed by its terminator, in one write.

        The client has the whole response at once, before the stream's task runs again (in a
        burst of stream ends that is a scheduler pass of tens of ms sooner, and one write
        fewer). h11 still ends the body when the response completes; the connection drops
        the terminator h11 then writes (:meth:`DirectSendTCPServer.protocol_send`).
        """
        if self.broken:
            return False
        self._conn.body_end_written = True
        if not payload:  # a zero-size chunk would itself be the terminator
            return self._send(BODY_END)
        return self._send(b"%x\r\n%b\r\n%b" % (len(payload), payload, BODY_END))

    def _send(self, frame: bytes) -> bool:
        if self._stalled:
            if self._head:  # the first chunk: the held head goes with it
                frame, self._head = self._head + frame, b""
                self._restall()
            if self._stalled:
                self.backlog += frame
                return False
        if _DELIVERY.open:  # the reader writes it with the rest of its delivery
            if self._held:  # a second chunk in one delivery (a reader that fell behind)
                self._held += frame
            else:
                self._held = frame
                held = _DELIVERY.held
                held.append(self)
                if len(held) >= HELD_MAX:
                    _DELIVERY.write_out()
            return True
        return self._write(frame)

    def write_held(self) -> None:
        """The delivery's end writes what was held (:mod:`smgd.engines.delivery`); what the
        kernel does not take waits in the backlog, and the stream's task is woken to flush it
        (or to end the stream on a broken socket), as a False from :meth:`write` would have
        asked."""
        frame, self._held = self._held, b""
        if self._write(frame):
            return
        if self.wake is not None:
            self.wake()

    def _write(self, frame: bytes) -> bool:
        fd = self._fileno()
        try:
            sent = os.write(fd, frame) if fd >= 0 else 0
        except BlockingIOError:
            sent = 0
        except OSError:  # EPIPE, ECONNRESET: the client is gone
            self.broken = True
            return False
        if sent < len(frame):
            self.backlog += frame[sent:]
            self._stalled = True
            return False
        self.writes += 1
        return True

    async def flush(self) -> None:
        """Push the backlog through hypercorn's send path, which waits for the socket; the
        response head first, where the server sends it (:meth:`wait_for_head`)."""
        send_head = self._head_sender
        if send_head is not None:
            await send_head()
            self._head_sender = None  # only now: nothing may overtake the head
            self._restall()
        while self.backlog and not self.broken:
            data = bytes(self.backlog)
            self.backlog.clear()
            self.hold()
            try:
                # The base class's path on purpose: lock, then send_all, which waits until
                # the kernel took everything (a broken socket closes the stream there).
                await TCPServer.protocol_send(self._conn, RawData(data=data))
            finally:
                self.release()
            if self._fileno() < 0:
                self.broken = True


def direct_writer(scope: Mapping[str, Any]) -> DirectWriter | None:
    """A writer for this request's connection, or None where direct mode does not apply."""
    if scope.get("type") != "http" or scope.get("http_version") != "1.1":
        return None
    conn = (scope.get("state") or {}).get(CONNECTION_KEY)
    if conn is None:
        return None
    return DirectWriter(conn)
