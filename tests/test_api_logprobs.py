"""Logprobs end to end: OpenAI chat / completions shapes, SGLang-native ``/generate``.

Two engines: the in-process :class:`FakeEngine` with deterministic logprobs attached to its
deltas (:func:`smgd.mock.scheduler.mock_logprob`, the mock engine's own formula), and the mock
engine speaking SGLang's wire over real ipc sockets, read with the OpenAI SDK. What is checked:
values, token strings and bytes (against :class:`TokenText` and the tokenizer), and alignment
(each streamed chunk's entries are exactly the tokens of its text; stop-string cuts drop the
tokens past the cut; the EOS entry goes with its text).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import httpx
import openai
import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from smgd.api.app import create_app
from smgd.api.openai import TokenText
from smgd.api.pipeline import Choice, LogprobTrack
from smgd.config import Config, EngineConfig, ServerConfig, WireFamily
from smgd.engines.sglang import SglangEngineClient
from smgd.gateway import Gateway
from smgd.mock.engine import MockEngine
from smgd.mock.scheduler import MockScheduler, mock_logprob
from smgd.mock.sglang import SglangMockWire
from smgd.text.stream import TextStream
from smgd.text.tokenizer import load_tokenizer
from smgd.wire.common import EngineInfo, Finish, FinishReason, TokenDelta
from tests.engine_harness import short_ipc_dir
from tests.fake_engine import (
    EOS,
    MODEL,
    TINY_MODEL,
    Behaviour,
    FakeEngine,
    open_app,
    post,
    post_stream,
)

T = TypeVar("T")
TOK = load_tokenizer(TINY_MODEL)
TT = TokenText(TOK)
# "日" is split over two byte-level tokens: their bytes, not their text, make up the character.
IDS = TOK.encode(" café 日本 ok. Hello, world! How are you?", add_special_tokens=False)
ASCII = TOK.encode(" Hello, world! How are you today?", add_special_tokens=False)
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


class LogprobEngine(FakeEngine):
    """A FakeEngine whose deltas carry the mock engine's logprobs when the request asks."""

    def __init__(self, name: str = "fake", *, behaviour: Behaviour | None = None) -> None:
        super().__init__(name, behaviour=behaviour)
        self.positions: dict[str, int] = {}

    def deliver(self, delta: TokenDelta) -> None:
        req = next((r for r in self.requests if r.rid == delta.rid), None)
        k = None if req is None else req.sampling.logprobs
        if k is not None and delta.token_ids:
            pos = self.positions.get(delta.rid, 0)
            delta.logprobs = [mock_logprob(t, pos + i, k) for i, t in enumerate(delta.token_ids)]
            self.positions[delta.rid] = pos + len(delta.token_ids)
        super().deliver(delta)


class TokenspeedLike(LogprobEngine):
    wire = "tokenspeed"
    max_top_logprobs = 0  # as TokenspeedEngineClient: only the sampled token's logprob


def value(position: int) -> float:
    return mock_logprob(0, position, 0).logprob


def chat_entry(token_id: int, position: int, k: int) -> dict[str, Any]:
    """The content item smgd must produce, built from the tokenizer and the mock formula."""
    text, raw = TT.get(token_id)
    lp = value(position)
    top = []
    for j in range(k):
        alt, alt_raw = TT.get(token_id ^ j)
        top.append({"token": alt, "logprob": lp - j, "bytes": alt_raw})
    return {"token": text, "logprob": lp, "bytes": raw, "top_logprobs": top}


def offsets(ids: list[int]) -> list[int]:
    """Where each token's text starts, by one-shot decoding of the prefixes (ASCII output)."""
    return [len(TOK.decode(ids[:i])) for i in range(len(ids))]


# --------------------------------------------------------------------------- pure


def test_token_text_bytes_rebuild_split_characters() -> None:
    assert TT.get(IDS[1])[0] == TOK.decode(IDS[1:2])
    assert bytes(b for t in IDS for b in TT.get(t)[1]) == TOK.decode(IDS).encode()
    split = [t for t in IDS if "\ufffd" in TT.get(t)[0]]
    assert split, "the sample must contain a character split across tokens"
    assert TT.get(EOS) == ("</s>", list(b"</s>"))


def _choice(stops: tuple[str, ...] = (), include: bool = False) -> Choice:
    text = TextStream(TOK, stops=stops, include_stop=include)
    return Choice(0, "r", text, prompt_tokens=1, logprobs=LogprobTrack())


def _delta(ids: list[int], start: int, finish: Finish | None = None) -> TokenDelta:
    lps = [mock_logprob(t, start + i, 0) for i, t in enumerate(ids)]
    return TokenDelta(rid="r", token_ids=ids, logprobs=lps, finish=finish)


