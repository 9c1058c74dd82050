"""Logprobs end to end: OpenAI chat / completions shapes, SGLang-native ``/generate``.

Two engines: the in-process :class:`FakeEngine` with deterministic logprobs attached to its
deltas (:func:`smgd.mock.scheduler.mock_logprob`, the mock engine's own formula), and the mock
engine speaking SGLang's wire over real ipc sockets, read with the OpenAI SDK. What is checked:
values, token strings and bytes (against :class:`TokenText` and the tokenizer), and alignment:
one entry per counted token (through the token completing a stop string, the EOS last);
completions ``tokens`` concatenate to the text and ``text_offset`` indexes it (checked against
one-shot decodes of prefixes); a streamed entry goes out once its text has.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import httpx
import openai
import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from smgd.api.core import prepare
from smgd.api.core.pipeline import Choice, LogprobTrack
from smgd.api.core.sse import encode_json
from smgd.api.handlers import openai as openai_handlers
from smgd.api.handlers.openai import (
    EchoHead,
    TokenText,
    completion_logprobs,
    echo_logprobs,
)
from smgd.api.http.app import create_app
from smgd.config import Config, EngineConfig, ServerConfig, WireFamily
from smgd.engines.sglang import SglangEngineClient
from smgd.gateway import Gateway
from smgd.mock.engine import MockEngine
from smgd.mock.scheduler import MockRequest, MockScheduler, mock_logprob, mock_prompt_logprob
from smgd.mock.sglang import SglangMockWire
from smgd.text.stream import TextStream
from smgd.text.tokenizer import load_tokenizer
from smgd.wire.common import EngineInfo, Finish, FinishReason, GenerateRequest, TokenDelta
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


def contributions(ids: list[int]) -> list[str]:
    """Each token's share of the text, by one-shot decoding of the prefixes: what token i adds
    to the text of the tokens before it ("" while the decode ends in an unfinished character)."""
    prefixes = [""]
    for i in range(1, len(ids) + 1):
        whole = TOK.decode(ids[:i])
        prefixes.append(prefixes[-1] if whole.endswith("\ufffd") else whole)
    return [prefixes[i + 1][len(prefixes[i]) :] for i in range(len(ids))]


def offsets(texts: list[str]) -> list[int]:
    out, at = [], 0
    for t in texts:
        out.append(at)
        at += len(t)
    return out


def clip(texts: list[str], length: int) -> list[str]:
    """Contributions cut where the returned text ends (a stop string's cut)."""
    out, at = [], 0
    for t in texts:
        out.append(t[: max(0, length - at)])
        at += len(t)
    return out


# --------------------------------------------------------------------------- pure


def test_token_text_bytes_rebuild_split_characters() -> None:
    assert TT.get(IDS[1])[0] == TOK.decode(IDS[1:2])
    assert bytes(b for t in IDS for b in TT.get(t)[1]) == TOK.decode(IDS).encode()
    split = [t for t in IDS if "\ufffd" in TT.get(t)[0]]
    assert split, "the sample must contain a character split across tokens"
    assert TT.get(EOS) == ("</s>", list(b"</s>"))


def _choice(stops: tuple[str, ...] = (), include: bool = False, **kw: Any) -> Choice:
    text = TextStream(TOK, stops=stops, include_stop=include)
    return Choice(0, "r", text, prompt_tokens=1, logprobs=LogprobTrack(), **kw)


def _delta(ids: list[int], start: int, finish: Finish | None = None) -> TokenDelta:
    lps = [mock_logprob(t, start + i, 0) for i, t in enumerate(ids)]
    return TokenDelta(rid="r", token_ids=ids, logprobs=lps, finish=finish)


def _released(track: LogprobTrack | None) -> tuple[list[int], list[str], list[int]]:
    assert track is not None
    return [e.token_id for e in track.entries], track.texts, track.offsets


def test_entries_wait_for_held_back_text_then_release() -> None:
    # A stop that never matches still holds back its length - 1 characters.
    choice = _choice(stops=("zzzzzzzzzzzz",))
    track = choice.logprobs
    assert track is not None
    sent = ""
    for i, t in enumerate(ASCII[:-1]):
        sent += choice.apply(_delta([t], i))
        _, offs, texts = track.unsent()
        for o, piece in zip(offs, texts, strict=True):
            assert sent[o : o + len(piece)] == piece  # released once wholly sent
    assert len(track.entries) < len(ASCII) - 1  # the hold-back kept some back
    last = Finish(reason=FinishReason.LENGTH)
    sent += choice.apply(_delta([ASCII[-1]], len(ASCII) - 1, last))
    assert sent == TOK.decode(ASCII)
    texts = contributions(ASCII)
    assert _released(track) == (ASCII, texts, offsets(texts))


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("per_step", [1, 3, 100])
def test_stop_string_keeps_entries_through_the_completing_token(
    include: bool, per_step: int
) -> None:
    # "world" is split " wor" + "ld": "ld" completes it and is the last entry (with the part
    # of its text that was returned); the tokens after it in the same delta go.
    full = TOK.decode(ASCII)
    stop = "world"
    choice = _choice(stops=(stop,), include=include, keep_ids=True)
    out = ""
    for i in range(0, len(ASCII), per_step):
        out += choice.apply(_delta(ASCII[i : i + per_step], i))
    cut = full.index(stop) + (len(stop) if include else 0)
    assert out == full[:cut] and choice.finish_reason == "stop"
    done = next(i for i in range(len(ASCII)) if stop in TOK.decode(ASCII[: i + 1]))
    assert TT.get(ASCII[done])[0] == "ld"
    texts = clip(contributions(ASCII[: done + 1]), cut)
    assert _released(choice.logprobs) == (ASCII[: done + 1], texts, offsets(texts))
    assert "".join(texts) == out
    assert choice.completion_tokens == done + 1
    assert choice.output_ids == ASCII[: done + 1]


def test_split_character_goes_to_the_token_completing_it() -> None:
    choice = _choice()
    text = choice.apply(_delta(IDS, 0, Finish(reason=FinishReason.LENGTH)))
    ids, texts, offs = _released(choice.logprobs)
    assert ids == IDS and "".join(texts) == text == TOK.decode(IDS)
    at = IDS.index(837)  # a lone byte: the first of "日"
    assert (texts[at], texts[at + 1]) == ("", "日本")
    assert offs[at] == offs[at + 1] == text.index("日")
    assert offs == offsets(texts)


def test_unfinished_character_at_the_end_goes_to_the_last_token() -> None:
    choice = _choice()
    at = IDS.index(837)
    text = choice.apply(_delta(IDS[: at + 1], 0, Finish(reason=FinishReason.LENGTH)))
    assert text.endswith("\ufffd")
    _, texts, offs = _released(choice.logprobs)
    assert "".join(texts) == text and texts[-1] == "\ufffd" and offs == offsets(texts)


def test_streamed_entries_follow_their_text() -> None:
    # Token by token with a lone byte: the byte's entry goes out with the character.
    choice = _choice()
    track = choice.logprobs
    assert track is not None
    at = IDS.index(837)
    for i, t in enumerate(IDS[: at + 2]):
        sent = choice.apply(_delta([t], i))
        ids = [e.token_id for e in track.unsent()[0]]
        assert ids == ([] if i == at else IDS[at : at + 2] if i == at + 1 else [t])
        assert sent == ("" if i == at else contributions(IDS)[i])


def test_eos_entry_is_last_with_no_text() -> None:
    choice = _choice()
    finish = Finish(reason=FinishReason.STOP, matched_token=EOS)
    text = choice.apply(_delta([*ASCII[:3], EOS], 0, finish))
    texts = [*contributions(ASCII[:3]), ""]
    assert _released(choice.logprobs) == ([*ASCII[:3], EOS], texts, offsets(texts))
    assert "".join(texts) == text
    assert choice.completion_tokens == 4


def test_eos_after_a_stop_in_the_same_delta_is_dropped() -> None:
    choice = _choice(stops=("world",))
    finish = Finish(reason=FinishReason.STOP, matched_token=EOS)
    choice.apply(_delta([*ASCII[:7], EOS], 0, finish))
    assert _released(choice.logprobs)[0] == ASCII[:6]  # through "ld"
    assert (choice.completion_tokens, choice.matched) == (6, "world")


def test_native_track_keeps_one_entry_per_output_id() -> None:
    text = TextStream(TOK, stops=("zzz",))
    choice = Choice(
        0, "r", text, prompt_tokens=1, keep_ids=True, logprobs=LogprobTrack(aligned=False)
    )
    choice.apply(_delta([*ASCII, EOS], 0, Finish(reason=FinishReason.STOP, matched_token=EOS)))
    assert choice.logprobs is not None and choice.output_ids is not None
    assert [e.token_id for e in choice.logprobs.entries] == choice.output_ids == [*ASCII, EOS]


def test_native_track_ends_at_the_token_completing_a_stop() -> None:
    text = TextStream(TOK, stops=("world",))
    choice = Choice(
        0, "r", text, prompt_tokens=1, keep_ids=True, logprobs=LogprobTrack(aligned=False)
    )
    choice.apply(_delta([*ASCII, EOS], 0, Finish(reason=FinishReason.STOP, matched_token=EOS)))
    assert choice.logprobs is not None
    assert [e.token_id for e in choice.logprobs.entries] == choice.output_ids == ASCII[:6]
    assert choice.completion_tokens == 6


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


async def test_eos_is_counted_and_has_the_last_entry() -> None:
    engine = LogprobEngine(behaviour=Behaviour(output=ASCII, eos_after=3))
    async with open_app(engine) as (app, _):
        reply = await post(app, "/v1/chat/completions", {**CHAT, "logprobs": True, "max_tokens": 9})
    data = reply.json()
    assert data["usage"]["completion_tokens"] == 4
    assert data["choices"][0]["logprobs"]["content"] == [
        chat_entry(t, i, 0) for i, t in enumerate([*ASCII[:3], EOS])
    ]


def completion_expected(ids: list[int], k: int, length: int) -> dict[str, Any]:
    """Every token's entry; ``tokens`` are their contributions clipped to ``length``."""
    tops = []
    for i, t in enumerate(ids):
        top = {TT.get(t ^ j)[0]: value(i) - j for j in range(k)}
        top.setdefault(TT.get(t)[0], value(i))
        tops.append(top)
    texts = clip(contributions(ids), length)
    return {
        "tokens": texts,
        "token_logprobs": [value(i) for i in range(len(ids))],
        "top_logprobs": tops,
        "text_offset": offsets(texts),
    }


def merged_logprobs(chunks: list[dict[str, Any]]) -> dict[str, list[Any]]:
    merged: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for c in chunks:
        for key, items in (c["logprobs"] or {}).items():
            merged[key].extend(items)
    return merged


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("per_step", [2, 50])
async def test_completions_shape_and_stop_cut(streaming: bool, per_step: int) -> None:
    engine = LogprobEngine(behaviour=Behaviour(output=ASCII, tokens_per_step=per_step))
    async with open_app(engine) as (app, _):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": len(ASCII), "logprobs": 2,
                "stop": ["How"], "stream": streaming,
                "stream_options": {"include_usage": True} if streaming else None}  # fmt: skip
        if streaming:
            reply = await post_stream(app, "/v1/completions", body)
            usage = reply.chunks()[-1]["usage"]
            chunks = [c["choices"][0] for c in reply.chunks()[:-1]]
        else:
            data = (await post(app, "/v1/completions", body)).json()
            usage, chunks = data["usage"], data["choices"]
    text = "".join(c["text"] for c in chunks)
    full = TOK.decode(ASCII)
    assert text == full[: full.index("How")]
    # " How" completes the stop: its entry is the last one, its token the " " that was sent.
    done = next(i for i, t in enumerate(ASCII) if TT.get(t)[0] == " How")
    merged = merged_logprobs(chunks)
    assert merged == completion_expected(ASCII[: done + 1], 2, len(text))
    assert merged["tokens"][-1] == " "
    assert "".join(merged["tokens"]) == text
    assert usage["completion_tokens"] == done + 1 == len(merged["tokens"])


