"""Mirrors of TokenSpeed 0.1.1's wire structs and handshake maps (field order is the contract).

Field orders mirror ``tokenspeed/runtime/engine/io_struct.py``, ``zmq_wire.py`` and
``sampling/sampling_params.py`` of the 0.1.1 wheel. Data-plane structs are msgspec
``array_like`` (a tagged struct's element 0 is its class name); handshake messages are msgpack
**maps**. Decoding tolerates missing trailing defaults and extra trailing fields (newer engines
append).
"""

from __future__ import annotations

from typing import Any

import msgspec

from smgd.wire.common import EngineInfo

REQ_ADD = b"\x00"
REQ_ABORT = b"\x01"
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
TAG_REQUEST = "TokenizedGenerateReqInput"
TAG_OUTPUT = "BatchTokenIDOutSlim"

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
