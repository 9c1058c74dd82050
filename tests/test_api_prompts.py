"""Huge prompts: refused before tokenizing when they cannot fit; big ones tokenized off the loop."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import trio

from smgd import sampling
from smgd.api.core import prepare
from smgd.api.core.prepare import BIG_PROMPT_CHARS, encode
from smgd.assets import TINY_MODEL_DIR
from smgd.errors import InvalidRequest
from smgd.text.tokenizer import Tokenizer, load_tokenizer
from tests.fake_engine import MODEL, FakeEngine, open_app, post

CONTEXT = 4096  # the fake engine's max_model_len
PER_TOKEN = 12  # the tiny model's longest token, in characters
TOO_LONG = "x" * (CONTEXT * PER_TOKEN + 1)  # cannot be 4096 tokens or fewer


class Calls:
    """Counts the tokenizer's encode calls, and the threads they ran on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tok: Tokenizer) -> None:
        self.threads: list[int] = []
        for name in ("encode", "encode_many"):
            monkeypatch.setattr(tok, name, self._wrap(getattr(tok, name)))

    def _wrap(self, method: Any) -> Any:
        def counted(*args: Any) -> Any:
            self.threads.append(threading.get_ident())
            return method(*args)

        return counted


@pytest.fixture
def tok() -> Tokenizer:
    return load_tokenizer(TINY_MODEL_DIR)


async def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(
    monkeypatch: pytest.MonkeyPatch, tok: Tokenizer
) -> None:
    calls = Calls(monkeypatch, tok)
    limiter = trio.CapacityLimiter(1)
    with pytest.raises(InvalidRequest) as info:
        await encode(tok, TOO_LONG, add_special_tokens=True, limiter=limiter, context=CONTEXT)
    assert info.value.code == "context_length_exceeded"
    assert info.value.param == "prompt"
    assert f"{CONTEXT * PER_TOKEN + 1} characters" in info.value.message
    assert calls.threads == []
    # One character less could fit (were it 12-character tokens): the tokenizer decides.
    await encode(tok, TOO_LONG[1:], add_special_tokens=False, limiter=limiter, context=CONTEXT)
    assert len(calls.threads) == 1


