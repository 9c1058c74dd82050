"""Request preparation shared by the OpenAI and native endpoints, and what every handler gets.

A handler is ``Call -> Reply`` (:mod:`smgd.api.handlers`): a :class:`Call` carries the request's
body, id and everything the app holds for it (:class:`ApiContext`); a :class:`Reply` is the
answer, a JSON document or an SSE body. :mod:`smgd.api.http.dispatch` builds the call and sends
the reply.

Body → JSON dict (400 on anything else), model → :class:`~smgd.gateway.ModelText` (404),
text → token ids (big prompts in a worker thread), then engines picked and every engine
request validated *before* the response starts, so no bad input reaches an engine and every
client error is a real 4xx status rather than a mid-stream event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import trio

from smgd.api.core.execute import Cutoff, Job
from smgd.api.core.pipeline import Choice, LogprobTrack, RequestState, new_engine_rid
from smgd.api.core.sse import encode_json
from smgd.config import is_mock, sglang_has_tokenizer
from smgd.errors import EngineNotReady, InvalidRequest, SmgdError
from smgd.sampling import for_choice, nested_deeper
from smgd.text.stream import TextStream
from smgd.wire.common import GenerateRequest

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from smgd.api.core.execute import EventWriter
    from smgd.api.core.pacer import LoadPacer
    from smgd.engines.base import EngineClient
    from smgd.gateway import Gateway, ModelText
    from smgd.metrics import RequestMetrics
    from smgd.sampling import TextOptions
    from smgd.text.tokenizer import Tokenizer
    from smgd.wire.common import SamplingParams
    from smgd.worker_peers import WorkerPeers

__all__ = [
    "JSON_HEADERS",
    "MAX_CHOICES",
    "MAX_PROMPT_LOGPROBS",
    "OPENAI_NAMES",
    "ApiContext",
    "Call",
    "Handler",
    "ParamNames",
    "Recorder",
    "Reply",
    "check_engine",
    "context_len",
    "decode_body",
    "encode",
    "encode_all",
    "json_reply",
    "off_the_loop",
    "plan_jobs",
    "resolve_model",
]

log = logging.getLogger("smgd.api")

# Prompts longer than this (characters) are tokenized in a worker thread: `encode_batch`
# releases the GIL, so the event loop keeps streaming meanwhile. Shorter ones tokenize inline:
# 16 K characters took 4 ms (English) to 9 ms (accented and CJK text) on the 2-core test VM
# with the tiny model, a pause the loop's streams absorb, while a thread hop costs a few
# scheduler passes.
BIG_PROMPT_CHARS = 16_384
# Request bodies at least this big are prepared off the loop (off_the_loop): a 64 KiB chat
# body renders in ~5 ms on the 2-core test VM (250,000 empty messages, ~8 MB: 0.75 s), about
# what a thread hop and the GIL's hand-back cost the loop.
BIG_BODY_BYTES = 65_536
_T = TypeVar("_T")
# One HTTP request fans out into (prompts x n) engine requests while admission sees one;
# 64 bounds what a single batched /v1/completions call can put on the engines.
MAX_CHOICES = 64
# The prompt logprob entries (a prompt token's, or one of its top alternatives) one request may
# ask the engines for: 2**20 holds lm-eval's largest batches (64 prompts of a 4k context with
# `logprobs: 1`, 524,288) and a 100k-token document with 9 top logprobs. Each entry is decoded
# on the loop as it comes (0.6 µs; an engine that sends a whole batch's in one frame pauses
# it ~0.6 s at this bound) and converted for the reply (1.2-1.6 µs, in a worker thread when
# big); 64 prompts of 4,000 tokens with 20 top logprobs (5.4 million) paused it 4.7 s, and
# built a 340 MB reply. vLLM has no such bound (only its max_logprobs, 20 per token).
MAX_PROMPT_LOGPROBS = 1 << 20

_decoder = msgspec.json.Decoder()


@dataclass(slots=True)
class ApiContext:
    """What an app's handlers share: one per app, built by :mod:`smgd.api.http.app`.

    ``api_keys``, ``keepalive_s`` and ``max_body_bytes`` change on a reload; the rest is fixed
    for the app's life.
    """

    gateway: Gateway
    api_keys: tuple[bytes, ...]  # empty: no key needed
    tokenize_limiter: trio.CapacityLimiter
    keepalive_s: float
    created: int  # unix time the app was built (the `created` of /v1/models)
    max_body_bytes: int
    pacer: LoadPacer | None = None  # adaptive SSE coalescing under load
    cutoff: Cutoff = field(default_factory=Cutoff)  # ends running requests at a drain's deadline
    registry: CollectorRegistry | None = None  # the app's metrics, served at GET /metrics
    peers: WorkerPeers | None = None  # the other workers (server.workers > 1), else None


Recorder = Callable[["RequestState", float], None]


@dataclass(slots=True)
class Call:
    """One request as its handler sees it: the body, the id, and what the app holds for it."""

    ctx: ApiContext
    request_id: str  # echoed in X-Request-Id (/generate's `rid` may replace it)
    body: bytes  # the whole request body
    nursery: trio.Nursery  # the app-wide nursery: home of n > 1 pumps
    writer: EventWriter | None  # direct SSE writes for this connection, where they apply
    recorder: Recorder | None = None  # the app's metrics recorder
    recorded: bool = False  # the recorder saw this request (errors must not count it again)
    logged: bool = False  # it wrote its own log line (a generation's, log_request)
    metrics: RequestMetrics | None = None  # the app's request metrics (embeddings record here)
    path_tail: str = ""  # a path template's part: the model of /v1/models/{model}

    async def json(self) -> dict[str, Any]:
        """The body as a JSON object (400 on anything else); a big one decoded and checked in
        a worker thread (:func:`off_the_loop`): checking how deep an 8 MB body of 600,000
        small arrays nests walked 2.4 million containers in Python, 1.3 s on the loop."""
        return await off_the_loop(self, decode_body, self.body)

    def record(self, state: RequestState, now: float) -> None:
        """``RequestState.recorder``: hand the finished request to the metrics recorder once
        (log_request, which writes its line next)."""
        self.recorded = self.logged = True
        if self.recorder is not None:
            self.recorder(state, now)

    def record_pooling(
        self,
        model: str,
        engine: str,
        *,
        prompt_tokens: int,
        queued_s: float,
        duration_s: float,
        failure: SmgdError | None = None,
        cancelled: bool = False,
    ) -> None:
        """An embedding request's one metrics record (:meth:`RequestMetrics.record_pooling`)."""
        self.recorded = True
        if self.metrics is not None:
            self.metrics.record_pooling(
                model, engine,
                prompt_tokens=prompt_tokens, queued_s=queued_s, duration_s=duration_s,
                failure=failure, cancelled=cancelled, draining=self.ctx.gateway.draining,
            )  # fmt: skip

    def new_state(self, kind: str, model: str) -> RequestState:
        state = RequestState(
            request_id=self.request_id,
            kind=kind,
            model=model,
            created=int(time.time()),
            t_start=trio.current_time(),
        )
        state.recorder = self.record
        return state


