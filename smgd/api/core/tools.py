"""Tool calls and reasoning in a chat response: the request's options, the parsed reply (pure).

A chat request gets a parser (:mod:`smgd.parse`) when its engine has a ``reasoning_parser``,
or the request has ``tools``, ``tool_choice`` is not ``none`` and the engine has a
``tool_parser``. Every other request takes the plain path and never builds one: no per-token
cost for a request that asked for none of this.

- :func:`read_tool_choice` validates ``tools``, ``tool_choice`` and ``parallel_tool_calls``
  (400s naming the parameter) into :class:`ToolRequest`.
- :class:`ParseSpec` is what one choice's parser is built from (the engine's parser names and
  the request's tools); :meth:`ParseSpec.for_engine` returns None when nothing is to parse.
- :class:`ChoiceParser` runs one choice's parser over its text pieces and turns the events of
  one piece into the fields of one ``chat.completion.chunk`` delta (:func:`delta_fields`); at
  the end, :meth:`ChoiceParser.message` is the non-streamed message.

``tool_choice``, as vLLM 0.32 serves it: ``none`` renders the tools into the prompt (vLLM's
default, without ``--exclude-tools-when-tool-choice-none``) and parses no calls (reasoning is
still parsed); ``auto`` (the default with tools) parses calls; ``required`` and a named
function are enforced by a JSON schema of the call(s) given to the engine's grammar backend
(:func:`required_schema`, :func:`named_schema`: vLLM's schema shapes), and the constrained
output is read as that JSON rather than by the model's markup parser. ``finish_reason`` is
``tool_calls`` when calls were made and the output ended by itself (a cut-off call ends with
``length``); a named function ends with ``stop``, as OpenAI and vLLM answer.
``parallel_tool_calls: false`` keeps only the first call (vLLM drops the others, as here).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import msgspec

from smgd.errors import InvalidRequest
from smgd.parse import (
    ContentDelta,
    ReasoningDelta,
    ToolCall,
    ToolCallDelta,
    collect,
    stream_parser,
)
from smgd.parse.scan import random_id
from smgd.sampling import check_nesting
from smgd.wire.common import Structured, StructuredKind

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from smgd.parse import Event, StreamParser

__all__ = [
    "ChoiceParser",
    "ParseSpec",
    "ToolRequest",
    "delta_fields",
    "forced_constraint",
    "named_schema",
    "read_tool_choice",
    "required_schema",
]


class ToolRequest(msgspec.Struct, frozen=True):
    """A chat request's validated tool options.

    ``choice``: ``"none"``, ``"auto"``, ``"required"``, or ``"function"`` with ``name`` set.
    """

    tools: list[dict[str, Any]]  # as the client sent them (validated by the chat template)
    choice: str = "none"
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """``required`` or a named function: the engine's grammar writes the call(s)."""
        return self.choice in ("required", "function")


