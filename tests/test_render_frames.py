"""The renderers' text frames: a direct stream builds a mid-stream event from one, and it must
be the very bytes the renderer's ``delta`` returns for that text."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from smgd.api.core.pipeline import Choice, RequestState
from smgd.api.core.sse import ChunkFormat, encode_json
from smgd.api.handlers.native import NativeRenderer
from smgd.api.handlers.openai import OpenAIRenderer, ParsedRenderer, TokenText
from smgd.text.stream import TextStream
from smgd.text.tokenizer import load_tokenizer
from tests.fake_engine import TINY_MODEL

TOK = load_tokenizer(TINY_MODEL)


def _state() -> RequestState:
    return RequestState(request_id="r", kind="chat", model="m", created=0, t_start=0.0)


def _choice(index: int = 0) -> Choice:
    return Choice(index, f"r{index}", TextStream(TOK), prompt_tokens=3)


def _format(chat: bool, usage: bool) -> ChunkFormat:
    return ChunkFormat(response_id="x-1", created=5, model="m", chat=chat, include_usage=usage)


@given(
    texts=st.lists(st.text(), min_size=1, max_size=5),
    chat=st.booleans(),
    usage=st.booleans(),
    index=st.integers(0, 3),
    echo=st.booleans(),
)
def test_a_text_frame_around_a_text_is_the_renderers_event(
    texts: list[str], chat: bool, usage: bool, index: int, echo: bool
) -> None:
    state = _state()
    render = OpenAIRenderer(
        _format(chat, usage), state, include_usage=usage, echo={index: "p: "} if echo else None
    )
    choice = _choice(index)
    assert render.text_frame(choice) is None  # the first event (role, echo) is still to come
    render.delta(choice, "first")
    frame = render.text_frame(choice)
    assert frame is not None and len(frame) == 2
    before, after = frame
    for text in texts:
        expected = render.delta(choice, text)
        if text:
            assert before + encode_json(text) + after == expected
        else:
            assert expected == b""  # the sink sends nothing for an empty text too


def test_events_with_logprobs_never_have_a_frame() -> None:
    render = OpenAIRenderer(
        _format(True, False), _state(), include_usage=False, tokens=TokenText(TOK)
    )
    choice = _choice()
    assert render.text_frame(choice) == ()
    choice.sent_role = True
    assert render.text_frame(choice) == ()


def test_a_parsed_choice_never_has_a_frame_and_a_plain_one_does() -> None:
    parser: Any = object()  # only its presence matters to text_frame
    render = ParsedRenderer(_format(True, True), _state(), {0: parser}, include_usage=True)
    parsed, plain = _choice(0), _choice(1)
    assert render.text_frame(parsed) == ()
    assert render.text_frame(plain) is None
    render.delta(plain, "hi")
    frame = render.text_frame(plain)
    assert isinstance(frame, tuple) and len(frame) == 2
    assert frame[0] + encode_json("there") + frame[1] == render.delta(plain, "there")


@pytest.mark.parametrize("indexed", [False, True])
def test_native_events_never_have_a_frame(indexed: bool) -> None:
    render = NativeRenderer(_state(), 16, indexed=indexed)
    choice = _choice()
    assert render.text_frame(choice) == ()
    choice.sent_role = True
    assert render.text_frame(choice) == ()