JSON_HEADERS: Mapping[str, str] = {"Content-Type": "application/json"}


@dataclass(slots=True)
class Reply:
    """A handler's answer: a JSON document, or an SSE body (an async iterator of events)."""

    body: bytes | AsyncGenerator[bytes, None]
    headers: Mapping[str, str]
    status: int = 200


def json_reply(payload: Any, status: int = 200, headers: Mapping[str, str] = JSON_HEADERS) -> Reply:
    """``payload`` as a JSON document."""
    return Reply(encode_json(payload), headers, status)


# A route's handler (smgd.api.handlers): 4xx/5xx errors are raised as SmgdErrors.
Handler = Callable[[Call], Awaitable[Reply]]


# The deepest JSON a request body may nest. A structured-output schema may nest 64 levels
# (smgd.sampling) inside a few levels of request; nothing a client sends legitimately comes near
# 128. Deeper bodies are refused on every Python alike: msgspec's own limit is the interpreter's
# recursion guard, which a 1,000-deep body trips on 3.11 but not on 3.12 (C recursion limit).
MAX_JSON_DEPTH = 128
_TOO_DEEP = f"the request body's JSON is nested too deeply (over {MAX_JSON_DEPTH} levels)"


def decode_body(data: bytes) -> dict[str, Any]:
    """A request body as a JSON object (400 on anything else)."""
    try:
        body = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        # msgspec decodes nested arrays and objects recursively, within the interpreter's
        # recursion guard: far deeper bodies trip it before MAX_JSON_DEPTH is checked.
        raise InvalidRequest(_TOO_DEEP) from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    # Fewer brackets than the limit cannot nest past it: two C-level counts spare the walk
    # for every ordinary body.
    if data.count(b"[") + data.count(b"{") > MAX_JSON_DEPTH and nested_deeper(body, MAX_JSON_DEPTH):
        raise InvalidRequest(_TOO_DEEP)
    return body


