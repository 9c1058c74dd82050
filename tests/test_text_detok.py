"""Incremental detokenizer and TextStream: streamed text equals one-shot decode."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smgd.assets import TINY_MODEL_DIR
from smgd.text.detok import IncrementalDetokenizer
from smgd.text.stream import TextStream
from smgd.text.tokenizer import Tokenizer, load_tokenizer
from tests.test_text_stops import reference_cut


@functools.cache
def tok() -> Tokenizer:
    return load_tokenizer(TINY_MODEL_DIR)


def chunks(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    out, i = [], 0
    for size in sizes:
        if i >= len(ids):
            break
        out.append(list(ids[i : i + size]))
        i += size
    if i < len(ids):
        out.append(list(ids[i:]))
    return out


# The detokenizer's three paths: the byte table (byte-level vocabularies such as the tiny
# model's), DecodeStream (other vocabularies) and the windowed fallback.
MODES = ("table", "stream", "window")


def detok(mode: str = "table", tokenizer: Any = None, **kwargs: Any) -> IncrementalDetokenizer:
    d = IncrementalDetokenizer(
        tok() if tokenizer is None else tokenizer,
        use_byte_table=mode == "table",
        use_decode_stream=mode != "window",
        **kwargs,
    )
    assert (d._table is not None) == (mode == "table")
    assert (d._stream is not None) == (mode == "stream")
    return d


def stream_text(d: IncrementalDetokenizer, parts: list[list[int]]) -> list[str]:
    return [d.push(p) for p in parts] + [d.flush()]


# Ids anywhere in the vocab (specials included, so random byte tokens make invalid UTF-8
# too) and chunk sizes 1..4, so deltas of one and of several tokens both occur.
IDS = st.lists(st.integers(0, 1023), max_size=40)
SIZES = st.lists(st.integers(1, 4), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ids=IDS, sizes=SIZES, skip=st.booleans(), mode=st.sampled_from(MODES))
def test_streamed_text_equals_one_shot_decode(
    ids: list[int], sizes: list[int], skip: bool, mode: str
) -> None:
    d = detok(mode, skip_special_tokens=skip)
    assert "".join(stream_text(d, chunks(ids, sizes))) == tok().decode(
        ids, skip_special_tokens=skip
    )
    assert d.num_tokens == len(ids)


TEXT = st.text(st.sampled_from("ab c\nçé日本🙂🚀👩‍💻<s>"), max_size=30)


@settings(max_examples=100, deadline=None)
@given(text=TEXT, sizes=SIZES, mode=st.sampled_from(MODES))
def test_real_text_streams_without_replacement_chars(
    text: str, sizes: list[int], mode: str
) -> None:
    ids = tok().encode(text, add_special_tokens=False)
    d = detok(mode)
    pieces = stream_text(d, chunks(ids, sizes))
    assert "".join(pieces) == tok().decode(ids)
    assert not any("\ufffd" in p for p in pieces)  # never a broken character mid-stream


@pytest.mark.parametrize("mode", MODES)
def test_ids_no_vocabulary_has_from_the_engine_have_no_text(mode: str) -> None:
    """A negative id or one past u32 (a misbehaving engine's) decodes to nothing, as an id past
    the vocabulary does; the tokenizer itself raises OverflowError for them."""
    ids = tok().encode("hello there", add_special_tokens=False)
    d = detok(mode)
    pieces = [d.push(ids[:1]), d.push([-1]), d.push([2**40, 5000]), d.push(ids[1:])]
    assert "".join(pieces) + d.flush() == tok().decode(ids)


@pytest.mark.parametrize("mode", MODES)
def test_split_character_is_held_until_complete(mode: str) -> None:
    ids = tok().encode("a🦀b", add_special_tokens=False)
    d = detok(mode)
    out = [d.push([i]) for i in ids]
    assert out[0] == "a"
    assert out[-1] == "b"
    assert "".join(out) == "a🦀b"
    assert "" in out  # at least one token completed no character


@pytest.mark.parametrize("mode", MODES)
def test_incomplete_character_at_end_flushes_as_replacement(mode: str) -> None:
    ids = tok().encode("🦀", add_special_tokens=False)
    assert len(ids) > 1
    d = detok(mode)
    assert d.push(ids[:-1]) == ""
    assert d.flush() == tok().decode(ids[:-1])
    assert "\ufffd" in tok().decode(ids[:-1])


@pytest.mark.parametrize("mode", MODES)
def test_without_keep_held_an_unfinished_character_at_the_end_is_dropped(mode: str) -> None:
    """vLLM's front end: the output text is what the steps emitted; held bytes are dropped."""
    ids = tok().encode("a🦀", add_special_tokens=False)
    d = detok(mode, keep_held=False)
    assert "".join(d.push([i]) for i in ids[:-1]) == "a"
    assert d.flush() == ""
    assert d.flush() == ""  # nothing held any more
    keep = detok(mode)
    assert "".join(keep.push([i]) for i in ids[:-1]) + keep.flush() == tok().decode(ids[:-1])


@settings(max_examples=150, deadline=None)
@given(ids=IDS, sizes=SIZES, mode=st.sampled_from(MODES))
def test_without_keep_held_the_text_does_not_depend_on_how_ids_were_batched(
    ids: list[int], sizes: list[int], mode: str
) -> None:
    """vLLM steps one id at a time; the engine's batches here depend on timing (a batch that
    ended inside a character once lost its whole text)."""
    one_by_one = detok(mode, keep_held=False)
    expected = "".join(stream_text(one_by_one, [[i] for i in ids]))
    batched = detok(mode, keep_held=False)
    assert "".join(stream_text(batched, chunks(ids, sizes))) == expected


def test_without_keep_held_a_batch_ending_inside_a_character_keeps_its_complete_text() -> None:
    ids = tok().encode("ab🦀", add_special_tokens=False)
    for mode in MODES:
        d = detok(mode, keep_held=False)
        assert d.push(ids[:-1]) == ""  # one batch: "ab" and the crab's first bytes
        assert d.flush() == "ab"


class _CountingDecoder:
    """A tokenizer's ``decode`` that counts the ids it was given (the fallback path's only
    use of the tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.ids_decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.ids_decoded += len(ids)
        return str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def test_without_keep_held_a_long_run_of_stray_bytes_flushes_in_one_pass() -> None:
    """Walking back over held ids decodes a short window per id, not the whole run each time
    (2,000 stray bytes: ~2 million ids decoded the other way)."""
    stray = next(i for i in range(1024) if tok().decode([i, i]) == "\ufffd\ufffd")
    ids = [*tok().encode("hello", add_special_tokens=False), *[stray] * 2000]
    counting = _CountingDecoder(tok().hf)
    d = detok("window", cast(Any, counting), keep_held=False)
    assert d.push(ids) == ""  # one batch ending inside a "character"
    counting.ids_decoded = 0
    assert d.flush() == "hello"
    assert counting.ids_decoded < 10 * len(ids)


@pytest.mark.parametrize("mode", MODES)
def test_skip_special_tokens_option(mode: str) -> None:
    ids = [*tok().encode("hi", add_special_tokens=False), 5]
    keep = detok(mode, skip_special_tokens=False)
    assert "".join(stream_text(keep, [ids])) == "hi<|im_end|>"
    drop = detok(mode)
    assert "".join(stream_text(drop, [ids])) == "hi"


@pytest.mark.parametrize("mode", MODES)
def test_prompt_priming_does_not_change_output(mode: str) -> None:
    prompt = tok().encode("Hello there, 日本語 🙂 friend")
    out = tok().encode(" world 🚀 again", add_special_tokens=False)
    d = detok(mode, prompt_ids=prompt)
    assert "".join(stream_text(d, [[i] for i in out])) == tok().decode(out)
    assert d.num_tokens == len(out)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("text", ["ab", "abcdefgh"])
def test_a_prompt_ending_inside_a_character_does_not_leak_into_the_output(
    mode: str, text: str
) -> None:
    """DecodeStream primed with ids whose text ends inside a character emits that whole text
    again on its first step; short prompts (up to 4 ids) were primed whole."""
    stray = next(i for i in range(1024) if tok().decode([i]) == "\ufffd")
    prompt = [*tok().encode(text, add_special_tokens=False), stray]
    out = tok().encode("ok", add_special_tokens=False)
    d = detok(mode, prompt_ids=prompt)
    assert "".join(stream_text(d, [[i] for i in out])) == "ok"


class _BrokenStream:
    """Stands in for a DecodeStream that hits "Invalid prefix" after a few steps."""

    def __init__(self, real: object, fail_after: int) -> None:
        self.real, self.left = real, fail_after

    def step(self, hf: object, ids: list[int]) -> str | None:
        self.left -= 1
        if self.left < 0:
            raise Exception("Invalid prefix encountered")
        text: str | None = self.real.step(hf, ids)  # type: ignore[attr-defined]
        return text


@pytest.mark.parametrize("fail_after", [0, 1, 3, 6])
def test_decode_stream_error_switches_to_fallback(fail_after: int) -> None:
    text = "Café 🙂 crème brûlée 日本語 done"
    ids = tok().encode(text, add_special_tokens=False)
    d = detok("stream")
    d._stream = _BrokenStream(d._stream, fail_after)  # type: ignore[assignment]
    assert "".join(stream_text(d, [[i] for i in ids])) == text
    assert d.using_fallback


@settings(max_examples=100, deadline=None)
@given(ids=IDS, skip=st.booleans(), mode=st.sampled_from(MODES), fail_after=st.integers(0, 45))
def test_push_each_equals_push_of_one_id_at_a_time(
    ids: list[int], skip: bool, mode: str, fail_after: int
) -> None:
    # Also when DecodeStream fails partway (on its first step, in the middle, or never).
    one = detok(mode, skip_special_tokens=skip)
    each = detok(mode, skip_special_tokens=skip)
    if mode == "stream":
        one._stream = _BrokenStream(one._stream, fail_after)  # type: ignore[assignment]
        each._stream = _BrokenStream(each._stream, fail_after)  # type: ignore[assignment]
    half = len(ids) // 2
    want = [one.push([i]) for i in ids] + [one.flush()]
    got = [*each.push_each(ids[:half]), *each.push_each(ids[half:]), each.flush()]
    assert got == want
    assert "".join(got) == tok().decode(ids, skip_special_tokens=skip)
    assert each.using_fallback == one.using_fallback


@settings(max_examples=100, deadline=None)
@given(
    text=TEXT,
    sizes=SIZES,
    stops=st.lists(st.text(st.sampled_from("ab c🙂日"), min_size=1, max_size=3), max_size=3),
    include=st.booleans(),
)
def test_text_stream_matches_decode_then_cut(
    text: str, sizes: list[int], stops: list[str], include: bool
) -> None:
    ids = tok().encode(text, add_special_tokens=False)
    ts = TextStream(tok(), stops=stops, include_stop=include)
    pieces = [ts.push(p) for p in chunks(ids, sizes)]
    got = "".join(t for t, _ in pieces) + ts.finish()
    hits = [h for _, h in pieces if h is not None]
    want, want_hit = reference_cut(tok().decode(ids), stops, include)
    assert got == want
    assert ts.stop_hit == want_hit
    assert len(hits) <= 1


def test_text_stream_drops_stop_token_text() -> None:
    ids = tok().encode("hi", add_special_tokens=False)
    ts = TextStream(tok(), skip_special_tokens=False)
    assert ts.push([*ids, 2], stop_token=True) == ("hi", None)
    kept = TextStream(tok(), skip_special_tokens=False, include_stop=True)
    assert kept.push([*ids, 2], stop_token=True) == ("hi</s>", None)


def test_text_stream_after_stop_is_silent() -> None:
    ts = TextStream(tok(), stops=["lo"])
    ids = tok().encode("Hello world", add_special_tokens=False)
    text, hit = ts.push(ids)
    assert (text, hit) == ("Hel", "lo")
    assert ts.push(ids) == ("", None)
    assert ts.finish() == ""


@settings(max_examples=150, deadline=None)
@given(
    text=TEXT,
    sizes=SIZES,
    stops=st.lists(st.text(st.sampled_from("ab c🙂日"), min_size=1, max_size=3), max_size=3),
    include=st.booleans(),
)
def test_text_stream_keeps_ids_through_the_one_completing_the_stop(
    text: str, sizes: list[int], stops: list[str], include: bool
) -> None:
    # However the ids are grouped into deltas, the output ends at the first id after which
    # the text holds a stop: what an engine that checks stops after every token would make.
    # The text after id j is the decode of the longest prefix up to j that does not end in an
    # unfinished character (the text of an id with such bytes waits for the next one).
    ids = tok().encode(text, add_special_tokens=False)
    ts = TextStream(tok(), stops=stops, include_stop=include)
    used = 0
    for part in chunks(ids, sizes):
        _, hit = ts.push(part)
        if hit is not None:
            assert 1 <= ts.kept <= len(part)
            used += ts.kept
            break
        used += len(part)
    prefixes: list[str] = []
    for j in range(1, len(ids) + 1):
        whole = tok().decode(ids[:j])
        held = whole.endswith("\ufffd")
        prefixes.append((prefixes[-1] if prefixes else "") if held else whole)
    want = next(
        (j + 1 for j, p in enumerate(prefixes) if reference_cut(p, stops, include)[1] is not None),
        len(ids),
    )
    assert used == want


def test_text_stream_merged_delta_ends_at_the_stop() -> None:
    ids = tok().encode("Hello world, hello", add_special_tokens=False)
    ts = TextStream(tok(), stops=["wor"])
    assert ts.push(ids) == ("Hello ", "wor")
    assert "wor" in tok().decode(ids[: ts.kept])
    assert "wor" not in tok().decode(ids[: ts.kept - 1])
