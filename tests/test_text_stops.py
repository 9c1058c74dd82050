"""Stop-string matching with hold-back, checked against a brute-force reference."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smgd.text.stops import StopMatcher, cut_at_first_stop


def reference_cut(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """Independent definition: the first prefix of `text` ending in a stop (longest wins)."""
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(stop):
                return text[: end if include else end - len(stop)], stop
    return text, None


def run(m: StopMatcher, pieces: Sequence[str]) -> tuple[str, list[str]]:
    out, hits = [], []
    for p in pieces:
        text, hit = m.feed(p)
        out.append(text)
        if hit is not None:
            hits.append(hit)
    return "".join(out) + m.flush(), hits


def split(text: str, cuts: Sequence[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    edges = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(edges)]


ALPHABET = st.sampled_from("abc 🙂\n")


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(ALPHABET, max_size=40),
    cuts=st.lists(st.integers(0, 100), max_size=12),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=4),
    include=st.booleans(),
)
def test_streamed_equals_one_shot_cut(
    text: str, cuts: list[int], stops: list[str], include: bool
) -> None:
    m = StopMatcher(stops, include_stop=include)
    got, hits = run(m, split(text, cuts))
    want, want_hit = reference_cut(text, stops, include)
    assert got == want
    assert hits == ([want_hit] if want_hit else [])
    assert m.hit == want_hit
    assert cut_at_first_stop(text, stops, include_stop=include) == (want, want_hit)


def test_stop_split_across_pieces_is_caught() -> None:
    m = StopMatcher(["\n\nUser:"])
    assert m.feed("Answer.\n") == ("An", None)  # len(stop) - 1 = 6 chars held back
    assert m.feed("\nUs") == ("swe", None)
    assert m.feed("er: more") == ("r.", "\n\nUser:")
    assert m.done
    assert m.flush() == ""


def test_hold_back_is_released_when_no_stop_follows() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("abcdef") == ("abc", None)  # 3 = len("STOP") - 1 chars held
    assert m.feed("g") == ("d", None)
    assert m.flush() == "efg"


def test_earliest_ending_stop_wins_then_longest() -> None:
    assert cut_at_first_stop("xabcd", ["abcd", "bc"]) == ("xa", "bc")
    assert cut_at_first_stop("xabc", ["bc", "abc"]) == ("x", "abc")
    assert cut_at_first_stop("xabc", ["bc"], include_stop=True) == ("xabc", "bc")


def test_no_stops_passes_through() -> None:
    m = StopMatcher([])
    assert m.feed("anything") == ("anything", None)
    assert m.flush() == ""


def test_empty_stop_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["ok", ""])


def test_hit_end_is_where_the_stop_ends_in_the_fed_text() -> None:
    m = StopMatcher(["\n\nUser:"])
    assert m.feed("Answer.\n\nUs") == ("Answe", None)
    assert m.feed("er: more") == ("r.", "\n\nUser:")
    assert m.hit_end == 3  # "er:" of the second piece


def test_long_stops_are_matched_without_a_combined_pattern() -> None:
    """32 stops of 50,000 characters sharing a prefix (the most a request may send): re.compile
    of their alternation strips the shared prefix one character at a time (quadratic), 8.3 s
    on the event loop. They are searched one by one instead, and still match as before."""
    shared = "z" * 50_000
    stops = [f"{shared}{i:02d}" for i in range(32)]
    matcher = StopMatcher(stops)
    assert matcher._any is None  # no alternation was compiled
    text, hits = run(matcher, ["hi ", shared[:30_000], shared[30_000:], "17 tail"])
    assert (text, hits) == ("hi ", [f"{shared}17"])
    assert cut_at_first_stop(f"hi {shared}17 tail", stops) == ("hi ", f"{shared}17")
