"""Engine supervision by name, and applying a new ``smgd.toml`` as a diff.

:class:`EngineSet` runs one supervisor task per engine in the daemon's nursery
(:func:`supervise_engine`): it builds the engine's client from the engine's current settings,
runs it, and relaunches it with backoff when it dies. Each supervisor has its own cancel scope
and an event set once it has returned, i.e. once its engine process has exited and its
sockets are closed.

A reload re-reads and validates the whole file, loads every tokenizer it names, runs the
reload hooks' checks and builds (without starting) the client of every engine it would start.
Any error refuses the reload whole: nothing changes and the old config keeps serving. A valid
file is then applied per engine, matched by name:

- **added**: started (launched, if it has ``[engines.launch]``);
- **removed**: out of routing at once; its streams get ``server.drain_timeout_s`` to finish;
  then it is stopped;
- **changed, only in** :data:`IN_PLACE` keys (admission limits, timeouts, served names,
  ``required``, ``chat_template``): the running client takes the new values; nothing is
  interrupted;
- **changed in any other key** (:func:`replace_keys`): the engine is replaced. It takes no new
  request (readiness shows it ``draining``; its models get 503 with Retry-After unless another
  engine serves them), its streams get ``server.drain_timeout_s``, then it is stopped fully
  (launched process exited, sockets closed) before a client with the new settings binds the
  same sockets (and launches the engine again). An attached (external) engine reconnects by
  itself.

A new engine that cannot bind or launch does not take smgd down: the reload reports it under
``failed`` and the supervisor retries it with backoff, as after a crash. Streams on engines the
reload does not touch are never touched. Server settings that need a rebind
(:data:`RESTART_KEYS`) keep their running values and are reported.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import msgspec
import trio

from smgd.config import Config, EngineConfig, diff_engines, load_config
from smgd.engines import build_engine_client
from smgd.engines.base import EngineState
from smgd.errors import SmgdError, TransportError
from smgd.workers import for_worker

if TYPE_CHECKING:
    from smgd.engines.base import EngineClient
    from smgd.gateway import Gateway

log = logging.getLogger("smgd.reload")

# Relaunch backoff for a dead engine: first retry after 1 s, doubling up to 60 s, so a crash
# loop costs little while a transient failure recovers fast. An engine that stayed up for
# BACKOFF_RESET_S is considered healthy again and starts over at the initial delay.
BACKOFF_INITIAL_S = 1.0
BACKOFF_MAX_S = 60.0
BACKOFF_RESET_S = 60.0
# How often a drain re-counts an engine's streams. Counts change on its reader task with no
# event to wait on; 50 ms adds at most that much to a reload that waits for a drain.
DRAIN_POLL_S = 0.05

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

# Keys of an ``[[engines]]`` entry that only smgd reads, so a reload applies them to the
# running engine with no disruption (EngineClient.reconfigure). Any other key is read by the
# engine process or decides its sockets, and a change to it replaces the engine.
IN_PLACE = frozenset(
    {
        "models",
        "required",
        "chat_template",
        "max_inflight",
        "max_queue",
        "queue_timeout_s",
        "timeouts",
    }
)


class ReloadResult(msgspec.Struct, kw_only=True):
    ok: bool
    error: str | None = None
    added: list[str] = msgspec.field(default_factory=list)
    removed: list[str] = msgspec.field(default_factory=list)
    # Every engine whose settings changed; `replaced` are those that needed a new engine.
    changed: list[str] = msgspec.field(default_factory=list)
    replaced: list[str] = msgspec.field(default_factory=list)
    # Engines (added or replaced) that could not bind or launch: name -> why. smgd retries
    # them with backoff; /readiness shows their state and last error.
    failed: dict[str, str] = msgspec.field(default_factory=dict)
    needs_restart: list[str] = msgspec.field(default_factory=list)


def changed_keys(old: EngineConfig, new: EngineConfig) -> list[str]:
    """The keys of an ``[[engines]]`` entry that differ (a table counts as one key)."""
    return [
        f.name
        for f in msgspec.structs.fields(EngineConfig)
        if getattr(old, f.name) != getattr(new, f.name)
    ]


def replace_keys(old: EngineConfig, new: EngineConfig) -> list[str]:
    """The changed keys of an engine that need a new engine (empty: apply in place)."""
    return [key for key in changed_keys(old, new) if key not in IN_PLACE]


@dataclass(eq=False)
class Supervised:
    """One engine under supervision: its settings, its current client, its task's lifetime."""

    config: EngineConfig
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    # Set once the supervisor task has returned: its engine is stopped, its sockets closed.
    stopped: trio.Event = field(default_factory=trio.Event)
    client: EngineClient | None = None
    # Why the engine last failed, kept across relaunches so a crash or handshake loop shows it.
    last_error: str | None = None
    # Being stopped (removed or replaced by a reload): a death now is not relaunched.
    retiring: bool = False


