r"""Tool calling on the REAL engines, through the whole daemon (``smgd serve``, HTTP).

Needs both engine venvs and tiny models (``.ci/sglang-env.sh``, ``.ci/vllm-env.sh``)::

    set -a; eval "$(bash .ci/vllm-env.sh)"; eval "$(bash .ci/sglang-env.sh)"; set +a
    .venv/bin/python -m pytest -q -m real_engine tests/real_engines/test_tools_real.py

One daemon per engine (module-scoped; launched like test_structured_real.py's, by
:mod:`.daemon_real`), with ``tool_parser = "hermes"`` and ``hermes_tools.jinja`` as the chat
template (the tiny models' own templates render no tools, and smgd refuses ``tools`` for such a
template). The model is random: only the engine's grammar, built by smgd from ``tool_choice``
(vLLM's schemas), makes it write a call, so every valid call below proves the constraint went
through. Parameters are bounded (strings by ``pattern``: xgrammar's ``maxLength`` lets control
characters through, see test_structured_real.py; integers by bounds) so a random model finishes.

Per engine: a named ``tool_choice`` gives exactly one call of that function whose arguments
validate, ``finish_reason: "stop"``; streamed and whole agree (greedy); ``required`` gives valid
calls of declared tools with ``finish_reason: "tool_calls"`` (one without parallel calls; with
them, several streamed under their own index and id); the OpenAI SDK's streaming accumulation of
the tool-call deltas gives the same call; a call and its tool result go back through the
template and the next forced call comes; LangChain's ``with_structured_output`` gets a valid
pydantic object with both its methods (its default, ``json_schema``: a ``response_format``; and
``function_calling``: a named ``tool_choice``), and its ``bind_tools`` with a forced choice gets
parsed ``tool_calls``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest
from langchain_core.messages import AIMessage
from langchain_openai import ChatOpenAI

from .daemon_real import MODEL, post, serve

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]

TEMPLATE = Path(__file__).with_name("hermes_tools.jinja")
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# SGLang's tiny tokenizer spends about a token per character: a required array of one call is
# up to ~75 tokens, of three ~120; the prompt is 334 (vLLM's: 190), the context 512.
MAX_TOKENS = 128


class Weather(pydantic.BaseModel):
    """get_weather's arguments: bounded so a random model's call ends."""

    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(pattern="^[a-z]{1,8}$")
    days: int = pydantic.Field(ge=1, le=7)


class Clock(pydantic.BaseModel):
    """get_time's arguments."""

    model_config = pydantic.ConfigDict(extra="forbid")
    zone: str = pydantic.Field(pattern="^[A-Z]{3}$")


ARGUMENTS: dict[str, type[pydantic.BaseModel]] = {"get_weather": Weather, "get_time": Clock}
# Written out rather than pydantic's schemas (titles, descriptions): the tools go into a prompt
# and the tiny models' context is 512 tokens, ~1 token per character of JSON.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module", params=["sglang", "vllm"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    with serve(request.param, template=TEMPLATE, extra='tool_parser = "hermes"\n') as base:
        yield base