def test_entries_wait_for_held_back_text_then_release() -> None:
    # A stop that never matches still holds back its length - 1 characters.
    choice = _choice(stops=("zzzzzzzzzzzz",))
    track = choice.logprobs
    assert track is not None
    sent = ""
    for i, t in enumerate(ASCII[:-1]):
        sent += choice.apply(_delta([t], i))
        _, offs = track.unsent()
        assert all(o < len(sent) for o in offs)  # nothing ahead of the text sent
    assert len(track.entries) < len(ASCII) - 1  # the hold-back kept some back
    last = Finish(reason=FinishReason.LENGTH)
    sent += choice.apply(_delta([ASCII[-1]], len(ASCII) - 1, last))
    assert sent == TOK.decode(ASCII)
    assert [e.token_id for e in track.entries] == ASCII
    assert track.offsets == offsets(ASCII)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_drops_entries_past_the_cut(include: bool) -> None:
    full = TOK.decode(ASCII)
    stop = "world"
    choice = _choice(stops=(stop,), include=include)
    text = choice.apply(_delta(list(ASCII), 0))
    cut = full.index(stop) + (len(stop) if include else 0)
    assert text == full[:cut] and choice.finish_reason == "stop"
    kept = [t for t, o in zip(ASCII, offsets(ASCII), strict=True) if o < cut]
    assert choice.logprobs is not None
    assert [e.token_id for e in choice.logprobs.entries] == kept
    assert len(kept) < len(ASCII)


def test_eos_entry_goes_with_its_text() -> None:
    choice = _choice()
    finish = Finish(reason=FinishReason.STOP, matched_token=EOS)
    choice.apply(_delta([*ASCII[:3], EOS], 0, finish))
    assert choice.logprobs is not None
    assert [e.token_id for e in choice.logprobs.entries] == ASCII[:3]


def test_native_track_keeps_one_entry_per_output_id() -> None:
    text = TextStream(TOK, stops=("world",))
    choice = Choice(
        0, "r", text, prompt_tokens=1, keep_ids=True, logprobs=LogprobTrack(aligned=False)
    )
    choice.apply(_delta([*ASCII, EOS], 0, Finish(reason=FinishReason.STOP, matched_token=EOS)))
    assert choice.logprobs is not None and choice.output_ids is not None
    assert [e.token_id for e in choice.logprobs.entries] == choice.output_ids


# --------------------------------------------------------------------------- FakeEngine


async def test_chat_non_stream_values_tokens_and_top() -> None:
    engine = LogprobEngine(behaviour=Behaviour(output=IDS))
    async with open_app(engine) as (app, _):
        body = {**CHAT, "max_tokens": len(IDS), "logprobs": True, "top_logprobs": 2}
        reply = await post(app, "/v1/chat/completions", body)
    assert reply.status == 200, reply.body
    choice = reply.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert content == [chat_entry(t, i, 2) for i, t in enumerate(IDS)]
    assert (
        bytes(b for item in content for b in item["bytes"]) == choice["message"]["content"].encode()
    )


async def test_chat_without_logprobs_has_null() -> None:
    async with open_app(LogprobEngine(behaviour=Behaviour(output=IDS))) as (app, _):
        reply = await post(app, "/v1/chat/completions", {**CHAT, "max_tokens": 3})
    assert reply.json()["choices"][0]["logprobs"] is None


async def test_chat_stream_chunks_carry_the_entries_of_their_text() -> None:
    # Three tokens per engine step: chunks are coalesced and carry several entries each.
    engine = LogprobEngine(behaviour=Behaviour(output=IDS, tokens_per_step=3))
    async with open_app(engine) as (app, _):
        body = {**CHAT, "max_tokens": len(IDS), "logprobs": True, "stream": True}
        reply = await post_stream(app, "/v1/chat/completions", body)
    assert reply.status == 200
    items: list[dict[str, Any]] = []
    for chunk in reply.chunks():
        (c,) = chunk["choices"]
        text = c["delta"].get("content") or ""
        got = (c["logprobs"] or {"content": []})["content"]
        assert bytes(b for item in got for b in item["bytes"]) == text.encode()
        items.extend(got)
    assert items == [chat_entry(t, i, 0) for i, t in enumerate(IDS)]
    assert (
        max(
            len((c["choices"][0]["logprobs"] or {"content": []})["content"]) for c in reply.chunks()
        )
        > 1
    )


async def test_chat_stream_n2_each_choice_aligned() -> None:
    engine = LogprobEngine(behaviour=Behaviour(output=ASCII, tokens_per_step=2))
    async with open_app(engine) as (app, _):
        body = {
            **CHAT,
            "max_tokens": 6,
            "n": 2,
            "logprobs": True,
            "top_logprobs": 1,
            "stream": True,
        }
        reply = await post_stream(app, "/v1/chat/completions", body)
    per: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for chunk in reply.chunks():
        for c in chunk["choices"]:
            per[c["index"]].extend((c["logprobs"] or {"content": []})["content"])
    for items in per.values():
        assert items == [chat_entry(t, i, 1) for i, t in enumerate(ASCII[:6])]