def resolve_model(gateway: Gateway, body: dict[str, Any]) -> tuple[str, ModelText]:
    model = body.get("model")
    if model is None:
        served = list(gateway.texts)
        if len(served) != 1:
            raise InvalidRequest("`model` is required", param="model")
        model = served[0]
    if not isinstance(model, str):
        raise InvalidRequest("`model` must be a string", param="model")
    adapter = gateway.router.adapter_of(model)  # a LoRA adapter runs its base model's text
    return model, gateway.text(model if adapter is None else adapter[0])


def context_len(gateway: Gateway, model: str) -> int | None:
    """The longest context among the model's engines that know theirs; None if none does yet."""
    adapter = gateway.router.adapter_of(model)
    base = model if adapter is None else adapter[0]
    lens = [e.info.max_model_len for e in gateway.router.engines() if e.info and base in e.models]
    return max(lens, default=None)


async def off_the_loop(call: Call, work: Callable[..., _T], *args: Any) -> _T:
    """``work(*args)``, in a worker thread (under the tokenizer's limiter) for a big request.

    For a request's pure-Python preparation, whose cost grows with its body: validating chat
    messages and tools and rendering the chat template. An 8 MB body of 90,000 tools or
    250,000 messages took 0.75-1.2 s of it, a pause of every stream on the loop. In a thread it
    still holds the GIL, but the loop gets it back every switch interval (5 ms), so streams
    go on; a small request runs inline, where a thread hop would cost more than the work.
    """
    if len(call.body) < BIG_BODY_BYTES:
        return work(*args)
    return await trio.to_thread.run_sync(work, *args, limiter=call.ctx.tokenize_limiter)


async def encode(
    tokenizer: Tokenizer,
    text: str,
    *,
    add_special_tokens: bool,
    limiter: trio.CapacityLimiter,
    context: int | None = None,
    param: str = "prompt",
) -> list[int]:
    """Token ids of ``text``; a big prompt in a worker thread under ``limiter``.

    With ``context`` (the model's context length), a text longer than that many tokens can
    possibly hold is refused at once (400 ``context_length_exceeded``, naming ``param``): the
    tokenizer never sees it. An 8 MB prompt took 26-45 s of tokenizer CPU before smgd found it
    too long; the character bound is the tokenizer's ``max_token_chars``.
    """
    [ids] = await encode_all(
        tokenizer,
        [text],
        add_special_tokens=add_special_tokens,
        limiter=limiter,
        context=context,
        param=param,
    )
    return ids


async def encode_all(
    tokenizer: Tokenizer,
    texts: Sequence[str],
    *,
    add_special_tokens: bool,
    limiter: trio.CapacityLimiter,
    context: int | None = None,
    param: str = "prompt",
) -> list[list[int]]:
    """Token ids of each of one request's ``texts`` (a batched prompt, embedding inputs), as
    :func:`encode` gives them, each checked against ``context`` first.

    Their sizes add up: 2,048 embedding inputs of 3,600 characters (7.4 MB), each under
    :data:`BIG_PROMPT_CHARS`, were tokenized inline one after the other and paused every
    stream for 2.4 s. Texts that are big together go to a worker thread in one ``encode_batch``.
    """
    if context is not None:
        for text in texts:
            if tokenizer.cannot_fit(text, context):
                raise _too_long(tokenizer, text, context, param)
    if sum(map(len, texts)) < BIG_PROMPT_CHARS:
        return [tokenizer.encode(text, add_special_tokens) for text in texts]
    return await trio.to_thread.run_sync(
        tokenizer.encode_many,
        list(texts),
        add_special_tokens,
        limiter=limiter,
    )


