"""Engine supervision: build each engine's client, run it, relaunch it, apply a reload.

One engine's life, in the order this module runs it:

1. :meth:`EngineSet.start` gives the engine a :class:`Supervised` slot (its settings, a cancel
   scope, an event set once it has stopped) and starts :func:`supervise_engine` for it in the
   daemon's nursery.
2. :func:`supervise_engine` builds the client from the slot's current settings
   (:func:`build_engine_client`: the wire's client class, the launch command, the context
   length to fall back on), puts it in the router and runs it. When it dies, its streams are
   failed (by the client) and it is built and run again, with backoff.
3. :meth:`EngineSet.reload` re-reads ``smgd.toml`` (this worker's share of it), validates the
   whole of it (every tokenizer it names loads, every reload hook accepts it, every client it
   would start can be built) and carries out its :func:`smgd.reload.plan`: added engines start,
   removed ones leave routing and stop after a drain, changed ones take the new settings in
   place (:meth:`EngineSet.reconfigure`) or are stopped and started again
   (:meth:`EngineSet.stop` with ``replacing``). Any validation error refuses the reload whole:
   nothing changes and the old config keeps serving.

A new engine that cannot bind or launch does not take smgd down: the reload reports it under
``failed`` and its supervisor retries it with backoff, as after a crash. At start-up the same
failure is an error (smgd exits naming it). Streams on engines a reload does not touch are
never touched.

This module writes the gateway's engine state (see :class:`smgd.gateway.Gateway`): the config
and texts (on a reload), the router's engines, ``engine_restarts`` and the reload counters.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import trio

from smgd.config import Config, EngineConfig, WireFamily, engine_ipc_dir, load_config
from smgd.engines import grammar_args, launch_flags, scheduling_args
from smgd.engines.lora import lora_args, static_adapters
from smgd.engines.sglang import SglangEngineClient
from smgd.engines.state import EngineState
from smgd.engines.tokenspeed import DEFAULT_HANDSHAKE, TokenspeedEngineClient, tokenspeed_argv
from smgd.engines.vllm import VllmEngineClient, vllm_argv
from smgd.errors import ConfigError, SmgdError, TransportError
from smgd.launch import launcher_script, mock_argv, mock_script_args
from smgd.reload import Plan, ReloadResult, changed_keys, plan, replace_keys
from smgd.sdnotify import notify
from smgd.wire.common import EngineInfo
from smgd.worker_id import for_worker

if TYPE_CHECKING:
    from collections.abc import Mapping

    from smgd.engines.base import EngineClient
    from smgd.gateway import Gateway, ModelText

__all__ = [
    "EngineSet",
    "Supervised",
    "build_engine_client",
    "fallback_info",
    "supervise_engine",
]

log = logging.getLogger("smgd.supervise")

# Relaunch backoff for a dead engine: first retry after 1 s, doubling up to 60 s, so a crash
# loop costs little while a transient failure recovers fast. An engine that stayed up for
# BACKOFF_RESET_S is considered healthy again and starts over at the initial delay.
BACKOFF_INITIAL_S = 1.0
BACKOFF_MAX_S = 60.0
BACKOFF_RESET_S = 60.0
# How often a drain re-counts an engine's streams. Counts change on its reader task with no
# event to wait on; 50 ms adds at most that much to a reload that waits for a drain.
DRAIN_POLL_S = 0.05


# --------------------------------------------------------------------------- building a client


def fallback_info(engine: EngineConfig, config: Config, text: ModelText) -> EngineInfo:
    """Context length and vocab when the engine does not report them (never 0)."""
    max_len = engine.max_model_len or text.max_model_len
    if engine.wire is WireFamily.MOCK:
        max_len = engine.max_model_len or engine.mock.max_model_len
    if not max_len:
        raise ConfigError(
            "no context length: the model's config.json has no max_position_embeddings",
            path=f"$.engines[{config.engines.index(engine)}].max_model_len",
            hint="set max_model_len for this engine",
        )
    return EngineInfo(max_model_len=max_len, vocab_size=text.vocab_size)


def build_engine_client(
    engine: EngineConfig, config: Config, texts: Mapping[str, ModelText]
) -> EngineClient:
    """The client for ``engine`` as ``config`` runs it (built, not started).

    ``texts`` are the config's text pipelines by served model name. Raises ConfigError for
    what cannot run (no context length, an unsupported wire).
    """
    ipc_dir = engine_ipc_dir(config, engine)
    text = texts[engine.models[0]]
    fallback = fallback_info(engine, config, text)
    wire = engine.mock.wire if engine.wire is WireFamily.MOCK else engine.wire.value
    input_path = str(ipc_dir / "in.sock")
    output_path = str(ipc_dir / "out.sock")
    argv: list[str] | None = None
    env: dict[str, str] | None = None
    launch = engine.launch
    if engine.wire is WireFamily.MOCK or (launch is not None and launch.kind == "mock"):
        extra = [
            "--step-ms",
            str(engine.mock.step_ms),
            "--max-batch",
            str(engine.mock.max_batch),
            "--context-len",
            str(fallback.max_model_len),
            "--eos-token-ids",
            ",".join(map(str, text.tokenizer.eos_token_ids)),
            "--skip-ids",
            ",".join(map(str, sorted(text.tokenizer.special_ids))),
            *mock_script_args(engine, config),
            *scheduling_args(engine),
            *(launch.args if launch else []),
        ]
        argv = mock_argv(wire, f"ipc://{input_path}", f"ipc://{output_path}", extra)
        if wire in ("vllm", "tokenspeed"):
            argv += ["--handshake", "{handshake}"]  # filled in once the client has bound it
    elif launch is not None:
        env = dict(launch.env)
        if launch.kind == "command":
            argv = list(launch.command)
        elif launch.kind == "sglang":
            argv = [
                launch.python or "python3",
                launcher_script("sglang_scheduler.py"),
                "--smgd-input",
                f"ipc://{input_path}",
                "--smgd-output",
                f"ipc://{output_path}",
                "--model-path",
                str(text.model_dir),
                *launch_flags(engine),
                *lora_args(config, engine),
                *launch.args,
            ]
        elif launch.kind == "tokenspeed":
            argv = tokenspeed_argv(
                python=launch.python or "python3",
                model=str(text.model_dir),
                args=[*grammar_args(engine), *launch.args],
            )
        elif launch.kind == "vllm":
            argv = vllm_argv(
                python=launch.python or "python3",
                launcher=launcher_script("vllm_engine.py"),
                model=str(text.model_dir),
                args=[*launch_flags(engine), *lora_args(config, engine), *launch.args],
            )
    if wire == "vllm":
        return VllmEngineClient(
            engine,
            fallback_info=fallback,
            adapters=static_adapters(config, engine),
            input_path=input_path,
            output_path=output_path,
            handshake=engine.addresses.handshake or f"ipc://{ipc_dir / 'hs.sock'}",
            launch_argv=argv,
            launch_env=env,
            eos_token_ids=tuple(text.tokenizer.eos_token_ids),
        )
    if wire == "tokenspeed":
        # A launched engine is told where to dial (any free port); an external one dials
        # TokenSpeed's default unless the config names the address.
        handshake = engine.addresses.handshake or (
            "tcp://127.0.0.1:*" if argv is not None else DEFAULT_HANDSHAKE
        )
        return TokenspeedEngineClient(
            engine,
            fallback_info=fallback,
            input_path=input_path,
            output_path=output_path,
            handshake=handshake,
            launch_argv=argv,
            launch_env=env,
        )
    if wire == "sglang":
        return SglangEngineClient(
            engine,
            fallback_info=fallback,
            adapters=static_adapters(config, engine),
            input_path=input_path,
            output_path=output_path,
            launch_argv=argv,
            launch_env=env,
        )
    raise ConfigError(
        f"wire {wire!r} is not supported yet",
        path=f"$.engines[{config.engines.index(engine)}].wire",
    )


# --------------------------------------------------------------------------- one engine


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
        client = build_engine_client(slot.config, gateway.config, gateway.texts)
        client.last_error = slot.last_error  # a relaunched engine still says why it was needed
        slot.client = client
        gateway.router.put(client)
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
        except* Exception as group:
            # A bug in the engine's client, on something from the engine nobody foresaw: this
            # engine failed, not the daemon (raised on, it ended every engine and the HTTP
            # server). Relaunched like any failure, with the traceback in the log.
            error = _innermost(group)
            log.error("engine %s: unexpected error in its client", name, exc_info=error)
            reason = f"unexpected error in smgd's engine client: {error!r}"
        slot.last_error = client.last_error = reason
        if not bound and first:
            if not retry_start:
                # Died before it was even bound: a startup failure, not something to retry.
                raise TransportError(f"engine {name} failed to start: {reason}")
            task_status.started(reason)
            first = False
        if slot.retiring:
            return  # being stopped anyway: a relaunch would only be cancelled
        gateway.engine_restarts[name] = gateway.engine_restarts.get(name, 0) + 1
        # Healthy for BACKOFF_RESET_S: counted from readiness, not launch (a long load is no
        # health), and before the delay is logged, so the log says the delay slept.
        ready_at = client.ready_at
        if ready_at is not None and trio.current_time() - ready_at > BACKOFF_RESET_S:
            backoff = BACKOFF_INITIAL_S
        log.warning("engine %s failed: %s; restarting in %.1f s", name, reason, backoff)
        await trio.sleep(backoff)
        backoff = min(backoff * 2, BACKOFF_MAX_S)


# --------------------------------------------------------------------------- every engine


@dataclass
class EngineSet:
    """Every engine of this daemon (or worker), by name, each under its own supervisor."""

    gateway: Gateway
    nursery: trio.Nursery  # the daemon's: every supervisor task runs in it
    # How the daemon was started, so a reload re-reads the same file with the same overrides.
    config_path: str | None = None
    overrides: list[str] = field(default_factory=list)
    engines: dict[str, Supervised] = field(default_factory=dict)
    # Held while engines start and while a reload runs: one change at a time.
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

    async def reload(self) -> ReloadResult:
        """Re-read smgd.toml and apply it (SIGHUP, POST /admin/reload, `smgd reload`)."""
        notify("RELOADING=1")
        try:
            async with self.lock:  # after the start-up, and one reload at a time
                result = await self._reload()
        finally:
            notify("READY=1")
        self.gateway.reloads_total += 1
        if not result.ok:
            self.gateway.reload_failures_total += 1
        return result

    async def _reload(self) -> ReloadResult:
        gateway = self.gateway
        if gateway.draining:
            # Shutting down: an engine it added would be launched only to be stopped, and one
            # it replaced would cut the drain of the streams it still has.
            log.error("reload rejected, nothing changed: smgd is draining (shutting down)")
            return ReloadResult(ok=False, error="smgd is draining (shutting down)")
        try:
            # A worker (server.workers > 1) applies only its share of the engines.
            loaded = for_worker(load_config(self.config_path, overrides=self.overrides))
            todo = plan(gateway.config, loaded)
            staged = gateway.stage_texts(todo.config)
            appliers = gateway.prepare_reload(todo.config)
            # Build (not start) every client the reload would start: what cannot be built
            # (no context length, an unsupported wire) refuses the whole reload now.
            for engine in todo.starts:
                build_engine_client(engine, todo.config, staged)
        except SmgdError as exc:
            text = exc.one_line() if isinstance(exc, ConfigError) else exc.message
            log.error("reload rejected, nothing changed: %s", text)
            return ReloadResult(ok=False, error=text)
        except Exception as exc:  # never trio.Cancelled (a BaseException): that one propagates
            # A bug in reading or checking the new config must not take the serving daemon
            # (and every stream in it) down: nothing was applied yet, so refusing is safe.
            log.exception("reload rejected, nothing changed: internal error")
            return ReloadResult(ok=False, error=f"internal error: {type(exc).__name__}: {exc}")
        for key in todo.needs_restart:
            log.warning("reload: %s changed; it takes effect after a restart", key)
        gateway.apply_config(todo.config, staged)
        for apply in appliers:
            apply()
        for engine in todo.in_place:
            keys = ", ".join(changed_keys(todo.before[engine.name], engine))
            log.info("reload: engine %s: %s applied in place", engine.name, keys)
            self.reconfigure(engine)
        for engine in todo.replaced:
            log.info(
                "reload: engine %s changed (%s): draining, then replacing it",
                engine.name,
                ", ".join(replace_keys(todo.before[engine.name], engine)),
            )
        failed = await self._apply(todo)
        result = ReloadResult(
            ok=True,
            added=[e.name for e in todo.added],
            removed=[e.name for e in todo.removed],
            changed=[e.name for e in todo.changed],
            replaced=[e.name for e in todo.replaced],
            failed=failed,
            needs_restart=todo.needs_restart,
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

    async def _apply(self, todo: Plan) -> dict[str, str]:
        """Stop, replace and start engines as planned, all at once; {name: why} of the new
        engines that did not start (their supervisors retry them)."""
        failed: dict[str, str] = {}
        drain_s = todo.config.server.drain_timeout_s
        async with trio.open_nursery() as nursery:
            for engine in todo.removed:
                nursery.start_soon(partial(self.stop, engine.name, drain_s=drain_s))
            for engine in todo.replaced:
                nursery.start_soon(self._replace, engine, drain_s, failed)
            for engine in todo.added:
                nursery.start_soon(self._start_new, engine, failed)
        return failed

    async def _replace(self, engine: EngineConfig, drain_s: float, failed: dict[str, str]) -> None:
        await self.stop(engine.name, drain_s=drain_s, replacing=True)
        await self._start_new(engine, failed)

    async def _start_new(self, engine: EngineConfig, failed: dict[str, str]) -> None:
        error = await self.start(engine, retry=True)
        if error is not None:
            failed[engine.name] = error
