"""The start gate: a wave of request starts goes a time budget's worth per scheduler pass,
in order; a lone request goes at once."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
from hypercorn.config import Config as HypercornConfig

from smgd.api.http import worker_loop
from smgd.api.http.app import create_app
from smgd.api.http.start_gate import (
    IDLE_WINDOW_S,
    MIN_BUDGET_S,
    IdleShare,
    PassCounter,
    Slices,
    StartGate,
)

from .fake_engine import MODEL, FakeEngine, open_gateway
from .http_helpers import dechunk

MS = 0.001


def test_a_pass_lets_starts_through_until_its_budget_is_spent() -> None:
    slices = Slices()
    t = 10.0
    assert slices.arrive(t, 1)  # the first start of a pass always goes
    went = 1
    while slices.arrive(t + went * MS, 1):
        went += 1
    assert went == round(MIN_BUDGET_S / MS)  # 0, 1, ... 4 ms in, not at 5
    assert not slices.arrive(t + 0.1, 1)  # spent for the rest of the pass
    # The next pass: the pump wakes as many as the last slice took, whether it runs before
    # this pass's first start (it sees the last slice whole) or after it (the one before).
    assert slices.to_wake(2) == went
    assert slices.arrive(t + 0.2, 2)
    assert slices.to_wake(2) == went


def test_a_woken_slice_gets_as_much_time_as_the_rest_of_the_loop_took() -> None:
    slices = Slices()
    assert slices.arrive(0.0, 1)
    assert not slices.arrive(MIN_BUDGET_S, 1)
    # The reader took 40 ms between the two slices: the starts get 40 ms too.
    start = MIN_BUDGET_S + 0.040
    assert slices.arrive(start, 2, woken=True)
    assert slices.arrive(start + 0.039, 2)
    assert not slices.arrive(start + 0.041, 2)


def test_after_an_idle_loop_a_burst_gets_the_least_budget() -> None:
    slices = Slices()
    assert slices.arrive(0.0, 1)
    assert slices.arrive(5.0, 9)  # seconds later, not woken: idle time is not the loop's work
    assert slices.arrive(5.0 + MIN_BUDGET_S - MS, 9)
    assert not slices.arrive(5.0 + MIN_BUDGET_S, 9)


def test_the_pump_wakes_at_least_one() -> None:
    slices = Slices()
    assert slices.arrive(0.0, 1)
    assert not slices.arrive(1.0, 1)
    assert slices.to_wake(2) == 1


async def _wave(
    gate: StartGate, n: int, clock: list[float], work_s: float
) -> list[tuple[int, int]]:
    """``n`` starts runnable in one pass, each ``work_s`` of (fake) preparation once it goes;
    (start, pass) in the order they went."""
    counter = PassCounter()
    trio.lowlevel.add_instrument(counter)
    went: list[tuple[int, int]] = []

    async def start(i: int) -> None:
        await gate.enter()
        went.append((i, counter.passes))
        clock[0] += work_s

    try:
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(start, i)
    finally:
        trio.lowlevel.remove_instrument(counter)
        gate.close()
    return went


async def test_a_wave_goes_a_budget_per_pass_in_order() -> None:
    clock = [0.0]
    gate = StartGate(clock=lambda: clock[0])
    went = await _wave(gate, 60, clock, MS)
    assert sorted(i for i, _ in went) == list(range(60))  # every start went, once
    per_pass: dict[int, int] = {}
    for _, pass_no in went:
        per_pass[pass_no] = per_pass.get(pass_no, 0) + 1
    budget = round(MIN_BUDGET_S / MS)
    assert max(per_pass.values()) <= budget + 1  # one over at most: the first of a pass
    assert len(per_pass) >= 60 // (budget + 1)  # spread over passes
    # Those that waited went in the order they came (trio starts a pass's tasks in no set
    # order, so the order is theirs at the gate, checked by their pass).
    passes = [pass_no for _, pass_no in went]
    assert passes == sorted(passes)
    assert gate.waited >= 60 - budget


async def test_a_lone_start_goes_at_once() -> None:
    clock = [0.0]
    gate = StartGate(clock=lambda: clock[0])
    went = await _wave(gate, 1, clock, MS)
    assert [i for i, _ in went] == [0]
    assert gate.waited == 0


async def test_starts_that_fit_the_budget_do_not_wait() -> None:
    clock = [0.0]
    gate = StartGate(clock=lambda: clock[0])
    went = await _wave(gate, 20, clock, 0.0)  # no work: all fit the first slice
    assert len(went) == 20
    assert gate.waited == 0
    assert len({pass_no for _, pass_no in went}) == 1


async def test_a_waiting_start_that_is_cancelled_leaves_the_line() -> None:
    clock = [0.0]
    gate = StartGate(clock=lambda: clock[0])
    went: list[int] = []
    scopes: dict[int, trio.CancelScope] = {}

    async def start(i: int) -> None:
        with trio.CancelScope() as scopes[i]:
            await gate.enter()
            went.append(i)
            clock[0] += 0.010  # over the budget at once: everyone after waits

    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(start, i)
        for _ in range(2):  # the starts ran (one went), the pump woke the next
            await trio.lowlevel.checkpoint()
        waiting = [i for i in range(5) if i not in went]
        assert waiting  # some wait for later passes
        scopes[waiting[-1]].cancel()
    gate.close()
    assert sorted(went) == sorted(set(range(5)) - {waiting[-1]})
    assert not gate._waiting


@pytest.mark.parametrize("n", [1, 7])
async def test_the_gate_stops_counting_passes_when_closed(n: int) -> None:
    clock = [0.0]
    gate = StartGate(clock=lambda: clock[0])
    await _wave(gate, n, clock, MS)
    assert gate._counter is None


def test_idle_share_says_saturated_after_a_whole_busy_window_only() -> None:
    idle = IdleShare()
    assert not idle.update(0.0, 0.0)
    assert not idle.update(IDLE_WINDOW_S / 2, 0.0)  # half a window: no verdict yet
    assert idle.update(IDLE_WINDOW_S, 0.1 * IDLE_WINDOW_S)  # waited 10 % of it: saturated
    assert idle.update(1.5 * IDLE_WINDOW_S, 0.1 * IDLE_WINDOW_S)  # the verdict holds ...
    # ... until a whole window says otherwise (waited 60 % of the next one).
    assert not idle.update(2 * IDLE_WINDOW_S, 0.7 * IDLE_WINDOW_S)


async def test_a_saturated_loop_lets_a_wave_through_at_once() -> None:
    clock = [0.0]
    gate = StartGate(clock=lambda: clock[0])
    gate._idle.update(-2 * IDLE_WINDOW_S, 0.0)
    gate._idle.update(-IDLE_WINDOW_S, 0.0)  # a whole window without waiting for I/O
    went = await _wave(gate, 30, clock, MS)
    assert len(went) == 30
    assert gate.waited == 0


async def test_the_pass_counter_counts_passes_and_the_time_spent_waiting() -> None:
    counter = PassCounter()
    trio.lowlevel.add_instrument(counter)
    try:
        # Real time on purpose: what is counted is the loop's wait in epoll, which a mock
        # clock's jumps skip.
        await trio.sleep(0.05)
        for _ in range(5):
            await trio.lowlevel.checkpoint()
    finally:
        trio.lowlevel.remove_instrument(counter)
    assert 0.045 <= counter.idle_s < 5
    assert counter.passes >= 5


class _NeverSaturated(IdleShare):
    def update(self, now: float, idle_s: float) -> bool:
        return False


@asynccontextmanager
async def serving(gate: StartGate) -> AsyncIterator[int]:
    async with open_gateway(FakeEngine()) as gateway:
        config = HypercornConfig()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        config.graceful_timeout = 1
        app = create_app(gateway, environ={})
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                lambda task_status: worker_loop.serve(
                    app, config, start_gate=gate, task_status=task_status
                )
            )
            yield int(binds[0].rsplit(":", 1)[1])
            nursery.cancel_scope.cancel()


async def _read_response(stream: trio.SocketStream) -> bytes:
    """One chunked response, to its body's end (the connection stays open: a keep-alive
    request is the fast path's, where the gate is)."""
    data = bytearray()
    while not data.endswith(b"0\r\n\r\n"):
        chunk = await stream.receive_some(65536)
        assert chunk, bytes(data[-200:])
        data += chunk
    return bytes(data)


async def test_a_wave_through_the_server_is_answered_whole() -> None:
    """64 streams sent at once over 64 kept-alive connections, through smgd's worker loop with
    a gate whose clock moves 10 ms a reading (so the second start of any pass waits)."""
    ticks = [0.0]

    def clock() -> float:
        ticks[0] += 0.010
        return ticks[0]

    gate = StartGate(clock=clock)
    gate._idle = _NeverSaturated()  # the fake clock's idle share means nothing
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 5, "stream": True}
    payload = json.dumps(body).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    async with serving(gate) as port:
        streams = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(64)]
        answers: dict[int, bytes] = {}

        async def one(i: int) -> None:
            answers[i] = await _read_response(streams[i])

        await trio.testing.wait_all_tasks_blocked()  # every connection accepted and reading
        for s in streams:  # without a checkpoint between them: they arrive as one wave
            assert os.write(s.socket.fileno(), request) == len(request)
        try:
            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    for i in range(64):
                        nursery.start_soon(one, i)
        finally:
            for s in streams:
                await s.aclose()
    assert gate.waited > 0
    for i in range(64):
        head, _, rest = answers[i].partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), answers[i][:200]
        events = [line for line in dechunk(rest).split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]", events[-3:]
