"""An engine client's reader task: the only task touching the output socket.

It decodes each frame and demultiplexes by rid into
:class:`~smgd.engines.stream.RequestStream` slots (:meth:`~smgd.engines.core.ClientCore.deliver`),
never awaiting a consumer. An undecodable frame fails the requests in flight; a streak of them
kills the engine.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

import trio

from smgd.engines.delivery import DELIVERY
from smgd.errors import WireError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from smgd.engines.core import ClientCore
    from smgd.wire.common import TokenDelta

log = logging.getLogger("smgd.engine")

# Consecutive undecodable frames before the engine is declared dead. One garbled frame can be a
# bug in an exotic field; a streak means the peer does not speak our wire (wrong version/mode).
DECODE_ERROR_STREAK = 8
# Frames taken off the output socket per wakeup. Bounded so the reader yields to consumers
# between batches even when an engine floods us; 64 frames = dozens of engine steps.
RECV_BATCH = 64
# Rows the reader delivers between two yields. An engine message carries a row for every
# running request: at C = 1,024 delivering one takes ~12 ms of the loop, and a request that
# starts or ends meanwhile waits for it at every scheduler pass on its way (several between
# one response's end and the next request's send), which cost C = 1,024 its delivered share
# (docs/performance.md, "Issue 21, seventh pass"). A pass every 256 rows (~3 ms) lets them
# through; a batch of at most 256 rows, every one below C = 256, is delivered without one.
DELIVER_CHUNK = 256


async def reader_task(client: ClientCore) -> None:
    """The only task on the output socket: decode each frame, deliver its deltas (see the
    constants above for when it yields)."""
    sock = client._output_socket()
    deliver = client.deliver
    # Direct writes are held while rows are delivered and made together before each
    # yield (smgd.engines.delivery): ended in the finally too, so none is ever left held.
    delivery = DELIVERY
    while True:
        batch = await sock.recv_multipart_batch(RECV_BATCH)
        client._last_frame = trio.current_time()
        delivered = 0  # rows since the last yield
        delivery.start()
        try:
            for frames in batch:
                try:
                    deltas = client._decode_frames(frames)
                except Exception as exc:
                    # A decoder that trips over a value its types let through (a string
                    # where a number goes) raises what Python raises: the frame is as
                    # undecodable as a WireError's, and the reader must live on (raised
                    # on, it ended every engine and the daemon with it).
                    if _undecodable(client, exc):
                        return
                    continue
                client._decode_streak = 0
                if delivered + len(deltas) <= DELIVER_CHUNK:  # every message below C = 256
                    for delta in deltas:
                        deliver(delta)
                    delivered += len(deltas)
                    continue
                if client._fresh:
                    deltas = _first_outputs_first(client, deltas)
                for delta in deltas:
                    if delivered >= DELIVER_CHUNK:
                        delivery.end()
                        await trio.lowlevel.checkpoint()
                        delivery.start()
                        delivered = 0
                    deliver(delta)
                    delivered += 1
        finally:
            delivery.end()
        # No checkpoint here: the next receive yields before it returns a batch (it parks,
        # or it checkpoints after draining), so consumers run between two batches anyway,
        # and one scheduler pass fewer per engine step is measurable at C = 16 and 64
        # (docs/performance.md, "Issue 21, fourth pass").


def _undecodable(client: ClientCore, exc: Exception) -> bool:
    """Count a frame the client's ``_decode_frames`` refused and fail the requests in
    flight; True if the streak killed the engine.

    Which requests had output in the frame is unknown (an engine message carries a row for
    each running one), and what it held is lost: streamed on, a request would finish as a
    success with a gap in its text. So each fails, as the engine has it still running,
    with an abort to the engine; the engine serves on.
    """
    client._decode_errors += 1
    client._decode_streak += 1
    if isinstance(exc, WireError):
        log.warning("engine %s: undecodable frame: %s", client.name, exc)
    else:  # a decoder bug's traceback, for the report
        log.warning("engine %s: undecodable frame: %r", client.name, exc, exc_info=exc)
    message = (
        f"engine {client.name} sent an output message smgd could not decode ({exc}); "
        "the request's output may be incomplete"
    )
    if failed := client.fail_alone(list(client._streams.values()), partial(WireError, message)):
        log.warning(
            "engine %s: %d request(s) in flight failed and aborted (undecodable frame)",
            client.name,
            failed,
        )
    if client._decode_streak >= DECODE_ERROR_STREAK:
        client.die(f"{client._decode_streak} undecodable frames in a row ({exc})")
        return True
    return False


def _first_outputs_first(client: ClientCore, deltas: Sequence[TokenDelta]) -> Sequence[TokenDelta]:
    """``deltas`` with the rows of requests that had no output yet moved to the front
    (in order; rows of one request keep theirs). An engine puts a step's new requests
    after its running ones; delivered in slices, their first tokens would wait for every
    slice before them (docs/performance.md, "Issue 21, seventh pass")."""
    fresh = client._fresh
    first: list[TokenDelta] = []
    rest: list[TokenDelta] = []
    for delta in deltas:
        (first if delta.rid in fresh else rest).append(delta)
    if not first:
        return deltas
    fresh.difference_update(delta.rid for delta in first)
    return first + rest
