"""The part of an engine client that every one of its tasks shares.

:class:`ClientCore` holds the client's state (the requests in flight, in the order they were
sent, and what is kept of each; the engine's state and death; the counters), delivers each
decoded delta to its request's stream (:meth:`ClientCore.deliver`, the hot path), declares the
engine dead (:meth:`ClientCore.die`) and names the wire's hooks. What runs over it
are modules of their own, functions of the client that import nothing above this one: the
reader (:mod:`smgd.engines.reader`), the watchdogs (:mod:`smgd.engines.watchdogs`), the output
watch (:mod:`smgd.engines.output_watch`) and a request's checks
(:mod:`smgd.engines.validation`). :class:`~smgd.engines.base.EngineClient` adds the lifecycle,
the sender and the request interface, and each wire family subclasses it.
"""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from smgd.admission import Admission
from smgd.engines.lora import LoraTable
from smgd.engines.state import EngineState
from smgd.engines.stream import RequestStream, StreamState, fail_all
from smgd.errors import EngineDead
from smgd.wire.common import Finish, FinishReason

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from smgd.config import EngineConfig
    from smgd.errors import EngineError
    from smgd.wire.common import EngineInfo, EngineLoad, EngineRequest, LoraAdapter, TokenDelta
    from smgd.zmq_trio import TrioSocket

log = logging.getLogger("smgd.engine")


