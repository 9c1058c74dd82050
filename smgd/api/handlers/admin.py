"""The admin listener's routes: reload, drain, engine state. Never on the public listener.

- ``POST /admin/reload``: re-read the config and apply it as a diff (200, or 400 with the
  reasons it was refused).
- ``POST /admin/drain``: start the drain (as SIGTERM does).
- ``GET /admin/engines``: drain state, uptime, reload counts and every engine's statistics.

Reloading and draining are the daemon's: the app is built with the two functions
(:func:`smgd.api.http.app.create_admin_app`), and each route gets its own as its first
argument. Where the listener is and who may reach it: :mod:`smgd.api.http.server`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from smgd.api.core.prepare import Reply, json_reply

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from smgd.api.core.prepare import Call
    from smgd.reload import ReloadResult

__all__ = ["drain", "engines", "reload"]


async def reload(run: Callable[[], Awaitable[ReloadResult]], call: Call) -> Reply:
    """``POST /admin/reload``."""
    result = await run()
    return json_reply(result, 200 if result.ok else 400)


async def drain(start: Callable[[], None], call: Call) -> Reply:
    """``POST /admin/drain``."""
    start()
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