def _tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def read_tool_choice(body: Mapping[str, Any], tools: list[dict[str, Any]] | None) -> ToolRequest:
    """``tool_choice`` and ``parallel_tool_calls`` against the (already validated) ``tools``."""
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise InvalidRequest("`parallel_tool_calls` must be a boolean", param="parallel_tool_calls")
    tools = tools or []
    for i, name in enumerate(_tool_names(tools)):
        if not name:
            at = f"tools[{i}].function.name"
            raise InvalidRequest(f"{at} must not be empty", param=at)
    raw = body.get("tool_choice")
    if raw is None:
        return ToolRequest(tools, "auto" if tools else "none", parallel=parallel)
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise InvalidRequest(
                f"`tool_choice` must be 'none', 'auto', 'required' or a named function, "
                f"got {raw!r}",
                param="tool_choice",
            )
        if raw != "none" and not tools:
            raise InvalidRequest(f"tool_choice {raw!r} needs `tools`", param="tool_choice")
        return ToolRequest(tools, raw, parallel=parallel)
    function = raw.get("function") if isinstance(raw, dict) else None
    named = function.get("name") if isinstance(function, dict) else None
    if not isinstance(raw, dict) or raw.get("type", "function") != "function" or not named:
        raise InvalidRequest(
            '`tool_choice` must be a string or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if not isinstance(named, str) or named not in _tool_names(tools):
        raise InvalidRequest(
            f"tool_choice names function {named!r}, which is not in `tools`",
            param="tool_choice.function.name",
        )
    return ToolRequest(tools, "function", name=named, parallel=parallel)


def _parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    # vLLM's _params_or_empty_object: a tool without parameters takes an empty object.
    return params if params else {"type": "object", "properties": {}}


def named_schema(request: ToolRequest) -> dict[str, Any]:
    """A named function: the output is its arguments object (vLLM's schema)."""
    for tool in request.tools:
        if tool["function"]["name"] == request.name:
            return _parameters(tool)
    raise AssertionError("read_tool_choice checked the name")


def required_schema(request: ToolRequest) -> dict[str, Any]:
    """``required``: a JSON array of ``{"name", "parameters"}`` calls, at least one (at most
    one without parallel calls), each a tool of the request (vLLM's schema, ``$defs`` of the
    tools' parameters gathered at the top)."""
    schemas = []
    defs: dict[str, Any] = {}
    for i, tool in enumerate(request.tools):
        params = dict(_parameters(tool))
        own = params.pop("$defs", None)
        if own is not None:
            at = f"tools[{i}].function.parameters.$defs"
            if not isinstance(own, dict):
                raise InvalidRequest(f"{at} must be an object", param=at)
            for key, value in own.items():
                if key in defs and defs[key] != value:
                    raise InvalidRequest(
                        f"{at}: definition {key!r} differs from another tool's", param=at
                    )
                defs[key] = value
        name = tool["function"]["name"]
        schemas.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": schemas},
    }
    if not request.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def forced_constraint(request: ToolRequest) -> Structured | None:
    """The engine's constraint for ``required`` / a named function (None for the others).

    Its schema is held to the nesting limit of a ``response_format`` schema (a deeper one can
    exhaust a grammar backend's recursion): a 400 naming the tool whose parameters go past it.
    """
    if request.choice == "required":
        schema = required_schema(request)
        for i, tool in enumerate(request.tools):
            one = msgspec.structs.replace(request, tools=[tool])
            check_nesting(
                required_schema(one),
                f"tools[{i}].function.parameters",
                within=" with tool_choice 'required' (its schema adds 5 around them)",
            )
    elif request.choice == "function":
        schema = named_schema(request)
        at = _tool_names(request.tools).index(str(request.name))
        check_nesting(schema, f"tools[{at}].function.parameters")
    else:
        return None
    return Structured(kind=StructuredKind.JSON, param="tool_choice", spec=schema)


class ParseSpec(msgspec.Struct, frozen=True):
    """What a chat request's parsers are built from, before an engine is picked."""

    tools: ToolRequest
    thinking: bool = True  # False: the template closed the reasoning block (enable_thinking)
    reasoning: bool = True  # False (vLLM's include_reasoning): the reasoning is left out

    def for_engine(
        self, tool_parser: str | None, reasoning_parser: str | None
    ) -> ChoiceParser | None:
        """One choice's parser on an engine with these parsers; None: plain text, no parser."""
        tool = tool_parser if self.tools.choice == "auto" else None
        if tool is None and reasoning_parser is None and not self.tools.forced:
            return None
        return ChoiceParser(
            stream_parser(
                tool=tool,
                reasoning=reasoning_parser,
                tools=self.tools.tools,
                thinking=self.thinking,
            ),
            self.tools,
            keep_reasoning=self.reasoning,
        )


