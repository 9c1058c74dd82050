"""Decoding vLLM messages: smgd's hot path (:func:`decode_outputs`) and handshake, and for the
mock engine and tests the engine's view of requests and the exact output mirror.

The hot path decodes with a pre-built decoder into lean structs whose uninteresting fields stay
``msgspec.Raw`` and translates to :mod:`smgd.wire.common` values. Version skew rule (vLLM only
appends fields): decoders ignore extra trailing array elements and unknown map keys and default
missing trailing ones. vLLM 0.33 appends ``error`` to ``EngineCoreOutput``; the hot path reads
it, the mirror stays at 0.32's 18 fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import msgspec

from smgd.errors import WireError
from smgd.wire.common import (
    EngineLoad,
    Finish,
    FinishReason,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
)
from smgd.wire.vllm.structs import (
    ENGINE_CORE_DEAD,
    AbortRequest,
    AddRequest,
    EngineCoreOutputs,
    EngineCoreRequest,
    Frame,
    HandshakeMetadata,
    HandshakeStatus,
    Hello,
    InputMessage,
    Ready,
    ReadyResponse,
    RequestType,
    StartDpWave,
    Tensor,
    UtilityOutput,
    UtilityRequest,
    VllmFinishReason,
)
from smgd.wire.vllm.tensors import tensor_values

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence


def _decode(decoder: msgspec.msgpack.Decoder[Any], buf: Frame, what: str) -> Any:
    try:
        return decoder.decode(buf)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"vllm: cannot decode {what}: {exc}") from exc


# --------------------------------------------------------------------------------------------
# Handshake
# --------------------------------------------------------------------------------------------

_STATUS_DECODER: Final = msgspec.msgpack.Decoder(HandshakeStatus)
_INIT_DECODER: Final = msgspec.msgpack.Decoder(HandshakeMetadata)
_READY_RESPONSE_DECODER: Final = msgspec.msgpack.Decoder(ReadyResponse)


def _one_frame(frames: Sequence[Frame], what: str) -> Frame:
    if len(frames) != 1:
        raise WireError(f"vllm: {what} must be one frame, got {len(frames)}")
    return frames[0]


def decode_handshake(frames: Sequence[Frame]) -> Hello | Ready:
    """HELLO or READY from the engine's handshake DEALER (identity frame excluded)."""
    msg = _decode(_STATUS_DECODER, _one_frame(frames, "handshake message"), "handshake message")
    if msg.status == "HELLO":
        return Hello(msg.status, msg.local, msg.headless, msg.parallel_config_hash)
    if msg.status == "READY":
        return Ready(msg.status, msg.local, msg.headless, msg.parallel_config_hash)
    raise WireError(f"vllm: unexpected handshake status {msg.status!r}")


def decode_init(frames: Sequence[Frame]) -> HandshakeMetadata:
    return _decode(_INIT_DECODER, _one_frame(frames, "init message"), "init message")  # type: ignore[no-any-return]


def decode_ready_response(frames: Sequence[Frame]) -> ReadyResponse:
    """EngineCoreReadyResponse: max_model_len, max_num_seqs, kv_cache_size_tokens, ..."""
    frame = _one_frame(frames, "ready response")
    return _decode(_READY_RESPONSE_DECODER, frame, "ready response")  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------
# Input socket, as the engine reads it (mock engine, tests)
# --------------------------------------------------------------------------------------------

_REQUEST_DECODER: Final = msgspec.msgpack.Decoder(EngineCoreRequest)
_ABORT_DECODER: Final = msgspec.msgpack.Decoder(list[str])
_UTILITY_DECODER: Final = msgspec.msgpack.Decoder(UtilityRequest)
_WAVE_DECODER: Final = msgspec.msgpack.Decoder(StartDpWave)


