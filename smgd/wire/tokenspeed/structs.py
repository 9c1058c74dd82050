"""TokenSpeed 0.1.1 direct-ZMQ wire codec (sans-IO): the headless scheduler's router side.

Topology (the router binds everything, the engine dials in): a **tcp** handshake ROUTER (the engine
only ever dials ``tcp://{--data-parallel-address}:{--data-parallel-rpc-port}``), an input ROUTER
and an output PULL, which may be ``ipc://``. Engine identities are 2-byte little-endian engine
indices. Handshake: HELLO → INIT (our data-plane addresses) → READY on the handshake socket, then
one registration map (``WireEngineCoreReadyResponse``) on the input socket; the engine is ready
once both READY and the registration arrived. Handshake messages are msgpack **maps**.

Data plane (msgspec ``array_like`` structs; a tagged struct's element 0 is its class name):

* request ``[type byte, payload]``: ADD ``0x00`` + ``TokenizedGenerateReqInput`` (the shortest
  valid prefix has 6 elements, 0.1.1 writes 25), ABORT ``0x01`` + ``list[str]`` of rids;
* output, one frame per engine step: ``BatchTokenIDOutSlim`` columns (token *deltas*, finish
  ``""|stop|length|abort``, cumulative usage, sampled-token logprobs, then ``engine_index`` and
  the load tail ``num_running, num_waiting, kv_active_pages, kv_total_pages``), or the raw frame
  ``ENGINE_CORE_DEAD``.

Engine behaviour the caller must know: a request smgd aborts never gets a terminal frame (finish
it locally); a payload the engine cannot decode is dropped silently (so validate before sending:
:func:`encode_add` does); a request the engine rejects comes back as a bare ``"abort"``, mapped
here to an ABORT finish with status 400. Field orders mirror ``tokenspeed/runtime/engine/
io_struct.py``, ``zmq_wire.py`` and ``sampling/sampling_params.py`` of the 0.1.1 wheel; decoding
tolerates missing trailing defaults and extra trailing fields (newer engines append).

The JSON form (:func:`frames_to_json` / :func:`json_to_frames`) names every field and re-encodes
byte-identically; it works on the generic msgpack value so short prefixes, extra trailing
elements and ints in float slots survive a round trip.
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from smgd.errors import InvalidRequest, WireError
from smgd.wire.common import (
    EngineInfo,
    EngineLoad,
    Finish,
    FinishReason,
    GenerateRequest,
    TokenDelta,
    TokenLogprob,
)

REQ_ADD = b"\x00"
REQ_ABORT = b"\x01"
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
TAG_REQUEST = "TokenizedGenerateReqInput"
TAG_OUTPUT = "BatchTokenIDOutSlim"
# TokenSpeed's "top_k disabled" value (sampling_params._TOP_K_DISABLED); -1 on the API side.
TOP_K_DISABLED = 1 << 30
# The fused top-k/top-p kernel sorts at most 128 candidates; verify() rejects top_k >= 128.
TOP_K_MAX = 127
# TokenSpeed's greedy threshold (sampling_params._SAMPLING_EPS): below it, temperature 0 means
# greedy, spelled temperature 1.0 + top_k 1 + seed 0.
GREEDY_EPS = 1e-6
# Greedy requests get this pinned seed, like TokenSpeed's own __post_init__: tie-breaking then
# does not depend on the rid (SMG leaves it unset; see wire/tokenspeed.md §3.10 item 4).
GREEDY_SEED = 0
# A rejected request only comes back as a bare "abort": treat it as the client's request being
# refused (4xx), never as an engine failure that would trip retries or circuit breakers.
REJECTED_STATUS = 400

Num = int | float  # msgspec keeps an int in a float slot as an int (byte-identical re-encode)


# --------------------------------------------------------------------------- wire structs


class SamplingParams(msgspec.Struct, kw_only=True, array_like=True):
    """TokenSpeed's untagged 29-slot ``SamplingParams`` (field order is the contract)."""

    max_new_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # a Python set on the engine side
    temperature: Num = 1.0
    top_p: Num = 1.0
    top_k: int = -1
    min_p: Num = 0.0
    frequency_penalty: Num = 0.0
    presence_penalty: Num = 0.0
    repetition_penalty: Num = 1.0
    min_new_tokens: int = 0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    thinking_budget: int | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, Num] | None = None
    seed: int | None = None
    logprobs: int | None = None
    n: int = 1
    stop_strs: str | list[str] | None = None
    stop_str_max_len: int = 0
    is_normalized: bool = False


