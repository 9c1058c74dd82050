"""Server-sent-event framing with pre-built bytes (the streaming hot path).

Every chunk of one request shares its ``id``/``object``/``created``/``model`` prefix, so
:class:`ChunkFormat` encodes that once and each event is a ``join`` of constant byte pieces
plus the JSON-encoded text. No per-token dicts, no generic JSON serialization of the envelope.

Wire format (OpenAI): ``data: <json>\\n\\n`` per event, ``data: [DONE]\\n\\n`` at the end,
``: keep-alive\\n\\n`` comments while a request waits. With ``include_usage`` every chunk
carries ``"usage":null`` and one last chunk has ``"choices":[]`` and the usage.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["DONE", "KEEPALIVE", "SSE_HEADERS", "ChunkFormat", "encode_json", "event"]

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    # Tells nginx-style proxies not to buffer the stream (harmless without a proxy).
    "X-Accel-Buffering": "no",
}

_encoder = msgspec.json.Encoder()
encode_json = _encoder.encode


def event(obj: Any) -> bytes:
    """One ``data:`` event for an arbitrary JSON-able object (errors, usage, native chunks)."""
    return b"data: " + _encoder.encode(obj) + b"\n\n"


class ChunkFormat:
    """Byte templates for one request's ``chat.completion.chunk`` / ``text_completion`` events."""

    __slots__ = (
        "_delta_close",
        "_end",
        "_head",
        "_index",
        "_reasoning_events",
        "_text_events",
        "_text_key",
        "chat",
    )

    def __init__(
        self,
        *,
        response_id: str,
        created: int,
        model: str,
        chat: bool,
        include_usage: bool,
    ) -> None:
        self.chat = chat
        obj = b"chat.completion.chunk" if chat else b"text_completion"
        self._head = b"".join(
            (
                b'data: {"id":',
                _encoder.encode(response_id),
                b',"object":"',
                obj,
                b'","created":',
                str(created).encode(),
                b',"model":',
                _encoder.encode(model),
                b',"choices":[{"index":',
            )
        )
        self._text_key = b',"delta":{"content":' if chat else b',"text":'
        self._delta_close = b"}" if chat else b""
        self._end = b'}],"usage":null}\n\n' if include_usage else b"}]}\n\n"
        self._index: list[bytes] = []
        # Per choice index: the bytes before and after the JSON text of a plain text event.
        self._text_events: list[tuple[bytes, bytes]] = []
        self._reasoning_events: list[tuple[bytes, bytes]] = []  # the same for reasoning text

    def _index_bytes(self, index: int) -> bytes:
        while len(self._index) <= index:
            self._index.append(str(len(self._index)).encode())
        return self._index[index]

    def text_frame(self, index: int) -> tuple[bytes, bytes]:
        """The bytes before and after the JSON text of :meth:`text_event`, built once per
        choice index."""
        events = self._text_events
        while len(events) <= index:
            # chunk() itself, cut around its empty text: the layout has one source. Only
            # constant keys follow the text, so its '""' is the last one in the event.
            whole = self.chunk(len(events), "")
            cut = whole.rindex(b'""')
            events.append((whole[:cut], whole[cut + 2 :]))
        return events[index]

    def text_event(self, index: int, text: str) -> bytes:
        """``chunk(index, text)``: an event with no role, finish reason or logprobs.

        The event of nearly every token, so both sides of the text are built once per choice.
        """
        try:
            before, after = self._text_events[index]
        except IndexError:  # the choice's first text event (a try costs nothing otherwise)
            before, after = self.text_frame(index)
        return before + _encoder.encode(text) + after

    def reasoning_event(self, index: int, text: str) -> bytes:
        """``delta_chunk(index, {"reasoning_content": text})``, built as :meth:`text_event` is:
        the event of nearly every token of a thinking model's reasoning."""
        events = self._reasoning_events
        while len(events) <= index:
            whole = self.delta_chunk(len(events), {"reasoning_content": ""})
            cut = whole.rindex(b'""')
            events.append((whole[:cut], whole[cut + 2 :]))
        before, after = events[index]
        return before + _encoder.encode(text) + after

    def chunk(
        self,
        index: int,
        text: str,
        *,
        role: bool = False,
        finish_reason: str | None = None,
        logprobs: bytes = b"null",
    ) -> bytes:
        """One content event. ``role`` marks the first chat chunk of a choice."""
        if self.chat:
            if role:
                body = b',"delta":{"role":"assistant","content":' + _encoder.encode(text) + b"}"
            elif text or finish_reason is None:
                body = self._text_key + _encoder.encode(text) + self._delta_close
            else:
                body = b',"delta":{}'  # OpenAI's final chunk: empty delta, finish_reason set
        else:
            body = self._text_key + _encoder.encode(text)
        finish = b"null" if finish_reason is None else b'"' + finish_reason.encode() + b'"'
        return b"".join(
            (
                self._head,
                self._index_bytes(index),
                body,
                b',"logprobs":',
                logprobs,
                b',"finish_reason":',
                finish,
                self._end,
            )
        )

    def delta_chunk(
        self,
        index: int,
        delta: dict[str, Any],
        *,
        finish_reason: str | None = None,
        logprobs: bytes = b"null",
    ) -> bytes:
        """A chat event with any ``delta`` (reasoning, tool calls): not the per-token path."""
        finish = b"null" if finish_reason is None else b'"' + finish_reason.encode() + b'"'
        return b"".join(
            (
                self._head,
                self._index_bytes(index),
                b',"delta":',
                _encoder.encode(delta),
                b',"logprobs":',
                logprobs,
                b',"finish_reason":',
                finish,
                self._end,
            )
        )

    def usage(self, usage: dict[str, Any]) -> bytes:
        """The ``include_usage`` chunk: no choices, the whole request's usage."""
        head = self._head[: -len(b'{"index":')]  # ends with `"choices":[`
        return head + b'],"usage":' + _encoder.encode(usage) + b"}\n\n"
