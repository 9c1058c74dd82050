"""TrioSocket / monitor tests over real ipc sockets in a temp dir, both ends in one trio loop.

Tests that wait on real zmq I/O use ``trio.fail_after`` so a hang fails instead of blocking CI.
Tests that need time to pass use ``autojump_clock`` and no real-time ``fail_after`` (the mock
clock would jump to it while the zmq I/O thread works).
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.testing
import zmq

from smgd.errors import TransportError
from smgd.ipc import ipc_endpoint
from smgd.zmq_trio import TrioSocket, monitor_events, open_monitor, open_socket

Ctx = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    yield context
    context.destroy(linger=0)


@asynccontextmanager
async def bound_and_connected(
    ctx: Ctx, ep: str, bound_type: int, connecting_type: int
) -> AsyncIterator[tuple[TrioSocket, TrioSocket]]:
    """(bound, connecting): a socket of ``bound_type`` bound on ``ep``, one connected to it."""
    async with (
        open_socket(bound_type, context=ctx) as bound,
        open_socket(connecting_type, context=ctx) as connecting,
    ):
        bound.socket.bind(ep)
        connecting.socket.connect(ep)
        yield bound, connecting


@pytest.fixture
async def pair(ctx: Ctx, tmp_path: Path) -> AsyncIterator[tuple[TrioSocket, TrioSocket]]:
    """(push, pull): PULL bound on ipc, PUSH connected."""
    ep = ipc_endpoint(tmp_path / "p.sock")
    async with bound_and_connected(ctx, ep, zmq.PULL, zmq.PUSH) as (pull, push):
        yield push, pull


def num(frame: zmq.Frame) -> int:
    return int.from_bytes(frame.buffer, "little")


def frame(i: int) -> bytes:
    return i.to_bytes(4, "little")


# -- soak / throughput ------------------------------------------------------------------------


async def _soak(
    push: TrioSocket,
    pull: TrioSocket,
    n: int,
    *,
    batch: bool,
    limit_s: float,
    until_sender_parks: int = 0,
) -> int:
    """Send up to n messages and check them in order; returns how many were sent.

    ``until_sender_parks``: stop sending once the sender has parked that many times, and
    before each receive wait until the sender is parked (or done), so each round crosses the
    sender's edge whatever the relative speed of the two sides on this machine."""
    sent = 0
    done = False

    async def sender() -> None:
        nonlocal sent, done
        while sent < n and push.statistics().waits < (until_sender_parks or n + 1):
            await push.send_multipart([frame(sent), b"payload"])
            sent += 1
        done = True

    expected = 0
    with trio.fail_after(limit_s):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender)
            while True:
                if until_sender_parks:
                    # Returns once every task but this one is blocked: the sender is parked
                    # on its FD (or finished), so `done` is current.
                    await trio.testing.wait_all_tasks_blocked()
                    if done and expected == sent:
                        break
                elif expected == n:  # the sender sends all n here
                    break
                msgs = await pull.recv_multipart_batch() if batch else [await pull.recv_multipart()]
                for msg in msgs:
                    assert len(msg) == 2
                    assert num(msg[0]) == expected  # no loss, no duplicate, in order
                    expected += 1
    with pytest.raises(trio.WouldBlock):
        pull.recv_multipart_nowait()
    return sent


async def test_soak_200k_push_pull_no_loss_no_hang(
    pair: tuple[TrioSocket, TrioSocket],
) -> None:
    push, pull = pair
    await _soak(push, pull, 200_000, batch=True, limit_s=60)
    # The edge-triggered park paths were exercised: whichever side is faster waits for the
    # other (which side that is depends on the machine, so only the sum is certain; the
    # tiny-HWM soak below forces the sender to park).
    assert push.statistics().waits + pull.statistics().waits > 0


@pytest.mark.parametrize("batch", [True, False])
async def test_soak_tiny_hwm_parks_on_every_few_messages(
    ctx: Ctx, tmp_path: Path, batch: bool
) -> None:
    ep = ipc_endpoint(tmp_path / "t.sock")
    async with (
        open_socket(zmq.PULL, context=ctx) as pull,
        open_socket(zmq.PUSH, context=ctx) as push,
    ):
        # HWM 1 on both ends: nearly every send and recv crosses an edge.
        pull.socket.setsockopt(zmq.RCVHWM, 1)
        push.socket.setsockopt(zmq.SNDHWM, 1)
        # Small kernel buffers too (the kernel rounds up to its minimum), else the unix
        # socket's own buffer holds ~150 messages and the sender parks only once per that many.
        pull.socket.setsockopt(zmq.RCVBUF, 1024)
        push.socket.setsockopt(zmq.SNDBUF, 1024)
        pull.socket.bind(ep)
        push.socket.connect(ep)
        # ~1.5 s normally. A lost edge usually stalls until some unrelated mailbox command
        # wakes the FD (observed: 25-36 s), so a 15 s bound turns that into a failure.
        # Counting parks in a fixed number of messages depended on which side was faster
        # (79 parks in 20,000 on a loaded CI box); instead the sender goes on until it has
        # parked 300 times, the consumer letting it park before every receive.
        sent = await _soak(push, pull, 200_000, batch=batch, limit_s=15, until_sender_parks=300)
        assert push.statistics().waits >= 300
        assert sent < 200_000  # parked on every few messages, not once in a long while


