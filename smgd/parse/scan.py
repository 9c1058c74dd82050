"""Incremental building blocks shared by the parsers: every one of them looks at each new
character once, so a parser's cost per ``feed`` is proportional to the delta.

- :func:`find_marker` / :func:`partial_marker`: find markup strings in streamed text, and how
  much of a buffer's tail must be held back because it could be the start of one.
- :class:`JsonScanner`: a validating JSON scanner fed in pieces: where a value ends, or the
  first character that makes it invalid.
- :class:`CallHeader`: recognises ``{"name": "...", "arguments":`` as it streams in, so a
  call can be announced and its arguments streamed before the call is complete.
- :class:`Out`: the event sink every tool parser writes to. It numbers calls, gives them ids,
  and applies the whitespace rule around calls (see its docstring).
"""

from __future__ import annotations

import json
import random
import re
import string
from typing import TYPE_CHECKING

from smgd.parse.events import ContentDelta, Event, ToolCallDelta

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = [
    "CallHeader",
    "JsonScanner",
    "Out",
    "find_marker",
    "is_ws",
    "partial_marker",
    "random_id",
]

_ALNUM = string.ascii_letters + string.digits


def random_id(prefix: str = "call_", length: int = 24) -> str:
    """A tool call id shaped like OpenAI's (``call_`` + 24 alphanumerics)."""
    return prefix + "".join(random.choices(_ALNUM, k=length))


def is_ws(text: str) -> bool:
    """True for the empty string and whitespace only."""
    return not text or text.isspace()


def find_marker(buf: str, markers: Sequence[str], start: int = 0) -> tuple[int, str]:
    """The earliest marker in ``buf[start:]`` (longest on a tie), or ``(-1, "")``."""
    best, found = -1, ""
    for marker in markers:
        pos = buf.find(marker, start)
        if pos >= 0 and (best < 0 or pos < best or (pos == best and len(marker) > len(found))):
            best, found = pos, marker
    return best, found


