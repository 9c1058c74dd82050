"""deepseek_v3: DeepSeek-V3 / R1 tool calls, written with the model's special tokens::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Text before the block is content, and so is text after it (vLLM drops the latter). A call is
announced when its name line and the opening fence are read; its arguments are streamed as
written (vLLM does not check them either) up to the closing fence. A call without the
``function<｜tool▁sep｜>name\\n```json\\n`` head is dropped, as vLLM drops it; unlike vLLM's
single-line pattern, arguments may span lines (pretty-printed JSON).
"""

from __future__ import annotations

from smgd.parse.base import ToolParser
from smgd.parse.scan import find_marker, partial_marker

__all__ = ["DeepSeekV3"]

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
OPEN_FENCE = "\n```json\n"
CLOSE_FENCE = "\n```" + CALL_END

_TEXT, _CALLS, _TYPE, _NAME, _ARGS, _AFTER = range(6)

# What each state looks for; text before the first hit is content (_TEXT), the call's type
# (_TYPE, ignored), its name (_NAME), its arguments (_ARGS), or framing (_CALLS, dropped).
_MARKERS = {
    _TEXT: (CALLS_BEGIN,),
    _CALLS: (CALL_BEGIN, CALLS_END),
    _TYPE: (SEP, CALL_END),
    _NAME: (OPEN_FENCE, CALL_END),
    _ARGS: (CLOSE_FENCE, CALL_END),
}


class DeepSeekV3(ToolParser):
    name = "deepseek_v3"
    models = "DeepSeek-V3, DeepSeek-R1 (and -0528) with their own chat templates"
    # A call's type and name are held until the fence: text longer than this without one is
    # not a call head and the call is dropped. Real heads are a few dozen characters.
    HEAD_LIMIT = 256

    def _setup(self) -> None:
        self._state = _TEXT
        self._head: list[str] = []  # the name read so far
        self._head_len = 0

    def _run(self, *, final: bool) -> None:
        buf, i = self._buf, 0
        while i < len(buf):
            state = self._state
            if state == _AFTER:
                self._out.text(buf[i:])
                i = len(buf)
                break
            markers = _MARKERS[state]
            pos, found = find_marker(buf, markers, i)
            end = pos if pos >= 0 else len(buf) - (0 if final else partial_marker(buf[i:], markers))
            self._text(state, buf[i:end])
            i = end
            if pos < 0:
                break
            i = pos + len(found)
            if found in (CALLS_BEGIN, CALL_END):
                self._state = _CALLS
            elif found == CALLS_END:
                self._state = _AFTER
            elif found == CALL_BEGIN:
                self._state = _TYPE
            elif found == SEP:
                self._head, self._head_len = [], 0
                self._state = _NAME
            elif found == OPEN_FENCE:
                self._out.start_call("".join(self._head))
                self._state = _ARGS
            else:  # CLOSE_FENCE
                self._state = _CALLS
        self._buf = buf[i:]

    def _text(self, state: int, text: str) -> None:
        if state == _TEXT:
            self._out.text(text)
        elif state == _ARGS:
            self._out.args(text)
        elif state == _NAME and text:
            self._head.append(text)
            self._head_len += len(text)
            if self._head_len > self.HEAD_LIMIT:
                self._state = _TYPE  # not a call head: skip to the call's end
