"""One /metrics over every worker (smgd.worker_metrics): merge, and gather over unix sockets."""

from __future__ import annotations

from pathlib import Path

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from smgd import worker_metrics
from smgd.worker_metrics import WorkerPeers, bind_sockets, gather, merge, serve_own, worker_peers


def _registry(engine: str, requests: int) -> CollectorRegistry:
    registry = CollectorRegistry()
    counter = Counter("smgd_requests", "Requests.", ["engine"], registry=registry)
    counter.labels(engine).inc(requests)
    Gauge("smgd_engine_up", "Up.", ["engine"], registry=registry).labels(engine).set(1)
    histogram = Histogram("smgd_ttft_seconds", "TTFT.", buckets=[0.1, 1.0], registry=registry)
    histogram.observe(0.05 * requests)
    return registry


def _samples(text: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_merge_labels_every_sample_with_its_worker_under_one_header_per_family() -> None:
    texts = [(0, generate_latest(_registry("e0", 3))), (1, generate_latest(_registry("e1", 5)))]
    merged = merge(texts, 2)
    samples = _samples(merged)
    assert samples[("smgd_requests_total", frozenset({("engine", "e0"), ("worker", "0")}))] == 3
    assert samples[("smgd_requests_total", frozenset({("engine", "e1"), ("worker", "1")}))] == 5
    assert samples[("smgd_ttft_seconds_count", frozenset({("worker", "1")}))] == 1
    assert samples[("smgd_workers_scraped", frozenset())] == 2
    text = merged.decode()
    assert text.count("# TYPE smgd_requests_total counter") == 1
    assert text.count("# TYPE smgd_ttft_seconds histogram") == 1
    # Every sample but the scrape's own count names its worker.
    assert all(
        dict(labels).get("worker") in ("0", "1")
        for (name, labels) in samples
        if name != "smgd_workers_scraped"
    )


def test_a_worker_whose_text_does_not_parse_is_left_out_not_the_scrape() -> None:
    merged = merge([(0, generate_latest(_registry("e0", 1))), (1, b"not {{ prometheus")], 2)
    samples = _samples(merged)
    assert samples[("smgd_workers_scraped", frozenset())] == 1
    assert ("smgd_requests_total", frozenset({("engine", "e0"), ("worker", "0")})) in samples
    assert not any(("worker", "1") in labels for (_, labels) in samples)


def test_worker_peers_come_from_the_supervisors_environment() -> None:
    env = {
        "SMGD_WORKER": "1/3",
        worker_metrics.METRICS_DIR_ENV: "/run/x",
        worker_metrics.METRICS_FD_ENV: "7",
    }
    assert worker_peers(env) == WorkerPeers(index=1, count=3, directory="/run/x", own_fd=7)
    assert worker_peers({"SMGD_WORKER": "1/3"}) is None  # no sockets: own registry only
    assert worker_peers({}) is None


async def test_gather_reads_every_worker_and_skips_one_that_does_not_answer(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # Three workers' sockets, as the supervisor binds them; worker 2 never answers (as while
    # it restarts: the socket is the supervisor's and accepts, nobody reads).
    sockets = bind_sockets(str(tmp_path), 3)
    try:
        registries = [_registry(f"e{i}", i + 1) for i in range(3)]
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_own, sockets[1].fileno(), registries[1])
            peers = WorkerPeers(0, 3, str(tmp_path), sockets[0].fileno())
            start = trio.current_time()
            merged = await gather(registries[0], peers)
            waited = trio.current_time() - start
            nursery.cancel_scope.cancel()
    finally:
        for sock in sockets:
            sock.close()
    samples = _samples(merged)
    assert samples[("smgd_workers_scraped", frozenset())] == 2
    assert samples[("smgd_requests_total", frozenset({("engine", "e0"), ("worker", "0")}))] == 1
    assert samples[("smgd_requests_total", frozenset({("engine", "e1"), ("worker", "1")}))] == 2
    assert not any(("worker", "2") in labels for (_, labels) in samples)
    assert worker_metrics.FETCH_TIMEOUT_S <= waited < worker_metrics.FETCH_TIMEOUT_S + 1