async def test_eos_is_counted_but_has_no_entry() -> None:
    engine = LogprobEngine(behaviour=Behaviour(output=ASCII, eos_after=3))
    async with open_app(engine) as (app, _):
        reply = await post(app, "/v1/chat/completions", {**CHAT, "logprobs": True, "max_tokens": 9})
    data = reply.json()
    assert data["usage"]["completion_tokens"] == 4
    assert data["choices"][0]["logprobs"]["content"] == [
        chat_entry(t, i, 0) for i, t in enumerate(ASCII[:3])
    ]


def completion_expected(ids: list[int], k: int, cut: int) -> dict[str, Any]:
    kept = [(i, t, o) for i, (t, o) in enumerate(zip(ids, offsets(ids), strict=True)) if o < cut]
    tops = []
    for i, t, _ in kept:
        top = {TT.get(t ^ j)[0]: value(i) - j for j in range(k)}
        top.setdefault(TT.get(t)[0], value(i))
        tops.append(top)
    return {
        "tokens": [TT.get(t)[0] for _, t, _ in kept],
        "token_logprobs": [value(i) for i, _, _ in kept],
        "top_logprobs": tops,
        "text_offset": [o for _, _, o in kept],
    }


@pytest.mark.parametrize("streaming", [False, True])
async def test_completions_shape_and_stop_cut(streaming: bool) -> None:
    engine = LogprobEngine(behaviour=Behaviour(output=ASCII, tokens_per_step=2))
    async with open_app(engine) as (app, _):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": len(ASCII), "logprobs": 2,
                "stop": ["How"], "stream": streaming}  # fmt: skip
        if streaming:
            reply = await post_stream(app, "/v1/completions", body)
            chunks = [c["choices"][0] for c in reply.chunks()]
        else:
            chunks = (await post(app, "/v1/completions", body)).json()["choices"]
    text = "".join(c["text"] for c in chunks)
    full = TOK.decode(ASCII)
    assert text == full[: full.index("How")]
    merged: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for c in chunks:
        for key, items in (c["logprobs"] or {}).items():
            merged[key].extend(items)
    assert merged == completion_expected(ASCII, 2, len(text))
    # " How" straddles the cut: part of its text (the space) was sent, so its entry is kept.
    assert "".join(merged["tokens"]) == text + "How"


async def test_native_generate_logprobs_non_stream_and_stream() -> None:
    engine = LogprobEngine(behaviour=Behaviour(output=ASCII))
    body = {"input_ids": [70, 71], "return_logprob": True, "top_logprobs_num": 2,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 5}}  # fmt: skip
    async with open_app(engine) as (app, _):
        meta = (await post(app, "/generate", body)).json()["meta_info"]
        streamed = await post_stream(app, "/generate", {**body, "stream": True})
        plain_body = {**body, "top_logprobs_num": 0, "return_text_in_logprobs": False}
        plain = (await post(app, "/generate", plain_body)).json()
    ids = ASCII[:5]
    assert meta["output_token_logprobs"] == [[value(i), t, TT.get(t)[0]] for i, t in enumerate(ids)]
    assert meta["output_top_logprobs"] == [
        [[value(i) - j, t ^ j, TT.get(t ^ j)[0]] for j in range(2)] for i, t in enumerate(ids)
    ]
    for event in streamed.chunks():  # cumulative, like text and output_ids
        assert [x[1] for x in event["meta_info"]["output_token_logprobs"]] == event["output_ids"]
    assert (
        streamed.chunks()[-1]["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"]
    )
    assert plain["meta_info"]["output_token_logprobs"] == [
        [value(i), t, None] for i, t in enumerate(ids)
    ]
    assert "output_top_logprobs" not in plain["meta_info"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {**CHAT, "logprobs": True, "top_logprobs": 2, "stream": True},
            "top_logprobs",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "logprobs": 1}, "logprobs"),
        (
            "/generate",
            {"text": "a", "return_logprob": True, "top_logprobs_num": 1},
            "top_logprobs_num",
        ),
    ],
)
async def test_tokenspeed_rejects_top_logprobs_up_front(
    path: str, body: dict[str, Any], param: str
) -> None:
    engine = TokenspeedLike()
    async with open_app(engine) as (app, _):
        reply = await post(app, path, body)
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["param"] == param and "top_logprobs" in error["message"]
    assert engine.requests == []  # nothing reached the engine


