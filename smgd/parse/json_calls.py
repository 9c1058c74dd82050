"""Tool parsers whose calls are JSON objects: hermes, llama3_json, mistral.

All three read a call object ``{"name": ..., "arguments": ...}`` with :class:`JsonCall`:

- when the object starts with the name and then the arguments key (what the models' chat
  templates show them), the call is announced as soon as the name is read and its arguments
  stream as the model writes them (raw text, the model's own spacing);
- any other shape (keys in another order, extra keys first) is held until the object ends,
  then decoded whole and announced with ``json.dumps``-formatted arguments;
- an object that is not a call, or text that is not JSON, is rejected before anything of it
  was sent: the parser then returns it as content, and the rest of the output with it
  (vLLM turns the whole output into content when any call is malformed).

Once a call is announced it stays a call: arguments that turn invalid later, or are cut off
by the end of the output, are sent as the model wrote them (what vLLM's streaming does too);
clients see ``finish_reason`` "length" for a cut-off call.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from smgd.parse.base import ToolParser
from smgd.parse.scan import (
    CallHeader,
    JsonScanner,
    Out,
    find_marker,
    partial_marker,
    random_id,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["Hermes", "JsonCall", "Llama3Json", "Mistral"]

# JsonCall's states: reading the header; streaming the arguments; the rest of the object
# (ignored); holding an object written in another order; arguments that stopped being JSON;
# not a call; finished.
_HEADER, _ARGS, _TAIL, _HELD, _BROKEN, _REJECTED, _DONE = range(7)

# The parsers' states (each uses its subset): plain text; inside <tool_call>; after a malformed
# call (the rest is content); the start of the output / just after [TOOL_CALLS]; between
# llama3 objects; in a call object; text that cannot hold calls; after the calls; a v11 name;
# in a [...] list of calls; after a list element; the arguments of a v11 call.
(_TEXT, _CALL, _FALLBACK, _START, _SEP, _OBJECT, _PLAIN, _AFTER) = range(8)
(_NAME, _ARRAY, _ARRAY_NEXT, _ELEMENT, _V11_ARGS) = range(8, 13)


class JsonCall:
    """One call object, read as it streams (see the module docstring).

    ``feed(text, start, end)`` reads ``text[start:end]`` and returns how far it read: up to
    ``end``, or less when the object ended (``done``) or was rejected (``rejected``; then the
    return value is the offending character). ``close()`` says the call's text ended (an end
    tag, the end of the output). ``raw`` is the text read while nothing was sent, for the
    caller to return as content when the call is rejected.
    """

    __slots__ = ("_accept", "_header", "_raw", "_scan", "_started", "_ws", "out", "state")

    def __init__(
        self, out: Out, keys: Sequence[str], accept: Callable[[Any], tuple[str, str] | None]
    ) -> None:
        self.out = out
        self._accept = accept
        self._scan = JsonScanner()
        self._header = CallHeader(keys)
        self.state = _HEADER
        self._raw: list[str] = []
        self._started = False  # the arguments value has begun (whitespace before it is skipped)
        self._ws = ""  # whitespace held back in broken arguments

    @property
    def done(self) -> bool:
        return self.state == _DONE

    @property
    def rejected(self) -> bool:
        return self.state == _REJECTED

    @property
    def sent(self) -> bool:
        """Whether the call was announced (it can no longer be rejected)."""
        return self.state in (_ARGS, _TAIL, _BROKEN, _DONE)

    @property
    def raw(self) -> str:
        return "".join(self._raw)

    def feed(self, text: str, start: int, end: int) -> int:
        i = start
        while i < end and self.state not in (_DONE, _REJECTED):
            if self.state == _HEADER:
                h = self._header.feed(text, i, end)
                stop = h if h >= 0 else end
                j = self._scan.feed(text, i, stop)
                self._raw.append(text[i:j])
                if self._scan.error:
                    self.state = _REJECTED
                    return j
                i = j
                if self._scan.done:
                    self._decide()
                elif h >= 0:
                    self.out.start_call(self._header.name)
                    self._raw = []
                    self.state = _ARGS
                elif h == -2:
                    self.state = _HELD
            elif self.state == _ARGS:
                j = self._scan.feed(text, i, end, stop_depth=1)
                piece = text[i:j]
                if not self._started:
                    piece = piece.lstrip()
                    self._started = bool(piece)
                self.out.args(piece)
                i = j
                if self._scan.error:
                    self.state = _BROKEN
                elif self._scan.stopped:
                    self.state = _TAIL
            elif self.state == _TAIL:
                j = self._scan.feed(text, i, end)
                if self._scan.error or self._scan.done:
                    self.state = _DONE  # the call is whole; a bad tail is ignored
                    return j
                i = j
            elif self.state == _HELD:
                j = self._scan.feed(text, i, end)
                self._raw.append(text[i:j])
                if self._scan.error:
                    self.state = _REJECTED
                    return j
                i = j
                if self._scan.done:
                    self._decide()
            else:  # _BROKEN: the rest is the model's text, trailing whitespace left out
                chunk = self._ws + text[i:end]
                body = chunk.rstrip()
                self.out.args(body)
                self._ws = chunk[len(body) :]
                i = end
        return i

    def _decide(self) -> None:
        """The whole object was held: announce it as a call, or reject it."""
        try:
            call = self._accept(json.loads(self.raw))
        except ValueError:
            call = None
        if call is None:
            self.state = _REJECTED
        else:
            self.out.start_call(call[0], call[1])
            self.state = _DONE

    def close(self) -> None:
        """The call's text ended: an unfinished object that was never sent is rejected."""
        if self.state in (_HEADER, _HELD):
            if self._scan.finish():
                self._decide()
            else:
                self.state = _REJECTED
        elif self.state != _REJECTED:
            self.state = _DONE


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# ------------------------------------------------------------------------------------- hermes


