"""``POST /v1/chat/completions`` and ``POST /v1/completions`` (OpenAI-compatible).

Streams are SSE (:mod:`smgd.api.core.sse`): the first chat chunk of each choice carries
``delta.role``, the last one ``finish_reason`` (``stop`` / ``length``), ``include_usage``
adds a ``choices: []`` usage chunk before ``[DONE]``. ``n > 1`` and batched completion
prompts become one engine request per choice, with ``index = prompt_index * n + j``.

Chat with tools or reasoning (:mod:`smgd.api.core.tools`): a choice whose engine has the
parsers the request needs gets a :class:`~smgd.api.core.tools.ChoiceParser`, and the stream
is rendered by :class:`ParsedRenderer` (``reasoning_content``, ``content``, ``tool_calls``
deltas; ``finish_reason: "tool_calls"``); every other request keeps :class:`OpenAIRenderer`.

Logprobs (chat ``logprobs`` + ``top_logprobs``, completions ``logprobs: k``) come in OpenAI's
two shapes: chat ``{"content": [{token, logprob, bytes, top_logprobs}]}``, completions
``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``, one entry per
token counted in ``usage``. A streamed chunk carries the entries of the tokens whose text it
completes (see :class:`~smgd.api.core.pipeline.LogprobTrack`). Completions ``tokens`` are each
token's contribution to the returned text, which ``text_offset`` indexes; every other token
string comes from :class:`TokenText`.
"""

from __future__ import annotations

import re
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from smgd.api.core.errors import stream_error
from smgd.api.core.execute import collect, log_request, stream
from smgd.api.core.pipeline import MIN_LOGPROB, RequestState
from smgd.api.core.prepare import (
    JSON_HEADERS,
    OPENAI_NAMES,
    ParamNames,
    Reply,
    context_len,
    encode,
    encode_all,
    off_the_loop,
    plan_jobs,
    resolve_model,
)
from smgd.api.core.sse import DONE, SSE_HEADERS, ChunkFormat, encode_json
from smgd.api.core.tools import ParseSpec, delta_fields, forced_constraint, read_tool_choice
from smgd.errors import InvalidRequest, SmgdError
from smgd.parse import ContentDelta, ReasoningDelta
from smgd.sampling import for_prompt, from_openai
from smgd.text.chat import prepare_tools, refuse_media
from smgd.text.tokenizer import MAX_TOKEN_ID

if TYPE_CHECKING:
    from smgd.api.core.execute import Job
    from smgd.api.core.pipeline import Choice
    from smgd.api.core.prepare import Call, SamplingFor
    from smgd.api.core.tools import ChoiceParser, ToolRequest
    from smgd.gateway import ModelText
    from smgd.sampling import TextOptions
    from smgd.text.tokenizer import Tokenizer
    from smgd.wire.common import SamplingParams, Structured, TokenLogprob

__all__ = [
    "BIG_REPLY_ENTRIES",
    "MAX_REPLY_PROMPT_LOGPROBS",
    "EchoHead",
    "OpenAIRenderer",
    "ParsedRenderer",
    "PromptParts",
    "TokenText",
    "chat_logprobs",
    "chat_reply",
    "completion_logprobs",
    "completion_reply",
    "render_chat",
    "stop_reason",
    "template_kwargs",
]

# A completions reply repeats its prompt's logprobs in every choice of the prompt (vLLM's
# shape: `echo`'s part of `logprobs`, and the `prompt_logprobs` field): at most this many
# entries (a prompt token's, or one of its top alternatives) over all its choices, about
# 270 MB of reply at ~64 bytes an entry. 16 choices of a 4,000-token prompt with 20 top
# logprobs are 1.3 million (86 MB); 4 such prompts (5.4 million, 343 MB) paused the loop
# 0.4-0.8 s even converted once and built in a thread (the reply's copies: its join, the
# HTTP write's), and took 2.6 s to answer. What the engines send is bounded apart
# (prepare.MAX_PROMPT_LOGPROBS).
MAX_REPLY_PROMPT_LOGPROBS = 1 << 22
# Chat keys that would change the prompt in ways smgd does not implement; rejected by name.
_CHAT_UNSUPPORTED = ("chat_template", "documents")
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback pieces


def _byte_level_table() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character standing for each byte in vocab pieces."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in keep}
    shifted = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_BYTE_LEVEL = _byte_level_table()


