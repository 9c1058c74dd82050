"""Parsers by name (vLLM's ``--tool-call-parser`` / ``--reasoning-parser`` names)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from smgd.parse.base import ReasoningParser, StreamParser, ToolParser
from smgd.parse.deepseek import DeepSeekV3
from smgd.parse.json_calls import Hermes, Llama3Json, Mistral
from smgd.parse.pythonic import Pythonic
from smgd.parse.qwen_coder import Qwen3Coder
from smgd.parse.reasoning import DeepSeekR1, Qwen3

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "UnknownParser",
    "reasoning_parser",
    "stream_parser",
    "tool_parser",
]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (DeepSeekV3, Hermes, Llama3Json, Mistral, Pythonic, Qwen3Coder)
}
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {cls.name: cls for cls in (DeepSeekR1, Qwen3)}


class UnknownParser(ValueError):
    """A parser name smgd does not have; the message lists the valid ones."""

    def __init__(self, kind: str, name: str, valid: Sequence[str]) -> None:
        super().__init__(f"unknown {kind} parser {name!r}; valid: {', '.join(sorted(valid))}")
        self.kind = kind
        self.name = name
        self.valid = tuple(sorted(valid))


def tool_parser(name: str) -> type[ToolParser]:
    """The tool parser class called ``name``; :class:`UnknownParser` if there is none."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise UnknownParser("tool", name, list(TOOL_PARSERS)) from None


def reasoning_parser(name: str) -> type[ReasoningParser]:
    """The reasoning parser class called ``name``; :class:`UnknownParser` if there is none."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise UnknownParser("reasoning", name, list(REASONING_PARSERS)) from None


def stream_parser(
    *,
    tool: str | None = None,
    reasoning: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: bool = True,
    new_id: Callable[[], str] | None = None,
) -> StreamParser:
    """A parser for one response: the named reasoning and tool parsers composed."""
    return StreamParser(
        reasoning=reasoning_parser(reasoning)(thinking=thinking) if reasoning else None,
        tools=tool_parser(tool)(tools, new_id=new_id) if tool else None,
    )