class SessionParams(msgspec.Struct, kw_only=True, array_like=True):
    id: str | None = None
    rid: str | None = None
    offset: int | None = None
    replace: bool | None = None


class TokenizedGenerateReqInput(
    msgspec.Struct, tag=TAG_REQUEST, tag_field="_tag", kw_only=True, array_like=True
):
    """The ADD payload. ``sampling_params`` is required, so 6 elements is the shortest prefix."""

    rid: str | list[str] | None = None
    http_worker_ipc: str | None = None
    input_text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    stream: bool = False
    input_embeds: list[Any] | None = None
    session_params: SessionParams | None = None
    custom_logit_processor: str | None = None
    return_hidden_states: bool = False
    created_time: Num = 0.0
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    input_multi_ids: list[list[int]] | None = None
    input_extra_infos: list[dict[str, Any]] | None = None
    input_ids_unpadded: list[int] | None = None
    multimodal_inputs: Any = None  # opaque here (tensors as ext 3 / aux frames); never sent
    validation_error: str | None = None
    data_parallel_rank: int | None = None  # appended after 0.1.0


class BatchTokenIDOutSlim(
    msgspec.Struct, tag=TAG_OUTPUT, tag_field="_tag", kw_only=True, array_like=True
):
    """One engine step's output; every column is parallel to ``rids``."""

    rids: list[str] | None = None
    output_ids: list[list[int]]
    finished_reasons: list[str]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    output_token_logprobs_val: list[list[Num]]
    output_token_logprobs_idx: list[list[int]]
    engine_index: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_active_pages: int = 0
    kv_total_pages: int = 0


class AbortRequest(msgspec.Struct, frozen=True):
    """A decoded ABORT message (mock side)."""

    rids: list[str]


class ReadyMessage(msgspec.Struct, kw_only=True):
    """HELLO / READY (``WireReadyMessage``): a map, every key present on encode."""

    status: str | None = None
    local: bool | None = None
    headless: bool | None = None
    parallel_config_hash: str | None = None


class HandshakeAddresses(msgspec.Struct, kw_only=True):
    inputs: list[str] = msgspec.field(default_factory=list)
    outputs: list[str] = msgspec.field(default_factory=list)
    coordinator_input: str | None = None
    coordinator_output: str | None = None
    frontend_stats_publish_address: str | None = None


class HandshakeInit(msgspec.Struct, kw_only=True):
    addresses: HandshakeAddresses
    parallel_config: dict[str, Any] = msgspec.field(default_factory=dict)


class ReadyResponse(msgspec.Struct, kw_only=True):
    """``WireEngineCoreReadyResponse`` exactly as TokenSpeed 0.1.1 writes it (19 keys)."""

    max_model_len: int = 0
    num_gpu_blocks: int = 0
    prefix_granularity: int = 0
    dp_stats_address: str | None = None
    dtype: str = "bfloat16"
    multimodal_encoder_dtype: str | None = None
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
    kv_cache_size_tokens: int | None = None
    kv_cache_max_concurrency: Num | None = None
    kv_events_config: dict[str, Any] | None = None


class Registration(msgspec.Struct, kw_only=True):
    """The registration map as smgd reads it: every key optional, unknown keys ignored.

    TokenSpeed renamed ``block_size`` to ``prefix_granularity`` (#1057); both are accepted.
    """

    max_model_len: int = 0
    num_gpu_blocks: int | None = None
    prefix_granularity: int | None = None
    block_size: int | None = None
    dtype: str | None = None
    vllm_version: str | None = None
    world_size: int | None = None
    data_parallel_size: int | None = None
    tensor_parallel_size: int | None = None
    data_parallel_rank: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None  # older senders: -1 = no chunked-prefill cap
    instance_id: str | None = None
    kv_cache_size_tokens: int | None = None

    @property
    def granularity(self) -> int | None:
        return self.prefix_granularity if self.prefix_granularity is not None else self.block_size

    def engine_info(self) -> EngineInfo:
        return EngineInfo(
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs or None,
            kv_cache_tokens=self.kv_cache_size_tokens,
            version=self.vllm_version,
        )