async def test_slow_consumer_sender_far_ahead_no_loss(
    pair: tuple[TrioSocket, TrioSocket],
) -> None:
    push, pull = pair
    n, hwm = 5_000, 100
    push.socket.setsockopt(zmq.SNDHWM, hwm)
    sent = 0
    max_ahead = 0

    async def sender() -> None:
        nonlocal sent
        for i in range(n):
            await push.send_multipart([frame(i)])
            sent += 1

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender)
            for expected in range(n):
                msg = await pull.recv_multipart()
                assert num(msg[0]) == expected
                max_ahead = max(max_ahead, sent - expected)
                # A slow consumer: give the sender ten turns per message received.
                for _ in range(10):
                    await trio.lowlevel.checkpoint()
    assert max_ahead >= hwm  # the sender really ran far ahead...
    assert push.statistics().waits > 0  # ...until backpressure parked it


# -- the armed receive --------------------------------------------------------------------------


def count_events_reads(sock: TrioSocket) -> list[int]:
    """Wrap ``sock``'s EVENTS reads; the returned list grows by one per read."""
    reads: list[int] = []
    getsockopt = sock._getsockopt

    def counting(option: int) -> int:
        if option == zmq.EVENTS:
            reads.append(option)
        return getsockopt(option)

    sock._getsockopt = counting
    return reads


async def test_a_receive_after_a_batch_parks_first_and_misses_nothing(
    pair: tuple[TrioSocket, TrioSocket],
) -> None:
    push, pull = pair
    reads = count_events_reads(pull)
    extra_reads: list[int] = []  # per batch: EVENTS reads beyond one per message
    got: list[int] = []

    async def receiver() -> None:
        while len(got) < 40:
            before = len(reads)
            batch = await pull.recv_multipart_batch()
            got.extend(num(m[0]) for m in batch)
            extra_reads.append(len(reads) - before - len(batch))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receiver)
            for i in range(40):
                if i % 2:
                    # Sent while the receiver is parked (an engine step between two idle
                    # gaps) ...
                    await trio.testing.wait_all_tasks_blocked()
                    await push.send_multipart([frame(i)])
                else:
                    # ... or while it is between two batches (a step that arrives during
                    # delivery): the FD armed by the last batch must still report it.
                    await push.send_multipart([frame(i)])
                    await trio.sleep(0.002)  # let the I/O thread hand it over
    assert got == list(range(40))
    # After the first batch each one ends on an EVENTS read that said "none", so the next
    # parks at once: one read per message that says "a message", one that says "no more".
    # (Reading EVENTS before parking, and again after waking, made it four more.)
    assert extra_reads[1:] == [1] * (len(extra_reads) - 1)


async def test_any_other_call_on_the_socket_disarms_the_next_receive(
    ctx: Ctx, tmp_path: Path
) -> None:
    # A send on a two-way socket processes its mailbox, which clears the FD's signal for a
    # message that arrived meanwhile. A receive that still parked first would wait forever.
    ep = ipc_endpoint(tmp_path / "d.sock")
    async with bound_and_connected(ctx, ep, zmq.PAIR, zmq.PAIR) as (ours, peer):
        with trio.fail_after(10):
            await peer.send_multipart([frame(1)])
            assert [num(m[0]) for m in await ours.recv_multipart_batch()] == [1]
            await peer.send_multipart([frame(2)])
            await trio.sleep(0.05)  # the message is queued and the FD signalled
            ours.send_multipart_nowait([frame(9)])  # eats the signal
            assert [num(m[0]) for m in await ours.recv_multipart_batch()] == [2]
            assert num((await peer.recv_multipart())[0]) == 9


# -- cancellation -----------------------------------------------------------------------------


async def test_cancelled_recv_then_later_message_is_received(
    pair: tuple[TrioSocket, TrioSocket],
) -> None:
    push, pull = pair
    scope = trio.CancelScope()

    async def receiver() -> None:
        with scope:
            await pull.recv_multipart()
            pytest.fail("nothing was sent yet")

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receiver)
            await trio.testing.wait_all_tasks_blocked()
            assert pull.statistics().busy
            scope.cancel()
        assert scope.cancelled_caught
        assert not pull.statistics().busy
        await push.send_multipart([frame(7)])
        msg = await pull.recv_multipart()
    assert num(msg[0]) == 7


