"""``POST /generate``: SGLang's native API.

Request: ``text`` or ``input_ids``, ``sampling_params`` (SGLang names: ``max_new_tokens``,
``stop``, ``no_stop_trim``...), ``stream``, ``rid``, ``lora_path`` (a LoRA adapter's name, as
SGLang: the same as ``"model": "<model>:<adapter>"``). Response: ``{"text", "output_ids",
"meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
"e2e_latency"}}``; a list of those when ``n > 1``. A top-level ``priority`` goes to engines
that schedule by it (``[[engines]] scheduling``; a 400 elsewhere unless 0). Streamed events
carry the *cumulative* ``text`` and ``output_ids`` so far (SGLang's default), ending with
``data: [DONE]``.
``finish_reason`` is ``{"type": "stop", "matched": <token id or stop string>}`` or
``{"type": "length", "length": <max_new_tokens>}``.

Logprobs (``return_logprob``, ``top_logprobs_num``, ``return_text_in_logprobs``) are SGLang's:
``meta_info.output_token_logprobs`` is one ``[logprob, token_id, text or null]`` per id of
``output_ids``, and ``output_top_logprobs`` (when ``top_logprobs_num > 0``) one list of those
per id; streamed events carry them cumulatively, like the text. ``logprob_start_len: 0`` adds
the prompt's, as SGLang writes them: ``input_token_logprobs`` one item per prompt token, the
first ``[null, id, text or null]``, and ``input_top_logprobs`` (``null`` for the first token).
Other starts than -1 and 0, and ``token_ids_logprob``, are rejected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import trio

from smgd.api.core.errors import stream_error
from smgd.api.core.execute import collect, stream
from smgd.api.core.pipeline import MIN_LOGPROB, check_request_id
from smgd.api.core.prepare import (
    JSON_HEADERS,
    ParamNames,
    Reply,
    context_len,
    encode,
    plan_jobs,
    resolve_model,
)
from smgd.api.core.sse import DONE, SSE_HEADERS, encode_json, event
from smgd.api.handlers.openai import TokenText
from smgd.errors import InvalidRequest, ModelNotFound, SmgdError
from smgd.sampling import from_native, read_priority

if TYPE_CHECKING:
    from smgd.api.core.execute import Job
    from smgd.api.core.pipeline import Choice, LogprobTrack, RequestState
    from smgd.api.core.prepare import Call
    from smgd.gateway import Gateway, ModelText
    from smgd.sampling import TextOptions
    from smgd.wire.common import SamplingParams, TokenLogprob

__all__ = ["NativeRenderer", "generate_reply"]

# What an engine may refuse, by /generate's names.
_NAMES = ParamNames(
    min_tokens="sampling_params.min_new_tokens", prompt_logprobs="logprob_start_len"
)
# SGLang request keys for features no engine path here implements; rejected by name.
_UNSUPPORTED = (
    "image_data", "audio_data", "video_data", "input_embeds", "session_params",
    "custom_logit_processor", "return_hidden_states", "bootstrap_host", "data_parallel_rank",
)  # fmt: skip


def _finish(choice: Choice, max_tokens: int) -> dict[str, Any] | None:
    if choice.finish_reason is None:
        return None
    if choice.finish_reason == "length":
        return {"type": "length", "length": max_tokens}
    return {"type": "stop", "matched": choice.matched}


class _Grown:
    """A JSON array that only grows, its items encoded once: ``raw`` is the whole array.

    A streamed ``/generate`` event carries every logprob so far (SGLang's cumulative
    ``meta_info``): rebuilt per event, a 4,096-token stream with top-20 logprobs converted
    ~180 million items on the loop. Encoded as they come, an event costs a copy of the bytes.
    """

    __slots__ = ("_body", "count")

    def __init__(self) -> None:
        self._body = bytearray()
        self.count = 0  # items so far

    def extend(self, items: list[Any]) -> None:
        if not items:
            return
        if self.count:
            self._body += b","
        self._body += encode_json(items)[1:-1]
        self.count += len(items)

    @property
    def raw(self) -> msgspec.Raw:
        return msgspec.Raw(b"[" + self._body + b"]")


class NativeLogprobs:
    """SGLang's logprob fields of ``meta_info`` for one request: each choice's entries
    converted and encoded once, as they come (``_Grown``), the prompt's once."""

    def __init__(self, tokens: TokenText, *, top: bool, with_text: bool) -> None:
        self.tokens = tokens
        self.top = top
        self.with_text = with_text
        self._output: dict[int, tuple[_Grown, _Grown]] = {}  # by choice: values, tops
        self._prompt: dict[int, tuple[int, dict[str, Any]]] = {}  # by choice: (rows, fields)

    def _item(self, logprob: float, token_id: int) -> list[Any]:
        text = self.tokens.get(token_id)[0] if self.with_text else None
        return [max(logprob, MIN_LOGPROB), token_id, text]

    def fields(self, index: int, track: LogprobTrack) -> dict[str, Any]:
        """Choice ``index``'s output fields, with the entries of ``track`` not seen before
        converted now (entries only ever grow)."""
        grown = self._output.get(index)
        if grown is None:
            grown = self._output[index] = (_Grown(), _Grown())
        values, tops = grown
        new = track.entries[values.count :]
        values.extend([self._item(e.logprob, e.token_id) for e in new])
        out: dict[str, Any] = {"output_token_logprobs": values.raw}
        if self.top:
            tops.extend([[self._item(t.logprob, t.token_id) for t in e.top or ()] for e in new])
            out["output_top_logprobs"] = tops.raw
        return out

    def prompt_fields(
        self, index: int, prompt_ids: list[int], entries: list[TokenLogprob]
    ) -> dict[str, Any]:
        """``logprob_start_len: 0``: the first prompt token has no logprob (SGLang's null).
        Converted and encoded once per choice (every streamed event repeats them), again only
        if more rows came (an engine may send a long prompt's in parts)."""
        done = self._prompt.get(index)
        if done is not None and done[0] == len(entries):
            return done[1]
        first = prompt_ids[0] if prompt_ids else None
        text = self.tokens.get(first)[0] if self.with_text and first is not None else None
        out: dict[str, Any] = {
            "input_token_logprobs": msgspec.Raw(
                encode_json(
                    [[None, first, text], *(self._item(e.logprob, e.token_id) for e in entries)]
                )
            )
        }
        if self.top:
            rows = ([self._item(t.logprob, t.token_id) for t in e.top or ()] for e in entries)
            out["input_top_logprobs"] = msgspec.Raw(encode_json([None, *rows]))
        self._prompt[index] = (len(entries), out)
        return out


