"""The admin listener's routes: reload, drain, engine state. Never on the public listener.

- ``POST /admin/reload``: re-read the config and apply it as a diff (200, or 400 with the
  reasons it was refused); 503 when this process cannot reload (no daemon behind the gateway).
- ``POST /admin/drain``: start the drain (as SIGTERM does).
- ``GET /admin/engines``: drain state, uptime, reload counts and every engine's statistics.

Where the listener is and who may reach it: :mod:`smgd.api.http.server` (``serve_admin``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from smgd.api.core.errors import http_error
from smgd.api.core.prepare import JSON_HEADERS, Reply, json_reply

if TYPE_CHECKING:
    from smgd.api.core.prepare import Call

__all__ = ["drain", "engines", "reload"]


async def reload(call: Call) -> Reply:
    """``POST /admin/reload``."""
    gateway = call.ctx.gateway
    if gateway.reload is None:
        return Reply(http_error(503, "reload is not available"), JSON_HEADERS, 503)
    result = await gateway.reload()
    return json_reply(result, 200 if result.ok else 400)


async def drain(call: Call) -> Reply:
    """``POST /admin/drain``."""
    gateway = call.ctx.gateway
    gateway.draining = True
    gateway.drain_event.set()
    return json_reply({"draining": True})


async def engines(call: Call) -> Reply:
    """``GET /admin/engines``."""
    gateway = call.ctx.gateway
    return json_reply(
        {
            "draining": gateway.draining,
            "uptime_s": trio.current_time() - gateway.started_at,
            "reloads_total": gateway.reloads_total,
            "reload_failures_total": gateway.reload_failures_total,
            "engines": [engine.statistics() for engine in gateway.router.engines()],
        }
    )
