"""Decoding SGLang frames: smgd's hot path (scheduler -> router) and, for the mock engine and
tests, requests and any modeled message.

:func:`decode_output` uses a slim prefix mirror of ``BatchTokenIDOutput`` and a pre-built
decoder; everything it returns is an engine-neutral :mod:`smgd.wire.common` value or a control
reply.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Raw
from msgspec.msgpack import Ext

from smgd.errors import WireError
from smgd.wire.common import Finish, FinishReason, TokenDelta, TokenLogprob, TopLogprob
from smgd.wire.sglang.arrays import exts_to_ids
from smgd.wire.sglang.structs import (
    MODELED,
    SGLANG_TAGS,
    AbortReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    BatchTokenIDOutput,
    BatchTokenizedEmbeddingReqInput,
    BatchTokenizedGenerateReqInput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    HealthCheckOutput,
    OtherMessage,
    PickleWrapper,
    ShutdownReq,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)


class _OutputHead(
    msgspec.Struct, tag="BatchTokenIDOutput", kw_only=True, array_like=True, gc=False
):
    """Hot-path view of BatchTokenIDOutput: the first 22 columns; the rest are skipped.

    Columns smgd never reads are ``Raw``: any value is accepted and none is decoded (a
    256-request frame decodes in ~26 instead of ~40 µs).
    """

    rids: list[str] | None = None
    http_worker_ipcs: Raw = Raw()
    finished_reasons: list[dict[str, Any] | None]
    decoded_texts: Raw
    decode_ids: Raw
    read_offsets: Raw
    output_ids: list[Ext] | None
    skip_special_tokens: Raw
    spaces_between_special_tokens: Raw
    no_stop_trim: Raw
    prompt_tokens: list[int]
    reasoning_tokens: Raw
    completion_tokens: list[int]
    cached_tokens: list[int]
    input_token_logprobs_val: list[list[Any] | None] | None
    input_token_logprobs_idx: list[list[Any] | None] | None
    output_token_logprobs_val: list[list[Any] | None] | None
    output_token_logprobs_idx: list[list[Any] | None] | None
    input_top_logprobs_val: list[list[Any] | None] | None
    input_top_logprobs_idx: list[list[Any] | None] | None
    output_top_logprobs_val: list[list[Any] | None] | None
    output_top_logprobs_idx: list[list[Any] | None] | None


class _EmbedHead(
    msgspec.Struct, tag="BatchEmbeddingOutput", kw_only=True, array_like=True, gc=False
):
    """Hot-path view of BatchEmbeddingOutput: its first 6 columns."""

    rids: list[str] | None = None
    http_worker_ipcs: Raw = Raw()
    finished_reasons: list[dict[str, Any] | None]
    embeddings: list[Any]
    prompt_tokens: list[int]
    cached_tokens: list[int]


Control = HealthCheckOutput | FlushCacheReqOutput | GetInternalStateReqOutput | OtherMessage
Request = (
    TokenizedGenerateReqInput
    | BatchTokenizedGenerateReqInput
    | TokenizedEmbeddingReqInput
    | BatchTokenizedEmbeddingReqInput
    | AbortReq
    | FlushCacheReqInput
    | ShutdownReq
    | GetInternalStateReq
    | OtherMessage
)

_raw_decoder = msgspec.msgpack.Decoder()  # untyped: ext stays Ext, bin stays bytes
_output_decoder = msgspec.msgpack.Decoder(
    _OutputHead
    | _EmbedHead
    | AbortReq
    | HealthCheckOutput
    | FlushCacheReqOutput
    | GetInternalStateReqOutput
)
_request_decoder = msgspec.msgpack.Decoder(
    TokenizedGenerateReqInput
    | BatchTokenizedGenerateReqInput
    | TokenizedEmbeddingReqInput
    | BatchTokenizedEmbeddingReqInput
    | AbortReq
    | FlushCacheReqInput
    | ShutdownReq
    | GetInternalStateReq
)
_any_modeled_decoder = msgspec.msgpack.Decoder(
    TokenizedGenerateReqInput
    | BatchTokenizedGenerateReqInput
    | TokenizedEmbeddingReqInput
    | BatchTokenizedEmbeddingReqInput
    | AbortReq
    | HealthCheckOutput
    | FlushCacheReqInput
    | FlushCacheReqOutput
    | ShutdownReq
    | GetInternalStateReq
    | GetInternalStateReqOutput
    | BatchTokenIDOutput
    | BatchStrOutput
    | BatchEmbeddingOutput
    | PickleWrapper
)


def finish_from_wire(reason: dict[str, Any] | None) -> Finish | None:
    """SGLang's ``BaseFinishReason.to_json()`` dict as a common Finish (None: still running)."""
    if reason is None:
        return None
    kind = reason.get("type")
    if kind == "length":
        return Finish(reason=FinishReason.LENGTH)
    if kind == "stop":
        matched = reason.get("matched")
        return Finish(
            reason=FinishReason.STOP,
            matched_token=matched if type(matched) is int else None,
            matched_text=matched if isinstance(matched, str) else None,
        )
    if kind == "abort":
        status = reason.get("status_code")
        message = reason.get("message")
        return Finish(
            reason=FinishReason.ABORT,
            message=message if isinstance(message, str) else None,
            status_code=status if type(status) is int else None,
        )
    return Finish(reason=FinishReason.ERROR, message=f"unknown SGLang finish reason {reason!r}")


