"""The two parser interfaces, and how one of each is composed for a request.

A parser object lives for one response. ``feed(delta)`` takes the next piece of generated
text (any split: a token, several, a character) and returns the events it makes certain;
``finish()`` is called once at the end of the output and returns the rest. Text that could
still turn out to be markup (a partial ``<tool_call``, a call whose first keys have not
arrived yet) is held back until the next piece decides it, never longer than that markup.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from smgd.parse.events import ContentDelta, Event, ReasoningDelta
from smgd.parse.scan import Out, random_id

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

__all__ = ["ReasoningParser", "StreamParser", "ToolParser"]


class ToolParser(ABC):
    """Finds tool calls in model text; everything else is content.

    ``tools`` are the request's ``tools`` entries (OpenAI shape); parsers that type argument
    values from the schemas (qwen3_coder) read them, the others ignore them. ``new_id`` makes
    call ids (default: :meth:`make_id`).

    A parser keeps the text it has not decided yet in ``_buf`` and writes what it has decided
    to ``_out`` (an :class:`~smgd.parse.scan.Out`); its own state is set up by :meth:`_setup`.
    ``feed`` adds the delta to ``_buf`` and calls :meth:`_run`; ``finish`` calls it once more
    with ``final=True``, then :meth:`_end`.
    """

    name: ClassVar[str]
    models: ClassVar[str]  # model families the markup fits (for docs and error messages)
    # Whether whitespace right before a call, after real text, stays content ("keep") or is
    # dropped ("drop"): what the vLLM parser of the same name does (see Out).
    ws_before_call: ClassVar[str] = "keep"

    def __init__(
        self,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        new_id: Callable[[], str] | None = None,
    ) -> None:
        self.tools = list(tools or ())
        self.new_id = new_id or self.make_id
        self._out = Out(self.new_id, ws_before_call=self.ws_before_call)
        self._buf = ""
        self._setup()

    def _setup(self) -> None:  # noqa: B027 (optional: a parser may have no state of its own)
        """Set up the parser's own state (called once, by ``__init__``)."""

    @staticmethod
    def make_id() -> str:
        """A call id shaped like OpenAI's: ``call_`` + 24 random alphanumerics."""
        return random_id()

    def feed(self, delta: str) -> list[Event]:
        self._buf += delta
        self._run(final=False)
        return self._out.take()

    def finish(self) -> list[Event]:
        self._run(final=True)
        self._end()
        self._out.finish()
        return self._out.take()

    @abstractmethod
    def _run(self, *, final: bool) -> None:
        """Read ``_buf``: write what it decides to ``_out``, keep the rest in ``_buf``. With
        ``final`` the output has ended: nothing is held back for text still to come."""

    def _end(self) -> None:  # noqa: B027 (optional: a parser may have nothing left open)
        """The output ended (after the final :meth:`_run`): close what is still open."""


class ReasoningParser(ABC):
    """Splits model text into reasoning and content.

    ``thinking=False`` says the prompt already closed the reasoning block (a chat template's
    ``enable_thinking=False`` renders an empty ``<think></think>``): the output is content.
    """

    name: ClassVar[str]
    models: ClassVar[str]
    # Markup that ends reasoning without being reasoning's own end tag; it stays in the text
    # handed on as content so the tool parser sees it (qwen3: a <tool_call> inside <think>).
    implicit_ends: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, thinking: bool = True) -> None:
        self.thinking = thinking

    @abstractmethod
    def feed(self, delta: str) -> list[ContentDelta | ReasoningDelta]: ...

    @abstractmethod
    def finish(self) -> list[ContentDelta | ReasoningDelta]: ...


class StreamParser:
    """One response's parser: reasoning first, then tool calls in the non-reasoning text.

    Either part may be absent. The reasoning parser's content is what the tool parser reads,
    so markup inside the reasoning is never taken for a call.
    """

    __slots__ = ("reasoning", "tools")

    def __init__(
        self, *, reasoning: ReasoningParser | None = None, tools: ToolParser | None = None
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools

    def feed(self, delta: str) -> list[Event]:
        if self.reasoning is None:
            return self.tools.feed(delta) if self.tools is not None else _content(delta)
        return self._route(self.reasoning.feed(delta), final=False)

    def finish(self) -> list[Event]:
        if self.reasoning is None:
            return self.tools.finish() if self.tools is not None else []
        return self._route(self.reasoning.finish(), final=True)

    def _route(self, events: list[ContentDelta | ReasoningDelta], *, final: bool) -> list[Event]:
        if self.tools is None:
            return list(events)
        out: list[Event] = []
        for event in events:
            if isinstance(event, ContentDelta):
                out += self.tools.feed(event.text)
            else:
                out.append(event)
        if final:
            out += self.tools.finish()
        return out


def _content(delta: str) -> list[Event]:
    return [ContentDelta(delta)] if delta else []
