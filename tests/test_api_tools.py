"""Tools and reasoning in /v1/chat/completions: parser events → chunks, and the app in process.

The pure part (smgd.api.core.tools) is checked on its own: tool_choice validation, vLLM's
schemas for required / named calls, delta merging, when a request gets no parser at all. The
in-process app (fake engine writing scripted token ids, autojump clock) checks the message
and the stream, and that a plain request never builds a parser.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
import trio

import smgd.api.handlers.openai as openai_handler
from smgd.api.core.tools import (
    ParseSpec,
    ToolRequest,
    delta_fields,
    forced_constraint,
    read_tool_choice,
    required_schema,
)
from smgd.errors import InvalidRequest
from smgd.parse import ContentDelta, Event, ReasoningDelta, ToolCallDelta
from smgd.text.chat import prepare_tools
from smgd.text.tokenizer import load_tokenizer
from tests.fake_engine import (
    MODEL,
    TINY_MODEL,
    Behaviour,
    FakeEngine,
    open_app,
    post,
    post_stream,
)

TOK = load_tokenizer(TINY_MODEL)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
REPLY = (
    "<think>\nHmm.\n</think>\n\nChecking.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "tools": TOOLS,
    "max_tokens": 200,
}


def tool_request(**body: Any) -> ToolRequest:
    return read_tool_choice(body, prepare_tools(body.get("tools", TOOLS)))


# ------------------------------------------------------------------------------- pure


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
        ({"tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tool_choice": {"function": {"name": "nope"}}}, "tool_choice.function.name"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ],
)  # fmt: skip
def test_bad_tool_options_are_400s_naming_the_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        tool_request(**body)
    assert err.value.param == param


def test_tool_choice_defaults() -> None:
    assert tool_request().choice == "auto"
    assert tool_request(tools=None).choice == "none"
    named = tool_request(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (named.choice, named.name, named.forced) == ("function", "get_time", True)


def test_required_schema_is_vllms_shape() -> None:
    schema = required_schema(tool_request(tool_choice="required", parallel_tool_calls=False))
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    first, second = schema["items"]["anyOf"]
    assert first["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert first["required"] == ["name", "parameters"]
    # A tool without parameters takes an empty object (vLLM's _params_or_empty_object).
    assert second["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert "maxItems" not in required_schema(tool_request(tool_choice="required"))


def _nested(levels: int) -> dict[str, Any]:
    """An object schema whose objects nest ``levels`` deep (two JSON levels each)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("tool_choice", "levels"),
    [("required", 30), ({"type": "function", "function": {"name": "deep"}}, 32)],
)
def test_a_forced_calls_schema_is_held_to_the_nesting_limit(tool_choice: Any, levels: int) -> None:
    # response_format's schema may nest 64 levels (a deeper one can exhaust a grammar backend's
    # recursion); the schema a tool_choice makes of the tools' parameters went to the engine
    # however deep. ("required" wraps each tool's parameters in 5 levels of its own.)
    tools = [
        {"type": "function", "function": {"name": "flat"}},
        {"type": "function", "function": {"name": "deep", "parameters": _nested(levels)}},
    ]
    request = read_tool_choice({"tool_choice": tool_choice}, tools)
    with pytest.raises(InvalidRequest) as info:
        forced_constraint(request)
    assert info.value.param == "tools[1].function.parameters"
    assert "nested too deeply" in info.value.message
    shallower = [tools[0], {**tools[1], "function": {"name": "deep", "parameters": _nested(28)}}]
    assert forced_constraint(read_tool_choice({"tool_choice": tool_choice}, shallower))


def test_no_parser_without_tools_or_reasoning_parser() -> None:
    plain = ParseSpec(tool_request(tools=None))
    assert plain.for_engine("hermes", None) is None  # no tools in the request
    assert ParseSpec(tool_request()).for_engine(None, None) is None  # no tool parser
    assert ParseSpec(tool_request(tool_choice="none")).for_engine("hermes", None) is None
    assert ParseSpec(tool_request(tools=None)).for_engine(None, "qwen3") is not None


def test_delta_fields_merge_one_piece_into_one_delta() -> None:
    events: list[Event] = [
        ReasoningDelta("a"),
        ContentDelta("b"),
        ToolCallDelta(0, "", id="call_1", name="f"),
        ToolCallDelta(0, '{"x": '),
        ToolCallDelta(0, "1}"),
        ToolCallDelta(1, "{}", id="call_2", name="g"),
        ContentDelta("c"),
    ]
    assert delta_fields(events) == {
        "reasoning_content": "a",
        "content": "bc",
        "tool_calls": [
            {"index": 0, "id": "call_1", "type": "function",
             "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"index": 1, "id": "call_2", "type": "function",
             "function": {"name": "g", "arguments": "{}"}},
        ],
    }  # fmt: skip
    assert delta_fields([]) == {}


