"""Per-request state, pure: one :class:`Choice` per engine request, one :class:`RequestState`.

A :class:`Choice` turns the engine's token-id deltas into client text (incremental
detokenizer + stop-string matcher with hold-back, via :class:`~smgd.text.stream.TextStream`),
counts tokens and decides the OpenAI ``finish_reason``. :class:`RequestState` holds the
choices of one HTTP request plus its ids and timings, computes ``usage`` and the one log line
written when the request ends. No trio, no HTTP: times are passed in.

Request ids: the client's ``X-Request-Id`` (bounded length and charset) or a minted one names
the HTTP request in headers and logs; each engine request gets its own fixed-length
``uuid4().hex`` rid, because SGLang aborts by rid *prefix* and clients reuse header ids.
"""

from __future__ import annotations

import logging
import random
import re
from array import array
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from smgd.api.core.errors import engine_finish_error
from smgd.errors import InvalidRequest, SmgdError
from smgd.wire.common import FinishReason, TokenDelta, TokenLogprob

if TYPE_CHECKING:
    from collections.abc import Callable

    from smgd.engines.base import EngineClient
    from smgd.engines.stream import RequestStream
    from smgd.router import Router
    from smgd.text.stream import TextStream
    from smgd.wire.common import EngineInfo, EngineRequest

__all__ = [
    "Choice",
    "LogprobTrack",
    "RequestState",
    "check_request_id",
    "new_engine_rid",
    "new_request_id",
]

# A client id is echoed in headers and every log line: 128 visible characters is enough for
# any UUID/ULID/trace-id scheme and keeps a hostile header from bloating logs (xLLM caps 256).
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")

log = logging.getLogger("smgd.api")

_random_bits = random.getrandbits  # Mersenne Twister: no system call per id

_FINISH_TEXT = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def new_request_id() -> str:
    """32 random hex digits, like ``uuid4().hex``.

    Drawn from ``random`` (seeded from the OS at start and again after a fork) rather than
    ``uuid4``, whose ``os.urandom`` is a system call (1.9 vs 0.3 µs per id on the 2-core test
    VM), and every request takes two ids. Ids only have to be unique; none is a secret.
    """
    return f"{_random_bits(128):032x}"


def new_engine_rid() -> str:
    """Fixed-length hex: no engine rid is a prefix of another (SGLang aborts by prefix)."""
    return f"{_random_bits(128):032x}"


_Request = TypeVar("_Request", bound="EngineRequest")


def other_engine(
    router: Router,
    model: str,
    failed: EngineClient,
    request: _Request,
    tried: set[str],
    *,
    kind: str,
    when: str = "",
) -> tuple[EngineClient, _Request, EngineInfo] | None:
    """``request`` failed on engine ``failed``: another ready engine of ``model`` (none of
    ``tried``, which gains ``failed``), ``request`` under a fresh rid, and the engine info it
    was validated against there (for ``open_stream``'s ``checked``); None if there is no such
    engine or it cannot take the request.

    A move is logged as a warning: ``<kind> <rid>: engine <failed> failed<when>; retrying on
    <engine>``.
    """
    tried.add(failed.name)
    try:
        engine = router.pick(model, request.prompt_ids, exclude=tuple(tried))
        moved = msgspec.structs.replace(request, rid=new_engine_rid())
        checked = engine.validate(moved)
    except SmgdError:
        return None
    log.warning(
        "%s %s: engine %s failed%s; retrying on %s",
        kind, request.rid, failed.name, when, engine.name,
    )  # fmt: skip
    return engine, moved, checked


def check_request_id(value: str, param: str) -> str:
    if not _CLIENT_ID.fullmatch(value):
        raise InvalidRequest(
            f"{param} must be 1-128 characters of [A-Za-z0-9._:/+=@-]", param=param
        )
    return value


