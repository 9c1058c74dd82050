"""The engine client shape shared by every wire family.

One :class:`EngineClient` per configured engine, over :class:`~smgd.engines.core.ClientCore`
(its state, the delivery of a delta to its stream, its death, the wire's hooks). ``run()``
owns a nursery with:

- the sockets (bound by the subclass in :meth:`EngineClient._open`), and the optional launched
  engine process, whose exit (any exit code) means the engine is gone;
- a **reader** task (:mod:`smgd.engines.reader`): the only task touching the output socket; it
  decodes each frame and demultiplexes by rid into
  :class:`~smgd.engines.stream.RequestStream` slots, never awaiting a consumer;
- a **sender** task: the only task touching the input socket; it drains an unbounded outbox so
  request handlers (and their shielded ``finally`` aborts) never block on a socket;
- a **silence watchdog** (:mod:`smgd.engines.watchdogs`): no frame at all for
  ``timeouts.silence_s`` while requests are in flight means the engine is wedged;
- a **deadline watchdog** (there too): a request still running ``timeouts.request_s`` after it
  was sent fails with an :class:`~smgd.errors.EngineTimeout` and is aborted (the engine serves
  on);
- an **output watch** (:func:`smgd.engines.output_watch.watch_output`, started by the subclass
  before the engine can connect): a connection to the output socket that breaks while the
  engine lives on lost a message, the one libzmq refused for being over
  ``limits.max_frame_mb`` (``ZMQ_MAXMSGSIZE``, set by the subclass on the socket), so the
  requests in flight fail.

Any death signal (process exit, decode-error streak, send deadline, silence, the engine's own
dead sentinel) fails every in-flight stream with an :class:`~smgd.errors.EngineDead` of its own
and ends ``run()`` by raising one; the supervisor decides whether to relaunch.

A reload changes a running client in two ways (:mod:`smgd.reload`): :meth:`reconfigure` takes
the settings smgd alone reads (admission limits, timeouts, served names) with no disruption,
and :meth:`start_draining` stops new requests while the in-flight ones finish, before the
client is stopped and replaced by one with the new settings.
"""

from __future__ import annotations

import logging
import sys
from functools import partial
from itertools import islice
from typing import TYPE_CHECKING

import trio

from smgd import launch
from smgd.engines.core import ClientCore
from smgd.engines.reader import reader_task
from smgd.engines.state import EngineState, EngineStatistics, Occupancy
from smgd.engines.stream import RequestStream, StreamState, fail_all
from smgd.engines.validation import check_embed, check_generate
from smgd.engines.watchdogs import deadline_watchdog, health_prober, silence_watchdog
from smgd.errors import EngineDead, EngineNotReady, InvalidRequest, TransportError
from smgd.wire.common import EmbedRequest, GenerateRequest

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    from smgd.config import EngineConfig
    from smgd.wire.common import EngineInfo, EngineRequest, LoraAdapter

log = logging.getLogger("smgd.engine")