class TokenText:
    """Token id → (text, UTF-8 bytes) for logprob entries; one per request, cached per id.

    The bytes are the token's own (a byte-level piece or a ``<0xNN>`` fallback piece maps back
    to its bytes), so a character split over several tokens shows its real bytes in each, and
    its text is the bytes decoded with ``"\ufffd"`` for an incomplete character. Special and
    added tokens are their content.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._hf = tokenizer.hf
        decoder = self._hf.decoder
        self._byte_level = decoder is not None and b'"ByteLevel"' in decoder.__getstate__()
        self._added: dict[int, Any] | None = None
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._lookup(token_id)
        return hit

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        # An id no vocabulary has (negative, past u32: the engine's) raises OverflowError in
        # the tokenizer; it has no text, as an id past the vocabulary.
        piece = self._hf.id_to_token(token_id) if 0 <= token_id <= MAX_TOKEN_ID else None
        if piece is None:
            return "", []
        if self._added is None:
            self._added = self._hf.get_added_tokens_decoder()
        raw: bytes
        if token_id in self._added:
            raw = piece.encode()
        elif self._byte_level and all(c in _BYTE_LEVEL for c in piece):
            raw = bytes(_BYTE_LEVEL[c] for c in piece)
        elif m := _BYTE_FALLBACK.fullmatch(piece):
            raw = bytes((int(m.group(1), 16),))
        elif "\u2581" in piece:  # SentencePiece's word-boundary mark
            raw = piece.replace("\u2581", " ").encode()
        else:
            raw = str(self._hf.decode([token_id], skip_special_tokens=False)).encode()
        return raw.decode(errors="replace"), list(raw)


def _lp(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


def chat_logprobs(tt: TokenText, entries: list[TokenLogprob]) -> dict[str, Any]:
    """Chat's ``choices[i].logprobs``: one ``content`` item per token."""
    content = []
    for e in entries:
        token, raw = tt.get(e.token_id)
        top = []
        for t in e.top or ():
            alt, alt_raw = tt.get(t.token_id)
            top.append({"token": alt, "logprob": _lp(t.logprob), "bytes": alt_raw})
        content.append(
            {"token": token, "logprob": _lp(e.logprob), "bytes": raw, "top_logprobs": top}
        )
    return {"content": content}