def _row(column: list[Any] | None, i: int, n: int, name: str) -> Any:
    if column is None:
        return None
    if len(column) != n:
        raise WireError(f"BatchTokenIDOutput.{name} has {len(column)} entries for {n} rids")
    return column[i]


def _logprobs(head: _OutputHead, i: int, n: int) -> list[TokenLogprob] | None:
    """Request i's output logprobs; value and index columns are walked together."""
    vals = _row(head.output_token_logprobs_val, i, n, "output_token_logprobs_val")
    idxs = _row(head.output_token_logprobs_idx, i, n, "output_token_logprobs_idx")
    if not vals and not idxs:
        return None
    if vals is None or idxs is None or len(vals) != len(idxs):
        raise WireError(f"ragged output logprob columns for rid {head.rids[i]!r}")  # type: ignore[index]
    top_vals = _row(head.output_top_logprobs_val, i, n, "output_top_logprobs_val")
    top_idxs = _row(head.output_top_logprobs_idx, i, n, "output_top_logprobs_idx")
    has_top = bool(top_vals) or bool(top_idxs)
    if has_top and (
        top_vals is None
        or top_idxs is None
        or len(top_vals) != len(vals)
        or len(top_idxs) != len(vals)
    ):
        raise WireError(f"ragged top-logprob columns for rid {head.rids[i]!r}")  # type: ignore[index]
    out = []
    for k, (value, token_id) in enumerate(zip(vals, idxs, strict=True)):
        if type(token_id) is not int or not isinstance(value, int | float):
            raise WireError(f"logprob entry {k} of rid {head.rids[i]!r} is incomplete")  # type: ignore[index]
        top = None
        if has_top:
            tv, ti = top_vals[k] or [], top_idxs[k] or []
            if len(tv) != len(ti):
                raise WireError(f"ragged top-logprob entry {k} for rid {head.rids[i]!r}")  # type: ignore[index]
            top = [TopLogprob(t, float(v)) for v, t in zip(tv, ti, strict=True)] or None
        out.append(TokenLogprob(token_id=token_id, logprob=float(value), top=top))
    return out