@pytest.mark.parametrize("streaming", [False, True])
async def test_completions_text_offset_with_split_characters(streaming: bool) -> None:
    engine = LogprobEngine(behaviour=Behaviour(output=IDS, tokens_per_step=3))
    async with open_app(engine) as (app, _):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": len(IDS), "logprobs": 0,
                "stream": streaming}  # fmt: skip
        if streaming:
            reply = await post_stream(app, "/v1/completions", body)
            chunks = [c["choices"][0] for c in reply.chunks()]
        else:
            chunks = (await post(app, "/v1/completions", body)).json()["choices"]
    text = "".join(c["text"] for c in chunks)
    merged = merged_logprobs(chunks)
    assert text == TOK.decode(IDS)
    assert merged == completion_expected(IDS, 0, len(text))
    for token, at in zip(merged["tokens"], merged["text_offset"], strict=True):
        assert text[at : at + len(token)] == token
    # The lone byte's own text is U+FFFD (it keys top_logprobs), its share of the text is "".
    at = IDS.index(837)
    assert merged["tokens"][at] == "" and "\ufffd" in merged["top_logprobs"][at]


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
        ({"prompt": "a", "logprobs": 21}, "logprobs"),  # vLLM's cap (OpenAI's is 5)
    ],
)
async def test_completion_logprob_rejections(body: dict[str, Any], param: str) -> None:
    async with open_app(LogprobEngine()) as (app, _):
        reply = await post(app, "/v1/completions", {"model": MODEL, **body})
    assert reply.status == 400 and reply.json()["error"]["param"] == param


