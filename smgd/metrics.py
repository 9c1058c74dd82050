"""Prometheus metrics: per-request figures recorded once per request, engine gauges at scrape.

Two sources feed one private :class:`~prometheus_client.CollectorRegistry` per app (tests run
several daemons in one process, so nothing touches the global registry):

- :class:`RequestMetrics` is plain counters and pre-bucketed histograms, updated by
  :meth:`RequestMetrics.record` once when a request ends (from the request's state, read
  through the :class:`FinishedRequest` protocol that the api's ``RequestState`` meets), and
  by :meth:`RequestMetrics.refused` / :meth:`RequestMetrics.http` once per HTTP response.
  No per-token work, no locks: every update and every scrape runs on the trio thread.
- :class:`GatewayCollector` reads ``gateway.router.engines()`` statistics and the gateway's
  reload/restart counters *at scrape time*, so engine gauges cost nothing on the hot path.

Names follow Prometheus conventions: ``smgd_`` prefix, no ``:``, base units (seconds),
``_total`` on counters. The reference is ``docs/reference/metrics.md``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from smgd import __version__
from smgd.engines.lora_metrics import LoraInfoCollector
from smgd.errors import (
    ClientError,
    Draining,
    EngineError,
    EngineNotReady,
    Overloaded,
    SmgdError,
    Unauthorized,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Sequence

    from smgd.gateway import Gateway

__all__ = [
    "E2E_BUCKETS",
    "ITL_BUCKETS",
    "QUEUE_BUCKETS",
    "TOKEN_BUCKETS",
    "TPOT_BUCKETS",
    "TTFT_BUCKETS",
    "Buckets",
    "FinishedChoice",
    "FinishedRequest",
    "GatewayCollector",
    "RequestMetrics",
    "abort_reason",
    "build_registry",
]

# TTFT and end-to-end latency: 1 ms (a cached prompt on a local engine) up to 2 h (a long
# generation queued behind others); roughly 1-2.5-5 steps so percentiles stay within ~2.5x.
TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1800.0, 3600.0, 7200.0,
)  # fmt: skip
E2E_BUCKETS = TTFT_BUCKETS
# Inter-token latency per output *event* (vllm #52853): decode steps are 5-100 ms, but an
# event can wait behind another request's long prefill, so the tail goes to 10 minutes.
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0,
)  # fmt: skip
# Time per output token is an average over a choice's decode: the same range as one event gap.
TPOT_BUCKETS = ITL_BUCKETS
# A queue wait (admission, bounded by queue_timeout_s, plus the engine's) is part of TTFT:
# the TTFT range serves.
QUEUE_BUCKETS = TTFT_BUCKETS
# Prompt and output lengths: 1-2-5 steps from 1 token to 1M (the longest contexts served), as
# vLLM's request_prompt_tokens / request_generation_tokens buckets.
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= 10**6)

# Request outcomes (the `status` label of smgd_requests_total).
OK, ERROR, CANCELLED = "ok", "error", "cancelled"


class FinishedChoice(Protocol):
    """What :meth:`RequestMetrics.record` reads of one engine request (smgd.api.core.pipeline's
    ``Choice``); a protocol, so the metrics do not import the api above them."""

    @property
    def done(self) -> bool: ...
    @property
    def engine(self) -> str: ...
    @property
    def counts_prompt(self) -> bool: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def cached_tokens(self) -> int | None: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def stopped_here(self) -> bool: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def reported_finish(self) -> str | None: ...
    @property
    def queued_s(self) -> float: ...
    @property
    def t_first(self) -> float | None: ...
    @property
    def t_last(self) -> float | None: ...


class FinishedRequest(Protocol):
    """What :meth:`RequestMetrics.record` reads of a request (smgd.api.core.pipeline's
    ``RequestState``)."""

    @property
    def model(self) -> str: ...
    @property
    def choices(self) -> Sequence[FinishedChoice]: ...
    @property
    def error(self) -> str | None: ...
    @property
    def failure(self) -> SmgdError | None: ...
    @property
    def t_start(self) -> float: ...
    @property
    def t_first(self) -> float | None: ...
    @property
    def gaps(self) -> Sequence[float]: ...


# Up to this many values, observe_many bisects each value rather than each bound: the bounds
# of the histograms here number 10-30, and a value's bisect costs about a bound's.
_FEW_VALUES = 8


@dataclass
class Buckets:
    """A cumulative-on-export histogram: per-bucket counts plus sum, no locks."""

    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)  # last slot: +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def observe_many(self, values: Iterable[float]) -> None:
        """Bulk observe: one C-level sort and a bisect per bound, not a Python call per value
        (a 1000-event request's gaps cost ~50 us instead of ~800 us). A few values go one by
        one: a bisect each is cheaper than a pass over every bound."""
        if not isinstance(values, list | tuple):
            values = list(values)
        if len(values) <= _FEW_VALUES:
            for value in values:
                self.observe(value)
            return
        ordered = sorted(values)
        below = 0
        for i, bound in enumerate(self.bounds):
            upto = bisect.bisect_right(ordered, bound, lo=below)  # values <= bound (le)
            self.counts[i] += upto - below
            below = upto
        self.counts[-1] += len(ordered) - below
        self.total += sum(ordered)

    @property
    def count(self) -> int:
        return sum(self.counts)

    @property
    def observed(self) -> bool:
        """Whether any value was observed (an empty histogram is not exported)."""
        return any(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return out


def abort_reason(err: BaseException, *, draining: bool) -> str:
    """The `reason` label for a request refused or ended early by ``err``."""
    if isinstance(err, Draining) or (draining and isinstance(err, EngineNotReady)):
        return "drain"
    if isinstance(err, Overloaded):
        return "overloaded"
    if isinstance(err, Unauthorized):
        return "unauthorized"
    if isinstance(err, ClientError):
        return "validation"
    if isinstance(err, EngineNotReady):
        return "engine_unavailable"
    if isinstance(err, EngineError):
        return "engine_error"
    return "internal_error"


# The methods ``smgd_http_requests`` counts under their own name (RFC 9110's and PATCH).
KNOWN_METHODS = frozenset(
    ("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH")
)
UNKNOWN_METHOD = "other"


class RequestMetrics:
    """Per-request counters and histograms (updated at request end, exported at scrape)."""

    def __init__(self) -> None:
        self.http_requests: dict[tuple[str, str, str], int] = {}  # (route, method, status)
        self.aborts: dict[str, int] = {}  # by reason
        # Counters and histograms by (model, engine): one lookup per choice finds them all.
        self._pairs: dict[tuple[str, str], _Series] = {}

    # ---- recording (called once per request / response)
    def http(self, route: str, method: str, status: int) -> None:
        # A method token may be any name a client invents: one series each would grow the
        # registry (and every scrape) without bound, so the others share one label.
        key = (route, method if method in KNOWN_METHODS else UNKNOWN_METHOD, str(status))
        self.http_requests[key] = self.http_requests.get(key, 0) + 1

    def abort(self, reason: str, n: int = 1) -> None:
        self.aborts[reason] = self.aborts.get(reason, 0) + n

    def refused(self, err: SmgdError, *, draining: bool) -> None:
        """A request answered with an error status before any engine output."""
        self.abort(abort_reason(err, draining=draining))

    def record(self, state: FinishedRequest, now: float, *, draining: bool = False) -> None:
        """Fold one finished (or abandoned) request in; ``now`` is its end time.

        Every figure but the inter-token gaps is per choice (one engine request), labelled
        with the engine that ran it, as vLLM and SGLang count ``n > 1``.
        """
        model = state.model
        for choice in state.choices:
            engine = choice.engine
            if choice.done and state.error is None:
                status = OK
                finish = choice.reported_finish or choice.finish_reason or "stop"
            elif state.error is not None:
                status, finish = ERROR, "error"
            else:
                status, finish = CANCELLED, "abort"
            series = self._series(model, engine)
            series.requests[status] = series.requests.get(status, 0) + 1
            series.finished[finish] = series.finished.get(finish, 0) + 1
            tokens = series.tokens
            if choice.counts_prompt:
                tokens["prompt"] = tokens.get("prompt", 0) + choice.prompt_tokens
                if choice.cached_tokens:
                    tokens["cached"] = tokens.get("cached", 0) + choice.cached_tokens
                series.prompt_len.observe(choice.prompt_tokens)
            tokens["completion"] = tokens.get("completion", 0) + choice.completion_tokens
            series.output_len.observe(choice.completion_tokens)
            series.queue.observe(choice.queued_s)
            first, last = choice.t_first, choice.t_last
            if first is not None:
                series.ttft.observe(first - state.t_start)
                # vLLM's definition: the decode time over the tokens after the first. Only
                # with two events or more: one event's tokens came together, no decode timing.
                if last is not None and last > first and choice.completion_tokens > 1:
                    tpot = (last - first) / (choice.completion_tokens - 1)
                    series.tpot.observe(tpot)
            series.e2e.observe(now - state.t_start)
            if choice.stopped_here:
                self.abort("stop_string")
            elif status == CANCELLED:
                self.abort("drain" if draining else "client_disconnect")
        if state.failure is not None:
            self.abort(abort_reason(state.failure, draining=draining))
        if state.gaps and state.choices:
            # The gaps of every choice are pooled: n > 1 on several engines (rare) counts
            # them under the first choice's engine.
            self._series(model, state.choices[0].engine).itl.observe_many(state.gaps)

    def record_pooling(
        self,
        model: str,
        engine: str,
        *,
        prompt_tokens: int,
        queued_s: float,
        duration_s: float,
        failure: SmgdError | None = None,
        cancelled: bool = False,
        draining: bool = False,
    ) -> None:
        """Fold one finished (or failed, or abandoned) ``/v1/embeddings`` request in, once per
        HTTP request whatever its number of inputs: ``prompt_tokens`` over all of them,
        ``queued_s`` the longest admission wait among them, ``engine`` the one that ran the
        first. A pooling request generates nothing: no TTFT, inter-token, time per output
        token or generation tokens (vLLM counts its pooling requests the same way).
        """
        if failure is not None:
            status, finish = ERROR, "error"
        elif cancelled:
            status, finish = CANCELLED, "abort"
        else:
            status, finish = OK, "stop"
        series = self._series(model, engine)
        series.requests[status] = series.requests.get(status, 0) + 1
        series.finished[finish] = series.finished.get(finish, 0) + 1
        series.tokens["prompt"] = series.tokens.get("prompt", 0) + prompt_tokens
        series.prompt_len.observe(prompt_tokens)
        series.queue.observe(queued_s)
        series.e2e.observe(duration_s)
        if failure is not None:
            self.abort(abort_reason(failure, draining=draining))
        elif cancelled:
            self.abort("drain" if draining else "client_disconnect")

    def _series(self, model: str, engine: str) -> _Series:
        labels = (model, engine)
        series = self._pairs.get(labels)
        if series is None:
            series = self._pairs[labels] = _Series()
        return series

    # ---- export
    def collect(self) -> Iterator[Metric]:
        yield _counter(
            "smgd_http_requests",
            "HTTP responses by route template, method and status code.",
            ["route", "method", "status"],
            self.http_requests.items(),
        )
        yield _counter(
            "smgd_requests",
            "Engine requests (one per choice, one per embedding request) by model, engine and "
            "outcome (ok, error, cancelled).",
            ["model", "engine", "status"],
            self._rows("requests"),
        )
        yield _counter(
            "smgd_tokens",
            "Tokens by kind: prompt (once per prompt), completion (generated), cached "
            "(prompt tokens the engine served from its prefix cache).",
            ["model", "engine", "kind"],
            self._rows("tokens"),
        )
        yield _counter(
            "smgd_aborts",
            "Requests refused or ended before their natural finish, by cause.",
            ["reason"],
            (((reason,), value) for reason, value in self.aborts.items()),
        )
        yield _counter(
            "smgd_requests_finished",
            "Engine requests (one per choice, one per embedding request) by the finish reason "
            "the client saw: stop, length, tool_calls; abort (the client left), error.",
            ["model", "engine", "finish_reason"],
            self._rows("finished"),
        )
        yield _histogram(
            "smgd_time_to_first_token_seconds",
            "Time from request arrival to a choice's first generated token.",
            self._table("ttft"),
        )
        yield _histogram(
            "smgd_inter_token_latency_seconds",
            "Gap between consecutive output events of a choice (per event, not per token).",
            self._table("itl"),
        )
        yield _histogram(
            "smgd_time_per_output_token_seconds",
            "Per choice: (last output event - first) / (output tokens - 1), the mean decode "
            "time per token after the first.",
            self._table("tpot"),
        )
        yield _histogram(
            "smgd_request_queue_time_seconds",
            "Per choice: time its engine request queued before it ran: smgd's admission queue, "
            "plus the engine's own queue where the engine reports it (vLLM).",
            self._table("queue"),
        )
        yield _histogram(
            "smgd_request_duration_seconds",
            "End-to-end request latency, arrival to last byte (or abandonment), per choice "
            "(an embedding request: once).",
            self._table("e2e"),
        )
        yield _histogram(
            "smgd_request_prompt_tokens",
            "Prompt length in tokens, once per prompt.",
            self._table("prompt_len"),
        )
        yield _histogram(
            "smgd_request_generation_tokens",
            "Output length in tokens, per choice.",
            self._table("output_len"),
        )

    def _rows(self, name: str) -> Iterator[tuple[tuple[str, str, str], int]]:
        """One counter's rows: (model, engine, third label) and the count."""
        for (model, engine), series in self._pairs.items():
            for label, count in getattr(series, name).items():
                yield (model, engine, label), count

    def _table(self, name: str) -> dict[tuple[str, str], Buckets]:
        """One histogram's series by (model, engine), those that observed anything: a pair
        appears in a histogram with its first observation there, not with the pair's first."""
        return {
            labels: hist
            for labels, series in self._pairs.items()
            if (hist := getattr(series, name)).observed
        }

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: label sets appear as requests arrive


class _Series:
    """The counters and histograms of one (model, engine) pair.

    All at once: a choice's end updates three counters and four to seven histograms, and one
    lookup of the pair (rather than one per figure, each with a key tuple of its own) is most
    of what recording a request cost.
    """

    __slots__ = (
        "e2e", "finished", "itl", "output_len", "prompt_len", "queue", "requests", "tokens",
        "tpot", "ttft",
    )  # fmt: skip

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}  # by status
        self.finished: dict[str, int] = {}  # by finish reason
        self.tokens: dict[str, int] = {}  # by kind
        self.ttft = Buckets(TTFT_BUCKETS)
        self.itl = Buckets(ITL_BUCKETS)
        self.e2e = Buckets(E2E_BUCKETS)
        self.tpot = Buckets(TPOT_BUCKETS)
        self.queue = Buckets(QUEUE_BUCKETS)
        self.prompt_len = Buckets(TOKEN_BUCKETS)
        self.output_len = Buckets(TOKEN_BUCKETS)


