"""An in-process fake engine and app harness for the HTTP tests: no sockets, deterministic.

:class:`FakeEngine` subclasses :class:`~smgd.engines.base.EngineClient` and overrides the
wire hooks: ``_encode_request`` records the request and starts a driver task that pushes
:class:`~smgd.wire.common.TokenDelta` s through ``deliver()`` (or ``die()``), one engine step
per ``step_s``; ``_encode_abort`` records the abort. Everything else (``open_stream``, the
abort-on-early-exit, validation, stream coalescing) is the real base class.

:func:`open_app` builds a :class:`~smgd.gateway.Gateway` over the shipped tiny model with fake
engines in its router, and yields smgd's app with its lifespan running; :func:`post`,
:func:`get` and :func:`post_stream` call it in process (:mod:`tests.asgi_client`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from smgd.api.http.app import create_app
from smgd.api.http.dispatch import Dispatcher
from smgd.config import Config, EngineConfig, ServerConfig, WireFamily
from smgd.engines.base import EngineClient
from smgd.engines.delivery import DELIVERY
from smgd.engines.state import EngineState
from smgd.gateway import Gateway
from smgd.wire.common import (
    EngineInfo,
    EngineRequest,
    Finish,
    FinishReason,
    GenerateRequest,
    TokenDelta,
)
from tests.asgi_client import connect, http_scope, lifespan, request

TINY_MODEL = Path(__file__).resolve().parents[1] / "smgd" / "assets" / "tiny-model"
MODEL = "tiny"
EOS = 2  # the tiny model's </s>


@dataclass
class Behaviour:
    """How the fake engine answers every request (tests mutate ``engine.behaviour``)."""

    output: Sequence[int] = ()  # ids to emit, cycled; empty: count up from id 300
    tokens_per_step: int = 1
    step_s: float = 0.01
    first_step_s: float | None = None  # delay before the first output (prefill)
    eos_after: int | None = None  # emit EOS as token k+1 and finish STOP
    die_after: int | None = None  # after this many tokens, the engine dies
    finish: Finish | None = None  # finish with this after the first step (engine abort...)
    cached_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class FakeEngine(EngineClient):
    wire = "fake"

    def __init__(
        self,
        name: str = "fake",
        *,
        models: Sequence[str] = (MODEL,),
        max_model_len: int = 4096,
        vocab_size: int = 1024,
        behaviour: Behaviour | None = None,
    ) -> None:
        config = EngineConfig(
            name=name, wire=WireFamily.MOCK, models=list(models), model_dir=str(TINY_MODEL)
        )
        super().__init__(config, fallback_info=None)
        self.behaviour = behaviour or Behaviour()
        self._info = EngineInfo(max_model_len=max_model_len, vocab_size=vocab_size)
        self.requests: list[GenerateRequest] = []
        self.aborts: list[str] = []
        self.abort_times: dict[str, float] = {}
        self._abort_event = trio.Event()
        self._nursery: trio.Nursery | None = None

    # ---- lifecycle: no sockets, ready at once
    async def run(
        self, *, task_status: trio.TaskStatus[EngineClient] = trio.TASK_STATUS_IGNORED
    ) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.info = self._info
            self.state = EngineState.READY
            self._ready.set()
            nursery.start_soon(self._drain_outbox)
            task_status.started(self)
            await trio.sleep_forever()

    async def _drain_outbox(self) -> None:
        async for _ in self._outbox_recv:
            pass

    # ---- wire hooks
    def _encode_request(self, req: EngineRequest) -> list[bytes]:
        assert isinstance(req, GenerateRequest), "the fake engine only generates"
        self.requests.append(req)
        assert self._nursery is not None, "start the engine with nursery.start(engine.run)"
        self._nursery.start_soon(self._drive, req)
        return [b"request", req.rid.encode()]

    def _encode_abort(self, rid: str) -> list[bytes]:
        self.aborts.append(rid)
        self.abort_times[rid] = trio.current_time()
        self._abort_event.set()
        self._abort_event = trio.Event()
        return [b"abort", rid.encode()]

    async def wait_abort(self, rid: str) -> None:
        while rid not in self.aborts:
            await self._abort_event.wait()

    # ---- the scripted scheduler
    def _deliver_held(self, delta: TokenDelta) -> None:
        """Deliver as the real reader does: direct writes held to the delivery's end."""
        with DELIVERY:
            self.deliver(delta)

    def _token(self, i: int) -> int:
        out = self.behaviour.output
        return out[i % len(out)] if out else 300 + i % 500

    async def _drive(self, req: GenerateRequest) -> None:
        b = self.behaviour
        await trio.sleep(b.first_step_s if b.first_step_s is not None else b.step_s)
        sent = 0
        first = True
        while req.rid in self._streams:
            if b.finish is not None:
                self._deliver_held(TokenDelta(rid=req.rid, token_ids=[], finish=b.finish))
                return
            ids: list[int] = []
            finish: Finish | None = None
            for _ in range(b.tokens_per_step):
                if b.eos_after is not None and sent == b.eos_after:
                    ids.append(EOS)
                    sent += 1
                    finish = Finish(reason=FinishReason.STOP, matched_token=EOS)
                    break
                ids.append(self._token(sent))
                sent += 1
                if sent >= req.sampling.max_tokens:
                    finish = Finish(reason=FinishReason.LENGTH)
                    break
            self._deliver_held(
                TokenDelta(
                    rid=req.rid,
                    token_ids=ids,
                    finish=finish,
                    prompt_tokens=len(req.prompt_ids) if first else None,
                    completion_tokens=sent,
                    cached_tokens=b.cached_tokens if first else None,
                )
            )
            first = False
            if finish is not None:
                return
            if b.die_after is not None and sent >= b.die_after:
                self.die("fake engine crashed")
                return
            await trio.sleep(b.step_s)