# --------------------------------------------------------------------------- echo


def join_logprobs(head: dict[str, Any], tail: dict[str, Any] | None) -> dict[str, Any]:
    """The plain join EchoHead.join must spell: echoed prompt logprobs followed by the
    generated ones (offsets moved past the head)."""
    if tail is None:
        return head
    shift = sum(len(t) for t in head["tokens"])
    return {
        "tokens": head["tokens"] + tail["tokens"],
        "token_logprobs": head["token_logprobs"] + tail["token_logprobs"],
        "top_logprobs": head["top_logprobs"] + tail["top_logprobs"],
        "text_offset": head["text_offset"] + [shift + o for o in tail["text_offset"]],
    }


@pytest.mark.parametrize("tail_ids", [None, [], ASCII[:4], IDS[:5]])
@pytest.mark.parametrize("prompt", [IDS[:1], IDS[:7]])
def test_echo_head_join_is_the_encoded_join(prompt: list[int], tail_ids: list[int] | None) -> None:
    """The prompt's part, encoded once and spliced, is the bytes of the joined object."""
    rows = [mock_prompt_logprob(prompt[p], p, 2) for p in range(1, len(prompt))]
    head = echo_logprobs(TT, prompt, rows)
    tail = None
    if tail_ids is not None:
        entries = [mock_logprob(t, i, 2) for i, t in enumerate(tail_ids)]
        texts = contributions(tail_ids)
        tail = completion_logprobs(TT, entries, offsets(texts), texts)
    assert EchoHead(head).join(tail) == encode_json(join_logprobs(head, tail))


