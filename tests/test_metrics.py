"""/metrics and /get_load: request figures after real requests, engine gauges, naming lint."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from smgd.admission import Admission
from smgd.engines.state import EngineState
from smgd.engines.stream import RequestStream
from smgd.errors import (
    Draining,
    EngineDead,
    EngineNotReady,
    InvalidRequest,
    Overloaded,
    SmgdError,
    Unauthorized,
)
from smgd.metrics import (
    ITL_BUCKETS,
    TTFT_BUCKETS,
    Buckets,
    RequestMetrics,
    abort_reason,
    build_registry,
)
from smgd.text.tokenizer import load_tokenizer
from smgd.wire.common import EngineInfo, EngineLoad
from tests.asgi_client import request
from tests.fake_engine import (
    MODEL,
    TINY_MODEL,
    Behaviour,
    FakeEngine,
    get,
    open_app,
    open_gateway,
    post,
    post_stream,
)

TOK = load_tokenizer(TINY_MODEL)
IDS = TOK.encode(" Hello, world! How are you today?", add_special_tokens=False)
STEP_S = 0.01  # the fake engine's decode step

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(app: object) -> tuple[Samples, dict[str, str]]:
    """(value by (sample name, labels), type by family name) from GET /metrics."""
    reply = await get(app, "/metrics")  # type: ignore[arg-type]
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(reply.body.decode()):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, types


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def test_counts_match_what_was_sent(autojump_clock: trio.abc.Clock) -> None:
    async with open_app(FakeEngine()) as (app, _):
        prompt_tokens = 0
        for max_tokens in (3, 5):
            reply = await post(
                app, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens}
            )
            assert reply.status == 200
            prompt_tokens += reply.json()["usage"]["prompt_tokens"]
        streamed = await post_stream(
            app,
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 7,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        prompt_tokens += streamed.chunks()[-1]["usage"]["prompt_tokens"]
        missing = await post(app, "/v1/completions", {"model": "nope", "prompt": "x"})
        assert missing.status == 404
        samples, types = await scrape(app)

    ok = {"model": MODEL, "engine": "fake", "status": "ok"}
    assert value(samples, "smgd_requests_total", **ok) == 3
    tokens = {"model": MODEL, "engine": "fake"}
    assert value(samples, "smgd_tokens_total", kind="completion", **tokens) == 3 + 5 + 7
    assert value(samples, "smgd_tokens_total", kind="prompt", **tokens) == prompt_tokens
    assert value(samples, "smgd_aborts_total", reason="validation") == 1
    http = {"method": "POST", "route": "/v1/completions"}
    assert value(samples, "smgd_http_requests_total", status="200", **http) == 2
    assert value(samples, "smgd_http_requests_total", status="404", **http) == 1
    chat = {"method": "POST", "route": "/v1/chat/completions", "status": "200"}
    assert value(samples, "smgd_http_requests_total", **chat) == 1
    # One TTFT and one e2e per request; one inter-token gap per event after the first (the
    # fake engine emits one token per step, every step a separate event).
    hist = {"model": MODEL, "engine": "fake"}
    assert value(samples, "smgd_time_to_first_token_seconds_count", **hist) == 3
    assert value(samples, "smgd_request_duration_seconds_count", **hist) == 3
    gaps = (3 - 1) + (5 - 1) + (7 - 1)
    assert value(samples, "smgd_inter_token_latency_seconds_count", **hist) == gaps
    itl_sum = value(samples, "smgd_inter_token_latency_seconds_sum", **hist)
    assert itl_sum == pytest.approx(gaps * STEP_S)
    # Every gap is one 10 ms step (give or take float rounding of the clock): all of them at
    # or below le=0.015, none at or below le=0.0075.
    itl = "smgd_inter_token_latency_seconds_bucket"
    assert value(samples, itl, le="0.015", **hist) == gaps
    assert value(samples, itl, le="0.0075", **hist) == 0
    # Time per output token: one per request, each the 10 ms step (one token per event).
    assert value(samples, "smgd_time_per_output_token_seconds_count", **hist) == 3
    tpot_sum = value(samples, "smgd_time_per_output_token_seconds_sum", **hist)
    assert tpot_sum == pytest.approx(3 * STEP_S)
    # Lengths: prompts as usage counted them, outputs 3, 5 and 7 (le=5 holds two of them).
    assert value(samples, "smgd_request_prompt_tokens_count", **hist) == 3
    assert value(samples, "smgd_request_prompt_tokens_sum", **hist) == prompt_tokens
    assert value(samples, "smgd_request_generation_tokens_sum", **hist) == 3 + 5 + 7
    assert value(samples, "smgd_request_generation_tokens_bucket", le="5.0", **hist) == 2
    # No admission cap: every request was sent at once, no queue time.
    assert value(samples, "smgd_request_queue_time_seconds_count", **hist) == 3
    assert value(samples, "smgd_request_queue_time_seconds_sum", **hist) == 0
    finished = "smgd_requests_finished_total"
    assert value(samples, finished, finish_reason="length", **hist) == 3
    assert types["smgd_requests"] == "counter"
    assert types["smgd_time_to_first_token_seconds"] == "histogram"
    assert value(samples, "smgd_engine_generated_tokens_total", engine="fake", wire="fake") == 15


async def test_methods_clients_invent_share_one_label(autojump_clock: trio.abc.Clock) -> None:
    async with open_app(FakeEngine()) as (app, _):
        for i in range(50):
            answer = await request(app, f"X{i:03d}{'Y' * 100}", "/v1/models")
            assert answer.status == 405
        assert (await request(app, "PATCH", "/v1/models")).status == 405
        samples, _ = await scrape(app)
    label = frozenset({"route": "unmatched", "method": "other", "status": "405"}.items())
    assert samples[("smgd_http_requests_total", label)] == 50
    patch = frozenset({"route": "unmatched", "method": "PATCH", "status": "405"}.items())
    assert samples[("smgd_http_requests_total", patch)] == 1
    methods = {dict(labels)["method"] for name, labels in samples if name.startswith("smgd_http")}
    assert methods <= {"GET", "PATCH", "other"}


async def test_abort_causes(autojump_clock: trio.abc.Clock) -> None:
    fake = FakeEngine(behaviour=Behaviour(output=IDS, step_s=0.5))
    async with open_app(fake) as (app, gateway):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 50, "stream": True}
        gone = await post_stream(app, "/v1/completions", body, disconnect_after=2)
        assert gone.disconnected_at is not None
        await trio.sleep(1)  # let the abandoned generator's finally run
        stop = await post(
            app,
            "/v1/completions",
            {"model": MODEL, "prompt": "hi", "max_tokens": 50, "stop": "world"},
        )
        assert stop.json()["choices"][0]["finish_reason"] == "stop"
        fake.behaviour = Behaviour(step_s=0.01, die_after=2)
        died = await post_stream(app, "/v1/completions", body)
        assert "error" in died.chunks()[-1]
        gateway.draining = True
        drained = await post(app, "/v1/completions", {"model": MODEL, "prompt": "hi"})
        assert drained.status == 503
        samples, _ = await scrape(app)

    assert value(samples, "smgd_aborts_total", reason="client_disconnect") == 1
    assert value(samples, "smgd_aborts_total", reason="stop_string") == 1
    assert value(samples, "smgd_aborts_total", reason="engine_error") == 1
    assert value(samples, "smgd_aborts_total", reason="drain") == 1
    labels = {"model": MODEL, "engine": "fake"}
    assert value(samples, "smgd_requests_total", status="cancelled", **labels) == 1
    assert value(samples, "smgd_requests_total", status="ok", **labels) == 1
    assert value(samples, "smgd_requests_total", status="error", **labels) == 1
    finished = "smgd_requests_finished_total"
    assert value(samples, finished, finish_reason="abort", **labels) == 1
    assert value(samples, finished, finish_reason="stop", **labels) == 1
    assert value(samples, finished, finish_reason="error", **labels) == 1
    assert value(samples, "smgd_draining") == 1


async def test_metric_names_follow_prometheus_conventions(autojump_clock: trio.abc.Clock) -> None:
    async with open_app(FakeEngine()) as (app, gateway):
        gateway.engine_restarts["fake"] = 1
        await post(app, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        reply = await get(app, "/metrics")
    families = list(text_string_to_metric_families(reply.body.decode()))
    names = {f.name for f in families}
    assert {"smgd_requests", "smgd_engine_up", "smgd_engine_restarts", "smgd_reloads"} <= names
    for family in families:
        assert ":" not in family.name
        assert family.name.startswith(("smgd_", "process_")), family.name
        if family.type == "counter":
            for sample in family.samples:
                assert sample.name.endswith(("_total", "_created")), sample.name
        if family.type == "histogram" or any(
            w in family.name for w in ("latency", "duration", "time_")
        ):
            # a duration in seconds, or a count of tokens
            assert family.name.endswith(("_seconds", "_tokens")), family.name
        assert not family.name.endswith(("_ms", "_milliseconds", "_percent")), family.name
        for sample in family.samples:
            assert not {"request_id", "rid", "user"} & sample.labels.keys()


async def test_collector_reads_engines_at_scrape_time() -> None:
    ready = FakeEngine("a")
    dead = FakeEngine("b")
    async with open_gateway(ready, dead) as gateway:
        dead.state = EngineState.DEAD
        ready.load = EngineLoad(running=3, waiting=2, kv_usage=0.5)
        gateway.engine_restarts["b"] = 4
        gateway.reloads_total, gateway.reload_failures_total = 3, 1
        registry = build_registry(gateway, RequestMetrics())

        def v(name: str, **labels: str) -> float | None:
            return registry.get_sample_value(name, labels)

        a, b = {"engine": "a", "wire": "fake"}, {"engine": "b", "wire": "fake"}
        assert v("smgd_engine_up", **a) == 1 and v("smgd_engine_ready", **a) == 1
        assert v("smgd_engine_up", **b) == 0 and v("smgd_engine_ready", **b) == 0
        assert v("smgd_engine_running_requests", **a) == 3
        assert v("smgd_engine_waiting_requests", **a) == 2
        assert v("smgd_engine_kv_cache_usage_ratio", **a) == 0.5
        assert v("smgd_engine_running_requests", **b) is None  # b never reported a load
        assert v("smgd_engine_restarts_total", engine="b") == 4
        assert v("smgd_reloads_total") == 3 and v("smgd_reload_failures_total") == 1
        assert v("smgd_engine_requests_inflight", **a) == 0
        # Nothing is cached: a later change shows up at the next scrape.
        ready.state = EngineState.DEAD
        gateway.draining = True
        assert v("smgd_engine_ready", **a) == 0
        assert v("smgd_draining") == 1


async def test_inflight_and_get_load_follow_a_running_stream(
    autojump_clock: trio.abc.Clock,
) -> None:
    fake = FakeEngine(behaviour=Behaviour(step_s=0.1))
    async with open_app(fake) as (app, _):
        idle = (await get(app, "/get_load")).json()
        async with trio.open_nursery() as nursery:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 20, "stream": True}
            nursery.start_soon(post_stream, app, "/v1/completions", body)
            await trio.sleep(0.55)
            fake.load = EngineLoad(running=1, waiting=4, kv_usage=0.25)
            busy = (await get(app, "/get_load")).json()
            samples, _ = await scrape(app)
        after = (await get(app, "/get_load")).json()
    assert idle == [
        {
            "dp_rank": 0, "engine": "fake", "models": [MODEL], "wire": "fake", "state": "ready",
            "num_reqs": 0, "num_running_reqs": 0, "num_waiting_reqs": 0,
            "num_inflight_reqs": 0, "num_queued_reqs": 0, "token_usage": None,
        }
    ]  # fmt: skip
    [entry] = busy
    assert entry["num_reqs"] == 1 and entry["num_inflight_reqs"] == 1
    assert entry["num_running_reqs"] == 1 and entry["num_waiting_reqs"] == 4
    assert entry["token_usage"] == 0.25
    assert value(samples, "smgd_engine_requests_inflight", engine="fake", wire="fake") == 1
    assert after[0]["num_reqs"] == 0


async def test_admission_queue_shows_in_load(autojump_clock: trio.abc.Clock) -> None:
    fake = FakeEngine(behaviour=Behaviour(step_s=0.1))
    fake.admission = Admission(max_inflight=1, max_queue=8, queue_timeout_s=60)
    async with open_app(fake) as (app, _), trio.open_nursery() as nursery:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 10, "stream": True}
        for _ in range(3):
            nursery.start_soon(post_stream, app, "/v1/completions", body)
        await trio.sleep(0.25)
        [entry] = (await get(app, "/get_load")).json()
        samples, _ = await scrape(app)
    assert entry["num_inflight_reqs"] == 1 and entry["num_queued_reqs"] == 2
    assert entry["num_reqs"] == 3 and entry["num_waiting_reqs"] == 2
    assert value(samples, "smgd_engine_queue_depth", engine="fake", wire="fake") == 2


@pytest.mark.parametrize(
    ("on_bounds", "between", "as_tuple"),
    # A few values are observed one by one, many through one sort: both paths, either type.
    [(50, 500, False), (3, 2, False), (1, 0, True), (0, 8, False), (4, 5, True), (0, 0, False)],
)
def test_buckets_match_prometheus_client_histogram(
    on_bounds: int, between: int, as_tuple: bool
) -> None:
    rng = random.Random(7 + on_bounds + between)
    # exact boundaries: le is inclusive
    values = [rng.choice(ITL_BUCKETS) for _ in range(on_bounds)]
    values += [rng.lognormvariate(-3, 2) for _ in range(between)]
    ours = Buckets(ITL_BUCKETS)
    ours.observe_many(tuple(values) if as_tuple else values)
    registry = CollectorRegistry()
    reference = Histogram("x_seconds", "x", buckets=ITL_BUCKETS, registry=registry)
    for x in values:
        reference.observe(x)
    for le, cumulative in ours.cumulative():
        expected = registry.get_sample_value("x_seconds_bucket", {"le": le})
        assert cumulative == expected, le
    assert ours.count == len(values)
    assert ours.total == pytest.approx(registry.get_sample_value("x_seconds_sum"))


def test_buckets_span_one_millisecond_to_hours() -> None:
    for bounds in (TTFT_BUCKETS, ITL_BUCKETS):
        assert bounds[0] == 0.001
        assert list(bounds) == sorted(set(bounds))
    assert TTFT_BUCKETS[-1] >= 3600
    assert ITL_BUCKETS[-1] >= 60


@pytest.mark.parametrize(
    ("err", "draining", "reason"),
    [
        (InvalidRequest("x"), False, "validation"),
        (Unauthorized("x"), False, "unauthorized"),
        (Overloaded("x"), False, "overloaded"),
        (Draining("x"), False, "drain"),
        (EngineNotReady("x"), False, "engine_unavailable"),
        (EngineNotReady("x"), True, "drain"),
        (EngineDead("x"), False, "engine_error"),
        (SmgdError("x"), False, "internal_error"),
    ],
)
def test_abort_reason(err: SmgdError, draining: bool, reason: str) -> None:
    assert abort_reason(err, draining=draining) == reason


def read_docs() -> tuple[str, dict[str, Any]]:
    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "reference" / "metrics.md").read_text()
    return doc, json.loads((root / "docs" / "grafana-dashboard.json").read_text())


async def test_every_metric_is_documented_and_the_dashboard_uses_real_names(
    autojump_clock: trio.abc.Clock,
) -> None:
    fake = FakeEngine()
    fake.load = EngineLoad(running=1, waiting=0, kv_usage=0.1)  # so the load gauges appear
    async with open_app(fake) as (app, gateway):
        gateway.engine_restarts["fake"] = 1
        await post(app, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        reply = await get(app, "/metrics")
    families = {
        f.name: f.type
        for f in text_string_to_metric_families(reply.body.decode())
        if f.name.startswith("smgd_")
    }
    exposed = {name + "_total" if kind == "counter" else name for name, kind in families.items()}
    doc, dashboard = read_docs()
    documented = set(re.findall(r"`(smgd_[a-z_]+)`", doc))
    assert exposed - documented == set()  # every exposed metric has a row
    # and no row describes a metric that does not exist (smgd_workers_scraped: only with
    # server.workers > 1, checked in test_worker_peers and test_workers; LoRA info: only with
    # LoRA adapters configured)
    assert documented - exposed == {"smgd_workers_scraped", "smgd_lora_requests_info"}
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    used = {
        re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"smgd_\w+", e)
    }
    assert used - exposed == set()


def daemon_load(samples: Samples) -> tuple[float, float, float | None]:
    """(queued, running, KV usage) as the model-server protocol's gauges show them."""
    kv = samples.get(("smgd_kv_cache_usage_ratio", frozenset()))
    return value(samples, "smgd_queued_requests"), value(samples, "smgd_running_requests"), kv