def _prompt_logprobs(head: _OutputHead, i: int, n: int) -> list[TokenLogprob] | None:
    """Request i's prompt logprobs (sent once, with ``logprob_start_len`` 0): SGLang's rows
    start with the first prompt token's ``None``, which is dropped; top-k rows likewise."""
    vals = _row(head.input_token_logprobs_val, i, n, "input_token_logprobs_val")
    idxs = _row(head.input_token_logprobs_idx, i, n, "input_token_logprobs_idx")
    if not vals and not idxs:
        return None
    rid = head.rids[i]  # type: ignore[index]
    if vals is None or idxs is None or len(vals) != len(idxs):
        raise WireError(f"ragged prompt logprob columns for rid {rid!r}")
    top_vals = _row(head.input_top_logprobs_val, i, n, "input_top_logprobs_val") or []
    top_idxs = _row(head.input_top_logprobs_idx, i, n, "input_top_logprobs_idx") or []
    if len(top_vals) != len(top_idxs) or (top_vals and len(top_vals) != len(vals)):
        raise WireError(f"ragged prompt top-logprob columns for rid {rid!r}")
    out = []
    for k, (value, token_id) in enumerate(zip(vals, idxs, strict=True)):
        if value is None and k == 0:
            continue
        if type(token_id) is not int or not isinstance(value, int | float):
            raise WireError(f"prompt logprob entry {k} of rid {rid!r} is incomplete")
        top = None
        if top_vals:
            tv, ti = top_vals[k] or [], top_idxs[k] or []
            if len(tv) != len(ti):
                raise WireError(f"ragged prompt top-logprob entry {k} for rid {rid!r}")
            top = [TopLogprob(t, float(v)) for v, t in zip(tv, ti, strict=True)] or None
        out.append(TokenLogprob(token_id=token_id, logprob=float(value), top=top))
    return out


def _deltas(head: _OutputHead) -> list[TokenDelta]:
    rids = head.rids or []
    n = len(rids)
    outs = head.output_ids
    reasons = head.finished_reasons
    prompt, completion, cached = head.prompt_tokens, head.completion_tokens, head.cached_tokens
    if (outs is not None and len(outs) != n) or len(reasons) != n:
        raise WireError(f"BatchTokenIDOutput columns do not match its {n} rids")
    if len(prompt) != n or len(completion) != n or len(cached) != n:
        raise WireError(f"BatchTokenIDOutput usage columns do not match its {n} rids")
    want_logprobs = head.output_token_logprobs_val is not None or (
        head.output_token_logprobs_idx is not None
    )
    want_prompt = bool(head.input_token_logprobs_val) or bool(head.input_token_logprobs_idx)
    ids = exts_to_ids(outs) if outs is not None else None
    return [
        TokenDelta(
            rid=rid,
            token_ids=ids[i] if ids is not None else [],
            logprobs=_logprobs(head, i, n) if want_logprobs else None,
            prompt_logprobs=_prompt_logprobs(head, i, n) if want_prompt else None,
            # The None test inline: a running request (nearly every row) costs no call.
            finish=None if reasons[i] is None else finish_from_wire(reasons[i]),
            prompt_tokens=prompt[i],
            completion_tokens=completion[i],
            cached_tokens=cached[i],
        )
        for i, rid in enumerate(rids)
    ]


def _vector(row: Any) -> list[float] | None:
    """An embedding row as floats; None when it is not a dense vector (a sparse head's map)."""
    if not isinstance(row, list) or not all(
        isinstance(x, float | int) and not isinstance(x, bool) for x in row
    ):
        return None
    return [float(x) for x in row]


def _embed_deltas(head: _EmbedHead) -> list[TokenDelta]:
    rids = head.rids or []
    n = len(rids)
    columns = (head.finished_reasons, head.embeddings, head.prompt_tokens, head.cached_tokens)
    if any(len(column) != n for column in columns):
        raise WireError(f"BatchEmbeddingOutput columns do not match its {n} rids")
    deltas = []
    for i, rid in enumerate(rids):
        finish = finish_from_wire(head.finished_reasons[i])
        vector = _vector(head.embeddings[i])
        if finish is not None and finish.reason is not FinishReason.ABORT and vector is None:
            finish = Finish(
                reason=FinishReason.ERROR,
                message="the engine returned a sparse embedding, which smgd does not serve",
            )
        deltas.append(
            TokenDelta(
                rid=rid,
                token_ids=[],
                finish=finish,
                prompt_tokens=head.prompt_tokens[i],
                completion_tokens=0,
                cached_tokens=head.cached_tokens[i],
                embedding=vector,
            )
        )
    return deltas


