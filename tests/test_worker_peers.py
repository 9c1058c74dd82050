"""One /metrics and /readiness over every worker (smgd.worker_peers): merges, and asking."""

from __future__ import annotations

import json
from pathlib import Path

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from smgd import worker_peers as peers_module
from smgd.worker_peers import (
    WorkerPeers,
    ask_all,
    bind_sockets,
    merge_load,
    merge_metrics,
    merge_readiness,
    serve_own,
    worker_peers,
)


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
    merged = merge_metrics(texts, 2)
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


def test_the_daemon_load_gauges_are_one_series_for_all_workers() -> None:
    """An endpoint picker reads one series per server: queued and running are summed over
    the workers, KV usage averaged over those that have it, none labelled with a worker."""

    def worker(queued: float, running: float, kv: float | None) -> bytes:
        registry = _registry("e", 1)
        Gauge("smgd_queued_requests", "Queued.", registry=registry).set(queued)
        Gauge("smgd_running_requests", "Running.", registry=registry).set(running)
        if kv is not None:
            Gauge("smgd_kv_cache_usage_ratio", "KV.", registry=registry).set(kv)
        return generate_latest(registry)

    texts = [(0, worker(3, 4, 0.5)), (1, worker(5, 4, 0.25)), (2, worker(0, 1, None))]
    samples = _samples(merge_metrics(texts, 3))
    assert samples[("smgd_queued_requests", frozenset())] == 8
    assert samples[("smgd_running_requests", frozenset())] == 9
    assert samples[("smgd_kv_cache_usage_ratio", frozenset())] == 0.375
    for name in ("smgd_queued_requests", "smgd_running_requests", "smgd_kv_cache_usage_ratio"):
        assert [labels for (n, labels) in samples if n == name] == [frozenset()]
    # the other families keep their worker labels
    assert ("smgd_engine_up", frozenset({("engine", "e"), ("worker", "2")})) in samples


def test_a_worker_whose_text_does_not_parse_is_left_out_not_the_scrape() -> None:
    merged = merge_metrics([(0, generate_latest(_registry("e0", 1))), (1, b"not {{ prometheus")], 2)
    samples = _samples(merged)
    assert samples[("smgd_workers_scraped", frozenset())] == 1
    assert ("smgd_requests_total", frozenset({("engine", "e0"), ("worker", "0")})) in samples
    assert not any(("worker", "1") in labels for (_, labels) in samples)


def test_worker_peers_come_from_the_supervisors_environment() -> None:
    env = {
        "SMGD_WORKER": "1/3",
        peers_module.METRICS_DIR_ENV: "/run/x",
        peers_module.METRICS_FD_ENV: "7",
    }
    assert worker_peers(env) == WorkerPeers(index=1, count=3, directory="/run/x", own_fd=7)
    assert worker_peers({"SMGD_WORKER": "1/3"}) is None  # no sockets: own registry only
    assert worker_peers({}) is None


async def test_ask_all_reads_every_worker_and_skips_one_that_does_not_answer(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # Three workers' sockets, as the supervisor binds them; worker 2 never answers (as while
    # it restarts: the socket is the supervisor's and accepts, nobody reads).
    sockets = bind_sockets(str(tmp_path), 3)
    try:
        registries = [_registry(f"e{i}", i + 1) for i in range(3)]
        answers = {"metrics": lambda: generate_latest(registries[1])}
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_own, sockets[1].fileno(), answers)
            peers = WorkerPeers(0, 3, str(tmp_path), sockets[0].fileno())
            start = trio.current_time()
            got = await ask_all(peers, "metrics", generate_latest(registries[0]))
            waited = trio.current_time() - start
            unknown = await ask_all(peers, "no-such-thing", b"")
            nursery.cancel_scope.cancel()
    finally:
        for sock in sockets:
            sock.close()
    assert [index for index, _ in got] == [0, 1, 2]
    assert got[2][1] is None
    assert unknown[1][1] is None  # a request it does not know gets no answer, not a crash
    samples = _samples(merge_metrics(got, 3))
    assert samples[("smgd_workers_scraped", frozenset())] == 2
    assert samples[("smgd_requests_total", frozenset({("engine", "e0"), ("worker", "0")}))] == 1
    assert samples[("smgd_requests_total", frozenset({("engine", "e1"), ("worker", "1")}))] == 2
    assert not any(("worker", "2") in labels for (_, labels) in samples)
    assert peers_module.FETCH_TIMEOUT_S <= waited < peers_module.FETCH_TIMEOUT_S + 1


def _readiness(ready: bool, engine: str, *, draining: bool = False) -> bytes:
    status = "ready" if ready else ("draining" if draining else "not_ready")
    report = {"status": status, "draining": draining, "engines": {engine: {"ready": ready}}}
    return json.dumps({"ready": ready, "report": report}).encode()


def test_readiness_is_ready_only_when_every_worker_is() -> None:
    ready, report = merge_readiness([(0, _readiness(True, "e0")), (1, _readiness(True, "e1"))])
    assert ready
    assert report["status"] == "ready"
    assert report["engines"] == {"e0": {"ready": True}, "e1": {"ready": True}}
    assert report["workers"] == {"0": "ready", "1": "ready"}

    ready, report = merge_readiness([(0, _readiness(True, "e0")), (1, _readiness(False, "e1"))])
    assert not ready
    assert report["status"] == "not_ready"
    assert report["workers"] == {"0": "ready", "1": "not_ready"}


def test_a_worker_that_does_not_answer_or_drains_makes_the_daemon_not_ready() -> None:
    ready, report = merge_readiness([(0, _readiness(True, "e0")), (1, None)])
    assert not ready
    assert report["workers"] == {"0": "ready", "1": "no_answer"}
    assert report["engines"] == {"e0": {"ready": True}}

    ready, report = merge_readiness([(0, _readiness(False, "e0", draining=True)), (1, b"{")])
    assert not ready
    assert report["status"] == "draining"
    assert report["workers"] == {"0": "draining", "1": "no_answer"}


def test_load_lists_every_workers_engines_with_dp_rank_over_all_of_them() -> None:
    def entries(*names: str) -> bytes:
        return json.dumps([{"dp_rank": i, "engine": n} for i, n in enumerate(names)]).encode()

    merged = merge_load([(0, entries("a", "c")), (1, None), (2, entries("b")), (3, b"[1]")])
    assert merged == [
        {"dp_rank": 0, "engine": "a", "worker": 0},
        {"dp_rank": 1, "engine": "c", "worker": 0},
        {"dp_rank": 2, "engine": "b", "worker": 2},
    ]
