"""``POST /v1/chat/completions`` and ``POST /v1/completions`` (OpenAI-compatible).

Streams are SSE (:mod:`smgd.api.sse`): the first chat chunk of each choice carries
``delta.role``, the last one ``finish_reason`` (``stop`` / ``length``), ``include_usage``
adds a ``choices: []`` usage chunk before ``[DONE]``. ``n > 1`` and batched completion
prompts become one engine request per choice, with ``index = prompt_index * n + j``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import trio
from quart import Blueprint, Response

from smgd.api.errors import stream_error
from smgd.api.execute import collect, stream
from smgd.api.pipeline import RequestState
from smgd.api.prepare import (
    api,
    app_nursery,
    encode,
    plan_jobs,
    read_json,
    request_id,
    resolve_model,
)
from smgd.api.sse import DONE, SSE_HEADERS, ChunkFormat, encode_json
from smgd.errors import InvalidRequest, SmgdError
from smgd.sampling import from_openai

if TYPE_CHECKING:
    from smgd.api.execute import Job
    from smgd.api.pipeline import Choice
    from smgd.api.prepare import SamplingFor
    from smgd.gateway import ModelText
    from smgd.sampling import TextOptions
    from smgd.wire.common import SamplingParams

__all__ = ["OpenAIRenderer", "blueprint"]

blueprint = Blueprint("openai", __name__)

# Chat keys that would change the prompt in ways smgd does not implement; rejected by name.
_CHAT_UNSUPPORTED = ("chat_template", "documents")


class OpenAIRenderer:
    """Chunk bytes for one streamed OpenAI request."""

    def __init__(
        self,
        fmt: ChunkFormat,
        state: RequestState,
        *,
        include_usage: bool,
        echo: dict[int, str] | None = None,
    ) -> None:
        self.fmt = fmt
        self.state = state
        self.include_usage = include_usage
        self.echo = echo

    def delta(self, choice: Choice, text: str) -> bytes:
        first = not choice.sent_role
        if first and self.echo is not None:
            text = self.echo[choice.index] + text
        if not text and not choice.done and not (first and self.fmt.chat):
            return b""
        choice.sent_role = True
        return self.fmt.chunk(
            choice.index,
            text,
            role=first and self.fmt.chat,
            finish_reason=choice.finish_reason,
        )

    def end(self) -> bytes:
        if self.include_usage:
            return self.fmt.usage(self.state.usage()) + DONE
        return DONE

    def error(self, err: SmgdError) -> bytes:
        return stream_error(err)


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    streaming = body.get("stream", False)
    if streaming is None:
        streaming = False
    if not isinstance(streaming, bool):
        raise InvalidRequest("`stream` must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is None:
        return streaming, False
    if not isinstance(options, dict):
        raise InvalidRequest("`stream_options` must be an object", param="stream_options")
    if not streaming:
        raise InvalidRequest("`stream_options` needs `stream: true`", param="stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise InvalidRequest(
            "`include_usage` must be a boolean", param="stream_options.include_usage"
        )
    if options.get("continuous_usage_stats"):
        raise InvalidRequest(
            "`continuous_usage_stats` is not supported",
            param="stream_options.continuous_usage_stats",
        )
    return streaming, include


def _new_state(kind: str, model: str) -> RequestState:
    return RequestState(
        request_id=request_id(),
        kind=kind,
        model=model,
        created=int(time.time()),
        t_start=trio.current_time(),
    )


async def _respond(
    jobs: list[Job],
    state: RequestState,
    *,
    chat: bool,
    streaming: bool,
    include_usage: bool,
    echo: dict[int, str] | None,
) -> Response:
    prefix = "chatcmpl-" if chat else "cmpl-"
    response_id = prefix + state.request_id
    if streaming:
        fmt = ChunkFormat(
            response_id=response_id,
            created=state.created,
            model=state.model,
            chat=chat,
            include_usage=include_usage,
        )
        render = OpenAIRenderer(fmt, state, include_usage=include_usage, echo=echo)
        body = stream(
            jobs,
            state,
            render,
            keepalive_s=api().keepalive_s,
            nursery=app_nursery(),
        )
        response = Response(body, headers=SSE_HEADERS)
        response.timeout = None  # Quart's 60 s RESPONSE_TIMEOUT would cut long streams
        return response
    await collect(jobs, state)
    choices: list[dict[str, Any]] = []
    for job in jobs:
        choice = job.choice
        text = "".join(choice.parts)
        if echo is not None:
            text = echo[choice.index] + text
        entry: dict[str, Any] = {"index": choice.index}
        if chat:
            entry["message"] = {"role": "assistant", "content": text}
        else:
            entry["text"] = text
        entry["logprobs"] = None
        entry["finish_reason"] = choice.finish_reason
        entry["stop_reason"] = choice.matched  # vLLM extension: the stop string / token
        choices.append(entry)
    payload = {
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": state.created,
        "model": state.model,
        "choices": choices,
        "usage": state.usage(),
    }
    return Response(encode_json(payload), content_type="application/json")


def _sampler(body: dict[str, Any], text: ModelText, *, chat: bool) -> SamplingFor:
    eos = text.tokenizer.eos_token_ids
    vocab_size = text.vocab_size

    def sampling_for(prompt_len: int, context_len: int) -> tuple[SamplingParams, TextOptions]:
        return from_openai(
            body,
            chat=chat,
            prompt_len=prompt_len,
            context_len=context_len,
            vocab_size=vocab_size,
            eos_token_ids=eos,
        )

    return sampling_for


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"`{key}` must be a boolean", param=key)
    return value


@blueprint.post("/v1/chat/completions")
async def chat_completions() -> Response:
    ctx = api()
    body = await read_json()
    model, text = resolve_model(ctx.gateway, body)
    streaming, include_usage = _stream_flags(body)
    for key in _CHAT_UNSUPPORTED:
        if body.get(key) is not None:
            raise InvalidRequest(f"`{key}` is not supported by smgd", param=key)
    if _flag(body, "continue_final_message", False):
        raise InvalidRequest(
            "`continue_final_message` is not supported by smgd", param="continue_final_message"
        )
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest(
            "`chat_template_kwargs` must be an object", param="chat_template_kwargs"
        )
    reserved = {"messages", "tools", "add_generation_prompt"} & kwargs.keys()
    if reserved:
        raise InvalidRequest(
            f"`chat_template_kwargs` cannot set {sorted(reserved)}", param="chat_template_kwargs"
        )
    if "messages" not in body:
        raise InvalidRequest("`messages` is required", param="messages")
    prompt = text.tokenizer.render_chat(
        body["messages"],
        add_generation_prompt=_flag(body, "add_generation_prompt", True),
        tools=body.get("tools"),
        **kwargs,
    )
    # Chat templates render BOS themselves; vLLM also defaults to no special tokens here.
    ids = await encode(
        text.tokenizer, prompt, add_special_tokens=_flag(body, "add_special_tokens", False)
    )
    state = _new_state("chat", model)
    jobs, options = plan_jobs(
        ctx.gateway, model, text, [ids], _sampler(body, text, chat=True), state,
        logprobs_param="logprobs",
    )  # fmt: skip
    if options.echo:
        raise InvalidRequest("`echo` is not supported for chat", param="echo")
    return await _respond(
        jobs, state, chat=True, streaming=streaming, include_usage=include_usage, echo=None
    )


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_id(p) for p in prompt):
            return [prompt]
        if all(isinstance(p, list) and p and all(_is_id(t) for t in p) for p in prompt):
            return list(prompt)
    raise InvalidRequest(
        "`prompt` must be a non-empty string, array of strings, array of token ids, "
        "or array of token-id arrays",
        param="prompt",
    )


@blueprint.post("/v1/completions")
async def completions() -> Response:
    ctx = api()
    body = await read_json()
    model, text = resolve_model(ctx.gateway, body)
    streaming, include_usage = _stream_flags(body)
    raw = _completion_prompts(body)
    add_special = _flag(body, "add_special_tokens", True)
    prompts: list[list[int]] = []
    for item in raw:
        if isinstance(item, str):
            prompts.append(await encode(text.tokenizer, item, add_special_tokens=add_special))
        else:
            prompts.append(list(item))
    state = _new_state("completion", model)
    jobs, options = plan_jobs(
        ctx.gateway, model, text, prompts, _sampler(body, text, chat=False), state
    )
    echo: dict[int, str] | None = None
    if options.echo:
        echo = {}
        for job in jobs:
            item = raw[job.choice.index // options.n]
            echo[job.choice.index] = (
                item if isinstance(item, str) else text.tokenizer.decode(item, False)
            )
    return await _respond(
        jobs, state, chat=False, streaming=streaming, include_usage=include_usage, echo=echo
    )