class PromptLogprobEngine(LogprobEngine):
    """A LogprobEngine whose first delta of a request asking for prompt logprobs carries them
    (the mock engine's formula), as SGLang and vLLM send them with the first output."""

    def __init__(self, name: str = "fake", *, behaviour: Behaviour | None = None) -> None:
        super().__init__(name, behaviour=behaviour)
        self.prompted: set[str] = set()

    def deliver(self, delta: TokenDelta) -> None:
        req = next((r for r in self.requests if r.rid == delta.rid), None)
        k = None if req is None else req.sampling.prompt_logprobs
        if req is not None and k is not None and delta.rid not in self.prompted:
            self.prompted.add(delta.rid)
            ids = req.prompt_ids
            delta.prompt_logprobs = [mock_prompt_logprob(ids[p], p, k) for p in range(1, len(ids))]
        super().deliver(delta)


# Completions echo + logprobs requests that were served before the prompt's logprobs were
# shared among its choices (n = 2, one prompt and a batch of two), and the digest of what they
# were answered then (commit c9ca101): the id and `created` blanked, and a stream's events in
# each choice's order (the order of the choices' events is the engines' timing). The reply
# must stay what it was, byte for byte. The streamed digests are of the commit after, which
# fixed streamed echo's text_offset after the first chunk (it did not count the echoed
# prompt; test_echoed_completions_text_offsets_index_the_whole_text).
ECHO_BODIES: list[tuple[str, dict[str, Any], str, str | None]] = [
    (
        "/v1/completions",
        {"prompt": " café 日本 ok", "n": 2, "echo": True, "logprobs": 2, "max_tokens": 3},
        "13a1d08ca7f360289f54679d664126a9f796e89f0ea1bf501e7f8867eeb475be",
        "87fa81d8b98cf60206ba9b4c01594a34c98e77d62a4d7321b69473d5de3a437f",
    ),
    (
        "/v1/completions",
        {
            "prompt": ["Hello there", " café 日本 ok"],
            "n": 2,
            "echo": True,
            "logprobs": 1,
            "max_tokens": 2,
        },
        "49091e68896d3d6a24b56962ded9ece73c7b88fef22bac4c70f9fb423f99d4d4",
        "bfb1ea1bc1adea783168dd8506f5a778602f741d25ea877caadda9184aee9a7e",
    ),
    (  # echo without generation, and vLLM's prompt_logprobs field (non-streamed only)
        "/v1/completions",
        {
            "prompt": [ASCII[:5], IDS[:6]],
            "n": 2,
            "echo": True,
            "logprobs": 0,
            "prompt_logprobs": 0,
            "max_tokens": 0,
        },
        "e62df50c709493aa4bd6dde20ab7c6c1f7617a7ce5cbb221f71bc1d9e1a80f7c",
        None,
    ),
    (  # chat: the prompt's logprobs once, at the top level
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "café 日本"}],
            "n": 2,
            "logprobs": True,
            "top_logprobs": 1,
            "prompt_logprobs": 1,
            "max_tokens": 2,
        },
        "a0d6a7f6cf25b58061e3dffbfacb8c5fc06cef3b01f40393c79f8bad07508a1d",
        None,
    ),
]