class Choice:
    """One engine request's output as the client sees it."""

    __slots__ = (
        "cached_tokens",
        "completion_tokens",
        "counts_prompt",
        "engine",
        "finish_reason",
        "index",
        "logprobs",
        "matched",
        "output_ids",
        "parts",
        "plain_detok",
        "prompt_logprobs",
        "prompt_tokens",
        "reported_finish",
        "rid",
        "sent_role",
        "stopped_here",
        "stream",
        "t_first",
        "t_last",
        "text",
        "tokens_seen",
    )

    def __init__(
        self,
        index: int,
        rid: str,
        text: TextStream,
        *,
        prompt_tokens: int,
        counts_prompt: bool = True,
        engine: str = "",
        keep_ids: bool = False,
        logprobs: LogprobTrack | None = None,
        prompt_logprobs: bool = False,
    ) -> None:
        self.index = index
        self.rid = rid
        self.text = text
        self.engine = engine
        self.prompt_tokens = prompt_tokens
        self.counts_prompt = counts_prompt  # n > 1 shares a prompt: usage counts it once
        self.completion_tokens = 0
        self.cached_tokens: int | None = None
        self.finish_reason: str | None = None
        self.matched: int | str | None = None
        self.stopped_here = False  # a stop string matched in smgd: the engine must be aborted
        self.sent_role = False
        self.parts: list[str] = []  # text so far, kept for non-streamed and native responses
        self.output_ids: list[int] | None = [] if keep_ids else None
        self.logprobs = logprobs  # set when the request asked for logprobs
        self.t_first: float | None = None  # time of this choice's first output event
        # Prompt tokens 1, 2, ...'s logprobs as the engine sent them, when the request asked.
        self.prompt_logprobs: list[TokenLogprob] | None = [] if prompt_logprobs else None
        self.t_last: float | None = None  # time of this choice's last output event
        self.stream: RequestStream | None = None  # its engine request's, once sent
        # The finish reason the client was sent when a renderer changed it (``tool_calls``).
        self.reported_finish: str | None = None
        self.tokens_seen = 0  # completion_tokens at that event
        # The detokenizer, when a mid-stream token's text is its push() alone (no stop
        # strings, no logprobs): apply() then reads it here, not through the TextStream, one
        # object fewer per token (they are cold after an engine step).
        self.plain_detok = text.detok if text.plain and logprobs is None else None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def output_event(self, now: float, gaps: array[float]) -> bool:
        """Keep the time of an output event (a delta that brought tokens was applied) and its
        gap since the previous one, appended to ``gaps``; True if it was the choice's first.

        The request's :meth:`RequestState.output_event` calls it; a direct-mode stream calls
        it itself with the request's gaps, and so reads the request's state only once.
        """
        if self.completion_tokens == self.tokens_seen:
            return False  # a finish-only or empty delta is not an output event
        self.tokens_seen = self.completion_tokens
        last = self.t_last
        self.t_last = now
        if last is not None:
            gaps.append(now - last)
            return False
        self.t_first = now
        return True

    @property
    def queued_s(self) -> float:
        """How long its engine request queued: for a slot in smgd, then in the engine."""
        return self.stream.queued_s if self.stream is not None else 0.0

    def apply(self, delta: TokenDelta) -> str:
        """Fold one (coalesced) engine delta in; return the new client text.

        Sets ``finish_reason`` when the engine finished or a stop string matched. Raises the
        :class:`~smgd.errors.SmgdError` for an engine-side abort or failure.
        """
        if self.finish_reason is not None:
            return ""
        if delta.prompt_logprobs is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(delta.prompt_logprobs)
        ids = delta.token_ids
        counted = self.completion_tokens
        self.completion_tokens += len(ids)
        reported = delta.completion_tokens
        # Not max(): a builtin call with two arguments costs ~0.2 µs, per token here.
        if reported is not None and reported > self.completion_tokens:
            self.completion_tokens = reported
        if delta.cached_tokens is not None:
            self.cached_tokens = delta.cached_tokens
        if delta.prompt_tokens is not None:
            self.prompt_tokens = delta.prompt_tokens
        if self.output_ids is not None:
            self.output_ids.extend(ids)
        finish = delta.finish
        if finish is None and (detok := self.plain_detok) is not None:
            # Mid-stream with no stop strings and no logprobs, nearly every token: what the
            # rest of this method would do, without its calls (TextStream.plain).
            return detok.push(ids)
        if finish is not None and finish.reason not in _FINISH_TEXT:
            raise engine_finish_error(finish)
        stop_token = (
            finish is not None
            and finish.reason is FinishReason.STOP
            and finish.matched_token is not None
            and bool(ids)
            and ids[-1] == finish.matched_token
        )
        track = self.logprobs
        if track is None:
            text, hit = self.text.push(ids, stop_token=stop_token)
        else:
            text, hit = track.push(self.text, ids, delta.logprobs, stop_token=stop_token)
        if hit is not None:
            self.finish_reason, self.matched = "stop", hit
            self.stopped_here = finish is None
            # The output ends at the token that completed the stop: what the engine made
            # after it (in this same delta) is neither counted nor returned.
            kept = self.text.kept
            self.completion_tokens = counted + kept
            if self.output_ids is not None:
                del self.output_ids[len(self.output_ids) - len(ids) + kept :]
        elif finish is not None:
            text += self.text.finish() if track is None else track.finish(self.text)
            if self.text.stop_hit is not None:  # the held-back tail completed a stop
                self.finish_reason, self.matched = "stop", self.text.stop_hit
            else:
                self.finish_reason = _FINISH_TEXT[finish.reason]
                self.matched = (
                    finish.matched_token
                    if finish.matched_token is not None
                    else (finish.matched_text)
                )
        if track is not None:
            track.release(len(text), done=self.done)
        return text


