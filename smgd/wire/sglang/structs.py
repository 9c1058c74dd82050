"""SGLang 0.5.23 TokenizerManager <-> Scheduler wire (msgpack mode), sans-IO.

smgd plays SGLang's TokenizerManager: it PUSHes ``TokenizedGenerateReqInput`` / ``AbortReq`` /
control requests to a headless scheduler (``--skip-tokenizer-init``, ``SGLANG_USE_PICKLE_IPC=0``)
and PULLs ``BatchTokenIDOutput`` / ``AbortReq`` echoes / ``HealthCheckOutput`` back.

Wire rules mirrored here (see shared/wire/sglang.md):

* one ZMQ frame = one msgpack value; structs are *tagged arrays* ``[ClassName, f1, f2, ...]``
  holding every field in declaration order (base-class fields first), defaults never omitted;
* token id arrays are msgpack ext type 1 (``array('q')``: u32 BE meta length, msgpack typecode,
  raw native little-endian int64);
* floats are float64; ``SamplingParams`` and ``SessionParams`` are nested *untagged* arrays,
  ``PickleWrapper`` is a nested tagged ``["PickleWrapper", bin]`` kept as opaque bytes and never
  unpickled (unpickling would run code from the engine's side);
* decoding tolerates omitted trailing defaults and extra trailing fields (SGLang appends fields
  across versions); a missing required field, a wrong type or a tag SGLang does not have is a
  :class:`~smgd.errors.WireError`.

The mirrors below are typed only as tightly as the engine types them, so a decode followed by an
encode reproduces SGLang's own bytes. The hot path (:func:`decode_output`) uses a slim prefix
mirror of ``BatchTokenIDOutput`` and a pre-built decoder. The ``smgd wire`` JSON form lives in
:func:`frames_to_json` / :func:`json_to_frames`.
"""

from __future__ import annotations

import math
import struct
import sys
import uuid
from array import array
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
from msgspec import Raw
from msgspec.msgpack import Ext

from smgd.errors import InvalidRequest, WireError
from smgd.wire.common import (
    Finish,
    FinishReason,
    GenerateRequest,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
)
from smgd.wire.common import SamplingParams as CommonSampling

if TYPE_CHECKING:
    from collections.abc import Sequence

ENGINE_VERSION = "0.5.23"  # the SGLang release these mirrors were checked against
TOP_K_ALL = 1 << 30  # SGLang's "no top-k cut" (sampling_params.TOP_K_ALL)
GREEDY_EPS = 1e-6  # SGLang's _SAMPLING_EPS: temperature below this means greedy
HEALTH_CHECK_PREFIX = "HEALTH_CHECK"  # the scheduler special-cases rids starting with this
EXT_ARRAY = 1  # msgpack ext code SGLang uses for array.array ("stable wire id")
_Q_META = b"\x00\x00\x00\x02\xa1q"  # ext-1 header for typecode "q": u32 BE len 2 + msgpack "q"
_ONE_Q_LEN = len(_Q_META) + 8  # the payload of an array of one int64
_unpack_q = struct.Struct("<q").unpack_from  # SGLang's x86-64 hosts write little-endian
_LITTLE = sys.byteorder == "little"  # SGLang writes raw native (x86-64: little-endian) int64

Number = int | float  # SGLang types these float but writes whatever Python value it was given


# ---------------------------------------------------------------------------------------------
# Mirrors (field order = wire order). Do not reorder; SGLang only appends.


class PickleWrapper(msgspec.Struct, tag=True, array_like=True, gc=False):
    """``["PickleWrapper", bin]``: a pickled Python object. Opaque; never unpickled."""

    data: bytes


class SessionParams(msgspec.Struct, kw_only=True, array_like=True, gc=False):
    id: str | None = None
    rid: str | None = None
    offset: int | None = None
    replace: bool | None = None
    drop_previous_output: bool | None = None