def _normal(raw: bytes) -> bytes:
    raw = re.sub(rb'"id":"(chat)?cmpl-[^"]*"', b'"id":""', raw)
    return re.sub(rb'"created":[0-9]+', b'"created":0', raw)


def _by_choice(events: list[str]) -> bytes:
    """A stream's events, each choice's in their order, choice after choice."""
    by: dict[int, list[bytes]] = {}
    for e in events:
        index = len(events) if e == "[DONE]" else json.loads(e)["choices"][0]["index"]
        by.setdefault(index, []).append(_normal(e.encode()))
    return b"\n".join(b"\n".join(by[i]) for i in sorted(by))


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize(
    ("path", "body", "digest", "streamed"),
    ECHO_BODIES,
    ids=["one-prompt", "two-prompts", "echo-only", "chat"],
)
async def test_prompt_logprobs_reply_is_unchanged_and_converts_each_prompt_once(
    path: str,
    body: dict[str, Any],
    digest: str,
    streamed: str | None,
    streaming: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The replies above are unchanged, and each prompt's logprobs were converted once
    (they were converted for every choice: 2 x 2 here, 16 x 64 at most)."""
    if streaming:
        if streamed is None:
            pytest.skip("non-streamed only (vLLM's rules)")
        digest = streamed
    calls: list[str] = []

    def counting(name: str) -> Any:
        real = getattr(openai_handlers, name)

        def count(*args: Any) -> Any:
            calls.append(name)
            return real(*args)

        return count

    for name in ("echo_logprobs", "prompt_logprobs_field"):
        monkeypatch.setattr(openai_handlers, name, counting(name))
    full = {"model": MODEL, "temperature": 1.0, "stream": streaming, **body}
    async with open_app(PromptLogprobEngine(behaviour=Behaviour(output=ASCII))) as (app, _):
        if streaming:
            sse = await post_stream(app, path, full)
            assert sse.status == 200, sse.raw
            raw = _by_choice(sse.events)
        else:
            reply = await post(app, path, full)
            assert reply.status == 200, reply.body
            raw = _normal(reply.body)
    prompts = 2 if isinstance(body.get("prompt"), list) else 1
    assert calls.count("echo_logprobs") == (prompts if body.get("echo") else 0)
    # Echo implies prompt_logprobs: vLLM's field too, in a non-streamed reply.
    assert calls.count("prompt_logprobs_field") == (0 if streaming else prompts)
    assert hashlib.sha256(raw).hexdigest() == digest


@pytest.mark.parametrize(
    ("body", "asked"),
    [
        ({"prompt": ["ab", "cd"], "n": 3, "echo": True, "logprobs": 2}, [2, None, None]),
        ({"prompt": "ab", "n": 2, "logprobs": 1, "prompt_logprobs": 1}, [1, None]),
        # A prompt top-k above the output's too (SGLang's wire asks the larger for both sides
        # of the first choice; its client cuts the output's back: test_engine_sglang.py).
        ({"prompt": "ab", "n": 2, "logprobs": 1, "prompt_logprobs": 3}, [3, None]),
    ],
)
async def test_only_a_prompts_first_choice_asks_for_its_logprobs(
    body: dict[str, Any], asked: list[int | None]
) -> None:
    """``asked``: each prompt's engine requests' prompt_logprobs (None: not asked)."""
    engine = PromptLogprobEngine(behaviour=Behaviour(output=ASCII))
    full = {"model": MODEL, "temperature": 1.0, "max_tokens": 2, **body}
    async with open_app(engine) as (app, _):
        reply = await post(app, "/v1/completions", full)
    assert reply.status == 200, reply.body
    by_prompt: dict[tuple[int, ...], list[int | None]] = {}
    for r in engine.requests:  # in the order the choices' tasks sent them
        by_prompt.setdefault(tuple(r.prompt_ids), []).append(r.sampling.prompt_logprobs)
    for got in by_prompt.values():
        assert sorted(got, key=lambda k: -1 if k is None else k, reverse=True) == asked
    # Every choice has its prompt's logprobs all the same.
    fields = {json.dumps(c["prompt_logprobs"]) for c in reply.json()["choices"]}
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    assert len(by_prompt) == len(fields) == len(prompts)


class SlowPromptEngine(PromptLogprobEngine):
    """The choice that asked for the prompt's logprobs answers last (its prefill skips the
    prefix cache), two steps after the others."""

    async def _drive(self, req: GenerateRequest) -> None:
        if req.sampling.prompt_logprobs is not None:
            await trio.sleep(3 * self.behaviour.step_s)
        await super()._drive(req)


async def test_streamed_choices_wait_for_their_prompts_logprobs() -> None:
    """Choices whose output comes before their prompt's logprobs (which only the prompt's
    first choice asked for) send their first event, the prompt's part first, once they come:
    every choice's stream is what the first choice's is."""
    engine = SlowPromptEngine(behaviour=Behaviour(output=ASCII))
    body = {"model": MODEL, "prompt": ["ab cd", "ef"], "n": 3, "echo": True, "logprobs": 1,
            "max_tokens": 5, "temperature": 1.0, "stream": True}  # fmt: skip
    async with open_app(engine) as (app, _):
        sse = await post_stream(app, "/v1/completions", body)
    assert sse.status == 200, sse.raw
    by: dict[int, list[dict[str, Any]]] = {}
    for chunk in sse.chunks():
        choice = chunk["choices"][0]
        by.setdefault(choice["index"], []).append(choice)
    assert sorted(by) == list(range(6))
    for index, chunks in by.items():
        first = by[index - index % 3]
        assert chunks[0]["logprobs"]["token_logprobs"][0] is None  # the prompt's part first
        assert "".join(c["text"] for c in chunks) == "".join(c["text"] for c in first)
        mine, its = merged_logprobs(chunks), merged_logprobs(first)
        for key in ("tokens", "token_logprobs", "top_logprobs"):  # offsets: per chunk
            assert mine[key] == its[key]
        assert chunks[-1]["finish_reason"] == "length"


ONE_SHORT_PROMPT = {
    "prompt": "ab", "n": 8, "temperature": 1.0, "echo": True, "logprobs": 3, "max_tokens": 2,
}  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": ["abcd"] * 3, "echo": True, "logprobs": 3}, "echo"),
        ("/v1/completions", {"prompt": "abcd", "prompt_logprobs": 20}, "prompt_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "abcd " * 20}], "prompt_logprobs": 0},
            "prompt_logprobs",
        ),
        (
            "/generate",
            {
                "text": "abcd",
                "sampling_params": {"n": 4},
                "return_logprob": True,
                "logprob_start_len": 0,
                "top_logprobs_num": 5,
            },
            "logprob_start_len",
        ),
    ],
)
async def test_prompt_logprobs_past_the_bound_are_refused_by_name(
    path: str, body: dict[str, Any], param: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompt tokens x (k + 1) over MAX_PROMPT_LOGPROBS (each prompt once where only its first
    choice asks; native /generate asks per choice): a 400 before any engine sees it."""
    monkeypatch.setattr(prepare, "MAX_PROMPT_LOGPROBS", 40)
    engine = PromptLogprobEngine()
    async with open_app(engine) as (app, _):
        reply = await post(app, path, {"model": MODEL, "max_tokens": 1, **body})
        ok = await post(app, "/v1/completions", {**ONE_SHORT_PROMPT, "model": MODEL})
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["param"] == param and "entries a request may have" in error["message"]
    assert ok.status == 200, ok.body  # 8 choices of one short prompt: asked once
    assert len(engine.requests) == 8


