"""The LoRA adapters one engine serves, and what its requests are doing with them (sans-IO).

One :class:`LoraTable` per engine client. It holds the adapters by name with the id each
has on that engine (vLLM's ``lora_int_id``: the engine caches an adapter's weights under it,
so a name keeps its id for as long as it is loaded), the start-up ones from ``[engines.lora]``
and those loaded at run time (``POST /v1/load_lora_adapter``), and counts each adapter's
requests waiting in smgd's admission queue and running on the engine, for
``smgd_lora_requests_info`` (:mod:`smgd.engines.lora_metrics`).

Launch flags for ``[engines.lora]`` are :func:`lora_args`.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from smgd.config import resolve_path
from smgd.wire.common import LoraAdapter

if TYPE_CHECKING:
    from collections.abc import Iterator

    from smgd.config import Config, EngineConfig, LoraConfig

__all__ = ["LoraTable", "lora_args", "static_adapters"]


def static_adapters(config: Config, engine: EngineConfig) -> list[LoraAdapter]:
    """The start-up adapters of ``engine``, ids 1, 2, ... in config order."""
    if engine.lora is None:
        return []
    return [
        LoraAdapter(name=name, path=str(resolve_path(config, path)), int_id=i)
        for i, (name, path) in enumerate(engine.lora.adapters.items(), start=1)
    ]


def lora_args(config: Config, engine: EngineConfig) -> list[str]:
    """Engine flags for ``[engines.lora]`` of a launched vLLM or SGLang engine ([] = none).

    vLLM's engine core only learns adapters from requests and ``add_lora`` calls (the client
    adds the start-up ones at readiness); SGLang's scheduler loads ``--lora-paths`` itself.
    """
    lora = engine.lora
    kind = engine.launch.kind if engine.launch is not None else None
    if lora is None or kind not in ("vllm", "sglang"):
        return []
    rank = [] if lora.max_lora_rank is None else ["--max-lora-rank", str(lora.max_lora_rank)]
    if kind == "vllm":
        return ["--enable-lora", "--max-loras", str(lora.max_loras), *rank]
    paths = [f"{a.name}={a.path}" for a in static_adapters(config, engine)]
    return [
        "--enable-lora",
        "--max-loras-per-batch",
        str(lora.max_loras),
        *rank,
        *(["--lora-paths", *paths] if paths else []),
    ]


class LoraTable:
    """Adapters by name, their engine ids, and per-adapter request counts."""

    def __init__(self, config: LoraConfig | None, adapters: list[LoraAdapter]) -> None:
        self.enabled = config is not None
        self.max_loras = config.max_loras if config is not None else 0
        self.runtime_updates = config is not None and config.allow_runtime_updates
        self._adapters = {a.name: a for a in adapters}
        self.loading: set[str] = set()  # names a run-time load is under way for
        self._next_id = max((a.int_id for a in adapters), default=0) + 1
        # Requests per adapter: queued in smgd's admission / sent to the engine.
        self.waiting: Counter[str] = Counter()
        self.running: Counter[str] = Counter()
        # What the engine's ranks last said about their own queues (vLLM's scheduler stats):
        # rank -> (adapters running, adapters waiting).
        self._reported: dict[int, tuple[frozenset[str], frozenset[str]]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def __iter__(self) -> Iterator[LoraAdapter]:
        return iter(self._adapters.values())

    def get(self, name: str) -> LoraAdapter | None:
        return self._adapters.get(name)

    def new(self, name: str, path: str) -> LoraAdapter:
        """The adapter to load as ``name``: a name already loaded keeps its id (a reload in
        place, as vLLM's front end does), a new one takes a fresh id. Not added yet."""
        known = self._adapters.get(name)
        if known is not None:
            return LoraAdapter(name=name, path=path, int_id=known.int_id)
        adapter = LoraAdapter(name=name, path=path, int_id=self._next_id)
        self._next_id += 1
        return adapter

    def add(self, adapter: LoraAdapter) -> None:
        self._adapters[adapter.name] = adapter

    def remove(self, name: str) -> LoraAdapter | None:
        return self._adapters.pop(name, None)

    # ---- which adapters are busy (smgd.engines.lora_metrics)
    def report(self, rank: int, running: list[str], waiting: list[str]) -> None:
        """An engine rank's own account of its queues (vLLM's scheduler stats)."""
        self._reported[rank] = (frozenset(running), frozenset(waiting))

    def busy(self) -> tuple[set[str], set[str]]:
        """(running, waiting): adapters with requests the engine runs, and those with requests
        waiting, in the engine's queue (where it reports its queues) or in smgd's admission.

        A report is a snapshot taken before the engine's last step, so only adapters smgd still
        has requests in flight for count from it; one sent since the last report counts as
        running.
        """
        sent = set(self.running)
        reported_running = {n for run, _ in self._reported.values() for n in run} & sent
        reported_waiting = {n for _, wait in self._reported.values() for n in wait} & sent
        running = reported_running | (sent - reported_waiting)
        return running, reported_waiting | set(self.waiting)

    # ---- request counts (EngineClient.open_stream)
    def begin(self, name: str | None) -> None:
        """A request of adapter ``name`` (None: the base model, not counted) waits in smgd's
        admission until :meth:`sent`; :meth:`end` once it is over, either way."""
        if name is not None:
            self.waiting[name] += 1

    def sent(self, name: str | None) -> None:
        """The request :meth:`begin` counted is in the engine's outbox: running now."""
        if name is not None:
            _drop(self.waiting, name)
            self.running[name] += 1

    def end(self, name: str | None, *, sent: bool) -> None:
        if name is not None:
            _drop(self.running if sent else self.waiting, name)


def _drop(counts: Counter[str], name: str) -> None:
    counts[name] -= 1
    if counts[name] <= 0:
        del counts[name]