@pytest.mark.parametrize("batch", [True, False])
async def test_recv_cancelled_at_random_points_never_loses_a_message(
    pair: tuple[TrioSocket, TrioSocket], batch: bool
) -> None:
    push, pull = pair
    n = 3_000
    rng = random.Random(1234)
    got: list[int] = []
    current = trio.CancelScope()
    cancels = 0

    async def sender() -> None:
        for i in range(n):
            await push.send_multipart([frame(i)])
            for _ in range(rng.randint(0, 2)):
                await trio.lowlevel.checkpoint()

    async def canceller() -> None:
        nonlocal cancels
        while len(got) < n:
            for _ in range(rng.randint(0, 3)):
                await trio.lowlevel.checkpoint()
            if not current.cancel_called:
                current.cancel()
                cancels += 1

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender)
            nursery.start_soon(canceller)
            while len(got) < n:
                current = trio.CancelScope()
                with current:
                    if batch:
                        got.extend(num(m[0]) for m in await pull.recv_multipart_batch(4))
                    else:
                        got.append(num((await pull.recv_multipart())[0]))
    assert got == list(range(n))
    assert cancels > 100  # the cancels really landed all over the receive path


async def test_cancelled_send_on_peerless_push_sent_nothing(ctx: Ctx, tmp_path: Path) -> None:
    ep = ipc_endpoint(tmp_path / "s.sock")
    async with (
        open_socket(zmq.PUSH, context=ctx) as push,
        open_socket(zmq.PULL, context=ctx) as pull,
    ):
        push.socket.bind(ep)  # bound and nobody connected: a PUSH cannot send
        scope = trio.CancelScope()

        async def sender() -> None:
            with scope:
                await push.send_multipart([b"a", b"b", b"c"], deadline=trio.current_time() + 1e6)
                pytest.fail("a peerless PUSH cannot send")

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender)
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()
            assert scope.cancelled_caught
            pull.socket.connect(ep)
            await push.send_multipart([b"x", b"y", b"z"])
            # Had the cancelled send queued anything (even one part), it would arrive first.
            assert await pull.recv_multipart(copy=True) == [b"x", b"y", b"z"]
        with pytest.raises(trio.WouldBlock):
            pull.recv_multipart_nowait()


async def test_send_deadline_on_peerless_push_raises_transport_error(
    ctx: Ctx, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with open_socket(zmq.PUSH, context=ctx) as push:
        push.socket.bind(ipc_endpoint(tmp_path / "d.sock"))
        t0 = trio.current_time()
        with pytest.raises(TransportError, match="deadline") as info:
            await push.send_multipart([b"x"], deadline=t0 + 30)
        assert info.value.code == "send_deadline"
        assert trio.current_time() >= t0 + 30
        with pytest.raises(trio.WouldBlock):
            push.send_multipart_nowait([b"x"])


# -- ownership, close, errors -------------------------------------------------------------------


async def test_second_waiter_is_a_clear_busy_error(pair: tuple[TrioSocket, TrioSocket]) -> None:
    push, pull = pair
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pull.recv_multipart)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.BusyResourceError, match="exactly one task"):
                await pull.recv_multipart_batch()
            # A nowait call would eat the parked task's edge: refused too.
            with pytest.raises(trio.BusyResourceError):
                pull.recv_multipart_nowait()
            await push.send_multipart([frame(1)])  # releases the parked receiver
    assert not pull.statistics().busy


async def test_close_wakes_parked_task_and_later_calls_fail(
    pair: tuple[TrioSocket, TrioSocket],
) -> None:
    _, pull = pair
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def receiver() -> None:
                with pytest.raises(trio.ClosedResourceError):
                    await pull.recv_multipart()

            nursery.start_soon(receiver)
            await trio.testing.wait_all_tasks_blocked()
            pull.close()
    assert pull.closed
    assert pull.socket.closed
    pull.close()  # idempotent
    with pytest.raises(trio.ClosedResourceError):
        pull.recv_multipart_nowait()
    with pytest.raises(trio.ClosedResourceError):
        await pull.recv_multipart()


async def test_open_socket_sets_linger_zero(ctx: Ctx) -> None:
    async with open_socket(zmq.PUSH, context=ctx) as push:
        assert push.socket.getsockopt(zmq.LINGER) == 0
    assert push.closed