def _meta(
    state: RequestState,
    choice: Choice,
    max_tokens: int,
    logprobs: NativeLogprobs | None,
    prompt_ids: list[int],
) -> dict[str, Any]:
    meta = {
        "id": state.request_id,
        "finish_reason": _finish(choice, max_tokens),
        "prompt_tokens": choice.prompt_tokens,
        "completion_tokens": choice.completion_tokens,
        "cached_tokens": choice.cached_tokens or 0,
        "e2e_latency": round(trio.current_time() - state.t_start, 6),
    }
    if logprobs is not None and choice.logprobs is not None:
        if choice.prompt_logprobs is not None:
            meta.update(logprobs.prompt_fields(choice.index, prompt_ids, choice.prompt_logprobs))
        meta.update(logprobs.fields(choice.index, choice.logprobs))
    return meta


class NativeRenderer:
    def __init__(
        self,
        state: RequestState,
        max_tokens: int,
        *,
        indexed: bool,
        logprobs: NativeLogprobs | None = None,
        prompt_ids: list[int] | None = None,
    ) -> None:
        self.state = state
        self.max_tokens = max_tokens
        self.indexed = indexed
        self.logprobs = logprobs
        self.prompt_ids = prompt_ids or []

    def delta(self, choice: Choice, text: str) -> bytes:
        if text:
            choice.parts.append(text)
        elif not choice.done:
            return b""
        out: dict[str, Any] = {
            "text": "".join(choice.parts),
            "output_ids": choice.output_ids,
            "meta_info": _meta(self.state, choice, self.max_tokens, self.logprobs, self.prompt_ids),
        }
        if self.indexed:
            out["index"] = choice.index
        return event(out)

    def text_frame(self, choice: Choice) -> tuple[()]:
        return ()  # every event carries the whole text so far and its meta_info

    def end(self) -> bytes:
        return DONE

    def error(self, err: SmgdError) -> bytes:
        return stream_error(err)


def _resolve_lora_path(gateway: Gateway, body: dict[str, Any]) -> tuple[str, ModelText]:
    """The model, and SGLang's ``lora_path`` (an adapter's name) as ``<model>:<adapter>``."""
    model, text = resolve_model(gateway, body)
    lora = body.get("lora_path")
    if lora is None:
        return model, text
    if not isinstance(lora, str) or not lora:
        raise InvalidRequest(
            "`lora_path` must be an adapter's name (batched requests are not supported)",
            param="lora_path",
        )
    try:
        return resolve_model(gateway, {"model": f"{model}:{lora}"})
    except ModelNotFound:
        raise ModelNotFound(
            f"The LoRA adapter `{lora}` of model `{model}` does not exist.",
            param="lora_path",
            code="model_not_found",
        ) from None


