"""Streaming equals non-streaming for any split of the text (hypothesis: random cut points),
on the corpus and on random markup soup; and the JSON scanner agrees with ``json.loads``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smgd.parse import REASONING_PARSERS, TOOL_PARSERS
from smgd.parse.scan import CallHeader, JsonScanner
from tests.parse_corpus import check

CORPUS = check.load()

# Every parser alone, every reasoning parser with every tool parser.
COMBOS: list[tuple[str | None, str | None]] = [
    *((tool, None) for tool in TOOL_PARSERS),
    *((None, r) for r in REASONING_PARSERS),
    *((tool, r) for tool in TOOL_PARSERS for r in REASONING_PARSERS),
]


def _cut(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    pieces, last = [], 0
    for p in points:
        pieces.append(text[last:p])
        last = p
    pieces.append(text[last:])
    return pieces


def _same_for_any_split(case: check.Case, cuts: list[int]) -> None:
    whole = check.run(CORPUS, case, [case.text])
    pieces = check.run(CORPUS, case, _cut(case.text, cuts))
    assert check.smgd_normal(pieces) == check.smgd_normal(whole)
    # ids too: the calls are announced in the same order whatever the split
    assert [e for e in pieces if getattr(e, "id", None)] == [
        e for e in whole if getattr(e, "id", None)
    ]
    assert not check.shape_errors(pieces)


@settings(max_examples=400, deadline=None)
@given(case=st.sampled_from(CORPUS.cases), cuts=st.lists(st.integers(0, 400), max_size=40))
def test_corpus_any_split_equals_whole(case: check.Case, cuts: list[int]) -> None:
    _same_for_any_split(case, cuts)


@settings(max_examples=50, deadline=None)
@given(case=st.sampled_from(CORPUS.cases))
def test_corpus_char_by_char_equals_whole(case: check.Case) -> None:
    _same_for_any_split(case, list(range(len(case.text))))


# Pieces of every parser's markup, and things that look like it: random sequences of these hit
# the parsers' states in orders no model writes.
FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "<think>", "</think>", "</th",
    "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[TOOL_",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "function", "\n```json\n", "\n```",
    "<function=", "</function>", "<parameter=", "</parameter>", ">", "<",
    "{", "}", "[", "]", "(", ")", ":", ",", ";", "=", '"', "'", "'''", "\\", "\\u12",
    '"name"', '"arguments"', '"parameters"', '"get_weather"', '"search"', "get_weather", "search",
    "city", "query", "limit", "true", "null", "None", "-1.5e3", "42", " ", "\n", "\t",
    "héllo", "東京", "🚀", "x",
]  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    combo=st.sampled_from(COMBOS),
    parts=st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=3), max_size=40),
    cuts=st.lists(st.integers(0, 300), max_size=30),
)
def test_markup_soup_any_split_equals_whole(
    combo: tuple[str | None, str | None], parts: list[str], cuts: list[int]
) -> None:
    tool, reasoning = combo
    for thinking in (True, False):
        case = check.Case(
            id="soup",
            text="".join(parts),
            tool=tool,
            reasoning=reasoning,
            thinking=thinking,
            differs=None,
            expect=None,
            vllm_stream=(),
        )
        _same_for_any_split(case, cuts)


# ------------------------------------------------------------------------- the JSON scanner

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


def _scan(text: str, cuts: list[int]) -> tuple[bool, int]:
    """(whole valid value followed by whitespace only, where it ended), fed in pieces."""
    scanner = JsonScanner()
    pos = 0
    for piece in _cut(text, cuts):
        base = pos
        pos += len(piece)
        end = scanner.feed(piece)
        if scanner.error:
            return False, base + end
        if scanner.done:
            return text[base + end :].strip(" \t\n\r") == "", base + end
    return scanner.finish(), len(text)


def _json_ok(text: str) -> bool:
    def no_constants(name: str) -> Any:
        raise ValueError(name)  # NaN / Infinity: Python's extension, not JSON

    try:
        json.loads(text, parse_constant=no_constants)
    except ValueError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(
    value=json_values,
    indent=st.none() | st.integers(0, 2),
    ensure_ascii=st.booleans(),
    cuts=st.lists(st.integers(0, 200), max_size=20),
)
def test_scanner_finds_the_end_of_any_json(
    value: Any, indent: int | None, ensure_ascii: bool, cuts: list[int]
) -> None:
    text = json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)
    assert _scan(text, cuts) == (True, len(text))
    assert _scan(text + " tail", cuts) == (False, len(text))


@settings(max_examples=1000, deadline=None)
@given(
    text=st.text(alphabet='{}[],:"\\ \n\ttruefalsnu0123456789-.eE+xé/b', max_size=24),
    cuts=st.lists(st.integers(0, 24), max_size=6),
)
def test_scanner_agrees_with_json_loads(text: str, cuts: list[int]) -> None:
    assert _scan(text, cuts)[0] == _json_ok(text)


@pytest.mark.parametrize(
    "text",
    [
        '"\x01"',
        '"\\x"',
        '"\\u12g4"',
        "01",
        "1.",
        "-",
        "1e",
        "[1,]",
        '{"a":1,}',
        "{,}",
        "tru",
        "nul",
    ],
)
def test_scanner_rejects(text: str) -> None:
    assert not _scan(text, [])[0]
    assert not _json_ok(text)


def test_scanner_stops_at_member_values() -> None:
    scanner = JsonScanner()
    text = '{"a": {"b": [1, "}"]}, "c": 2.5}'
    start = text.index("{", 1)
    assert scanner.feed(text, 0, start) == start
    end = scanner.feed(text, start, stop_depth=1)
    assert scanner.stopped and text[start:end] == '{"b": [1, "}"]}'
    start = text.index("2.5")
    scanner.feed(text, end, start)
    end = scanner.feed(text, start, stop_depth=1)
    assert scanner.stopped and text[start:end] == "2.5"
    assert scanner.feed(text, end) == len(text) and scanner.done


# ------------------------------------------------------------------------- the call header


@settings(max_examples=200, deadline=None)
@given(
    name=st.text(min_size=1, max_size=8),
    key=st.sampled_from(["arguments", "parameters"]),
    ws=st.lists(st.sampled_from(["", " ", "\n", "\t "]), min_size=7, max_size=7),
    cuts=st.lists(st.integers(0, 80), max_size=8),
)
def test_call_header_reads_any_spacing_and_split(
    name: str, key: str, ws: list[str], cuts: list[int]
) -> None:
    head = f'{ws[0]}{{{ws[1]}"name"{ws[2]}:{ws[3]}{json.dumps(name)}{ws[4]},{ws[5]}"{key}"{ws[6]}:'
    text = head + ' {"x": 1}}'
    header = CallHeader(("arguments", "parameters"))
    pos, found = 0, -1
    for piece in _cut(text, cuts):
        found = header.feed(piece)
        if found >= 0:
            found += pos
            break
        assert found == -1
        pos += len(piece)
    assert found == len(head)
    assert (header.name, header.key) == (name, key)


@pytest.mark.parametrize(
    "text",
    [
        '{"arguments": {}, "name": "f"}',
        '{"name": "f", "parameters": {}}',
        '{"name": 3, "arguments": {}}',
        '["name"]',
        'name: "f"',
        '{"nam": "f"}',
    ],
)
def test_call_header_rejects_other_shapes(text: str) -> None:
    assert CallHeader(("arguments",)).feed(text) == -2
