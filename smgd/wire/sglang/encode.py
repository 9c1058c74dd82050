"""What smgd sends the scheduler (router -> scheduler), as SGLang's TokenizerManager would.

Generate requests normalized the way TokenizerManager normalizes them, aborts, health checks and
control requests; each is one frame.
"""

from __future__ import annotations

import math
import uuid
from typing import TYPE_CHECKING

import msgspec

from smgd.errors import InvalidRequest
from smgd.wire.common import grammar_fields
from smgd.wire.sglang.arrays import ids_to_ext
from smgd.wire.sglang.structs import (
    TOP_K_ALL,
    AbortReq,
    FlushCacheReqInput,
    GetInternalStateReq,
    SamplingParams,
    ShutdownReq,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from smgd.wire.common import EmbedRequest, GenerateRequest, LoraAdapter
    from smgd.wire.common import SamplingParams as CommonSampling


GREEDY_EPS = 1e-6  # SGLang's _SAMPLING_EPS: temperature below this means greedy
HEALTH_CHECK_PREFIX = "HEALTH_CHECK"  # the scheduler special-cases rids starting with this

_encoder = msgspec.msgpack.Encoder()


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
    sent: SGLang reads them from the model config. ``ignore_eos`` together with stop token ids
    cannot be expressed on this wire and is refused. A structured-output constraint goes in its
    grammar field (:func:`grammar_fields`).

    ``min_tokens`` goes in ``min_new_tokens`` as TokenizerManager sends it; SGLang 0.5.23's
    scheduler cannot apply it when started with ``--skip-tokenizer-init`` (its penalizer reads
    stop ids from the tokenizer object it then does not have, and crashes): smgd refuses it for
    such engines before anything is sent (``smgd.api.core.prepare.check_engine``).
    """
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
    json_schema, regex, ebnf = grammar_fields(s.structured)
    sp = SamplingParams(
        max_new_tokens=s.max_tokens,
        min_new_tokens=s.min_tokens,
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
        json_schema=json_schema,
        regex=regex,
        ebnf=ebnf,
    )
    _verify(sp)
    return sp


def _tgri(
    rid: str,
    ids: Sequence[int],
    sp: SamplingParams,
    stream: bool,
    logprobs: int | None,
    *,
    prompt_logprobs: int | None = None,
    priority: int | None = None,
) -> TokenizedGenerateReqInput:
    # One top-k count serves the prompt and the output on this wire: the larger one (the
    # engine client cuts the other side's top lists back to what it asked for).
    top = max(logprobs or 0, prompt_logprobs or 0)
    return TokenizedGenerateReqInput(
        rid=rid,
        input_text=None,
        input_ids=ids_to_ext(ids),
        input_embeds=None,
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=sp,
        return_logprob=logprobs is not None or prompt_logprobs is not None,
        # -1 (GenerateReqInput's default): no prompt logprobs; 0: from the first token on.
        logprob_start_len=-1 if prompt_logprobs is None else 0,
        top_logprobs_num=top,
        token_ids_logprob=None,
        stream=stream,
        priority=priority,
    )


def encode_generate(req: GenerateRequest, lora: LoraAdapter | None = None) -> bytes:
    """A ``TokenizedGenerateReqInput`` frame for one request (raises InvalidRequest).

    ``lora``: the adapter ``req.lora`` names, which the scheduler must already hold (loaded
    from ``--lora-paths`` at start); it is addressed by :func:`lora_id`, as SGLang's
    TokenizerManager does after resolving the name.
    """
    if not req.rid:
        raise ValueError("a generate request needs a non-empty rid")
    sp = to_sglang_sampling(req.sampling)
    msg = _tgri(
        req.rid,
        req.prompt_ids,
        sp,
        req.stream,
        req.sampling.logprobs,
        prompt_logprobs=req.sampling.prompt_logprobs,
        priority=req.priority,
    )
    if lora is not None:
        msg.lora_id = lora_id(lora.name, lora.path)
        msg.lora_name = lora.name
    return _encoder.encode(msg)


def lora_id(name: str, path: str) -> str:
    """The id SGLang gives an adapter of ``--lora-paths name=path`` (``LoRARef.deterministic_id``:
    uuid5 of the URL namespace over ``name NUL path``)."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"{name}\0{path}").hex


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


def _embedding_req(
    rid: str, ids: Sequence[int], sp: SamplingParams, dimensions: int | None
) -> TokenizedEmbeddingReqInput:
    return TokenizedEmbeddingReqInput(
        rid=rid,
        input_text=None,
        input_ids=ids_to_ext(ids),
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=sp,
        dimensions=dimensions,
    )


# The dummy sampling params of an embedding request: SamplingParams() normalized, with
# EmbeddingReqInput's normalization setting max_new_tokens to 0 (what TokenizerManager sends).
_EMBED_SAMPLING = SamplingParams(
    max_new_tokens=0, stop_strs=[], stop_regex_strs=[], is_normalized=True
)


def encode_embed(req: EmbedRequest) -> bytes:
    """A ``TokenizedEmbeddingReqInput`` frame for one input (an ``--is-embedding`` scheduler)."""
    if not req.rid:
        raise ValueError("an embedding request needs a non-empty rid")
    return _encoder.encode(_embedding_req(req.rid, req.prompt_ids, _EMBED_SAMPLING, req.dimensions))


def encode_embed_health_check(rid: str) -> bytes:
    """SGLang's /health_generate request for an embedding model: prompt [0], the probe's greedy
    sampling params (a dummy here) with max_new_tokens 0, as EmbeddingReqInput sets it."""
    if not rid.startswith(HEALTH_CHECK_PREFIX):
        raise ValueError(f"health-check rid must start with {HEALTH_CHECK_PREFIX!r}")
    sp = SamplingParams(
        max_new_tokens=0,
        temperature=1.0,
        top_k=1,
        stop_strs=[],
        stop_regex_strs=[],
        is_normalized=True,
    )
    return _encoder.encode(_embedding_req(rid, [0], sp, None))


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


def encode_message(msg: msgspec.Struct) -> bytes:
    """Encode any mirror struct exactly as SGLang's ``msgpack_encode`` would."""
    return _encoder.encode(msg)