class RequestState:
    """One HTTP request: its choices, ids, timings; usage and the final log line."""

    __slots__ = (
        "choices",
        "created",
        "error",
        "failure",
        "gaps",
        "kind",
        "model",
        "recorder",
        "request_id",
        "t_end",
        "t_first",
        "t_start",
    )

    def __init__(
        self, *, request_id: str, kind: str, model: str, created: int, t_start: float
    ) -> None:
        self.request_id = request_id
        self.kind = kind
        self.model = model
        self.created = created
        self.t_start = t_start
        self.t_first: float | None = None
        self.t_end: float | None = None
        self.choices: list[Choice] = []
        self.error: str | None = None
        self.failure: SmgdError | None = None  # what ended it early, for the abort metrics
        # Gaps between consecutive output events of each choice (inter-token latency per
        # event), observed into the metrics once at the end: 8 bytes per event, no per-token
        # work. A 10 000-event generation holds 80 KB until it ends.
        self.gaps = array("d")
        # Called once with (state, end time) when the request ends (the metrics recorder).
        self.recorder: Callable[[RequestState, float], None] | None = None

    def first_output(self, now: float) -> None:
        if self.t_first is None:
            self.t_first = now

    def output_event(self, choice: Choice, now: float) -> None:
        """``choice`` just produced tokens (a delta was applied); keep TTFT and the event gap."""
        if choice.output_event(now, self.gaps):
            self.first_output(now)  # the request's first event is its first choice's

    def fail(self, err: SmgdError) -> None:
        self.error = err.message
        self.failure = err

    def usage(self) -> dict[str, Any]:
        # One loop, not a generator per sum: every request's end (and its log line) asks.
        prompt = completion = cached = 0
        reported = False  # an engine said how many prompt tokens it served from its cache
        for c in self.choices:
            completion += c.completion_tokens
            if c.counts_prompt:
                prompt += c.prompt_tokens
                if c.cached_tokens is not None:
                    reported = True
                    cached += c.cached_tokens
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if reported:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def log_fields(self, now: float) -> dict[str, Any]:
        """The structured fields of the request's one log line."""
        self.t_end = now
        usage = self.usage()
        ttft = None if self.t_first is None else round((self.t_first - self.t_start) * 1e3, 2)
        return {
            "request_id": self.request_id,
            "endpoint": self.kind,
            "model": self.model,
            "engine": ",".join(sorted({c.engine for c in self.choices})),
            "engine_rids": [c.rid for c in self.choices],
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"],
            "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens"),
            "ttft_ms": ttft,
            "e2e_ms": round((now - self.t_start) * 1e3, 2),
            "finish_reason": ",".join(
                c.reported_finish or c.finish_reason or "none" for c in self.choices
            ),
            "error": self.error,
            "client_disconnected": self.client_disconnected,
        }

    @property
    def client_disconnected(self) -> bool:
        """It ended with a choice unfinished and no error: its client went away (the metrics'
        ``cancelled``, counted as a ``client_disconnect`` abort) and its engine requests were
        aborted. Nothing else ends a request that way: a drain's cut, a timeout and an engine
        failure each leave their error."""
        return self.error is None and not all(c.done for c in self.choices)


# Logprobs below this are sent as this (vLLM's clamp): -inf, which a fully masked token gets,
# has no JSON spelling.
MIN_LOGPROB = -9999.0


