"""A scripted mock engine through the real daemon, on an engine with no tool or reasoning
parser: a tool call and a think block token by token, and a client's tool loop.

The mock writes the reply a script gives for the prompt (tokenized with the model's tokenizer,
one token per step, then EOS); a prompt without a reply is echoed. With no ``tool_parser`` or
``reasoning_parser`` on the engine, the markup is plain text in ``content``, each token its own
SSE event. A tool loop's history (an assistant turn of ``tool_calls``, the ``tool`` result)
renders into the prompt; an image part is refused. Parsed calls and reasoning: test_tools.py.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from smgd.assets import TINY_MODEL_DIR
from smgd.text.tokenizer import load_tokenizer

from .harness import daemon_toml, mock_engine_toml, serve, stream

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow

TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK = "<think>\nThe user wants a number.\n</think>\n\n42"
SCRIPT = f"""
[[reply]]
when = "weather"
text = '''{TOOL_CALL}'''

[[reply]]
when = "answer"
text = '''{THINK}'''
"""


def pieces(text: str) -> list[str]:
    """The text each token of ``text`` adds, as the daemon streams it (one event per token)."""
    tok = load_tokenizer(TINY_MODEL_DIR)
    ids = tok.encode(text, add_special_tokens=False)
    return [tok.decode(ids[: i + 1])[len(tok.decode(ids[:i])) :] for i in range(len(ids))]


async def chat_stream(client: httpx.AsyncClient, content: str) -> tuple[list[str], list[Any]]:
    """Content deltas and finish reasons of a streamed chat completion."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "max_tokens": 200,
    }
    deltas: list[str] = []
    finishes: list[Any] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                if choice["delta"].get("content"):
                    deltas.append(choice["delta"]["content"])
                finishes.append(choice.get("finish_reason"))
    return deltas, [f for f in finishes if f is not None]


async def test_scripted_tool_call_and_think_block_stream_token_by_token(tmp_path: Path) -> None:
    (tmp_path / "replies.toml").write_text(SCRIPT)
    engine = mock_engine_toml("e0", "m", step_ms=10.0) + 'script = "replies.toml"\n'
    # One SSE event per engine step, however loaded the machine is: each token its own event.
    config = daemon_toml(engine, extra_server="coalesce_max_ms = 0.0\n")
    async with serve(tmp_path, config) as daemon, daemon.client() as client:
        for prompt, reply in (("What is the weather in Paris?", TOOL_CALL), ("answer?", THINK)):
            deltas, finishes = await chat_stream(client, prompt)
            assert deltas == pieces(reply)
            assert finishes == ["stop"]  # the EOS after the reply
        # The same reply without streaming, and the echo where no reply is for the prompt.
        body = {"model": "m", "messages": [{"role": "user", "content": "weather?"}]}
        whole = (await client.post("/v1/chat/completions", json=body)).json()
        assert whole["choices"][0]["message"]["content"] == TOOL_CALL
        assert whole["usage"]["completion_tokens"] == len(pieces(TOOL_CALL)) + 1  # + EOS
        echoed = await stream(client, "m", "The quick brown fox", 4)
        assert echoed.text == "".join(pieces("The quick brown fox")[:4])


async def test_tool_loop_history_and_media_parts_through_the_daemon(tmp_path: Path) -> None:
    """A client's whole tool loop renders (the call's history, the result, text parts); an
    image part is a 400 naming it, and the daemon serves on."""
    # First: the tool's result is in the prompt (the first match wins, and "weather" is too).
    tool_turn = "[[reply]]\nwhen = '<|im_start|>tool'\ntext = 'It is 21 C.'\n"
    (tmp_path / "replies.toml").write_text(tool_turn + SCRIPT)
    engine = mock_engine_toml("e0", "m") + 'script = "replies.toml"\n'
    async with serve(tmp_path, daemon_toml(engine)) as daemon, daemon.client() as client:
        function = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        call = {"id": "call_1", "type": "function", "function": function}
        messages: list[dict[str, Any]] = [
            {"role": "developer", "content": "Use the tools."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        ]
        tools = [{"type": "function", "function": {"name": "get_weather"}}]
        body = {"model": "m", "messages": messages, "tools": tools}
        reply = await client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == "It is 21 C."
        image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
        bad = {"model": "m", "messages": [{"role": "user", "content": [image]}]}
        refused = await client.post("/v1/chat/completions", json=bad)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "messages[0].content[0].type"
        assert "image_url" in error["message"] and "text-only" in error["message"]
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