async def test_daemon_load_is_estimated_where_the_engine_reports_none(
    autojump_clock: trio.abc.Clock,
) -> None:
    """No load reports (as SGLang): the oldest max_num_seqs requests run, the rest wait; the
    KV share is the running requests' prompt and output tokens over the KV capacity."""
    fake = FakeEngine(behaviour=Behaviour(step_s=0.1))
    fake._info = EngineInfo(
        max_model_len=4096, vocab_size=1024, max_num_seqs=2, kv_cache_tokens=1000
    )
    fake.admission = Admission(max_inflight=3, max_queue=8, queue_timeout_s=60)
    async with open_app(fake) as (app, _):
        idle, _ = await scrape(app)
        async with trio.open_nursery() as nursery:
            body = {"model": MODEL, "prompt": "hi there", "max_tokens": 10, "stream": True}
            for _ in range(4):
                nursery.start_soon(post_stream, app, "/v1/completions", body)
            await trio.sleep(0.55)  # five steps: every running request has five tokens
            busy, _ = await scrape(app)
        after, _ = await scrape(app)
    prompt = len(fake.requests[0].prompt_ids)
    # 2 running, 1 waiting in the engine (3 sent: max_inflight), 1 in smgd's admission queue.
    queued, running, kv = daemon_load(busy)
    assert (queued, running) == (2, 2)
    assert kv == pytest.approx((2 * prompt + 2 * 5) / 1000)
    assert daemon_load(idle) == (0, 0, 0.0)
    assert daemon_load(after) == (0, 0, 0.0)
    # the per-engine gauges show only what an engine reported: nothing here
    labels = frozenset({("engine", "fake"), ("wire", "fake")})
    assert ("smgd_engine_running_requests", labels) not in busy