def _too_long(tokenizer: Tokenizer, text: str, context: int, param: str) -> InvalidRequest:
    what = "the chat rendered from your messages" if param == "messages" else "your prompt"
    return InvalidRequest(
        f"This model's maximum context length is {context} tokens. However, {what} is "
        f"{len(text)} characters long, more than {context} tokens can hold (a token stands "
        f"for at most {tokenizer.max_token_chars} characters). Please reduce its length.",
        param=param,
        code="context_length_exceeded",
    )


@dataclass(frozen=True, slots=True)
class ParamNames:
    """An endpoint's request keys for what :func:`check_engine` may refuse."""

    min_tokens: str = "min_tokens"
    prompt_logprobs: str = "prompt_logprobs"
    priority: str = "priority"


OPENAI_NAMES = ParamNames()


SamplingFor = Callable[[int, int], "tuple[SamplingParams, TextOptions]"]


def plan_jobs(
    gateway: Gateway,
    model: str,
    text: ModelText,
    prompts: list[list[int]],
    sampling_for: SamplingFor,
    state: RequestState,
    *,
    keep_ids: bool = False,
    top_logprobs_param: str = "top_logprobs",
    align_logprobs: bool = True,
    names: ParamNames = OPENAI_NAMES,
    prompt_logprobs_once: bool = False,
) -> tuple[list[Job], TextOptions]:
    """Pick an engine per choice, normalize sampling, validate; (prompts x n) jobs.

    ``top_logprobs_param`` names the request key of the top-k count in a 400 when an engine
    cannot return top-k logprobs; ``align_logprobs`` is :class:`LogprobTrack`'s ``aligned``;
    ``names`` are the endpoint's names of what an engine may refuse (:func:`check_engine`).
    ``prompt_logprobs_once``: the reply gives each prompt's logprobs once for all its choices
    (the OpenAI endpoints), so only a prompt's first choice asks the engine for them.
    """
    if not prompts:
        raise InvalidRequest("the prompt is empty", param="prompt")
    jobs: list[Job] = []
    options: TextOptions | None = None
    adapter = gateway.router.adapter_of(model)
    lora = None if adapter is None else adapter[1]
    for p_index, ids in enumerate(prompts):
        first = gateway.router.pick(model, ids)
        if first.info is None:
            raise EngineNotReady(f"engine {first.name} is not ready")
        params, options = sampling_for(len(ids), first.info.max_model_len)
        n = options.n
        if n * len(prompts) > MAX_CHOICES:
            raise InvalidRequest(
                f"{len(prompts)} prompt(s) x n={n} exceeds {MAX_CHOICES} choices", param="n"
            )
        rest = _without_prompt_logprobs(params) if prompt_logprobs_once and n > 1 else params
        for j in range(n):
            engine = first if j == 0 else gateway.router.pick(model, ids)
            sampling = for_choice(params if j == 0 else rest, j)
            req = GenerateRequest(
                rid=new_engine_rid(),
                prompt_ids=ids,
                sampling=sampling,
                priority=check_engine(engine, params, options.priority, names),
                lora=lora,
            )
            checked = engine.validate(req)
            _check_top_logprobs(engine, params.logprobs, top_logprobs_param)
            stream = TextStream(
                text.tokenizer,
                stops=options.stop,
                include_stop=options.include_stop_str_in_output,
                skip_special_tokens=options.skip_special_tokens,
                prompt_ids=ids,
                # The text an engine's own front end ends an output with: vLLM drops bytes of
                # an unfinished character at the end, SGLang (and TokenSpeed) decode them "�".
                keep_held=engine.wire != "vllm",
            )
            choice = Choice(
                p_index * n + j,
                req.rid,
                stream,
                prompt_tokens=len(ids),
                counts_prompt=j == 0,
                engine=engine.name,
                keep_ids=keep_ids,
                logprobs=(
                    None if params.logprobs is None else LogprobTrack(aligned=align_logprobs)
                ),
                prompt_logprobs=sampling.prompt_logprobs is not None,
            )
            jobs.append(Job(engine, req, choice, gateway.router, checked=checked))
            state.choices.append(choice)
    assert options is not None
    _check_prompt_logprobs(jobs, names)
    if options.ignored:
        log.debug("%s: ignored request keys %s", state.request_id, ", ".join(options.ignored))
    return jobs, options


