"""pythonic: a Python list of calls with keyword arguments, as the whole output::

    [get_weather(city="Paris", unit="c"), search(query='x', tags=["a", "b"], exact=True)]

Values are Python literals (strings in any quotes, numbers, True/False/None, lists, tuples,
sets, dicts; ``true``/``false``/``null`` too, as models write them); they become JSON
arguments. Like vLLM, calls are read only when the output starts with ``[``, names are plain
identifiers and arguments are keywords only; anything else is content.

Each call is sent whole when its closing parenthesis arrives: its arguments only become JSON
once the Python value is complete. A malformed first call makes the whole output content
(vLLM's rule); once a call was sent it stays, and text after the list is content.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from typing import Any

from smgd.parse.base import ToolParser

__all__ = ["Pythonic", "call_arguments"]

_START, _LIST, _CALL, _NEXT, _AFTER, _PLAIN = range(6)
_NAME = re.compile(r"[a-zA-Z]\w*")
_JSON_NAMES = {"true": True, "false": False, "null": None}


class _Bad(Exception):
    """Not a call of the accepted shape."""


def _value(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, str | int | float):
            return node.value
        raise _Bad  # bytes, complex, Ellipsis: no JSON form
    if isinstance(node, ast.Dict):
        if not all(isinstance(k, ast.Constant) for k in node.keys):
            raise _Bad  # **spread or computed keys
        return {k.value: _value(v) for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[union-attr]
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return [_value(v) for v in node.elts]
    if isinstance(node, ast.JoinedStr) and all(isinstance(p, ast.Constant) for p in node.values):
        return "".join(str(p.value) for p in node.values)  # type: ignore[attr-defined]
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _value(node.operand)
        if isinstance(operand, int | float) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    raise _Bad


def call_arguments(text: str) -> tuple[str, str] | None:
    """``name(k=v, ...)`` as (name, arguments JSON), or None if it is not such a call."""
    try:
        with warnings.catch_warnings():
            # "\d" in a model's string: a DeprecationWarning (3.11) / SyntaxWarning (3.12+)
            warnings.simplefilter("ignore", SyntaxWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            node = ast.parse(text, mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        args: dict[str, Any] = {}
        for keyword in node.keywords:
            if keyword.arg is None:  # **kwargs
                return None
            args[keyword.arg] = _value(keyword.value)
        return node.func.id, json.dumps(args, ensure_ascii=False)
    except (SyntaxError, ValueError, _Bad, RecursionError):
        return None


class _CallScanner:
    """Finds the end of ``name(...)``: brackets and Python strings, character by character."""

    __slots__ = ("depth", "quote")

    def __init__(self) -> None:
        self.depth = 0
        self.quote = ""  # the open string's quote: ', ", ''' or """

    def feed(self, text: str, start: int, final: bool) -> int:
        """Read from ``start``; returns the index just past the closing parenthesis, or
        ``-(index of the first unread character) - 1`` when more text is needed."""
        i, n = start, len(text)
        while i < n:
            c = text[i]
            if self.quote:
                if c == "\\":
                    if i + 1 == n and not final:
                        return -i - 1
                    i += 2
                    continue
                q = self.quote
                if text.startswith(q, i):
                    self.quote = ""
                    i += len(q)
                    continue
                if len(q) == 3 and c == q[0] and i + 3 > n and not final:
                    return -i - 1  # maybe the closing triple quote
                i += 1
                continue
            if c in "'\"":
                if i + 3 > n and not final:
                    return -i - 1  # one quote or three? wait for two more characters
                self.quote = c * 3 if text.startswith(c * 3, i) else c
                i += len(self.quote)
                continue
            i += 1
            if c in "([{":
                self.depth += 1
            elif c in ")]}":
                self.depth -= 1
                if self.depth == 0:
                    return i
        return -n - 1


class Pythonic(ToolParser):
    name = "pythonic"
    models = "Llama 3.2 / 4 (pythonic prompts), ToolACE, other Python-style callers"

    def _setup(self) -> None:
        self._state = _START
        self._region: list[str] = []  # the list's text while nothing was sent
        self._call: list[str] = []  # the current call's text
        self._scan = _CallScanner()

    def _end(self) -> None:
        if self._state in (_LIST, _CALL, _NEXT):  # the list never closed
            self._fallback()

    def _run(self, *, final: bool) -> None:
        buf, i = self._buf, 0
        while i < len(buf):
            state = self._state
            if state == _START:
                if buf[i] == "[":
                    self._region = ["["]
                    self._state = _LIST
                    i += 1
                else:
                    self._state = _PLAIN
            elif state in (_PLAIN, _AFTER):
                self._out.text(buf[i:])
                i = len(buf)
            elif state in (_LIST, _NEXT):
                j = i
                while j < len(buf) and buf[j].isspace():
                    j += 1
                self._region.append(buf[i:j])
                i = j
                if i == len(buf):
                    break
                c = buf[i]
                if state == _NEXT and c in ",]":
                    self._region.append(c)
                    i += 1
                    self._state = _LIST if c == "," else _AFTER
                    continue
                m = _NAME.match(buf, i)
                if state == _LIST and m and m.end() < len(buf) and buf[m.end()] == "(":
                    self._call = [buf[i : m.end() + 1]]
                    self._scan = _CallScanner()
                    self._scan.depth = 1
                    i = m.end() + 1
                    self._state = _CALL
                elif state == _LIST and m and m.end() == len(buf) and not final:
                    break  # a name still being written
                else:
                    self._fallback()
            else:  # _CALL
                j = self._scan.feed(buf, i, final)
                if j < 0:
                    j = -j - 1
                    self._call.append(buf[i:j])
                    i = j
                    break
                self._call.append(buf[i:j])
                i = j
                text = "".join(self._call)
                call = call_arguments(text)
                if call is None:
                    self._fallback()
                    continue
                self._out.start_call(*call)
                self._region = []
                self._state = _NEXT
        self._buf = buf[i:]

    def _fallback(self) -> None:
        """Not a call list: all of it is content when nothing was sent (vLLM's rule), else
        the text from the bad call on."""
        self._out.text("".join(self._region) + "".join(self._call))
        self._region, self._call = [], []
        self._state = _AFTER
