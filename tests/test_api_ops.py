"""Ops endpoints and the SGLang-native /generate."""

from __future__ import annotations

import itertools
import json
import threading
from typing import Any

import pytest
import trio

from smgd.api.core import prepare
from smgd.engines.state import EngineState
from smgd.text.tokenizer import load_tokenizer
from tests.fake_engine import (
    MODEL,
    TINY_MODEL,
    Behaviour,
    FakeEngine,
    get,
    open_app,
    post,
    post_stream,
)

TOK = load_tokenizer(TINY_MODEL)
IDS = TOK.encode(" Hello, world! How are you today?", add_special_tokens=False)


async def test_health_and_readiness(autojump_clock: trio.abc.Clock) -> None:
    fake = FakeEngine()
    async with open_app(fake) as (app, _):
        assert (await get(app, "/health")).status == 200
        assert (await get(app, "/liveness")).status == 200
        ready = await get(app, "/readiness")
        assert ready.status == 200
        assert ready.json()["engines"]["fake"]["state"] == "ready"
        fake.state = EngineState.DEAD
        fake.last_error = "boom"
        down = await get(app, "/readiness")
        assert (await get(app, "/health")).status == 200
    assert down.status == 503
    assert down.json()["status"] == "not_ready"
    assert down.json()["engines"]["fake"] == {
        "state": "dead", "ready": False, "required": True, "last_error": "boom", "restarts": 0,
    }  # fmt: skip


async def test_models_reports_engine_context_length(autojump_clock: trio.abc.Clock) -> None:
    async with open_app(FakeEngine(max_model_len=1234)) as (app, _):
        reply = await get(app, "/v1/models")
    body = reply.json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == MODEL
    assert card["object"] == "model"
    assert card["max_model_len"] == 1234  # the handshake's value, not config.json's 4096
    assert isinstance(card["created"], int) and card["created"] > 1_600_000_000


