"""Acceptance: OpenAI's own Python SDK against smgd served by real hypercorn on 127.0.0.1:0.

The sync ``openai`` client runs in a worker thread (``trio.to_thread.run_sync``) while the
trio loop serves; the fake engine steps every few milliseconds of real time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import openai
import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from smgd.api.http.app import create_app
from smgd.gateway import Gateway
from smgd.text.tokenizer import load_tokenizer
from tests.fake_engine import MODEL, TINY_MODEL, Behaviour, FakeEngine, open_gateway

T = TypeVar("T")
TOK = load_tokenizer(TINY_MODEL)
IDS = TOK.encode(" Hello, world! How are you today? I am fine.", add_special_tokens=False)
MESSAGES: Any = [{"role": "user", "content": "Say hello"}]


class Served:
    def __init__(self, base_url: str, engine: FakeEngine, gateway: Gateway) -> None:
        self.engine = engine
        self.gateway = gateway
        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)

    async def call(self, fn: Callable[[], T]) -> T:
        return await trio.to_thread.run_sync(fn)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    # 2 ms steps: fast enough for the suite, slow enough that streams have several chunks.
    engine = FakeEngine(behaviour=Behaviour(output=IDS, step_s=0.002))
    async with open_gateway(engine) as gateway, trio.open_nursery() as nursery:
        cfg = HypercornConfig()
        cfg.bind = ["127.0.0.1:0"]
        cfg.accesslog = None
        cfg.graceful_timeout = 1.0  # teardown only; no test leaves a request running
        shutdown = trio.Event()
        app = create_app(gateway, environ={})
        binds: list[str] = await nursery.start(
            lambda task_status: serve(
                app, cfg, shutdown_trigger=shutdown.wait, task_status=task_status
            )
        )
        served = Served(binds[0], engine, gateway)
        yield served
        served.client.close()  # idle keep-alive connections would hold hypercorn's shutdown
        shutdown.set()


async def test_chat_and_completions_non_stream(served: Served) -> None:
    chat = await served.call(
        lambda: served.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    )
    assert chat.choices[0].message.content == TOK.decode(IDS[:4])
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 4
    assert chat._request_id is not None  # the SDK reads our x-request-id header
    comp = await served.call(
        lambda: served.client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    )
    assert comp.choices[0].text == TOK.decode(IDS[:3])
    assert comp.usage is not None and comp.usage.prompt_tokens == len(TOK.encode("hi"))


async def test_stream_with_usage_and_n2(served: Served) -> None:
    def run() -> tuple[dict[int, str], dict[int, str | None], Any]:
        texts: dict[int, str] = {0: "", 1: ""}
        finish: dict[int, str | None] = {}
        usage = None
        stream = served.client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=6, n=2, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    finish[choice.index] = choice.finish_reason
        return texts, finish, usage

    texts, finish, usage = await served.call(run)
    assert texts == {0: TOK.decode(IDS[:6]), 1: TOK.decode(IDS[:6])}
    assert finish == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 12


async def test_completions_stream_with_stop(served: Served) -> None:
    def run() -> tuple[str, str | None]:
        text, reason = "", None
        for chunk in served.client.completions.create(
            model=MODEL, prompt="hi", stop=["you"], stream=True
        ):
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    assert await served.call(run) == (" Hello, world! How are ", "stop")


async def test_bad_request_param(served: Served) -> None:
    def run() -> openai.BadRequestError:
        try:
            served.client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=3)
        except openai.BadRequestError as exc:
            return exc
        raise AssertionError("expected a 400")

    exc = await served.call(run)
    assert exc.status_code == 400
    assert exc.param == "temperature"
    assert exc.type == "invalid_request_error"
    assert served.engine.requests == []


async def test_disconnect_mid_stream_aborts_engine(served: Served) -> None:
    def run() -> int:
        stream = served.client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2000, stream=True
        )
        seen = 0
        for _ in stream:
            seen += 1
            if seen == 3:
                break
        stream.close()
        return seen

    assert await served.call(run) == 3
    [req] = served.engine.requests
    with trio.fail_after(5):
        await served.engine.wait_abort(req.rid)
    assert served.engine.in_flight == 0