async def test_big_prompts_are_tokenized_in_a_thread_under_the_limiter(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch, tok: Tokenizer
) -> None:
    text = "hello world " * (BIG_PROMPT_CHARS // 12 + 1)
    inline = tok.encode(text)
    calls = Calls(monkeypatch, tok)
    limiter = trio.CapacityLimiter(1)
    results: list[list[int]] = []

    async def tokenize() -> None:
        results.append(
            await encode(tok, text, add_special_tokens=True, limiter=limiter, context=CONTEXT)
        )

    # The limiter's only token is taken: the prompt must wait for it.
    async with trio.open_nursery() as nursery, limiter:
        nursery.start_soon(tokenize)
        await trio.sleep(10)
        assert results == []
        assert calls.threads == []
        assert limiter.statistics().tasks_waiting == 1
    assert results == [inline]
    assert calls.threads != [threading.get_ident()]  # not on the event loop's thread


async def test_small_prompts_are_tokenized_inline(
    monkeypatch: pytest.MonkeyPatch, tok: Tokenizer
) -> None:
    calls = Calls(monkeypatch, tok)
    limiter = trio.CapacityLimiter(1)
    async with limiter:  # would block a prompt that needed it
        with trio.fail_after(1):
            await encode(tok, "hello", add_special_tokens=True, limiter=limiter, context=CONTEXT)
    assert calls.threads == [threading.get_ident()]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": TOO_LONG}, "prompt"),
        ("/v1/completions", {"prompt": ["short", TOO_LONG]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": TOO_LONG}]}, "messages"),
        ("/generate", {"text": TOO_LONG}, "text"),
    ],
)
async def test_every_generation_route_refuses_a_prompt_that_cannot_fit_before_tokenizing(
    autojump_clock: trio.abc.Clock,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    body: dict[str, Any],
    param: str,
) -> None:
    fake = FakeEngine(max_model_len=CONTEXT)
    async with open_app(fake) as (app, gateway):
        tok = gateway.text(MODEL).tokenizer
        calls = Calls(monkeypatch, tok)
        reply = await post(app, path, {"model": MODEL, "max_tokens": 1, **body})
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == param
    assert calls.threads == []  # not even the batch's "short" prompt
    assert fake.requests == []


async def test_a_batch_of_prompts_big_together_is_tokenized_in_a_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each prompt is small, so each was tokenized inline, one after the other: 2,048 embedding
    # inputs of 3,600 characters paused every stream on the loop for 2.4 s. Together they are
    # big: one encode_batch in a worker thread (tests/faults/test_feature_surface.py has the
    # embeddings' case against the real daemon).
    prompts = ["hello world " * 40] * (BIG_PROMPT_CHARS // 480 + 1)
    async with open_app(FakeEngine()) as (app, gateway):
        tok = gateway.text(MODEL).tokenizer
        calls = Calls(monkeypatch, tok)
        reply = await post(
            app, "/v1/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 1}
        )
    assert reply.status == 200, reply.body
    assert len(reply.json()["choices"]) == len(prompts)
    assert len(calls.threads) == 1 and calls.threads != [threading.get_ident()]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/tokenize"])
async def test_a_big_chat_body_is_rendered_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    # 250,000 messages in an 8 MB body took 0.75 s to check and render: every stream on the
    # loop paused for it. A body of BIG_BODY_BYTES or more is rendered in a worker thread.
    threads: list[int] = []
    render = Tokenizer.render_chat

    def recorded(self: Tokenizer, *args: Any, **kwargs: Any) -> str:
        threads.append(threading.get_ident())
        return render(self, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "render_chat", recorded)
    # The tiny model's context (4,096 tokens) holds no 64 KiB chat: a smaller bound here.
    monkeypatch.setattr(prepare, "BIG_BODY_BYTES", 2_000)
    loop = threading.get_ident()
    small = [{"role": "user", "content": "hi"}]
    big = [{"role": "user", "content": "hello there"}] * 60  # ~2.5 KB of JSON
    async with open_app(FakeEngine()) as (app, _):
        for messages in (small, big):
            reply = await post(app, path, {"model": MODEL, "messages": messages, "max_tokens": 1})
            assert reply.status == 200, reply.body
        # A refusal raised in the thread is the same 400.
        bad = [*big[:-1], {"role": 5, "content": "x"}]
        reply = await post(app, path, {"model": MODEL, "messages": bad, "max_tokens": 1})
        assert reply.status == 400 and reply.json()["error"]["param"].startswith("messages[")
    assert threads[0] == loop
    assert threads[1] != loop and threads[2] != loop


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings", "/v1/tokenize"])
async def test_a_big_body_is_decoded_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    # Checking how deep an 8 MB body of 600,000 small arrays nests took 1.3 s (2.4 million
    # containers walked in Python), a pause of every stream on the loop; a body of
    # BIG_BODY_BYTES or more is decoded and checked in a worker thread.
    threads: list[int] = []
    walk = sampling.nested_deeper  # the walk prepare calls

    def recorded(value: Any, limit: int) -> bool:
        threads.append(threading.get_ident())
        return walk(value, limit)

    monkeypatch.setattr(prepare, "nested_deeper", recorded)
    monkeypatch.setattr(prepare, "BIG_BODY_BYTES", 2_000)
    small = {"model": MODEL, "prompt": [[5, 6]] * 140, "max_tokens": 1}  # 141 [s: walked
    deep: Any = 1
    for _ in range(prepare.MAX_JSON_DEPTH):
        deep = [deep]
    async with open_app(FakeEngine()) as (app, _):
        await post(app, path, small)
        big = await post(app, path, {**small, "x": [[1]] * 500})
        too_deep = await post(app, path, {**small, "x": [[1]] * 500, "y": deep})
    assert big.status != 500, big.body
    assert too_deep.status == 400 and "nested too deeply" in too_deep.json()["error"]["message"]
    loop = threading.get_ident()
    assert len(threads) == 3 and threads[0] == loop
    assert threads[1] != loop and threads[2] != loop


async def test_a_batchs_sampling_options_are_read_once_for_all_its_prompts(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The options were read again for every prompt: 1,000,000 stop_token_ids (a 2 MB body)
    # for 64 prompts were checked 64 times, a 6.4 s pause of every stream. Only max_tokens
    # depends on the prompt: it is worked out for each.
    reads: list[str] = []
    token_ids = sampling._Reader.token_ids

    def counted(self: Any, key: str, vocab_size: int) -> tuple[int, ...]:
        reads.append(key)
        return token_ids(self, key, vocab_size)

    monkeypatch.setattr(sampling._Reader, "token_ids", counted)
    fake = FakeEngine(max_model_len=100)
    prompts = [[5], [5, 6, 7], [5, 6, 7, 8, 9]]
    body = {"model": MODEL, "prompt": prompts, "stop_token_ids": [3, 3, 4] * 1000}
    async with open_app(fake) as (app, _):
        default = await post(app, "/v1/completions", body)
        asked = await post(app, "/v1/completions", {**body, "max_tokens": 94, "min_tokens": 2})
        too_many = await post(app, "/v1/completions", {**body, "max_tokens": 96})
        too_few = await post(app, "/v1/completions", {**body, "min_tokens": 96})
    assert default.status == 200 and asked.status == 200, (default.body, asked.body)
    assert reads == ["stop_token_ids"] * 4  # once per request
    sizes = sorted((len(r.prompt_ids), r.sampling.max_tokens) for r in fake.requests[:3])
    assert sizes == [(1, 99), (3, 97), (5, 95)]  # the room each prompt left
    assert [r.sampling.max_tokens for r in fake.requests[3:]] == [94, 94, 94]
    assert {r.sampling.stop_token_ids for r in fake.requests} == {(3, 4)}  # duplicates dropped
    assert [r.sampling.min_tokens for r in fake.requests] == [0, 0, 0, 2, 2, 2]
    # The same refusals as before, for the prompt they concern.
    assert too_many.status == 400 and too_many.json()["error"]["param"] == "max_tokens"
    assert too_many.json()["error"]["code"] == "context_length_exceeded"
    assert too_few.status == 400 and too_few.json()["error"]["param"] == "min_tokens"
