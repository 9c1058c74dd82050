"""The drain's deadline: requests still running end properly (error event, [DONE], aborts)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import trio
from hypercorn.config import Config as HypercornConfig

from smgd.admission import Admission
from smgd.api.core.execute import Cutoff, _StreamWatch
from smgd.api.http import worker_loop
from smgd.api.http.app import create_app
from smgd.api.http.dispatch import Dispatcher
from smgd.errors import Draining
from tests.fake_engine import (
    MODEL,
    Behaviour,
    FakeEngine,
    open_app,
    open_gateway,
    post,
    post_stream,
)

from .test_direct import post_sse

# 1,000 tokens at 10 ms: every request here is still running when the cut comes at 1 s.
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 1000, "stream": True}
CUT_AT_S = 1.0


def assert_drain_error(error: dict[str, Any]) -> None:
    assert error["type"] == "service_unavailable"
    assert error["code"] == "drain_timeout"
    assert "drain timeout" in error["message"]


async def cut_later(app: Dispatcher) -> None:
    await trio.sleep(CUT_AT_S)
    app.end_responses()


async def test_a_running_stream_ends_with_the_error_event_and_its_engine_request_is_aborted(
    autojump_clock: trio.abc.Clock,
) -> None:
    fake = FakeEngine()
    async with open_app(fake) as (app, _), trio.open_nursery() as nursery:
        assert isinstance(app, Dispatcher)
        nursery.start_soon(cut_later, app)
        reply = await post_stream(app, "/v1/completions", BODY)
    assert reply.status == 200
    assert reply.events[-1] == "[DONE]"
    assert_drain_error(json.loads(reply.events[-2])["error"])
    tokens = [c for c in reply.chunks() if "choices" in c]
    assert 0 < len(tokens) < 1000  # it ran until the cut, then ended
    assert [r.rid for r in fake.requests] == fake.aborts
    assert fake.abort_times[fake.aborts[0]] == CUT_AT_S
    assert fake.in_flight == 0


async def test_every_choice_of_an_n2_stream_is_aborted(autojump_clock: trio.abc.Clock) -> None:
    fake = FakeEngine()
    async with open_app(fake) as (app, _), trio.open_nursery() as nursery:
        assert isinstance(app, Dispatcher)
        nursery.start_soon(cut_later, app)
        reply = await post_stream(app, "/v1/completions", {**BODY, "n": 2})
    assert reply.events[-1] == "[DONE]"
    assert_drain_error(json.loads(reply.events[-2])["error"])
    assert sorted(r.rid for r in fake.requests) == sorted(fake.aborts)
    assert len(fake.aborts) == 2


async def test_a_non_streamed_request_gets_503_and_is_aborted(
    autojump_clock: trio.abc.Clock,
) -> None:
    fake = FakeEngine()
    async with open_app(fake) as (app, _), trio.open_nursery() as nursery:
        assert isinstance(app, Dispatcher)
        nursery.start_soon(cut_later, app)
        reply = await post(app, "/v1/completions", {**BODY, "stream": False})
    assert reply.status == 503
    assert reply.headers["retry-after"] == "5"
    assert_drain_error(reply.json()["error"])
    assert [r.rid for r in fake.requests] == fake.aborts


async def test_a_stream_waiting_for_admission_ends_without_reaching_the_engine(
    autojump_clock: trio.abc.Clock,
) -> None:
    fake = FakeEngine()
    fake.config.max_inflight = 1  # the engine takes one request at a time
    fake.admission = Admission(max_inflight=1, max_queue=10, queue_timeout_s=100)
    replies: list[Any] = []

    async def one() -> None:
        replies.append(await post_stream(app, "/v1/completions", BODY))

    async with open_app(fake) as (app, _), trio.open_nursery() as nursery:
        assert isinstance(app, Dispatcher)
        nursery.start_soon(one)
        await trio.sleep(0.1)
        nursery.start_soon(one)  # queued behind the first: the engine takes one at a time
        await trio.sleep(0.1)
        assert fake.admission.queue_depth == 1
        app.end_responses()
    running, queued = sorted(replies, key=lambda reply: reply.status)
    assert running.status == 200 and running.events[-1] == "[DONE]"
    assert_drain_error(json.loads(running.events[-2])["error"])
    # Nothing of the queued one's response went out: the cut is answered with its status.
    assert queued.status == 503 and queued.headers["retry-after"] == "5"
    assert_drain_error(json.loads(queued.raw)["error"])
    assert len(fake.requests) == 1  # the queued one never reached the engine
    assert fake.aborts == [fake.requests[0].rid]
    assert fake.admission.queue_depth == 0


async def test_a_request_after_the_cut_ends_at_once(autojump_clock: trio.abc.Clock) -> None:
    fake = FakeEngine()
    async with open_app(fake) as (app, _):
        assert isinstance(app, Dispatcher)
        app.end_responses()  # nothing running: nothing to end
        streamed = await post_stream(app, "/v1/completions", BODY)
        whole = await post(app, "/v1/completions", {**BODY, "stream": False})
    assert streamed.status == 503  # before its first event: its own status, as a whole one
    assert_drain_error(json.loads(streamed.raw)["error"])
    assert whole.status == 503
    assert fake.requests == []


# --------------------------------------------------------------------------- direct writes


@asynccontextmanager
async def serving(engine: FakeEngine) -> AsyncIterator[tuple[Dispatcher, int]]:
    """smgd's worker loop over real sockets (streams are written directly), and its app."""
    async with open_gateway(engine) as gateway:
        app = create_app(gateway, environ={})
        config = HypercornConfig()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(worker_loop.serve, app, config)
            yield app, int(binds[0].rsplit(":", 1)[1])
            nursery.cancel_scope.cancel()