class ClientCore:
    """State, delivery, death and hooks; subclasses implement the wire-specific hooks below."""

    wire: str = "?"
    # How many tokens below max_model_len an embedding input must stay: SGLang refuses an input
    # of context_len tokens or more (TokenizerManager's "longer than the model's context
    # length"), vLLM takes up to max_model_len.
    embed_len_margin: int = 0
    # The most top-k logprobs this wire can return (None: any). Checked before a request is
    # sent: an encoder refusing it at send time would be after a stream's 200 went out.
    max_top_logprobs: int | None = None

    def __init__(
        self,
        config: EngineConfig,
        *,
        fallback_info: EngineInfo | None,
        adapters: Sequence[LoraAdapter] = (),
    ) -> None:
        self.config = config
        self.name = config.name
        self.models = tuple(config.models)
        # LoRA adapters served on this engine (smgd.engines.lora): the start-up ones now,
        # run-time ones as load_adapter() adds them.
        self.lora = LoraTable(config.lora, list(adapters))
        self.state = EngineState.STARTING
        self.info: EngineInfo | None = None
        self.load: EngineLoad | None = None
        self.last_error: str | None = None
        self.ready_at: float | None = None  # trio time it became ready (the backoff's health)
        # Set when a reload replaces this engine: no new requests, in-flight ones finish.
        self.draining = False
        self._fallback_info = fallback_info
        self._streams: dict[str, RequestStream] = {}
        # rid -> the request parameter of its structured-output constraint, for the requests
        # that have one: an engine's refusal of the grammar becomes a 400 naming it.
        self._constrained: dict[str, str] = {}
        # Requests sent and perhaps without output yet: their rows go first when the reader
        # delivers a message in slices (a superset: cleared there and when a stream closes).
        self._fresh: set[str] = set()
        self._outbox_send, self._outbox_recv = trio.open_memory_channel[list[bytes]](math.inf)
        self._ready = trio.Event()
        self._dead = trio.Event()
        self._death: EngineDead | None = None
        self._last_frame = 0.0
        # Set (and replaced) by reconfigure(): wakes the timer tasks to re-read the settings.
        self._reconfigured = trio.Event()
        self._decode_streak = 0
        self._decode_errors = 0
        self._requests_total = 0
        self._tokens_total = 0
        self.admission = Admission(
            max_inflight=config.max_inflight,
            max_queue=config.max_queue,
            queue_timeout_s=config.queue_timeout_s,
        )

    @property
    def task(self) -> str:
        """``generate`` or ``embed``: what requests this engine's model serves."""
        return self.config.task

    def die(self, reason: str) -> None:
        """Declare the engine dead: fail every stream (each with its own error), stop run()."""
        if self._death is not None:
            return
        self.state = EngineState.DEAD
        self.last_error = reason
        message = f"engine {self.name} failed: {reason}"
        self._death = EngineDead(message)
        failed = fail_all(self._streams, partial(EngineDead, message))
        log.error("engine %s dead: %s (%d in-flight request(s) failed)", self.name, reason, failed)
        self._dead.set()

    # ------------------------------------------------------------------ demux helpers

    def deliver(self, delta: TokenDelta) -> None:
        """Route one decoded delta to its stream (called by the subclass's frame handler)."""
        stream = self._streams.get(delta.rid)
        if stream is None:
            if delta.finish is not None:
                self._forget(delta.rid)
            return  # finished or aborted locally already; late frames are expected
        n = len(delta.token_ids)
        self._tokens_total += n
        stream.tokens += n
        if stream.tokens > stream.limit:  # one comparison per delta on the hot path
            self._cut_at_limit(stream, delta)
        if delta.finish is not None and self._constrained:
            self._name_refused_constraint(delta)
        stream.push(delta)
        if delta.finish is not None:
            del self._streams[delta.rid]
            self._forget(delta.rid)

    def _cut_at_limit(self, stream: RequestStream, delta: TokenDelta) -> None:
        """``delta`` takes ``stream`` past its max_tokens: keep the tokens up to it and end the
        request there with a ``length`` finish, as the engine should have. An engine that had
        not finished it (it ignores max_tokens) would stream on forever: it gets an abort."""
        over = stream.tokens - stream.limit
        keep = len(delta.token_ids) - over
        del delta.token_ids[keep:]
        if delta.logprobs is not None:
            del delta.logprobs[keep:]
        stream.tokens = stream.limit
        delta.completion_tokens = None  # the engine's count includes what was cut
        if delta.finish is None:
            log.warning(
                "engine %s ran past max_tokens on request %s without finishing it: "
                "cut there and aborted",
                self.name,
                delta.rid,
            )
            self._outbox_send.send_nowait(self._encode_abort(delta.rid))
        delta.finish = Finish(reason=FinishReason.LENGTH)

    def _untrack(self, rid: str) -> None:
        """Take request ``rid`` out of the requests in flight and the tables kept beside them
        (a request that ends early: left by its client, failed alone, or its frame lost).
        A request whose final delta came leaves through :meth:`deliver` instead."""
        self._streams.pop(rid, None)
        self._fresh.discard(rid)
        self._constrained.pop(rid, None)

    def fail_alone(self, streams: Iterable[RequestStream], error: Callable[[], EngineError]) -> int:
        """Fail each of ``streams`` (still open) with an error of its own from ``error()``,
        take it out of the requests in flight and, while the engine serves (draining
        included), abort it there: the engine lives on and would otherwise run it for nobody.
        Returns how many failed. The one way out for a request that fails while its engine
        does not (a deadline, a silence the engine answers a probe for, a frame smgd could not
        decode or never got); the caller logs why."""
        failed = 0
        serving = self.state is EngineState.READY
        for stream in streams:
            rid = stream.rid
            self._untrack(rid)
            if stream.state is StreamState.OPEN:
                stream.fail(error())
                failed += 1
            if serving:
                self._outbox_send.send_nowait(self._encode_abort(rid))
        return failed

    def _silent_since(self) -> float:
        """Since when the engine has been silent with requests in flight, for the silence
        watchdog: its last frame (a data-parallel client looks at each rank)."""
        return self._last_frame

    def _forget(self, rid: str) -> None:
        """Request ``rid`` ended (its final delta came): drop what the wire client kept of it.

        A hook rather than an override of :meth:`deliver`, which runs once per token. Default:
        nothing kept."""

    def _name_refused_constraint(self, delta: TokenDelta) -> None:
        """A constrained request the engine ended because of its grammar (no backend, a schema
        or grammar the backend cannot compile) finishes as a 400 naming the parameter."""
        param = self._constrained.get(delta.rid)
        reason = None if param is None else self._grammar_refusal(delta)
        if reason is None:
            return
        delta.finish = Finish(
            reason=FinishReason.ABORT,
            message=f"engine {self.name} could not apply the structured output constraint in "
            f"`{param}`: {reason}",
            status_code=400,
            param=param,
        )

    def _grammar_refusal(self, delta: TokenDelta) -> str | None:
        """Why the engine refused a constrained request's grammar, if this final delta says so.

        Default (SGLang): an abort whose message is about the grammar ("Failed to compile json
        grammar: ...", "Grammar-based generation ... --grammar-backend none", "Grammar
        preprocessing timed out").
        """
        finish = delta.finish
        assert finish is not None
        message = finish.message or ""
        if finish.reason is FinishReason.ABORT and "grammar" in message.lower():
            return message
        return None

    # ------------------------------------------------------------------ hooks

    async def _open(self, nursery: trio.Nursery) -> None:
        raise NotImplementedError

    async def _become_ready(self) -> EngineInfo:
        raise NotImplementedError

    async def _close(self) -> None:
        raise NotImplementedError

    def _input_socket(self) -> TrioSocket:
        raise NotImplementedError

    def _output_socket(self) -> TrioSocket:
        raise NotImplementedError

    def _encode_request(self, req: EngineRequest) -> list[bytes]:
        raise NotImplementedError

    def _encode_abort(self, rid: str) -> list[bytes]:
        raise NotImplementedError

    def _decode_frames(self, frames: list[Any]) -> Sequence[TokenDelta]:
        """One output message's deltas, to be delivered in order (the subclass's bookkeeping
        of the message, such as health answers and queue times, done). Raises WireError."""
        raise NotImplementedError

    async def answers_probe(self, limit_s: float) -> bool:
        """Whether the engine answers a health probe within ``limit_s`` (it does not die of
        an unanswered one). Default: this wire has no probe, so no."""
        await trio.lowlevel.checkpoint()
        return False

    async def probe_health(self, limit_s: float) -> None:
        """Check the engine answers; call :meth:`die` if not. Default: no probe on this wire."""
        await trio.lowlevel.checkpoint()
