"""smgd.parse behaviour beyond the corpus: the registry, the layer rule, incremental streaming,
OpenAI's delta shape, ids, schema typing (qwen3_coder), pythonic values, and the cost per
delta."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tracemalloc
from typing import TYPE_CHECKING, Any

import pytest

from smgd.parse import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ContentDelta,
    Event,
    ReasoningDelta,
    StreamParser,
    ToolCallDelta,
    UnknownParser,
    parse,
    reasoning_parser,
    scan,
    stream_parser,
    tool_parser,
)
from smgd.parse.json_calls import Hermes
from smgd.parse.pythonic import _CallScanner, call_arguments
from smgd.parse.qwen_coder import coerce, schema_types

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "mode": {"type": "integer"}},
            },
        },
    }
]

# One long call per parser: its arguments hold a 'body' string; markup around it as each
# model writes it. "{body}" is replaced by the long text.
CALLS = {
    "hermes": '<tool_call>\n{{"name": "write", "arguments": {{"path": "{body}"}}}}\n</tool_call>',
    "llama3_json": '{{"name": "write", "parameters": {{"path": "{body}"}}}}',
    "mistral": '[TOOL_CALLS]write[ARGS]{{"path": "{body}"}}',
    "deepseek_v3": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>write\n```json\n"
        '{{"path": "{body}"}}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    ),
    "qwen3_coder": (
        "<tool_call>\n<function=write>\n<parameter=path>\n{body}\n</parameter>\n</function>\n"
        "</tool_call>"
    ),
    "pythonic": '[write(path="{body}")]',
}


def feed_all(parser: StreamParser, pieces: list[str]) -> list[list[Event]]:
    """The events each piece produced (the last entry: finish())."""
    return [parser.feed(p) for p in pieces] + [parser.finish()]


def test_calls_cover_every_tool_parser() -> None:
    assert set(CALLS) == set(TOOL_PARSERS)


# ---------------------------------------------------------------------------- registry


def test_unknown_tool_parser_lists_the_valid_names() -> None:
    with pytest.raises(UnknownParser) as info:
        tool_parser("hermes2")
    assert str(info.value) == (
        "unknown tool parser 'hermes2'; valid: deepseek_v3, hermes, llama3_json, mistral, "
        "pythonic, qwen3_coder"
    )
    assert info.value.valid == tuple(sorted(TOOL_PARSERS))
    assert isinstance(info.value, ValueError)


def test_unknown_reasoning_parser_lists_the_valid_names() -> None:
    with pytest.raises(
        UnknownParser, match=r"unknown reasoning parser 'r1'; valid: deepseek_r1, qwen3$"
    ):
        reasoning_parser("r1")
    with pytest.raises(UnknownParser, match="unknown reasoning parser"):
        stream_parser(tool="hermes", reasoning="nope")


def test_names_are_vllms() -> None:
    for name, tool in TOOL_PARSERS.items():
        assert (tool.name, bool(tool.models)) == (name, True)
    for name, reasoning in REASONING_PARSERS.items():
        assert (reasoning.name, bool(reasoning.models)) == (name, True)
    assert tool_parser("qwen3_coder") is TOOL_PARSERS["qwen3_coder"]


def test_parse_imports_nothing_above_it() -> None:
    code = (
        "import sys, smgd.parse\n"
        "print(sorted(m for m in sys.modules if m.startswith(('smgd', 'trio', 'zmq', 'quart'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    modules = json.loads(out.replace("'", '"'))
    assert all(m == "smgd" or m.startswith("smgd.parse") for m in modules), modules


# ---------------------------------------------------------------------------- streaming shape


@pytest.mark.parametrize("tool", [t for t in CALLS if t != "pythonic"])
def test_arguments_stream_before_the_call_ends(tool: str) -> None:
    """A long argument reaches the client while the model is still writing it."""
    body = "x" * 400
    text = CALLS[tool].format(body=body)
    parser = stream_parser(tool=tool, tools=TOOLS)
    sent = 0
    for n, step in enumerate(feed_all(parser, [text[i : i + 3] for i in range(0, len(text), 3)])):
        sent += sum(len(e.arguments) for e in step if isinstance(e, ToolCallDelta))
        fed = min(len(text), 3 * (n + 1))
        if fed >= text.index(body) + len(body):
            break
        if fed > text.index(body) + 50:
            # all of the body fed so far has been sent, but for a marker-sized tail
            assert sent >= fed - text.index(body) - 16, (tool, fed, sent)
    assert sent > len(body) // 2


def test_pythonic_sends_each_call_whole_at_its_parenthesis() -> None:
    text = '[write(path="a"), write(path="b", mode=1)]'
    cut = text.index(")") + 1
    parser = stream_parser(tool="pythonic")
    first = parser.feed(text[:cut])
    assert len(first) == 1 and isinstance(first[0], ToolCallDelta)
    assert first[0] == ToolCallDelta(0, '{"path": "a"}', id=first[0].id, name="write")
    rest = parser.feed(text[cut:]) + parser.finish()
    assert [(e.index, e.name) for e in rest if isinstance(e, ToolCallDelta)] == [(1, "write")]


def test_openai_delta_shape() -> None:
    first = ToolCallDelta(index=0, id="call_1", name="f", arguments="")
    more = ToolCallDelta(index=0, arguments='{"a"')
    assert first.to_openai() == {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    assert more.to_openai() == {"index": 0, "function": {"arguments": '{"a"'}}
    call = parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>', tool="hermes")
    assert call.tool_calls[0].to_openai()["type"] == "function"
    assert call.tool_calls[0].to_openai()["function"] == {"name": "f", "arguments": "{}"}


def test_ids_look_like_openais_and_mistrals() -> None:
    hermes = parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>', tool="hermes")
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", hermes.tool_calls[0].id)
    mistral = parse("[TOOL_CALLS]f[ARGS]{}", tool="mistral")
    assert re.fullmatch(r"[A-Za-z0-9]{9}", mistral.tool_calls[0].id)  # Mistral's templates need it
    ids = iter(["a", "b"])
    two = parse("[f(), g()]", tool="pythonic", new_id=lambda: next(ids))
    assert [c.id for c in two.tool_calls] == ["a", "b"]


def test_no_markup_in_content_around_calls() -> None:
    for tool, template in CALLS.items():
        text = "Before. " + template.format(body="v") + "\n"
        if tool in ("llama3_json", "pythonic"):
            text = template.format(body="v")  # these read calls only at the start
        result = parse(text, tool=tool, tools=TOOLS)
        assert [c.name for c in result.tool_calls] == ["write"], tool
        assert json.loads(result.tool_calls[0].arguments) == {"path": "v"}, tool
        assert result.content is None or result.content.strip() == "Before.", (tool, result)


def test_tool_calls_are_read_from_the_answer_only() -> None:
    text = (
        '<think>maybe <tool_call>{"name": "f", "arguments": {}}</tool_call></think>'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    )
    r1 = parse(text, tool="hermes", reasoning="deepseek_r1")
    assert [c.name for c in r1.tool_calls] == ["g"]
    assert r1.reasoning is not None and "<tool_call>" in r1.reasoning
    # qwen3 (as vLLM): a <tool_call> inside the reasoning ends it
    qwen = parse(text, tool="hermes", reasoning="qwen3")
    assert qwen.reasoning == "maybe "
    assert [c.name for c in qwen.tool_calls] == ["f", "g"]


def test_thinking_off_makes_everything_content() -> None:
    for name in REASONING_PARSERS:
        result = parse("a</think>b<think>c", reasoning=name, thinking=False)
        assert (result.content, result.reasoning) == ("a</think>b<think>c", None)


def test_no_parser_passes_text_through() -> None:
    parser = StreamParser()
    assert parser.feed("<tool_call>") == [ContentDelta("<tool_call>")]
    assert parser.feed("") == []
    assert parser.finish() == []


def test_reasoning_streams_as_it_comes() -> None:
    parser = stream_parser(reasoning="qwen3")
    assert parser.feed("<think>abc") == [ReasoningDelta("abc")]
    assert parser.feed("de</th") == [ReasoningDelta("de")]  # "</th" may be the end tag
    assert parser.feed("ink>xy") == [ContentDelta("xy")]
    assert parser.finish() == []


# ---------------------------------------------------------------------------- qwen3_coder typing


@pytest.mark.parametrize(
    ("text", "types", "value"),
    [
        ("5", {"integer"}, 5),
        (" 7 ", {"integer"}, 7),
        ("3.0", {"number"}, 3),
        ("0.25", {"number"}, 0.25),
        ("1e999", {"number"}, "1e999"),  # not a finite number: kept as text
        ("abc", {"integer"}, "abc"),
        ("True", {"boolean"}, True),
        ("0", {"boolean"}, False),
        ("null", {"string", "null"}, None),
        ("null", {"string"}, "null"),
        ('{"a": [1]}', {"object"}, {"a": [1]}),
        ("[1, 2]", {"array", "string"}, [1, 2]),
        ("not json", {"array"}, "not json"),
        ("[1e999]", {"array"}, "[1e999]"),
        ("12", {"object"}, 12),  # no type fits: JSON if it is JSON
    ],
)
def test_coerce_like_vllm(text: str, types: set[str], value: Any) -> None:
    got = coerce(text, types)
    assert got == value and type(got) is type(value)


def test_schema_types() -> None:
    assert schema_types({"type": "string"}) == {"string"}
    assert schema_types({"type": ["integer", "null"]}) == {"integer", "null"}
    assert schema_types({"enum": ["a", 1, 2.5, None, True]}) == {
        "string",
        "integer",
        "number",
        "null",
        "boolean",
    }
    assert schema_types({"anyOf": [{"type": "int"}, {"oneOf": [{"type": "Bool"}]}]}) == {
        "integer",
        "boolean",
    }
    assert schema_types({}) == {"string"}
    assert schema_types("nonsense") == {"string"}


def test_qwen3_coder_string_values_stream_and_others_arrive_whole() -> None:
    text = (
        "<tool_call>\n<function=write>\n<parameter=path>\nab\ncd\n</parameter>\n"
        "<parameter=mode>\n7\n</parameter>\n</function>\n</tool_call>"
    )
    parser = stream_parser(tool="qwen3_coder", tools=TOOLS)
    pieces = [
        e.arguments for ch in text for e in parser.feed(ch) if isinstance(e, ToolCallDelta)
    ] + [e.arguments for e in parser.finish() if isinstance(e, ToolCallDelta)]
    assert "".join(pieces) == '{"path": "ab\\ncd", "mode": 7}'
    assert ', "mode": 7' in pieces  # the integer in one piece
    assert "a" in pieces and "b" in pieces  # the string character by character


# ---------------------------------------------------------------------------- pythonic values


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("f()", ("f", "{}")),
        (
            "f(a=[1, (2, 3)], b={'k': {1}}, c=-1, d=+2.5)",
            ("f", '{"a": [1, [2, 3]], "b": {"k": [1]}, "c": -1, "d": 2.5}'),
        ),
        ("f(a=true, b=null, c=None, d=f'x')", ("f", '{"a": true, "b": null, "c": null, "d": "x"}')),
        ("f(a='\\d')", ("f", '{"a": "\\\\d"}')),  # an invalid escape: Python keeps the backslash
        ("f(1)", None),
        ("a.f(x=1)", None),
        ("f(**k)", None),
        ("f(x=b'1')", None),
        ("f(x=f'{y}')", None),
        ("f(x=y)", None),
        ("f(x=-True)", None),
        ("f(x=1, x=2)", ("f", '{"x": 2}')),  # as vLLM: ast.parse lets it through, last wins
        ("f(x=", None),
        ("[f()]", None),
    ],
)
def test_pythonic_call_arguments(text: str, expected: tuple[str, str] | None) -> None:
    assert call_arguments(text) == expected


# ---------------------------------------------------------------------------- cost
#
# Cost is counted, not timed (a timing fails on a loaded machine): the characters the parsers'
# scanning core is handed (every parser reads text through smgd.parse.scan and pythonic's call
# scanner), and the bytes each feed allocates (what copying held text costs). Both are the
# same on an idle machine and a loaded one.


class CostMeter:
    """Counts the characters handed to the parsers' scanning core while it is installed,
    and (in :meth:`cost`) the bytes allocated per feed.

    ``find_marker`` is charged the text from its start on (what ``str.find`` may read),
    ``partial_marker`` the whole tail its caller sliced, the scanners the span they read,
    ``Out.text`` the text it strips. Installed in every loaded ``smgd.parse`` module (the
    parsers import the functions by name) and on the scanner classes.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.chars = 0
        find, partial = scan.find_marker, scan.partial_marker

        def find_marker(buf: str, markers: Sequence[str], start: int = 0) -> tuple[int, str]:
            self.chars += len(buf) - start
            return find(buf, markers, start)

        def partial_marker(buf: str, markers: Sequence[str]) -> int:
            self.chars += len(buf)
            return partial(buf, markers)

        for module in [m for name, m in sys.modules.items() if name.startswith("smgd.parse")]:
            for original, meter in ((find, find_marker), (partial, partial_marker)):
                if getattr(module, original.__name__, None) is original:
                    monkeypatch.setattr(module, original.__name__, meter)
        json_feed, header_feed = scan.JsonScanner.feed, scan.CallHeader.feed
        call_feed, out_text = _CallScanner.feed, scan.Out.text

        def span(text: str, start: int, end: int | None) -> None:
            self.chars += (len(text) if end is None else end) - start

        def json_scanner_feed(
            scanner: scan.JsonScanner,
            text: str,
            start: int = 0,
            end: int | None = None,
            stop_depth: int = -1,
        ) -> int:
            span(text, start, end)
            return json_feed(scanner, text, start, end, stop_depth)

        def call_header_feed(
            header: scan.CallHeader, text: str, start: int = 0, end: int | None = None
        ) -> int:
            span(text, start, end)
            return header_feed(header, text, start, end)

        def call_scanner_feed(scanner: _CallScanner, text: str, start: int, final: bool) -> int:
            span(text, start, None)
            return call_feed(scanner, text, start, final)

        def text(out: scan.Out, text: str) -> None:
            span(text, 0, None)
            out_text(out, text)

        monkeypatch.setattr(scan.JsonScanner, "feed", json_scanner_feed)
        monkeypatch.setattr(scan.CallHeader, "feed", call_header_feed)
        monkeypatch.setattr(_CallScanner, "feed", call_scanner_feed)
        monkeypatch.setattr(scan.Out, "text", text)

    def cost(self, parser: StreamParser, text: str) -> tuple[int, int]:
        """Parsing ``text`` fed in 4-character pieces: the characters read, and the bytes
        allocated per feed (the peak above what was held before it) summed over the feeds,
        which counts copies of held text (``self.seen += delta`` copies all of it)."""
        before, allocated = self.chars, 0
        tracemalloc.start()
        try:
            for i in range(0, len(text) + 4, 4):
                tracemalloc.reset_peak()
                held = tracemalloc.get_traced_memory()[0]
                if i < len(text):
                    parser.feed(text[i : i + 4])
                else:
                    parser.finish()
                allocated += tracemalloc.get_traced_memory()[1] - held
        finally:
            tracemalloc.stop()
        return self.chars - before, allocated