async def test_a_direct_stream_ends_with_the_error_event_and_a_whole_chunked_body() -> None:
    # Real time: the reader task writes these events straight to the socket.
    fake = FakeEngine(behaviour=Behaviour(step_s=0.005))
    async with serving(fake) as (app, port), trio.open_nursery() as nursery:
        results: list[list[Any]] = []

        async def run() -> None:
            results.append(await post_sse(port, "/v1/completions", BODY))

        nursery.start_soon(run)
        with trio.fail_after(10):
            while not fake.requests:  # noqa: ASYNC110 - the fake engine signals no submit
                await trio.sleep(0.01)
            await trio.sleep(0.1)  # some events went out directly
            app.end_responses()
    # post_sse read a whole chunked body (to its terminator) with a 200 head.
    [events] = results
    assert events[-1] == "[DONE]"
    assert_drain_error(events[-2]["error"])
    assert len(events) > 3
    assert fake.aborts == [fake.requests[0].rid]


async def test_a_stream_cut_just_as_it_got_its_slot_leaves_open_stream_at_once() -> None:
    # The slot is granted, and before the task runs again the cut comes: open_stream was
    # entered with no checkpoint left to deliver the cancel, so it must be left explicitly.
    cutoff = Cutoff()
    exits: list[type[BaseException] | None] = []

    @asynccontextmanager
    async def open_stream(request: Any, checked: Any) -> AsyncIterator[str]:
        cutoff.cut("drain timeout")  # as if the cut ran while the slot was being granted
        try:
            yield "rs"
        except BaseException as exc:
            exits.append(type(exc))
            raise

    engine = SimpleNamespace(open_stream=open_stream, config=SimpleNamespace(max_inflight=1))
    job = SimpleNamespace(engine=engine, request=None, checked=None)
    watch = _StreamWatch(cutoff)
    with pytest.raises(Draining):
        async with watch.opening(job):  # type: ignore[arg-type]
            raise AssertionError("the body must not run")
    assert exits == [Draining]  # open_stream was left (its finally sends the abort)