class OutputsBatch(msgspec.Struct, kw_only=True):
    """One decoded output message: deltas plus the piggy-backed load, or the dead sentinel."""

    deltas: list[TokenDelta] = msgspec.field(default_factory=list)
    engine_index: int = 0
    load: EngineLoad | None = None  # None: the frame carried no load snapshot
    engine_dead: bool = False


class OutputRow(msgspec.Struct, kw_only=True):
    """One request's column entries in a ``BatchTokenIDOutSlim`` (mock side)."""

    rid: str
    output_ids: list[int]
    finished_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprob_vals: list[float] = msgspec.field(default_factory=list)
    logprob_ids: list[int] = msgspec.field(default_factory=list)


_ENC = msgspec.msgpack.Encoder()
_DEC_REQ = msgspec.msgpack.Decoder(TokenizedGenerateReqInput)
_DEC_OUT = msgspec.msgpack.Decoder(BatchTokenIDOutSlim)
_DEC_ABORT = msgspec.msgpack.Decoder(list[str])
_DEC_READY = msgspec.msgpack.Decoder(ReadyMessage)
_DEC_INIT = msgspec.msgpack.Decoder(HandshakeInit)
_DEC_REG = msgspec.msgpack.Decoder(Registration)
_DEC_SAMPLING = msgspec.msgpack.Decoder(SamplingParams)
_DEC_ANY = msgspec.msgpack.Decoder()


def _decode(decoder: msgspec.msgpack.Decoder[Any], frame: Any, what: str) -> Any:
    try:
        return decoder.decode(frame)
    except (msgspec.DecodeError, TypeError) as exc:  # ValidationError is a DecodeError
        raise WireError(f"tokenspeed: bad {what}: {exc}") from None


# --------------------------------------------------------------------------- handshake


def encode_identity(engine_index: int) -> bytes:
    """The engine's ZMQ identity: its index as 2 bytes, little-endian."""
    if not 0 <= engine_index <= 0xFFFF:
        raise ValueError(f"engine index {engine_index} does not fit 2 bytes")
    return engine_index.to_bytes(2, "little")


def decode_identity(frame: bytes | memoryview) -> int:
    if len(frame) != 2:
        raise WireError(f"tokenspeed: engine identity must be 2 bytes, got {len(frame)}")
    return int.from_bytes(frame, "little")


def split_routed(frames: Sequence[bytes | memoryview]) -> tuple[int, bytes]:
    """A ROUTER receive ``[identity, payload]`` → (engine index, payload)."""
    if len(frames) != 2:
        raise WireError(f"tokenspeed: expected [identity, payload], got {len(frames)} frames")
    return decode_identity(frames[0]), bytes(frames[1])


def encode_hello(*, local: bool = True, headless: bool = True) -> bytes:
    return _ENC.encode(ReadyMessage(status="HELLO", local=local, headless=headless))


def encode_ready(*, local: bool = True, headless: bool = True) -> bytes:
    return _ENC.encode(ReadyMessage(status="READY", local=local, headless=headless))


def decode_handshake(payload: bytes | memoryview) -> ReadyMessage:
    """A HELLO or READY payload (the frame after the identity)."""
    msg: ReadyMessage = _decode(_DEC_READY, payload, "handshake message")
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


def encode_init(inputs: Sequence[str], outputs: Sequence[str]) -> list[bytes]:
    """INIT, the reply to HELLO (prefix the engine's identity on the ROUTER).

    TokenSpeed dials ``inputs[0]`` and ``outputs[0]``; it raises if either is missing.
    """
    if not inputs or not outputs:
        raise ValueError("INIT needs at least one input and one output address")
    init = HandshakeInit(addresses=HandshakeAddresses(inputs=list(inputs), outputs=list(outputs)))
    return [_ENC.encode(init)]


def decode_init(payload: bytes | memoryview) -> HandshakeInit:
    init: HandshakeInit = _decode(_DEC_INIT, payload, "INIT")
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
        reg = _decode(_DEC_REG, data, "registration")
    if reg.max_model_len <= 0:
        raise WireError(f"tokenspeed: registration has no max_model_len ({reg.max_model_len})")
    return reg


def encode_registration(response: ReadyResponse) -> bytes:
    """Mock side: the registration frame the engine sends on its input DEALER."""
    return _ENC.encode(response)


