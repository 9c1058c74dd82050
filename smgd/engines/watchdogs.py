"""An engine client's timers, and the requests they fail alone while the engine serves on.

Started by :meth:`~smgd.engines.base.EngineClient.run`, each re-reading its settings at once
after a reload (:meth:`~smgd.engines.base.EngineClient.reconfigure` wakes it):

- the **silence watchdog**: no frame at all for ``timeouts.silence_s`` while requests are in
  flight means the engine is wedged, unless it answers a health probe: then it lost the silent
  requests, which fail alone;
- the **deadline watchdog**: a request still running ``timeouts.request_s`` after it was sent
  fails with an :class:`~smgd.errors.EngineTimeout` and is aborted (the engine serves on);
- the **health prober**: while idle, a probe every ``timeouts.health_interval_s`` (where the
  wire has a probe).
"""

from __future__ import annotations

import logging
import math
from itertools import islice
from typing import TYPE_CHECKING

import trio

from smgd.engines.state import EngineState
from smgd.errors import EngineTimeout

if TYPE_CHECKING:
    from collections.abc import Callable

    from smgd.engines.core import ClientCore
    from smgd.engines.stream import RequestStream
    from smgd.errors import EngineError

log = logging.getLogger("smgd.engine")


async def _sleep_unless_reconfigured(client: ClientCore, seconds: float) -> bool:
    """Sleep ``seconds`` (may be inf); False if the client's ``reconfigure()`` woke us
    earlier."""
    changed = client._reconfigured
    with trio.move_on_after(seconds):
        await changed.wait()
        return False
    return True


async def silence_watchdog(client: ClientCore) -> None:
    """Declare the engine dead after ``timeouts.silence_s`` without a frame while requests
    are in flight, unless it answers a probe (:func:`_lost_not_wedged`)."""
    while True:
        # Check at a fraction of the limit so detection lags the limit by at most 25 %.
        await _sleep_unless_reconfigured(client, client.config.timeouts.silence_s / 4)
        silence = client.config.timeouts.silence_s  # after the sleep: a reload may change it
        now = trio.current_time()
        if client._streams and now - client._silent_since() > silence:
            if await _lost_not_wedged(client, now, silence):
                continue
            client.die(
                f"no output for {silence:g} s with {len(client._streams)} request(s) in flight"
            )
            return
        if not client._streams:
            client._last_frame = trio.current_time()


async def _lost_not_wedged(client: ClientCore, now: float, silence: float) -> bool:
    """No frame for ``silence`` s with requests in flight: if the engine answers a health
    probe, it is alive and lost those requests. Then each request sent ``silence`` s or
    more before ``now`` that had no output meanwhile fails alone (504) and gets an abort,
    and the engine serves on: a relaunch would cost every other client the engine's
    start-up (minutes for a real model) for one lost request. False: no probe on this
    wire, or no answer (wedged)."""
    tokens = {rid: stream.tokens for rid, stream in client._streams.items()}
    if not await client.answers_probe(client.config.timeouts.health_timeout_s):
        return False
    cutoff = now - silence
    silent = [
        stream
        for rid, stream in client._streams.items()
        if stream.sent_at <= cutoff and tokens.get(rid) == stream.tokens
    ]
    _fail_alone(
        client,
        silent,
        lambda: EngineTimeout(
            f"engine {client.name} answers but sent no output for the request in "
            f"{silence:g} s (timeouts.silence_s); it was aborted",
            code="request_timeout",
        ),
        f"silent for timeouts.silence_s = {silence:g} s while the engine answers a probe",
    )
    return True


async def deadline_watchdog(client: ClientCore) -> None:
    """Fail each request still running ``timeouts.request_s`` after it was sent (0: none).

    Sleeps until the oldest request's deadline: ``_streams`` holds the requests in the
    order they were sent, so the expired ones are its first entries and a check costs
    nothing per token or per request beyond the stream's send time.
    """
    while True:
        limit = client.config.timeouts.request_s
        if limit <= 0:
            await _sleep_unless_reconfigured(client, math.inf)
            continue
        now = trio.current_time()
        oldest = next(iter(client._streams.values()), None)
        # None: any request sent from now on expires after now + limit, so look again then.
        wake = now + limit if oldest is None else oldest.sent_at + limit
        if wake > now and not await _sleep_unless_reconfigured(client, wake - now):
            continue  # new settings: start over with the new limit
        _expire(client, client.config.timeouts.request_s, trio.current_time())


def _expire(client: ClientCore, limit: float, now: float) -> None:
    """Fail and abort the requests sent ``limit`` seconds or more before ``now``."""
    if limit <= 0:
        return
    expired: list[RequestStream] = []
    for stream in client._streams.values():
        if stream.sent_at + limit > now:
            break  # sent in order: every later one is younger
        expired.append(stream)
    _fail_alone(
        client,
        expired,
        lambda: EngineTimeout(
            f"engine {client.name} did not finish the request within {limit:g} s "
            "(timeouts.request_s); it was aborted",
            code="request_timeout",
        ),
        f"unfinished after timeouts.request_s = {limit:g} s",
    )


def _fail_alone(
    client: ClientCore,
    streams: list[RequestStream],
    error: Callable[[], EngineError],
    why: str,
) -> None:
    """Fail and abort ``streams`` (:meth:`ClientCore.fail_alone`) and say ``why``."""
    if client.fail_alone(streams, error):
        log.warning(
            "engine %s: %d request(s) %s, aborted: %s",
            client.name,
            len(streams),
            why,
            " ".join(stream.rid for stream in islice(streams, 8)),
        )


async def health_prober(client: ClientCore) -> None:
    """While idle, probe the engine periodically (where the wire has a probe).

    With requests in flight the silence watchdog already proves liveness, so the probe
    only runs when nothing is in flight: that is when a wedged engine would go unnoticed.
    ``health_interval_s = 0`` (no probe) waits for a reload that sets one.
    """
    while True:
        interval = client.config.timeouts.health_interval_s
        if not await _sleep_unless_reconfigured(client, interval if interval > 0 else math.inf):
            continue  # new settings: start over with the new interval
        if not client._streams and client.state is EngineState.READY:
            await client.probe_health(client.config.timeouts.health_timeout_s)