class SamplingParams(msgspec.Struct, kw_only=True, array_like=True, gc=False):
    """SGLang's SamplingParams (33 slots, untagged). smgd always sends it normalized."""

    max_new_tokens: int | None = 128
    stop: Any = None
    stop_token_ids: list[int] | None = None  # a Set[int] in SGLang: any order is accepted
    stop_regex: Any = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: int = TOP_K_ALL
    min_p: Number = 0.0
    frequency_penalty: Number = 0.0
    presence_penalty: Number = 0.0
    repetition_penalty: Number = 1.0
    min_new_tokens: int = 0
    n: int = 1
    beam_width: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None
    logit_bias: dict[str, Number] | None = None
    sampling_seed: int | None = None
    custom_params: Any = None
    watermark: Any = None
    stop_strs: Any = None  # [] once normalized; None makes the scheduler crash
    stop_regex_strs: Any = None  # [] once normalized
    stop_str_max_len: int = 0
    stop_regex_max_len: int = 0
    is_normalized: bool = False  # True: the scheduler does not re-run __post_init__
    ebnf_full_assistant: bool = False


class BaseReq(msgspec.Struct, tag=True, kw_only=True, array_like=True, gc=False):
    rid: str | None = None
    http_worker_ipc: str | None = None


class BaseBatchReq(msgspec.Struct, tag=True, kw_only=True, array_like=True, gc=False):
    rids: list[str] | None = None
    http_worker_ipcs: Any = None


class TokenizedGenerateReqInput(BaseReq, kw_only=True):
    """Router -> scheduler generate request: 49 fields, fields 3-13 required."""

    input_text: Any
    input_ids: Ext | None
    input_embeds: Any
    mm_inputs: Any
    token_type_ids: Any
    sampling_params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: list[int] | None
    stream: bool
    return_sampling_mask: bool = False
    return_flat_raw_top_logprobs: bool = False
    return_hidden_states: bool | str = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_indexer_topk: bool = False
    session_id: str | None = None
    session_params: SessionParams | None = None
    lora_id: str | None = None
    custom_logit_processor: str | None = None
    positional_embed_overrides: Any = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    bootstrap_pair_key: str | None = None
    decode_tp_size: int | None = None
    routed_dp_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    routing_key: str | None = None
    require_reasoning: bool = False
    priority: int | None = None
    extra_key: str | None = None
    no_logs: bool = False
    return_bytes: bool = False
    return_entropy: bool = False
    need_wait_for_mm_inputs: bool | None = None
    num_items_assigned: Any = None
    encoder_urls: list[str] | None = None
    multi_item_delimiter_indices: list[int] | None = None
    token_indices_to_pool: list[int] | None = None
    time_stats: PickleWrapper | None = None
    cache_salt: str | None = None
    kv_hints: Any = None
    pp_prefetch_ticketed: bool = False
    sampling_logprobs_mode: str = "selected"
    lora_name: str | None = None


class BatchTokenizedGenerateReqInput(BaseBatchReq, kw_only=True):
    batch: list[TokenizedGenerateReqInput]


class AbortReq(BaseReq, kw_only=True):
    """Both directions. An empty rid aborts everything; rids match by prefix."""

    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None
    abort_message: str | None = None
    weight_versions: list[Any] | None = None  # [[version, start, end], ...]


class HealthCheckOutput(BaseReq, kw_only=True):
    """Sent instead of running a health-check request when the scheduler is busy.

    The scheduler does not echo the health check's rid here (rid is None): it answers the
    oldest pending check.
    """


class FlushCacheReqInput(BaseReq, kw_only=True):
    timeout_s: Number | None = None


class FlushCacheReqOutput(BaseReq, kw_only=True):
    success: bool
    message: str = ""


class ShutdownReq(BaseReq, kw_only=True):
    """The scheduler leaves its loop and exits 0."""


class GetInternalStateReq(BaseReq, kw_only=True):
    pass


class GetInternalStateReqOutput(BaseReq, kw_only=True):
    internal_state: dict[str, Any]