async def test_daemon_load_sums_engines_and_clamps_reports() -> None:
    a, b, dead = FakeEngine("a"), FakeEngine("b"), FakeEngine("c")
    async with open_gateway(a, b, dead) as gateway:
        registry = build_registry(gateway, RequestMetrics())

        def v(name: str) -> float | None:
            return registry.get_sample_value(name, {})

        # A report from before the last finish: nothing in flight, nothing runs or waits.
        a.load = EngineLoad(running=3, waiting=2, kv_usage=0.5)
        b.load = EngineLoad(running=0, waiting=0, kv_usage=0.25)
        dead.load = EngineLoad(running=0, waiting=0, kv_usage=1.0)
        dead.state = EngineState.DEAD  # its last figure is not current: not in the mean
        assert (v("smgd_queued_requests"), v("smgd_running_requests")) == (0, 0)
        assert v("smgd_kv_cache_usage_ratio") == pytest.approx((0.5 + 0.25) / 2)
        # 4 in flight on a, which reports 3 running and 2 waiting: one of those 2 is gone.
        for i in range(4):
            a._streams[str(i)] = RequestStream(str(i), "a")
        b.load = EngineLoad(running=1, waiting=0, kv_usage=0.25)
        b._streams["x"] = RequestStream("x", "b")
        assert (v("smgd_queued_requests"), v("smgd_running_requests")) == (1, 3 + 1)
        for engine in (a, b, dead):
            engine.load = None
        # No engine has a figure (no report, no KV capacity from the handshake): absent.
        assert v("smgd_kv_cache_usage_ratio") is None


