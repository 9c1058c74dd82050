"""Routing policies over fake engines (only the attributes the router reads)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from smgd.config import RoutingConfig, RoutingPolicy
from smgd.engines.base import EngineClient
from smgd.engines.lora import LoraTable
from smgd.engines.state import EngineState
from smgd.errors import EngineNotReady, ModelNotFound
from smgd.router import AFFINITY_OVERLOAD_MARGIN, Router


@dataclass
class Fake:
    name: str
    models: tuple[str, ...] = ("m",)
    in_flight: int = 0
    state: EngineState = EngineState.READY
    load: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    lora: LoraTable = field(default_factory=lambda: LoraTable(None, []))  # no adapters

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def state_name(self) -> str:
        return self.state.value


def router(policy: RoutingPolicy, *engines: Fake) -> Router:
    r = Router(RoutingConfig(policy=policy, prefix_tokens=8))
    for e in engines:
        r.put(cast(EngineClient, e))
    return r


def test_unknown_model_is_404_class() -> None:
    with pytest.raises(ModelNotFound):
        router(RoutingPolicy.ROUND_ROBIN, Fake("a")).pick("other")


def test_no_ready_engine_is_503_class_with_states() -> None:
    with pytest.raises(EngineNotReady, match="a: starting"):
        router(RoutingPolicy.ROUND_ROBIN, Fake("a", state=EngineState.STARTING)).pick("m")


def test_round_robin_alternates() -> None:
    r = router(RoutingPolicy.ROUND_ROBIN, Fake("a"), Fake("b"))
    assert Counter(r.pick("m").name for _ in range(10)) == {"a": 5, "b": 5}


def test_least_outstanding_picks_least_busy_ready() -> None:
    r = router(
        RoutingPolicy.LEAST_OUTSTANDING,
        Fake("a", in_flight=3),
        Fake("b", in_flight=1),
        Fake("c", state=EngineState.DEAD),
    )
    assert r.pick("m").name == "b"
    assert r.pick("m", exclude=["b"]).name == "a"


def test_prefix_affinity_sticks_unless_overloaded() -> None:
    engines = [Fake(n) for n in "abcd"]
    r = router(RoutingPolicy.PREFIX_AFFINITY, *engines)
    prefix = list(range(100, 108))
    homes = {r.pick("m", [*prefix, i]).name for i in range(100)}
    assert len(homes) == 1
    home = next(e for e in engines if e.name in homes)
    home.in_flight = AFFINITY_OVERLOAD_MARGIN
    assert r.pick("m", prefix).name != home.name


def test_prefix_affinity_spreads_different_prefixes() -> None:
    r = router(RoutingPolicy.PREFIX_AFFINITY, *(Fake(n) for n in "abcd"))
    homes = Counter(r.pick("m", [i] * 8).name for i in range(200))
    assert len(homes) == 4


def test_prefix_affinity_100_requests_sharing_a_1k_prefix_go_to_one_of_four() -> None:
    engines = [Fake(n) for n in ("e0", "e1", "e2", "e3")]
    r = Router(RoutingConfig(policy=RoutingPolicy.PREFIX_AFFINITY))  # default prefix_tokens
    for e in engines:
        r.put(cast(EngineClient, e))
    shared = [(i * 7919) % 1000 + 10 for i in range(1024)]
    picks: Counter[str] = Counter()
    for i in range(100):
        engine = cast(Fake, r.pick("m", [*shared, 5000 + i, 6000 + i]))
        picks[engine.name] += 1
        # Load allows: the home engine carries a few requests more than the others, well under
        # the overload margin (requests finish as new ones come).
        engine.in_flight = 1 + i % 8
    assert len(picks) == 1, picks
    assert picks.most_common(1)[0][1] == 100