@pytest.mark.parametrize(("n", "status"), [(8, 400), (2, 200)])
async def test_a_reply_repeating_too_many_prompt_logprobs_is_refused(
    n: int, status: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each choice repeats its prompt's logprobs: choices x prompt tokens x (k + 1) over
    MAX_REPLY_PROMPT_LOGPROBS is a 400 naming `echo`, though the engine is asked once."""
    monkeypatch.setattr(openai_handlers, "MAX_REPLY_PROMPT_LOGPROBS", 100)
    body = {"model": MODEL, "prompt": IDS[:6], "n": n, "echo": True, "logprobs": 3,
            "max_tokens": 1, "temperature": 1.0}  # fmt: skip
    async with open_app(PromptLogprobEngine()) as (app, _):
        reply = await post(app, "/v1/completions", body)
    assert reply.status == status, reply.body  # 6 tokens x 4 entries: 24 a choice
    if status == 400:
        assert reply.json()["error"]["param"] == "echo"


# --------------------------------------------------------------------------- SGLang mock wire


class Served:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)

    async def call(self, fn: Callable[[], T]) -> T:
        return await trio.to_thread.run_sync(fn)


@asynccontextmanager
async def serve_sglang_mock(sched: MockScheduler) -> AsyncIterator[Served]:
    """smgd over hypercorn, its one engine ``sched`` on SGLang's wire (ipc sockets)."""
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


@pytest.fixture
async def sglang_served() -> AsyncIterator[Served]:
    # Specials (ids 0-5) are skipped so the echoed output is plain text; EOS never comes.
    async with serve_sglang_mock(MockScheduler(max_batch=16, skip_ids=range(6))) as served:
        yield served


class BatchingScheduler(MockScheduler):
    """Reports every request's tokens 8 at a time, as SGLang does for a non-streamed request
    (and vLLM when several tokens come out of one step): deltas of several tokens."""

    def add(self, req: MockRequest) -> None:
        req.stream = False
        super().add(req)


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


@pytest.mark.parametrize("logprobs", [None, 1])
async def test_stop_usage_through_sglang_mock(logprobs: int | None) -> None:
    # The stop completes inside a delta of 8 tokens (and the 8th is not the one completing
    # it): usage and logprobs count only up to the token that completed it.
    sched = BatchingScheduler(max_batch=16, skip_ids=range(6), nonstream_interval=8)
    prompt = ASCII
    out = echoed(prompt, 100)
    done = next(j for j in range(len(out)) if "world" in TOK.decode(out[: j + 1]))
    assert done + 1 < 8
    async with serve_sglang_mock(sched) as served:
        comp = await served.call(
            lambda: served.client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=100, stop=["world"], logprobs=logprobs
            )
        )
    choice = comp.choices[0]
    assert choice.text == TOK.decode(out)[: TOK.decode(out).index("world")]
    assert choice.finish_reason == "stop"
    assert comp.usage is not None and comp.usage.completion_tokens == done + 1
    if logprobs is not None:
        assert choice.logprobs is not None and choice.logprobs.tokens is not None
        assert len(choice.logprobs.tokens) == done + 1
        assert "".join(choice.logprobs.tokens) == choice.text


