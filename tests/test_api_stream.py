"""Streaming lifecycle: client disconnect → engine abort, keep-alives, mid-stream failures."""

from __future__ import annotations

import logging

import pytest
import trio

from smgd.config import ServerConfig
from smgd.wire.common import Finish, FinishReason
from tests.fake_engine import MODEL, Behaviour, FakeEngine, open_app, post, post_stream

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 1000, "stream": True}


async def test_disconnect_aborts_engine_request(autojump_clock: trio.abc.Clock) -> None:
    fake = FakeEngine(behaviour=Behaviour(step_s=1.0))
    async with open_app(fake) as (app, _):
        reply = await post_stream(app, "/v1/completions", BODY, disconnect_after=2)
        [req] = fake.requests
        with trio.fail_after(5):
            await fake.wait_abort(req.rid)
        # Within one engine step of the hang-up (no step happened in between).
        assert reply.disconnected_at is not None
        assert fake.abort_times[req.rid] - reply.disconnected_at < fake.behaviour.step_s
        assert fake.in_flight == 0
    assert len(reply.chunks()) == 2


async def test_disconnect_aborts_every_choice_of_n(autojump_clock: trio.abc.Clock) -> None:
    fake = FakeEngine(behaviour=Behaviour(step_s=1.0))
    async with open_app(fake) as (app, _):
        await post_stream(app, "/v1/completions", {**BODY, "n": 3}, disconnect_after=2)
        with trio.fail_after(5):
            for req in fake.requests:
                await fake.wait_abort(req.rid)
        assert len(fake.requests) == 3
        assert fake.in_flight == 0


async def test_keepalive_comments_while_waiting(autojump_clock: trio.abc.Clock) -> None:
    fake = FakeEngine(behaviour=Behaviour(first_step_s=10.0))
    server = ServerConfig(keepalive_interval_s=3.0)
    async with open_app(fake, server=server) as (app, _):
        reply = await post_stream(app, "/v1/completions", {**BODY, "max_tokens": 2})
    assert reply.comments == 3  # at 3, 6, 9 s of a 10 s prefill
    assert reply.raw.startswith(b": keep-alive\n\n")
    assert reply.events[-1] == "[DONE]"
    assert len(reply.chunks()) >= 1


async def test_keepalive_for_n2(autojump_clock: trio.abc.Clock) -> None:
    fake = FakeEngine(behaviour=Behaviour(first_step_s=10.0))
    server = ServerConfig(keepalive_interval_s=4.0)
    async with open_app(fake, server=server) as (app, _):
        reply = await post_stream(app, "/v1/completions", {**BODY, "max_tokens": 2, "n": 2})
    assert reply.comments == 2
    assert reply.events[-1] == "[DONE]"


@pytest.mark.parametrize("n", [1, 2])
async def test_no_keepalive_comments_by_default(autojump_clock: trio.abc.Clock, n: int) -> None:
    # SGLang's bench_serving json-decodes every line: a comment line breaks it. Off unless set.
    fake = FakeEngine(behaviour=Behaviour(first_step_s=60.0))
    async with open_app(fake) as (app, _):
        reply = await post_stream(app, "/v1/completions", {**BODY, "max_tokens": 2, "n": n})
    assert reply.comments == 0
    assert b": keep-alive" not in reply.raw
    assert reply.events[-1] == "[DONE]"


async def test_engine_death_mid_stream_is_error_event(autojump_clock: trio.abc.Clock) -> None:
    fake = FakeEngine(behaviour=Behaviour(die_after=3))
    async with open_app(fake) as (app, _):
        reply = await post_stream(app, "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True,
        })  # fmt: skip
    assert reply.status == 200
    assert reply.events[-1] == "[DONE]"
    error = reply.chunks()[-1]
    assert error["error"]["type"] == "engine_error"
    assert "fake engine crashed" in error["error"]["message"]
    assert len(reply.chunks()) > 1  # some content came first