def _counter(
    name: str, doc: str, labels: list[str], rows: Iterable[tuple[tuple[str, ...], int]]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for values, count in rows:
        family.add_metric(list(values), count)
    return family


def _histogram(name: str, doc: str, table: dict[tuple[str, str], Buckets]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["model", "engine"])
    for labels, hist in table.items():
        family.add_metric(list(labels), hist.cumulative(), hist.total)
    return family


# Engine states whose KV figure is current (a dead engine's last report is not).
_SERVING = frozenset({"starting", "ready", "draining"})


class GatewayCollector:
    """Engine and daemon gauges, read from the gateway when Prometheus scrapes."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def collect(self) -> Iterator[Metric]:
        gateway = self.gateway
        labels = ["engine", "wire"]

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=labels)

        up = gauge("smgd_engine_up", "1 while the engine's process/connection is alive.")
        ready = gauge("smgd_engine_ready", "1 when the engine has handshaken and takes requests.")
        inflight = gauge(
            "smgd_engine_requests_inflight", "Requests submitted to the engine and not finished."
        )
        queue = gauge(
            "smgd_engine_queue_depth", "Requests waiting in smgd's admission queue for the engine."
        )
        running = gauge(
            "smgd_engine_running_requests", "Running requests as last reported by the engine."
        )
        waiting = gauge(
            "smgd_engine_waiting_requests", "Waiting requests as last reported by the engine."
        )
        kv = gauge(
            "smgd_engine_kv_cache_usage_ratio", "KV cache usage (0-1) as reported by the engine."
        )
        max_len = gauge("smgd_engine_max_model_len", "Context length from the engine handshake.")
        submitted = counter(
            "smgd_engine_requests", "Requests submitted to this engine client (resets on restart)."
        )
        generated = counter(
            "smgd_engine_generated_tokens",
            "Output tokens received from this engine client (resets on restart).",
        )
        rejected = counter(
            "smgd_engine_admission_rejected", "Requests refused by admission (queue full/timeout)."
        )
        decode_errors = counter(
            "smgd_engine_decode_errors",
            "Engine output messages smgd could not decode, or refused over limits.max_frame_mb.",
        )
        # The model-server protocol's three gauges, for the whole daemon (an endpoint picker
        # scrapes one series per server: per-engine series would make it read just one).
        queued_total = running_total = 0
        kv_values: list[float] = []
        for engine in gateway.router.engines():
            stats = engine.statistics()
            occupancy = engine.occupancy()
            queued_total += occupancy.waiting + stats.queue_depth
            running_total += occupancy.running
            if occupancy.kv_usage is not None and stats.state in _SERVING:
                kv_values.append(occupancy.kv_usage)
            values = [stats.name, stats.wire]
            up.add_metric(values, 1.0 if stats.state in ("starting", "ready") else 0.0)
            ready.add_metric(values, 1.0 if stats.state == "ready" else 0.0)
            inflight.add_metric(values, stats.in_flight)
            queue.add_metric(values, stats.queue_depth)
            if stats.load is not None:
                running.add_metric(values, stats.load.running)
                waiting.add_metric(values, stats.load.waiting)
                if stats.load.kv_usage is not None:
                    kv.add_metric(values, stats.load.kv_usage)
            if stats.max_model_len is not None:
                max_len.add_metric(values, stats.max_model_len)
            submitted.add_metric(values, stats.requests_total)
            generated.add_metric(values, stats.tokens_total)
            rejected.add_metric(values, stats.rejected_total)
            decode_errors.add_metric(values, stats.decode_errors)
        yield from (up, ready, inflight, queue, running, waiting, kv, max_len)
        yield from (submitted, generated, rejected, decode_errors)
        yield GaugeMetricFamily(
            "smgd_queued_requests",
            "Requests waiting to run: in the engines' own queues plus smgd's admission queues.",
            value=queued_total,
        )
        yield GaugeMetricFamily(
            "smgd_running_requests",
            "Requests in the engines' running batches.",
            value=running_total,
        )
        if kv_values:
            yield GaugeMetricFamily(
                "smgd_kv_cache_usage_ratio",
                "KV cache usage 0-1, the mean over the engines that report or allow an estimate.",
                value=sum(kv_values) / len(kv_values),
            )

        restarts = CounterMetricFamily(
            "smgd_engine_restarts", "Engine relaunches after a death.", labels=["engine"]
        )
        for name, count in sorted(gateway.engine_restarts.items()):
            restarts.add_metric([name], count)
        yield restarts
        yield CounterMetricFamily(
            "smgd_reloads",
            "Config reloads attempted (SIGHUP or admin).",
            value=gateway.reloads_total,
        )
        yield CounterMetricFamily(
            "smgd_reload_failures",
            "Config reloads rejected (the old config stayed).",
            value=gateway.reload_failures_total,
        )
        yield GaugeMetricFamily(
            "smgd_draining", "1 while smgd is draining for shutdown.", value=int(gateway.draining)
        )
        info = GaugeMetricFamily(
            "smgd_build_info", "smgd version (value is 1).", labels=["version"]
        )
        info.add_metric([__version__], 1)
        yield info

    def describe(self) -> list[Metric]:
        return []


def build_registry(gateway: Gateway, requests: RequestMetrics) -> CollectorRegistry:
    """A private registry: request metrics, gateway/engine gauges, process CPU/memory."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(requests)
    registry.register(GatewayCollector(gateway))
    registry.register(LoraInfoCollector(gateway.router.engines))
    ProcessCollector(registry=registry)
    return registry