def _check_prompt_logprobs(jobs: list[Job], names: ParamNames) -> None:
    """Refuse a request whose prompt logprobs would be over :data:`MAX_PROMPT_LOGPROBS`."""
    tokens = k = 0
    for job in jobs:
        asked = job.request.sampling.prompt_logprobs
        if asked is not None:
            tokens += len(job.request.prompt_ids)
            k = asked
    if tokens * (k + 1) > MAX_PROMPT_LOGPROBS:
        raise InvalidRequest(
            f"`{names.prompt_logprobs}`: the prompt logprobs asked for ({tokens} prompt tokens "
            f"x {k + 1} entries each) are more than the {MAX_PROMPT_LOGPROBS} entries a request "
            "may have; ask for fewer top logprobs, or send fewer or shorter prompts",
            param=names.prompt_logprobs,
        )


def _without_prompt_logprobs(params: SamplingParams) -> SamplingParams:
    """``params`` for a prompt's other choices when its first one asks for its logprobs.

    Every choice asked before: the engine computed them and sent them n times (with no prefix
    cache: SGLang's ``logprob_start_len`` 0 and vLLM's prompt logprobs skip it), and smgd
    decoded them n times on its loop (0.8 s for 16 choices of a 4,000-token prompt with 20 top
    logprobs). (SGLang's wire has one top-k count for both sides, the larger; its client cuts
    the first choice's output top lists back to the output's count, so every choice's output
    is alike.)
    """
    if params.prompt_logprobs is None:
        return params
    return msgspec.structs.replace(params, prompt_logprobs=None)


def check_engine(
    engine: EngineClient, params: SamplingParams, priority: int | None, names: ParamNames
) -> int | None:
    """Refuse what ``engine`` cannot do (400 naming the request key); the priority to send.

    - ``min_tokens`` on an SGLang scheduler without the model's tokenizer: 0.5.23's reads the
      min-new-tokens stop ids from the tokenizer object, which ``--skip-tokenizer-init`` leaves
      out (its own front end refuses it in that mode; the scheduler would crash). Schedulers
      smgd launches load it unless grammar backend "none" (:func:`sglang_has_tokenizer`); for
      one smgd does not launch, smgd cannot tell, so it refuses.
    - Prompt logprobs on TokenSpeed: its engine refuses any ``logprob_start_len`` but -1.
    - A non-zero ``priority`` where the engine does not schedule by priority (``[[engines]]
      scheduling``); vLLM refuses it then, SGLang would ignore it. An engine that does gets
      0 for a request without one: SGLang would otherwise run such requests last.
    """
    wire = engine.wire
    config = engine.config
    if (
        params.min_tokens
        and wire == "sglang"
        and not is_mock(config)
        and not sglang_has_tokenizer(config)
    ):
        raise InvalidRequest(
            f"`{names.min_tokens}` is not available on engine {engine.name}: an SGLang "
            "scheduler without its tokenizer (--skip-tokenizer-init, grammar backend none, or "
            "not launched by smgd) cannot apply it",
            param=names.min_tokens,
        )
    if params.prompt_logprobs is not None and wire == "tokenspeed":
        raise InvalidRequest(
            f"`{names.prompt_logprobs}`: engine {engine.name} (tokenspeed) returns no prompt "
            "logprobs",
            param=names.prompt_logprobs,
        )
    if config.scheduling != "priority":
        if priority:
            raise InvalidRequest(
                f"`{names.priority}`: engine {engine.name} does not schedule by priority "
                '(its [[engines]] scheduling is not "priority")',
                param=names.priority,
            )
        return None
    return priority or 0


def _check_top_logprobs(engine: EngineClient, k: int | None, param: str) -> None:
    limit = engine.max_top_logprobs
    if k is not None and limit is not None and k > limit:
        raise InvalidRequest(
            f"top_logprobs: engine {engine.name} ({engine.wire}) returns only the sampled "
            f"token's logprob; ask for {limit} top logprobs at most",
            param=param,
        )
