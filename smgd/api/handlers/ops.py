"""Operational endpoints: health, readiness, models, tokenize/detokenize.

- ``GET /health`` and ``GET /liveness``: 200 whenever the event loop answers (a failing
  liveness probe restarts the process, so it checks nothing else).
- ``GET /readiness``: 200 only when every required engine is ready and smgd is not draining;
  otherwise 503 with a reason per engine (its state, its last error, how often it restarted).
- ``GET /v1/models``: served model names with the context length the engines reported at
  their handshake (``max_model_len``), falling back to the model's config.json; then the LoRA
  adapters, each with its base model as ``parent``.
- ``GET /v1/models/{model}``: one of those cards (the id may hold ``/``); 404
  ``model_not_found`` for a name it does not list.
- ``POST /v1/tokenize`` (also ``/tokenize``): ``{"model", "prompt" | "messages",
  "add_special_tokens"}`` → ``{"tokens", "count", "max_model_len"}``.
- ``POST /v1/detokenize`` (also ``/detokenize``): ``{"model", "tokens"}`` → ``{"prompt"}``.
- ``GET /metrics``: Prometheus text from the app's private registry (:mod:`smgd.metrics`).
- ``GET /get_load``: SGLang-style load, one entry per engine (``docs/reference/metrics.md``).

With several workers (``server.workers``), ``/readiness``, ``/metrics`` and ``/get_load``
answer for all of them: this worker asks the others (:mod:`smgd.worker_peers`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import generate_latest

from smgd.api.core.prepare import (
    JSON_HEADERS,
    Reply,
    encode,
    json_reply,
    off_the_loop,
    resolve_model,
)
from smgd.api.core.sse import encode_json
from smgd.api.handlers.openai import render_chat, template_kwargs
from smgd.errors import InvalidRequest, ModelNotFound
from smgd.worker_peers import ask_all, merge_load, merge_metrics, merge_readiness

if TYPE_CHECKING:
    from smgd.api.core.prepare import Call
    from smgd.gateway import Gateway, ModelText

__all__ = [
    "detokenize",
    "get_load",
    "health",
    "load_answer",
    "load_report",
    "metrics",
    "model_cards",
    "models",
    "readiness",
    "readiness_answer",
    "readiness_report",
    "retrieve_model",
    "tokenize",
]

TEXT_0_0_4 = "text/plain; version=0.0.4; charset=utf-8"
# A failing readiness probe asks again after this many seconds.
_NOT_READY_HEADERS = {**JSON_HEADERS, "Retry-After": "5"}


async def health(call: Call) -> Reply:
    """``GET /health``, ``GET /liveness``."""
    return json_reply({"status": "ok"})


def readiness_report(gateway: Gateway) -> tuple[bool, dict[str, Any]]:
    """(ready, report): every required engine ready, and not draining."""
    engines = {e.name: e for e in gateway.router.engines()}
    report: dict[str, Any] = {}
    ready = not gateway.draining
    for config in gateway.config.engines:
        engine = engines.get(config.name)
        state = engine.state_name if engine is not None else "absent"
        up = engine is not None and engine.ready
        if config.required and not up:
            ready = False
        report[config.name] = {
            "state": state,
            "ready": up,
            "required": config.required,
            # Kept across relaunches: a crash or handshake loop shows why, not null.
            "last_error": engine.last_error if engine is not None else None,
            "restarts": gateway.engine_restarts.get(config.name, 0),
        }
    status = "ready" if ready else ("draining" if gateway.draining else "not_ready")
    return ready, {"status": status, "draining": gateway.draining, "engines": report}


def readiness_answer(gateway: Gateway) -> bytes:
    """This worker's readiness, as its peers ask for it (smgd.worker_peers)."""
    ready, report = readiness_report(gateway)
    return encode_json({"ready": ready, "report": report})


async def readiness(call: Call) -> Reply:
    """``GET /readiness``."""
    gateway, peers = call.ctx.gateway, call.ctx.peers
    if peers is None:
        ready, report = readiness_report(gateway)
    else:  # with workers: ready only if every worker is
        answers = await ask_all(peers, "readiness", readiness_answer(gateway))
        ready, report = merge_readiness(answers)
    if ready:
        return json_reply(report)
    return json_reply(report, 503, _NOT_READY_HEADERS)


def model_cards(gateway: Gateway, created: int) -> list[dict[str, Any]]:
    table = gateway.router.models()
    cards = []
    for model, text in gateway.texts.items():
        lens = [e.info.max_model_len for e in table.get(model, []) if e.info is not None]
        cards.append(
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "smgd",
                "root": str(text.model_dir),
                "parent": None,
                "max_model_len": min(lens) if lens else text.max_model_len,
                "ready": any(e.ready for e in table.get(model, [])),
            }
        )
    return cards + adapter_cards(gateway, cards, created)


def adapter_cards(
    gateway: Gateway, models: list[dict[str, Any]], created: int
) -> list[dict[str, Any]]:
    """A card per LoRA adapter, as vLLM lists them: ``parent`` is the base model, ``root``
    the adapter's directory; the context length and readiness are the base model's."""
    base = {card["id"]: card for card in models}
    cards: dict[str, dict[str, Any]] = {}
    for engine in gateway.router.engines():
        for adapter in engine.lora:
            parent = base.get(engine.models[0])
            if adapter.name in cards or parent is None:
                continue  # one card per adapter, however many engines hold it
            cards[adapter.name] = {
                **parent,
                "id": adapter.name,
                "created": created,
                "root": adapter.path,
                "parent": parent["id"],
            }
    return list(cards.values())