async def test_tool_calls_count_as_the_finish_the_client_saw(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The engine stopped, the client was told ``tool_calls`` (streamed or not): the finish
    reasons count what the client saw."""
    from tests.test_api_tools import CHAT, parsing_engine

    async with open_app(parsing_engine()) as (app, _):
        whole = await post(app, "/v1/chat/completions", CHAT)
        streamed = await post_stream(app, "/v1/chat/completions", {**CHAT, "stream": True})
        samples, _ = await scrape(app)
    assert whole.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert streamed.chunks()[-1]["choices"][0]["finish_reason"] == "tool_calls"
    labels = {"model": MODEL, "engine": "fake"}
    assert value(samples, "smgd_requests_finished_total", finish_reason="tool_calls", **labels) == 2
    assert value(samples, "smgd_requests_finished_total", finish_reason="stop", **labels) == 0


def _families(metrics: RequestMetrics) -> dict[str, set[tuple[str, ...]]]:
    """Label values of every sample a histogram exports, by histogram name."""
    out: dict[str, set[tuple[str, ...]]] = {}
    for family in metrics.collect():
        if family.type == "histogram":
            out[family.name] = {
                tuple(s.labels[k] for k in ("model", "engine")) for s in family.samples
            }
    return out


def test_a_histogram_shows_a_pair_only_once_it_observed_something() -> None:
    """A pair that ended a request without output has e2e and queue figures, no TTFT, no
    inter-token or per-token figure; an embedding pair no generation figures at all."""
    metrics = RequestMetrics()
    failed = SimpleNamespace(
        done=False, engine="e1", counts_prompt=True, prompt_tokens=4, cached_tokens=None,
        completion_tokens=0, stopped_here=False, finish_reason=None, reported_finish=None,
        queued_s=0.0, t_first=None, t_last=None,
    )  # fmt: skip
    state = SimpleNamespace(
        model="m", choices=[failed], error="engine died", failure=None, t_start=1.0,
        t_first=None, gaps=[],
    )  # fmt: skip
    metrics.record(state, 2.0)
    metrics.record_pooling("m", "e2", prompt_tokens=3, queued_s=0.0, duration_s=0.5)
    seen = _families(metrics)
    assert seen["smgd_request_duration_seconds"] == {("m", "e1"), ("m", "e2")}
    assert seen["smgd_request_queue_time_seconds"] == {("m", "e1"), ("m", "e2")}
    assert seen["smgd_request_prompt_tokens"] == {("m", "e1"), ("m", "e2")}
    assert seen["smgd_request_generation_tokens"] == {("m", "e1")}
    for name in (
        "smgd_time_to_first_token_seconds",
        "smgd_inter_token_latency_seconds",
        "smgd_time_per_output_token_seconds",
    ):
        assert seen[name] == set(), name