class EngineClient(ClientCore):
    """Base class; subclasses implement the wire-specific hooks of :class:`ClientCore`."""

    # ------------------------------------------------------------------ public API

    @property
    def ready(self) -> bool:
        """Takes new requests: handshake done, not dead, not draining for a replacement."""
        return self.state is EngineState.READY and not self.draining

    @property
    def state_name(self) -> str:
        """The state as reported (readiness, status): ``draining`` while a reload replaces it."""
        if self.draining and self.state is EngineState.READY:
            return "draining"
        return self.state.value

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            name=self.name,
            wire=self.wire,
            state=self.state_name,
            in_flight=len(self._streams),
            requests_total=self._requests_total,
            tokens_total=self._tokens_total,
            decode_errors=self._decode_errors,
            last_error=self.last_error,
            load=self.load,
            max_model_len=self.info.max_model_len if self.info else None,
            queue_depth=self.admission.queue_depth,
            rejected_total=self.admission.rejected_total,
        )

    def occupancy(self) -> Occupancy:
        """See :class:`~smgd.engines.state.Occupancy`; O(requests in flight) when estimated,
        so scrape-time only."""
        in_flight = len(self._streams)
        load = self.load
        if load is not None:
            running = min(load.running, in_flight)
            waiting = min(load.waiting, in_flight - running)
            return Occupancy(
                running=running, waiting=waiting, kv_usage=load.kv_usage, estimated=False
            )
        info = self.info
        running = min(in_flight, info.max_num_seqs or in_flight) if info else in_flight
        kv = None
        if info is not None and info.kv_cache_tokens:
            held = sum(s.tokens for s in islice(self._streams.values(), running))
            kv = min(held / info.kv_cache_tokens, 1.0)
        return Occupancy(running=running, waiting=in_flight - running, kv_usage=kv, estimated=True)

    async def wait_ready(self) -> None:
        await self._ready.wait()

    def reconfigure(self, config: EngineConfig) -> None:
        """Take a reload's new settings for this engine, in place (``smgd.reload.IN_PLACE``).

        Only settings smgd itself reads: admission limits (a raised ``max_inflight`` admits
        waiters at once, a lowered one admits nobody until enough streams end), timeouts
        (the watchdogs re-read them at once), the served names and ``required``. Streams in
        flight are not touched.
        """
        self.config = config
        self.models = tuple(config.models)
        self.admission.reconfigure(
            max_inflight=config.max_inflight,
            max_queue=config.max_queue,
            queue_timeout_s=config.queue_timeout_s,
        )
        changed, self._reconfigured = self._reconfigured, trio.Event()
        changed.set()

    def start_draining(self) -> None:
        """Take no new request (readiness and the router see it not ready); streams go on."""
        self.draining = True

    def validate(self, req: EngineRequest, *, ids_checked: EngineInfo | None = None) -> EngineInfo:
        """Reject what would kill or wedge the engine (raises InvalidRequest); the engine's
        info it was checked against.

        ``ids_checked``: that info, from an earlier check of this request (when it was planned):
        while the engine still runs with it, the prompt's token ids are not scanned again. The
        scan is the one cost of a check that grows with the prompt: ~130 µs for 4,096 ids here
        (``min`` and ``max``, each comparison a Python call), against ~1 µs for the rest.
        """
        info = self.info
        if info is None:
            raise EngineNotReady(f"engine {self.name} is not ready")
        scan = ids_checked is not info
        if isinstance(req, EmbedRequest):
            check_embed(self, req, info, scan)
        else:
            check_generate(self, req, info, scan)
        return info

    def open_stream(
        self, req: EngineRequest, *, checked: EngineInfo | None = None
    ) -> AbstractAsyncContextManager[RequestStream]:
        """Submit a request; yield its output stream; abort it on the engine if it is left early.

        ``async with engine.open_stream(req) as stream``: the engine must be ready and take
        the request (:meth:`validate`), and the request waits for an admission slot. Leaving
        the block before the stream finished (client gone, stop string hit, error) sends an
        abort and closes the stream locally at once: vLLM and TokenSpeed never answer an
        abort, and SGLang's late answer is simply dropped. The outbox is unbounded, so the
        abort is queued synchronously and cannot be lost to a cancellation.

        A request with a LoRA adapter counts as waiting for it until sent, then running
        (:class:`~smgd.engines.lora.LoraTable`), until the block is left. ``checked``: what
        :meth:`validate` returned for it when it was planned (:meth:`validate`'s ``ids_checked``).
        """
        return _OpenStream(self, req, checked)

    def _submit(self, req: EngineRequest, waited: float) -> RequestStream:
        """Put an admitted request in the outbox; its stream."""
        if not self.ready:  # it may have died (or begun draining) while it queued
            raise EngineNotReady(f"engine {self.name} is {self.state_name}")
        prompt = len(req.prompt_ids)
        limit = sys.maxsize  # an embedding: no output tokens
        if isinstance(req, GenerateRequest):
            limit = prompt + req.sampling.max_tokens
        stream = RequestStream(req.rid, self.name, prompt_tokens=prompt, limit=limit)
        stream.queued_s = waited
        stream.sent_at = trio.current_time()
        frames = self._encode_request(req)
        self._streams[req.rid] = stream
        self._fresh.add(req.rid)
        if isinstance(req, GenerateRequest) and req.sampling.structured is not None:
            self._constrained[req.rid] = req.sampling.structured.param
        self._requests_total += 1
        self._outbox_send.send_nowait(frames)
        return stream

    def _withdraw(self, rid: str, stream: RequestStream) -> None:
        """A submitted request's block was left: forget it, and abort it if still running."""
        still_running = stream.state is StreamState.OPEN
        self._untrack(rid)
        if still_running:
            stream.state = StreamState.CLOSED
            if self.state is EngineState.READY:  # draining included: it is alive
                self._outbox_send.send_nowait(self._encode_abort(rid))

    # ------------------------------------------------------------------ lifecycle

    async def run(
        self, *, task_status: trio.TaskStatus[EngineClient] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Bind, (launch,) become ready, then serve until cancelled or dead.

        ``task_status.started`` fires once the sockets are bound (readiness comes later, see
        :meth:`wait_ready`). Raises :class:`EngineDead` when the engine dies.
        """
        try:
            async with trio.open_nursery() as nursery:
                await self._open(nursery)
                task_status.started(self)
                self._last_frame = trio.current_time()
                nursery.start_soon(reader_task, self)
                nursery.start_soon(self._sender_task)
                nursery.start_soon(silence_watchdog, self)
                nursery.start_soon(deadline_watchdog, self)
                nursery.start_soon(self._death_waiter, nursery.cancel_scope)
                info = await self._become_ready()
                self.info = info
                self.state = EngineState.READY
                self.ready_at = trio.current_time()
                self._ready.set()
                log.info(
                    "engine %s ready (wire=%s, max_model_len=%s, vocab=%s)",
                    self.name,
                    self.wire,
                    info.max_model_len,
                    info.vocab_size,
                )
                nursery.start_soon(health_prober, self)
        finally:
            with trio.CancelScope(shield=True):
                await self._close()
            if self._death is None:
                self.state = EngineState.STOPPED
                fail_all(self._streams, partial(EngineDead, f"engine {self.name} stopped"))
        if self._death is not None:
            raise self._death

    async def _death_waiter(self, scope: trio.CancelScope) -> None:
        await self._dead.wait()
        scope.cancel()

    async def die_after_peer_left(self, child: launch.Child | None, why: str) -> None:
        """A peer left the engine's socket: the engine takes no new request from now (the
        router takes it as not ready) and dies once the reason is known, the launched
        process's exit if it comes within ``launch.EXIT_REPORT_S``, else ``why``; the streams
        in flight fail then."""
        if self._death is None:
            self.state = EngineState.DEAD
        self.die(await launch.peer_left_reason(child, why))

    async def _watch_child(self, child: launch.Child) -> None:
        """A launched engine's process: its exit is the engine's death."""
        self.die(launch.exit_reason(await child.wait()))

    @property
    def max_frame_bytes(self) -> int:
        """``limits.max_frame_mb`` in bytes: set as ``ZMQ_MAXMSGSIZE`` on the output socket
        (before it binds: a connection takes the socket's options when it is made)."""
        return self.config.limits.max_frame_mb << 20

    # ------------------------------------------------------------------ tasks

    async def _sender_task(self) -> None:
        sock = self._input_socket()
        async for frames in self._outbox_recv:
            try:
                # Everything queued goes out in this one wakeup. Each awaited send is a
                # scheduler pass, and in a burst of new requests a pass runs every other
                # runnable task first (~40 ms at 256 requests): one request per pass put
                # ~45 ms (p90 ~100 ms) between submit and send (docs/performance.md).
                while True:
                    try:
                        sock.send_multipart_nowait(frames)
                    except trio.WouldBlock:  # HWM or no peer yet: wait for room
                        send_s = self.config.timeouts.send_s  # per send: a reload may change it
                        await sock.send_multipart(frames, deadline=trio.current_time() + send_s)
                    try:
                        frames = self._outbox_recv.receive_nowait()
                    except trio.WouldBlock:
                        break
            except TransportError as exc:
                self.die(f"send failed: {exc.message}")
                return

    # ------------------------------------------------------------------ LoRA adapters

    async def load_adapter(
        self, name: str, path: str, *, load_inplace: bool = False
    ) -> LoraAdapter:
        """Load the LoRA adapter at ``path`` as ``name`` and serve it (``load_inplace``: load
        its weights again although that name is loaded). Raises a :class:`ClientError` where
        the wire cannot, or the engine refused it. Default: this wire loads none at run time."""
        await trio.lowlevel.checkpoint()
        raise InvalidRequest(
            f"engine {self.name} ({self.wire} wire) cannot load LoRA adapters at run time; "
            "name them in [engines.lora] adapters",
            param="lora_name",
        )

    async def unload_adapter(self, name: str) -> None:
        """Stop serving adapter ``name`` (requests in flight with it finish). Default: forget
        it; the engine keeps its weights cached until it needs the room."""
        await trio.lowlevel.checkpoint()
        self.lora.remove(name)


class _OpenStream:
    """:meth:`EngineClient.open_stream`'s block. A class rather than generator-based context
    managers: it runs once per request, and the three it replaces (the stream's, the admission
    slot's, the adapter count's) cost ~10 µs together, this ~1."""

    __slots__ = ("_admitted", "_checked", "_engine", "_lora", "_req", "_stream")

    def __init__(
        self, engine: EngineClient, req: EngineRequest, checked: EngineInfo | None
    ) -> None:
        self._engine = engine
        self._req = req
        self._checked = checked
        self._lora = req.lora if isinstance(req, GenerateRequest) else None  # embeddings: none
        self._admitted = False
        self._stream: RequestStream | None = None

    async def __aenter__(self) -> RequestStream:
        engine, req = self._engine, self._req
        engine.lora.begin(self._lora)
        try:
            if not engine.ready:
                raise EngineNotReady(f"engine {engine.name} is {engine.state_name}")
            # Again: the engine may have changed since the request was planned (restarted,
            # adapter unloaded, the rid taken meanwhile).
            engine.validate(req, ids_checked=self._checked)
            admission, rid = engine.admission, req.rid
            waited = 0.0 if admission.try_acquire(rid) else await admission.wait_acquire(rid)
            self._admitted = True
            self._stream = engine._submit(req, waited)
        except BaseException:
            self._leave()
            raise
        engine.lora.sent(self._lora)
        return self._stream

    async def __aexit__(self, *exc_info: object) -> None:
        self._leave()

    def _leave(self) -> None:
        engine, stream = self._engine, self._stream
        try:
            if stream is not None:
                engine._withdraw(self._req.rid, stream)
        finally:
            if self._admitted:
                engine.admission.release(self._req.rid)
            engine.lora.end(self._lora, sent=stream is not None)
