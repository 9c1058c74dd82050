"""``POST /v1/embeddings``: OpenAI's embeddings endpoint, served by engines with
``task = "embed"`` (SGLang's embedding requests, vLLM's pooling path).

Every 4xx comes before any engine sees the request: the body (:mod:`smgd.api.core.embed`), the
model (404 unknown, 400 naming ``model`` when it is not served for embeddings), ``dimensions``
against the model's config.json, each input tokenized (strings with the model's special tokens,
as both engines' own servers do, unless ``add_special_tokens`` is false) and checked by its
engine (vocabulary, context length). Then one engine request per input runs
(:mod:`smgd.api.core.embed_run`), and the vectors come back in input order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from smgd.api.core.embed import check_dimensions, embedding_response, parse_embed_request
from smgd.api.core.embed_run import EmbedJob, run_embeddings
from smgd.api.core.pipeline import new_engine_rid
from smgd.api.core.prepare import context_len, encode_all, json_reply, resolve_model
from smgd.errors import InvalidRequest, SmgdError
from smgd.wire.common import EmbedRequest

if TYPE_CHECKING:
    from smgd.api.core.prepare import Call, Reply
    from smgd.gateway import Gateway

__all__ = ["embeddings_reply", "model_task"]


def model_task(gateway: Gateway, model: str) -> str:
    """The task the engines serving ``model`` run (config.validate keeps it one per model)."""
    for engine in gateway.config.engines:
        if model in engine.models:
            return engine.task
    return "generate"


async def embeddings_reply(call: Call) -> Reply:
    """``POST /v1/embeddings``."""
    ctx = call.ctx
    gateway = ctx.gateway
    body = await call.json()
    model, text = resolve_model(gateway, body)
    task = model_task(gateway, model)
    if task != "embed":
        raise InvalidRequest(
            f"The model `{model}` is not an embedding model (it is served for {task}).",
            param="model",
        )
    params = parse_embed_request(body)
    check_dimensions(params.dimensions, model, text.config_json)
    context = context_len(gateway, model)
    encoded = iter(
        await encode_all(
            text.tokenizer,
            [item.text for item in params.inputs if item.text is not None],
            add_special_tokens=params.add_special_tokens,
            limiter=ctx.tokenize_limiter,
            context=context,
            param="input",
        )
    )
    prompts = [next(encoded) if item.ids is None else item.ids for item in params.inputs]
    t_start = trio.current_time()  # where a completion's clock starts: input tokenized
    jobs: list[EmbedJob] = []
    for ids in prompts:
        engine = gateway.router.pick(model, ids)
        req = EmbedRequest(rid=new_engine_rid(), prompt_ids=ids, dimensions=params.dimensions)
        checked = engine.validate(req)
        jobs.append(EmbedJob(engine, req, router=gateway.router, model=model, checked=checked))
    failure: SmgdError | None = None
    ended = cancelled = False
    try:
        await run_embeddings(jobs, ctx.cutoff)
        ended = True
    except SmgdError as err:
        failure = err
        raise
    except trio.Cancelled:  # the client left
        cancelled = True
        raise
    finally:
        # Once per request. Anything else is a bug: the dispatcher counts it (internal_error).
        if ended or failure is not None or cancelled:
            call.record_pooling(
                model, jobs[0].engine.name,
                prompt_tokens=_prompt_tokens(jobs),
                queued_s=max(job.queued_s for job in jobs),
                duration_s=trio.current_time() - t_start,
                failure=failure, cancelled=cancelled,
            )  # fmt: skip
    vectors = [job.vector or [] for job in jobs]
    return json_reply(
        embedding_response(model, vectors, _prompt_tokens(jobs), params.encoding_format)
    )


def _prompt_tokens(jobs: list[EmbedJob]) -> int:
    """The request's prompt tokens: each input's as its engine counted it, else its ids."""
    return sum(job.prompt_tokens or len(job.request.prompt_ids) for job in jobs)
