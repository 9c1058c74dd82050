"""Tool-call and reasoning parsers: model text in, OpenAI message parts out (sans-IO).

A chat model writes tool calls and its reasoning as markup inside its text
(``<tool_call>{...}</tool_call>``, ``<think>...</think>``, ``[TOOL_CALLS]``...). These parsers
turn that text into what an OpenAI client expects: ``content``, ``reasoning_content`` and
``tool_calls``, streamed as deltas or whole. They read the markup as vLLM 0.32's parsers of the
same names do (tests/parse_corpus records vLLM's results; docs/reference/parsers.md lists
where and why smgd differs).

Use::

    parser = stream_parser(tool="hermes", reasoning="qwen3", tools=request_tools)
    for delta in generated_text_pieces:
        for event in parser.feed(delta):   # ContentDelta | ReasoningDelta | ToolCallDelta
            ...
    events = parser.finish()               # once, at the end of the output

    result = parse(text, tool="hermes")    # non-streaming: Parsed(content, reasoning, tool_calls)

``parse`` is the fold of the streamed events, and a parser's events do not depend on how the
text was cut into pieces: non-streaming and streaming responses always agree.

:func:`tool_parser` / :func:`reasoning_parser` look a parser up by name (vLLM's names) and
raise :class:`UnknownParser` listing the valid ones.

Cost: a parser reads each character of the output once. ``feed`` costs O(len(delta)) plus
what it holds back: the tail of the text that could still start a marker (shorter than the
longest marker), a call's name until its arguments start (the first ~30 characters of a
call), and, only for calls written in an unusual order or pythonic calls, the call's text
until it is complete (then decoded once). Arguments stream through without being re-read;
nothing re-scans the whole output. A request that asked for no tools and whose engine has no
reasoning parser needs no parser at all.

This package is a leaf: it imports only the standard library and msgspec.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from smgd.parse.base import ReasoningParser, StreamParser, ToolParser
from smgd.parse.events import (
    ContentDelta,
    Event,
    Parsed,
    ReasoningDelta,
    ToolCall,
    ToolCallDelta,
    collect,
)
from smgd.parse.registry import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    UnknownParser,
    reasoning_parser,
    stream_parser,
    tool_parser,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ContentDelta",
    "Event",
    "Parsed",
    "ReasoningDelta",
    "ReasoningParser",
    "StreamParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "UnknownParser",
    "collect",
    "parse",
    "reasoning_parser",
    "stream_parser",
    "tool_parser",
]


def parse(
    text: str,
    *,
    tool: str | None = None,
    reasoning: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: bool = True,
    new_id: Callable[[], str] | None = None,
) -> Parsed:
    """A whole output at once: (content, reasoning, tool calls)."""
    parser = stream_parser(
        tool=tool, reasoning=reasoning, tools=tools, thinking=thinking, new_id=new_id
    )
    return collect([*parser.feed(text), *parser.finish()])