def completion_logprobs(
    tt: TokenText, entries: list[TokenLogprob], offsets: list[int], texts: list[str]
) -> dict[str, Any]:
    """Legacy completions' ``choices[i].logprobs``.

    ``tokens`` are the tokens' contributions to the returned text (they concatenate to it and
    ``text_offset`` indexes it; see :class:`~smgd.api.core.pipeline.LogprobTrack`); the keys of
    ``top_logprobs`` are tokens' own texts, and also hold the sampled token (OpenAI: "up to
    logprobs+1 elements").
    """
    values, tops = [], []
    for e in entries:
        top = {tt.get(t.token_id)[0]: _lp(t.logprob) for t in e.top or ()}
        top.setdefault(tt.get(e.token_id)[0], _lp(e.logprob))
        values.append(_lp(e.logprob))
        tops.append(top)
    return {
        "tokens": texts,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def echo_logprobs(
    tt: TokenText, prompt_ids: list[int], entries: list[TokenLogprob]
) -> dict[str, Any]:
    """Completions ``echo`` + ``logprobs``: the prompt tokens' part of ``choices[i].logprobs``,
    as vLLM writes it: the first token has no logprob (``null``), each token's text is its
    own, and ``text_offset`` counts those texts from 0. ``entries`` are tokens 1, 2, ...'s."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    at = 0
    for i, token_id in enumerate(prompt_ids):
        token = tt.get(token_id)[0]
        entry = entries[i - 1] if 0 < i <= len(entries) else None
        tokens.append(token)
        offsets.append(at)
        at += len(token)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        top = {tt.get(entry.token_id)[0]: _lp(entry.logprob)}
        for t in entry.top or ():
            top.setdefault(tt.get(t.token_id)[0], _lp(t.logprob))
        values.append(_lp(entry.logprob))
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def prompt_logprobs_field(
    tt: TokenText, entries: list[TokenLogprob] | None
) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs`` field: ``null`` for the first prompt token, then one
    ``{token id: {logprob, rank, decoded_token}}`` per token: the prompt token first, then its
    top-k alternatives (ranks 1..k)."""
    if entries is None:
        return None
    out: list[dict[str, Any] | None] = [None]
    for e in entries:
        row = {str(e.token_id): _prompt_entry(tt, e.token_id, e.logprob, _rank(e))}
        for j, t in enumerate(e.top or (), start=1):
            row.setdefault(str(t.token_id), _prompt_entry(tt, t.token_id, t.logprob, j))
        out.append(row)
    return out


# The keys of a completions `logprobs` object, and the JSON before each one's list.
_JOINED = tuple(
    (key, (b'{"' if i == 0 else b',"') + key.encode() + b'":')
    for i, key in enumerate(("tokens", "token_logprobs", "top_logprobs", "text_offset"))
)


class EchoHead:
    """One prompt's part of completions ``echo`` + ``logprobs`` (:func:`echo_logprobs`), its
    JSON encoded once: every choice of the prompt starts its ``logprobs`` with these bytes, so
    a choice costs a copy of them, not a conversion and an encode of the prompt's rows (16
    choices of a 4,000-token prompt with 20 top logprobs each built and encoded the same part
    again, 1.5 s of the loop; the engine's 16 copies of the rows took 0.8 s to decode).
    """

    __slots__ = ("_alone", "_lists", "shift")

    def __init__(self, part: dict[str, Any]) -> None:
        self._alone = encode_json(part)
        # Each list without its closing bracket (a view: join() copies it once).
        self._lists = [memoryview(encode_json(part[key]))[:-1] for key, _ in _JOINED]
        # Where the output's text starts, by the prompt tokens' texts: its text_offsets move
        # by this (vLLM's count: a BOS token's text included, which the echoed text has not).
        self.shift = sum(len(t) for t in part["tokens"])

    def join(self, tail: dict[str, Any] | None) -> bytes:
        """The JSON of the head's lists followed by ``tail``'s (its offsets moved past the
        head's text), the head's bytes copied, not encoded again."""
        if tail is None:
            return self._alone
        tail = {**tail, "text_offset": [self.shift + o for o in tail["text_offset"]]}
        pieces: list[bytes | memoryview] = []
        for (key, before), head in zip(_JOINED, self._lists, strict=True):
            pieces.append(before)
            more = encode_json(tail[key])
            if len(head) == 1:  # "[": the head is empty
                pieces.append(more)
            elif more == b"[]":
                pieces.extend((head, b"]"))
            else:
                pieces.extend((head, b",", memoryview(more)[1:]))
        pieces.append(b"}")
        return b"".join(pieces)


class PromptParts:
    """The prompt's logprobs of each prompt of a request, converted and encoded once and
    shared by its choices: choice ``i`` is choice ``i % n`` of prompt ``i // n``, and the
    choices of a prompt have its token ids (:func:`~smgd.api.core.prepare.plan_jobs`), so
    its logprobs are theirs too. The engine is asked for them on the prompt's first choice
    only (``prompt_logprobs_once``); a choice that asked itself gives its own rows if it
    comes first in a stream.
    """

    __slots__ = ("_fields", "_heads", "n", "prompt_ids", "tokens")

    def __init__(self, tokens: TokenText, jobs: list[Job], n: int) -> None:
        self.tokens = tokens
        self.n = n
        self.prompt_ids = [job.request.prompt_ids for job in jobs[::n]]
        self._heads: dict[int, EchoHead] = {}
        self._fields: dict[int, msgspec.Raw] = {}

    def head(self, choice: Choice, rows: list[TokenLogprob] | None) -> EchoHead | None:
        """The echo head of ``choice``'s prompt: the one built, else one built from ``rows``
        (None: not built, and no rows to build it from yet)."""
        p = choice.index // self.n
        head = self._heads.get(p)
        if head is None and rows is not None:
            part = echo_logprobs(self.tokens, self.prompt_ids[p], rows)
            head = self._heads[p] = EchoHead(part)
        return head

    def field(self, choice: Choice, rows: list[TokenLogprob] | None) -> msgspec.Raw:
        """vLLM's ``prompt_logprobs`` field of ``choice``'s prompt, encoded once."""
        p = choice.index // self.n
        field = self._fields.get(p)
        if field is None:
            field = self._fields[p] = msgspec.Raw(
                encode_json(prompt_logprobs_field(self.tokens, rows))
            )
        return field


def _rank(e: TokenLogprob) -> int | None:
    """The engine's rank of the prompt token, or its place among the top-k (None if absent)."""
    if e.rank is not None:
        return e.rank
    for j, t in enumerate(e.top or (), start=1):
        if t.token_id == e.token_id:
            return j
    return None


def _prompt_entry(tt: TokenText, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
    return {"logprob": _lp(logprob), "rank": rank, "decoded_token": tt.get(token_id)[0]}


def stop_reason(choice: Choice, sampling: SamplingParams) -> int | str | None:
    """vLLM's ``stop_reason``: the stop string, or the id of the client's ``stop_token_ids``,
    that ended the choice; None for EOS and length. (Engines name the EOS id a finish hit,
    which native ``/generate`` reports as SGLang does.)"""
    matched = choice.matched
    if choice.finish_reason != "stop":
        return None
    if isinstance(matched, str):
        return matched
    if (
        matched is not None
        and matched in sampling.stop_token_ids
        and (sampling.ignore_eos or matched not in sampling.eos_token_ids)
    ):
        return matched
    return None


class OpenAIRenderer:
    """Chunk bytes for one streamed OpenAI request."""

    def __init__(
        self,
        fmt: ChunkFormat,
        state: RequestState,
        *,
        include_usage: bool,
        echo: dict[int, str] | None = None,
        tokens: TokenText | None = None,
        parts: PromptParts | None = None,
    ) -> None:
        self.fmt = fmt
        self.state = state
        self.include_usage = include_usage
        self.echo = echo
        self.tokens = tokens  # set when the request asked for logprobs
        self.parts = parts  # echo with logprobs: the prompts' logprobs, shared by their choices
        # Choices whose first event waits for their prompt's logprobs: the text they made.
        self._held: dict[int, str] = {}

    def delta(self, choice: Choice, text: str) -> bytes:
        if choice.sent_role and choice.finish_reason is None and self.tokens is None:
            # Mid-stream text, the event of nearly every token: no role, echo, finish or
            # logprobs to add (the same bytes as the general path below).
            return self.fmt.text_event(choice.index, text) if text else b""
        first = not choice.sent_role
        head = None
        if first and self.parts is not None:
            head = self.parts.head(choice, choice.prompt_logprobs)
            if head is None:
                # The engine sends the prompt's logprobs with the prompt's first choice only:
                # this choice's first event (the prompt's logprobs first) waits for them.
                self._held[choice.index] = self._held.get(choice.index, "") + text
                return b""
            if self._held:
                text = self._held.pop(choice.index, "") + text
        out = self._event(choice, text, first, head)
        if head is not None and self._held:
            out += self._release(choice)
        return out

    def _event(self, choice: Choice, text: str, first: bool, head: EchoHead | None) -> bytes:
        if first and self.echo is not None:
            text = self.echo[choice.index] + text
        if not text and not choice.done and not (first and self.fmt.chat):
            return b""
        choice.sent_role = True
        logprobs = self._unsent_logprobs(choice, head)
        return self.fmt.chunk(
            choice.index,
            text,
            role=first and self.fmt.chat,
            finish_reason=choice.finish_reason,
            logprobs=logprobs,
        )

    def _release(self, source: Choice) -> bytes:
        """The first events of the choices that waited for the logprobs of ``source``'s
        prompt, now that its first event has them."""
        assert self.parts is not None
        n = self.parts.n
        prompt = source.index // n
        out = []
        for index in [i for i in self._held if i // n == prompt]:
            choice = self.state.choices[index]
            head = self.parts.head(choice, None)
            out.append(self._event(choice, self._held.pop(index), True, head))
        return b"".join(out)

    def text_frame(self, choice: Choice) -> tuple[bytes, bytes] | tuple[()] | None:
        if self.tokens is not None:
            return ()  # every event carries its logprobs
        if not choice.sent_role:
            return None  # the first event (role, echo) is still to come
        return self.fmt.text_frame(choice.index)

    def _unsent_logprobs(self, choice: Choice, head: EchoHead | None = None) -> bytes:
        """The logprobs of the chunk (``null`` if none); a completions ``echo`` puts the
        prompt's (``head``) before the output's in a choice's first chunk."""
        found: dict[str, Any] | None = None
        if self.tokens is not None and choice.logprobs is not None:
            entries, offsets, texts = choice.logprobs.unsent()
            if entries:
                if head is None and self.parts is not None:
                    # After the first chunk: offsets count the echoed prompt's tokens' text
                    # too, as the first chunk's do (and vLLM's, in every chunk).
                    built = self.parts.head(choice, None)
                    if built is not None:
                        offsets = [built.shift + at for at in offsets]
                found = self._logprobs(entries, offsets, texts)
            if head is not None:
                return head.join(found)
        return b"null" if found is None else encode_json(found)

    def _logprobs(
        self, entries: list[TokenLogprob], offsets: list[int], texts: list[str]
    ) -> dict[str, Any]:
        assert self.tokens is not None
        if self.fmt.chat:
            return chat_logprobs(self.tokens, entries)
        return completion_logprobs(self.tokens, entries, offsets, texts)

    def end(self) -> bytes:
        if self.include_usage:
            return self.fmt.usage(self.state.usage()) + DONE
        return DONE

    def error(self, err: SmgdError) -> bytes:
        return stream_error(err)


class ParsedRenderer(OpenAIRenderer):
    """Chat chunks of a request whose choices have parsers (tools, reasoning).

    Each text piece goes through its choice's parser; the events it makes certain go out as
    one chunk (``reasoning_content``, ``content``, ``tool_calls`` in OpenAI's delta shape), and
    a choice's last chunk carries the parser's finish reason. Choices without a parser (their
    engine has none) stream as :class:`OpenAIRenderer` streams them.
    """

    def __init__(
        self,
        fmt: ChunkFormat,
        state: RequestState,
        parsers: dict[int, ChoiceParser],
        *,
        include_usage: bool,
        tokens: TokenText | None = None,
    ) -> None:
        super().__init__(fmt, state, include_usage=include_usage, tokens=tokens)
        self.parsers = parsers

    def text_frame(self, choice: Choice) -> tuple[bytes, bytes] | tuple[()] | None:
        if choice.index in self.parsers:
            return ()  # its text goes through the parser
        return super().text_frame(choice)

    def delta(self, choice: Choice, text: str) -> bytes:
        parser = self.parsers.get(choice.index)
        if parser is None:
            return super().delta(choice, text)
        events = parser.feed(text)
        if choice.sent_role and not choice.done and self.tokens is None and len(events) < 2:
            # Mid-stream, one kind of text or nothing: the event of nearly every token, from
            # byte templates (the same bytes as the general path below).
            if not events:
                return b""
            event = events[0]
            if isinstance(event, ContentDelta):
                return self.fmt.text_event(choice.index, event.text)
            if isinstance(event, ReasoningDelta):
                return self.fmt.reasoning_event(choice.index, event.text)
        if choice.done:
            events += parser.finish()
            events += parser.forced_calls()
        fields = delta_fields(events)
        out = b""
        if not choice.sent_role:
            fields = {"role": "assistant", "content": "", **fields}
        logprobs = self._unsent_logprobs(choice)
        if fields or logprobs != b"null":
            choice.sent_role = True
            out = self.fmt.delta_chunk(choice.index, fields, logprobs=logprobs)
        if choice.done:
            reason = parser.finish_reason(choice.finish_reason)
            choice.reported_finish = reason
            out += self.fmt.delta_chunk(choice.index, {}, finish_reason=reason)
        return out


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    streaming = body.get("stream", False)
    if streaming is None:
        streaming = False
    if not isinstance(streaming, bool):
        raise InvalidRequest("`stream` must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is None:
        return streaming, False
    if not isinstance(options, dict):
        raise InvalidRequest("`stream_options` must be an object", param="stream_options")
    if not streaming:
        raise InvalidRequest("`stream_options` needs `stream: true`", param="stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise InvalidRequest(
            "`include_usage` must be a boolean", param="stream_options.include_usage"
        )
    if options.get("continuous_usage_stats"):
        raise InvalidRequest(
            "`continuous_usage_stats` is not supported",
            param="stream_options.continuous_usage_stats",
        )
    return streaming, include


async def _respond(
    call: Call,
    jobs: list[Job],
    state: RequestState,
    *,
    chat: bool,
    streaming: bool,
    include_usage: bool,
    echo: dict[int, str] | None,
    tokenizer: Tokenizer,
    n: int,
    parsers: dict[int, ChoiceParser] | None = None,
    echo_only: bool = False,
) -> Reply:
    """``echo``: each choice's prompt text, to put before its output; with logprobs, the
    prompt's logprobs go before the output's too. ``echo_only``: ``max_tokens: 0``, the reply
    is the prompt alone (its one engine token is counted in usage, as vLLM counts it). ``n``:
    the choices of each prompt (``jobs`` are prompt after prompt)."""
    prefix = "chatcmpl-" if chat else "cmpl-"
    sampling = jobs[0].request.sampling
    wants_logprobs = sampling.logprobs is not None
    tokens = (
        TokenText(tokenizer) if wants_logprobs or sampling.prompt_logprobs is not None else None
    )
    parts = None if tokens is None else PromptParts(tokens, jobs, n)
    response_id = prefix + state.request_id
    if streaming:
        fmt = ChunkFormat(
            response_id=response_id,
            created=state.created,
            model=state.model,
            chat=chat,
            include_usage=include_usage,
        )
        render: OpenAIRenderer
        if parsers:
            render = ParsedRenderer(fmt, state, parsers, include_usage=include_usage, tokens=tokens)
        else:
            render = OpenAIRenderer(
                fmt,
                state,
                include_usage=include_usage,
                echo=echo,
                tokens=tokens if wants_logprobs else None,
                parts=parts if echo is not None and wants_logprobs else None,
            )
        body = stream(
            jobs,
            state,
            render,
            keepalive_s=call.ctx.keepalive_s,
            nursery=call.nursery,
            pacer=call.ctx.pacer,
            writer=call.writer,
            cutoff=call.ctx.cutoff,
        )
        return Reply(body, SSE_HEADERS)
    await collect(jobs, state, call.ctx.cutoff, log=False)
    build = partial(
        _reply_body, jobs, state, response_id, chat=chat, echo=echo, tokens=tokens,
        parts=parts, parsers=parsers, echo_only=echo_only,
    )  # fmt: skip
    if _reply_entries(jobs, n) < BIG_REPLY_ENTRIES:
        payload = build()
    else:
        payload = await trio.to_thread.run_sync(build, limiter=call.ctx.tokenize_limiter)
    log_request(state)  # now that the finish reasons the client gets are known
    return Reply(payload, JSON_HEADERS)


# A non-streamed reply that converts at least this many logprob entries (a token's, or one of
# its top alternatives) is built in a worker thread. They cost 1.2-1.6 µs each on the 2-core
# test VM (converted and encoded), so 4,096 take ~5 ms, about what a thread hop and the GIL's
# hand-back cost the loop (BIG_BODY_BYTES's rule); a 4,000-token prompt's with 20 top
# logprobs each (84,000) took 0.13 s, and a batch of 64 such prompts over 8 s of the loop.
# In a thread the build still holds the GIL, but the loop gets it back every switch interval.
BIG_REPLY_ENTRIES = 4_096


def _reply_entries(jobs: list[Job], n: int) -> int:
    """How many logprob entries the reply of ``jobs`` converts: the outputs' (each choice's)
    and the prompts' (once per prompt)."""
    sampling = jobs[0].request.sampling
    entries = 0
    if sampling.logprobs is not None:
        tokens = sum(job.choice.completion_tokens for job in jobs)
        entries += tokens * (sampling.logprobs + 1)
    if sampling.prompt_logprobs is not None:
        tokens = sum(len(job.request.prompt_ids) for job in jobs[::n])
        entries += tokens * (sampling.prompt_logprobs + 1)
    return entries


def _reply_body(
    jobs: list[Job],
    state: RequestState,
    response_id: str,
    *,
    chat: bool,
    echo: dict[int, str] | None,
    tokens: TokenText | None,
    parts: PromptParts | None,
    parsers: dict[int, ChoiceParser] | None,
    echo_only: bool,
) -> bytes:
    """A non-streamed reply's JSON, once every job has finished (pure: a big one is built in
    a worker thread). The prompt's parts are built once per prompt (:class:`PromptParts`)
    from the logprobs of its first choice, the one that asked the engine for them."""
    sampling = jobs[0].request.sampling
    choices: list[bytes] = []
    for job in jobs:
        choice = job.choice
        text = "" if echo_only else "".join(choice.parts)
        if echo is not None:
            text = echo[choice.index] + text
        entry: dict[str, Any] = {"index": choice.index}
        finish_reason = choice.finish_reason
        parser = parsers.get(choice.index) if parsers else None
        if parser is not None:
            parser.feed(text)
            parser.finish()
            parser.forced_calls()
            entry["message"] = parser.message()
            finish_reason = choice.reported_finish = parser.finish_reason(finish_reason)
        elif chat:
            entry["message"] = {"role": "assistant", "content": text}
        else:
            entry["text"] = text
        entry["logprobs"] = None
        rows = None
        if parts is not None:
            rows = jobs[choice.index - choice.index % parts.n].choice.prompt_logprobs
        if tokens is not None and choice.logprobs is not None:
            track = choice.logprobs
            entry["logprobs"] = (
                chat_logprobs(tokens, track.entries)
                if chat
                else completion_logprobs(tokens, track.entries, track.offsets, track.texts)
            )
            if echo is not None and parts is not None:
                head = parts.head(choice, rows or [])
                assert head is not None
                tail = None if echo_only else entry["logprobs"]
                entry["logprobs"] = msgspec.Raw(head.join(tail))
        entry["finish_reason"] = finish_reason
        entry["stop_reason"] = stop_reason(choice, job.request.sampling)
        if not chat and parts is not None and sampling.prompt_logprobs is not None:
            entry["prompt_logprobs"] = parts.field(choice, rows)
        choices.append(encode_json(entry))
    # Each choice is encoded on its own and the reply joined from them: the same bytes as one
    # encode of the whole, whose one call held the GIL 0.24 s for a 343 MB reply (a pause of
    # the loop even from a worker thread); between calls the loop gets it back, and the join
    # is a copy.
    envelope = encode_json(
        {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": state.created,
            "model": state.model,
        }
    )
    rest: dict[str, Any] = {"usage": state.usage()}
    if chat and sampling.prompt_logprobs is not None and tokens is not None:
        # vLLM puts chat's at the top level (one prompt for every choice).
        rest["prompt_logprobs"] = prompt_logprobs_field(tokens, jobs[0].choice.prompt_logprobs)
    pieces: list[bytes | memoryview] = [memoryview(envelope)[:-1], b',"choices":[']
    for i, encoded in enumerate(choices):
        if i:
            pieces.append(b",")
        pieces.append(encoded)
    pieces.extend((b"],", memoryview(encode_json(rest))[1:]))
    return b"".join(pieces)


def _sampler(
    body: dict[str, Any], text: ModelText, *, chat: bool, forced: Structured | None = None
) -> SamplingFor:
    """``forced``: the constraint of a ``required`` / named ``tool_choice``."""
    eos = text.tokenizer.eos_token_ids
    vocab_size = text.vocab_size
    first: list[tuple[SamplingParams, TextOptions]] = []  # the first prompt's, once read

    def sampling_for(prompt_len: int, context_len: int) -> tuple[SamplingParams, TextOptions]:
        if first:  # another prompt of the request: the options are read once (for_prompt)
            params, options = first[0]
            sized = for_prompt(
                body, params, chat=chat, prompt_len=prompt_len, context_len=context_len
            )
            return sized, options
        params, options = from_openai(
            body,
            chat=chat,
            prompt_len=prompt_len,
            context_len=context_len,
            vocab_size=vocab_size,
            eos_token_ids=eos,
        )
        if forced is not None:
            if params.structured is not None:
                raise InvalidRequest(
                    f"tool_choice {body['tool_choice']!r} constrains the output to the call; "
                    f"it cannot go with `{params.structured.param}`",
                    param="tool_choice",
                )
            params = msgspec.structs.replace(params, structured=forced)
        first.append((params, options))
        return params, options

    return sampling_for


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"`{key}` must be a boolean", param=key)
    return value


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The request's ``chat_template_kwargs``, checked: an object that does not set what the
    request's own keys set."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest(
            "`chat_template_kwargs` must be an object", param="chat_template_kwargs"
        )
    reserved = {"messages", "tools", "add_generation_prompt"} & kwargs.keys()
    if reserved:
        raise InvalidRequest(
            f"`chat_template_kwargs` cannot set {sorted(reserved)}", param="chat_template_kwargs"
        )
    return kwargs


def render_chat(
    text: ModelText, body: dict[str, Any], kwargs: dict[str, Any]
) -> tuple[ToolRequest, str]:
    """The request's tools, checked, and its messages rendered to the prompt (off the loop
    for a big request: :func:`~smgd.api.core.prepare.off_the_loop`); chat and tokenize."""
    tools = read_tool_choice(body, prepare_tools(body.get("tools")))
    prompt = text.tokenizer.render_chat(
        body["messages"],
        add_generation_prompt=_flag(body, "add_generation_prompt", True),
        tools=body.get("tools"),
        **kwargs,
    )
    return tools, prompt


async def chat_reply(call: Call) -> Reply:
    """``POST /v1/chat/completions``: 4xx errors are raised before any engine sees the request."""
    body = await call.json()
    model, text = resolve_model(call.ctx.gateway, body)
    streaming, include_usage = _stream_flags(body)
    for key in _CHAT_UNSUPPORTED:
        if body.get(key) is not None:
            raise InvalidRequest(f"`{key}` is not supported by smgd", param=key)
    if _flag(body, "continue_final_message", False):
        raise InvalidRequest(
            "`continue_final_message` is not supported by smgd", param="continue_final_message"
        )
    kwargs = template_kwargs(body)
    if "messages" not in body:
        raise InvalidRequest("`messages` is required", param="messages")
    tools, prompt = await off_the_loop(call, render_chat, text, body, kwargs)
    # Chat templates render BOS themselves; vLLM also defaults to no special tokens here.
    ids = await encode(
        text.tokenizer,
        prompt,
        add_special_tokens=_flag(body, "add_special_tokens", False),
        limiter=call.ctx.tokenize_limiter,
        context=context_len(call.ctx.gateway, model),
        param="messages",
    )
    state = call.new_state("chat", model)
    jobs, options = plan_jobs(
        call.ctx.gateway, model, text, [ids],
        _sampler(body, text, chat=True, forced=forced_constraint(tools)), state,
        top_logprobs_param="top_logprobs", prompt_logprobs_once=True,
    )  # fmt: skip
    if options.echo:
        raise InvalidRequest("`echo` is not supported for chat", param="echo")
    _no_streamed_prompt_logprobs(body, streaming)
    spec = ParseSpec(
        tools,
        thinking=kwargs.get("enable_thinking") is not False,
        reasoning=_flag(body, "include_reasoning", True),
    )
    parsers: dict[int, ChoiceParser] = {}
    for job in jobs:
        config = job.engine.config
        parser = spec.for_engine(config.tool_parser, config.reasoning_parser)
        if parser is not None:
            parsers[job.choice.index] = parser
    return await _respond(
        call, jobs, state, chat=True, streaming=streaming, include_usage=include_usage, echo=None,
        tokenizer=text.tokenizer, n=options.n, parsers=parsers,
    )  # fmt: skip


_ONLY_INTS = {int}


def _all_ids(items: list[Any]) -> bool:
    """Every item is an int and not a bool (``type(True)`` is ``bool``, not ``int``). A set of
    the items' types is built in C: 2 µs for 64 ids, 11 µs with an isinstance per id."""
    return set(map(type, items)) == _ONLY_INTS


def _completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if _all_ids(prompt):
            return [prompt]
        if all(isinstance(p, list) and p and _all_ids(p) for p in prompt):
            return list(prompt)
        for i, item in enumerate(prompt):  # a chat content part, by mistake or on purpose
            if isinstance(item, dict):
                refuse_media(item.get("type"), f"prompt[{i}]")
    raise InvalidRequest(
        "`prompt` must be a non-empty string, array of strings, array of token ids, "
        "or array of token-id arrays",
        param="prompt",
    )


async def completion_reply(call: Call) -> Reply:
    """``POST /v1/completions``: 4xx errors are raised before any engine sees the request."""
    body = await call.json()
    model, text = resolve_model(call.ctx.gateway, body)
    streaming, include_usage = _stream_flags(body)
    raw = _completion_prompts(body)
    add_special = _flag(body, "add_special_tokens", True)
    context = context_len(call.ctx.gateway, model)
    encoded = iter(
        await encode_all(
            text.tokenizer,
            [item for item in raw if isinstance(item, str)],
            add_special_tokens=add_special,
            limiter=call.ctx.tokenize_limiter,
            context=context,
        )
    )
    prompts = [next(encoded) if isinstance(item, str) else list(item) for item in raw]
    state = call.new_state("completion", model)
    # Prompt logprobs the client did not name come from `echo` (with `logprobs`).
    implied = body.get("prompt_logprobs") is None
    jobs, options = plan_jobs(
        call.ctx.gateway, model, text, prompts, _sampler(body, text, chat=False), state,
        top_logprobs_param="logprobs",
        names=ParamNames(prompt_logprobs="echo") if implied else OPENAI_NAMES,
        prompt_logprobs_once=True,
    )  # fmt: skip
    _no_streamed_prompt_logprobs(body, streaming)
    _check_reply_size(jobs, options.n, "prompt_logprobs" if not implied else "echo")
    if options.echo_only and streaming:
        raise InvalidRequest(
            "`max_tokens: 0` (echo without generation) needs `stream: false`", param="max_tokens"
        )
    echo: dict[int, str] | None = None
    if options.echo:
        echo = {}
        for job in jobs:
            p, j = divmod(job.choice.index, options.n)
            item = raw[p]
            if j:  # the prompt's first choice has its text
                echo[job.choice.index] = echo[job.choice.index - j]
            else:
                echo[job.choice.index] = (
                    item if isinstance(item, str) else text.tokenizer.decode(item, False)
                )
    return await _respond(
        call, jobs, state, chat=False, streaming=streaming, include_usage=include_usage, echo=echo,
        tokenizer=text.tokenizer, n=options.n, echo_only=options.echo_only,
    )  # fmt: skip


def _check_reply_size(jobs: list[Job], n: int, param: str) -> None:
    """Refuse a completions request whose reply would repeat more prompt logprob entries than
    :data:`MAX_REPLY_PROMPT_LOGPROBS` over its choices."""
    k = jobs[0].request.sampling.prompt_logprobs  # the first choice asks for them, if any
    if k is None:
        return
    tokens = sum(len(job.request.prompt_ids) for job in jobs[::n]) * n
    if tokens * (k + 1) > MAX_REPLY_PROMPT_LOGPROBS:
        raise InvalidRequest(
            f"`{param}`: a reply of {len(jobs)} choice(s) would repeat the prompt logprobs of "
            f"{tokens} prompt tokens x {k + 1} entries each, more than the "
            f"{MAX_REPLY_PROMPT_LOGPROBS} a reply may hold; ask for fewer choices (`n`) or top "
            "logprobs, or send fewer or shorter prompts",
            param=param,
        )


def _no_streamed_prompt_logprobs(body: dict[str, Any], streaming: bool) -> None:
    """vLLM's rule: an explicit ``prompt_logprobs`` needs a non-streamed reply (completions'
    ``echo`` with ``logprobs`` streams them in its first chunk)."""
    if streaming and body.get("prompt_logprobs") is not None:
        raise InvalidRequest(
            "`prompt_logprobs` are not available when `stream=True`", param="prompt_logprobs"
        )
