"""Pure tests of the pre-built SSE framing: every chunk is exactly the JSON OpenAI defines."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from smgd.api.core.sse import DONE, ChunkFormat, event


def frame(raw: bytes) -> object:
    assert raw.startswith(b"data: ")
    assert raw.endswith(b"\n\n")
    assert b"\n" not in raw[:-2]  # one line per event, whatever the text contains
    return json.loads(raw[len(b"data: ") : -2])


@given(
    text=st.text(),
    model=st.text(min_size=1),
    index=st.integers(0, 200),
    finish=st.sampled_from([None, "stop", "length"]),
    role=st.booleans(),
    usage=st.booleans(),
)
def test_chat_chunk_is_openai_json(
    text: str, model: str, index: int, finish: str | None, role: bool, usage: bool
) -> None:
    fmt = ChunkFormat(response_id="chatcmpl-x", created=7, model=model, chat=True,
                      include_usage=usage)  # fmt: skip
    got = frame(fmt.chunk(index, text, role=role, finish_reason=finish))
    if role:
        delta = {"role": "assistant", "content": text}
    elif text or finish is None:
        delta = {"content": text}
    else:
        delta = {}
    expected: dict[str, object] = {
        "id": "chatcmpl-x",
        "object": "chat.completion.chunk",
        "created": 7,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if usage:
        expected["usage"] = None
    assert got == expected


@given(text=st.text(), index=st.integers(0, 5), finish=st.sampled_from([None, "length"]))
def test_completion_chunk_is_openai_json(text: str, index: int, finish: str | None) -> None:
    fmt = ChunkFormat(response_id="cmpl-1", created=1, model="m", chat=False, include_usage=False)
    assert frame(fmt.chunk(index, text, finish_reason=finish)) == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}],
    }


@given(
    text=st.text(),
    model=st.text(min_size=1),
    indexes=st.lists(st.integers(0, 8), min_size=1, max_size=6),
    chat=st.booleans(),
    usage=st.booleans(),
)
def test_text_event_is_the_plain_chunk(
    text: str, model: str, indexes: list[int], chat: bool, usage: bool
) -> None:
    fmt = ChunkFormat(response_id="x-1", created=3, model=model, chat=chat, include_usage=usage)
    for index in indexes:  # any order: the per-index pieces are built on first use
        assert fmt.text_event(index, text) == fmt.chunk(index, text)


def test_usage_chunk_has_no_choices() -> None:
    fmt = ChunkFormat(response_id="c", created=1, model="m", chat=True, include_usage=True)
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert frame(fmt.usage(usage)) == {
        "id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [], "usage": usage,
    }  # fmt: skip


def test_event_and_done() -> None:
    assert frame(event({"error": {"message": "x"}})) == {"error": {"message": "x"}}
    assert DONE == b"data: [DONE]\n\n"