def _innermost(error: BaseException) -> BaseException:
    """What actually failed: the first leaf of a (nested) exception group."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def _describe(error: BaseException) -> str:
    return error.message if isinstance(error, SmgdError) else str(error) or repr(error)


async def supervise_engine(
    gateway: Gateway,
    slot: Supervised,
    *,
    retry_start: bool = False,
    task_status: trio.TaskStatus[str | None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run one engine's client; on death, fail its streams (done by the client) and relaunch.

    ``task_status.started(None)`` once the first client has bound its sockets. If that first
    client cannot bind or launch, this raises :class:`TransportError`, unless ``retry_start``
    (a reload): then it reports ``started(why)`` and retries with backoff like after a crash.
    """
    name = slot.config.name
    backoff = BACKOFF_INITIAL_S
    first = True
    while True:
        client = build_engine_client(slot.config, gateway)
        client.last_error = slot.last_error  # a relaunched engine still says why it was needed
        slot.client = client
        gateway.router.put(client)
        started_at = trio.current_time()
        bound = False
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(client.run)
                bound = True
                if first:
                    task_status.started(None)
                    first = False
            return
        except* SmgdError as group:
            # die() recorded why; anything else (a bind or launch failure) is the group's
            # innermost error: a group nests one level per nursery and says nothing itself.
            if client.state is EngineState.DEAD and client.last_error:
                reason = client.last_error
            else:
                reason = _describe(_innermost(group))
        slot.last_error = client.last_error = reason
        if not bound and first:
            if not retry_start:
                # Died before it was even bound: a startup failure, not something to retry.
                raise TransportError(f"engine {name} failed to start: {reason}")
            task_status.started(reason)
            first = False
        if slot.retiring:
            return  # being stopped anyway: a relaunch would only be cancelled
        restarts = gateway.engine_restarts
        restarts[name] = restarts.get(name, 0) + 1
        log.warning("engine %s failed: %s; restarting in %.1f s", name, reason, backoff)
        if trio.current_time() - started_at > BACKOFF_RESET_S:
            backoff = BACKOFF_INITIAL_S
        await trio.sleep(backoff)
        backoff = min(backoff * 2, BACKOFF_MAX_S)