class BatchTokenIDOutput(BaseBatchReq, kw_only=True):
    """Scheduler -> router outputs: 53 parallel columns, one entry per rid (1-33 required)."""

    finished_reasons: list[dict[str, Any] | None]
    decoded_texts: list[str]
    decode_ids: list[Ext]
    read_offsets: list[int]
    output_ids: list[Ext] | None
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]
    prompt_tokens: list[int]
    reasoning_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    input_token_logprobs_val: Any
    input_token_logprobs_idx: Any
    output_token_logprobs_val: Any
    output_token_logprobs_idx: Any
    input_top_logprobs_val: Any
    input_top_logprobs_idx: Any
    output_top_logprobs_val: Any
    output_top_logprobs_idx: Any
    input_token_ids_logprobs_val: Any
    input_token_ids_logprobs_idx: Any
    output_token_ids_logprobs_val: Any
    output_token_ids_logprobs_idx: Any
    output_token_entropy_val: Any
    output_token_sampling_mask: Any
    output_hidden_states: Any
    routed_experts: Any
    indexer_topk: Any
    placeholder_tokens_idx: Any
    placeholder_tokens_val: Any
    retraction_counts: list[int] | None = None
    beam_search_output: Any = None
    weight_versions: Any = None
    token_steps: Any = None
    customized_info: PickleWrapper | None = None
    cached_tokens_details: Any = None
    dp_ranks: Any = None
    time_stats: PickleWrapper | None = None
    image_tokens: list[int] | None = None
    audio_tokens: list[int] | None = None
    video_tokens: list[int] | None = None
    spec_verify_ct: Any = None
    spec_num_correct_drafts: Any = None
    spec_num_block_accept_tokens: Any = None
    spec_num_cap_tokens: Any = None
    spec_correct_drafts_histogram: Any = None
    spec_cap_lens_histogram: Any = None
    input_top_logprobs_val_flat: Any = None
    input_top_logprobs_idx_flat: Any = None
    input_top_logprobs_flat_null_prefix: Any = None


class BatchStrOutput(BaseBatchReq, kw_only=True):
    """Detokenizer -> TokenizerManager output of SGLang's normal path; smgd never receives it."""

    finished_reasons: list[dict[str, Any] | None]
    output_strs: list[str]
    output_ids: list[Ext] | None
    prompt_tokens: list[int]
    completion_tokens: list[int]
    reasoning_tokens: list[int]
    cached_tokens: list[int]
    input_token_logprobs_val: Any
    input_token_logprobs_idx: Any
    output_token_logprobs_val: Any
    output_token_logprobs_idx: Any
    input_top_logprobs_val: Any
    input_top_logprobs_idx: Any
    output_top_logprobs_val: Any
    output_top_logprobs_idx: Any
    input_token_ids_logprobs_val: Any
    input_token_ids_logprobs_idx: Any
    output_token_ids_logprobs_val: Any
    output_token_ids_logprobs_idx: Any
    output_token_entropy_val: Any
    output_token_sampling_mask: Any
    output_hidden_states: Any
    routed_experts: Any
    indexer_topk: Any
    placeholder_tokens_idx: Any
    placeholder_tokens_val: Any
    retraction_counts: list[int] | None = None
    beam_search_output: Any = None
    weight_versions: Any = None
    token_steps: Any = None
    customized_info: PickleWrapper | None = None
    cached_tokens_details: Any = None
    dp_ranks: Any = None
    time_stats: PickleWrapper | None = None
    image_tokens: list[int] | None = None
    audio_tokens: list[int] | None = None
    video_tokens: list[int] | None = None
    spec_verify_ct: Any = None
    spec_num_correct_drafts: Any = None
    spec_num_block_accept_tokens: Any = None
    spec_num_cap_tokens: Any = None
    spec_correct_drafts_histogram: Any = None
    spec_cap_lens_histogram: Any = None
    input_top_logprobs_val_flat: Any = None
    input_top_logprobs_idx_flat: Any = None
    input_top_logprobs_flat_null_prefix: Any = None


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
    input_token_logprobs_val: Raw
    input_token_logprobs_idx: Raw
    output_token_logprobs_val: list[list[Any] | None] | None
    output_token_logprobs_idx: list[list[Any] | None] | None
    input_top_logprobs_val: Raw
    input_top_logprobs_idx: Raw
    output_top_logprobs_val: list[list[Any] | None] | None
    output_top_logprobs_idx: list[list[Any] | None] | None


class OtherMessage(msgspec.Struct, frozen=True):
    """A well-formed SGLang message smgd does not model: its tag and positional fields."""

    tag: str
    fields: list[Any]