def test_parser_pieces_fold_to_the_whole_message() -> None:
    spec = ParseSpec(tool_request())
    whole = spec.for_engine("hermes", "qwen3")
    assert whole is not None
    whole.feed(REPLY)
    whole.finish()
    streamed = spec.for_engine("hermes", "qwen3")
    assert streamed is not None
    deltas = [delta_fields(streamed.feed(ch)) for ch in REPLY] + [delta_fields(streamed.finish())]
    message = whole.message()
    assert message["reasoning_content"] == "\nHmm.\n"
    assert message["content"] == "\n\nChecking.\n"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    args = "".join(
        c["function"]["arguments"]
        for d in deltas
        for c in d.get("tool_calls", [])
        if c["index"] == 0
    )
    assert json.loads(args) == {"city": "Paris"}
    assert whole.finish_reason("stop") == "tool_calls"
    assert whole.finish_reason("length") == "length"  # a cut-off call says so


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    parser = ParseSpec(tool_request(parallel_tool_calls=False)).for_engine("hermes", "qwen3")
    assert parser is not None
    events = parser.feed(REPLY) + parser.finish()
    assert {e.index for e in events if isinstance(e, ToolCallDelta)} == {0}
    assert len(parser.message()["tool_calls"]) == 1


# ------------------------------------------------------------------------------- in process


def parsing_engine(text: str = REPLY) -> FakeEngine:
    ids = TOK.encode(text, add_special_tokens=False)
    fake = FakeEngine(behaviour=Behaviour(output=ids, eos_after=len(ids)))
    fake.config = msgspec.structs.replace(
        fake.config, tool_parser="hermes", reasoning_parser="qwen3"
    )
    return fake


async def test_message_and_stream_agree(autojump_clock: trio.abc.Clock) -> None:
    fake = parsing_engine()
    async with open_app(fake) as (app, _):
        reply = await post(app, "/v1/chat/completions", CHAT)
        streamed = await post_stream(app, "/v1/chat/completions", {**CHAT, "stream": True})
    assert reply.status == 200, reply.body
    [choice] = reply.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == "\nHmm.\n"
    names = [c["function"]["name"] for c in message["tool_calls"]]
    assert names == ["get_weather", "get_time"]
    # max_tokens / usage count every token: reasoning, content, calls and the EOS.
    ids = TOK.encode(REPLY, add_special_tokens=False)
    assert reply.json()["usage"]["completion_tokens"] == len(ids) + 1
    chunks = streamed.chunks()
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0] == {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"
    }  # fmt: skip
    calls: dict[int, dict[str, str]] = {}
    content = ""
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call["function"].get("name", "")
            entry["arguments"] += call["function"]["arguments"]
    assert content == message["content"]
    assert [c["name"] for c in calls.values()] == names
    for got, want in zip(calls.values(), message["tool_calls"], strict=True):
        assert json.loads(got["arguments"]) == json.loads(want["function"]["arguments"])


async def test_include_reasoning_false_leaves_the_reasoning_out(
    autojump_clock: trio.abc.Clock,
) -> None:
    # vLLM's field (default true). It was ignored: the reasoning came back anyway.
    fake = parsing_engine()
    body = {**CHAT, "include_reasoning": False}
    async with open_app(fake) as (app, _):
        reply = await post(app, "/v1/chat/completions", body)
        streamed = await post_stream(app, "/v1/chat/completions", {**body, "stream": True})
        bad = await post(app, "/v1/chat/completions", {**CHAT, "include_reasoning": "no"})
    assert reply.status == 200, reply.body
    message = reply.json()["choices"][0]["message"]
    assert "reasoning_content" not in message
    assert message["content"] == "\n\nChecking.\n"
    assert len(message["tool_calls"]) == 2
    deltas = [c["choices"][0]["delta"] for c in streamed.chunks() if c["choices"]]
    assert not any(d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    # The reasoning's tokens were still generated: usage counts them.
    ids = TOK.encode(REPLY, add_special_tokens=False)
    assert reply.json()["usage"]["completion_tokens"] == len(ids) + 1
    assert bad.status == 400 and bad.json()["error"]["param"] == "include_reasoning"


async def test_plain_request_builds_no_parser(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No tools and no reasoning parser: the plain renderer, as before tools existed."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a parser on the plain path")

    monkeypatch.setattr(openai_handler, "ParsedRenderer", refuse)
    ids = TOK.encode(" plain text", add_special_tokens=False)
    fake = FakeEngine(behaviour=Behaviour(output=ids, eos_after=len(ids)))
    fake.config = msgspec.structs.replace(fake.config, tool_parser="hermes")
    body = {"model": MODEL, "messages": CHAT["messages"], "stream": True}
    async with open_app(fake) as (app, _):
        streamed = await post_stream(app, "/v1/chat/completions", body)
    texts = [c["choices"][0]["delta"].get("content", "") for c in streamed.chunks()]
    assert "".join(texts) == " plain text"
    assert streamed.chunks()[-1]["choices"][0]["finish_reason"] == "stop"


async def test_each_choice_of_n_has_its_own_parser(autojump_clock: trio.abc.Clock) -> None:
    fake = parsing_engine()
    async with open_app(fake) as (app, _):
        whole = await post(app, "/v1/chat/completions", {**CHAT, "n": 2})
        streamed = await post_stream(app, "/v1/chat/completions", {**CHAT, "n": 2, "stream": True})
    for choice in whole.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls"
        assert len(choice["message"]["tool_calls"]) == 2
    names: dict[int, list[str]] = {0: [], 1: []}
    finishes: dict[int, str] = {}
    for chunk in streamed.chunks():
        for choice in chunk["choices"]:
            for call in choice["delta"].get("tool_calls", []):
                if "id" in call:
                    names[choice["index"]].append(call["function"]["name"])
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert names == {0: ["get_weather", "get_time"], 1: ["get_weather", "get_time"]}
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
