"""What a new ``smgd.toml`` changes in a running daemon: the reload plan (pure, sans-IO).

:func:`plan` compares the running config with a freshly loaded, valid one and says what a
reload does, engine by engine, matched by name:

- **added**: started (launched, if it has ``[engines.launch]``);
- **removed**: out of routing at once; its streams get ``server.drain_timeout_s`` to finish;
  then it is stopped;
- **changed, only in** :data:`IN_PLACE` keys (admission limits, timeouts, served names,
  ``required``, ``chat_template``): the running client takes the new values; nothing is
  interrupted;
- **changed in any other key** (:func:`replace_keys`): **replaced**. It takes no new request
  (readiness shows it ``draining``; its models get 503 with Retry-After unless another engine
  serves them), its streams get ``server.drain_timeout_s``, then it is stopped fully (launched
  process exited, sockets closed) before a client with the new settings binds the same
  sockets (and launches the engine again). An attached (external) engine reconnects by itself.

Server settings that need a rebind (:data:`RESTART_KEYS`) keep their running values in the
plan's config and are reported. Carrying the plan out (reading the file, validating it
whole, draining, stopping and starting engines) is :class:`smgd.supervise.EngineSet`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from smgd.config import Config, EngineConfig, diff_engines

__all__ = [
    "IN_PLACE",
    "RESTART_KEYS",
    "Plan",
    "ReloadResult",
    "changed_keys",
    "keep_running",
    "plan",
    "replace_keys",
]

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


@dataclass(frozen=True)
class Plan:
    """What applying a loaded config to the running one does (see the module docstring)."""

    config: Config  # the config to run: the file's, with the running RESTART_KEYS values
    before: dict[str, EngineConfig]  # the running engines' settings, by name
    added: list[EngineConfig]
    removed: list[EngineConfig]
    changed: list[EngineConfig]  # every engine whose settings changed
    replaced: list[EngineConfig]  # those of `changed` that need a new engine
    needs_restart: list[str]  # RESTART_KEYS the file changed (they keep their running value)

    @property
    def in_place(self) -> list[EngineConfig]:
        replaced = {e.name for e in self.replaced}
        return [e for e in self.changed if e.name not in replaced]

    @property
    def starts(self) -> list[EngineConfig]:
        """Every engine the plan starts a new client for."""
        return [*self.added, *self.replaced]


def plan(running: Config, loaded: Config) -> Plan:
    """The plan that takes ``running`` to ``loaded`` (a valid config, this worker's share)."""
    new = keep_running(loaded, running)
    added, removed, changed = diff_engines(running, new)
    before = {e.name: e for e in running.engines}
    return Plan(
        config=new,
        before=before,
        added=added,
        removed=removed,
        changed=changed,
        replaced=[e for e in changed if replace_keys(before[e.name], e)],
        needs_restart=[key for key in RESTART_KEYS if _get(running, key) != _get(loaded, key)],
    )


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


def keep_running(new: Config, running: Config) -> Config:
    """``new`` with the running values of :data:`RESTART_KEYS` (they need a restart)."""
    for key in RESTART_KEYS:
        replaced = _with(new, key.split("."), _get(running, key))
        assert isinstance(replaced, Config)
        new = replaced
    return new


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