def decode_request(frames: Sequence[Frame]) -> InputMessage:
    """An input-socket message as the engine sees it (for the mock engine and tests)."""
    if len(frames) < 2:
        raise WireError(f"vllm: request needs a type frame and a body, got {len(frames)} frames")
    kind, body = bytes(frames[0]), frames[1]
    if kind == RequestType.ADD.value:
        req = _decode(_REQUEST_DECODER, body, "EngineCoreRequest")
        return AddRequest(req, [bytes(f) for f in frames[2:]])
    if kind == RequestType.ABORT.value:
        return AbortRequest(_decode(_ABORT_DECODER, body, "abort"))
    if kind == RequestType.UTILITY.value:
        return _decode(_UTILITY_DECODER, body, "utility request")  # type: ignore[no-any-return]
    if kind == RequestType.START_DP_WAVE.value:
        return _decode(_WAVE_DECODER, body, "start-wave request")  # type: ignore[no-any-return]
    raise WireError(f"vllm: unknown request type byte {kind.hex()!r}")


# --------------------------------------------------------------------------------------------
# Output socket: exact mirror (mock engine, tests)
# --------------------------------------------------------------------------------------------

_OUTPUTS_DECODER: Final = msgspec.msgpack.Decoder(EngineCoreOutputs)


def is_engine_dead(frames: Sequence[Frame]) -> bool:
    return len(frames) == 1 and frames[0] == ENGINE_CORE_DEAD


def decode_engine_outputs(frames: Sequence[Frame]) -> EngineCoreOutputs:
    """The whole EngineCoreOutputs struct (arrays keep their aux indexes into ``frames``)."""
    if not frames:
        raise WireError("vllm: empty output message")
    if is_engine_dead(frames):
        raise WireError("vllm: ENGINE_CORE_DEAD is not an EngineCoreOutputs message")
    return _decode(_OUTPUTS_DECODER, frames[0], "EngineCoreOutputs")  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------
# Output socket: hot path
# --------------------------------------------------------------------------------------------

_NIL: Final = msgspec.Raw(b"\xc0")


class _HotLogprobs(msgspec.Struct, array_like=True, gc=False):
    logprob_token_ids: Tensor
    logprobs: Tensor
    ranks: Tensor


class _HotPrefill(msgspec.Struct, gc=False):
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


class _HotError(msgspec.Struct, gc=False):
    code: str = ""
    message: str = ""
    retryable: bool = False


class _HotEvent(msgspec.Struct, gc=False):
    type: int  # EngineCoreEventType
    timestamp: float  # the engine's time.monotonic()


# EngineCoreEventType values.
_QUEUED, _SCHEDULED = 1, 2


def _queue_time(events: list[_HotEvent]) -> float | None:
    """The wait in the engine's queue, first QUEUED to first SCHEDULED event (vLLM's own
    ``queued_time``); None when the events hold only one of them."""
    queued = scheduled = None
    for ev in events:
        if ev.type == _QUEUED and queued is None:
            queued = ev.timestamp
        elif ev.type == _SCHEDULED and scheduled is None:
            scheduled = ev.timestamp
    if queued is None or scheduled is None:
        return None
    return max(scheduled - queued, 0.0)


class _HotOutput(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: _HotLogprobs | None = None
    new_prompt_logprobs_tensors: _HotLogprobs | None = None
    pooling_output: Tensor | None = None
    finish_reason: int | None = None
    stop_reason: int | str | None = None
    events: list[_HotEvent] | None = None  # with log_stats; in a request's first output
    kv_transfer_params: msgspec.Raw = _NIL
    ec_transfer_params: msgspec.Raw = _NIL
    trace_headers: msgspec.Raw = _NIL
    prefill_stats: _HotPrefill | None = None
    routed_experts: msgspec.Raw = _NIL
    num_nans_in_logits: int = 0
    mm_cache_miss_hashes: msgspec.Raw = _NIL
    new_sampling_mask: msgspec.Raw = _NIL
    spec_decode_metrics: msgspec.Raw = _NIL
    prompt_token_id_logprobs: msgspec.Raw = _NIL
    error: _HotError | None = None  # vLLM >= 0.33


class _HotStats(msgspec.Struct, gc=False):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    # Requests per LoRA adapter name in the scheduler's queues (empty without LoRA).
    waiting_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)
    running_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)


