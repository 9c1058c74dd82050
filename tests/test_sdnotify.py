"""systemd notifications: a fake NOTIFY_SOCKET (a datagram socket the test binds) sees what
smgd says: READY=1 once ready, RELOADING=1/READY=1 around a reload, STOPPING=1 at drain, and
WATCHDOG=1 every half WATCHDOG_USEC."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trio.testing

from smgd.sdnotify import notify, watchdog, watchdog_interval

from .daemon_harness import config_text, engine_toml, running_daemon
from .engine_harness import short_ipc_dir


class Inbox:
    """Datagrams received on the fake notify socket, with the (trio) time each arrived."""

    def __init__(self) -> None:
        self.messages: list[tuple[float, str]] = []
        self._changed = trio.Event()

    def states(self) -> list[str]:
        return [text for _, text in self.messages]

    async def wait_for(self, state: str, count: int = 1) -> None:
        while sum(text.startswith(state) for text in self.states()) < count:
            self._changed = trio.Event()
            await self._changed.wait()

    async def pump(self, sock: trio.socket.SocketType) -> None:
        while True:
            data = await sock.recv(4096)
            self.messages.append((trio.current_time(), data.decode()))
            self._changed.set()


@asynccontextmanager
async def notify_socket(monkeypatch: pytest.MonkeyPatch, address: str) -> AsyncIterator[Inbox]:
    """Bind ``address`` (``@name`` = abstract namespace) and point NOTIFY_SOCKET at it."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    with sock:
        await sock.bind("\0" + address[1:] if address.startswith("@") else address)
        monkeypatch.setenv("NOTIFY_SOCKET", address)
        inbox = Inbox()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(inbox.pump, sock)
            yield inbox
            nursery.cancel_scope.cancel()


@pytest.fixture
def no_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("no_systemd")
def test_notify_without_notify_socket_sends_nothing() -> None:
    assert notify("READY=1") is False


@pytest.mark.usefixtures("no_systemd")
async def test_notify_to_a_path_and_reloading_carries_monotonic_usec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with notify_socket(monkeypatch, str(short_ipc_dir() / "notify")) as inbox:
        assert notify("READY=1")
        assert notify("RELOADING=1")
        with trio.fail_after(5):
            await inbox.wait_for("RELOADING=1")
    ready, reloading = inbox.states()
    assert ready == "READY=1"
    first, second = reloading.split("\n")
    assert first == "RELOADING=1"
    key, _, usec = second.partition("=")
    assert key == "MONOTONIC_USEC"
    # systemd compares it with CLOCK_MONOTONIC, in microseconds.
    assert abs(int(usec) / 1e6 - time.monotonic()) < 5


@pytest.mark.usefixtures("no_systemd")
def test_notify_to_a_socket_nobody_listens_on_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(short_ipc_dir() / "absent"))
    assert notify("READY=1") is False  # no exception, no block


@pytest.mark.usefixtures("no_systemd")
def test_watchdog_interval_is_half_of_watchdog_usec(monkeypatch: pytest.MonkeyPatch) -> None:
    assert watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "3000000")
    assert watchdog_interval() == 1.5
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval() == 1.5
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # the watchdog is someone else's
    assert watchdog_interval() is None


@pytest.mark.usefixtures("no_systemd")
async def test_watchdog_pings_every_interval(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    async with notify_socket(monkeypatch, f"@smgd-test-{uuid.uuid4().hex}") as inbox:
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watchdog, 7.5)
            with trio.fail_after(100):
                await inbox.wait_for("WATCHDOG=1", count=5)
            nursery.cancel_scope.cancel()
    times = [when - start for when, text in inbox.messages if text == "WATCHDOG=1"]
    assert times[:5] == pytest.approx([0.0, 7.5, 15.0, 22.5, 30.0])