async def generate_reply(call: Call) -> Reply:
    """``POST /generate``: 4xx errors are raised before any engine sees the request.

    A valid ``rid`` becomes the request's id (``call.request_id``): echoed in ``X-Request-Id``,
    on errors too, and named in the log line.
    """
    body = await call.json()
    model, text = _resolve_lora_path(call.ctx.gateway, body)
    for key in _UNSUPPORTED:
        if body.get(key) is not None:
            raise InvalidRequest(f"`{key}` is not supported by smgd", param=key)
    streaming = body.get("stream") or False
    if not isinstance(streaming, bool):
        raise InvalidRequest("`stream` must be a boolean", param="stream")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise InvalidRequest(
            "`rid` must be a string (batched requests are not supported)", param="rid"
        )
    if rid is not None:
        call.request_id = check_request_id(rid, "rid")  # echoed in X-Request-Id and logs
    prompt_text, input_ids = body.get("text"), body.get("input_ids")
    if (prompt_text is None) == (input_ids is None):
        raise InvalidRequest("exactly one of `text` and `input_ids` is required", param="text")
    if prompt_text is not None:
        if not isinstance(prompt_text, str):
            raise InvalidRequest(
                "`text` must be a string (batched requests are not supported)", param="text"
            )
        ids = await encode(
            text.tokenizer,
            prompt_text,
            add_special_tokens=True,
            limiter=call.ctx.tokenize_limiter,
            context=context_len(call.ctx.gateway, model),
            param="text",
        )
    else:
        if not isinstance(input_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in input_ids
        ):
            raise InvalidRequest(
                "`input_ids` must be an array of token ids (batches are not supported)",
                param="input_ids",
            )
        ids = input_ids
    logprobs, with_text, prompt_logprobs = _logprob_options(body)
    sampling_params = body.get("sampling_params")
    vocab, eos = text.vocab_size, text.tokenizer.eos_token_ids

    priority = read_priority(body)

    def sampling_for(prompt_len: int, context_len: int) -> tuple[SamplingParams, TextOptions]:
        return from_native(
            sampling_params,
            prompt_len=prompt_len,
            context_len=context_len,
            vocab_size=vocab,
            eos_token_ids=eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            priority=priority,
        )

    state = call.new_state("generate", model)
    jobs, options = plan_jobs(
        call.ctx.gateway, model, text, [ids], sampling_for, state,
        keep_ids=True, top_logprobs_param="top_logprobs_num", align_logprobs=False,
        names=_NAMES,
    )  # fmt: skip
    max_tokens = jobs[0].request.sampling.max_tokens
    lp = None
    if logprobs is not None:
        lp = NativeLogprobs(TokenText(text.tokenizer), top=logprobs > 0, with_text=with_text)
    if streaming:
        render = NativeRenderer(
            state, max_tokens, indexed=options.n > 1, logprobs=lp, prompt_ids=ids
        )
        body_iter = stream(
            jobs,
            state,
            render,
            keepalive_s=call.ctx.keepalive_s,
            nursery=call.nursery,
            pacer=call.ctx.pacer,
            writer=call.writer,
            cutoff=call.ctx.cutoff,
        )
        return Reply(body_iter, SSE_HEADERS)
    await collect(jobs, state, call.ctx.cutoff)
    outs = [_final(state, job, max_tokens, lp, ids) for job in jobs]
    payload: Any = outs[0] if len(outs) == 1 else outs
    return Reply(encode_json(payload), JSON_HEADERS)


def _final(
    state: RequestState,
    job: Job,
    max_tokens: int,
    logprobs: NativeLogprobs | None,
    prompt_ids: list[int],
) -> dict[str, Any]:
    choice = job.choice
    return {
        "text": "".join(choice.parts),
        "output_ids": choice.output_ids,
        "meta_info": _meta(state, choice, max_tokens, logprobs, prompt_ids),
    }


def _logprob_options(body: dict[str, Any]) -> tuple[int | None, bool, bool]:
    """(top-k count or None when no logprobs, return_text_in_logprobs, prompt logprobs) of a
    /generate body."""
    for key in ("return_logprob", "return_text_in_logprobs"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise InvalidRequest(f"`{key}` must be a boolean", param=key)
    start = body.get("logprob_start_len")
    if start is not None and start not in (-1, 0):
        raise InvalidRequest(
            "`logprob_start_len` must be -1 (no prompt logprobs) or 0 (from the first prompt "
            "token): smgd returns no partial prompt logprobs",
            param="logprob_start_len",
        )
    if body.get("token_ids_logprob") is not None:
        raise InvalidRequest(
            "`token_ids_logprob` is not supported by smgd", param="token_ids_logprob"
        )
    top = body.get("top_logprobs_num")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
        raise InvalidRequest("`top_logprobs_num` must be an integer", param="top_logprobs_num")
    if not body.get("return_logprob"):
        return None, False, False
    return top or 0, bool(body.get("return_text_in_logprobs")), start == 0
