"""qwen3_coder: Qwen3-Coder's XML-style calls; parameter values are typed by the tool schema::

    <tool_call>
    <function=search>
    <parameter=query>
    rust async
    </parameter>
    <parameter=limit>
    5
    </parameter>
    </function>
    </tool_call>

Every value is written as text; one newline after ``<parameter=...>`` and one before
``</parameter>`` are framing. The JSON type comes from the request's tool schema, as vLLM
reads it (:func:`coerce`): ``5`` is 5 for an integer parameter and ``"5"`` for a string one;
a parameter the schema does not know stays a string.

Streaming: the call is announced at ``<function=name>``; a string-typed value streams as it
is written; any other value is sent whole at its ``</parameter>`` (its JSON form depends on
all of it). A parameter left open is closed by ``</function>`` or the end of the output (vLLM
drops it when not streaming). ``<function=`` also starts a call without ``<tool_call>``.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from smgd.parse.base import ToolParser
from smgd.parse.scan import find_marker, partial_marker

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = ["Qwen3Coder", "coerce", "schema_types"]

TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"
FUNC = "<function="
FUNC_END = "</function>"
PARAM = "<parameter="
PARAM_END = "</parameter>"

_TEXT, _PREAMBLE, _NAME, _ARGS, _PNAME, _VALUE, _BETWEEN = range(7)

_MARKERS: dict[int, tuple[str, ...]] = {
    _TEXT: (TOOL_START, FUNC),
    _PREAMBLE: (FUNC, TOOL_END),
    _NAME: (">", FUNC_END),
    _ARGS: (PARAM, FUNC_END, TOOL_END),
    _PNAME: (">",),
    _VALUE: (PARAM_END, PARAM, FUNC_END, TOOL_END),
    _BETWEEN: (TOOL_END, TOOL_START, FUNC),
}

# vLLM's spellings of JSON Schema types (tool schemas written for other stacks use them).
_ALIASES = {
    **dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
    **dict.fromkeys(
        ("int", "int32", "int64", "uint", "uint32", "uint64", "long", "short", "unsigned"),
        "integer",
    ),
    **dict.fromkeys(("float", "float32", "float64", "double"), "number"),
    "bool": "boolean",
    "dict": "object",
    **dict.fromkeys(("arr", "list", "sequence"), "array"),
}
_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")


def schema_types(schema: Any) -> set[str]:
    """The JSON types a (sub)schema allows: ``type``, ``enum`` values, ``anyOf`` / ``oneOf``
    / ``allOf``; ``{"string"}`` when it says nothing."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    kind = schema.get("type")
    if isinstance(kind, str):
        types.add(kind)
    elif isinstance(kind, list):
        types.update(t for t in kind if isinstance(t, str))
    enum = schema.get("enum")
    if isinstance(enum, list):
        for value in enum:
            types.add(_json_type(value))
    for key in ("anyOf", "oneOf", "allOf"):
        choices = schema.get(key)
        if isinstance(choices, list):
            for choice in choices:
                types |= schema_types(choice)
    return {_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types} or {"string"}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _finite(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return False
    return True


def coerce(text: str, types: set[str]) -> Any:
    """A parameter's text as the first of its types it reads as (null, integer, number,
    boolean, object, array, string, in that order); failing all, JSON if it is, else the
    text. Integral numbers become integers (vLLM's ``3.0`` -> ``3``)."""
    for kind in _PRIORITY:
        if kind not in types:
            continue
        if kind == "string":
            return text
        if kind == "null":
            if text.lower() == "null":
                return None
        elif kind == "integer":
            try:
                return int(text)
            except ValueError:
                pass
        elif kind == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number.is_integer() else number
        elif kind == "boolean":
            word = text.strip().lower()
            if word in ("true", "1"):
                return True
            if word in ("false", "0"):
                return False
        else:
            try:
                parsed = json.loads(text)
            except ValueError:
                continue
            if _finite(parsed):
                return parsed
    try:
        parsed = json.loads(text)
    except ValueError:
        return text
    return parsed if _finite(parsed) else text


def _properties(tools: Sequence[Mapping[str, Any]], name: str) -> dict[str, Any]:
    for tool in tools:
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and fn.get("name") == name:
            params = fn.get("parameters") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            return props if isinstance(props, dict) else {}
    return {}


def _trim_first_newline(text: str) -> str:
    return text[1:] if text.startswith("\n") else text


class Qwen3Coder(ToolParser):
    name = "qwen3_coder"
    models = "Qwen3-Coder, Qwen3-Coder-Next, Qwen3.5 / Qwen3-Next with the XML call template"
    # Names (function and parameter) are held until their ">": longer text is not a name
    # and ends the call. Real names are a few dozen characters.
    NAME_LIMIT = 256
    ws_before_call = "drop"  # as vLLM's parser, which strips the content before calls

    def _setup(self) -> None:
        self._state = _TEXT
        self._name: list[str] = []
        self._props: dict[str, Any] = {}
        self._params = 0  # parameters written into the current call's JSON
        self._stream = False  # the current value is a string sent as it arrives
        self._value: list[str] = []  # the current value (not streamed), or its start
        self._started = False  # the current value's first character was seen
        self._nl = False  # a streamed value's trailing newline, held back
        self._types: set[str] = set()  # the current value's JSON types
        self._key = ""  # the current parameter's name, as a JSON string
        self._sep = ""  # what goes before the current (not streamed) parameter

    def _end(self) -> None:
        if self._state in (_ARGS, _PNAME, _VALUE):
            self._end_call()

    def _run(self, *, final: bool) -> None:
        buf, i = self._buf, 0
        while i < len(buf):
            state = self._state
            markers = _MARKERS[state]
            pos, found = find_marker(buf, markers, i)
            end = pos if pos >= 0 else len(buf) - (0 if final else partial_marker(buf[i:], markers))
            self._text(buf[i:end])
            i = end
            if self._state != state:  # a name ran too long
                continue
            if pos < 0:
                break
            i = pos + len(found)
            self._marker(state, found)
        self._buf = buf[i:]

    def _text(self, text: str) -> None:
        state = self._state
        if not text:
            return
        if state == _TEXT:
            self._out.text(text)
        elif state in (_NAME, _PNAME):
            self._name.append(text)
            if sum(map(len, self._name)) > self.NAME_LIMIT:
                self._name = []
                if state == _PNAME:
                    self._end_call()
                self._state = _BETWEEN
        elif state == _VALUE:
            self._value_text(text)
        # text in _PREAMBLE, _ARGS, _BETWEEN is framing: dropped

    def _marker(self, state: int, found: str) -> None:
        if found == TOOL_START:
            self._state = _PREAMBLE
        elif found == FUNC:
            self._name = []
            self._state = _NAME
        elif state == _NAME:  # ">" or </function>
            name = "".join(self._name).strip()
            self._out.start_call(name)
            self._props = _properties(self.tools, name)
            self._params = 0
            self._state = _ARGS
            if found == FUNC_END:
                self._end_call()
        elif state == _PNAME:  # ">"
            self._start_value("".join(self._name).lstrip())
            self._state = _VALUE
        elif found == PARAM:
            if state == _VALUE:
                self._end_value()
            self._name = []
            self._state = _PNAME
        elif found == PARAM_END:
            self._end_value()
            self._state = _ARGS
        elif found in (FUNC_END, TOOL_END) and state in (_ARGS, _VALUE):
            self._end_call()
            self._state = _TEXT if found == TOOL_END else _BETWEEN
        else:  # </tool_call> in _PREAMBLE / _BETWEEN
            self._state = _TEXT

    # ------------------------------------------------------------------ values

    def _start_value(self, key: str) -> None:
        types = schema_types(self._props[key]) if key in self._props else {"string"}
        self._types = types
        self._stream = types == {"string"}
        self._value = []
        self._started = False
        self._nl = False
        sep = "{" if self._params == 0 else ", "
        self._params += 1
        self._key = json.dumps(key, ensure_ascii=False)
        if self._stream:
            self._out.args(f'{sep}{self._key}: "')
        else:
            self._sep = sep

    def _value_text(self, text: str) -> None:
        if not self._started:
            text = _trim_first_newline(text)
            self._started = True  # the first character is seen even when it was the newline
            if not text:
                return
        if not self._stream:
            self._value.append(text)
            return
        if self._nl:
            text = "\n" + text
        self._nl = text.endswith("\n")
        if self._nl:
            text = text[:-1]
        if text:
            self._out.args(json.dumps(text, ensure_ascii=False)[1:-1])

    def _end_value(self) -> None:
        if self._stream:
            self._out.args('"')
            return
        text = "".join(self._value)
        if text.endswith("\n"):
            text = text[:-1]
        value = json.dumps(coerce(text, self._types), ensure_ascii=False)
        self._out.args(f"{self._sep}{self._key}: {value}")

    def _end_call(self) -> None:
        if self._state == _VALUE:
            self._end_value()
        self._out.args("}" if self._params else "{}")
        self._params = 0
        self._state = _BETWEEN
