"""Tool calls and reasoning through the real daemon: a scripted mock writes the markup.

The mock engine writes the reply a script gives for the prompt, one token per step; the
engine's ``tool_parser = "hermes"`` and ``reasoning_parser = "qwen3"`` turn it into
``reasoning_content``, ``content`` and ``tool_calls``. A streamed response accumulates to the
non-streamed one, the OpenAI SDK reads both, and no markup reaches ``content``.
"""

from __future__ import annotations

import json
from functools import partial
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
import trio

from .harness import daemon_toml, mock_engine_toml, serve, until

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}'
CALL = f"<tool_call>\n{WEATHER}\n</tool_call>"
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
THINK = "<think>\nThe user wants the weather.\n</think>\n\n"
# The first reply whose `when` is in the rendered prompt wins, and every prompt holds the tools
# (get_weather): the replies for other prompts come first.
SCRIPT = f"""
[[reply]]
when = "answer"
text = '''{THINK}It is 21 C.'''

[[reply]]
when = "pick one"
text = '''{THINK}[{{"name": "get_time", "parameters": {{"zone": "CET"}}}}]'''

[[reply]]
when = "city args"
text = '''{THINK}{{"city": "Paris"}}'''

[[reply]]
when = "weather and time"
text = '''{THINK}{CALL}\n{CALL2}'''

[[reply]]
when = "weather"
text = '''{THINK}Let me look.\n{CALL}'''
"""
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time"}},
]


def config(tmp_path: Path, *, grammar: bool = False) -> str:
    (tmp_path / "replies.toml").write_text(SCRIPT)
    parsers = 'tool_parser = "hermes"\nreasoning_parser = "qwen3"\n'
    engine = mock_engine_toml("e0", "m", step_ms=2.0, extra=parsers)
    engine += 'script = "replies.toml"\n'
    if grammar:  # the mock then takes constraints (and logs them; the script writes the JSON)
        engine += '[engines.structured_output]\nbackend = "xgrammar"\n'
    return daemon_toml(engine)


def body(prompt: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}]
    return {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 200, **extra}


async def chunks(client: httpx.AsyncClient, request: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    async with client.stream("POST", "/v1/chat/completions", json=request) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:]))
    return out