# 8x the output should cost about 8x; a parser re-reading everything it has seen costs
# about 64x. 20x leaves room for fixed costs, and is far from 64x.
LINEAR_BOUND = 20


def growth(
    meter: CostMeter, make: Callable[[], StreamParser], output: Callable[[int], str]
) -> tuple[float, float]:
    """How much more reading and allocating 8x the output costs."""
    (small_read, small_alloc), (large_read, large_alloc) = (
        meter.cost(make(), output(n)) for n in (100, 800)
    )
    assert small_read > len(output(100)) / 2  # the meter sees the text, not a part of it
    return large_read / small_read, large_alloc / small_alloc


@pytest.mark.parametrize(
    ("tool", "reasoning"),
    [*((t, None) for t in TOOL_PARSERS), (None, "deepseek_r1"), ("hermes", "qwen3")],
)
def test_cost_grows_linearly_with_the_output(
    monkeypatch: pytest.MonkeyPatch, tool: str | None, reasoning: str | None
) -> None:
    """O(delta) per feed: long content with '<' in it, then a long argument."""

    def output(n: int) -> str:
        content = "a < b, [x] {y} " * n
        call = CALLS[tool].format(body="q" * (15 * n)) if tool else ""
        if tool in ("llama3_json", "pythonic"):
            return call  # these read calls only at the start of the output
        return ("<think>" + content + "</think>" if reasoning else "") + content + call

    def make() -> StreamParser:
        return stream_parser(tool=tool, reasoning=reasoning, tools=TOOLS)

    read, allocated = growth(CostMeter(monkeypatch), make, output)
    assert read < LINEAR_BOUND
    assert allocated < LINEAR_BOUND


class RescanningHermes(Hermes):
    """Hermes plus the mistake the cost test is there to catch: looking for the start tag in
    all of the text seen so far at every feed."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.seen = ""

    def feed(self, delta: str) -> list[Event]:
        self.seen += delta
        scan.find_marker(self.seen, (self.START,))
        return super().feed(delta)


class HoardingHermes(Hermes):
    """Hermes keeping all of the text seen in one string (a copy of it at every feed)."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.seen = ""

    def feed(self, delta: str) -> list[Event]:
        self.seen += delta
        return super().feed(delta)


def test_the_cost_measure_sees_a_parser_that_rereads_or_copies_the_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    meter = CostMeter(monkeypatch)

    def output(n: int) -> str:
        return "a < b, [x] {y} " * n

    read, _ = growth(meter, lambda: StreamParser(tools=RescanningHermes(TOOLS)), output)
    _, allocated = growth(meter, lambda: StreamParser(tools=HoardingHermes(TOOLS)), output)
    assert read > 2 * LINEAR_BOUND
    assert allocated > 2 * LINEAR_BOUND
