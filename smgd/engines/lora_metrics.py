"""``smgd_lora_requests_info``: which LoRA adapters are busy, for LoRA-aware load balancers.

The Gateway API Inference Extension's model-server protocol (proposal 003, "LoRA Adapter
Serving") scrapes this gauge with the semantics of vLLM's ``vllm:lora_requests_info`` (the
endpoint picker is told smgd's name: docs/reference/metrics.md): the value is when it was last
updated (Unix seconds; the picker takes the newest series), the labels

- ``max_lora``: how many adapters one batch may hold (``[engines.lora] max_loras``; summed
  over the engines with LoRA, since each runs its own batches);
- ``running_lora_adapters``: the adapters with requests an engine runs, comma-separated;
- ``waiting_lora_adapters``: the adapters with requests waiting, comma-separated: in the
  engine's own queue (vLLM reports its queues per adapter in its scheduler stats; other
  engines' queued requests count as running) or in smgd's admission queue.

One series per scrape, only while some engine has ``[engines.lora]`` (vLLM, too, has none
without LoRA).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

    from smgd.engines.base import EngineClient

__all__ = ["LORA_INFO", "LoraInfoCollector"]

LORA_INFO = "smgd_lora_requests_info"


class LoraInfoCollector:
    """A prometheus_client collector over the engines ``engines()`` returns at scrape time."""

    def __init__(
        self, engines: Callable[[], Iterable[EngineClient]], clock: Callable[[], float] = time.time
    ) -> None:
        self._engines = engines
        self._clock = clock

    def collect(self) -> Iterator[GaugeMetricFamily]:
        tables = [e.lora for e in self._engines() if e.lora.enabled]
        if not tables:
            return
        family = GaugeMetricFamily(
            LORA_INFO,
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        busy = [t.busy() for t in tables]
        running = sorted({name for run, _ in busy for name in run})
        waiting = sorted({name for _, wait in busy for name in wait})
        max_lora = sum(t.max_loras for t in tables)
        family.add_metric([str(max_lora), ",".join(waiting), ",".join(running)], self._clock())
        yield family

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # nothing fixed: the family exists only while an engine has LoRA