def accumulate(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed choice folded as clients fold it: texts joined, calls merged by index."""
    content, reasoning, finish = "", "", None
    calls: dict[int, dict[str, Any]] = {}
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                have = calls.setdefault(call["index"], {"arguments": ""})
                if "id" in call:
                    assert "name" not in have, "a call's id and name come once, first"
                    have.update(id=call["id"], type=call["type"], name=call["function"]["name"])
                else:
                    assert "name" in have, "arguments before the call's first delta"
                have["arguments"] += call["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return {"content": content, "reasoning": reasoning, "calls": calls, "finish": finish}


async def test_tool_calls_and_reasoning_streamed_and_whole(tmp_path: Path) -> None:
    async with serve(tmp_path, config(tmp_path)) as daemon, daemon.client() as client:
        whole = (await client.post("/v1/chat/completions", json=body("weather?"))).json()
        choice = whole["choices"][0]
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls"
        assert message["reasoning_content"] == "\nThe user wants the weather.\n"
        # Text around the calls is content, as the model wrote it (vLLM keeps it so too).
        assert message["content"] == "\n\nLet me look.\n"
        [call] = message["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "°C"}

        events = await chunks(client, body("weather?", stream=True))
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        streamed = accumulate(events)
        assert streamed["finish"] == "tool_calls"
        assert streamed["content"] == message["content"]
        assert streamed["reasoning"] == message["reasoning_content"]
        [got] = streamed["calls"].values()
        assert got["name"] == "get_weather" and got["type"] == "function"
        assert json.loads(got["arguments"]) == json.loads(call["function"]["arguments"])
        # Arguments arrive in pieces, not in one delta at the end.
        pieces = [
            c for e in events for ch in e["choices"] for c in ch["delta"].get("tool_calls") or []
        ]
        assert len(pieces) > 3
        # No markup in any content or reasoning delta.
        texts = streamed["content"] + streamed["reasoning"]
        assert "<tool_call>" not in texts and "<think>" not in texts

        # Two calls, indexes 0 and 1; parallel_tool_calls false keeps the first only.
        two = (await client.post("/v1/chat/completions", json=body("weather and time"))).json()
        names = [c["function"]["name"] for c in two["choices"][0]["message"]["tool_calls"]]
        assert names == ["get_weather", "get_time"]
        assert two["choices"][0]["message"]["content"] is None
        streamed = accumulate(await chunks(client, body("weather and time", stream=True)))
        assert sorted(streamed["calls"]) == [0, 1]
        one = await client.post(
            "/v1/chat/completions", json=body("weather and time", parallel_tool_calls=False)
        )
        assert [
            c["function"]["name"] for c in one.json()["choices"][0]["message"]["tool_calls"]
        ] == ["get_weather"]

        # tool_choice none: no calls parsed (the markup stays content), reasoning still split.
        none = await client.post("/v1/chat/completions", json=body("weather?", tool_choice="none"))
        message = none.json()["choices"][0]["message"]
        assert "tool_calls" not in message and "<tool_call>" in message["content"]
        assert none.json()["choices"][0]["finish_reason"] == "stop"

        # Reasoning only: finish stop, no calls.
        answer = (await client.post("/v1/chat/completions", json=body("answer?"))).json()
        assert answer["choices"][0]["message"]["content"] == "\n\nIt is 21 C."
        assert answer["choices"][0]["finish_reason"] == "stop"

        # A bad tool is a 400 naming it, and the daemon serves on.
        bad = body("weather?", tools=[{"type": "function", "function": {"name": 3}}])
        refused = await client.post("/v1/chat/completions", json=bad)
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "tools[0].function.name"
        unknown = body("weather?", tool_choice={"type": "function", "function": {"name": "x"}})
        refused = await client.post("/v1/chat/completions", json=unknown)
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "tool_choice.function.name"
        again = await client.post("/v1/chat/completions", json=body("weather?"))
        assert again.status_code == 200


async def test_openai_sdk_reads_tool_calls(tmp_path: Path) -> None:
    async with serve(tmp_path, config(tmp_path)) as daemon:
        sdk = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
        messages: Any = [{"role": "user", "content": "weather and time?"}]

        def create() -> Any:
            return sdk.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # type: ignore[arg-type]

        def streamed() -> Any:
            # The SDK's own accumulation of streamed tool-call deltas.
            with sdk.chat.completions.stream(model="m", messages=messages, tools=TOOLS) as s:  # type: ignore[arg-type]
                for _ in s:
                    pass
                return s.get_final_completion()

        try:
            whole = await trio.to_thread.run_sync(create)
            final = await trio.to_thread.run_sync(streamed)
        finally:
            sdk.close()
        for completion in (whole, final):
            choice = completion.choices[0]
            assert choice.finish_reason == "tool_calls"
            calls = choice.message.tool_calls
            assert [c.function.name for c in calls] == ["get_weather", "get_time"]
            assert json.loads(calls[1].function.arguments) == {"zone": "CET"}
        assert [c.function.arguments for c in whole.choices[0].message.tool_calls] == [
            c.function.arguments for c in final.choices[0].message.tool_calls
        ]


def sent_schemas(log: str) -> list[Any]:
    """The JSON schemas the mock engine was sent as constraints, in order (its log lines)."""
    return [
        json.loads(line.split(" json_schema: ", 1)[1])
        for line in log.splitlines()
        if " smgd.mock: constraint " in line
    ]


# What tool_choice "required" constrains the output to with TOOLS (vLLM's schema): a JSON
# array of one or more calls, each a tool's name and its parameters.
NO_PARAMETERS = {"type": "object", "properties": {}}
REQUIRED_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "anyOf": [
            {
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                "required": ["name", "parameters"],
            }
            for name, params in (
                ("get_weather", WEATHER_PARAMETERS),
                ("get_time", NO_PARAMETERS),
            )
        ],
    },
}


async def test_required_and_named_tool_choice_are_constrained(tmp_path: Path) -> None:
    """``required`` and a named function reach the engine as a JSON schema constraint (the
    mock logs each it is sent; it does not apply them: its script writes the JSON), and the
    replies parse as the calls; with a ``response_format`` as well, a 400."""
    grammar = config(tmp_path, grammar=True)
    async with serve(tmp_path, grammar) as daemon, daemon.client() as client:

        async def sent(n: int) -> bool:
            return len(sent_schemas(daemon.log())) >= n

        required = body("pick one", tool_choice="required")
        whole = (await client.post("/v1/chat/completions", json=required)).json()
        choice = whole["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_time"
        assert json.loads(call["function"]["arguments"]) == {"zone": "CET"}
        streamed = accumulate(await chunks(client, {**required, "stream": True}))
        assert streamed["finish"] == "tool_calls" and streamed["content"] == ""
        assert [c["name"] for c in streamed["calls"].values()] == ["get_time"]
        await until(partial(sent, 2), 10)
        assert sent_schemas(daemon.log()) == [REQUIRED_SCHEMA] * 2

        named = {"type": "function", "function": {"name": "get_weather"}}
        whole = (
            await client.post("/v1/chat/completions", json=body("city args", tool_choice=named))
        ).json()
        choice = whole["choices"][0]
        assert choice["finish_reason"] == "stop"  # OpenAI's (and vLLM's) for a named call
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        await until(partial(sent, 3), 10)
        assert sent_schemas(daemon.log())[2] == WEATHER_PARAMETERS

        # With another constraint: a 400 naming tool_choice, and nothing reaches the engine.
        both = body("pick one", tool_choice="required", response_format={"type": "json_object"})
        refused = await client.post("/v1/chat/completions", json=both)
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "tool_choice"
        # The engine logs in the order it is sent requests: a named call's constraint after
        # the refusal comes right after the first one's.
        again = await client.post("/v1/chat/completions", json=body("city args", tool_choice=named))
        assert again.status_code == 200
        await until(partial(sent, 4), 10)
        assert sent_schemas(daemon.log()) == [REQUIRED_SCHEMA] * 2 + [WEATHER_PARAMETERS] * 2


async def test_required_tool_choice_needs_a_grammar_backend(tmp_path: Path) -> None:
    async with serve(tmp_path, config(tmp_path)) as daemon, daemon.client() as client:
        refused = await client.post(
            "/v1/chat/completions", json=body("pick one", tool_choice="required")
        )
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "tool_choice"
        assert (await client.post("/v1/chat/completions", json=body("answer"))).status_code == 200


async def test_langchain_bind_tools(tmp_path: Path) -> None:
    """LangChain's ChatOpenAI with bound tools gets the calls, whole and streamed."""
    from langchain_openai import ChatOpenAI
    from pydantic import SecretStr

    async with serve(tmp_path, config(tmp_path)) as daemon:
        llm = ChatOpenAI(
            model="m",
            base_url=daemon.url + "/v1",
            api_key=SecretStr("unused"),
            max_retries=0,
        ).bind_tools(TOOLS)

        def invoke() -> Any:
            return llm.invoke("weather and time?")

        def streamed() -> Any:
            gathered: Any = None
            for chunk in llm.stream("weather and time?"):
                gathered = chunk if gathered is None else gathered + chunk
            return gathered

        whole = await trio.to_thread.run_sync(invoke)
        gathered = await trio.to_thread.run_sync(streamed)
    for message in (whole, gathered):
        assert [(c["name"], c["args"]) for c in message.tool_calls] == [
            ("get_weather", {"city": "Paris", "unit": "°C"}),
            ("get_time", {"zone": "CET"}),
        ]
        assert all(c["id"].startswith("call_") for c in message.tool_calls)