async def test_tokenize_detokenize_roundtrip(autojump_clock: trio.abc.Clock) -> None:
    async with open_app(FakeEngine()) as (app, _):
        tok = await post(app, "/v1/tokenize", {"model": MODEL, "prompt": "Hello, world!"})
        detok = await post(app, "/v1/detokenize", {"model": MODEL, "tokens": tok.json()["tokens"]})
        chat = await post(
            app, "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        )
        bad = await post(app, "/v1/detokenize", {"model": MODEL, "tokens": [99999]})
    assert tok.json()["tokens"] == TOK.encode("Hello, world!")
    assert tok.json()["count"] == len(tok.json()["tokens"])
    assert detok.json()["prompt"] == TOK.decode(TOK.encode("Hello, world!"), False)
    rendered = TOK.render_chat([{"role": "user", "content": "hi"}])
    assert chat.json()["tokens"] == TOK.encode(rendered, add_special_tokens=False)
    assert bad.status == 400 and bad.json()["error"]["param"] == "tokens"


async def test_a_big_detokenize_runs_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2.6 million ids (an 8 MB body) took 0.2 s to check and 0.5 s to decode, both on the loop
    # (the tokenizer's decode holds the GIL): every stream paused 0.8 s. A big body is checked
    # and decoded in a worker thread, with the batch decode, which lets the GIL go.
    monkeypatch.setattr(prepare, "BIG_BODY_BYTES", 2_000)
    threads: list[int] = []
    async with open_app(FakeEngine()) as (app, gateway):
        tok = gateway.text(MODEL).tokenizer
        for name in ("decode", "decode_many"):
            method = getattr(tok, name)

            def recorded(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
                threads.append(threading.get_ident())
                return _method(*args, **kwargs)

            monkeypatch.setattr(tok, name, recorded)
        small = await post(app, "/v1/detokenize", {"model": MODEL, "tokens": IDS})
        big = await post(app, "/v1/detokenize", {"model": MODEL, "tokens": IDS * 100})
        bad = await post(app, "/v1/detokenize", {"model": MODEL, "tokens": [*IDS * 100, -1]})
    assert small.json()["prompt"] == TOK.decode(IDS, False)
    assert big.json()["prompt"] == TOK.decode(IDS * 100, False)
    assert bad.status == 400 and bad.json()["error"]["param"] == "tokens"
    loop = threading.get_ident()
    assert len(threads) == 2 and threads[0] == loop and threads[1] != loop


async def test_tokenize_renders_messages_as_chat_does(autojump_clock: trio.abc.Clock) -> None:
    # vLLM's tokenize takes the chat's `tools` and `chat_template_kwargs`; both were ignored,
    # so the count was not the prompt's a chat request with them gets.
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    async with open_app(FakeEngine()) as (app, _):
        with_tools = await post(
            app, "/v1/tokenize", {"model": MODEL, "messages": messages, "tools": tools}
        )
        kwargs = {"chat_template_kwargs": {"bos_token": "<|im_end|>"}}
        with_kwargs = await post(
            app, "/v1/tokenize", {"model": MODEL, "messages": messages, **kwargs}
        )
        bad_tools = await post(
            app, "/v1/tokenize", {"model": MODEL, "messages": messages, "tools": [{"x": 1}]}
        )
        bad_kwargs = await post(
            app,
            "/v1/tokenize",
            {"model": MODEL, "messages": messages, "chat_template_kwargs": {"tools": []}},
        )
    rendered = TOK.render_chat(messages, tools=tools)
    assert with_tools.json()["tokens"] == TOK.encode(rendered, add_special_tokens=False)
    rendered = TOK.render_chat(messages, bos_token="<|im_end|>")
    assert with_kwargs.json()["tokens"] == TOK.encode(rendered, add_special_tokens=False)
    assert bad_tools.status == 400 and bad_tools.json()["error"]["param"].startswith("tools")
    assert bad_kwargs.status == 400
    assert bad_kwargs.json()["error"]["param"] == "chat_template_kwargs"


async def test_generate_non_stream(autojump_clock: trio.abc.Clock) -> None:
    fake = FakeEngine(behaviour=Behaviour(output=IDS, eos_after=4))
    async with open_app(fake) as (app, _):
        body = {"text": "hi", "rid": "my-rid", "sampling_params": {"max_new_tokens": 50}}
        reply = await post(app, "/generate", body)
    body = reply.json()
    assert reply.headers["x-request-id"] == "my-rid"
    assert body["text"] == TOK.decode(IDS[:4])
    assert body["output_ids"] == [*IDS[:4], 2]
    meta = body["meta_info"]
    assert meta["id"] == "my-rid"
    assert meta["finish_reason"] == {"type": "stop", "matched": 2}
    assert meta["prompt_tokens"] == len(TOK.encode("hi"))
    assert meta["completion_tokens"] == 5
    assert fake.requests[0].rid != "my-rid"
    assert fake.requests[0].sampling.max_tokens == 50


async def test_generate_input_ids_stream_cumulative(autojump_clock: trio.abc.Clock) -> None:
    fake = FakeEngine(behaviour=Behaviour(output=IDS))
    async with open_app(fake) as (app, _):
        reply = await post_stream(app, "/generate", {
            "input_ids": [77, 78], "stream": True,
            "sampling_params": {"max_new_tokens": 8, "stop": "world"},
        })  # fmt: skip
    assert fake.requests[0].prompt_ids == [77, 78]
    assert reply.events[-1] == "[DONE]"
    events = [json.loads(e) for e in reply.events[:-1]]
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # cumulative
    assert texts[-1] == " Hello, "
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "world"}
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


async def test_generate_length_finish(autojump_clock: trio.abc.Clock) -> None:
    async with open_app(FakeEngine(behaviour=Behaviour(output=IDS))) as (app, _):
        reply = await post(
            app, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3}}
        )
    assert reply.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