@pytest.mark.parametrize("streaming", [False, True])
async def test_echoed_completions_text_offsets_index_the_whole_text(streaming: bool) -> None:
    """With ``echo``, every ``text_offset`` indexes the text the client got, the echoed
    prompt first (vLLM's offsets count the prompt's text in every streamed chunk, not only
    the first)."""
    engine = PromptLogprobEngine(behaviour=Behaviour(output=ASCII, tokens_per_step=2))
    # Token ids, so no BOS is added: a BOS token's text ("<s>") is not in the echoed text.
    prompt = TOK.encode(" Hello, world", add_special_tokens=False)
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1,
            "max_tokens": 8, "n": 2, "temperature": 1.0, "stream": streaming}  # fmt: skip
    async with open_app(engine) as (app, _):
        if streaming:
            reply = await post_stream(app, "/v1/completions", body)
            chunks = [c for event in reply.chunks() for c in event["choices"]]
        else:
            chunks = (await post(app, "/v1/completions", body)).json()["choices"]
    for index in (0, 1):
        mine = [c for c in chunks if c["index"] == index]
        text = "".join(c["text"] for c in mine)
        assert text.startswith(" Hello, world") and len(text) > len(" Hello, world")
        checked = 0
        for chunk in mine:
            lp = chunk["logprobs"] or {"tokens": [], "text_offset": []}
            for token, at in zip(lp["tokens"], lp["text_offset"], strict=True):
                assert text[at : at + len(token)] == token, (index, token, at)
                checked += 1
        assert checked == len(prompt) + 8, index


