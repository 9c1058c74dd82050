"""Engine supervision by name, and applying a new ``smgd.toml`` as a diff.

:class:`EngineSet` owns one cancel scope per engine (inside the daemon's nursery). A reload
re-reads and validates the file first; an invalid file changes nothing. A valid one is applied:
engines added are started; removed ones leave the router at once (no new requests), their
in-flight streams get up to ``server.drain_timeout_s`` to finish, then they are stopped;
changed ones are stopped the same way and started again with the new settings. Streams on
untouched engines are never touched. Server settings that need a rebind are reported, not applied.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import msgspec
import trio

from smgd.config import Config, EngineConfig, diff_engines, load_config
from smgd.errors import SmgdError
from smgd.workers import for_worker

if TYPE_CHECKING:
    from smgd.gateway import Gateway

log = logging.getLogger("smgd.reload")

# Keys whose change only takes effect after a restart (they are bound sockets / listeners).
RESTART_KEYS = (
    "server.host",
    "server.port",
    "server.workers",
    "admin.host",
    "admin.port",
    "admin.token_env",
    "logging.format",
    "logging.access_log",
    "run_dir",
)


class ReloadResult(msgspec.Struct, kw_only=True):
    ok: bool
    error: str | None = None
    added: list[str] = msgspec.field(default_factory=list)
    removed: list[str] = msgspec.field(default_factory=list)
    changed: list[str] = msgspec.field(default_factory=list)
    needs_restart: list[str] = msgspec.field(default_factory=list)


@dataclass
class EngineSet:
    gateway: Gateway
    nursery: trio.Nursery
    scopes: dict[str, trio.CancelScope] = field(default_factory=dict)
    lock: trio.Lock = field(default_factory=trio.Lock)

    async def start(self, engine: EngineConfig, *, tolerate_failure: bool = False) -> None:
        """Supervise ``engine`` until :meth:`stop`. A startup failure raises unless tolerated."""
        from smgd.daemon import supervise_engine

        scope = trio.CancelScope()
        self.scopes[engine.name] = scope

        async def runner(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            started = False

            def mark_started(_: object = None) -> None:
                nonlocal started
                started = True
                task_status.started()

            status = _Status(mark_started)
            try:
                with scope:
                    await supervise_engine(self.gateway, engine, task_status=status)
            except SmgdError as exc:
                if not tolerate_failure:
                    raise
                log.error("engine %s failed to start: %s", engine.name, exc.message)
                if self.scopes.get(engine.name) is scope:
                    del self.scopes[engine.name]
                self.gateway.router.remove(engine.name)
            finally:
                if not started:
                    task_status.started()

        await self.nursery.start(runner)

    async def stop(self, name: str, *, drain_s: float) -> None:
        """Take ``name`` out of routing, let its streams finish (up to ``drain_s``), stop it."""
        client = self.gateway.router.get(name)
        self.gateway.router.remove(name)
        scope = self.scopes.pop(name, None)
        if client is not None:
            with trio.move_on_after(drain_s):
                while client.in_flight:  # noqa: ASYNC110 - counts change on the reader task
                    await trio.sleep(0.05)
            if client.in_flight:
                log.warning("engine %s: %d stream(s) cut by reload", name, client.in_flight)
        if scope is not None:
            scope.cancel()

    async def reload(self, path: str | None) -> ReloadResult:
        async with self.lock:
            return await self._reload(path)

    async def _reload(self, path: str | None) -> ReloadResult:
        old = self.gateway.config
        try:
            # A worker (server.workers > 1) applies only its share of the engines.
            new = for_worker(load_config(path, overrides=self.gateway.overrides))
            staged = self.gateway.stage_texts(new)
            appliers = self.gateway.prepare_reload(new)
        except SmgdError as exc:
            text = exc.one_line() if hasattr(exc, "one_line") else exc.message
            log.error("reload rejected, nothing changed: %s", text)
            return ReloadResult(ok=False, error=text)
        added, removed, changed = diff_engines(old, new)
        restart = [key for key in RESTART_KEYS if _get(old, key) != _get(new, key)]
        for key in restart:
            log.warning("reload: %s changed; it takes effect after a restart", key)
        self.gateway.apply_config(new, staged)
        for apply in appliers:
            apply()
        drain_s = new.server.drain_timeout_s
        async with trio.open_nursery() as nursery:
            for engine in [*removed, *changed]:
                nursery.start_soon(partial(self.stop, engine.name, drain_s=drain_s))
        for engine in [*changed, *added]:
            await self.start(engine, tolerate_failure=True)
        result = ReloadResult(
            ok=True,
            added=[e.name for e in added],
            removed=[e.name for e in removed],
            changed=[e.name for e in changed],
            needs_restart=restart,
        )
        log.info(
            "reload applied: added=%s removed=%s changed=%s",
            result.added,
            result.removed,
            result.changed,
        )
        return result


class _Status:
    """A task_status that also tells the runner when the engine was bound."""

    def __init__(self, callback: object) -> None:
        self._callback = callback

    def started(self, value: object = None) -> None:
        assert callable(self._callback)
        self._callback(value)


def _get(config: Config, dotted: str) -> object:
    node: object = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node