def chat(url: str, **body: Any) -> dict[str, Any]:
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": MAX_TOKENS, **body}
    reply = post(url, "/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    choice: dict[str, Any] = reply.json()["choices"][0]
    return choice


def streamed(url: str, **body: Any) -> tuple[dict[str, Any], str | None]:
    """The streamed message put together from its deltas by OpenAI's rules, checking each
    call's first delta carries its id, type and name; and the finish reason."""
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": MAX_TOKENS, **body}
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={"model": MODEL, **body, "stream": True},
        timeout=120,
    ) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            delta = choice["delta"]
            content.append(delta.get("content") or "")
            for piece in delta.get("tool_calls") or []:
                if piece["index"] not in calls:
                    assert piece["id"] and piece["type"] == "function", piece
                    assert piece["function"]["name"], piece
                    calls[piece["index"]] = {
                        "id": piece["id"],
                        "type": "function",
                        "function": {"name": piece["function"]["name"], "arguments": ""},
                    }
                else:
                    assert "id" not in piece and "name" not in piece["function"], piece
                call = calls[piece["index"]]
                call["function"]["arguments"] += piece["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    assert sorted(calls) == list(range(len(calls)))  # indexes 0, 1, ... in order
    message = {"content": "".join(content), "tool_calls": [calls[i] for i in sorted(calls)]}
    return message, finish


def valid(call: dict[str, Any]) -> pydantic.BaseModel:
    """The call's arguments, validated against its tool's parameters."""
    assert call["type"] == "function" and call["id"], call
    function = call["function"]
    assert function["name"] in ARGUMENTS, call
    return ARGUMENTS[function["name"]].model_validate_json(function["arguments"])


def test_named_tool_choice_yields_one_valid_call(url: str) -> None:
    for temperature, seed in [(0.0, 0), (1.0, 0), (1.0, 1), (1.0, 2)]:
        choice = chat(url, tool_choice=NAMED, temperature=temperature, seed=seed)
        message = choice["message"]
        assert choice["finish_reason"] == "stop", choice  # vLLM's (and OpenAI's) for a named call
        assert len(message["tool_calls"]) == 1, message
        assert message["tool_calls"][0]["function"]["name"] == "get_weather"
        assert isinstance(valid(message["tool_calls"][0]), Weather)
        assert not message.get("content"), message  # the call is not echoed as text


def test_named_call_streamed_is_the_whole_call(url: str) -> None:
    whole = chat(url, tool_choice=NAMED, temperature=0, seed=7)
    message, finish = streamed(url, tool_choice=NAMED, temperature=0, seed=7)
    assert finish == whole["finish_reason"] == "stop"
    assert message["content"] == (whole["message"].get("content") or "")
    [call] = message["tool_calls"]
    [expected] = whole["message"]["tool_calls"]
    assert call["function"] == expected["function"]  # name and the very argument bytes
    valid(call)


def test_required_yields_valid_calls_of_declared_tools(url: str) -> None:
    for seed in range(3):
        choice = chat(
            url, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed
        )
        [call] = choice["message"]["tool_calls"]  # one at most without parallel calls
        valid(call)
        assert choice["finish_reason"] == "tool_calls", choice


def test_required_with_parallel_calls(url: str) -> None:
    """With parallel calls the array has no bound: after each call the random model picks
    ``,`` (another call) or ``]``, so some samples run to ``max_tokens`` (then the partial
    JSON comes back as text, as vLLM does). Every finished one is valid calls."""
    finished = 0
    for seed in range(6):
        choice = chat(url, tool_choice="required", temperature=1.0, seed=seed)
        if choice["finish_reason"] == "length":
            assert choice["message"]["content"].startswith('[{"name":'), choice
            assert not choice["message"].get("tool_calls"), choice
            continue
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert calls, choice
        for call in calls:
            valid(call)
        finished += 1
    assert finished, "no sample closed its array of calls"


def test_several_calls_stream_as_the_whole_answer(url: str, request: pytest.FixtureRequest) -> None:
    """A streamed sample that wrote more than one call: each call under its own index and id,
    each valid; on vLLM, where a seed reproduces the sample, the same calls as the whole
    answer. SGLang 0.5.23 honours ``sampling_seed`` only when launched with
    ``--enable-deterministic-inference``, so there a seeded sample is not reproducible and only
    the streamed calls are checked."""
    # About one sample in six writes two calls or more (measured on both engines, first six
    # seeds): 30 samples miss on SGLang (not reproducible) with a chance of (5/6)^30 < 0.5 %.
    for seed in range(30):
        message, finish = streamed(url, tool_choice="required", temperature=1.0, seed=seed)
        calls = message["tool_calls"]
        if finish != "tool_calls" or len(calls) < 2:
            continue
        for call in calls:
            valid(call)
        assert len({c["id"] for c in calls}) == len(calls)  # one id per call
        if request.node.callspec.params["url"] == "vllm":
            whole = chat(url, tool_choice="required", temperature=1.0, seed=seed)
            assert whole["finish_reason"] == finish
            assert [c["function"] for c in calls] == [
                c["function"] for c in whole["message"]["tool_calls"]
            ]
        return
    pytest.fail("no streamed sample of 30 wrote two calls")


def test_required_streamed_is_the_whole_answer(url: str) -> None:
    body: dict[str, Any] = {"tool_choice": "required", "parallel_tool_calls": False}
    whole = chat(url, **body, temperature=0, seed=3)
    message, finish = streamed(url, **body, temperature=0, seed=3)
    assert finish == whole["finish_reason"] == "tool_calls"
    assert [c["function"] for c in message["tool_calls"]] == [
        c["function"] for c in whole["message"]["tool_calls"]
    ]


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_openai_sdk_stream_accumulates_the_same_call(url: str, tool_choice: Any) -> None:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        common: dict[str, Any] = {
            "model": MODEL,
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": tool_choice,
            "parallel_tool_calls": False,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "seed": 5,
        }
        whole = client.chat.completions.create(**common)
        with client.chat.completions.stream(**common) as stream:
            final = stream.get_final_completion()
        [expected] = whole.choices[0].message.tool_calls or []
        [call] = final.choices[0].message.tool_calls or []
        assert (call.function.name, call.function.arguments) == (
            expected.function.name,
            expected.function.arguments,
        )
        assert call.id  # the SDK kept the first delta's id
        assert final.choices[0].finish_reason == whole.choices[0].finish_reason
    valid(call.model_dump())


def llm(url: str, http: httpx.Client) -> ChatOpenAI:
    """LangChain's OpenAI chat model on the daemon, greedy, over ``http`` (closed by the
    caller: LangChain keeps its own clients open otherwise)."""
    return ChatOpenAI(
        model=MODEL,
        base_url=f"{url}/v1",
        api_key=pydantic.SecretStr("unused"),
        max_retries=0,
        temperature=0,
        max_completion_tokens=MAX_TOKENS,
        http_client=http,
    )


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(
    url: str, method: Literal["function_calling", "json_schema"]
) -> None:
    """``json_schema`` (``ChatOpenAI``'s default in langchain-openai 1.x) sends the schema as
    ``response_format``; ``function_calling`` as a tool and a named ``tool_choice``. Both need
    the engine's grammar here, and both come back as a validated ``Weather``."""
    with httpx.Client(timeout=120) as http:
        structured = llm(url, http).with_structured_output(Weather, method=method, include_raw=True)
        out = structured.invoke("What is the weather in Paris?")
    assert isinstance(out, dict)
    assert out["parsing_error"] is None, out
    assert isinstance(out["parsed"], Weather), out
    if method == "function_calling":
        assert out["raw"].tool_calls[0]["name"] == "Weather", out


@pytest.mark.parametrize("tool_choice", ["get_weather", "any"])
def test_langchain_bind_tools_forced(url: str, tool_choice: str) -> None:
    """``bind_tools`` with a forced choice (a name: a named ``tool_choice``; ``"any"``:
    ``required``): LangChain reads the calls into ``tool_calls`` with parsed ``args``."""
    with httpx.Client(timeout=120) as http:
        forced = llm(url, http).bind_tools(
            TOOLS, tool_choice=tool_choice, parallel_tool_calls=False
        )
        reply = forced.invoke("What is the weather in Paris?")
    assert isinstance(reply, AIMessage)
    [call] = reply.tool_calls
    assert tool_choice == "any" or call["name"] == tool_choice, call
    ARGUMENTS[call["name"]].model_validate(call["args"])
    assert not reply.invalid_tool_calls


def test_a_tool_result_goes_back_and_the_next_call_comes(url: str) -> None:
    """The whole loop: the first call and its result go back in the history (rendered by the
    template: the prompt grows by them), and the model is made to call the other tool."""
    first = chat(url, tool_choice=NAMED, temperature=0)["message"]
    [call] = first["tool_calls"]
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
    ]
    named = {"type": "function", "function": {"name": "get_time"}}
    # Only get_time this time, and 48 tokens (a get_time call is ~30): the history costs ~150
    # tokens of SGLang's tiny model's 512.
    body = {"tools": TOOLS[1:], "tool_choice": named, "max_tokens": 48, "temperature": 0}
    before = post(url, "/v1/chat/completions", {"messages": MESSAGES, **body})
    after = post(url, "/v1/chat/completions", {"messages": history, **body})
    assert before.status_code == after.status_code == 200, after.text
    grown = after.json()["usage"]["prompt_tokens"] - before.json()["usage"]["prompt_tokens"]
    assert grown > len(call["function"]["arguments"]), grown  # the call and result rendered
    choice = after.json()["choices"][0]
    [second] = choice["message"]["tool_calls"]
    assert second["function"]["name"] == "get_time"
    assert isinstance(valid(second), Clock)
    assert choice["finish_reason"] == "stop"
