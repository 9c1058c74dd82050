"""An engine that fails before the first token: the request moves to another engine.

After the first token a stream is never replayed: the failure is reported instead.
"""

from __future__ import annotations

import json
import logging

import pytest

from .engine_harness import VocabularyScans
from .fake_engine import (
    MODEL,
    Behaviour,
    DiesBeforeFirstToken,
    FakeEngine,
    open_app,
    post,
    post_stream,
)

BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 6, "temperature": 0}


async def test_streamed_request_moves_to_another_engine_before_its_first_token() -> None:
    bad, good = DiesBeforeFirstToken("a"), FakeEngine("b")
    async with open_app(bad, good) as (app, _):
        reply = await post_stream(app, "/v1/completions", {**BODY, "stream": True})
    assert reply.status == 200
    assert reply.events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in reply.events[:-1]]
    assert not any("error" in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(bad.requests) == 1 and len(good.requests) == 1
    assert bad.requests[0].rid != good.requests[0].rid  # a fresh engine rid for the retry


async def test_non_streamed_request_moves_to_another_engine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bad, good = DiesBeforeFirstToken("a"), FakeEngine("b")
    with caplog.at_level(logging.WARNING, logger="smgd.api"):
        async with open_app(bad, good) as (app, _):
            reply = await post(app, "/v1/completions", BODY)
    assert reply.status == 200, reply.body
    assert reply.json()["usage"]["completion_tokens"] == 6
    assert len(good.requests) == 1
    # The operator's trace of the move: which request, which engine failed, where it went.
    rid = bad.requests[0].rid
    moves = [r.getMessage() for r in caplog.records if "retrying on" in r.getMessage()]
    assert moves == [f"request {rid}: engine a failed before the first token; retrying on b"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_moved_request_is_scanned_once_on_each_engine(
    monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    # Its prompt ids are checked against each engine's vocabulary once: when it is planned on
    # the first, when it is moved to the second; neither submit scans them again.
    scans = VocabularyScans(monkeypatch)
    bad, good = DiesBeforeFirstToken("a"), FakeEngine("b")
    async with open_app(bad, good) as (app, _):
        if stream:
            streamed = await post_stream(app, "/v1/completions", {**BODY, "stream": True})
            assert streamed.status == 200 and streamed.events[-1] == "[DONE]"
        else:
            assert (await post(app, "/v1/completions", BODY)).status == 200
    assert len(bad.requests) == 1 and len(good.requests) == 1
    assert scans.prompts == [bad.requests[0].prompt_ids, good.requests[0].prompt_ids]


async def test_no_retry_after_the_first_token() -> None:
    bad = FakeEngine("a", behaviour=Behaviour(die_after=2))
    good = FakeEngine("b")
    async with open_app(bad, good) as (app, _):
        reply = await post_stream(app, "/v1/completions", {**BODY, "stream": True})
    assert reply.status == 200
    assert any("error" in e for e in reply.events if e != "[DONE]")
    assert good.requests == []  # never replayed


async def test_no_other_engine_reports_the_failure() -> None:
    async with open_app(DiesBeforeFirstToken("a")) as (app, _):
        reply = await post(app, "/v1/completions", BODY)
    assert reply.status in (502, 503)
    assert "crashed during prefill" in reply.json()["error"]["message"]


async def test_n2_streams_move_to_another_engine_before_their_first_token() -> None:
    bad, good = DiesBeforeFirstToken("a"), FakeEngine("b")
    async with open_app(bad, good) as (app, _):
        reply = await post_stream(
            app, "/v1/completions", {**BODY, "stream": True, "n": 2, "temperature": 1}
        )  # n > 1 cannot be greedy
    assert reply.status == 200
    chunks = [json.loads(e) for e in reply.events if e != "[DONE]"]
    assert not any("error" in c for c in chunks)
    finishes = {
        c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
        for c in chunks
        if c["choices"] and c["choices"][0]["finish_reason"]
    }
    assert finishes == {0: "length", 1: "length"}
    assert len(good.requests) >= 1  # at least the choice that went to `a` moved to `b`