async def test_tokenspeed_sampled_logprobs_only_is_fine() -> None:
    async with open_app(TokenspeedLike(behaviour=Behaviour(output=ASCII))) as (app, _):
        reply = await post(app, "/v1/chat/completions", {**CHAT, "logprobs": True, "max_tokens": 2})
    assert reply.status == 200
    assert reply.json()["choices"][0]["logprobs"]["content"] == [
        chat_entry(t, i, 0) for i, t in enumerate(ASCII[:2])
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a", "logprobs": 1, "echo": True}, "echo"),
        ({"prompt": "a", "logprobs": 6}, "logprobs"),  # OpenAI's legacy cap is 5
    ],
)
async def test_completion_logprob_rejections(body: dict[str, Any], param: str) -> None:
    async with open_app(LogprobEngine()) as (app, _):
        reply = await post(app, "/v1/completions", {"model": MODEL, **body})
    assert reply.status == 400 and reply.json()["error"]["param"] == param


# --------------------------------------------------------------------------- SGLang mock wire


class Served:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)

    async def call(self, fn: Callable[[], T]) -> T:
        return await trio.to_thread.run_sync(fn)


@pytest.fixture
async def sglang_served() -> AsyncIterator[Served]:
    """smgd over hypercorn, its one engine the mock scheduler on SGLang's wire (ipc sockets)."""
    ipc = short_ipc_dir()
    config = EngineConfig(
        name="e0", wire=WireFamily.SGLANG, models=[MODEL], model_dir=str(TINY_MODEL)
    )
    client = SglangEngineClient(
        config,
        fallback_info=EngineInfo(max_model_len=4096, vocab_size=1024),
        input_path=str(ipc / "in.sock"),
        output_path=str(ipc / "out.sock"),
    )
    gateway = Gateway.from_config(Config(server=ServerConfig(), engines=[config]))
    wire = SglangMockWire(f"ipc://{ipc}/in.sock", f"ipc://{ipc}/out.sock")
    # Specials (ids 0-5) are skipped so the echoed output is plain text; EOS never comes.
    sched = MockScheduler(max_batch=16, skip_ids=range(6))
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        await nursery.start(MockEngine(wire, sched, step_s=0.002).run)
        with trio.fail_after(30):
            await client.wait_ready()
        gateway.router.put(client)
        cfg = HypercornConfig()
        cfg.bind = ["127.0.0.1:0"]
        cfg.accesslog = None
        cfg.graceful_timeout = 1.0
        shutdown = trio.Event()
        app = create_app(gateway, environ={})
        binds: list[str] = await nursery.start(
            lambda task_status: serve(
                app, cfg, shutdown_trigger=shutdown.wait, task_status=task_status
            )
        )
        served = Served(binds[0])
        yield served
        served.client.close()
        shutdown.set()
        nursery.cancel_scope.cancel()


def echoed(prompt: list[int], n: int) -> list[int]:
    source = [t for t in prompt if t >= 6]
    return [source[i % len(source)] for i in range(n)]


async def test_sdk_chat_through_sglang_mock(sglang_served: Served) -> None:
    messages: Any = [{"role": "user", "content": "Hello, world!"}]
    prompt = TOK.encode(
        TOK.render_chat(messages, add_generation_prompt=True), add_special_tokens=False
    )
    expected = echoed(prompt, 6)
    client = sglang_served.client
    chat = await sglang_served.call(
        lambda: client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, logprobs=True, top_logprobs=2
        )
    )
    logprobs = chat.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    got = [item.model_dump() for item in logprobs.content]
    assert got == [chat_entry(t, i, 2) for i, t in enumerate(expected)]
    assert "".join(item.token for item in logprobs.content) == chat.choices[0].message.content

    def streamed() -> list[Any]:
        items: list[Any] = []
        for chunk in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, logprobs=True, stream=True
        ):
            for c in chunk.choices:
                if c.logprobs is not None and c.logprobs.content:
                    assert "".join(x.token for x in c.logprobs.content) == c.delta.content
                    items.extend(x.model_dump() for x in c.logprobs.content)
        return items

    assert await sglang_served.call(streamed) == [
        chat_entry(t, i, 0) for i, t in enumerate(expected)
    ]


async def test_sdk_completions_and_native_through_sglang_mock(sglang_served: Served) -> None:
    prompt = ASCII[:5]
    comp = await sglang_served.call(
        lambda: sglang_served.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=7, logprobs=2
        )
    )
    expected = echoed(prompt, 7)
    assert comp.choices[0].logprobs is not None
    assert comp.choices[0].logprobs.model_dump() == completion_expected(expected, 2, 10**6)
    body = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 1,
            "sampling_params": {"max_new_tokens": 7}}  # fmt: skip
    async with httpx.AsyncClient(base_url=sglang_served.base_url) as http:
        meta = (await http.post("/generate", json=body)).json()["meta_info"]
    assert meta["output_token_logprobs"] == [[value(i), t, None] for i, t in enumerate(expected)]
    assert meta["output_top_logprobs"] == [[[value(i), t, None]] for i, t in enumerate(expected)]
