"""smgd's accept loop (smgd.api.http.accepting) on real loopback sockets."""

from __future__ import annotations

import errno
import socket
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from smgd.api.http import accepting


def _listener(backlog: int = 128) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(backlog)
    return sock


def _connect(port: int, n: int) -> list[socket.socket]:
    """n clients whose handshakes the kernel completed: they wait in the accept queue."""
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]


async def _serve_until(
    done: trio.Event,
    handler: accepting.Handler,
    listener: socket.socket,
    *,
    also: Callable[[], Awaitable[object]] | None = None,
) -> None:
    """Run the accept loop on ``listener`` (and ``also``, a task to run beside it) until
    ``done`` is set (5 s at most), then stop it."""
    async with trio.open_nursery() as nursery:
        if also is not None:
            nursery.start_soon(also)
        nursery.start_soon(
            lambda: accepting.serve_sockets(handler, [listener], handler_nursery=nursery)
        )
        with trio.fail_after(5):
            await done.wait()
        nursery.cancel_scope.cancel()


async def test_connections_waiting_in_the_kernel_are_taken_in_one_pass() -> None:
    listener = _listener()
    clients = _connect(listener.getsockname()[1], 50)
    passes = 0
    started_at: list[int] = []
    all_started = trio.Event()

    async def count_passes() -> None:
        nonlocal passes
        while True:
            passes += 1
            await trio.lowlevel.checkpoint()

    async def handler(stream: trio.SocketStream, fileno: Callable[[], int]) -> None:
        started_at.append(passes)
        if len(started_at) == 50:
            all_started.set()
        await trio.sleep_forever()

    await _serve_until(all_started, handler, listener, also=count_passes)
    # trio's serve_listeners starts one a pass: 50 connections over 50 passes.
    assert max(started_at) - min(started_at) <= 1
    assert listener.fileno() == -1  # closed when the loop ends
    for client in clients:
        client.close()


@pytest.mark.parametrize("ending", ["returns", "raises", "is cancelled"])
async def test_a_connection_is_closed_whatever_way_its_handler_ends(ending: str) -> None:
    server_side, client = socket.socketpair()
    streams: list[trio.SocketStream] = []
    filenos: list[int] = []
    given: list[Callable[[], int]] = []

    async def handler(stream: trio.SocketStream, fileno: Callable[[], int]) -> None:
        streams.append(stream)
        given.append(fileno)
        filenos.append(fileno())
        assert filenos[0] == stream.socket.fileno() >= 0  # the stream's own descriptor
        if ending == "raises":
            raise ValueError("a handler's bug")
        if ending == "is cancelled":
            await trio.sleep_forever()

    with trio.CancelScope() as scope:
        if ending == "is cancelled":
            scope.cancel()  # the server shuts down while the connection is served
        if ending == "raises":
            with pytest.raises(ValueError, match="bug"):
                await accepting._handle(server_side, handler)
        else:
            await accepting._handle(server_side, handler)
    [stream] = streams
    assert stream.socket.fileno() == -1
    assert given[0]() == -1  # the fileno a handler was given knows the socket closed too
    client.settimeout(5)
    assert client.recv(1) == b""  # the client reads the end of the connection
    client.close()


async def test_a_burst_over_the_batch_is_taken_over_several_wakeups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(accepting, "ACCEPT_BATCH", 2)
    listener = _listener()
    clients = _connect(listener.getsockname()[1], 7)
    echoed: list[bytes] = []
    all_echoed = trio.Event()

    async def echo(stream: trio.SocketStream, fileno: Callable[[], int]) -> None:
        data = await stream.receive_some(100)
        echoed.append(data)
        await stream.send_all(data.upper())
        if len(echoed) == 7:
            all_echoed.set()

    for i, client in enumerate(clients):
        client.sendall(b"hello %d" % i)
    await _serve_until(all_echoed, echo, listener)
    assert sorted(echoed) == sorted(b"hello %d" % i for i in range(7))
    for i, client in enumerate(clients):
        assert client.recv(100) == b"HELLO %d" % i
        assert client.recv(100) == b""  # the stream is closed once its handler returns
        client.close()


class _FailingFirst(socket.socket):
    """A listener whose first accepts fail with the given errnos."""

    failures: list[int]

    def accept(self) -> tuple[socket.socket, object]:
        if self.failures:
            code = self.failures.pop(0)
            raise OSError(code, errno.errorcode[code])
        return super().accept()


def _failing_listener(failures: list[int]) -> _FailingFirst:
    sock = _FailingFirst(socket.AF_INET, socket.SOCK_STREAM)
    sock.failures = failures
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


async def test_running_out_of_descriptors_waits_retries_and_says_so_once(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    listener = _failing_listener([errno.EMFILE, errno.EMFILE, errno.EMFILE])
    client = socket.create_connection(listener.getsockname())
    handled_at: list[float] = []
    handled = trio.Event()

    async def handler(stream: trio.SocketStream, fileno: Callable[[], int]) -> None:
        handled_at.append(trio.current_time())
        handled.set()

    start = trio.current_time()
    await _serve_until(handled, handler, listener)
    assert handled_at[0] - start >= 3 * accepting.CAPACITY_RETRY_S
    failed = [r.getMessage() for r in caplog.records if "accept failed" in r.getMessage()]
    assert len(failed) == 1 and "EMFILE" in failed[0]  # once, not once per retry
    assert "accepting connections again: every waiting one taken, after 3 failed tries" in (
        caplog.text
    )
    client.close()


async def test_an_aborted_connection_is_skipped_and_an_unknown_error_ends_the_loop() -> None:
    listener = _failing_listener([errno.ECONNABORTED])
    client = socket.create_connection(listener.getsockname())
    handled = trio.Event()

    async def handler(stream: trio.SocketStream, fileno: Callable[[], int]) -> None:
        handled.set()

    await _serve_until(handled, handler, listener)
    client.close()

    broken = _failing_listener([errno.EBADF])
    other = socket.create_connection(broken.getsockname())
    with pytest.raises(ExceptionGroup) as caught, trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await accepting.serve_sockets(handler, [broken], handler_nursery=nursery)
    assert caught.group_contains(OSError, match="EBADF")
    assert broken.fileno() == -1
    other.close()


def test_a_shortage_is_reported_when_it_starts_and_ends_and_not_at_every_turn() -> None:
    shortage = accepting.Shortage()
    assert shortage.drained() is None  # an empty queue with no shortage: nothing to say
    assert shortage.failed(0.0) == 1  # starts: reported
    assert shortage.failed(0.1) is None  # retries: counted, not reported
    assert shortage.failed(0.2) is None
    assert shortage.drained() == 3  # ends: reported, with its count
    # It starts again within REPORT_EVERY_S (the edge of the limit): counted silently...
    assert shortage.failed(1.0) is None
    assert shortage.failed(1.1) is None
    assert shortage.drained() is None  # ...and its end is not news either
    # The next start after REPORT_EVERY_S is reported with every failure since the last
    # report: the first shortage's two retries, the silent one's two and its own.
    later = accepting.REPORT_EVERY_S + 0.5
    assert shortage.failed(later) == 5
    assert shortage.drained() == 1