async def test_engine_death_n2_is_error_event(autojump_clock: trio.abc.Clock) -> None:
    fake = FakeEngine(behaviour=Behaviour(die_after=3))
    async with open_app(fake) as (app, _):
        reply = await post_stream(app, "/v1/completions", {**BODY, "n": 2})
    assert reply.events[-1] == "[DONE]"
    assert reply.chunks()[-1]["error"]["type"] == "engine_error"


async def test_engine_death_non_stream_is_502(autojump_clock: trio.abc.Clock) -> None:
    fake = FakeEngine(behaviour=Behaviour(die_after=2))
    async with open_app(fake) as (app, _):
        reply = await post(app, "/v1/completions", {"model": MODEL, "prompt": "hi"})
    assert reply.status == 502
    assert reply.json()["error"]["type"] == "engine_error"


async def test_engine_not_ready_is_503_with_retry_after(autojump_clock: trio.abc.Clock) -> None:
    from smgd.engines.state import EngineState

    fake = FakeEngine()
    async with open_app(fake) as (app, _):
        fake.state = EngineState.STARTING
        reply = await post(app, "/v1/completions", {"model": MODEL, "prompt": "hi"})
        assert reply.status == 503
        assert reply.headers["retry-after"] == "2"
        assert reply.json()["error"]["type"] == "service_unavailable"
    assert fake.requests == []


async def test_a_long_stream_is_not_cut(autojump_clock: trio.abc.Clock) -> None:
    # 100 steps of 1 s: past the 60 s body timeout, and Quart's response timeout once.
    fake = FakeEngine(behaviour=Behaviour(step_s=1.0))
    async with open_app(fake) as (app, _):
        reply = await post_stream(app, "/v1/completions", {**BODY, "max_tokens": 100})
    assert reply.events[-1] == "[DONE]"
    assert reply.chunks()[-1]["choices"][0]["finish_reason"] == "length"


def _done_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "smgd.api" and " done: " in r.getMessage()]


@pytest.mark.parametrize(
    ("behaviour", "level", "error"),
    [
        (Behaviour(), logging.INFO, None),  # a finished request
        # The engine refused the request (a 4xx): the client's problem, info.
        (
            Behaviour(finish=Finish(reason=FinishReason.ABORT, message="nope", status_code=400)),
            logging.INFO,
            "nope",
        ),
        (Behaviour(die_after=3), logging.WARNING, "failed"),  # the engine died: warning
    ],
)
async def test_a_request_failed_by_an_engine_is_logged_at_warning(
    autojump_clock: trio.abc.Clock,
    caplog: pytest.LogCaptureFixture,
    behaviour: Behaviour,
    level: int,
    error: str | None,
) -> None:
    caplog.set_level(logging.INFO, logger="smgd.api")
    async with open_app(FakeEngine(behaviour=behaviour)) as (app, _):
        await post_stream(app, "/v1/completions", {**BODY, "max_tokens": 5})
    [record] = _done_records(caplog)
    assert record.levelno == level
    if error is None:
        assert "error" not in record.getMessage()
    else:
        assert error in record.getMessage()  # the human line says what went wrong


async def test_a_request_its_client_left_is_logged_as_a_disconnect(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    # nginx's 499 in the line, and a field a JSON log can be filtered on; a finished request
    # beside it says neither.
    caplog.set_level(logging.INFO, logger="smgd.api")
    async with open_app(FakeEngine(behaviour=Behaviour(step_s=1.0))) as (app, _):
        await post_stream(app, "/v1/completions", BODY, disconnect_after=2)
        await post_stream(app, "/v1/completions", {**BODY, "max_tokens": 3})
    left, finished = _done_records(caplog)
    assert left.getMessage().endswith("finish none, client disconnected (499)")
    assert left.client_disconnected is True  # type: ignore[attr-defined]
    assert left.levelno == logging.INFO  # the client's doing: nothing for an operator to fix
    assert "disconnected" not in finished.getMessage()
    assert finished.client_disconnected is False  # type: ignore[attr-defined]
