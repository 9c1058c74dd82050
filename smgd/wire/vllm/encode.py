"""What smgd sends the engine core, as vLLM's own front end would: INIT on the handshake socket,
ADD / ABORT / UTILITY / START_DP_WAVE on the input socket."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Final

import msgspec

from smgd.wire.common import StructuredKind, written
from smgd.wire.vllm.structs import (
    AbortRequest,
    AddRequest,
    EngineCoreRequest,
    HandshakeMetadata,
    LoRARequest,
    PoolingParams,
    RequestType,
    SamplingParams,
    StartDpWave,
    UtilityRequest,
    ZmqAddresses,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from smgd.wire.common import EmbedRequest, GenerateRequest, LoraAdapter, Structured
    from smgd.wire.common import SamplingParams as CommonSampling
    from smgd.wire.vllm.structs import InputMessage


# vLLM's SamplingParams._MAX_TEMP: temperatures in (0, this) are raised to it (the engine
# would produce NaN/inf otherwise); 0 means greedy.
_MAX_TEMP: Final = 1e-2

_ENCODER: Final = msgspec.msgpack.Encoder()


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


# What vLLM's front end writes for a character in an EBNF string literal (choice_as_grammar);
# other C0 controls and DEL become \uXXXX.
_EBNF_ESCAPES: Final = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def choice_grammar(choices: Sequence[str]) -> str:
    """``root ::= "a" | "b"``: the EBNF vLLM's front end turns a choice into for xgrammar."""

    def literal(text: str) -> str:
        out = []
        for ch in text:
            if ch in _EBNF_ESCAPES:
                out.append(_EBNF_ESCAPES[ch])
            elif ch < " " or ch == "\x7f":
                out.append(f"\\u{ord(ch):04x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'

    return "root ::= " + " | ".join(literal(c) for c in choices)


def _choices_grammar(s: Structured) -> str:
    return choice_grammar(s.choices)


def structured_outputs(s: Structured, backend: str = "auto") -> dict[str, Any]:
    """``StructuredOutputsParams`` (a dataclass: a map with every field, in field order) as vLLM's
    front end sends it after ``_validate_structured_outputs``.

    ``backend`` is the engine's structured-output backend: the engine core builds the backend
    the first constrained request names in ``_backend``, so it is always set. ``"auto"`` (vLLM's
    default) names xgrammar and marks it chosen automatically, as vLLM does when xgrammar takes
    the request. For xgrammar a choice goes as its EBNF grammar (:func:`choice_grammar`), as
    vLLM converts it; the other backends take the list.
    """
    name = "xgrammar" if backend == "auto" else backend
    fields: dict[str, Any] = dict.fromkeys(("json", "regex", "choice", "grammar", "json_object"))
    if s.kind is StructuredKind.JSON:
        fields["json"] = s.spec
    elif s.kind is StructuredKind.JSON_OBJECT:
        fields["json_object"] = True
    elif s.kind is StructuredKind.CHOICE:
        if name == "xgrammar":
            fields["grammar"] = written(s, _choices_grammar)
        else:
            fields["choice"] = list(s.choices)
    else:
        fields["regex" if s.kind is StructuredKind.REGEX else "grammar"] = s.spec
    return {
        **fields,
        "disable_any_whitespace": s.disable_any_whitespace,
        "disable_additional_properties": s.disable_additional_properties,
        "whitespace_pattern": s.whitespace_pattern,
        "structural_tag": None,
        "_backend": name,
        "_backend_was_auto": backend == "auto",
    }


_SAMPLING_DEFAULTS: Final = {
    f.name: f.default
    for f in msgspec.structs.fields(SamplingParams)
    if f.default_factory is msgspec.NODEFAULT
}


def to_vllm_sampling(sp: CommonSampling, *, structured_backend: str = "auto") -> SamplingParams:
    """smgd's normalized sampling -> what vLLM's front end would send after its own
    ``__post_init__`` and ``update_from_generation_config`` (and, for a structured-output
    constraint, its validation against ``structured_backend``: :func:`structured_outputs`).

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
        "prompt_logprobs": sp.prompt_logprobs,
        "logit_bias": dict(sp.logit_bias) if sp.logit_bias else None,
        "structured_outputs": (
            None if sp.structured is None else structured_outputs(sp.structured, structured_backend)
        ),
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
    structured_backend: str = "auto",
    lora: LoraAdapter | None = None,
) -> list[bytes]:
    """ADD frames (type byte + EngineCoreRequest) for one engine request.

    The caller validates first (vLLM's front end does, the engine does not): prompt ids below
    the vocab size and ``len(prompt) + max_tokens <= max_model_len``; either mistake kills the
    engine. ``client_index`` picks the output socket (``outputs[client_index]`` of INIT).
    ``structured_backend`` is the engine's structured-output backend (see
    :func:`structured_outputs`). ``req.priority`` is vLLM's (lower runs first; the engine
    refuses a non-zero one unless started with ``--scheduling-policy priority``). ``lora``: the
    adapter the request runs with (the caller resolved ``req.lora`` to it; the engine loads it
    from its path on first use).
    """
    core = EngineCoreRequest(
        request_id=req.rid,
        prompt_token_ids=req.prompt_ids,
        mm_features=None,
        sampling_params=to_vllm_sampling(req.sampling, structured_backend=structured_backend),
        pooling_params=None,
        arrival_time=time.time() if arrival_time is None else arrival_time,
        lora_request=None if lora is None else lora_request(lora),
        cache_salt=cache_salt,
        data_parallel_rank=None,
        client_index=client_index,
        priority=req.priority or 0,
    )
    return encode_engine_request(core)


def encode_embed(
    req: EmbedRequest, *, client_index: int = 0, arrival_time: float | None = None
) -> list[bytes]:
    """ADD frames for one embedding input (an engine started with ``--runner pooling``):
    ``pooling_params`` as vLLM's front end sends ``/v1/embeddings`` after ``verify`` (task
    ``embed``, ``use_activation`` = normalize), no sampling params.

    The caller validates as for :func:`encode_add` (prompt ids below the vocab size,
    ``len(prompt) <= max_model_len``) and ``dimensions`` against the model (vLLM's front end
    refuses it unless the model is Matryoshka; the engine does not check).
    """
    core = EngineCoreRequest(
        request_id=req.rid,
        prompt_token_ids=req.prompt_ids,
        mm_features=None,
        sampling_params=None,
        pooling_params=PoolingParams(
            use_activation=True,
            dimensions=req.dimensions,
            task="embed",
            skip_reading_prefix_cache=False,
        ),
        arrival_time=time.time() if arrival_time is None else arrival_time,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        client_index=client_index,
    )
    return encode_engine_request(core)


def lora_request(adapter: LoraAdapter) -> LoRARequest:
    """vLLM's LoRARequest for an adapter, as its front end builds one (no base model name)."""
    return LoRARequest(adapter.name, adapter.int_id, adapter.path)


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


def encode_request_message(msg: InputMessage) -> list[bytes]:
    """Inverse of ``decode_request``."""
    if isinstance(msg, AddRequest):
        return encode_engine_request(msg.request, msg.aux)
    if isinstance(msg, AbortRequest):
        return [RequestType.ABORT.value, _ENCODER.encode(msg.request_ids)]
    if isinstance(msg, UtilityRequest):
        return [RequestType.UTILITY.value, _ENCODER.encode(msg)]
    return [RequestType.START_DP_WAVE.value, _ENCODER.encode(msg)]