class Hermes(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them."""

    name = "hermes"
    models = "Qwen 2.5 / QwQ / Qwen3 (JSON calls), Hermes 2 Pro / 3, many fine-tunes"
    START = "<tool_call>"
    END = "</tool_call>"

    def _setup(self) -> None:
        self._state = _TEXT
        self._call: JsonCall | None = None

    @staticmethod
    def _accept(obj: Any) -> tuple[str, str] | None:
        # vLLM reads obj["name"] and obj["arguments"]: anything else fails the whole output.
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and "arguments" in obj:
            return obj["name"], _dumps(obj["arguments"])
        return None

    def _end(self) -> None:
        if self._state == _CALL:
            self._end_call(closed=False)

    def _run(self, *, final: bool) -> None:
        buf, i = self._buf, 0
        while i < len(buf):
            if self._state == _FALLBACK:
                self._out.text(buf[i:])
                i = len(buf)
            elif self._state == _TEXT:
                pos, _ = find_marker(buf, (self.START,), i)
                if pos < 0:
                    keep = 0 if final else partial_marker(buf[i:], (self.START,))
                    self._out.text(buf[i : len(buf) - keep])
                    i = len(buf) - keep
                    break
                self._out.text(buf[i:pos])
                i = pos + len(self.START)
                self._call = JsonCall(self._out, ("arguments",), self._accept)
                self._state = _CALL
            else:
                call = self._call
                assert call is not None
                pos, _ = find_marker(buf, (self.END,), i)
                if pos >= 0:
                    stop = pos
                else:
                    stop = len(buf) - (0 if final else partial_marker(buf[i:], (self.END,)))
                j = call.feed(buf, i, stop) if not call.done else stop
                if call.rejected:
                    self._reject(call)
                    i = j
                    continue
                # (text after a finished object, inside the tags, is ignored)
                if pos < 0:
                    i = stop
                    break
                i = pos + len(self.END)
                self._end_call(closed=True)
        self._buf = buf[i:]

    def _end_call(self, *, closed: bool) -> None:
        call = self._call
        assert call is not None
        call.close()
        self._call = None
        if call.rejected:
            self._reject(call, end=self.END if closed else "")
        else:
            self._state = _TEXT

    def _reject(self, call: JsonCall, end: str = "") -> None:
        self._out.text(self.START + call.raw + end)
        self._call = None
        self._state = _FALLBACK


# -------------------------------------------------------------------------------- llama3_json


class Llama3Json(ToolParser):
    """A JSON call object at the start of the output (or after ``<|python_tag|>``), more
    separated by ``;``: ``{"name": "f", "parameters": {...}}; {"name": "g", ...}``."""

    name = "llama3_json"
    models = "Llama 3.1 / 3.2 / 3.3 (JSON tool calling), Llama 4 in JSON mode"
    TAG = "<|python_tag|>"
    KEYS = ("arguments", "parameters")

    def _setup(self) -> None:
        self._state = _START
        self._call: JsonCall | None = None
        self._region: list[str] = []  # the calls' text while nothing was sent (for a fallback)

    @staticmethod
    def _accept(obj: Any) -> tuple[str, str] | None:
        # vLLM: obj["name"], then obj["arguments"] if present else obj["parameters"].
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        for key in Llama3Json.KEYS:
            if key in obj:
                return obj["name"], _dumps(obj[key])
        return None

    def _end(self) -> None:
        if self._call is not None:
            self._call.close()
            if self._call.rejected:
                self._fallback(self._call.raw)
        elif self._state == _SEP and not self._out.calls:
            self._fallback("")  # <|python_tag|> and nothing after it

    def _run(self, *, final: bool) -> None:
        buf, i = self._buf, 0
        while i < len(buf):
            state = self._state
            if state in (_AFTER, _FALLBACK):
                self._out.text(buf[i:])
                i = len(buf)
            elif state == _PLAIN:
                pos, _ = find_marker(buf, (self.TAG,), i)
                if pos < 0:
                    keep = 0 if final else partial_marker(buf[i:], (self.TAG,))
                    self._out.text(buf[i : len(buf) - keep])
                    i = len(buf) - keep
                    break
                self._out.text(buf[i:pos])
                self._region = [self.TAG]
                self._state = _SEP
                i = pos + len(self.TAG)
            elif state in (_START, _SEP):
                j = i
                while j < len(buf) and (buf[j].isspace() or (state == _SEP and buf[j] == ";")):
                    j += 1
                if state == _START:
                    self._out.text(buf[i:j])  # held back: dropped if a call follows
                else:
                    self._region.append(buf[i:j])
                i = j
                if i == len(buf):
                    break
                if buf[i] == "{":
                    self._call = JsonCall(self._out, self.KEYS, self._accept)
                    self._state = _OBJECT
                elif state == _SEP:
                    if self._out.calls:
                        self._state = _AFTER  # text after the calls is content
                    else:
                        self._fallback("")  # <|python_tag|> and no JSON
                elif buf.startswith(self.TAG, i):
                    self._region = [self.TAG]
                    self._state = _SEP
                    i += len(self.TAG)
                elif not final and self.TAG.startswith(buf[i:]):
                    break  # maybe the tag: wait for the rest
                else:
                    self._state = _PLAIN
            else:  # _OBJECT
                call = self._call
                assert call is not None
                j = call.feed(buf, i, len(buf))
                if not call.sent:
                    self._region.append(buf[i:j])
                i = j
                if call.rejected:
                    self._fallback(call.raw)
                elif call.done:
                    self._call = None
                    self._state = _SEP
        self._buf = buf[i:]

    def _fallback(self, rejected: str) -> None:
        """Not a call: its text and everything after it is content; all of the calls' text
        when no call was sent before (vLLM returns the whole output then)."""
        self._out.text(rejected if self._out.calls else "".join(self._region))
        self._call = None
        self._state = _FALLBACK


# ------------------------------------------------------------------------------------ mistral


class JsonValue:
    """A JSON value sent as the current call's arguments as the model writes it.

    Whitespace before it is skipped. If the text stops being JSON, the rest (up to where the
    caller ends the call) is sent as written, trailing whitespace left out.
    """

    __slots__ = ("_scan", "_started", "_ws", "out")

    def __init__(self, out: Out) -> None:
        self.out = out
        self._scan = JsonScanner()
        self._started = False
        self._ws = ""

    @property
    def done(self) -> bool:
        return self._scan.done

    def feed(self, text: str, start: int, end: int) -> int:
        """Read ``text[start:end]``; returns the index just past the value if it ended."""
        if self._scan.error:
            chunk = self._ws + text[start:end]
            body = chunk.rstrip()
            self.out.args(body)
            self._ws = chunk[len(body) :]
            return end
        j = self._scan.feed(text, start, end)
        piece = text[start:j]
        if not self._started:
            piece = piece.lstrip()
            self._started = bool(piece)
        self.out.args(piece)
        if self._scan.error:
            return self.feed(text, j, end)
        return j

    def close(self) -> None:
        self._scan.finish()


class Mistral(ToolParser):
    """``[TOOL_CALLS]`` then either a JSON array of call objects (tokenizers before v11:
    ``[TOOL_CALLS][{"name": "f", "arguments": {...}}]``) or, from v11, ``name[ARGS]{...}``
    per call (``[TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}``; ``name{...}`` too). The
    form is read from what follows the marker, so one parser serves every version."""

    name = "mistral"
    models = "Mistral 7B v0.3, Mixtral, Mistral Nemo / Small / Large, Ministral, Magistral"
    MARKER = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    # A v11 name runs from the marker to [ARGS] or "{"; text longer than this without one is
    # not a call name (a model writing prose after the marker): it becomes content. Real tool
    # names are far shorter; the bound keeps the held-back text small.
    NAME_LIMIT = 256

    def _setup(self) -> None:
        self._state = _TEXT
        self._array = False  # the current element is in a [...] list
        self._call: JsonCall | None = None
        self._value: JsonValue | None = None
        self._region: list[str] = []  # text after the marker while nothing was sent
        self._name: list[str] = []
        self._name_len = 0

    @staticmethod
    def _accept(obj: Any) -> tuple[str, str] | None:
        # vLLM: a missing or non-string name is "", missing arguments are "{}", string
        # arguments are kept as they are.
        if not isinstance(obj, dict) or not ("name" in obj or "arguments" in obj):
            return None
        name = obj.get("name")
        args = obj.get("arguments")
        text = "{}" if args is None else args if isinstance(args, str) else _dumps(args)
        return (name if isinstance(name, str) else ""), text

    @staticmethod
    def make_id() -> str:
        """Mistral's chat templates reject tool call ids that are not 9 alphanumerics."""
        return random_id("", 9)

    def _end(self) -> None:
        state = self._state
        if state == _ELEMENT and self._call is not None:
            self._call.close()
            if self._call.rejected:
                self._fallback(self._call.raw)
        elif state == _NAME:
            name = "".join(self._name).strip()
            if name:
                self._out.start_call(name, "{}")  # vLLM: a bare name is a call without arguments
        elif state in (_ARRAY, _ARRAY_NEXT) and not self._out.calls:
            self._fallback("")
        elif state == _V11_ARGS and self._value is not None:
            self._value.close()

    def _run(self, *, final: bool) -> None:
        buf, i = self._buf, 0
        markers = (self.MARKER,)
        while i < len(buf):
            state = self._state
            if state in (_AFTER, _FALLBACK):
                self._out.text(buf[i:])
                i = len(buf)
            elif state == _TEXT:
                pos, _ = find_marker(buf, markers, i)
                if pos < 0:
                    keep = 0 if final else partial_marker(buf[i:], markers)
                    self._out.text(buf[i : len(buf) - keep])
                    i = len(buf) - keep
                    break
                self._out.text(buf[i:pos])
                i = pos + len(self.MARKER)
                self._region = []
                self._state = _START
            elif state == _START:  # just after [TOOL_CALLS]: which form?
                j = i
                while j < len(buf) and buf[j].isspace():
                    j += 1
                self._region.append(buf[i:j])
                i = j
                if i == len(buf):
                    break
                if buf.startswith(self.MARKER, i):
                    i += len(self.MARKER)  # repeated markers count as one
                elif not final and self.MARKER.startswith(buf[i:]):
                    break  # "[" may be the array or another marker
                elif buf[i] in "[{":
                    self._out.ws = "keep"  # vLLM's pre-v11 path keeps "text\n" before calls
                    if buf[i] == "[":
                        self._region.append("[")
                        i += 1
                        self._state = _ARRAY
                    else:
                        self._element(array=False)
                else:
                    self._out.ws = "drop"  # vLLM's v11 path strips content around calls
                    self._name, self._name_len = [], 0
                    self._state = _NAME
            elif state in (_ARRAY, _ARRAY_NEXT):
                j = i
                while j < len(buf) and (
                    buf[j].isspace() or (state == _ARRAY_NEXT and buf[j] == ",")
                ):
                    j += 1
                self._region.append(buf[i:j])
                i = j
                if i == len(buf):
                    break
                if buf[i] == "{":
                    self._element(array=True)
                elif buf[i] == "]" and self._out.calls:
                    i += 1
                    self._state = _AFTER  # text after the list is content
                else:
                    self._fallback("")
            elif state == _ELEMENT:
                call = self._call
                assert call is not None
                j = call.feed(buf, i, len(buf))
                if not call.sent:
                    self._region.append(buf[i:j])
                i = j
                if call.rejected:
                    self._fallback(call.raw)
                elif call.done:
                    self._call = None
                    self._state = _ARRAY_NEXT if self._array else _AFTER
            elif state == _NAME:
                pos, found = find_marker(buf, (self.ARGS, "{", self.MARKER), i)
                end = (
                    pos
                    if pos >= 0
                    else len(buf)
                    - (0 if final else partial_marker(buf[i:], (self.ARGS, self.MARKER)))
                )
                self._name.append(buf[i:end])
                self._name_len += end - i
                i = end
                if self._name_len > self.NAME_LIMIT:
                    self._region += self._name
                    self._fallback("")
                    continue
                if pos < 0:
                    break
                name = "".join(self._name).strip()
                if found == self.MARKER:
                    self._out.start_call(name, "{}")  # a bare name: a call without arguments
                    i = pos + len(found)
                    self._region = []
                    self._state = _START
                    continue
                self._out.start_call(name)
                self._value = JsonValue(self._out)
                self._state = _V11_ARGS
                i = pos + len(found) if found == self.ARGS else pos
            else:  # _V11_ARGS: one JSON value; text after it up to the next marker is content
                value = self._value
                assert value is not None
                pos, _ = find_marker(buf, markers, i)
                stop = (
                    pos
                    if pos >= 0
                    else len(buf) - (0 if final else partial_marker(buf[i:], markers))
                )
                i = value.feed(buf, i, stop)
                if value.done or pos >= 0:
                    self._value = None
                    self._state = _TEXT
                elif i == stop:
                    break
        self._buf = buf[i:]

    def _element(self, *, array: bool) -> None:
        self._call = JsonCall(self._out, ("arguments",), self._accept)
        self._array = array
        self._state = _ELEMENT

    def _fallback(self, rejected: str) -> None:
        """Not a call: what follows the marker is content (vLLM drops the marker itself and
        the whitespace after it), or, after calls were sent, the rejected text and the rest."""
        text = rejected if self._out.calls else "".join(self._region).lstrip()
        self._out.text(text)
        self._call = None
        self._state = _FALLBACK
