"""What a parser emits, and the non-streaming view of it.

A streaming parser turns model text into three kinds of events:

- :class:`ContentDelta`: text for the message's ``content``;
- :class:`ReasoningDelta`: text for ``reasoning_content``;
- :class:`ToolCallDelta`: a piece of one tool call in OpenAI's streaming shape. ``index``
  numbers the calls of one response from 0. The first delta of a call carries ``id`` and
  ``name`` (its ``type`` is always ``"function"``); later deltas carry only argument text.
  Concatenating a call's ``arguments`` pieces gives its ``function.arguments`` string.

:func:`collect` folds events into a :class:`Parsed` (content, reasoning, tool calls): the
non-streaming result is, by construction, the fold of the streaming events.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = [
    "ContentDelta",
    "Event",
    "Parsed",
    "ReasoningDelta",
    "ToolCall",
    "ToolCallDelta",
    "collect",
]


class ContentDelta(msgspec.Struct, frozen=True):
    text: str


class ReasoningDelta(msgspec.Struct, frozen=True):
    text: str


class ToolCallDelta(msgspec.Struct, frozen=True):
    """One piece of tool call ``index``; ``id``/``name`` are set on its first piece only."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The ``choices[].delta.tool_calls[]`` entry of a chat.completion.chunk."""
        function: dict[str, str] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out


Event = ContentDelta | ReasoningDelta | ToolCallDelta


class ToolCall(msgspec.Struct, frozen=True):
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The ``choices[].message.tool_calls[]`` entry of a chat.completion."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class Parsed(msgspec.Struct, frozen=True):
    """A whole response: ``None`` where a part is empty, as OpenAI's message has it."""

    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCall]


def collect(events: Iterable[Event]) -> Parsed:
    """Fold streamed events into the non-streaming result."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, tuple[str, str, list[str]]] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ReasoningDelta):
            reasoning.append(event.text)
        elif event.index in calls:
            calls[event.index][2].append(event.arguments)
        else:
            calls[event.index] = (event.id or "", event.name or "", [event.arguments])
    return Parsed(
        content="".join(content) or None,
        reasoning="".join(reasoning) or None,
        tool_calls=[
            ToolCall(id=id_, name=name, arguments="".join(args))
            for _, (id_, name, args) in sorted(calls.items())
        ],
    )