# Every tag in SGLang 0.5.23's msgpack_decode union. A tag outside this set is not SGLang's.
SGLANG_TAGS = frozenset(
    """TokenizedGenerateReqInput TokenizedEmbeddingReqInput ClearHiCacheReqInput
    ClearHiCacheReqOutput FlushCacheReqInput FlushCacheReqOutput AddExternalCorpusReqInput
    AddExternalCorpusReqOutput RemoveExternalCorpusReqInput RemoveExternalCorpusReqOutput
    ListExternalCorporaReqInput ListExternalCorporaReqOutput AttachHiCacheStorageReqInput
    AttachHiCacheStorageReqOutput DetachHiCacheStorageReqInput DetachHiCacheStorageReqOutput
    PauseGenerationReqInput ContinueGenerationReqInput TokenizerWorkerRegistrationReq
    PauseContinueBroadcastReq UpdateWeightFromDiskReqInput UpdateWeightFromDiskReqOutput
    UpdateWeightsFromDistributedReqInput UpdateWeightsFromDistributedReqOutput
    UpdateWeightsFromTensorReqInput UpdateWeightsFromTensorReqOutput
    InitWeightsSendGroupForRemoteInstanceReqInput UpdateWeightsFromIPCReqInput
    UpdateWeightsFromIPCReqOutput InitWeightsSendGroupForRemoteInstanceReqOutput
    SendWeightsToRemoteInstanceReqInput SendWeightsToRemoteInstanceReqOutput
    UpdateExpertBackupReq BackupDramReq InitWeightsUpdateGroupReqInput
    InitWeightsUpdateGroupReqOutput DestroyWeightsUpdateGroupReqInput
    DestroyWeightsUpdateGroupReqOutput UpdateWeightVersionReqInput UpdateWeightVersionReqOutput
    GetWeightsByNameReqInput GetWeightsByNameReqOutput ReleaseMemoryOccupationReqInput
    ReleaseMemoryOccupationReqOutput ResumeMemoryOccupationReqInput
    ResumeMemoryOccupationReqOutput BeginWeightUpdateReqInput BeginWeightUpdateReqOutput
    EndWeightUpdateReqInput EndWeightUpdateReqOutput CheckWeightsReqInput CheckWeightsReqOutput
    SlowDownReqInput SlowDownReqOutput PdRoleSwitchReqInput PdRoleSwitchReqOutput AbortReq
    EncoderDispatchErrorReq ActiveRanksOutput ElasticScaleUpdateReq ScaleElasticEPReqInput
    ScaleElasticEPReqOutput GetInternalStateReq GetInternalStateReqOutput SetInternalStateReq
    SetInternalStateReqOutput GetHiCacheL3LayoutReq GetHiCacheL3LayoutReqOutput ProfileReq
    ProfileReqOutput FreezeGCReq ShutdownReq ConfigureLoggingReq OpenSessionReqInput
    CloseSessionReqInput OpenSessionReqOutput HealthCheckOutput ExpertDistributionReq
    ExpertDistributionReqOutput ParseFunctionCallReq SeparateReasoningReqInput
    VertexGenerateReqInput RpcReqInput RpcReqOutput LoadLoRAAdapterReqInput
    UnloadLoRAAdapterReqInput LoadLoRAAdapterFromTensorsReqInput LoRAUpdateOutput BlockReqInput
    SetInjectDumpMetadataReqOutput LazyDumpTensorsReqInput LazyDumpTensorsReqOutput
    DumperControlReqInput DumperControlReqOutput BeamSearchOutput BatchTokenizedGenerateReqInput
    BatchTokenizedEmbeddingReqInput BatchTokenIDOutput BatchStrOutput BatchEmbeddingOutput
    PickleWrapper""".split()  # noqa: SIM905 (a word list reads better than 105 quoted names)
)

# Top-level messages modeled by name (used by decode_request / the JSON form).
MODELED: dict[str, type[msgspec.Struct]] = {
    cls.__name__: cls
    for cls in (
        TokenizedGenerateReqInput,
        BatchTokenizedGenerateReqInput,
        AbortReq,
        HealthCheckOutput,
        FlushCacheReqInput,
        FlushCacheReqOutput,
        ShutdownReq,
        GetInternalStateReq,
        GetInternalStateReqOutput,
        BatchTokenIDOutput,
        BatchStrOutput,
        PickleWrapper,
    )
}

Control = HealthCheckOutput | FlushCacheReqOutput | GetInternalStateReqOutput | OtherMessage
Request = (
    TokenizedGenerateReqInput
    | BatchTokenizedGenerateReqInput
    | AbortReq
    | FlushCacheReqInput
    | ShutdownReq
    | GetInternalStateReq
    | OtherMessage
)