def _abort_delta(msg: AbortReq) -> TokenDelta:
    finish = finish_from_wire(msg.finished_reason)
    if finish is None or finish.reason is not FinishReason.ABORT:
        finish = Finish(reason=FinishReason.ABORT, message=msg.abort_message or "Aborted")
    return TokenDelta(rid=msg.rid or "", token_ids=[], finish=finish)


_OUTPUT_TAGS = frozenset(
    {
        "BatchTokenIDOutput",
        "BatchEmbeddingOutput",
        "AbortReq",
        "HealthCheckOutput",
        "FlushCacheReqOutput",
    }
    | {"GetInternalStateReqOutput"}
)
_REQUEST_TAGS = frozenset(
    {"TokenizedGenerateReqInput", "BatchTokenizedGenerateReqInput", "AbortReq"}
    | {"TokenizedEmbeddingReqInput", "BatchTokenizedEmbeddingReqInput"}
    | {"FlushCacheReqInput", "ShutdownReq", "GetInternalStateReq"}
)


def _other(frame: bytes | memoryview, exc: Exception, typed: frozenset[str]) -> OtherMessage:
    """A frame the typed decoder refused: another SGLang message, or a WireError.

    ``typed`` are the tags the refusing decoder knows: a refusal of one of those is a malformed
    frame; any other SGLang tag is well-formed traffic smgd does not model here.
    """
    try:
        value = _raw_decoder.decode(frame)
    except msgspec.DecodeError as err:
        raise WireError(f"undecodable SGLang frame: {err}") from None
    if isinstance(value, list) and value and isinstance(value[0], str):
        tag = value[0]
        if tag not in SGLANG_TAGS:
            raise WireError(f"unknown SGLang message tag {tag!r}")
        if tag not in typed:
            return OtherMessage(tag, value[1:])
    raise WireError(f"malformed SGLang frame: {exc}")


def decode_output(frame: bytes | memoryview) -> list[TokenDelta] | Control:
    """Decode one scheduler -> router frame.

    ``BatchTokenIDOutput`` becomes one TokenDelta per rid (ids are new ids only, usage is
    cumulative), ``BatchEmbeddingOutput`` one final TokenDelta per rid with its vector; an
    ``AbortReq`` echo (a queued or rejected request) becomes a one-element list with an ABORT
    finish; control replies come back as their typed struct, other well-formed SGLang messages
    as :class:`OtherMessage`. Anything else raises WireError.
    """
    try:
        msg = _output_decoder.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return _other(frame, exc, _OUTPUT_TAGS)
    if type(msg) is _OutputHead:
        return _deltas(msg)
    if type(msg) is _EmbedHead:
        return _embed_deltas(msg)
    if type(msg) is AbortReq:
        return [_abort_delta(msg)]
    control: Control = msg
    return control


def decode_request(frame: bytes | memoryview) -> Request:
    """Decode one router -> scheduler frame (for the mock engine); WireError when malformed."""
    try:
        msg: Request = _request_decoder.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return _other(frame, exc, _REQUEST_TAGS)
    return msg


def decode_any(frame: bytes | memoryview) -> msgspec.Struct | OtherMessage:
    """Decode any SGLang frame into its mirror (or OtherMessage); WireError when malformed."""
    try:
        msg: msgspec.Struct = _any_modeled_decoder.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return _other(frame, exc, frozenset(MODELED))
    return msg
