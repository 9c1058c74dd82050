"""OpenAI endpoints over the in-process fake engine: shapes, usage, stops, n, streaming."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from smgd.text.tokenizer import load_tokenizer
from smgd.wire.common import Finish, FinishReason, TokenDelta
from tests.asgi_client import connect, http_scope
from tests.engine_harness import VocabularyScans
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

TOK = load_tokenizer(TINY_MODEL)
SENTENCE = " Hello, world! How are you today? I am fine."
IDS = TOK.encode(SENTENCE, add_special_tokens=False)
MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
CHAT: dict[str, Any] = {"model": MODEL, "messages": MESSAGES}


def engine(**kw: object) -> FakeEngine:
    return FakeEngine(behaviour=Behaviour(output=IDS, **kw))  # type: ignore[arg-type]


async def test_chat_non_stream_length(autojump_clock: trio.abc.Clock) -> None:
    fake = engine()
    async with open_app(fake) as (app, _):
        reply = await post(app, "/v1/chat/completions", {**CHAT, "max_tokens": 5})
    assert reply.status == 200, reply.body
    body = reply.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": TOK.decode(IDS[:5])}
    assert choice["finish_reason"] == "length"
    prompt_len = len(fake.requests[0].prompt_ids)
    assert body["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": 5,
        "total_tokens": prompt_len + 5,
    }
    assert fake.requests[0].sampling.max_tokens == 5
    assert fake.aborts == []  # finished on the engine: nothing to abort


async def test_chat_prompt_is_rendered_with_template(autojump_clock: trio.abc.Clock) -> None:
    fake = engine()
    async with open_app(fake) as (app, _):
        await post(app, "/v1/chat/completions", {**CHAT, "max_tokens": 1})
    expected = TOK.encode(TOK.render_chat(MESSAGES), add_special_tokens=False)
    assert fake.requests[0].prompt_ids == expected


async def test_eos_finishes_with_stop_and_counts_eos(autojump_clock: trio.abc.Clock) -> None:
    fake = engine(eos_after=3)
    async with open_app(fake) as (app, _):
        reply = await post(app, "/v1/completions", {"model": MODEL, "prompt": "hi"})
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == TOK.decode(IDS[:3])
    assert reply.json()["usage"]["completion_tokens"] == 4  # EOS counts, like OpenAI/vLLM


async def test_stop_string_ends_and_aborts(autojump_clock: trio.abc.Clock) -> None:
    fake = engine()
    async with open_app(fake) as (app, _):
        reply = await post(
            app, "/v1/completions", {"model": MODEL, "prompt": "hi", "stop": [" you"]}
        )
        rid = fake.requests[0].rid
        with trio.fail_after(1):
            await fake.wait_abort(rid)
    choice = reply.json()["choices"][0]
    assert choice["text"] == " Hello, world! How are"
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == " you"


async def test_stop_in_a_multi_token_step_counts_up_to_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    # The engine sends 50 tokens per step (and reports 50 generated): the stop " you" is
    # completed by the 10th, and usage says 10, streamed or not.
    done = next(i for i in range(len(IDS)) if " you" in TOK.decode(IDS[: i + 1]))
    for streaming in (False, True):
        fake = engine(tokens_per_step=50)
        async with open_app(fake) as (app, _):
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 100, "stop": [" you"],
                    "stream": streaming}  # fmt: skip
            if streaming:
                body["stream_options"] = {"include_usage": True}
                usage = (await post_stream(app, "/v1/completions", body)).chunks()[-1]["usage"]
            else:
                usage = (await post(app, "/v1/completions", body)).json()["usage"]
        assert usage["completion_tokens"] == done + 1


async def test_stop_string_streamed_with_holdback(autojump_clock: trio.abc.Clock) -> None:
    fake = engine()
    async with open_app(fake) as (app, _):
        reply = await post_stream(
            app,
            "/v1/chat/completions",
            {**CHAT, "stream": True, "stop": "today?"},
        )
        with trio.fail_after(1):
            await fake.wait_abort(fake.requests[0].rid)
    chunks = reply.chunks()
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == " Hello, world! How are you "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert reply.events[-1] == "[DONE]"


async def test_chat_stream_shape(autojump_clock: trio.abc.Clock) -> None:
    fake = engine()
    async with open_app(fake) as (app, _):
        reply = await post_stream(
            app, "/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 6}
        )
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert reply.headers["cache-control"] == "no-cache"
    assert reply.events[-1] == "[DONE]"
    chunks = reply.chunks()
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert all("usage" not in c for c in chunks)  # only with include_usage
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [
        "length"
    ]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == TOK.decode(IDS[:6])


async def test_include_usage_adds_final_chunk(autojump_clock: trio.abc.Clock) -> None:
    fake = engine(cached_tokens=3)
    async with open_app(fake) as (app, _):
        reply = await post_stream(
            app,
            "/v1/completions",
            {
                "model": MODEL,
                "prompt": "hi",
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
    chunks = reply.chunks()
    *content, last = chunks
    assert all(c["usage"] is None for c in content)
    assert last["choices"] == []
    prompt_len = len(fake.requests[0].prompt_ids)
    assert last["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": 4,
        "total_tokens": prompt_len + 4,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    assert "".join(c["choices"][0]["text"] for c in content) == TOK.decode(IDS[:4])


async def test_n2_streams_both_indexes(autojump_clock: trio.abc.Clock) -> None:
    fake = engine()
    async with open_app(fake) as (app, _):
        reply = await post_stream(
            app,
            "/v1/chat/completions",
            {**CHAT, "stream": True, "n": 2, "max_tokens": 5,
             "stream_options": {"include_usage": True}},
        )  # fmt: skip
    assert len(fake.requests) == 2
    assert fake.requests[0].rid != fake.requests[1].rid
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in reply.chunks()[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content", "")
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: TOK.decode(IDS[:5]), 1: TOK.decode(IDS[:5])}
    assert finishes == {0: "length", 1: "length"}
    usage = reply.chunks()[-1]["usage"]
    assert usage["completion_tokens"] == 10
    assert usage["prompt_tokens"] == len(fake.requests[0].prompt_ids)  # counted once


async def test_n2_stop_string_aborts_each_choice(autojump_clock: trio.abc.Clock) -> None:
    fake = engine()
    async with open_app(fake) as (app, _):
        reply = await post_stream(
            app, "/v1/completions",
            {"model": MODEL, "prompt": "hi", "stream": True, "n": 2, "stop": ["!"]},
        )  # fmt: skip
        with trio.fail_after(1):
            for req in fake.requests:
                await fake.wait_abort(req.rid)
    finals = [
        c["choices"][0] for c in reply.chunks() if c["choices"][0]["finish_reason"] is not None
    ]
    assert sorted(f["index"] for f in finals) == [0, 1]
    assert {f["finish_reason"] for f in finals} == {"stop"}


async def test_n2_non_stream(autojump_clock: trio.abc.Clock) -> None:
    fake = engine()
    async with open_app(fake) as (app, _):
        reply = await post(app, "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2,
                                                     "max_tokens": 3})  # fmt: skip
    choices = reply.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert [c["text"] for c in choices] == [TOK.decode(IDS[:3])] * 2


async def test_batched_prompts_and_echo(autojump_clock: trio.abc.Clock) -> None:
    fake = engine()
    async with open_app(fake) as (app, _):
        reply = await post(
            app, "/v1/completions",
            {"model": MODEL, "prompt": ["Hello", " world"], "max_tokens": 2, "echo": True},
        )  # fmt: skip
    assert reply.status == 200, reply.body
    choices = reply.json()["choices"]
    assert [c["text"] for c in choices] == [p + TOK.decode(IDS[:2]) for p in ["Hello", " world"]]
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] == sum(len(r.prompt_ids) for r in fake.requests)


async def test_token_id_prompts(autojump_clock: trio.abc.Clock) -> None:
    fake = engine()
    async with open_app(fake) as (app, _):
        reply = await post(
            app, "/v1/completions",
            {"model": MODEL, "prompt": [[77, 78], [300]], "max_tokens": 1, "n": 2, "echo": True},
        )  # fmt: skip
    assert reply.status == 200, reply.body
    # Choices run concurrently: the engine sees them in any order.
    assert sorted(r.prompt_ids for r in fake.requests) == [[77, 78], [77, 78], [300], [300]]
    choices = reply.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[2]["text"] == TOK.decode([300], skip_special_tokens=False) + TOK.decode(IDS[:1])
    assert reply.json()["usage"]["prompt_tokens"] == 3  # each prompt once, not once per n


async def test_slow_client_gets_coalesced_chunks(autojump_clock: trio.abc.Clock) -> None:
    # 40 engine steps queue up before the client reads: nothing is lost, fewer chunks come out.
    fake = engine(step_s=0.001)
    async with open_app(fake) as (app, _):
        raw = bytearray()
        scope = http_scope("POST", "/v1/completions")
        async with connect(app, scope) as conn:
            conn.send(b'{"model": "tiny", "prompt": "hi", "max_tokens": 40, "stream": true}')
            raw += await conn.receive()
            await trio.sleep(1)  # the client stalls; the engine keeps producing
            raw += await conn.read_all()
    from tests.fake_engine import parse_sse

    events, _ = parse_sse(bytes(raw))
    chunks = [__import__("json").loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    expected = TOK.decode([IDS[i % len(IDS)] for i in range(40)])
    assert text == expected
    assert len(chunks) < 20  # 40 tokens, far fewer events


async def test_engine_abort_finish_is_an_error(autojump_clock: trio.abc.Clock) -> None:
    from smgd.wire.common import Finish

    fake = engine(
        finish=Finish(reason=FinishReason.ABORT, message="prompt rejected", status_code=400)
    )
    async with open_app(fake) as (app, _):
        reply = await post(app, "/v1/completions", {"model": MODEL, "prompt": "hi"})
    assert reply.status == 400
    assert reply.json()["error"]["message"] == "prompt rejected"


async def test_n_choices_get_seed_plus_index(autojump_clock: trio.abc.Clock) -> None:
    fake = engine()
    async with open_app(fake) as (app, _):
        reply = await post(
            app, "/v1/completions",
            {"model": MODEL, "prompt": ["a", "b"], "n": 3, "seed": 100, "max_tokens": 1},
        )  # fmt: skip
        assert reply.status == 200, reply.body
        native = await post(
            app, "/generate",
            {"text": "a", "sampling_params": {"n": 2, "sampling_seed": 5, "max_new_tokens": 1}},
        )  # fmt: skip
        assert native.status == 200, native.body
    # Each prompt's choices get seed + j, j = 0..n-1 (as vLLM's parallel sampling does).
    seeds = sorted(r.sampling.seed for r in fake.requests if r.sampling.seed is not None)
    assert seeds == [5, 6, 100, 100, 101, 101, 102, 102]


async def test_n_above_1_with_greedy_sampling_is_a_400(autojump_clock: trio.abc.Clock) -> None:
    fake = engine()
    async with open_app(fake) as (app, _):
        for path, body in (
            ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2, "temperature": 0}),
            ("/v1/chat/completions", {**CHAT, "n": 2, "temperature": 0, "stream": True}),
        ):
            reply = await post(app, path, body)
            assert reply.status == 400
            error = reply.json()["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", "n")
            assert error["message"] == "n must be 1 when using greedy sampling, got 2."
    assert fake.requests == []


class StopTokenEngine(FakeEngine):
    """Finishes a request on the first id of its ``stop_token_ids`` it emits, as engines do."""

    def deliver(self, delta: TokenDelta) -> None:
        req = next((r for r in self.requests if r.rid == delta.rid), None)
        stops = () if req is None else req.sampling.stop_token_ids
        hit = next((i for i, t in enumerate(delta.token_ids) if t in stops), None)
        if hit is not None:
            del delta.token_ids[hit + 1 :]
            delta.finish = Finish(reason=FinishReason.STOP, matched_token=delta.token_ids[hit])
        super().deliver(delta)


async def test_stop_reason_is_null_for_eos_and_length(autojump_clock: trio.abc.Clock) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 5}
    chat = {**CHAT, "max_tokens": 5}
    async with open_app(engine(eos_after=3)) as (app, _):
        for path, req in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            choice = (await post(app, path, req)).json()["choices"][0]
            assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
        # /generate keeps SGLang's shape: the EOS id is the match.
        native = await post(app, "/generate", {"text": "hi", "sampling_params": {}})
        assert native.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    async with open_app(engine()) as (app, _):
        for path, req in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            choice = (await post(app, path, req)).json()["choices"][0]
            assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)


async def test_stop_reason_names_the_stop_token_id(autojump_clock: trio.abc.Clock) -> None:
    stop_id = IDS[4]
    fake = StopTokenEngine(behaviour=Behaviour(output=IDS))
    async with open_app(fake) as (app, _):
        for path, req in (
            ("/v1/completions", {"model": MODEL, "prompt": "hi"}),
            ("/v1/chat/completions", CHAT),
        ):
            reply = await post(app, path, {**req, "stop_token_ids": [stop_id]})
            choice = reply.json()["choices"][0]
            assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_id)
            assert reply.json()["usage"]["completion_tokens"] == 5
        # An EOS id listed in stop_token_ids is still EOS (vLLM checks EOS first)...
        fake.behaviour = Behaviour(output=IDS, eos_after=2)
        body = {"model": MODEL, "prompt": "hi", "stop_token_ids": [EOS]}
        reply = await post(app, "/v1/completions", body)
        assert reply.json()["choices"][0]["stop_reason"] is None
        # ...unless ignore_eos: then it is one of the client's stop tokens.
        reply = await post(app, "/v1/completions", {**body, "ignore_eos": True})
        assert reply.json()["choices"][0]["stop_reason"] == EOS


async def test_a_prompts_token_ids_are_scanned_once_per_choice(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Checked against the engine's vocabulary when the request is planned; the submit on the
    # same engine does not scan them again (a 4,096-id prompt costs ~130 µs a scan).
    scans = VocabularyScans(monkeypatch)
    fake = engine()
    async with open_app(fake) as (app, _):
        body = {"model": MODEL, "prompt": IDS, "max_tokens": 3, "n": 2, "temperature": 1.0}
        reply = await post(app, "/v1/completions", body)
        assert reply.status == 200, reply.body
        streamed = await post_stream(app, "/v1/completions", {**body, "stream": True})
    assert len(fake.requests) == 4 and streamed
    assert scans.lengths == [len(IDS)] * 4  # two choices, twice: once each
