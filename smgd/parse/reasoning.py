"""Reasoning parsers: ``<think>...</think>``, read as vLLM 0.32 reads it.

Both start inside the reasoning block: the chat templates of DeepSeek-R1 (and its distills)
and of Qwen3's thinking models open ``<think>`` in the prompt, so the output often begins
with the reasoning itself. A ``<think>`` the model writes is dropped; the first
``</think>`` ends the reasoning; an output without it is all reasoning (cut off by
``max_tokens`` while thinking).

They differ after that:

- ``deepseek_r1``: everything after the first ``</think>`` is content, as written.
- ``qwen3``: a ``<tool_call>`` inside the reasoning also ends it (Qwen3 models sometimes
  call a tool without closing the block); the ``<tool_call>`` is left in the content, for the
  tool parser. A stray ``</think>`` in the content is dropped.

With ``thinking=False`` (the prompt closed the block) the whole output is content, as written.
"""

from __future__ import annotations

from typing import ClassVar

from smgd.parse.base import ReasoningParser
from smgd.parse.events import ContentDelta, ReasoningDelta
from smgd.parse.scan import find_marker, partial_marker

__all__ = ["DeepSeekR1", "Qwen3"]

START = "<think>"
END = "</think>"


class _Think(ReasoningParser):
    # Markup inside the reasoning: dropped (START), ending it and dropped (END), or ending it
    # and handed on as content (implicit_ends).
    content_drops: ClassVar[tuple[str, ...]] = ()  # markup dropped from the content

    def __init__(self, *, thinking: bool = True) -> None:
        super().__init__(thinking=thinking)
        self._in_reasoning = thinking
        self._buf = ""
        self._reasoning_markers = (START, END, *self.implicit_ends)
        self._drops = self.content_drops if thinking else ()

    def feed(self, delta: str) -> list[ContentDelta | ReasoningDelta]:
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> list[ContentDelta | ReasoningDelta]:
        return self._run(final=True)

    def _run(self, *, final: bool) -> list[ContentDelta | ReasoningDelta]:
        out: list[ContentDelta | ReasoningDelta] = []
        buf, i = self._buf, 0
        while i < len(buf):
            markers = self._reasoning_markers if self._in_reasoning else self._drops
            pos, found = find_marker(buf, markers, i) if markers else (-1, "")
            if pos < 0:
                keep = 0 if final or not markers else partial_marker(buf[i:], markers)
                self._emit(out, buf[i : len(buf) - keep])
                i = len(buf) - keep
                break
            self._emit(out, buf[i:pos])
            i = pos + len(found)
            if found == START or not self._in_reasoning:
                continue  # <think> inside the reasoning, or a dropped marker in the content
            self._in_reasoning = False
            if found != END:  # an implicit end: the markup belongs to the content
                out.append(ContentDelta(found))
        self._buf = buf[i:]
        return out

    def _emit(self, out: list[ContentDelta | ReasoningDelta], text: str) -> None:
        if text:
            out.append(ReasoningDelta(text) if self._in_reasoning else ContentDelta(text))


class DeepSeekR1(_Think):
    name = "deepseek_r1"
    models = "DeepSeek-R1 and its distills (Qwen / Llama based), QwQ-32B"


class Qwen3(_Think):
    name = "qwen3"
    models = "Qwen3 (thinking mode), Qwen3-*-Thinking-2507, Qwen3.5"
    implicit_ends = ("<tool_call>",)
    content_drops = (END,)