_encoder = msgspec.msgpack.Encoder()
_raw_decoder = msgspec.msgpack.Decoder()  # untyped: ext stays Ext, bin stays bytes
_output_decoder = msgspec.msgpack.Decoder(
    _OutputHead | AbortReq | HealthCheckOutput | FlushCacheReqOutput | GetInternalStateReqOutput
)
_request_decoder = msgspec.msgpack.Decoder(
    TokenizedGenerateReqInput
    | BatchTokenizedGenerateReqInput
    | AbortReq
    | FlushCacheReqInput
    | ShutdownReq
    | GetInternalStateReq
)
_any_modeled_decoder = msgspec.msgpack.Decoder(
    TokenizedGenerateReqInput
    | BatchTokenizedGenerateReqInput
    | AbortReq
    | HealthCheckOutput
    | FlushCacheReqInput
    | FlushCacheReqOutput
    | ShutdownReq
    | GetInternalStateReq
    | GetInternalStateReqOutput
    | BatchTokenIDOutput
    | BatchStrOutput
    | PickleWrapper
)


# ---------------------------------------------------------------------------------------------
# Token arrays (ext type 1)


def ids_to_ext(ids: Sequence[int]) -> Ext:
    """Token ids as SGLang's ``array('q')`` ext (what TokenizerManager sends as input_ids)."""
    arr = array("q", ids)
    if not _LITTLE:
        arr.byteswap()
    return Ext(EXT_ARRAY, _Q_META + arr.tobytes())


def ext_to_ids(ext: Any) -> list[int]:
    """Decode an ext-1 ``array.array`` payload to a list of ints (any integer typecode)."""
    if type(ext) is not Ext or ext.code != EXT_ARRAY:
        raise WireError(f"expected an int64 array (msgpack ext 1), got {type(ext).__name__}")
    raw = ext.data
    if type(raw) is bytes and len(raw) == _ONE_Q_LEN and raw.startswith(_Q_META):
        # One int64, a decode step's usual output: half the time of the general path.
        return [_unpack_q(raw, len(_Q_META))[0]]
    data = memoryview(raw)
    try:
        if _LITTLE and data[:6] == _Q_META:
            result: list[int] = data[6:].cast("q").tolist()
            return result
        meta_len = int.from_bytes(data[:4], "big")
        typecode = msgspec.msgpack.decode(data[4 : 4 + meta_len])
        if not isinstance(typecode, str) or typecode not in "bBhHiIlLqQ":
            raise WireError(f"array ext with non-integer typecode {typecode!r}")
        arr = array(typecode)
        arr.frombytes(data[4 + meta_len :])
    except (TypeError, ValueError, msgspec.DecodeError) as exc:
        raise WireError(f"malformed array ext: {exc}") from None
    if not _LITTLE:
        arr.byteswap()
    return arr.tolist()


# ---------------------------------------------------------------------------------------------
# Router -> scheduler


def _verify(sp: SamplingParams) -> None:
    """SGLang's SamplingParams.verify() checks: the scheduler does not run them, and a bad value
    can crash it, so smgd refuses them before sending."""

    def bad(param: str, message: str) -> InvalidRequest:
        return InvalidRequest(f"{param} {message}", param=param)

    if not math.isfinite(sp.temperature) or sp.temperature < 0:
        raise bad("temperature", "must be a non-negative finite number")
    if not 0.0 < sp.top_p <= 1.0:
        raise bad("top_p", "must be in (0, 1]")
    if not 0.0 <= sp.min_p <= 1.0:
        raise bad("min_p", "must be in [0, 1]")
    if sp.top_k < 1:
        raise bad("top_k", "must be -1 or at least 1")
    if not -2.0 <= sp.frequency_penalty <= 2.0:
        raise bad("frequency_penalty", "must be in [-2, 2]")
    if not -2.0 <= sp.presence_penalty <= 2.0:
        raise bad("presence_penalty", "must be in [-2, 2]")
    if not 0.0 < sp.repetition_penalty <= 2.0:
        raise bad("repetition_penalty", "must be in (0, 2]")
    if sp.max_new_tokens is not None and sp.max_new_tokens < 0:
        raise bad("max_tokens", "must be non-negative")
    if sp.sampling_seed is not None and not -(1 << 63) <= sp.sampling_seed < (1 << 63):
        raise bad("seed", "must fit in a signed 64-bit integer")


