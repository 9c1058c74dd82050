"""The trio shell around :mod:`smgd.api.core.pipeline`: run a request's engine streams.

- :func:`collect`: non-streamed; one task per choice, the first error cancels the rest.
- :func:`stream`: an async generator of SSE bytes for the response body. One choice (the hot
  path) reads its :class:`~smgd.engines.stream.RequestStream` directly: one event per
  ``receive()``, which already coalesces everything the engine sent since the last read, so
  a slow client gets fewer, fuller chunks and nothing is dropped. ``n > 1`` runs one pump task
  per choice in the app nursery and fans their deltas in over one channel.

Leaving ``EngineClient.open_stream`` early (client gone → ``trio.Cancelled`` in the generator,
stop string hit, error) sends the engine abort from its ``finally``; ``Cancelled`` is never
caught here.

A drain that runs out of time ends the requests still running through :class:`Cutoff`, and
each one ends as any failed request does: a stream with its error event, ``[DONE]`` and the
end of its body, a non-streamed request with a 503; each engine request is aborted.

Metrics: each output event notes its time on the request state (TTFT, inter-event gaps);
:func:`log_request`, run once from every path's ``finally``, hands the state to its
``recorder`` (the app's :mod:`smgd.metrics`), which observes everything in one go.

A stream written directly (one choice on an HTTP/1.1 connection of smgd's own worker loop)
gets an :class:`EventWriter`: the HTTP layer's writer (``DirectWriter`` in
:mod:`smgd.api.http.direct`) as this module sees it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import trio

from smgd.api.core.pipeline import other_engine
from smgd.api.core.sse import KEEPALIVE, encode_json
from smgd.errors import Draining, EngineDead, EngineNotReady, SmgdError
from smgd.wire.common import TokenDelta

if TYPE_CHECKING:
    from array import array
    from collections.abc import AsyncGenerator, Callable
    from contextlib import AbstractAsyncContextManager

    from smgd.api.core.pacer import LoadPacer
    from smgd.api.core.pipeline import Choice, RequestState
    from smgd.engines.base import EngineClient
    from smgd.engines.stream import RequestStream
    from smgd.router import Router
    from smgd.wire.common import EngineInfo, GenerateRequest

__all__ = [
    "Cutoff",
    "EventWriter",
    "Job",
    "Renderer",
    "StreamFailed",
    "collect",
    "log_request",
    "stream",
]

log = logging.getLogger("smgd.api")


class Cutoff:
    """Ends an app's running requests properly when smgd's drain runs out of time.

    Every running request watches the cutoff (:meth:`watch`) with an *ender*, a callback that
    wakes it wherever it waits: its engine stream (:meth:`RequestStream.notify`), its fan-in
    channel, the cancel scope around a wait that sends nothing to the client (an admission
    slot, a non-streamed request). :meth:`cut` calls every ender; each request then finds the
    cutoff's error (:meth:`check`) and ends through its ordinary error path, so a stream sends
    its error event, ``[DONE]`` and the end of its chunked body, and leaving
    ``open_stream`` aborts its engine request. Nothing is cancelled while it writes to its
    client: a cancel there could leave half a chunk on the wire.

    A request that starts after the cut fails at once. Each failure gets its own error object
    (one shared exception would carry every request's traceback).
    """

    __slots__ = ("_enders", "message")

    def __init__(self) -> None:
        self.message: str | None = None  # set by cut(): every request ends with this message
        self._enders: set[Callable[[], None]] = set()

    def watch(self, ender: Callable[[], None]) -> None:
        self._enders.add(ender)

    def unwatch(self, ender: Callable[[], None]) -> None:
        self._enders.discard(ender)

    def cut(self, message: str) -> int:
        """End every request watching: each gets :class:`Draining` with ``message``; how many."""
        self.message = message
        enders = list(self._enders)
        self._enders.clear()
        for end in enders:
            end()
        return len(enders)

    def error(self) -> Draining:
        """A new error for one request the cut ended."""
        assert self.message is not None, "not cut"
        return Draining(self.message, code="drain_timeout")

    def check(self) -> None:
        """Raise the cutoff's error once it was cut."""
        if self.message is not None:
            raise self.error()


_NEVER_CUT = Cutoff()  # for callers without an app (its cut() is never called)


class _StreamWatch:
    """One streamed choice's ender, and the context manager around its engine stream.

    ``async with watch.opening(job) as rs`` is ``job.engine.open_stream(job.request)``, except
    that a cut ends its wait for an admission slot (the one wait in it, and nothing has been
    sent to the client from there). Then the ender wakes the stream's task where it waits for
    output. It runs once per request, so it is cheap: a class rather than a generator-based
    context manager, and a cancel scope (~3.7 µs to enter and leave here) only where the
    engine caps its requests in flight; without a cap, admission never waits.
    """

    __slots__ = ("_may_wait", "_opened", "admitting", "cutoff", "rs")

    def __init__(self, cutoff: Cutoff) -> None:
        self.cutoff = cutoff
        self.rs: RequestStream | None = None
        self.admitting: trio.CancelScope | None = None
        self._opened: AbstractAsyncContextManager[RequestStream] | None = None
        self._may_wait = False
        cutoff.check()
        cutoff.watch(self.end)

    def end(self) -> None:
        if self.admitting is not None:
            self.admitting.cancel()  # waiting for an admission slot: nothing sent yet
        if self.rs is not None:
            self.rs.notify()  # the stream's task wakes and finds the cutoff's error

    def opening(self, job: Job) -> _StreamWatch:
        self._opened = job.engine.open_stream(job.request, checked=job.checked)
        self._may_wait = job.engine.config.max_inflight > 0
        return self

    async def __aenter__(self) -> RequestStream:
        opened = self._opened
        assert opened is not None, "use `async with watch.opening(job)`"
        if self._may_wait:
            with trio.CancelScope() as self.admitting:
                self.rs = await opened.__aenter__()
            self.admitting = None
        else:
            self.rs = await opened.__aenter__()
        if self.cutoff.message is not None:  # cut while it waited, or as it got its slot
            err = self.cutoff.error()
            if self.rs is not None:  # it got one: leaving open_stream aborts the request
                await opened.__aexit__(type(err), err, None)
            raise err
        assert self.rs is not None
        return self.rs

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        opened, self._opened, self.rs = self._opened, None, None
        assert opened is not None
        return await opened.__aexit__(*exc_info)

    def close(self) -> None:
        self.rs = None
        self.cutoff.unwatch(self.end)


@dataclass(slots=True)
class Job:
    engine: EngineClient
    request: GenerateRequest
    choice: Choice
    router: Router | None = None  # set: the job may move to another engine before its 1st token
    tried: set[str] = field(default_factory=set)
    # What engine.validate returned for the request when it was planned or moved
    # (open_stream's ``checked``).
    checked: EngineInfo | None = None


# Engine failures worth another engine: the engine died or was not ready at submit. A 4xx-class
# rejection (EngineRejected) or a full queue is the request's fate on any engine.
_RETRYABLE = (EngineDead, EngineNotReady)


def reroute(job: Job, model: str) -> bool:
    """Move a job that has produced no token yet to another ready engine; False if none.

    Retries happen only before the first token: a started stream is never replayed.
    """
    if job.router is None or job.choice.completion_tokens:
        return False
    moved = other_engine(
        job.router, model, job.engine, job.request, job.tried,
        kind="request", when=" before the first token",
    )  # fmt: skip
    if moved is None:
        return False
    job.engine, job.request, job.checked = moved
    job.choice.engine = job.engine.name  # the metrics count it where it ran
    return True


class Renderer(Protocol):
    """Endpoint-specific SSE bytes (OpenAI chunks, SGLang-native events)."""

    def delta(self, choice: Choice, text: str) -> bytes: ...
    def text_frame(self, choice: Choice) -> tuple[bytes, bytes] | tuple[()] | None:
        """The bytes around the JSON text of ``choice``'s mid-stream events from now on, when
        such an event is that text alone (``delta`` returns them with its text between); None
        while that is not known yet, ``()`` when this renderer's events never are."""

    def end(self) -> bytes: ...
    def error(self, err: SmgdError) -> bytes: ...


class EventWriter(Protocol):
    """Writes one stream's events straight to its client's socket, as HTTP/1.1 chunks.

    Methods run on the engine's reader task (:meth:`write`, :meth:`finish`) or the stream's
    own task (:meth:`flush`); nothing here waits except :meth:`flush`.
    """

    @property
    def broken(self) -> bool:
        """The client's socket broke: nothing more can be written."""

    @property
    def backlog(self) -> bytearray:
        """Bytes the kernel did not take yet; :meth:`flush` sends them."""

    @property
    def writes(self) -> int:
        """Chunks the kernel took at once so far."""

    # Set by the stream's task while its stream is direct: a write held to the end of an
    # engine message's delivery (smgd.engines.delivery) calls it where :meth:`write` would
    # have returned False (a backlog to flush, or a broken socket).
    wake: Callable[[], None] | None

    def write(self, payload: bytes) -> bool:
        """Send ``payload`` as one chunk now; False if it waits in the backlog or broke."""

    def finish(self, payload: bytes) -> bool:
        """Send ``payload`` as the body's last chunk and end the body, in one write."""

    async def flush(self) -> None:
        """Send the backlog, waiting for the socket."""


def log_request(state: RequestState) -> None:
    """Hand the ended request to the metrics recorder and write its one log line.

    The line is at info, or at warning when smgd or an engine failed the request (a 5xx-class
    error: the engine died, went silent, the drain ran out): that one asks an operator to look.
    A client error or a client that went away stays at info; the latter's line ends with
    ``client disconnected (499)`` and has ``client_disconnected`` set.
    """
    now = trio.current_time()
    if state.recorder is not None:
        try:
            state.recorder(state, now)
        except Exception:  # metrics must never break a response
            log.exception("%s: recording metrics failed", state.request_id)
    failure = state.failure
    level = logging.WARNING if failure is not None and failure.status >= 500 else logging.INFO
    state.t_end = now
    if not log.isEnabledFor(level):
        return  # a line nobody writes: its fields are not built (2.6 µs per request)
    fields = state.log_fields(now)
    if fields["client_disconnected"]:
        # nginx's 499: the request ended because its client went away (a close, a reset, or
        # a half-close, which a read's end cannot tell from a close: docs/reference/http-api.md).
        error = ", client disconnected (499)"
    else:
        error = "" if state.error is None else f", error: {state.error}"
    log.log(
        level,
        "%s %s done: %s prompt + %s completion tokens, ttft %s ms, e2e %s ms, finish %s%s",
        fields["request_id"], fields["endpoint"], fields["prompt_tokens"],
        fields["completion_tokens"], fields["ttft_ms"], fields["e2e_ms"],
        fields["finish_reason"], error, extra=fields,
    )  # fmt: skip


def _failed(state: RequestState, exc: Exception) -> SmgdError:
    """Record a stream's failure; a non-smgd exception is logged and reported as internal."""
    err = exc if isinstance(exc, SmgdError) else _internal(exc, state)
    state.fail(err)
    return err


def _internal(exc: Exception, state: RequestState) -> SmgdError:
    log.exception("request %s failed", state.request_id, exc_info=exc)
    return SmgdError(f"internal error: {type(exc).__name__}")


# --------------------------------------------------------------------------- non-streamed


async def _collect_one(job: Job, state: RequestState) -> None:
    while True:
        try:
            await _collect_attempt(job, state)
            return
        except _RETRYABLE:
            if not reroute(job, state.model):
                raise


async def _collect_attempt(job: Job, state: RequestState) -> None:
    choice = job.choice
    async with job.engine.open_stream(job.request, checked=job.checked) as rs:
        choice.stream = rs
        async for delta in rs:
            text = choice.apply(delta)
            state.output_event(choice, trio.current_time())
            if text:
                choice.parts.append(text)
            if choice.done:
                return
    raise EngineDead(f"engine {job.engine.name} ended the request without a finish")


async def collect(
    jobs: list[Job], state: RequestState, cutoff: Cutoff | None = None, *, log: bool = True
) -> None:
    """Run every job to its finish; raise the first :class:`SmgdError` (others cancelled).

    ``cutoff`` cancels the jobs (their engine requests are aborted) and raises its error.
    ``log=False``: the caller calls :func:`log_request` once it has rendered the response
    (a chat choice's ``tool_calls`` finish is known only then); on an error it is done here.
    """
    errors: list[SmgdError] = []
    cutoff = cutoff or _NEVER_CUT

    async def run(job: Job, scope: trio.CancelScope) -> None:
        try:
            await _collect_one(job, state)
        except SmgdError as err:
            errors.append(err)
            scope.cancel()

    scope = trio.CancelScope()  # no byte goes to the client meanwhile: a cancel is safe
    finished = False
    try:
        cutoff.check()
        cutoff.watch(scope.cancel)
        with scope:
            if len(jobs) == 1:
                await _collect_one(jobs[0], state)
            else:
                async with trio.open_nursery() as nursery:
                    for job in jobs:
                        nursery.start_soon(run, job, nursery.cancel_scope)
        if scope.cancelled_caught:
            cutoff.check()
        if errors:
            raise errors[0]
        finished = True
    except SmgdError as err:
        state.fail(err)
        raise
    finally:
        cutoff.unwatch(scope.cancel)
        if log or not finished:
            log_request(state)


# --------------------------------------------------------------------------- streamed


def stream(
    jobs: list[Job],
    state: RequestState,
    render: Renderer,
    *,
    keepalive_s: float,
    nursery: trio.Nursery | None,
    pacer: LoadPacer | None = None,
    writer: EventWriter | None = None,
    cutoff: Cutoff | None = None,
) -> AsyncGenerator[bytes, None]:
    """The SSE body; ``writer`` (one choice only) lets events skip the ASGI stack; ``cutoff``
    ends the stream with its error event."""
    cutoff = cutoff or _NEVER_CUT
    if pacer is not None:
        pacer.expect_load()
    if len(jobs) == 1:
        return _stream_one(jobs[0], state, render, keepalive_s, pacer, writer, cutoff)
    assert nursery is not None, "n > 1 streams need the app nursery for their pumps"
    return _stream_many(jobs, state, render, keepalive_s, nursery, cutoff)


class _ClientGone(Exception):
    """A direct write found the client's socket broken."""


class StreamFailed(Exception):
    """A stream failed (the engine's queue was full, no engine took it, it died, the drain ran
    out; with ``n > 1``, any of its choices): raised out of the stream's body where its error
    event would go.

    The HTTP layer knows what of the response went out: where nothing did (the fast path
    still holds the head for the first event) it answers with the error's own status (a 429
    with ``Retry-After`` that a client or balancer retries, where a 200 with an error event
    looks like a served request); else it sends ``event`` (the stream's error event and its
    end) and ends the body as the stream would have.
    """

    def __init__(self, error: SmgdError, event: bytes) -> None:
        super().__init__(error.message)
        self.error = error
        self.event = event


@dataclass(slots=True, eq=False)
class _DirectSink:
    """The reader task's side of a direct-mode stream: :meth:`sink` is the stream's sink.

    One slots object rather than closures: a token touches its fields, and closures keep each
    captured variable in a cell object of its own, so the reader task, which runs cold after
    every engine step, touched a dozen scattered cells per token instead of one object.

    When the pacer's direct window is open (a saturated loop), output that arrives sooner than
    one window after this stream's last event is held and merged, and goes out as one event
    at the pacer's tick: fewer, fuller events, the same bytes. A finish is never held.
    """

    rs: RequestStream
    choice: Choice
    state: RequestState
    render: Renderer
    writer: EventWriter
    pacer: LoadPacer | None
    failures: list[Exception] = field(default_factory=list)
    held: TokenDelta | None = None  # output merged while the window is open
    # The renderer's text_frame() for this choice: None until it answers (it is asked after
    # each event), then the bytes around a mid-stream event's text, which is then built here
    # without the renderer and its format (objects of their own, cold after an engine step),
    # or () when the choice's events are never that.
    frame: tuple[bytes, bytes] | tuple[()] | None = None
    last_event: float = -math.inf  # of this stream's last event: none yet, so never held
    # trio.current_time() is three calls to reach the clock's; this is one (per token).
    now: Callable[[], float] = field(init=False)
    # The request's event gaps (RequestState.gaps), kept here: a token's event then reads the
    # request's state object only for the request's first event.
    gaps: array[float] = field(init=False)

    def __post_init__(self) -> None:
        self.now = trio.lowlevel.current_clock().current_time
        self.gaps = self.state.gaps

    def sink(self, delta: TokenDelta) -> bool:
        held = self.held
        if held is not None:
            held.merge(delta)
            if delta.finish is None:
                return True
            delta, self.held = held, None
        elif (
            (pacer := self.pacer) is not None
            and delta.finish is None
            and (window := pacer.direct_window_s)
        ):
            due = self.last_event + window
            if due > self.now() and pacer.call_at(due, self.release):
                self.held = delta
                return True
        self.emit(delta)
        return True

    def emit(self, delta: TokenDelta) -> None:
        choice = self.choice
        try:
            text = choice.apply(delta)
            self.last_event = now = self.now()
            if choice.output_event(now, self.gaps):
                self.state.first_output(now)
            frame = self.frame
            if frame and choice.finish_reason is None:
                out = frame[0] + encode_json(text) + frame[1] if text else b""
            else:
                out = self.render.delta(choice, text)
                if frame is None and choice.finish_reason is None:
                    self.frame = self.render.text_frame(choice)
        except Exception as exc:  # never into the reader task: the stream's task raises it
            self.failures.append(exc)
            self.rs.notify()
            return
        if choice.finish_reason is not None:  # choice.done
            try:
                end = out + self.render.end()
            except Exception as exc:  # as above: the task raises it
                self.failures.append(exc)
            else:
                self.writer.finish(end)  # a backlog is the task's to flush, as for any event
            self.rs.notify()  # the end: the task completes the response
        elif out and not self.writer.write(out):
            self.rs.notify()  # a backlog to flush, or a broken socket: the task acts

    def release(self) -> None:  # on the pacer task, at its tick
        # Only while the stream has a sink: the task's exit detaches this one (each stream gets
        # one sink), and held output is moot then.
        held = self.held
        if held is not None and self.rs.sink is not None:
            self.held = None
            self.emit(held)


async def _direct(
    rs: RequestStream,
    choice: Choice,
    state: RequestState,
    render: Renderer,
    writer: EventWriter,
    keepalive_s: float,
    pacer: LoadPacer | None = None,
    cutoff: Cutoff = _NEVER_CUT,
) -> None:
    """Let the reader task write this stream's events through ``writer`` until it ends.

    Returns once the choice is done and every byte is written: the reader wrote the last
    event, the end and the body's terminator together (:meth:`EventWriter.finish`), so the
    client has the whole response before this task runs again. Raises the engine's error, or
    :class:`_ClientGone`; the caller sends an error event the normal way.
    """
    direct = _DirectSink(rs, choice, state, render, writer, pacer)
    failures = direct.failures
    writer.wake = rs.notify
    rs.sink = direct.sink  # a cycle through rs until the finally below breaks it
    try:
        while True:
            if writer.broken:
                raise _ClientGone
            if writer.backlog:
                # Before anything else, a failure included: the caller's error event goes out
                # through h11, and must not overtake bytes (perhaps half a chunk) still here.
                await writer.flush()
                continue
            if failures:
                raise failures[0]
            if choice.done:
                return
            cutoff.check()  # after the backlog's flush: the error event must not overtake it
            delta = rs.receive_nowait()  # output from before the sink, or the engine's error
            if delta is not None:
                direct.sink(delta)
                continue
            if keepalive_s <= 0:
                await rs.wait()
                continue
            written = writer.writes
            with trio.move_on_after(keepalive_s) as idle:
                await rs.wait()
            if idle.cancelled_caught and writer.writes == written:
                writer.write(KEEPALIVE)
    finally:
        rs.sink = None  # a pending release() now does nothing; held output is moot
        writer.wake = None


async def _stream_one(
    job: Job,
    state: RequestState,
    render: Renderer,
    keepalive_s: float,
    pacer: LoadPacer | None,
    writer: EventWriter | None,
    cutoff: Cutoff,
) -> AsyncGenerator[bytes, None]:
    choice = job.choice
    watch: _StreamWatch | None = None
    try:
        watch = _StreamWatch(cutoff)
        while True:
            try:
                async with watch.opening(job) as rs:
                    choice.stream = rs
                    if writer is not None:
                        # The dispatcher gave the writer the response head before it asked
                        # for the body (to hold, or to wait for where the server writes it):
                        # every event can go to the writer, the first one included.
                        try:
                            await _direct(
                                rs, choice, state, render, writer, keepalive_s, pacer, cutoff
                            )
                        except _ClientGone:
                            return  # leaving open_stream aborts the engine request
                        break
                    while True:
                        cutoff.check()
                        delta = rs.receive_nowait()  # raises the engine's error / EndOfChannel
                        if delta is None:
                            # Wait without taking: the cutoff's ender wakes this wait too.
                            if keepalive_s <= 0:
                                await rs.wait()
                                continue
                            with trio.move_on_after(keepalive_s) as idle:
                                await rs.wait()
                            if idle.cancelled_caught:
                                yield KEEPALIVE
                            continue
                        text = choice.apply(delta)
                        state.output_event(choice, trio.current_time())
                        out = render.delta(choice, text)
                        if out:
                            yield out
                        if choice.done:
                            break
                        if pacer is not None and pacer.window_s > 0:
                            # Loaded loop: let output pile up so the next event carries more.
                            await pacer.hold()
                break
            except _RETRYABLE:
                if not reroute(job, state.model):
                    raise
        if writer is None:  # a direct stream's reader wrote the end with its last event
            yield render.end()
    except trio.EndOfChannel:
        early = EngineDead(f"engine {job.engine.name} ended the request early")
        state.fail(early)
        state.error = "stream ended without a finish"
        raise StreamFailed(early, render.error(early)) from None
    except Exception as exc:
        err = _failed(state, exc)
        raise StreamFailed(err, render.error(err)) from None
    finally:
        if watch is not None:
            watch.close()
        log_request(state)


_Item = tuple[int, TokenDelta | SmgdError]


async def _pump(
    job: Job,
    send: trio.MemorySendChannel[_Item],
    model: str,
    *,
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Forward one choice's deltas to the fan-in channel; the consumer cancels it when done."""
    index = job.choice.index
    with trio.CancelScope() as scope:
        task_status.started(scope)
        try:
            while True:
                produced = False  # a forwarded token: from then on, never retry elsewhere
                try:
                    async with job.engine.open_stream(job.request, checked=job.checked) as rs:
                        job.choice.stream = rs
                        async for delta in rs:
                            produced = produced or bool(delta.token_ids)
                            send.send_nowait((index, delta))
                            if delta.finish is not None:
                                return
                    send.send_nowait((index, EngineDead(f"engine {job.engine.name} ended early")))
                    return
                except _RETRYABLE:
                    if produced or not reroute(job, model):
                        raise
        except SmgdError as err:
            send.send_nowait((index, err))
        except trio.ClosedResourceError:
            pass  # the consumer is gone; leaving open_stream sent the abort
        except Exception as exc:  # a pump runs in the app nursery: never let it crash it
            log.exception("stream pump for %s failed", job.request.rid, exc_info=exc)
            send.send_nowait((index, SmgdError(f"internal error: {type(exc).__name__}")))


async def _stream_many(
    jobs: list[Job],
    state: RequestState,
    render: Renderer,
    keepalive_s: float,
    nursery: trio.Nursery,
    cutoff: Cutoff,
) -> AsyncGenerator[bytes, None]:
    send, recv = trio.open_memory_channel[_Item](math.inf)
    by_index = {job.choice.index: job.choice for job in jobs}
    scopes: dict[int, trio.CancelScope] = {}

    def end() -> None:  # the cutoff's ender: its error reaches the consumer as a pump's would
        send.send_nowait((-1, cutoff.error()))

    try:
        cutoff.check()
        cutoff.watch(end)
        for job in jobs:
            scopes[job.choice.index] = await nursery.start(_pump, job, send, state.model)
        while any(not c.done for c in by_index.values()):
            items = await _receive_all(recv, keepalive_s)
            if not items:
                yield KEEPALIVE
                continue
            out: list[bytes] = []
            for index, payload in _merge(items):
                if isinstance(payload, SmgdError):
                    raise payload
                choice = by_index[index]
                text = choice.apply(payload)
                state.output_event(choice, trio.current_time())
                out.append(render.delta(choice, text))
                if choice.stopped_here:
                    scopes[index].cancel()  # abort this one on the engine now
            yield b"".join(out)
        yield render.end()
    except Exception as exc:
        err = _failed(state, exc)
        raise StreamFailed(err, render.error(err)) from None
    finally:
        cutoff.unwatch(end)
        for scope in scopes.values():
            scope.cancel()
        send.close()
        recv.close()
        log_request(state)


async def _receive_all(recv: trio.MemoryReceiveChannel[_Item], keepalive_s: float) -> list[_Item]:
    """Everything queued (waiting for the first item up to ``keepalive_s``; [] on timeout)."""
    first: _Item | None = None
    try:
        first = recv.receive_nowait()
    except trio.WouldBlock:
        if keepalive_s > 0:
            with trio.move_on_after(keepalive_s):
                first = await recv.receive()
            if first is None:
                return []
        else:
            first = await recv.receive()
    items = [first]
    while True:
        try:
            items.append(recv.receive_nowait())
        except trio.WouldBlock:
            return items


def _merge(items: list[_Item]) -> list[_Item]:
    """Coalesce queued deltas per choice (order of first appearance); errors pass through."""
    merged: dict[int, TokenDelta | SmgdError] = {}
    for index, payload in items:
        have = merged.get(index)
        if isinstance(have, TokenDelta) and isinstance(payload, TokenDelta):
            have.merge(payload)
        elif not isinstance(have, SmgdError):
            merged[index] = payload
    return list(merged.items())
