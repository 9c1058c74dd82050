"""An engine client's output watch: a frame over ``limits.max_frame_mb`` fails the requests
in flight, and the engine serves on.

libzmq refuses a message over ``ZMQ_MAXMSGSIZE`` (set by the subclass on the output socket,
:attr:`~smgd.engines.base.EngineClient.max_frame_bytes`) by dropping the connection it came
on, unread; the engine reconnects and sends on. So a connection to the output socket that
breaks while the engine lives on lost a message, and the requests in flight fail.
:func:`watch_output` is started by the subclass before the engine can connect.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

import trio
import zmq

from smgd import launch
from smgd.engines.stream import fail_all
from smgd.errors import EngineDead, WireError
from smgd.zmq_trio import open_monitor

if TYPE_CHECKING:
    from smgd.engines.core import ClientCore
    from smgd.engines.stream import RequestStream

log = logging.getLogger("smgd.engine")


async def watch_output(
    client: ClientCore, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Watch the output socket's connections; start it before the engine can connect (a
    monitor's events are not replayed). A broken one goes to :func:`_output_broke`.

    A connection that never completed its ZMTP handshake carried no frame: a stale-socket
    probe (:func:`smgd.ipc.clear_stale_socket`) connects and leaves so. libzmq reports
    that as a failed handshake and the disconnect right after it, back to back (one call
    on its I/O thread), so a disconnect that follows a failed handshake is not a break.
    """
    peers: set[int] = set()  # by connection fd, as the subclasses' input watches
    kinds = (
        zmq.EVENT_ACCEPTED
        | zmq.EVENT_DISCONNECTED
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    )
    async with open_monitor(client._output_socket(), kinds) as events:
        task_status.started()
        unshaken = False  # the event before was a failed handshake
        async for event in events:
            if event.kind == "accepted":
                peers.add(event.value)
            elif event.kind == "disconnected" and event.value in peers:
                peers.discard(event.value)
                if not unshaken:
                    await _output_broke(client)
            unshaken = event.kind == "handshake_failed"


async def _output_broke(client: ClientCore) -> None:
    """A connection to the output socket broke. An engine that exits or crashes closes its
    own (its death comes from its exit or its input socket, within
    ``launch.EXIT_REPORT_S``); one that lives on had it cut by smgd: libzmq drops the
    connection of a frame over ``limits.max_frame_mb`` without reading it, and the
    message is lost, with what it held for each request in flight (the engine reconnects
    and sends on). So, as after an undecodable frame, each fails and is aborted.

    The requests in flight are taken off the reader at once, so that nothing the engine
    sends after reconnecting reaches them (they would end as successes with a gap), and
    fail when the cause is known: the engine's death, or the lost frame.
    """
    held, client._streams = client._streams, {}
    for rid in held:
        client._untrack(rid)
    failed = False
    try:
        with trio.move_on_after(launch.EXIT_REPORT_S):
            await client._dead.wait()
        if client._death is None:
            failed = True
            _lost_frame(client, held)
    finally:
        if not failed:  # dead, or stopped meanwhile: as die() and run() fail streams
            death = client._death
            why = death.message if death is not None else f"engine {client.name} stopped"
            fail_all(held, partial(EngineDead, why))


def _lost_frame(client: ClientCore, held: dict[str, RequestStream]) -> None:
    limit = client.config.limits.max_frame_mb
    client._decode_errors += 1
    message = (
        f"engine {client.name} sent an output message smgd refused: its connection to the "
        f"output socket broke while the engine ran on, which a frame over "
        f"limits.max_frame_mb ({limit} MiB) does (smgd drops such a frame unread); the "
        "request's output may be incomplete"
    )
    failed = client.fail_alone(list(held.values()), partial(WireError, message))
    log.warning(
        "engine %s: a connection to its output socket broke while it ran on (a frame over "
        "limits.max_frame_mb = %d MiB, dropped unread?): %d request(s) in flight failed "
        "and aborted",
        client.name,
        limit,
        failed,
    )