async def models(call: Call) -> Reply:
    """``GET /v1/models``."""
    ctx = call.ctx
    return json_reply({"object": "list", "data": model_cards(ctx.gateway, ctx.created)})


async def retrieve_model(call: Call) -> Reply:
    """``GET /v1/models/{model}`` (the OpenAI SDK's ``models.retrieve``): the card ``GET
    /v1/models`` lists for that id, whatever kind of model it is."""
    ctx = call.ctx
    model = call.path_tail
    for card in model_cards(ctx.gateway, ctx.created):
        if card["id"] == model:
            return json_reply(card)
    raise ModelNotFound(
        f"The model `{model}` does not exist.", param="model", code="model_not_found"
    )


async def tokenize(call: Call) -> Reply:
    """``POST /v1/tokenize``, ``POST /tokenize``."""
    ctx = call.ctx
    body = await call.json()
    model, text = resolve_model(ctx.gateway, body)
    tokenizer = text.tokenizer
    special = body.get("add_special_tokens")
    if special is not None and not isinstance(special, bool):
        raise InvalidRequest("`add_special_tokens` must be a boolean", param="add_special_tokens")
    if "messages" in body:
        # Rendered as the chat endpoint renders it (tools, chat_template_kwargs), so the count
        # is that of the prompt a chat request with the same keys gets.
        _, prompt = await off_the_loop(call, render_chat, text, body, template_kwargs(body))
        ids = await encode(
            tokenizer, prompt, add_special_tokens=bool(special), limiter=ctx.tokenize_limiter
        )
    else:
        raw = body.get("prompt")
        if not isinstance(raw, str):
            raise InvalidRequest("`prompt` (a string) or `messages` is required", param="prompt")
        ids = await encode(
            tokenizer, raw, add_special_tokens=special is not False, limiter=ctx.tokenize_limiter
        )
    lens = [e.info.max_model_len for e in ctx.gateway.router.models().get(model, []) if e.info]
    return json_reply(
        {
            "tokens": ids,
            "count": len(ids),
            "max_model_len": min(lens) if lens else text.max_model_len,
        }
    )


async def detokenize(call: Call) -> Reply:
    """``POST /v1/detokenize``, ``POST /detokenize``."""
    body = await call.json()
    _, text = resolve_model(call.ctx.gateway, body)
    # Checking and decoding 2.6 million ids (an 8 MB body) took 0.7 s: a big body's go to a
    # worker thread, and the batch decode there lets the GIL go.
    prompt = await off_the_loop(call, _detokenize, text, body.get("tokens"))
    return json_reply({"prompt": prompt})


def _detokenize(text: ModelText, tokens: Any) -> str:
    vocab = text.vocab_size
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
    ):
        raise InvalidRequest(
            f"`tokens` must be an array of token ids in [0, {vocab})", param="tokens"
        )
    [prompt] = text.tokenizer.decode_many([tokens], skip_special_tokens=False)
    return prompt


async def metrics(call: Call) -> Reply:
    """``GET /metrics``."""
    ctx = call.ctx
    assert ctx.registry is not None, "the app has no metrics registry"
    body = generate_latest(ctx.registry)
    if ctx.peers is not None:  # with workers, one scrape covers them all (smgd.worker_peers)
        body = merge_metrics(await ask_all(ctx.peers, "metrics", body), ctx.peers.count)
    # The classic text format's content type: every Prometheus/agent version parses it (the
    # client's default advertises version=1.0.0, which older scrapers do not know).
    return Reply(body, {"Content-Type": TEXT_0_0_4})


def load_report(gateway: Gateway) -> list[dict[str, Any]]:
    """SGLang ``/get_load`` shape, one entry per engine (``dp_rank`` = position).

    ``num_reqs`` counts everything smgd holds for the engine (in flight + admission queue);
    ``num_waiting_reqs`` is the engine-reported waiting queue plus smgd's admission queue.
    ``num_running_reqs`` and ``token_usage`` come from the engine's own load report when its
    wire carries one (else in-flight and null).
    """
    out: list[dict[str, Any]] = []
    for rank, engine in enumerate(gateway.router.engines()):
        stats = engine.statistics()
        load = stats.load
        out.append(
            {
                "dp_rank": rank,
                "engine": stats.name,
                "models": list(engine.models),
                "wire": stats.wire,
                "state": stats.state,
                "num_reqs": stats.in_flight + stats.queue_depth,
                "num_running_reqs": load.running if load is not None else stats.in_flight,
                "num_waiting_reqs": (load.waiting if load is not None else 0) + stats.queue_depth,
                "num_inflight_reqs": stats.in_flight,
                "num_queued_reqs": stats.queue_depth,
                "token_usage": load.kv_usage if load is not None else None,
            }
        )
    return out


def load_answer(gateway: Gateway) -> bytes:
    """This worker's load report, as its peers ask for it (smgd.worker_peers)."""
    return encode_json(load_report(gateway))


async def get_load(call: Call) -> Reply:
    """``GET /get_load``."""
    gateway, peers = call.ctx.gateway, call.ctx.peers
    if peers is None:
        return json_reply(load_report(gateway))
    # With workers: every worker's engines, in worker order, dp_rank renumbered over them all.
    return json_reply(merge_load(await ask_all(peers, "load", load_answer(gateway))))
