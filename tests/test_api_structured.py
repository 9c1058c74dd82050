"""Structured output through the HTTP layer (in-process fake engine): what reaches the engine,
and how a refusal looks to the client, streamed or not, on every endpoint that takes one."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
import trio

from smgd import sampling
from smgd.config import StructuredOutputConfig
from smgd.wire.common import Finish, FinishReason, Structured, StructuredKind
from tests.fake_engine import MODEL, Behaviour, FakeEngine, open_app, post, post_stream

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
# What SGLang's scheduler answers for a schema its xgrammar cannot compile.
GRAMMAR_ABORT = Finish(
    reason=FinishReason.ABORT, message="Failed to compile json grammar: bad", status_code=400
)


def with_grammar(engine: FakeEngine) -> FakeEngine:
    """The fake engine is a mock (no grammar backend) unless its config names one."""
    so = StructuredOutputConfig(backend="xgrammar")
    engine.config = msgspec.structs.replace(engine.config, structured_output=so)
    return engine


@pytest.mark.parametrize(
    ("path", "body", "want"),
    [
        ("/v1/chat/completions", {**CHAT, "response_format": JSON_SCHEMA},
         Structured(kind=StructuredKind.JSON, param="response_format", spec=SCHEMA)),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "guided_choice": ["a", "b"]},
         Structured(kind=StructuredKind.CHOICE, param="guided_choice", choices=("a", "b"))),
        ("/generate", {"text": "x", "sampling_params": {"regex": "[0-9]+"}},
         Structured(kind=StructuredKind.REGEX, param="sampling_params.regex", spec="[0-9]+")),
    ],
)  # fmt: skip
async def test_the_constraint_reaches_the_engine(
    autojump_clock: trio.abc.Clock, path: str, body: dict[str, Any], want: Structured
) -> None:
    fake = with_grammar(FakeEngine())
    async with open_app(fake) as (app, _):
        reply = await post(app, path, {**body, "max_tokens": 3} if path != "/generate" else body)
    assert reply.status == 200, reply.body
    assert [r.sampling.structured for r in fake.requests] == [want]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}},
         "response_format"),
        ("/v1/completions", {"model": MODEL, "prompt": "x",
                             "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
        ("/generate", {"text": "x", "sampling_params": {"json_schema": "{}"}},
         "sampling_params.json_schema"),
    ],
)  # fmt: skip
async def test_the_mock_engine_has_no_grammar_backend(
    autojump_clock: trio.abc.Clock, path: str, body: dict[str, Any], param: str
) -> None:
    fake = FakeEngine()
    async with open_app(fake) as (app, _):
        reply = await post(app, path, body)
        streamed = await post(app, path, {**body, "stream": True})
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert error["message"].startswith("engine fake has no grammar backend")
    assert streamed.status == 400  # refused before the stream starts
    assert streamed.json() == reply.json()
    assert fake.requests == []


async def test_a_refused_grammar_is_a_400_naming_the_param(autojump_clock: trio.abc.Clock) -> None:
    fake = with_grammar(FakeEngine(behaviour=Behaviour(finish=GRAMMAR_ABORT)))
    async with open_app(fake) as (app, _):
        reply = await post(app, "/v1/chat/completions", {**CHAT, "response_format": JSON_SCHEMA})
        stream = await post_stream(
            app, "/v1/chat/completions", {**CHAT, "response_format": JSON_SCHEMA, "stream": True}
        )
        plain = await post(app, "/v1/chat/completions", {**CHAT, "max_tokens": 2})
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "response_format")
    assert error["message"] == (
        "engine fake could not apply the structured output constraint in `response_format`: "
        "Failed to compile json grammar: bad"
    )
    # Streamed, the refusal comes before the first event, while the head still waits for it:
    # the same 400 with the same envelope, and no stream.
    assert stream.status == 400 and stream.events == []
    assert json.loads(stream.raw) == {"error": error}
    # The same abort for a request without a constraint is an engine rejection naming nothing.
    assert plain.status == 400
    assert plain.json()["error"]["param"] is None


async def test_a_batchs_schema_is_read_once_for_all_its_prompts(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reading a schema walks it (its nesting), a cost that grows with it: 3 MB took 70 ms, and
    # it was read again for each of up to 64 prompts (tests/faults/test_feature_surface.py).
    walks: list[object] = []
    walk = sampling._too_deep

    def counted(value: Any) -> bool:
        walks.append(value)
        return walk(value)

    monkeypatch.setattr(sampling, "_too_deep", counted)
    fake = with_grammar(FakeEngine())
    body = {"model": MODEL, "prompt": ["a", "bb", "ccc"], "max_tokens": 2}
    async with open_app(fake) as (app, _):
        reply = await post(app, "/v1/completions", {**body, "guided_json": SCHEMA})
        typo = await post(app, "/v1/completions", {**body, "structured_outputs": {"jsn": {}}})
    assert reply.status == 200, reply.body
    assert walks == [SCHEMA]
    want = Structured(kind=StructuredKind.JSON, param="guided_json", spec=SCHEMA)
    assert [r.sampling.structured for r in fake.requests[:3]] == [want] * 3
    assert typo.status == 200  # an unknown field is ignored, as vLLM does, for every prompt
    assert [r.sampling.structured for r in fake.requests[3:]] == [None] * 3