def to_sglang_sampling(s: CommonSampling) -> SamplingParams:
    """Normalize engine-neutral sampling params the way SGLang's TokenizerManager would.

    Greedy becomes temperature 1 + top_k 1, top_k -1 becomes 1<<30, stop strings/regexes are
    empty lists (smgd matches stop strings itself), ``is_normalized`` is True. EOS ids are not
    sent: SGLang reads them from the model config. ``min_tokens`` and ``ignore_eos`` together
    with stop token ids cannot be expressed on this wire and are refused.
    """
    if s.min_tokens > 0:
        # SGLang's min-new-tokens penalizer reads the tokenizer's EOS, which a
        # --skip-tokenizer-init scheduler does not have: it would crash.
        raise InvalidRequest(
            "min_tokens is not supported by the SGLang backend", param="min_tokens"
        )
    if s.ignore_eos and s.stop_token_ids:
        # SGLang's ignore_eos also disables stop_token_ids (_check_token_based_finish).
        raise InvalidRequest(
            "ignore_eos together with stop_token_ids is not supported by the SGLang backend",
            param="stop_token_ids",
        )
    temperature, top_k = float(s.temperature), s.top_k
    if 0.0 <= temperature < GREEDY_EPS:
        temperature, top_k = 1.0, 1
    if top_k == -1:
        top_k = TOP_K_ALL
    # A set built in the same order as SGLang's __post_init__ ({int(t) for t in ids}) iterates
    # in the same order, so the bytes match what TokenizerManager would send.
    stop_ids = list({int(t) for t in s.stop_token_ids}) or None
    sp = SamplingParams(
        max_new_tokens=s.max_tokens,
        stop_token_ids=stop_ids,
        temperature=temperature,
        top_p=float(s.top_p),
        top_k=top_k,
        min_p=float(s.min_p),
        frequency_penalty=float(s.frequency_penalty),
        presence_penalty=float(s.presence_penalty),
        repetition_penalty=float(s.repetition_penalty),
        ignore_eos=s.ignore_eos,
        logit_bias=({str(k): float(v) for k, v in s.logit_bias.items()} if s.logit_bias else None),
        sampling_seed=s.seed,
        stop_strs=[],
        stop_regex_strs=[],
        is_normalized=True,
    )
    _verify(sp)
    return sp


def _tgri(
    rid: str, ids: Sequence[int], sp: SamplingParams, stream: bool, logprobs: int | None
) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(
        rid=rid,
        input_text=None,
        input_ids=ids_to_ext(ids),
        input_embeds=None,
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=sp,
        return_logprob=logprobs is not None,
        logprob_start_len=-1,  # GenerateReqInput's default: no prompt logprobs
        top_logprobs_num=logprobs or 0,
        token_ids_logprob=None,
        stream=stream,
    )


def encode_generate(req: GenerateRequest) -> bytes:
    """A ``TokenizedGenerateReqInput`` frame for one request (raises InvalidRequest)."""
    if not req.rid:
        raise ValueError("a generate request needs a non-empty rid")
    sp = to_sglang_sampling(req.sampling)
    return _encoder.encode(_tgri(req.rid, req.prompt_ids, sp, req.stream, req.sampling.logprobs))


def new_health_check_rid() -> str:
    """A fresh rid the scheduler recognizes as a health check (as /health_generate makes)."""
    return f"{HEALTH_CHECK_PREFIX}_{uuid.uuid4().hex}"


def encode_health_check(rid: str) -> bytes:
    """SGLang's /health_generate request: prompt [0], one greedy token, not streamed.

    ``rid`` must start with ``HEALTH_CHECK``: only then does a busy scheduler answer with a
    ``HealthCheckOutput`` instead of queueing it.
    """
    if not rid.startswith(HEALTH_CHECK_PREFIX):
        raise ValueError(f"health-check rid must start with {HEALTH_CHECK_PREFIX!r}")
    sp = SamplingParams(
        max_new_tokens=1,
        temperature=1.0,
        top_k=1,  # temperature 0 after SGLang's greedy rewrite
        stop_strs=[],
        stop_regex_strs=[],
        is_normalized=True,
    )
    return _encoder.encode(_tgri(rid, [0], sp, False, None))


