"""Model name → engines, and the policy that picks one engine per request.

Policies (per model in ``[routing]``): ``round_robin``; ``least_outstanding`` (fewest in-flight
requests, ties broken by the engine's own reported waiting queue); ``prefix_affinity`` (a hash
of the first ``prefix_tokens`` prompt tokens picks a home engine so the engine's prefix cache
hits, unless that engine is overloaded compared with the least loaded one).

A model name may also name a LoRA adapter an engine serves (:attr:`EngineClient.lora`), by
its own name or as ``base:adapter``: such a request goes to the engines of the base model
that hold the adapter (:meth:`Router.adapter_of`).
"""

from __future__ import annotations

import hashlib
import itertools
from typing import TYPE_CHECKING

from smgd.config import RoutingConfig, RoutingPolicy
from smgd.errors import EngineNotReady, ModelNotFound

if TYPE_CHECKING:
    from collections.abc import Sequence

    from smgd.engines.base import EngineClient

# prefix_affinity leaves the home engine when it has this many more in-flight requests than the
# least loaded ready engine: a cache hit saves one prefill, a queue of 32 costs far more.
AFFINITY_OVERLOAD_MARGIN = 32


class Router:
    def __init__(self, routing: RoutingConfig) -> None:
        self.routing = routing
        self._engines: dict[str, EngineClient] = {}
        self._counter = itertools.count()

    # ---- membership (smgd.supervise puts and removes engines as they start, die, reload)
    def put(self, engine: EngineClient) -> None:
        self._engines[engine.name] = engine

    def remove(self, name: str) -> None:
        self._engines.pop(name, None)

    def engines(self) -> list[EngineClient]:
        return list(self._engines.values())

    def get(self, name: str) -> EngineClient | None:
        return self._engines.get(name)

    def models(self) -> dict[str, list[EngineClient]]:
        table: dict[str, list[EngineClient]] = {}
        for engine in self._engines.values():
            for model in engine.models:
                table.setdefault(model, []).append(engine)
        return table

    def policy_for(self, model: str) -> RoutingPolicy:
        return self.routing.models.get(model, self.routing.policy)

    def adapter_of(self, model: str) -> tuple[str, str] | None:
        """(base model, adapter) when ``model`` names a LoRA adapter rather than a served
        model: the adapter's own name, or ``base:adapter``; None otherwise."""
        engines = self._engines.values()
        for engine in engines:  # a loop, not any() over a generator: every request asks
            if model in engine.models:
                return None
        for engine in engines:
            if model in engine.lora:
                return engine.models[0], model
        base, sep, adapter = model.rpartition(":")
        if sep:
            for engine in engines:
                if base in engine.models and adapter in engine.lora:
                    return base, adapter
        return None

    def candidates(self, model: str) -> list[EngineClient]:
        engines = [e for e in self._engines.values() if _serves(e, model)]
        if not engines:
            raise ModelNotFound(
                f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )
        ready = [e for e in engines if e.ready]
        if not ready:
            states = ", ".join(f"{e.name}: {e.state_name}" for e in engines)
            raise EngineNotReady(f"no ready engine for model `{model}` ({states})")
        return ready

    def pick(
        self, model: str, prompt_ids: Sequence[int] = (), *, exclude: Sequence[str] = ()
    ) -> EngineClient:
        ready = [e for e in self.candidates(model) if e.name not in exclude]
        if not ready:
            raise EngineNotReady(f"no other ready engine for model `{model}`")
        if len(ready) == 1:
            return ready[0]
        policy = self.policy_for(model)
        if policy is RoutingPolicy.ROUND_ROBIN:
            return ready[next(self._counter) % len(ready)]
        least = min(ready, key=_load_key)
        if policy is RoutingPolicy.PREFIX_AFFINITY and prompt_ids:
            home = _home(ready, prompt_ids[: self.routing.prefix_tokens])
            if home.in_flight - least.in_flight < AFFINITY_OVERLOAD_MARGIN:
                return home
        return least


def _serves(engine: EngineClient, model: str) -> bool:
    """Whether ``engine`` runs requests for ``model``: a name it serves, an adapter it holds,
    or ``base:adapter`` of both."""
    if model in engine.models or model in engine.lora:
        return True
    base, sep, adapter = model.rpartition(":")
    return bool(sep) and base in engine.models and adapter in engine.lora


def _load_key(engine: EngineClient) -> tuple[int, int, str]:
    waiting = engine.load.waiting if engine.load is not None else 0
    return (engine.in_flight, waiting, engine.name)


def _home(engines: list[EngineClient], prefix: Sequence[int]) -> EngineClient:
    """Rendezvous hashing: stable per prefix, moves few keys when engines come and go."""
    key = ",".join(map(str, prefix)).encode()

    def score(engine: EngineClient) -> bytes:
        return hashlib.blake2b(key + b"|" + engine.name.encode(), digest_size=8).digest()

    return max(engines, key=score)
