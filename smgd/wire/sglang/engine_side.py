"""The scheduler's side of the SGLang wire, for the mock engine: outputs and replies written as
SGLang's scheduler writes them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from smgd.wire.common import Finish, FinishReason, TokenLogprob
from smgd.wire.sglang.arrays import ids_to_ext
from smgd.wire.sglang.structs import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    FlushCacheReqOutput,
    HealthCheckOutput,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

_encoder = msgspec.msgpack.Encoder()


def finish_to_wire(finish: Finish | None, completion_tokens: int) -> dict[str, Any] | None:
    """A common Finish as SGLang's scheduler writes it: the inverse of
    :func:`~smgd.wire.sglang.decode.finish_from_wire`."""
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


class OutputItem(NamedTuple):
    """One request's slice of a BatchTokenIDOutput (plain 6-tuples work too)."""

    rid: str
    token_ids: Sequence[int]  # new ids since the previous frame for this rid
    finish: Finish | None
    prompt_tokens: int
    completion_tokens: int  # cumulative
    cached_tokens: int
    logprobs: Sequence[TokenLogprob] | None = None
    # (first prompt token id, logprobs of prompt tokens 1..), sent once (logprob_start_len 0)
    prompt_logprobs: tuple[int, Sequence[TokenLogprob]] | None = None


def _prompt_columns(items: Sequence[OutputItem], top: bool) -> tuple[Any, Any, Any, Any]:
    """SGLang's input logprob columns: each row starts with the first token's None."""
    vals: list[list[Any]] = []
    idxs: list[list[Any]] = []
    top_vals: list[list[Any]] = []
    top_idxs: list[list[Any]] = []
    for it in items:
        if it.prompt_logprobs is None:
            for col in (vals, idxs, top_vals, top_idxs):
                col.append([])
            continue
        first, rows = it.prompt_logprobs
        vals.append([None, *(lp.logprob for lp in rows)])
        idxs.append([first, *(lp.token_id for lp in rows)])
        if top:
            top_vals.append([None, *([t.logprob for t in lp.top or ()] for lp in rows)])
            top_idxs.append([None, *([t.token_id for t in lp.top or ()] for lp in rows)])
        else:
            top_vals.append([])
            top_idxs.append([])
    return vals, idxs, top_vals, top_idxs


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
    in_vals, in_idxs, in_top_vals, in_top_idxs = empty, empty, empty, empty
    if vals is not None and any(it.prompt_logprobs is not None for it in its):
        top = any(lp.top for it in its for lp in (it.prompt_logprobs or (0, ()))[1])
        in_vals, in_idxs, in_top_vals, in_top_idxs = _prompt_columns(its, top)
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
        input_token_logprobs_val=in_vals,
        input_token_logprobs_idx=in_idxs,
        output_token_logprobs_val=vals,
        output_token_logprobs_idx=idxs,
        input_top_logprobs_val=in_top_vals,
        input_top_logprobs_idx=in_top_idxs,
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


class EmbeddingItem(NamedTuple):
    """One request's slice of a BatchEmbeddingOutput."""

    rid: str
    embedding: Sequence[float] | None  # None: the request did not get a vector (aborted)
    finish: Finish
    prompt_tokens: int
    cached_tokens: int


def encode_embedding_output(items: Sequence[EmbeddingItem]) -> bytes:
    """A BatchEmbeddingOutput frame as the scheduler's output streamer writes it (a finished
    embedding is ``{"type": "length", "length": 0}``: one dummy output id; ``time_stats`` nil,
    as in :func:`build_batch_output`)."""
    n = len(items)
    return _encoder.encode(
        BatchEmbeddingOutput(
            rids=[it.rid for it in items],
            http_worker_ipcs=[None] * n,
            finished_reasons=[finish_to_wire(it.finish, 0) for it in items],
            embeddings=[list(it.embedding) if it.embedding is not None else [] for it in items],
            prompt_tokens=[it.prompt_tokens for it in items],
            cached_tokens=[it.cached_tokens for it in items],
            placeholder_tokens_idx=None,
            placeholder_tokens_val=None,
            retraction_counts=[0] * n,
            cached_tokens_details=[None] * n,
        )
    )


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