class DiesBeforeFirstToken(FakeEngine):
    """An engine that crashes during every request's prefill (a retry's case)."""

    async def _drive(self, req: GenerateRequest) -> None:
        await trio.sleep(0.01)
        self.die("crashed during prefill")


@asynccontextmanager
async def open_gateway(
    *engines: FakeEngine, server: ServerConfig | None = None
) -> AsyncIterator[Gateway]:
    """A gateway over the tiny model whose router holds ``engines`` (started here)."""
    engines = engines or (FakeEngine(),)
    config = Config(
        server=server or ServerConfig(),
        engines=[e.config for e in engines],
    )
    gateway = Gateway.from_config(config)
    async with trio.open_nursery() as nursery:
        for engine in engines:
            await nursery.start(engine.run)
            gateway.router.put(engine)
        yield gateway
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def open_app(
    *engines: FakeEngine, server: ServerConfig | None = None, environ: dict[str, str] | None = None
) -> AsyncIterator[tuple[Dispatcher, Gateway]]:
    async with open_gateway(*engines, server=server) as gateway:
        app = create_app(gateway, environ=environ or {})
        async with lifespan(app):
            yield app, gateway


# --------------------------------------------------------------------------- HTTP helpers


@dataclass
class Reply:
    status: int
    headers: httpx.Headers  # looked up in any case, as clients do
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class SseReply:
    status: int
    headers: httpx.Headers
    raw: bytes
    events: list[str]  # the payload of every `data:` line, in order
    comments: int  # `: ...` comment lines (keep-alives)
    disconnected_at: float | None = None

    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]


async def post(
    app: Dispatcher, path: str, body: Any, headers: dict[str, str] | None = None
) -> Reply:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    answer = await request(app, "POST", path, data, headers)
    return Reply(answer.status, httpx.Headers(answer.headers), answer.body)


async def get(app: Dispatcher, path: str, headers: dict[str, str] | None = None) -> Reply:
    answer = await request(app, "GET", path, b"", headers)
    return Reply(answer.status, httpx.Headers(answer.headers), answer.body)


def parse_sse(raw: bytes) -> tuple[list[str], int]:
    events: list[str] = []
    comments = 0
    assert raw.endswith(b"\n\n") or not raw, raw[-80:]
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        if block.startswith(":"):
            comments += 1
            continue
        assert block.startswith("data: "), block
        events.append(block[len("data: ") :])
    return events, comments


async def post_stream(
    app: Dispatcher,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    *,
    disconnect_after: int | None = None,
) -> SseReply:
    """POST and read the SSE body; with ``disconnect_after``, hang up after that many reads.

    After a hang-up the app gets a second to end its call (it must not wait for the stream).
    """
    payload = json.dumps(body).encode()
    raw = bytearray()
    disconnected_at: float | None = None
    scope = http_scope("POST", path, headers, length=len(payload))
    with trio.CancelScope() as cancel:
        async with connect(app, scope) as conn:
            conn.send(payload)
            reads = 0
            while True:
                try:
                    raw += await conn.receive()
                except trio.EndOfChannel:
                    break
                reads += 1
                if disconnect_after is not None and reads >= disconnect_after:
                    conn.disconnect()
                    disconnected_at = trio.current_time()
                    cancel.deadline = disconnected_at + 1.0
                    break
    assert not cancel.cancelled_caught, "the app did not end its call after the hang-up"
    assert conn.status is not None
    # A stream that failed before its first event is answered whole (a JSON error): no events.
    sse = httpx.Headers(conn.headers).get("content-type", "").startswith("text/event-stream")
    events, comments = parse_sse(bytes(raw)) if sse else ([], 0)
    return SseReply(
        conn.status, httpx.Headers(conn.headers), bytes(raw), events, comments, disconnected_at
    )