# --------------------------------------------------------------------------- requests


def _check_sampling(req: GenerateRequest, max_model_len: int | None) -> None:
    """The engine's ``verify()`` and logprob gates, raised as 400s before sending.

    A request the engine rejects only comes back as a bare "abort", so say why up front.
    """
    s = req.sampling
    checks: list[tuple[bool, str, str]] = [
        (s.temperature >= 0.0, "temperature", f"must be non-negative, got {s.temperature}"),
        (0.0 < s.top_p <= 1.0, "top_p", f"must be in (0, 1], got {s.top_p}"),
        (0.0 <= s.min_p <= 1.0, "min_p", f"must be in [0, 1], got {s.min_p}"),
        (s.top_k <= TOP_K_MAX, "top_k", f"must be at most {TOP_K_MAX} or -1, got {s.top_k}"),
        (abs(s.frequency_penalty) <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
        (abs(s.presence_penalty) <= 2.0, "presence_penalty", "must be in [-2, 2]"),
        (0.0 <= s.repetition_penalty <= 2.0, "repetition_penalty", "must be in [0, 2]"),
        (s.max_tokens >= 0, "max_tokens", f"must be at least 0, got {s.max_tokens}"),
        (0 <= s.min_tokens <= s.max_tokens, "min_tokens", "must be in [0, max_tokens]"),
        (s.logprobs in (None, 0), "top_logprobs", "TokenSpeed returns only sampled-token logprobs"),
        (all(k >= 0 for k in s.logit_bias or ()), "logit_bias", "token ids must be >= 0"),
    ]
    if max_model_len is not None:
        limit = max_model_len - 1
        ok = len(req.prompt_ids) <= limit
        checks.append((ok, "prompt", f"{len(req.prompt_ids)} tokens exceed the limit of {limit}"))
    for ok, param, why in checks:
        if not ok:
            raise InvalidRequest(f"{param} {why}", param=param)


def to_wire_sampling(req: GenerateRequest) -> SamplingParams:
    """Common sampling → TokenSpeed's form, normalized the way its own ``__post_init__`` does.

    Greedy (temperature < 1e-6) becomes temperature 1.0 + top_k 1 + seed 0; top_k -1 (or 0)
    becomes the 1<<30 sentinel; no stop ids becomes nil. ``is_normalized`` stays false so the
    engine still derives ``stop_strs`` and the rid-based seed itself. Stop strings and EOS ids
    are never sent: smgd matches stop strings itself and TokenSpeed knows its own EOS.
    """
    s = req.sampling
    temperature, top_k, seed = float(s.temperature), s.top_k, s.seed
    if s.greedy:
        temperature, top_k = 1.0, 1
    if top_k == 1:
        seed = GREEDY_SEED
    if top_k <= 0:
        top_k = TOP_K_DISABLED
    stop_ids = list(set(s.stop_token_ids)) if s.stop_token_ids else None  # set order, as Python
    bias = {str(k): float(v) for k, v in s.logit_bias.items()} if s.logit_bias else None
    return SamplingParams(
        max_new_tokens=s.max_tokens,
        stop_token_ids=stop_ids,
        temperature=temperature,
        top_p=float(s.top_p),
        top_k=top_k,
        min_p=float(s.min_p),
        frequency_penalty=float(s.frequency_penalty),
        presence_penalty=float(s.presence_penalty),
        repetition_penalty=float(s.repetition_penalty),
        min_new_tokens=s.min_tokens,
        ignore_eos=s.ignore_eos,
        logit_bias=bias,
        seed=seed,
    )


def to_wire_request(req: GenerateRequest) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(
        rid=req.rid,
        input_ids=list(req.prompt_ids),
        sampling_params=to_wire_sampling(req),
        return_logprob=req.sampling.logprobs is not None,
        stream=req.stream,
    )


def encode_add(req: GenerateRequest, *, max_model_len: int | None = None) -> list[bytes]:
    """``[0x00, payload]`` for one request, in TokenSpeed 0.1.1's full 25-element form.

    Raises :class:`InvalidRequest` for what the engine would reject (it would answer with a
    bare abort, or for a prompt longer than ``max_model_len - 1`` silently truncate output).
    """
    _check_sampling(req, max_model_len)
    return [REQ_ADD, _ENC.encode(to_wire_request(req))]


def encode_request(msg: TokenizedGenerateReqInput) -> list[bytes]:
    """``[0x00, payload]`` for an already-built wire struct."""
    return [REQ_ADD, _ENC.encode(msg)]


def encode_abort(rids: Iterable[str]) -> list[bytes]:
    """``[0x01, msgpack list[str]]``. The engine never answers it; finish the stream locally."""
    rid_list = list(rids)
    if not rid_list or not all(rid_list):
        raise ValueError("abort needs at least one non-empty rid")
    return [REQ_ABORT, _ENC.encode(rid_list)]


def decode_request(
    frames: Sequence[bytes | memoryview],
) -> TokenizedGenerateReqInput | AbortRequest:
    """Mock side: ``[type byte, payload, *aux]`` as the engine's DEALER receives it."""
    if len(frames) < 2:
        raise WireError(f"tokenspeed: a request needs >= 2 frames, got {len(frames)}")
    kind = bytes(frames[0])
    if kind == REQ_ADD:
        msg: TokenizedGenerateReqInput = _decode(_DEC_REQ, frames[1], "ADD payload")
        return msg
    if kind == REQ_ABORT:
        return AbortRequest(rids=_decode(_DEC_ABORT, frames[1], "ABORT payload"))
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
    out: BatchTokenIDOutSlim = _decode(_DEC_OUT, head, "output batch")
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


def finish_to_wire(finish: Finish | None) -> str:
    """Mock side: a common Finish → TokenSpeed's finish string (errors travel as aborts)."""
    if finish is None:
        return ""
    return {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(finish.reason, "abort")


def encode_output(
    rows: Sequence[OutputRow],
    *,
    engine_index: int = 0,
    num_running: int = 0,
    num_waiting: int = 0,
    kv_active_pages: int = 0,
    kv_total_pages: int = 0,
) -> list[bytes]:
    """Mock side: one ``BatchTokenIDOutSlim`` frame, laid out as TokenSpeed's ``from_full``."""
    batch = BatchTokenIDOutSlim(
        rids=[r.rid for r in rows],
        output_ids=[list(r.output_ids) for r in rows],
        finished_reasons=[r.finished_reason for r in rows],
        prompt_tokens=[r.prompt_tokens for r in rows],
        completion_tokens=[r.completion_tokens for r in rows],
        cached_tokens=[r.cached_tokens for r in rows],
        output_token_logprobs_val=[list(r.logprob_vals) for r in rows],
        output_token_logprobs_idx=[list(r.logprob_ids) for r in rows],
        engine_index=engine_index,
        num_running=num_running,
        num_waiting=num_waiting,
        kv_active_pages=kv_active_pages,
        kv_total_pages=kv_total_pages,
    )
    return [_ENC.encode(batch)]


def encode_engine_dead() -> list[bytes]:
    return [ENGINE_CORE_DEAD]


# --------------------------------------------------------------------------- JSON form

_RESERVED = ("type", "request_type", "identity", "aux")
_REQUEST_TYPES = {REQ_ADD: "ADD", REQ_ABORT: "ABORT"}
_TAGGED: dict[str, type[msgspec.Struct]] = {
    TAG_REQUEST: TokenizedGenerateReqInput,
    TAG_OUTPUT: BatchTokenIDOutSlim,
}
_NESTED: dict[tuple[str, str], type[msgspec.Struct]] = {
    (TAG_REQUEST, "sampling_params"): SamplingParams,
    (TAG_REQUEST, "session_params"): SessionParams,
}
_MAP_TYPES = (
    ("WireReadyMessage", "status", _DEC_READY),
    ("WireHandshakeInitMessage", "addresses", _DEC_INIT),
    ("WireEngineCoreReadyResponse", "max_model_len", _DEC_REG),
)


def _to_json_value(v: Any) -> Any:
    """A generic msgpack value → JSON-safe, reversibly (bytes, ext, odd keys, non-finite)."""
    if isinstance(v, bool | int | str) or v is None:
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"$float": repr(v)}
    if isinstance(v, list | tuple):
        return [_to_json_value(x) for x in v]
    if isinstance(v, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in v):
            return {k: _to_json_value(x) for k, x in v.items()}
        return {"$map": [[_to_json_value(k), _to_json_value(x)] for k, x in v.items()]}
    if isinstance(v, bytes | bytearray | memoryview):
        return {"$bytes": bytes(v).hex()}
    if isinstance(v, msgspec.msgpack.Ext):
        return {"$ext": v.code, "hex": bytes(v.data).hex()}
    raise WireError(f"tokenspeed: cannot represent {type(v).__name__} in JSON")


def _from_json_value(v: Any) -> Any:
    if isinstance(v, list):
        return [_from_json_value(x) for x in v]
    if isinstance(v, dict):
        if "$float" in v:
            return float(v["$float"])
        if "$map" in v:
            return {_from_json_value(k): _from_json_value(x) for k, x in v["$map"]}
        if "$bytes" in v:
            return bytes.fromhex(v["$bytes"])
        if "$ext" in v:
            return msgspec.msgpack.Ext(int(v["$ext"]), bytes.fromhex(v["hex"]))
        return {k: _from_json_value(x) for k, x in v.items()}
    return v


def _named(cls: type[msgspec.Struct], values: list[Any], owner: str) -> dict[str, Any]:
    """Positional values → {field: value} for the elements present (+ ``_extra`` beyond)."""
    names = cls.__struct_fields__
    out: dict[str, Any] = {}
    for name, value in zip(names, values, strict=False):
        nested = _NESTED.get((owner, name))
        if nested is not None and isinstance(value, list):
            out[name] = _named(nested, value, nested.__name__)
        else:
            out[name] = _to_json_value(value)
    if len(values) > len(names):
        out["_extra"] = _to_json_value(values[len(names) :])
    return out


def _default(cls: type[msgspec.Struct], name: str) -> Any:
    for field in msgspec.structs.fields(cls):
        if field.name == name:
            if field.default is not msgspec.NODEFAULT:
                return msgspec.to_builtins(field.default)
            if field.default_factory is not msgspec.NODEFAULT:
                return msgspec.to_builtins(field.default_factory())
    raise WireError(f"tokenspeed: {cls.__name__}.{name} is required")


def _positional(cls: type[msgspec.Struct], obj: Mapping[str, Any], owner: str) -> list[Any]:
    """{field: value} → positional values up to the last field given (gaps get defaults)."""
    names = cls.__struct_fields__
    unknown = set(obj) - set(names) - {"_extra", *_RESERVED}
    if unknown:
        raise WireError(f"tokenspeed: unknown {cls.__name__} fields {sorted(unknown)}")
    present = [i for i, name in enumerate(names) if name in obj]
    values: list[Any] = []
    for name in names[: present[-1] + 1 if present else 0]:
        if name not in obj:
            values.append(_default(cls, name))
            continue
        value, nested = obj[name], _NESTED.get((owner, name))
        if nested is not None and isinstance(value, dict):
            values.append(_positional(nested, value, nested.__name__))
        else:
            values.append(_from_json_value(value))
    if "_extra" in obj:
        values.extend(_from_json_value(obj["_extra"]))
    return values


def _payload_to_json(payload: bytes) -> dict[str, Any]:
    """One msgpack payload frame → {"type": ..., fields...}."""
    value = _decode(_DEC_ANY, payload, "frame")
    if isinstance(value, list):
        head = value[0] if value else None
        if isinstance(head, str) and head in _TAGGED:
            cls = _TAGGED[head]
            _decode(msgspec.msgpack.Decoder(cls), payload, head)  # validate the types
            return {"type": head, **_named(cls, value[1:], head)}
        if all(isinstance(x, str) for x in value):
            return {"type": "AbortPayload", "rids": value}
        if isinstance(head, str):
            raise WireError(f"tokenspeed: unknown struct tag {head!r}")
        _decode(_DEC_SAMPLING, payload, "SamplingParams")
        return {"type": "SamplingParams", **_named(SamplingParams, value, "SamplingParams")}
    if isinstance(value, dict):
        for name, key, decoder in _MAP_TYPES:
            if key in value:
                _decode(decoder, payload, name)
                fields = _to_json_value(value)
                if set(fields) & set(_RESERVED):
                    raise WireError(f"tokenspeed: {name} uses a reserved JSON key")
                return {"type": name, **fields}
    raise WireError(f"tokenspeed: unrecognised frame ({type(value).__name__})")


def _frame_to_json(frame: bytes) -> dict[str, Any]:
    if len(frame) == 1:
        return {"type": "RequestTypeFrame", "request_type": _REQUEST_TYPES.get(frame, frame[0])}
    if frame == ENGINE_CORE_DEAD:
        return {"type": "EngineCoreDeadSentinel"}
    if len(frame) == 2:
        return {"type": "EngineIdentity", "engine_index": decode_identity(frame)}
    return _payload_to_json(frame)


def frames_to_json(frames: Sequence[bytes | memoryview]) -> dict[str, Any]:
    """One message (its frames; a leading 2-byte ROUTER identity is allowed) → readable JSON.

    A lone frame is classified by shape: request-type byte, engine identity, dead sentinel,
    tagged struct, abort rid list, bare SamplingParams, or a handshake map.
    """
    parts = [bytes(f) for f in frames]
    if not parts:
        raise WireError("tokenspeed: no frames")
    if len(parts) == 1:
        return _frame_to_json(parts[0])
    out: dict[str, Any] = {}
    if len(parts[0]) == 2:
        out["identity"] = decode_identity(parts[0])
        parts = parts[1:]
    if len(parts) >= 2 and len(parts[0]) == 1:
        kind = _REQUEST_TYPES.get(parts[0])
        if kind is None:
            raise WireError(f"tokenspeed: unknown request type byte {parts[0].hex()!r}")
        body = _payload_to_json(parts[1])
        expected = "AbortPayload" if kind == "ABORT" else TAG_REQUEST
        if body["type"] != expected:
            raise WireError(f"tokenspeed: {kind} carries a {body['type']}")
        out = {"type": expected, "request_type": kind, **out, **body}
        aux = parts[2:]
    else:
        out = {**_frame_to_json(parts[0]), **out}
        aux = parts[1:]
    if aux:
        out["aux"] = [a.hex() for a in aux]
    return out


def _payload_from_json(kind: str, obj: Mapping[str, Any]) -> bytes:
    if kind in _TAGGED:
        cls = _TAGGED[kind]
        payload = _ENC.encode([kind, *_positional(cls, obj, kind)])
        _decode(msgspec.msgpack.Decoder(cls), payload, kind)
        return payload
    if kind == "SamplingParams":
        payload = _ENC.encode(_positional(SamplingParams, obj, kind))
        _decode(_DEC_SAMPLING, payload, kind)
        return payload
    if kind == "AbortPayload":
        return _ENC.encode(_decode_abort_json(obj))
    for name, _key, decoder in _MAP_TYPES:
        if kind == name:
            fields = {k: v for k, v in obj.items() if k not in _RESERVED}
            payload = _ENC.encode(_from_json_value(fields))
            _decode(decoder, payload, name)
            return payload
    raise WireError(f"tokenspeed: unknown message type {kind!r}")


def _decode_abort_json(obj: Mapping[str, Any]) -> list[str]:
    rids = obj.get("rids")
    if not isinstance(rids, list) or not all(isinstance(r, str) for r in rids):
        raise WireError("tokenspeed: AbortPayload needs rids: [str, ...]")
    return rids


def _type_byte(code: Any) -> bytes:
    for byte, name in _REQUEST_TYPES.items():
        if code == name:
            return byte
    if isinstance(code, int) and 0 <= code <= 0xFF:
        return bytes([code])
    raise WireError(f"tokenspeed: unknown request_type {code!r}")


def json_to_frames(obj: Mapping[str, Any]) -> list[bytes]:
    """The inverse of :func:`frames_to_json`, byte-identical on anything it produced."""
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise WireError("tokenspeed: JSON message needs a string 'type'")
    frames: list[bytes] = []
    try:
        if "identity" in obj:
            frames.append(encode_identity(int(obj["identity"])))
        if kind == "RequestTypeFrame":
            return [*frames, _type_byte(obj.get("request_type"))]
        if kind == "EngineIdentity":
            return [*frames, encode_identity(int(obj["engine_index"]))]
        if kind == "EngineCoreDeadSentinel":
            frames.append(ENGINE_CORE_DEAD)
        else:
            if "request_type" in obj:
                frames.append(_type_byte(obj["request_type"]))
            frames.append(_payload_from_json(kind, obj))
        frames.extend(bytes.fromhex(a) for a in obj.get("aux", ()))
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"tokenspeed: bad {kind} JSON: {exc}") from None
    return frames