def encode_abort(rid: str) -> bytes:
    """``AbortReq(rid)``. The scheduler aborts every request whose rid *starts with* ``rid``."""
    if not rid:
        raise ValueError("refusing an empty abort rid: SGLang would abort every request")
    return _encoder.encode(AbortReq(rid=rid))


def encode_flush_cache() -> bytes:
    return _encoder.encode(FlushCacheReqInput())


def encode_shutdown() -> bytes:
    return _encoder.encode(ShutdownReq())


def encode_get_internal_state() -> bytes:
    return _encoder.encode(GetInternalStateReq())


# ---------------------------------------------------------------------------------------------
# Scheduler -> router


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


def finish_to_wire(finish: Finish | None, completion_tokens: int) -> dict[str, Any] | None:
    """The inverse, as SGLang's scheduler writes it (used by the mock engine)."""
    if finish is None:
        return None
    if finish.reason is FinishReason.LENGTH:
        return {"type": "length", "length": completion_tokens}
    if finish.reason is FinishReason.STOP:
        matched = finish.matched_token if finish.matched_token is not None else finish.matched_text
        return {"type": "stop", "matched": matched}
    status = finish.status_code
    if finish.reason is FinishReason.ERROR and status is None:
        status = 500
    return {
        "type": "abort",
        "message": finish.message or "Aborted",
        "status_code": status,
        "err_type": None,
    }


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
    return [
        TokenDelta(
            rid=rid,
            token_ids=ext_to_ids(outs[i]) if outs is not None else [],
            logprobs=_logprobs(head, i, n) if want_logprobs else None,
            finish=finish_from_wire(reasons[i]),
            prompt_tokens=prompt[i],
            completion_tokens=completion[i],
            cached_tokens=cached[i],
        )
        for i, rid in enumerate(rids)
    ]


def _abort_delta(msg: AbortReq) -> TokenDelta:
    finish = finish_from_wire(msg.finished_reason)
    if finish is None or finish.reason is not FinishReason.ABORT:
        finish = Finish(reason=FinishReason.ABORT, message=msg.abort_message or "Aborted")
    return TokenDelta(rid=msg.rid or "", token_ids=[], finish=finish)


_OUTPUT_TAGS = frozenset(
    {"BatchTokenIDOutput", "AbortReq", "HealthCheckOutput", "FlushCacheReqOutput"}
    | {"GetInternalStateReqOutput"}
)
_REQUEST_TAGS = frozenset(
    {"TokenizedGenerateReqInput", "BatchTokenizedGenerateReqInput", "AbortReq"}
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
    cumulative); an ``AbortReq`` echo (a queued or rejected request) becomes a one-element list
    with an ABORT finish; control replies come back as their typed struct, other well-formed
    SGLang messages as :class:`OtherMessage`. Anything else raises WireError.
    """
    try:
        msg = _output_decoder.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return _other(frame, exc, _OUTPUT_TAGS)
    if type(msg) is _OutputHead:
        return _deltas(msg)
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


def encode_message(msg: msgspec.Struct) -> bytes:
    """Encode any mirror struct exactly as SGLang's ``msgpack_encode`` would."""
    return _encoder.encode(msg)


# ---------------------------------------------------------------------------------------------
# Scheduler side, for the mock engine


class OutputItem(NamedTuple):
    """One request's slice of a BatchTokenIDOutput (plain 6-tuples work too)."""

    rid: str
    token_ids: Sequence[int]  # new ids since the previous frame for this rid
    finish: Finish | None
    prompt_tokens: int
    completion_tokens: int  # cumulative
    cached_tokens: int
    logprobs: Sequence[TokenLogprob] | None = None


def _logprob_columns(items: Sequence[OutputItem]) -> tuple[Any, Any, Any, Any]:
    if all(len(it) < 7 or not it[6] for it in items):
        return None, None, None, None
    vals, idxs, top_vals, top_idxs = [], [], [], []
    for it in items:
        lps = list(it[6] or ()) if len(it) > 6 else []
        vals.append([lp.logprob for lp in lps])
        idxs.append([lp.token_id for lp in lps])
        top_vals.append([[t.logprob for t in lp.top or ()] for lp in lps])
        top_idxs.append([[t.token_id for t in lp.top or ()] for lp in lps])
    return vals, idxs, top_vals, top_idxs