async def test_a_streamed_echo_has_the_logprobs_of_the_whole_reply() -> None:
    """A text prompt (its BOS token's text "<s>" counted in the offsets, as vLLM counts it):
    each choice's streamed logprobs, joined, are the non-streamed reply's."""
    body = {"model": MODEL, "prompt": " Hello, world", "echo": True, "logprobs": 2,
            "max_tokens": 7, "n": 2, "temperature": 1.0}  # fmt: skip
    engine = PromptLogprobEngine(behaviour=Behaviour(output=ASCII, tokens_per_step=2))
    async with open_app(engine) as (app, _):
        whole = (await post(app, "/v1/completions", body)).json()["choices"]
        reply = await post_stream(app, "/v1/completions", {**body, "stream": True})
    chunks = [c for event in reply.chunks() for c in event["choices"]]
    for choice in whole:
        mine = [c for c in chunks if c["index"] == choice["index"]]
        assert len([c for c in mine if c["logprobs"]]) > 2  # several chunks after the first
        assert merged_logprobs(mine) == choice["logprobs"]


async def test_streamed_generate_logprobs_are_converted_once_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every streamed ``/generate`` event carries all logprobs so far and the prompt's (as
    SGLang's do); each entry is converted once however many events repeat it (a 4,096-token
    stream with top-20 logprobs converted ~180 million items on the loop), and each event
    still has them all."""
    from smgd.api.handlers import native

    calls = 0
    item = native.NativeLogprobs._item

    def counted(self: native.NativeLogprobs, logprob: float, token_id: int) -> list[Any]:
        nonlocal calls
        calls += 1
        return item(self, logprob, token_id)

    monkeypatch.setattr(native.NativeLogprobs, "_item", counted)
    tokens, top, prompt = 48, 2, [70, 71, 72]
    engine = PromptLogprobEngine(behaviour=Behaviour(output=ASCII * 4, tokens_per_step=1))
    body = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": top,
            "logprob_start_len": 0, "sampling_params": {"max_new_tokens": tokens}}  # fmt: skip
    async with open_app(engine) as (app, _):
        whole = (await post(app, "/generate", body)).json()["meta_info"]
        calls = 0
        streamed = await post_stream(app, "/generate", {**body, "stream": True})
    events = streamed.chunks()
    assert len(events) > tokens // 2  # many events, each repeating what came before
    assert calls == (tokens + len(prompt) - 1) * (1 + top)
    for got in events:
        meta = got["meta_info"]
        for key in ("input_token_logprobs", "input_top_logprobs"):
            assert meta[key] == whole[key], key
        n = len(got["output_ids"])
        assert meta["output_token_logprobs"] == whole["output_token_logprobs"][:n]
        assert meta["output_top_logprobs"] == whole["output_top_logprobs"][:n]