def partial_marker(buf: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of ``buf`` that is a proper prefix of some marker."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(buf)), longest, -1):
            if buf.endswith(marker[:k]):
                longest = k
                break
    return longest


# ---------------------------------------------------------------------------- JSON

_WS = " \t\n\r"
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_NUMBER_RUN = re.compile(r"[0-9eE+\-.]+")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")

# What the scanner expects next (outside strings, numbers and literals).
_VALUE, _KEY_OR_END, _KEY, _COLON, _OBJ_NEXT, _VALUE_OR_END, _ARR_NEXT = range(7)


class JsonScanner:
    """Checks one JSON value (RFC 8259, as ``json.loads`` reads it) fed in pieces.

    ``feed(text, start, end)`` reads ``text[start:end]`` and returns where it stopped:

    - ``done`` set: the value ended; the return value is the index just past it;
    - ``error`` set: ``text[return value]`` makes the value invalid (nothing after it is read);
    - ``stopped`` set (only with ``stop_depth=d``): a value nested ``d`` levels deep ended
      just before the return value, e.g. ``d=1`` for each member value of an object;
    - otherwise everything up to ``end`` was read and more is needed.

    A number's end is only known at the character after it: :meth:`finish` completes a
    top-level number at the end of the input. Work per call is proportional to the text read;
    runs of plain string characters are skipped with one regex match.
    """

    __slots__ = ("_esc", "_expect", "_lit", "_num", "_stack", "_str", "done", "error", "stopped")

    def __init__(self) -> None:
        self._stack: list[str] = []  # "{" or "[" per open container
        self._expect = _VALUE
        self._str = False  # inside a string
        self._esc = 0  # 0: no escape; -1: after a backslash; n > 0: hex digits still due
        self._lit = ""  # the rest of true/false/null still due
        self._num: list[str] | None = None  # the number being read
        self.done = False
        self.error = False
        self.stopped = False  # the last feed stopped at a value ending at stop_depth

    @property
    def depth(self) -> int:
        return len(self._stack)

    def _end_value(self) -> bool:
        """A value ended; True when it was the top-level one."""
        if not self._stack:
            self.done = True
            return True
        self._expect = _OBJ_NEXT if self._stack[-1] == "{" else _ARR_NEXT
        return False

    def _ended(self, stop_depth: int) -> bool:
        """A value ended: whether feed must return (top level done, or a stop_depth value)."""
        if self._end_value():
            return True
        if self.depth == stop_depth:
            self.stopped = True
            return True
        return False

    def _end_number(self) -> bool:
        """Close the pending number; False when it is not a valid JSON number."""
        assert self._num is not None
        ok = _NUMBER.match("".join(self._num)) is not None
        self._num = None
        return ok

    def feed(self, text: str, start: int = 0, end: int | None = None, stop_depth: int = -1) -> int:
        """Read ``text[start:end]``; see the class docstring for what the result means."""
        i, n = start, len(text) if end is None else end
        self.stopped = False
        while i < n:
            if self._str:
                if self._esc > 0:
                    if text[i] not in _HEX:
                        self.error = True
                        return i
                    self._esc -= 1
                    i += 1
                    continue
                if self._esc < 0:
                    if text[i] not in _ESCAPES:
                        self.error = True
                        return i
                    self._esc = 4 if text[i] == "u" else 0
                    i += 1
                    continue
                m = _STRING_RUN.match(text, i, n)
                if m:
                    i = m.end()
                    continue
                c = text[i]
                i += 1
                if c == "\\":
                    self._esc = -1
                elif c == '"':
                    self._str = False
                    if self._expect == _KEY:
                        self._expect = _COLON
                    elif self._ended(stop_depth):
                        return i
                else:  # a raw control character: json.loads rejects it
                    self.error = True
                    return i - 1
                continue
            if self._lit:
                if text[i] != self._lit[0]:
                    self.error = True
                    return i
                self._lit = self._lit[1:]
                i += 1
                if not self._lit and self._ended(stop_depth):
                    return i
                continue
            if self._num is not None:
                m = _NUMBER_RUN.match(text, i, n)
                if m:
                    self._num.append(m.group())
                    i = m.end()
                    if i == n:
                        return i
                if not self._end_number():
                    self.error = True
                    return i
                if self._ended(stop_depth):
                    return i
                continue
            c = text[i]
            if c in _WS:
                i += 1
                continue
            expect = self._expect
            if expect in (_VALUE, _VALUE_OR_END):
                if c == "]" and expect == _VALUE_OR_END:
                    self._stack.pop()
                    i += 1
                    if self._ended(stop_depth):
                        return i
                    continue
                i += 1
                if c == "{":
                    self._stack.append("{")
                    self._expect = _KEY_OR_END
                elif c == "[":
                    self._stack.append("[")
                    self._expect = _VALUE_OR_END
                elif c == '"':
                    self._str = True
                elif c in "tfn":
                    self._lit = {"t": "rue", "f": "alse", "n": "ull"}[c]
                elif c == "-" or c.isdigit():
                    self._num = [c]
                else:
                    self.error = True
                    return i - 1
            elif expect in (_KEY_OR_END, _KEY):
                i += 1
                if c == '"':
                    self._str = True
                    self._expect = _KEY
                elif c == "}" and expect == _KEY_OR_END:
                    self._stack.pop()
                    if self._ended(stop_depth):
                        return i
                else:
                    self.error = True
                    return i - 1
            elif expect == _COLON:
                if c != ":":
                    self.error = True
                    return i
                i += 1
                self._expect = _VALUE
            else:  # _OBJ_NEXT / _ARR_NEXT
                close = "}" if expect == _OBJ_NEXT else "]"
                i += 1
                if c == ",":
                    self._expect = _KEY if expect == _OBJ_NEXT else _VALUE
                elif c == close:
                    self._stack.pop()
                    if self._ended(stop_depth):
                        return i
                else:
                    self.error = True
                    return i - 1
        return i

    def finish(self) -> bool:
        """At the end of the input: True when a whole value was read."""
        if self._num is not None and not self._stack and not self.error:
            if self._end_number():
                self.done = True
            else:
                self.error = True
        return self.done


# ---------------------------------------------------------------------------- call header

_HEADER_STEPS = ("{", '"name"', ":", "NAME", ",", "KEY", ":")


class CallHeader:
    """Matches ``{ "name" : "<name>" , "<key>" :`` (any JSON whitespace) as text streams in.

    ``feed`` returns the index in ``text`` just past the final colon once the whole header has
    been read (then ``name`` and ``key`` are set), -1 when it needs more text, and -2 as soon as
    the text cannot be such a header (another key order, another key, not an object): the
    caller then falls back to reading the whole call. ``keys`` are the accepted argument keys.
    Keys and the name are JSON strings and may use escapes.
    """

    __slots__ = ("_lit", "_step", "_str", "key", "keys", "name")

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = tuple(keys)
        self._step = 0
        self._lit = ""  # the literal being matched ('"name"'), consumed so far
        self._str: list[str] | None = None  # a string (name or key) being read, raw
        self.name = ""
        self.key = ""

    def feed(self, text: str, start: int = 0, end: int | None = None) -> int:
        """Read ``text[start:end]``; see the class docstring for the result."""
        i, n = start, len(text) if end is None else end
        while i < n:
            c = text[i]
            if self._str is not None:
                self._str.append(c)
                i += 1
                if c == '"' and not _odd_backslashes(self._str):
                    if not self._end_string():
                        return -2
                    if self._step == len(_HEADER_STEPS):
                        return i
                continue
            step = _HEADER_STEPS[self._step]
            if self._lit:
                want = step[len(self._lit)]
                if c != want:
                    return -2
                self._lit += c
                i += 1
                if self._lit == step:
                    self._lit = ""
                    self._step += 1
                    if self._step == len(_HEADER_STEPS):
                        return i
                continue
            if c in _WS:
                i += 1
                continue
            if step in ("NAME", "KEY"):
                if c != '"':
                    return -2
                self._str = ['"']
            elif c != step[0]:
                return -2
            elif len(step) == 1:
                self._step += 1
                if self._step == len(_HEADER_STEPS):
                    return i + 1
            else:
                self._lit = c
            i += 1
        return -1

    def _end_string(self) -> bool:
        assert self._str is not None
        raw = "".join(self._str)
        self._str = None
        try:
            value = json.loads(raw)
        except ValueError:
            return False
        if _HEADER_STEPS[self._step] == "NAME":
            self.name = value
        elif value in self.keys:
            self.key = value
        else:
            return False
        self._step += 1
        return True


def _odd_backslashes(chars: list[str]) -> bool:
    """Whether the quote just appended to ``chars`` is escaped."""
    n, j = 0, len(chars) - 2
    while j >= 0 and chars[j] == "\\":
        n += 1
        j -= 1
    return n % 2 == 1


# ---------------------------------------------------------------------------- output


class Out:
    """The event sink of a tool parser: content text, calls and their argument pieces.

    Whitespace rule (the same streaming and not, so both agree for any split of the text):
    whitespace at the end of the content seen so far is held back until more text shows
    what it is.

    - Content that is only whitespace when a call starts is dropped (the model's newline
      before ``<tool_call>`` is framing, not an answer).
    - With ``ws_before_call="drop"`` the whitespace right before a call is dropped even after
      real text (vLLM's engine-based parsers strip content when calls are made); with
      ``"keep"`` it stays (vLLM's Hermes-style parsers keep ``"text\\n"``).
    - After a call, whitespace-only stretches (between calls, after the last) are dropped;
      text after a call is content, with the whitespace before it.
    - At the end, held whitespace is content only if no call was made.
    """

    __slots__ = ("_current", "_events", "_pending", "_text_since_call", "calls", "new_id", "ws")

    def __init__(self, new_id: Callable[[], str], ws_before_call: str = "keep") -> None:
        self.new_id = new_id
        self.ws = ws_before_call
        self._events: list[Event] = []
        self._pending = ""  # held-back whitespace
        self._text_since_call = False  # real text since the start or the last call
        self.calls = 0
        self._current = -1  # index of the call receiving arguments

    def text(self, text: str) -> None:
        if not text:
            return
        stripped = text.rstrip()
        if not stripped:
            self._pending += text
            return
        self._events.append(ContentDelta(self._pending + stripped))
        self._pending = text[len(stripped) :]
        self._text_since_call = True

    def start_call(self, name: str, arguments: str = "") -> None:
        """Announce call number ``calls`` (its first delta: id, name, maybe arguments)."""
        if self._pending and self.ws == "keep" and self._text_since_call and self.calls == 0:
            self._events.append(ContentDelta(self._pending))
        self._pending = ""
        self._text_since_call = False
        self._current = self.calls
        self.calls += 1
        self._events.append(
            ToolCallDelta(index=self._current, id=self.new_id(), name=name, arguments=arguments)
        )

    def args(self, text: str) -> None:
        if text:
            self._events.append(ToolCallDelta(index=self._current, arguments=text))

    def finish(self) -> None:
        if self._pending and self.calls == 0:
            self._events.append(ContentDelta(self._pending))
        self._pending = ""

    def take(self) -> list[Event]:
        events, self._events = self._events, []
        return events