def build_batch_output(items: Sequence[OutputItem | tuple[Any, ...]]) -> BatchTokenIDOutput:
    """A BatchTokenIDOutput shaped like the one SGLang's scheduler sends in skip-tokenizer mode.

    ``time_stats`` (a pickled SGLang object on the real wire) is sent as nil: the mock has no
    SGLang classes to pickle and smgd never reads it.
    """
    its = [OutputItem(*it) for it in items]
    n = len(its)
    ids = [ids_to_ext(it.token_ids) for it in its]
    vals, idxs, top_vals, top_idxs = _logprob_columns(its)
    empty: list[list[Any]] | None = None if vals is None else [[] for _ in its]
    finished = any(it.finish is not None for it in its)
    return BatchTokenIDOutput(
        rids=[it.rid for it in its],
        http_worker_ipcs=[None] * n,
        finished_reasons=[finish_to_wire(it.finish, it.completion_tokens) for it in its],
        decoded_texts=[""] * n,
        decode_ids=ids,
        read_offsets=[0] * n,
        output_ids=ids,
        skip_special_tokens=[True] * n,
        spaces_between_special_tokens=[True] * n,
        no_stop_trim=[False] * n,
        prompt_tokens=[it.prompt_tokens for it in its],
        reasoning_tokens=[0] * n,
        completion_tokens=[it.completion_tokens for it in its],
        cached_tokens=[it.cached_tokens for it in its],
        input_token_logprobs_val=empty,
        input_token_logprobs_idx=empty,
        output_token_logprobs_val=vals,
        output_token_logprobs_idx=idxs,
        input_top_logprobs_val=empty,
        input_top_logprobs_idx=empty,
        output_top_logprobs_val=top_vals,
        output_top_logprobs_idx=top_idxs,
        input_token_ids_logprobs_val=empty,
        input_token_ids_logprobs_idx=empty,
        output_token_ids_logprobs_val=empty,
        output_token_ids_logprobs_idx=empty,
        output_token_entropy_val=None,
        output_token_sampling_mask=None,
        output_hidden_states=None,
        routed_experts=None,
        indexer_topk=None,
        placeholder_tokens_idx=None,
        placeholder_tokens_val=None,
        retraction_counts=[0] * n,
        weight_versions=(
            [[["default", 0, it.completion_tokens]] if it.finish else None for it in its]
            if finished
            else None
        ),
        cached_tokens_details=[None] * n,
        dp_ranks=[None] * n,
        image_tokens=[0] * n,
        audio_tokens=[0] * n,
        video_tokens=[0] * n,
        spec_verify_ct=[],
        spec_num_correct_drafts=[],
        spec_num_block_accept_tokens=[],
        spec_num_cap_tokens=[],
        spec_correct_drafts_histogram=[],
        spec_cap_lens_histogram=[],
    )


def encode_batch_output(items: Sequence[OutputItem | tuple[Any, ...]]) -> bytes:
    """A BatchTokenIDOutput frame from (rid, new ids, finish, prompt, completion, cached) rows."""
    return _encoder.encode(build_batch_output(items))


def encode_abort_echo(rid: str, finish: Finish | None = None) -> bytes:
    """The AbortReq a scheduler sends back for a queued or rejected request."""
    return _encoder.encode(
        AbortReq(
            rid=rid,
            finished_reason=finish_to_wire(finish, 0),
            weight_versions=[["default", 0, 0]],
        )
    )


def encode_health_output(rid: str | None = None) -> bytes:
    """The HealthCheckOutput a busy scheduler sends instead of running a health check.

    SGLang's scheduler leaves ``rid`` empty (it answers the oldest pending health check), so a
    faithful mock passes no rid.
    """
    return _encoder.encode(HealthCheckOutput(rid=rid))


def encode_flush_output(success: bool = True, message: str = "") -> bytes:
    return _encoder.encode(FlushCacheReqOutput(success=success, message=message))


def frames_to_json(frames: list[bytes]) -> dict[str, Any]:
    """One message as JSON (see :mod:`smgd.wire.sglang_json`)."""
    from smgd.wire.sglang_json import frames_to_json as convert

    return convert(frames)


def json_to_frames(obj: dict[str, Any]) -> list[bytes]:
    """The frame of a message given in its JSON form (see :mod:`smgd.wire.sglang_json`)."""
    from smgd.wire.sglang_json import json_to_frames as convert

    return convert(obj)
