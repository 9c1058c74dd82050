"""Decoding TokenSpeed messages: smgd's hot path (:func:`decode_output`), the handshake and the
registration, and for the mock engine the requests as the engine reads them.

A request the engine rejects comes back as a bare ``"abort"``, mapped here to an ABORT finish
with status 400; a request smgd aborts never gets a terminal frame (the caller finishes it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from smgd.errors import WireError
from smgd.wire.common import EngineLoad, Finish, FinishReason, TokenDelta, TokenLogprob
from smgd.wire.tokenspeed.structs import (
    ENGINE_CORE_DEAD,
    REQ_ABORT,
    REQ_ADD,
    AbortRequest,
    BatchTokenIDOutSlim,
    HandshakeInit,
    ReadyMessage,
    Registration,
    TokenizedGenerateReqInput,
)

if TYPE_CHECKING:
    from collections.abc import Container, Sequence


# A rejected request only comes back as a bare "abort": treat it as the client's request being
# refused (4xx), never as an engine failure that would trip retries or circuit breakers.
REJECTED_STATUS = 400


class OutputsBatch(msgspec.Struct, kw_only=True):
    """One decoded output message: deltas plus the piggy-backed load, or the dead sentinel."""

    deltas: list[TokenDelta] = msgspec.field(default_factory=list)
    engine_index: int = 0
    load: EngineLoad | None = None  # None: the frame carried no load snapshot
    engine_dead: bool = False


_DEC_REQ = msgspec.msgpack.Decoder(TokenizedGenerateReqInput)
_DEC_OUT = msgspec.msgpack.Decoder(BatchTokenIDOutSlim)
_DEC_ABORT = msgspec.msgpack.Decoder(list[str])
_DEC_READY = msgspec.msgpack.Decoder(ReadyMessage)
_DEC_INIT = msgspec.msgpack.Decoder(HandshakeInit)
_DEC_REG = msgspec.msgpack.Decoder(Registration)


def decode_as(decoder: msgspec.msgpack.Decoder[Any], frame: Any, what: str) -> Any:
    """``decoder.decode(frame)``; a frame it refuses is a WireError naming ``what``."""
    try:
        return decoder.decode(frame)
    except (msgspec.DecodeError, TypeError) as exc:  # ValidationError is a DecodeError
        raise WireError(f"tokenspeed: bad {what}: {exc}") from None


# --------------------------------------------------------------------------- handshake


def decode_identity(frame: bytes | memoryview) -> int:
    if len(frame) != 2:
        raise WireError(f"tokenspeed: engine identity must be 2 bytes, got {len(frame)}")
    return int.from_bytes(frame, "little")


def split_routed(frames: Sequence[bytes | memoryview]) -> tuple[int, bytes]:
    """A ROUTER receive ``[identity, payload]`` → (engine index, payload)."""
    if len(frames) != 2:
        raise WireError(f"tokenspeed: expected [identity, payload], got {len(frames)} frames")
    return decode_identity(frames[0]), bytes(frames[1])


def decode_handshake(payload: bytes | memoryview) -> ReadyMessage:
    """A HELLO or READY payload (the frame after the identity)."""
    msg: ReadyMessage = decode_as(_DEC_READY, payload, "handshake message")
    if msg.status not in ("HELLO", "READY"):
        raise WireError(f"tokenspeed: unexpected handshake status {msg.status!r}")
    return msg


def decode_hello(payload: bytes | memoryview) -> ReadyMessage:
    msg = decode_handshake(payload)
    if msg.status != "HELLO":
        raise WireError(f"tokenspeed: expected HELLO, got {msg.status!r}")
    return msg


def decode_ready(payload: bytes | memoryview) -> ReadyMessage:
    msg = decode_handshake(payload)
    if msg.status != "READY":
        raise WireError(f"tokenspeed: expected READY, got {msg.status!r}")
    return msg


def decode_init(payload: bytes | memoryview) -> HandshakeInit:
    init: HandshakeInit = decode_as(_DEC_INIT, payload, "INIT")
    return init


def decode_registration(data: bytes | memoryview | Mapping[str, Any]) -> Registration:
    """The registration map (payload bytes, or an already-decoded mapping)."""
    if isinstance(data, Mapping):
        try:
            reg: Registration = msgspec.convert(dict(data), Registration)
        except msgspec.ValidationError as exc:
            raise WireError(f"tokenspeed: bad registration: {exc}") from None
    else:
        if not len(data):
            raise WireError("tokenspeed: empty registration frame")
        reg = decode_as(_DEC_REG, data, "registration")
    if reg.max_model_len <= 0:
        raise WireError(f"tokenspeed: registration has no max_model_len ({reg.max_model_len})")
    return reg


# --------------------------------------------------------------------------- requests (mock side)


def decode_request(
    frames: Sequence[bytes | memoryview],
) -> TokenizedGenerateReqInput | AbortRequest:
    """Mock side: ``[type byte, payload, *aux]`` as the engine's DEALER receives it."""
    if len(frames) < 2:
        raise WireError(f"tokenspeed: a request needs >= 2 frames, got {len(frames)}")
    kind = bytes(frames[0])
    if kind == REQ_ADD:
        msg: TokenizedGenerateReqInput = decode_as(_DEC_REQ, frames[1], "ADD payload")
        return msg
    if kind == REQ_ABORT:
        return AbortRequest(rids=decode_as(_DEC_ABORT, frames[1], "ABORT payload"))
    raise WireError(f"tokenspeed: unknown request type byte {kind.hex()!r}")


