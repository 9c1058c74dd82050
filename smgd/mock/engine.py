"""The mock engine's trio shell: sockets, the step loop, fault injection.

The wire-specific part is a :class:`MockWire` (one per engine wire); the scheduling is the
sans-IO :class:`~smgd.mock.scheduler.MockScheduler`. One task owns the input socket and feeds
the scheduler; the step loop owns the output socket and sends one batched frame per step,
exactly like a real scheduler. Runs in-process (tests) or as ``smgd mock-engine`` (a child).

Faults, on command (:meth:`MockEngine.inject` or the ``--control`` socket):
``die`` (exit at once, exit code 1), ``hang`` (stop stepping and reading), ``garble`` (every
output message becomes an undecodable frame), ``silent`` (keep reading, never send), ``lose``
(drop the requests that arrive, answer the rest: SGLang health checks, vLLM utility calls),
``ok`` (clear faults).
"""

from __future__ import annotations

import json
import logging
import os
from itertools import islice
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar

import trio
import zmq

from smgd.zmq_trio import TrioSocket

if TYPE_CHECKING:
    from collections.abc import Sequence

    from smgd.mock.scheduler import MockScheduler, StepOutput

log = logging.getLogger("smgd.mock")
_T = TypeVar("_T")
_V = TypeVar("_V")

# "lose": requests that arrive while it is set are dropped unanswered (an engine that loses a
# request while it serves the others and answers its health checks); running ones go on.
Fault = Literal["die", "hang", "garble", "silent", "lose", "ok"]
FAULTS: tuple[Fault, ...] = ("die", "hang", "garble", "silent", "lose", "ok")
GARBAGE = b"\xc1 not msgpack \xff"
# What a mock wire records of what it got (request ids, aborts, utility calls), for tests and
# a look from a debugger: the last RECORDED of each at least, 2 x RECORDED at most. A mock that
# runs for long (a bench, the built-in engine of `smgd serve`) must not keep every id it got:
# the vLLM mock's records held ~130 bytes per request (its 32-character id, a list entry and
# a dict entry), ~50 KB a second at the 400 requests a second of `smgd bench`'s C = 1,024.
RECORDED = 4096


def record(entries: list[_T], entry: _T) -> None:
    """Append ``entry`` to ``entries``, dropping the oldest past 2 x :data:`RECORDED` (in
    one cut, down to RECORDED: the cost of a cut spread over as many appends)."""
    entries.append(entry)
    if len(entries) > 2 * RECORDED:
        del entries[:-RECORDED]


def record_in(table: dict[str, _V], key: str, value: _V) -> None:
    """``table[key] = value``, dropping the oldest keys past 2 x :data:`RECORDED`, as
    :func:`record` does."""
    table[key] = value
    if len(table) > 2 * RECORDED:
        for old in list(islice(table, len(table) - RECORDED)):
            del table[old]