class ChoiceParser:
    """One choice's parser state: text pieces in, delta fields and the final message out."""

    __slots__ = ("events", "forced", "keep_reasoning", "parallel", "parser", "request")

    def __init__(
        self, parser: StreamParser, request: ToolRequest, *, keep_reasoning: bool = True
    ) -> None:
        self.parser = parser
        self.request = request
        self.parallel = request.parallel
        # The reasoning is still parsed out (it must not reach the content), then dropped.
        self.keep_reasoning = keep_reasoning
        # A forced call is JSON the grammar wrote: held whole and read at the end, as vLLM
        # does (its non-streamed parse), so streaming and not agree.
        self.forced: list[str] | None = [] if request.forced else None
        self.events: list[Event] = []  # everything sent, for the final message and finish

    def feed(self, text: str) -> list[Event]:
        events = self.parser.feed(text) if text else []
        return self._keep(events)

    def finish(self) -> list[Event]:
        return self._keep(self.parser.finish())

    def _keep(self, events: list[Event]) -> list[Event]:
        if self.forced is not None:
            out: list[Event] = []
            for event in events:
                if isinstance(event, ContentDelta):
                    self.forced.append(event.text)
                else:
                    out.append(event)
            events = out
        if not self.parallel:
            events = [e for e in events if not isinstance(e, ToolCallDelta) or e.index == 0]
        if not self.keep_reasoning:
            events = [e for e in events if not isinstance(e, ReasoningDelta)]
        self.events += events
        return events

    def forced_calls(self) -> list[Event]:
        """At the end of a forced output: its calls as events (appended to :attr:`events`)."""
        if self.forced is None:
            return []
        text = "".join(self.forced)
        calls = read_forced(text, self.request)
        if calls is None:
            events: list[Event] = [ContentDelta(text)] if text else []
        else:
            events = [
                ToolCallDelta(index=i, arguments=c.arguments, id=c.id, name=c.name)
                for i, c in enumerate(calls)
            ]
        self.events += events
        return events

    @property
    def called(self) -> bool:
        return any(isinstance(e, ToolCallDelta) for e in self.events)

    def finish_reason(self, reason: str | None) -> str | None:
        """The OpenAI finish reason: ``tool_calls`` when calls ended the output by themselves."""
        if reason == "stop" and self.called and self.request.choice != "function":
            return "tool_calls"
        return reason

    def message(self) -> dict[str, Any]:
        """The non-streamed ``message``, folded from every event sent."""
        parsed = collect(self.events)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
        elif parsed.content is None:
            message["content"] = ""
        return message


def read_forced(text: str, request: ToolRequest) -> list[ToolCall] | None:
    """The calls in a grammar-constrained output; None if it is not the expected JSON (a
    cut-off output: it is returned as content)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if request.choice == "function":
        assert request.name is not None
        if not isinstance(value, dict):
            return None
        return [ToolCall(random_id(), request.name, json.dumps(value, ensure_ascii=False))]
    if not isinstance(value, list):
        return None
    calls = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("parameters", {})
        calls.append(ToolCall(random_id(), item["name"], json.dumps(args, ensure_ascii=False)))
    return calls[:1] if not request.parallel else calls


def delta_fields(events: Sequence[Event]) -> dict[str, Any]:
    """The ``delta`` of one chunk for the events of one text piece (empty: nothing to send).

    Content and reasoning pieces are joined; a call's pieces are merged into one entry per
    call index (its first piece carries ``id``, ``type`` and ``name``), in order.
    """
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ReasoningDelta):
            reasoning.append(event.text)
        else:
            have = calls.get(event.index)
            if have is None:
                calls[event.index] = event.to_openai()
            else:
                have["function"]["arguments"] += event.arguments
    delta: dict[str, Any] = {}
    if reasoning:
        delta["reasoning_content"] = "".join(reasoning)
    if content:
        delta["content"] = "".join(content)
    if calls:
        delta["tool_calls"] = list(calls.values())
    return delta