# --------------------------------------------------------------------------- outputs


def _finish(raw: str) -> Finish | None:
    if not raw:
        return None
    if raw == "stop":
        return Finish(reason=FinishReason.STOP)
    if raw == "length":
        return Finish(reason=FinishReason.LENGTH)
    if raw == "abort":
        # The engine never answers our own aborts, so an abort here is its refusal (n != 1,
        # verify() failure, logprobs disabled, pause): the message and err_type are not sent.
        return Finish(
            reason=FinishReason.ABORT,
            message="the engine rejected the request (TokenSpeed sends no reason)",
            status_code=REJECTED_STATUS,
        )
    if raw == "error":
        return Finish(reason=FinishReason.ERROR, message="the engine failed the request")
    # A newer engine's reason: it is terminal; report it rather than truncate silently.
    return Finish(reason=FinishReason.STOP, message=f"engine finish reason {raw!r}")


def decode_output(frames: Sequence[Any], *, aborted: Container[str] = ()) -> OutputsBatch:
    """One output message (frame 0; aux frames are ignored) → engine-neutral deltas.

    ``aborted``: rids smgd aborted; late frames for them are dropped. Raises WireError on
    anything that is neither a ``BatchTokenIDOutSlim`` nor the dead sentinel, or on ragged
    columns (never guess which token a logprob belongs to).
    """
    if not frames:
        raise WireError("tokenspeed: empty output message")
    head = memoryview(frames[0])
    if head.nbytes == len(ENGINE_CORE_DEAD) and head == ENGINE_CORE_DEAD:
        return OutputsBatch(engine_dead=True)
    out: BatchTokenIDOutSlim = decode_as(_DEC_OUT, head, "output batch")
    rids = out.rids or []
    n = len(rids)
    columns = (
        out.output_ids, out.finished_reasons, out.prompt_tokens, out.completion_tokens,
        out.cached_tokens, out.output_token_logprobs_val, out.output_token_logprobs_idx,
    )  # fmt: skip
    if any(len(col) != n for col in columns):
        raise WireError(
            f"tokenspeed: ragged output columns {[len(c) for c in columns]} for {n} rids"
        )
    deltas: list[TokenDelta] = []
    for i, rid in enumerate(rids):
        if rid in aborted:
            continue
        vals, idxs = out.output_token_logprobs_val[i], out.output_token_logprobs_idx[i]
        if len(vals) != len(idxs):
            raise WireError(f"tokenspeed: {rid}: {len(vals)} logprobs for {len(idxs)} token ids")
        logprobs = None
        if vals:
            logprobs = [
                TokenLogprob(token_id=t, logprob=float(v)) for t, v in zip(idxs, vals, strict=True)
            ]
        deltas.append(
            TokenDelta(
                rid=rid,
                token_ids=out.output_ids[i],
                logprobs=logprobs,
                finish=_finish(out.finished_reasons[i]),
                prompt_tokens=out.prompt_tokens[i],
                completion_tokens=out.completion_tokens[i],
                cached_tokens=out.cached_tokens[i],
            )
        )
    load = None
    if out.kv_total_pages > 0:  # 0: the engine had no load snapshot yet (or an old sender)
        load = EngineLoad(
            running=out.num_running,
            waiting=out.num_waiting,
            kv_usage=out.kv_active_pages / out.kv_total_pages,
        )
    return OutputsBatch(deltas=deltas, engine_index=out.engine_index, load=load)
