"""Mirrors of SGLang 0.5.23's scheduler messages (msgpack mode): field order is wire order.

Wire rules mirrored here (see shared/wire/sglang.md):

* one ZMQ frame = one msgpack value; structs are *tagged arrays* ``[ClassName, f1, f2, ...]``
  holding every field in declaration order (base-class fields first), defaults never omitted;
* token id arrays are msgpack ext type 1 (``array('q')``: u32 BE meta length, msgpack typecode,
  raw native little-endian int64; see :mod:`smgd.wire.sglang.arrays`);
* floats are float64; ``SamplingParams`` and ``SessionParams`` are nested *untagged* arrays,
  ``PickleWrapper`` is a nested tagged ``["PickleWrapper", bin]`` kept as opaque bytes and never
  unpickled (unpickling would run code from the engine's side);
* decoding tolerates omitted trailing defaults and extra trailing fields (SGLang appends fields
  across versions); a missing required field, a wrong type or a tag SGLang does not have is a
  :class:`~smgd.errors.WireError`.

The mirrors are typed only as tightly as the engine types them, so a decode followed by an
encode reproduces SGLang's own bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec.msgpack import Ext

ENGINE_VERSION = "0.5.23"  # the SGLang release these mirrors were checked against
TOP_K_ALL = 1 << 30  # SGLang's "no top-k cut" (sampling_params.TOP_K_ALL)

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


class TokenizedEmbeddingReqInput(BaseReq, kw_only=True):
    """Router -> scheduler embedding request (an ``--is-embedding`` scheduler): 19 fields,
    fields 3-7 required. ``sampling_params`` is a dummy the scheduler only reads for its
    defaults; SGLang's TokenizerManager sends ``SamplingParams()`` normalized."""

    input_text: Any
    input_ids: Ext | None
    mm_inputs: Any
    token_type_ids: Any
    sampling_params: SamplingParams
    lora_id: str | None = None
    positional_embed_overrides: Any = None
    routed_dp_rank: int | None = None
    priority: int | None = None
    dimensions: int | None = None  # Matryoshka truncation, done by the pooler
    return_pooled_hidden_states: bool = False
    multi_item_delimiter_indices: list[int] | None = None
    token_indices_to_pool: list[int] | None = None
    decision_layout: list[int] | None = None
    time_stats: PickleWrapper | None = None
    lora_name: str | None = None


class BatchTokenizedEmbeddingReqInput(BaseBatchReq, kw_only=True):
    batch: list[TokenizedEmbeddingReqInput]


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


class BatchEmbeddingOutput(BaseBatchReq, kw_only=True):
    """Scheduler -> router outputs of an embedding scheduler: one entry per *finished* rid
    (an embedding request finishes in its one prefill step). Fields 1-7 required.

    ``embeddings`` rows are float lists (``tensor.tolist()`` of the pooled float32 vector,
    float64 on the wire); a sparse-head model sends ``{token id: weight}`` maps instead.
    """

    finished_reasons: list[dict[str, Any] | None]
    embeddings: list[Any]
    prompt_tokens: list[int]
    cached_tokens: list[int]
    placeholder_tokens_idx: Any
    placeholder_tokens_val: Any
    retraction_counts: list[int] | None = None
    cached_tokens_details: Any = None
    time_stats: PickleWrapper | None = None
    pooled_hidden_states: Any = None


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
        TokenizedEmbeddingReqInput,
        BatchTokenizedEmbeddingReqInput,
        AbortReq,
        HealthCheckOutput,
        FlushCacheReqInput,
        FlushCacheReqOutput,
        ShutdownReq,
        GetInternalStateReq,
        GetInternalStateReqOutput,
        BatchTokenIDOutput,
        BatchStrOutput,
        BatchEmbeddingOutput,
        PickleWrapper,
    )
}