class _HotOutputs(msgspec.Struct, array_like=True, gc=False):
    engine_index: int = 0
    outputs: list[_HotOutput] = msgspec.field(default_factory=list)
    scheduler_stats: _HotStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: list[str] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None


_HOT_DECODER: Final = msgspec.msgpack.Decoder(_HotOutputs)


class UtilityReply(msgspec.Struct, frozen=True, kw_only=True):
    call_id: int
    ok: bool
    result: Any = None
    failure_message: str | None = None


class OutputsBatch(msgspec.Struct, kw_only=True):
    """One output-socket message translated to engine-neutral values.

    ``deltas`` carry no ``completion_tokens``: the wire sends new ids only, the caller counts.
    ``prompt_logprobs`` maps a request id to its prompt rows (first output only).
    ``queue_times`` maps a request id to the seconds it waited in the engine's queue, from
    the QUEUED and SCHEDULED events of its first output (only when the engine logs stats).
    """

    engine_index: int = 0
    deltas: list[TokenDelta] = msgspec.field(default_factory=list)
    utility: UtilityReply | None = None
    load: EngineLoad | None = None
    finished_requests: list[str] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None
    timestamp: float = 0.0
    engine_dead: bool = False
    prompt_logprobs: dict[str, list[TokenLogprob]] | None = None
    queue_times: dict[str, float] | None = None
    # With scheduler stats: the adapters with requests running / waiting in the engine.
    lora_running: list[str] | None = None
    lora_waiting: list[str] | None = None


def _logprob_rows(
    lp: _HotLogprobs, frames: Sequence[Frame], k: int | None, *, ranks: bool = False
) -> list[TokenLogprob]:
    """Rows of a LogprobsTensors; ``ranks``: with each row's token rank (prompt rows)."""
    if len(lp.logprob_token_ids.shape) != 2 or lp.logprob_token_ids.shape != lp.logprobs.shape:
        raise WireError("vllm: logprob token ids and values must be 2-D of the same shape")
    ids = tensor_values(lp.logprob_token_ids, frames)
    vals = tensor_values(lp.logprobs, frames)
    if len(ids) != len(vals) or any(len(a) != len(b) for a, b in zip(ids, vals, strict=False)):
        raise WireError("vllm: logprob token ids and values have different shapes")
    rank_of: list[Any] = [None] * len(ids)
    if ranks:
        rank_of = tensor_values(lp.ranks, frames)
        if len(rank_of) != len(ids):
            raise WireError("vllm: prompt logprob ranks do not match its rows")
    rows: list[TokenLogprob] = []
    for id_row, val_row, rank in zip(ids, vals, rank_of, strict=True):
        # Column 0 is the sampled (or prompt) token; 1..K are the batch-wide top-K, so slice
        # to the request's own K.
        n = len(id_row) - 1 if k is None else min(k, len(id_row) - 1)
        top = [TopLogprob(id_row[j], val_row[j]) for j in range(1, n + 1)] if n > 0 else None
        rows.append(TokenLogprob(token_id=id_row[0], logprob=val_row[0], top=top, rank=rank))
    return rows


def _vector(t: Tensor, frames: Sequence[Frame]) -> list[float]:
    """A pooled output (one vector for the ``embed`` task) as floats."""
    if len(t.shape) != 1:
        raise WireError(f"vllm: pooling output of shape {t.shape} is not one vector")
    return [float(x) for x in tensor_values(t, frames)]


