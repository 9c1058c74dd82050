"""quart-trio's per-request ASGI handling with fewer scheduler passes before the handler.

quart-trio runs every HTTP request as two new tasks: one reads the ASGI messages (the body,
then a disconnect), the other runs the handler, which waits for the body the first one
delivers. Each hand-over is a scheduler pass, and a trio pass runs every other runnable task
first. When 256 requests arrive at once (the load generator's streams end in lockstep), one
pass takes tens of milliseconds, and the passes before the engine submit set TTFT: traced at
C=256, a request spent ~56 ms before its handler ran and ~64 ms more waiting for its body.

:class:`InlineHTTPConnection` keeps quart-trio's behaviour and changes the order:

- the request's own task reads the body first (:func:`read_body`). Messages already queued
  (a small request's body arrives in the same read as its head) are taken with the
  ``receive_nowait`` of the trio memory channel behind hypercorn's ``receive``, without a
  scheduler pass; any other ``receive`` (Quart's test client, another server) is awaited;
- a whole body is also kept in the scope (:data:`QUEUED_BODY_KEY`), where
  :func:`smgd.api.core.prepare.read_json` takes it without awaiting Quart's body (an await on an
  event that is already set is still a scheduler pass);
- the handler then runs in the same task; the message reader still runs beside it and still
  cancels the handler when the client disconnects.

A body that does not arrive within Quart's ``BODY_TIMEOUT`` gets the handler anyway, with
the request's ``body_timeout`` at 0, so Quart answers 408 as it would have; a body over
``MAX_CONTENT_LENGTH`` is left to Quart, which answers 413.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any, Literal

import trio
from quart_trio.asgi import TrioASGIHTTPConnection

if TYPE_CHECKING:
    from collections.abc import Callable

    from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable
    from quart.wrappers import Request

__all__ = [
    "QUEUED_BODY_KEY",
    "InlineHTTPConnection",
    "next_message",
    "nowait_receiver",
    "read_body",
]

# Where a request's whole body, read before its handler, is kept in the ASGI scope.
QUEUED_BODY_KEY = "smgd.body"

BodyOutcome = Literal["complete", "too_large", "disconnected"]


class InlineHTTPConnection(TrioASGIHTTPConnection):
    """Set as the app's ``asgi_http_class`` (:func:`smgd.api.http.app.create_app`)."""

    async def __call__(self, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        request = self._create_request_from_scope(send)
        limit = self.app.config["MAX_CONTENT_LENGTH"]
        timeout = request.body_timeout
        with trio.move_on_after(math.inf if timeout is None else timeout) as waited:
            outcome = await read_body(request, receive, limit)
        if waited.cancelled_caught:
            request.body_timeout = 0  # the handler's get_data raises RequestTimeout at once
        elif outcome == "disconnected":
            return  # gone before the handler started: nothing to answer
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.handle_messages, nursery, request, receive)
            # Cancels the nursery once the response is sent, which stops the reader.
            await self.handle_request(nursery, request, send)


async def read_body(request: Request, receive: Any, limit: int | None) -> BodyOutcome:
    """Apply ``request``'s ASGI messages up to the end of its body (or a disconnect).

    Messages after the body's end stay queued for the reader task, which must still see the
    disconnect. A whole body of at most ``limit`` bytes is put in the scope under
    :data:`QUEUED_BODY_KEY`; past ``limit`` reading stops ("too_large": Quart's body then
    raises 413 and the reader task takes the rest).
    """
    nowait = nowait_receiver(receive)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await next_message(receive, nowait)
        kind = message["type"]
        if kind == "http.request":
            data = message.get("body", b"")
            request.body.append(data)
            parts.append(data)
            size += len(data)
            if limit is not None and size > limit:
                return "too_large"
            if not message.get("more_body", False):
                request.body.set_complete()
                scope: dict[str, Any] = request.scope  # type: ignore[assignment]
                scope[QUEUED_BODY_KEY] = b"".join(parts)
                return "complete"
        elif kind == "http.disconnect":
            return "disconnected"


def nowait_receiver(receive: Any) -> Callable[[], Any] | None:
    """The ``receive_nowait`` of the trio memory channel behind hypercorn's ``receive``, if any."""
    channel = getattr(receive, "__self__", None)
    return channel.receive_nowait if isinstance(channel, trio.MemoryReceiveChannel) else None


async def next_message(receive: Any, nowait: Callable[[], Any] | None) -> Any:
    """The next ASGI message: taken without a scheduler pass when one is already queued."""
    if nowait is not None:
        with contextlib.suppress(trio.WouldBlock):
            return nowait()
    return await receive()