class MockWire(Protocol):
    """What a wire adds to the generic mock."""

    async def open(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> tuple[TrioSocket, TrioSocket]:
        """Connect (and handshake); return (input socket, output socket)."""
        ...

    def on_request(self, frames: Sequence[bytes], sched: MockScheduler) -> list[list[bytes]]:
        """Apply one request message; return messages to send back at once (if any)."""
        ...

    def encode_step(
        self, outputs: list[StepOutput], aborted_queued: list[str], sched: MockScheduler
    ) -> list[list[bytes]]:
        """Messages for one step's outputs (usually one batch message)."""
        ...

    def garbage(self) -> list[bytes]: ...


def connect_data_sockets(
    ctx: zmq.Context[zmq.Socket[bytes]], identity: bytes, input_addr: str, output_addr: str
) -> tuple[TrioSocket, TrioSocket]:
    """The engine side of the vLLM/TokenSpeed data plane, once INIT named smgd's addresses.

    A DEALER carrying this rank's identity reads from smgd's input ROUTER; a PUSH writes to
    smgd's output PULL. Unlimited HWMs, as the engines set them.
    """
    inp = ctx.socket(zmq.DEALER)
    out = ctx.socket(zmq.PUSH)
    for sock in (inp, out):
        sock.setsockopt(zmq.LINGER, 0)
    inp.setsockopt(zmq.IDENTITY, identity)
    inp.setsockopt(zmq.RCVHWM, 0)
    out.setsockopt(zmq.SNDHWM, 0)
    inp.connect(input_addr)
    out.connect(output_addr)
    return TrioSocket(inp), TrioSocket(out)


class EngineExit(Exception):
    """The mock was asked to exit (shutdown request or a `die` fault)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class MockEngine:
    def __init__(
        self,
        wire: MockWire,
        sched: MockScheduler,
        *,
        step_s: float,
        control: str | None = None,
        exit_process_on_die: bool = False,
    ) -> None:
        self.wire = wire
        self.sched = sched
        self.step_s = step_s
        self.control = control
        self.exit_process_on_die = exit_process_on_die
        self.fault: Fault = "ok"
        self._work = trio.Event()
        self._fault_changed = trio.Event()
        self.frames_sent = 0

    def inject(self, fault: Fault) -> None:
        log.warning("mock: fault %s", fault)
        if fault == "die":
            if self.exit_process_on_die:
                os._exit(1)
            raise EngineExit(1)
        self.fault = fault
        self.sched.lose_requests = fault == "lose"
        changed, self._fault_changed = self._fault_changed, trio.Event()
        changed.set()
        self._work.set()

    async def run(
        self, *, task_status: trio.TaskStatus[MockEngine] = trio.TASK_STATUS_IGNORED
    ) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            in_sock, out_sock = await self.wire.open(ctx)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._reader, in_sock, out_sock)
                    if self.control:
                        nursery.start_soon(self._control_task, ctx, self.control)
                    task_status.started(self)
                    await self._step_loop(out_sock)
            finally:
                in_sock.close()
                out_sock.close()
        finally:
            ctx.term()

    async def _reader(self, in_sock: TrioSocket, out_sock: TrioSocket) -> None:
        while True:
            batch = await in_sock.recv_multipart_batch(256, copy=True)
            # After the read, not only before it: a message that came while the reader waited
            # and the engine hung meanwhile is not answered either (a vLLM utility call, which
            # the reader answers itself, was answered by a hung mock).
            while self.fault == "hang":
                await self._fault_changed.wait()
            for frames in batch:
                replies = self.wire.on_request(frames, self.sched)
                if self.fault != "silent":
                    for reply in replies:
                        await out_sock.send_multipart(reply)
            self._work.set()

    async def _step_loop(self, out_sock: TrioSocket) -> None:
        next_step = trio.current_time()
        while True:
            if self.sched.idle and self.fault != "garble":
                self._work = trio.Event()
                await self._work.wait()
                next_step = trio.current_time()
            while self.fault in ("hang", "silent"):
                # Nothing is produced: park until the next fault command (e.g. "ok").
                await self._fault_changed.wait()
                next_step = trio.current_time()
            outputs = self.sched.step()
            messages = self.wire.encode_step(outputs, self.sched.take_aborted_queued(), self.sched)
            if self.fault == "garble":
                # Every message of the step is replaced: the outputs are lost, as they would be
                # if the engine wrote a frame smgd cannot decode.
                messages = [self.wire.garbage() for _ in messages] or [self.wire.garbage()]
            for message in messages:
                await out_sock.send_multipart(message)
                self.frames_sent += 1
            next_step += self.step_s
            now = trio.current_time()
            if next_step > now:
                await trio.sleep_until(next_step)
            else:
                # Fell behind (steps cost more than step_s): do not try to catch up in a burst.
                next_step = now
                await trio.lowlevel.checkpoint()

    async def _control_task(self, ctx: zmq.Context[zmq.Socket[bytes]], addr: str) -> None:
        sock = TrioSocket(ctx.socket(zmq.PULL))
        sock.socket.bind(addr)
        try:
            while True:
                frames = await sock.recv_multipart(copy=True)
                try:
                    command = json.loads(frames[0])
                    fault = command["fault"]
                except (ValueError, KeyError, TypeError):
                    log.warning("mock: bad control message")
                    continue
                if fault in FAULTS:
                    self.inject(fault)
        finally:
            sock.close()