def _finish(out: _HotOutput) -> Finish:
    reason = out.finish_reason
    stop = out.stop_reason
    if reason == VllmFinishReason.STOP:
        # stop_reason: the matched stop token id; None for EOS.
        if isinstance(stop, str):
            return Finish(reason=FinishReason.STOP, matched_text=stop)
        return Finish(reason=FinishReason.STOP, matched_token=stop)
    if reason == VllmFinishReason.LENGTH:
        return Finish(reason=FinishReason.LENGTH)
    if reason == VllmFinishReason.ABORT:
        return Finish(reason=FinishReason.ABORT)
    if reason == VllmFinishReason.REPETITION:
        # OpenAI has no "repetition": report a stop (what a client can act on) and keep the
        # engine's reason in the message.
        return Finish(reason=FinishReason.STOP, message=str(stop or "repetition_detected"))
    if reason == VllmFinishReason.ERROR:
        msg = out.error.message if out.error is not None and out.error.message else None
        return Finish(
            reason=FinishReason.ERROR,
            message=msg or "engine finished the request with an error",
            status_code=500,
        )
    return Finish(reason=FinishReason.ERROR, message=f"unknown vLLM finish reason {reason}")


def decode_outputs(
    frames: Sequence[Frame], *, logprobs_k: Mapping[str, int | None] | None = None
) -> OutputsBatch:
    """Decode one output-socket message (hot path).

    ``logprobs_k`` maps request ids to the number of top logprobs each asked for; vLLM sends
    the batch-wide maximum. Requests not in it keep every column.
    """
    if not frames:
        raise WireError("vllm: empty output message")
    if len(frames) == 1 and frames[0] == ENGINE_CORE_DEAD:
        return OutputsBatch(engine_dead=True)
    msg: _HotOutputs = _decode(_HOT_DECODER, frames[0], "EngineCoreOutputs")
    deltas: list[TokenDelta] = []
    prompt_lp: dict[str, list[TokenLogprob]] | None = None
    queue_times: dict[str, float] | None = None
    for out in msg.outputs:
        rid = out.request_id
        delta = TokenDelta(rid=rid, token_ids=out.new_token_ids)
        if out.finish_reason is not None:
            delta.finish = _finish(out)
        if out.prefill_stats is not None:
            delta.prompt_tokens = out.prefill_stats.num_prompt_tokens
            delta.cached_tokens = out.prefill_stats.num_cached_tokens
        if out.pooling_output is not None:
            delta.embedding = _vector(out.pooling_output, frames)
            delta.completion_tokens = 0
        if out.new_logprobs is not None:
            k = logprobs_k.get(rid) if logprobs_k is not None else None
            delta.logprobs = _logprob_rows(out.new_logprobs, frames, k)
        if out.new_prompt_logprobs_tensors is not None:
            if prompt_lp is None:
                prompt_lp = {}
            rows = _logprob_rows(out.new_prompt_logprobs_tensors, frames, None, ranks=True)
            prompt_lp[rid] = delta.prompt_logprobs = rows
        if out.events is not None and (waited := _queue_time(out.events)) is not None:
            if queue_times is None:
                queue_times = {}
            queue_times[rid] = waited
        deltas.append(delta)
    utility = None
    if (u := msg.utility_output) is not None:
        value = u.result.value if u.result is not None else None
        utility = UtilityReply(
            call_id=u.call_id,
            ok=u.failure_message is None,
            result=value,
            failure_message=u.failure_message,
        )
    load = lora_running = lora_waiting = None
    if (st := msg.scheduler_stats) is not None:
        load = EngineLoad(
            running=st.num_running_reqs, waiting=st.num_waiting_reqs, kv_usage=st.kv_cache_usage
        )
        lora_running = [name for name, n in st.running_lora_adapters.items() if n]
        lora_waiting = [name for name, n in st.waiting_lora_adapters.items() if n]
    return OutputsBatch(
        engine_index=msg.engine_index,
        deltas=deltas,
        utility=utility,
        load=load,
        finished_requests=msg.finished_requests,
        wave_complete=msg.wave_complete,
        start_wave=msg.start_wave,
        timestamp=msg.timestamp,
        prompt_logprobs=prompt_lp,
        queue_times=queue_times,
        lora_running=lora_running,
        lora_waiting=lora_waiting,
    )
