"""The Gateway API Inference Extension's model-server protocol, on the real daemon.

docs/proposals/003-model-server-protocol (kubernetes-sigs/gateway-api-inference-extension):
OpenAI completions and chat, and three Prometheus gauges an endpoint picker reads (names may
differ, types and meanings may not): the requests queued, the requests running, the KV-cache
utilisation (a fraction, as vLLM's ``kv_cache_usage_perc``). smgd's names are in
docs/reference/metrics.md, with the picker flags that point at them.

Each wire's mock runs 4 requests at once with slow steps; 12 streams make 8 wait. vLLM's mock
reports its scheduler's counts (as vLLM does); SGLang's sends none, and smgd estimates them
from what it has in flight and the handshake's max_running_requests.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from .faults.harness import StreamOutcome, daemon_toml, mock_engine_toml, serve, stream, until

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow

BATCH = 4
STREAMS = 12
STEP_MS = 50.0  # 60 tokens take 3 s: the 8 waiting requests stay queued while we look
TOKENS = 60
# smgd's name -> its type (the protocol metric it stands for)
REQUIRED = {
    "smgd_queued_requests": "gauge",  # TotalQueuedRequests
    "smgd_running_requests": "gauge",  # TotalRunningRequests
    "smgd_kv_cache_usage_ratio": "gauge",  # KVCacheUtilization
}


def engine(wire: str) -> str:
    return mock_engine_toml("e0", "m", step_ms=STEP_MS) + f'wire = "{wire}"\nmax_batch = {BATCH}\n'


async def scrape(client: httpx.AsyncClient) -> tuple[dict[str, str], dict[str, list[float]]]:
    """(type by family, the values of its samples; by sample name too) of /metrics."""
    reply = await client.get("/metrics")
    assert reply.status_code == 200
    types: dict[str, str] = {}
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(reply.text):
        types[family.name] = family.type
        values[family.name] = [s.value for s in family.samples]
        for sample in family.samples:
            if sample.name != family.name:  # a histogram's _sum, _count, _bucket
                values.setdefault(sample.name, []).append(sample.value)
    return types, values


def load(values: dict[str, list[float]]) -> tuple[float, float, float]:
    """(queued, running, KV usage); each must be exactly one series, with no labels to pick."""
    (queued,) = values["smgd_queued_requests"]
    (running,) = values["smgd_running_requests"]
    (kv,) = values["smgd_kv_cache_usage_ratio"]
    return queued, running, kv


@pytest.mark.parametrize("wire", ["sglang", "vllm"])
async def test_protocol_metrics_under_load(tmp_path: Path, wire: str) -> None:
    async with serve(tmp_path, daemon_toml(engine(wire))) as daemon, daemon.client() as client:
        # The inference API: both OpenAI endpoints answer.
        chat = await client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        text = await client.post("/v1/completions", json=body)
        assert text.status_code == 200 and text.json()["object"] == "text_completion"

        types, idle = await scrape(client)
        for name, kind in REQUIRED.items():
            assert types.get(name) == kind, name
        idle_kv = load(idle)[2]
        assert load(idle)[:2] == (0, 0)

        outcomes = [StreamOutcome(status=0) for _ in range(STREAMS)]
        busy: list[tuple[float, float, float]] = []
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for outcome in outcomes:
                    nursery.start_soon(partial(stream, client, "m", "a b c", TOKENS, into=outcome))

                async def all_sent() -> bool:
                    # every stream reached the engine (the engine's report follows its next
                    # step); the first 4 have tokens
                    queued, running, _ = load((await scrape(client))[1])
                    return (
                        queued + running == STREAMS
                        and sum(bool(o.chunks) for o in outcomes) >= BATCH
                    )

                await until(all_sent, 20)
                for _ in range(3):
                    busy.append(load((await scrape(client))[1]))
                    await trio.sleep(0.1)
        _, final = await scrape(client)
        after = load(final)

    assert all(o.status == 200 for o in outcomes)
    # While the first 4 run (2 s), the other 8 wait in the engine's queue.
    for queued, running, kv in busy:
        assert (queued, running) == (STREAMS - BATCH, BATCH)
        assert 0 < kv <= 1 and kv > idle_kv
    queued, running, kv = after
    assert (queued, running) == (0, 0)
    assert 0 <= kv <= 1
    # Queue time: no admission cap, so only the engine's own queue, which vLLM reports per
    # request (its QUEUED and SCHEDULED events) and SGLang does not. The 8 that waited
    # queued for the first 4's 40 steps (2 s) at least.
    (queue_s,) = final["smgd_request_queue_time_seconds_sum"]
    (count,) = final["smgd_request_queue_time_seconds_count"]
    assert count == STREAMS + 2
    if wire == "vllm":
        assert queue_s >= (STREAMS - BATCH) * TOKENS * STEP_MS / 1000 * 0.9
    else:
        assert queue_s == 0
