"""SGLang scheduler client (msgpack mode): smgd plays TokenizerManager and the detokenizer.

Topology: smgd **binds** PUSH (requests, the scheduler's input) and PULL (outputs; the
scheduler connects two PUSH sockets to it). Readiness barrier: the scheduler has attached to our
PUSH (socket monitor ``accepted``) **and** answered a health-check generate. Before that, no
request is sent: a PUSH with no peer would queue or block it.

Death: the launched process exits (any code: a scheduler that exits is gone), our PUSH's peer
disconnects, a send misses its deadline, a decode-error streak, or silence with requests in
flight (all handled by :class:`~smgd.engines.base.EngineClient`). For a launched engine, also a
peer on the request socket that is not part of it (``SO_PEERCRED``): a scheduler left running by
an earlier smgd would take a share of the requests.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
import zmq

from smgd import ipc, launch
from smgd.engines.base import EngineClient
from smgd.engines.output_watch import watch_output
from smgd.errors import EngineDead
from smgd.wire.common import EmbedRequest, EngineInfo, EngineRequest, TokenDelta
from smgd.wire.sglang.decode import decode_output
from smgd.wire.sglang.encode import (
    encode_abort,
    encode_embed,
    encode_embed_health_check,
    encode_generate,
    encode_health_check,
    new_health_check_rid,
)
from smgd.wire.sglang.structs import HealthCheckOutput
from smgd.zmq_trio import TrioSocket, open_monitor

if TYPE_CHECKING:
    from collections.abc import Sequence

    from smgd.config import EngineConfig
    from smgd.wire.common import LoraAdapter

log = logging.getLogger("smgd.engine.sglang")

# SGLang's own sockets use unlimited HWMs (config_socket): a bounded HWM on our PUSH would make
# sends fail under a burst that the scheduler would have absorbed.
UNLIMITED_HWM = 0
# How long a health-check generate may take to be answered during the readiness barrier.
# A tiny model answers in well under a second; a cold big model's first step can take seconds.
HEALTH_TIMEOUT_S = 60.0


class SglangEngineClient(EngineClient):
    wire = "sglang"
    embed_len_margin = 1

    def __init__(
        self,
        config: EngineConfig,
        *,
        fallback_info: EngineInfo | None,
        input_path: str,
        output_path: str,
        launch_argv: list[str] | None = None,
        launch_env: dict[str, str] | None = None,
        adapters: Sequence[LoraAdapter] = (),
    ) -> None:
        super().__init__(config, fallback_info=fallback_info, adapters=adapters)
        self.input_path = input_path
        self.output_path = output_path
        self.launch_argv = launch_argv
        self.launch_env = launch_env
        self.child: launch.Child | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._push: TrioSocket | None = None
        self._pull: TrioSocket | None = None
        self._attached = trio.Event()
        self._foreign: int | None = None  # a peer pid that is not part of the launched engine
        self._opened = False  # past _open: a death now is a relaunch, not a start-up failure
        self._health_rid: str | None = None
        self._health_done = trio.Event()
        self._probe_lock = trio.Lock()
        # rid -> (output top-k, prompt top-k) of the requests that ask the two different
        # counts: the wire has one count for both, the larger (wire.sglang.encode), so the
        # other side's top lists come back longer than asked and are cut here.
        self._tops: dict[str, tuple[int, int]] = {}

    @property
    def input_endpoint(self) -> str:
        return self.config.addresses.input or f"ipc://{self.input_path}"

    @property
    def output_endpoint(self) -> str:
        return self.config.addresses.output or f"ipc://{self.output_path}"

    # ------------------------------------------------------------------ hooks

    async def _open(self, nursery: trio.Nursery) -> None:
        # Before binding: a scheduler an earlier smgd left running would connect at once.
        ipc_dir = Path(self.input_path).parent
        await launch.reap_orphans(ipc_dir, self.name)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._ctx = ctx
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDHWM, UNLIMITED_HWM)
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.RCVHWM, UNLIMITED_HWM)
        pull.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        self._push, self._pull = TrioSocket(push), TrioSocket(pull)
        for endpoint, sock in ((self.input_endpoint, push), (self.output_endpoint, pull)):
            if endpoint.startswith("ipc://"):
                ipc.prepare_ipc_endpoint(endpoint[len("ipc://") :])
            try:
                sock.bind(endpoint)
            except zmq.ZMQError as exc:
                from smgd.errors import TransportError

                raise TransportError(
                    f"engine {self.name}: cannot bind {endpoint}: {exc.strerror}"
                ) from None
        await nursery.start(self._watch_peer)
        await nursery.start(watch_output, self)
        if self.launch_argv is not None:
            ipc.prepare_ipc_dir(ipc_dir)  # holds the pid file, even with tcp addresses
            self.child = await launch.spawn(
                nursery,
                self.name,
                self.launch_argv,
                env=self.launch_env,
                pid_file=ipc_dir / launch.PID_FILE,
            )
            nursery.start_soon(self._watch_child, self.child)

    async def _watch_peer(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        assert self._push is not None
        # Peers are tracked by connection fd: a stale-socket probe (another smgd checking the
        # path) connects and disconnects too, and must not read as the scheduler leaving.
        peers: set[int] = set()
        async with open_monitor(self._push, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED) as events:
            task_status.started()
            async for event in events:
                if event.kind == "accepted":
                    if self._is_foreign(ipc.peer_pid(event.value)):
                        continue  # reported by _become_ready (or now, if it is already past)
                    peers.add(event.value)
                    self._attached.set()
                elif event.kind == "disconnected":
                    peers.discard(event.value)
                    if not peers and self._attached.is_set():
                        why = "the scheduler disconnected from the request socket"
                        await self.die_after_peer_left(self.child, why)
                        return

    def _is_foreign(self, pid: int | None) -> bool:
        """A launched engine's request socket is for its scheduler alone: another peer (an
        engine left by an earlier smgd) would take a share of the requests and their aborts."""
        if self.launch_argv is None or pid is None or pid == os.getpid():
            return False  # an external scheduler may be any process; our own probes are not
        if self.child is not None and self.child.owns(pid):
            return False
        self._foreign = pid
        if self._opened:
            self.die(self._foreign_message(pid))
        return True

    def _foreign_message(self, pid: int) -> str:
        return (
            f"a process smgd did not launch (pid {pid}: {ipc.command_line(pid) or 'gone'}) "
            f"is connected to the request socket {self.input_endpoint} and would take a share "
            "of the requests (an engine left running by an earlier smgd?); stop it"
        )

    async def _become_ready(self) -> EngineInfo:
        self._opened = True
        if self._foreign is not None:  # it connected while the sockets were being set up
            self.die(self._foreign_message(self._foreign))
            raise EngineDead(self.last_error or "not ready")
        ready_s = self.config.timeouts.ready_s
        with trio.move_on_after(ready_s) as scope:
            await self._attached.wait()
            if self.child is not None:
                # Launched engines (the mock too) print `SMGD_READY {json}` once loaded.
                await self.child.ready_event.wait()
        if scope.cancelled_caught:
            if self._attached.is_set():  # a launched command that does not report (docs)
                self.die(
                    "the scheduler attached, but printed no `SMGD_READY` line on its stdout "
                    f"within {ready_s:g} s"
                )
            else:
                self.die(f"the scheduler did not attach within {ready_s:g} s")
            raise EngineDead(self.last_error or "not ready")
        # Within what is left of ready_s: it bounds the whole start (the check waited its own
        # HEALTH_TIMEOUT_S whatever ready_s said).
        left = scope.deadline - trio.current_time()
        await self.health_check(min(HEALTH_TIMEOUT_S, max(left, 0.0)))
        return self._engine_info()

    async def health_check(self, limit_s: float) -> None:
        """Send a 1-token health-check generate; any answer for it counts as healthy."""
        if not await self.answers_probe(limit_s):
            self.die(f"no answer to a health check within {limit_s:g} s")
            raise EngineDead(self.last_error or "health check failed")

    async def answers_probe(self, limit_s: float) -> bool:
        # One probe at a time: an answer is matched by the one rid awaited (the idle prober's
        # and the silence watchdog's probes could otherwise overlap as requests come and go).
        async with self._probe_lock:
            rid = new_health_check_rid()
            self._health_rid = rid
            self._health_done = trio.Event()
            probe = encode_embed_health_check if self.task == "embed" else encode_health_check
            self._outbox_send.send_nowait([probe(rid)])
            with trio.move_on_after(limit_s) as scope:
                await self._health_done.wait()
            self._health_rid = None
            return not scope.cancelled_caught

    async def probe_health(self, limit_s: float) -> None:
        # health_check already declared the death; run() ends through die().
        with contextlib.suppress(EngineDead):
            await self.health_check(limit_s)

    def _engine_info(self) -> EngineInfo:
        fallback = self._fallback_info
        reported: dict[str, Any] = (self.child.ready_info or {}) if self.child else {}
        max_len = self.config.max_model_len or _positive(reported.get("context_length"))
        if not max_len and fallback is not None:
            max_len = fallback.max_model_len
        if not max_len:
            raise EngineDead(f"engine {self.name}: unknown context length (set max_model_len)")
        return EngineInfo(
            max_model_len=max_len,
            vocab_size=fallback.vocab_size if fallback else None,
            kv_cache_tokens=_positive(reported.get("max_total_num_tokens")),
            max_num_seqs=_positive(reported.get("max_running_requests")),
            version=reported.get("version"),
        )

    async def _close(self) -> None:
        if self.child is not None:
            await self.child.stop()
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close()
        if self._ctx is not None:
            self._ctx.term()

    def _input_socket(self) -> TrioSocket:
        assert self._push is not None
        return self._push

    def _output_socket(self) -> TrioSocket:
        assert self._pull is not None
        return self._pull

    def _encode_request(self, req: EngineRequest) -> list[bytes]:
        if isinstance(req, EmbedRequest):
            return [encode_embed(req)]
        lora = None if req.lora is None else self.lora.get(req.lora)
        out_k, prompt_k = req.sampling.logprobs, req.sampling.prompt_logprobs
        if out_k is not None and prompt_k is not None and out_k != prompt_k:
            self._tops[req.rid] = (out_k, prompt_k)
        return [encode_generate(req, lora)]

    def _forget(self, rid: str) -> None:
        super()._forget(rid)
        if self._tops:
            self._tops.pop(rid, None)

    def _untrack(self, rid: str) -> None:
        # A request that ends early may never get a final delta (failed alone, its frame
        # lost): what it asked for its top-k goes with it here.
        super()._untrack(rid)
        if self._tops:
            self._tops.pop(rid, None)

    def _trim_tops(self, deltas: Sequence[TokenDelta]) -> None:
        """Cut each top-k list of the requests in ``_tops`` to what its side asked for."""
        tops = self._tops
        for delta in deltas:
            asked = tops.get(delta.rid)
            if asked is None:
                continue
            for entries, k in zip((delta.logprobs, delta.prompt_logprobs), asked, strict=True):
                for entry in entries or ():
                    if entry.top is not None and len(entry.top) > k:
                        del entry.top[k:]

    def _encode_abort(self, rid: str) -> list[bytes]:
        return [encode_abort(rid)]

    def _decode_frames(self, frames: list[Any]) -> Sequence[TokenDelta]:
        result = decode_output(memoryview(frames[0]))  # zero-copy over the zmq frame
        if isinstance(result, list):
            if self._tops:  # empty unless a request asked two top-k counts
                self._trim_tops(result)
            health = self._health_rid
            if health is None:
                return result
            deltas = []
            for delta in result:
                if delta.rid == health:
                    self._health_done.set()
                else:
                    deltas.append(delta)
            return deltas
        # A busy scheduler answers the oldest pending health check with a HealthCheckOutput
        # whose rid is None (seen live on 0.5.23), so any HealthCheckOutput is the answer.
        if self._health_rid is not None and isinstance(result, HealthCheckOutput):
            self._health_done.set()
        return ()


def _positive(value: object) -> int | None:
    return value if isinstance(value, int) and value > 0 else None
