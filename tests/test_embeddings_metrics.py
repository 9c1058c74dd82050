"""``/v1/embeddings`` in the request series: once per request, no generation figures."""

from __future__ import annotations

import msgspec
import pytest
import trio

from .fake_engine import MODEL, open_app, post
from .test_embeddings_core import FakeEmbedder
from .test_metrics import scrape, value

GENERATION_SERIES = (
    "smgd_time_to_first_token_seconds_count",
    "smgd_inter_token_latency_seconds_count",
    "smgd_time_per_output_token_seconds_count",
    "smgd_request_generation_tokens_count",
)


async def test_each_request_counts_once_with_its_inputs_tokens(
    autojump_clock: trio.abc.Clock,
) -> None:
    bodies = [[[5, 6, 7]], [[5], [6, 7], [8, 9, 10, 11]], [1, 2]]  # 3 requests, 6 inputs
    async with open_app(FakeEmbedder("a")) as (app, _):
        for ids in bodies:
            reply = await post(app, "/v1/embeddings", {"model": MODEL, "input": ids})
            assert reply.status == 200, reply.body
        samples, _ = await scrape(app)
    labels = {"model": MODEL, "engine": "a"}
    tokens = 3 + (1 + 2 + 4) + 2
    assert value(samples, "smgd_requests_finished_total", finish_reason="stop", **labels) == 3
    assert value(samples, "smgd_requests_total", status="ok", **labels) == 3
    assert value(samples, "smgd_request_prompt_tokens_count", **labels) == 3
    assert value(samples, "smgd_request_prompt_tokens_sum", **labels) == tokens
    assert value(samples, "smgd_tokens_total", kind="prompt", **labels) == tokens
    assert value(samples, "smgd_request_duration_seconds_count", **labels) == 3
    # The fake embeds every input after one 10 ms step: the autojump clock makes that exact.
    assert value(samples, "smgd_request_duration_seconds_sum", **labels) == pytest.approx(0.03)
    assert value(samples, "smgd_request_queue_time_seconds_count", **labels) == 3
    for name in GENERATION_SERIES:
        assert value(samples, name, **labels) == 0, name
    assert value(samples, "smgd_tokens_total", kind="completion", **labels) == 0


async def test_a_failed_request_counts_as_error_once(autojump_clock: trio.abc.Clock) -> None:
    async with open_app(FakeEmbedder("a", dies=True)) as (app, _):
        reply = await post(app, "/v1/embeddings", {"model": MODEL, "input": [[5, 6], [7]]})
        assert reply.status in (502, 503)
        samples, _ = await scrape(app)
    labels = {"model": MODEL, "engine": "a"}
    assert value(samples, "smgd_requests_finished_total", finish_reason="error", **labels) == 1
    assert value(samples, "smgd_requests_finished_total", finish_reason="stop", **labels) == 0
    assert value(samples, "smgd_requests_total", status="error", **labels) == 1
    assert value(samples, "smgd_request_prompt_tokens_sum", **labels) == 3
    assert value(samples, "smgd_aborts_total", reason="engine_error") == 1  # not twice


async def test_a_client_that_leaves_counts_as_abort(autojump_clock: trio.abc.Clock) -> None:
    async with open_app(FakeEmbedder("a")) as (app, _):
        with trio.move_on_after(0.005):  # before the fake's 10 ms step answers
            await post(app, "/v1/embeddings", {"model": MODEL, "input": [[5, 6]]})
        samples, _ = await scrape(app)
    labels = {"model": MODEL, "engine": "a"}
    assert value(samples, "smgd_requests_finished_total", finish_reason="abort", **labels) == 1
    assert value(samples, "smgd_aborts_total", reason="client_disconnect") == 1


async def test_queue_time_is_the_longest_wait_among_its_inputs(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = FakeEmbedder("a")
    engine.reconfigure(msgspec.structs.replace(engine.config, max_inflight=1))
    async with open_app(engine) as (app, _):
        # One slot: the inputs run one after another, 10 ms each; the third waits 20 ms.
        reply = await post(app, "/v1/embeddings", {"model": MODEL, "input": [[5], [6], [7]]})
        assert reply.status == 200, reply.body
        samples, _ = await scrape(app)
    labels = {"model": MODEL, "engine": "a"}
    assert value(samples, "smgd_request_queue_time_seconds_count", **labels) == 1
    assert value(samples, "smgd_request_queue_time_seconds_sum", **labels) == pytest.approx(0.02)
    assert value(samples, "smgd_request_duration_seconds_sum", **labels) == pytest.approx(0.03)