@pytest.mark.usefixtures("no_systemd")
@pytest.mark.parametrize("usec", [None, "0", "3000000"])
async def test_watchdog_pings_only_when_systemd_asks_for_it(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock, usec: str | None
) -> None:
    """No WATCHDOG_USEC (or 0, which would make the loop spin): the task returns at once."""
    if usec is not None:
        monkeypatch.setenv("WATCHDOG_USEC", usec)
    pings: list[float] = []

    def record(state: str) -> bool:
        pings.append(trio.current_time())
        assert len(pings) < 100, "the watchdog spins"  # a spinning loop fails here, fast
        return True

    monkeypatch.setattr("smgd.sdnotify.notify", record)
    start = trio.current_time()
    with trio.move_on_after(10) as waited:
        await watchdog()
    assert waited.cancelled_caught is (usec == "3000000")
    expected = [0.0, 1.5, 3.0, 4.5, 6.0, 7.5, 9.0] if usec == "3000000" else []
    assert [t - start for t in pings] == pytest.approx(expected)


@pytest.mark.usefixtures("no_systemd")
async def test_daemon_notifies_ready_reloading_watchdog_and_stopping(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # 0.2 s watchdog -> a ping every 0.1 s of real time: several arrive while the test runs.
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    path = tmp_path / "smgd.toml"
    path.write_text(config_text(engine_toml("e", "m", step_ms=1)))
    address = f"@smgd-test-{uuid.uuid4().hex}"
    async with (
        notify_socket(monkeypatch, address) as inbox,
        running_daemon(path) as (daemon, client),
    ):
        with trio.fail_after(30):
            await inbox.wait_for("READY=1")
        assert (await client.get("/readiness")).status_code == 200
        result = await daemon.reload()
        assert result.ok
        with trio.fail_after(5):
            await inbox.wait_for("READY=1", count=2)
            await inbox.wait_for("WATCHDOG=1", count=3)
        daemon.drain()
        with trio.fail_after(5):
            await inbox.wait_for("STOPPING=1")
    states = [s.split("\n")[0] for s in inbox.states() if s != "WATCHDOG=1"]
    assert states == ["READY=1", "RELOADING=1", "READY=1", "STOPPING=1"]


def _long_notify_path() -> str:
    # 150 bytes: over the 108 a unix socket address holds (a deep $RUNTIME_DIRECTORY can be).
    base = str(short_ipc_dir())
    return base + "/" + "n" * (150 - len(base) - 1)


@pytest.mark.usefixtures("no_systemd")
def test_a_notify_socket_path_over_the_limit_is_one_logged_error_not_an_exception(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    address = _long_notify_path()
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    with caplog.at_level("ERROR", logger="smgd.sdnotify"):
        assert notify("READY=1") is False
        assert notify("WATCHDOG=1") is False
    (record,) = caplog.records  # once per address, not at every watchdog ping
    assert "150 bytes, over the 108-byte unix socket address limit" in record.getMessage()
    assert address in record.getMessage()


@pytest.mark.usefixtures("no_systemd")
def test_an_unusable_notify_socket_is_reported_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    not_a_socket = short_ipc_dir() / "file"
    not_a_socket.write_text("")
    monkeypatch.setenv("NOTIFY_SOCKET", str(not_a_socket))
    with caplog.at_level("ERROR", logger="smgd.sdnotify"):
        assert notify("READY=1") is False
    (record,) = caplog.records
    assert "Connection refused" in record.getMessage()


@pytest.mark.usefixtures("no_systemd")
async def test_the_daemon_serves_with_a_notify_socket_path_over_the_limit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", _long_notify_path())
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # a ping every 50 ms: many notify calls
    path = tmp_path / "smgd.toml"
    path.write_text(config_text(engine_toml("e", "m", step_ms=1)))
    with caplog.at_level("ERROR", logger="smgd.sdnotify"):
        async with running_daemon(path) as (_, client):
            with trio.fail_after(30):
                while (await client.get("/readiness")).status_code != 200:  # noqa: ASYNC110
                    await trio.sleep(0.05)
            await trio.sleep(0.3)  # READY=1 and several watchdog pings went nowhere
            assert (await client.get("/readiness")).status_code == 200
    errors = [r for r in caplog.records if r.name == "smgd.sdnotify"]
    assert len(errors) == 1