async def test_router_mandatory_unknown_peer_is_transport_error_with_errno(
    ctx: Ctx, tmp_path: Path
) -> None:
    async with open_socket(zmq.ROUTER, context=ctx) as router:
        router.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.socket.bind(ipc_endpoint(tmp_path / "r.sock"))
        with pytest.raises(TransportError) as info:
            await router.send_multipart([b"nobody", b"", b"x"])
        assert info.value.code == "EHOSTUNREACH"
        assert isinstance(info.value.__cause__, zmq.ZMQError)
        with pytest.raises(TransportError):
            router.send_multipart_nowait([b"nobody", b"x"])
        assert not router.statistics().busy


class _StuckRouter:
    """ROUTER_MANDATORY with the target peer's pipe full: EVENTS claims POLLOUT (another peer
    has room) but every send to this peer fails with EAGAIN, and the FD never fires."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self.sends = 0
        self.closed = False

    def getsockopt(self, opt: int) -> int:
        return self.read_fd if opt == zmq.FD else zmq.POLLOUT

    def send_multipart(self, frames: Any, flags: int = 0) -> None:
        self.sends += 1
        if self.sends > 100_000:
            raise AssertionError("send loop is spinning without yielding")
        raise zmq.Again

    def close(self, linger: int | None = None) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)
        self.closed = True


async def test_ready_but_eagain_polls_instead_of_spinning_until_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = _StuckRouter()
    sock = TrioSocket(cast("zmq.Socket[bytes]", fake))
    t0 = trio.current_time()
    try:
        with pytest.raises(TransportError, match="deadline"):
            await sock.send_multipart([b"peer", b"x"], deadline=t0 + 1)
    finally:
        sock.close()
    assert trio.current_time() >= t0 + 1
    # Polled at ~1 ms: on the order of a thousand attempts, not a hot spin.
    assert 100 < fake.sends < 5_000
    assert fake.closed


async def test_close_during_ready_but_eagain_poll_raises_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = _StuckRouter()
    sock = TrioSocket(cast("zmq.Socket[bytes]", fake))
    async with trio.open_nursery() as nursery:

        async def sender() -> None:
            with pytest.raises(trio.ClosedResourceError):
                await sock.send_multipart([b"peer", b"x"])

        nursery.start_soon(sender)
        await trio.sleep(0.05)  # virtual time: the sender is in its poll loop
        assert sock.statistics().busy
        sock.close()
    assert fake.closed


# -- monitor ------------------------------------------------------------------------------------

ATTACH_DETACH = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


async def test_monitor_reports_peer_attach_then_detach(ctx: Ctx, tmp_path: Path) -> None:
    ep = ipc_endpoint(tmp_path / "m.sock")
    async with open_socket(zmq.PULL, context=ctx) as pull:
        pull.socket.bind(ep)
        with trio.fail_after(10):
            async with open_monitor(pull, ATTACH_DETACH) as events:
                async with open_socket(zmq.PUSH, context=ctx) as push:
                    async with open_monitor(push, zmq.EVENT_CONNECTED) as push_events:
                        push.socket.connect(ep)
                        connected = await push_events.receive()
                    accepted = await events.receive()
                # the PUSH is closed now
                gone = await events.receive()
    assert (connected.kind, connected.endpoint) == ("connected", ep)
    assert (accepted.kind, accepted.endpoint) == ("accepted", ep)
    assert (gone.kind, gone.endpoint) == ("disconnected", ep)


_PEER = """
import sys, time, zmq
s = zmq.Context().socket(zmq.PUSH)
s.connect(sys.argv[1])
time.sleep(60)
"""


async def test_monitor_reports_peer_process_that_dies(ctx: Ctx, tmp_path: Path) -> None:
    ep = ipc_endpoint(tmp_path / "k.sock")
    async with open_socket(zmq.PULL, context=ctx) as pull:
        pull.socket.bind(ep)
        kinds: list[str] = []
        with trio.fail_after(30):
            async with aclosing(monitor_events(pull, ATTACH_DETACH)) as events:
                proc = await trio.lowlevel.open_process([sys.executable, "-c", _PEER, ep])
                try:
                    async for event in events:
                        kinds.append(event.kind)
                        if event.kind == "accepted":
                            proc.kill()  # SIGKILL: no goodbye, the kernel closes its socket
                        elif event.kind == "disconnected":
                            break
                finally:
                    proc.kill()
                    await proc.wait()
    assert kinds == ["accepted", "disconnected"]


async def test_monitor_stream_ends_when_socket_closes(ctx: Ctx) -> None:
    async with open_socket(zmq.PULL, context=ctx) as pull:
        pull.socket.bind("inproc://closing")
        seen: list[str] = []
        with trio.fail_after(10):
            async with open_monitor(pull, zmq.EVENT_CLOSED | zmq.EVENT_MONITOR_STOPPED) as events:
                pull.close()
                async for event in events:  # must terminate on its own
                    seen.append(event.kind)
    assert seen[-1] == "monitor_stopped"