@dataclass
class EngineSet:
    gateway: Gateway
    nursery: trio.Nursery
    engines: dict[str, Supervised] = field(default_factory=dict)
    lock: trio.Lock = field(default_factory=trio.Lock)

    async def start(self, engine: EngineConfig, *, retry: bool = False) -> str | None:
        """Supervise ``engine`` until :meth:`stop`; return once its sockets are bound.

        A failure to bind or launch raises, or with ``retry`` (a reload) is returned (as the
        reason) while the supervisor retries it with backoff.
        """
        slot = Supervised(engine)
        self.engines[engine.name] = slot
        error: str | None = await self.nursery.start(self._supervise, slot, retry)
        return error

    async def _supervise(
        self, slot: Supervised, retry: bool, *, task_status: trio.TaskStatus[str | None]
    ) -> None:
        try:
            with slot.scope:
                await supervise_engine(
                    self.gateway, slot, retry_start=retry, task_status=task_status
                )
        finally:
            slot.stopped.set()

    async def stop(self, name: str, *, drain_s: float, replacing: bool = False) -> None:
        """Stop ``name``: no new requests, its streams get up to ``drain_s``, then it is
        stopped; returns once its process has exited and its sockets are closed.

        A removed engine leaves routing at once. One being ``replacing`` stays visible as
        ``draining`` so its models answer 503 (not 404) until the new one is up.
        """
        slot = self.engines.pop(name, None)
        if slot is None:
            return
        slot.retiring = True
        client = slot.client
        if client is not None and replacing:
            client.start_draining()
        else:
            self.gateway.router.remove(name)
        if client is not None:
            with trio.move_on_after(drain_s):
                while client.in_flight:  # noqa: ASYNC110 - counts change on the reader task
                    await trio.sleep(DRAIN_POLL_S)
            if client.in_flight:
                log.warning("engine %s: %d stream(s) cut by reload", name, client.in_flight)
        slot.scope.cancel()
        await slot.stopped.wait()
        # A replaced engine stays listed (stopped: 503) until its successor takes its place.
        if not replacing and self.gateway.router.get(name) is slot.client:
            self.gateway.router.remove(name)

    def reconfigure(self, engine: EngineConfig) -> None:
        """Apply an in-place change: the running client and every later relaunch use it."""
        slot = self.engines.get(engine.name)
        if slot is None:
            return
        slot.config = engine
        if slot.client is not None:
            slot.client.reconfigure(engine)

    async def reload(self, path: str | None) -> ReloadResult:
        async with self.lock:
            return await self._reload(path)

    async def _reload(self, path: str | None) -> ReloadResult:
        old = self.gateway.config
        try:
            # A worker (server.workers > 1) applies only its share of the engines.
            loaded = for_worker(load_config(path, overrides=self.gateway.overrides))
            new = _keep_running(loaded, old)
            staged = self.gateway.stage_texts(new)
            appliers = self.gateway.prepare_reload(new)
            added, removed, changed = diff_engines(old, new)
            before = {e.name: e for e in old.engines}
            replaced = [e for e in changed if replace_keys(before[e.name], e)]
            # Build (not start) every client the reload would start: what cannot be built
            # (no context length, an unsupported wire) refuses the whole reload now.
            trial = dataclasses.replace(self.gateway, config=new, texts=staged)
            for engine in [*added, *replaced]:
                build_engine_client(engine, trial)
        except SmgdError as exc:
            text = exc.one_line() if hasattr(exc, "one_line") else exc.message
            log.error("reload rejected, nothing changed: %s", text)
            return ReloadResult(ok=False, error=text)
        restart = [key for key in RESTART_KEYS if _get(old, key) != _get(loaded, key)]
        for key in restart:
            log.warning("reload: %s changed; it takes effect after a restart", key)
        self.gateway.apply_config(new, staged)
        for apply in appliers:
            apply()
        for engine in changed:
            if engine not in replaced:
                keys = ", ".join(changed_keys(before[engine.name], engine))
                log.info("reload: engine %s: %s applied in place", engine.name, keys)
                self.reconfigure(engine)
        for engine in replaced:
            log.info(
                "reload: engine %s changed (%s): draining, then replacing it",
                engine.name,
                ", ".join(replace_keys(before[engine.name], engine)),
            )
        failed: dict[str, str] = {}
        drain_s = new.server.drain_timeout_s
        async with trio.open_nursery() as nursery:
            for engine in removed:
                nursery.start_soon(partial(self.stop, engine.name, drain_s=drain_s))
            for engine in replaced:
                nursery.start_soon(self._replace, engine, drain_s, failed)
            for engine in added:
                nursery.start_soon(self._start_new, engine, failed)
        result = ReloadResult(
            ok=True,
            added=[e.name for e in added],
            removed=[e.name for e in removed],
            changed=[e.name for e in changed],
            replaced=[e.name for e in replaced],
            failed=failed,
            needs_restart=restart,
        )
        log.info(
            "reload applied: added=%s removed=%s changed=%s (replaced=%s)",
            result.added,
            result.removed,
            result.changed,
            result.replaced,
        )
        for name, why in failed.items():
            log.error("reload: engine %s did not start: %s (retrying with backoff)", name, why)
        return result

    async def _replace(self, engine: EngineConfig, drain_s: float, failed: dict[str, str]) -> None:
        await self.stop(engine.name, drain_s=drain_s, replacing=True)
        await self._start_new(engine, failed)

    async def _start_new(self, engine: EngineConfig, failed: dict[str, str]) -> None:
        error = await self.start(engine, retry=True)
        if error is not None:
            failed[engine.name] = error


def _get(config: Config, dotted: str) -> object:
    node: object = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _with(node: object, parts: list[str], value: object) -> object:
    """``node`` (a Struct) with the value at ``parts`` replaced."""
    assert isinstance(node, msgspec.Struct)
    head, rest = parts[0], parts[1:]
    inner = _with(getattr(node, head), rest, value) if rest else value
    return msgspec.structs.replace(node, **{head: inner})


def _keep_running(new: Config, running: Config) -> Config:
    """``new`` with the running values of :data:`RESTART_KEYS` (they need a restart)."""
    for key in RESTART_KEYS:
        replaced = _with(new, key.split("."), _get(running, key))
        assert isinstance(replaced, Config)
        new = replaced
    return new