class LogprobTrack:
    """One choice's logprob entries, released in step with the text the client was sent.

    ``aligned`` (the OpenAI endpoints): each output id goes through the detokenizer on its
    own, so every entry knows its token's *contribution*: the text the detokenizer produced
    when that token arrived (``""`` for a byte of an unfinished character or a skipped special
    token; the whole character for the token completing it). Contributions, cut where a stop
    string cuts the output, concatenate to the choice's text; ``offsets`` says where each
    starts in it. An entry is released once its contribution has been sent; at the end every
    entry of a counted token is (through the token completing a stop string, and the EOS /
    stop token, whose contribution is ``""``), so there is one entry per token of
    ``usage.completion_tokens``. Not aligned (native ``/generate``): every entry is kept, one
    per id of ``output_ids``, as SGLang reports them.
    """

    __slots__ = (
        "_chars",
        "_emitted",
        "_last",
        "_pending",
        "aligned",
        "entries",
        "offsets",
        "sent",
        "texts",
    )

    def __init__(self, *, aligned: bool = True) -> None:
        self.aligned = aligned
        self.entries: list[TokenLogprob] = []  # released, in output order
        self.offsets: list[int] = []  # aligned: where each released token's text starts
        self.texts: list[str] = []  # aligned: each released token's contribution
        self.sent = 0  # entries a streaming renderer has already written
        self._pending: list[tuple[int, str, TokenLogprob]] = []  # (text start, text, entry)
        self._last: TokenLogprob | None = None  # the EOS / stop token's entry, released last
        self._chars = 0  # detokenized characters so far (client text is a prefix of them)
        self._emitted = 0  # client characters so far

    def push(
        self,
        text: TextStream,
        ids: list[int],
        logprobs: list[TokenLogprob] | None,
        *,
        stop_token: bool,
    ) -> tuple[str, str | None]:
        """``TextStream.push`` for a request with logprobs; keeps each entry's contribution."""
        if not self.aligned:
            sent, hit = text.push(ids, stop_token=stop_token)
            if logprobs:
                self.entries.extend(logprobs if hit is None else logprobs[: text.kept])
            return sent, hit
        if text.stops.done:
            return "", None
        entries = logprobs or ()
        if stop_token and ids and not text.stops.include_stop:
            # The EOS / stop token: no text, an entry (it counts), released at the end.
            if len(entries) >= len(ids):
                self._last = entries[len(ids) - 1]
            ids = ids[:-1]
        out: list[str] = []
        # Past a stop the detokenizer's state no longer matters: all ids go in at once.
        for k, piece in enumerate(text.detok.push_each(ids)):
            if k < len(entries):
                self._pending.append((self._chars, piece, entries[k]))
            self._chars += len(piece)
            sent, hit = text.stops.feed(piece)
            out.append(sent)
            if hit is not None:
                text.kept = k + 1
                self._last = None  # the engine's EOS came after the stop: not counted
                return "".join(out), hit
        return "".join(out), None

    def finish(self, text: TextStream) -> str:
        """``TextStream.finish``; text the detokenizer still held goes to the last token."""
        if text.stops.done:
            return ""
        tail = text.detok.flush()
        if tail and self._pending:
            start, piece, entry = self._pending[-1]
            self._pending[-1] = (start, piece + tail, entry)
        self._chars += len(tail)
        sent, _ = text.stops.feed(tail)
        return sent + text.stops.flush()

    def release(self, new_chars: int, *, done: bool) -> None:
        """The client was sent ``new_chars`` more characters; ``done``: output is complete."""
        if not self.aligned:
            return
        self._emitted = sent = self._emitted + new_chars
        if done:
            # Everything left goes; a stop string's cut clips contributions to the text sent.
            if self._last is not None:
                self._pending.append((self._chars, "", self._last))
                self._last = None
            for start, piece, entry in self._pending:
                if start + len(piece) > sent:
                    piece = piece[: max(0, sent - start)]
                    start = min(start, sent)
                self.offsets.append(start)
                self.texts.append(piece)
                self.entries.append(entry)
            self._pending = []
            return
        take = 0
        for start, piece, _ in self._pending:
            # Fully sent; an empty contribution waits for the text after it (the character
            # its byte is part of goes out with the token completing it).
            if start >= sent or start + len(piece) > sent:
                break
            take += 1
        if take:
            for start, piece, entry in self._pending[:take]:
                self.offsets.append(start)
                self.texts.append(piece)
                self.entries.append(entry)
            del self._pending[:take]

    def unsent(self) -> tuple[list[TokenLogprob], list[int], list[str]]:
        """Released entries (text offsets, contributions) not yet written by a renderer."""
        start, self.sent = self.sent, len(self.entries)
        return self.entries[start:], self.offsets[start:], self.texts[start:]
