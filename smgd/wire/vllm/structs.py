"""Mirrors of vLLM 0.32.0's EngineCore messages: field order, configs and defaults as vLLM's.

Everything is msgspec msgpack exactly as vLLM writes it: ``array_like`` structs are positional
and always carry every field (``omit_defaults`` does nothing for them), ``SamplingParams`` is a
map without its default-valued keys, dataclasses are maps with every key. Arrays (logprobs,
tensors) are ``[dtype, shape, data]`` where ``data`` is msgpack ext type 3 holding the raw
little-endian bytes, or, from 256 bytes up, the index of an extra ("aux") frame. Encoding a
mirror gives vLLM's bytes.
"""

from __future__ import annotations

import enum
from typing import Any, Final, TypeAlias

import msgspec
from msgspec.msgpack import Ext

from smgd.wire.common import EngineInfo

Frame: TypeAlias = bytes | bytearray | memoryview

ENGINE_CORE_DEAD: Final = b"ENGINE_CORE_DEAD"
# vLLM's CUSTOM_TYPE_RAW_VIEW: inline raw array bytes.
RAW_VIEW_EXT: Final = 3


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


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's PoolingParams (10 positional fields), as the front end sends an ``embed`` request
    after ``verify``: task and use_activation (= normalize) set, prefix cache readable."""

    use_activation: bool | None = None
    dimensions: int | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None
    task: str | None = None
    requires_token_ids: bool = False
    skip_reading_prefix_cache: bool | None = None
    late_interaction_params: Any = None
    extra_kwargs: dict[str, Any] | None = None
    output_kind: int = 2  # RequestOutputKind.FINAL_ONLY, the only kind pooling allows


class LoRARequest(msgspec.Struct, array_like=True, gc=False):
    """vLLM's LoRARequest (``lora_request`` of an ADD, the argument of ``add_lora``): a
    positional array that always carries all six fields."""

    lora_name: str
    lora_int_id: int  # >= 1; the engine caches the adapter's weights under this id
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """ADD body: 22 positional fields, always all of them."""

    request_id: str
    prompt_token_ids: list[int] | None
    mm_features: list[Any] | None
    sampling_params: SamplingParams | None
    pooling_params: PoolingParams | None
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
