"""The private parts of hypercorn and h11 that smgd builds on, pinned to the versions checked.

smgd's worker loop (smgd.api.http.worker_loop) and direct writes (smgd.api.http.direct) use a
few attributes that are not hypercorn's documented API, and the dispatcher
(smgd.api.http.dispatch) relies on how hypercorn hands a request its messages. Each is named
below with what depends on it. On any other installed version these tests fail until someone
has checked every item against it and updated :data:`TESTED`.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from typing import Any

import pytest
import trio
from hypercorn.config import Config
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import TrioSingleTask

from smgd.api.http import worker_loop
from smgd.api.http.keep_alive import KeepAlive
from smgd.api.http.worker_loop import DirectSendTCPServer

# The versions every item below was checked against.
TESTED = {"hypercorn": "0.18.0", "h11": "0.16.0"}

# (owner, private attribute, its parameters as smgd calls or overrides it, what depends on it)
PRIVATE: list[tuple[type, str, list[str], str]] = [
    (H11Protocol, "_create_stream", ["self", "request"],
     "worker_loop.H11Protocol: refuses a request with Content-Length and Transfer-Encoding"),
    (H11Protocol, "_check_protocol", ["self", "event"],
     "worker_loop.H11Protocol: overridden to take no switch to HTTP/2 (h2c, the preface)"),
    (H11Protocol, "_send_error_response", ["self", "status_code"],
     "worker_loop.H11Protocol: h11's refusals (400, 431, 501) carry the error envelope"),
    (H11Protocol, "_send_h11_event", ["self", "event"],
     "worker_loop.H11Protocol sends its refusal through it"),
    (TCPServer, "_read_data", ["self"],
     "DirectSendTCPServer: its read loop (hypercorn's with a read timeout) calls on_disconnect"),
    (TCPServer, "_initiate_server_close", ["self"],
     "DirectSendTCPServer overrides it (no protocol built only to be told of the close); "
     "hypercorn's _idle_timeout calls it"),
    (TCPServer, "_close", ["self"],
     "DirectSendTCPServer._close: once, and without an EOF after the client's"),
    (TrioSingleTask, "restart", ["self", "task_group", "action"],
     "keep_alive.KeepAlive stands in for TCPServer.idle_task: TCPServer calls restart(), stop()"),
    (TrioSingleTask, "stop", ["self"], "as above"),
    (TaskGroup, "spawn", ["self", "func", "args"],
     "DirectSendTCPServer.run opens the connection's TaskGroup, which the fast path spawns in"),
    (TCPServer, "_idle_timeout", ["self"],
     "fast_path: a request's end restarts the keep-alive timer with it, as TCPServer does"),
]  # fmt: skip


@pytest.mark.parametrize(("dist", "version"), TESTED.items())
def test_the_installed_version_is_the_one_checked(dist: str, version: str) -> None:
    installed = importlib.metadata.version(dist)
    assert installed == version, (
        f"{dist} {installed} is installed; smgd's use of its internals was checked against "
        f"{version}: check every item of tests/test_pins.py against {installed}, then update TESTED"
    )


@pytest.mark.parametrize(("owner", "name", "params", "why"), PRIVATE)
def test_every_private_attribute_used_exists_with_its_parameters(
    owner: type, name: str, params: list[str], why: str
) -> None:
    attribute = getattr(owner, name, None)
    assert callable(attribute), f"{owner.__qualname__}.{name} is gone: {why}"
    assert list(inspect.signature(attribute).parameters) == params, why


def test_a_connection_has_the_attributes_the_worker_loop_and_direct_writes_use() -> None:
    # TCPServer's constructor sets them; DirectSendTCPServer replaces idle_task with its own.
    server = DirectSendTCPServer(None, Config(), None, {}, None)
    assert isinstance(server.send_lock, trio.Lock)  # its own immediate writes check it is free
    assert isinstance(server.idle_task, KeepAlive)
    # DirectSendTCPServer.run does what TCPServer.run does for a plain TCP stream, with
    # ProtocolWrapper's parameters in this order; the fast path's scopes take the connection's
    # addresses from the wrapper.
    assert list(inspect.signature(ProtocolWrapper.__init__).parameters) == [
        "self", "app", "config", "context", "task_group", "state", "ssl", "client", "server",
        "send", "alpn_protocol",
    ]  # fmt: skip
    wrapper = inspect.getsource(ProtocolWrapper.__init__)
    assert "self.client = client" in wrapper and "self.server = server" in wrapper
    run = inspect.getsource(TCPServer.run)
    for step in (
        "self.protocol = ProtocolWrapper(",
        "await self.protocol.initiate()",
        "await self.idle_task.restart(self._task_group, self._idle_timeout)",
        "await self._read_data()",
        "await self._close()",
        'alpn_protocol = "http/1.1"',  # what run() passes for a stream without TLS
    ):
        assert step in run, f"TCPServer.run changed ({step}): check DirectSendTCPServer.run"
    # Its protocol is built when first needed, without the initiate() TCPServer.run awaits:
    # HTTP/1.1's does nothing. And what it does on a close, DirectSendTCPServer does without a
    # protocol: close the stream (protocol_send), tell the protocol, close (the reaper's).
    assert inspect.getsource(H11Protocol.initiate).rstrip().endswith("pass")
    send = inspect.getsource(TCPServer.protocol_send)
    closed = send[send.index("elif isinstance(event, Closed):") :]
    assert closed.split("\n")[1:3] == [
        " " * 12 + "await self._close()",
        " " * 12 + "await self.protocol.handle(Closed())",
    ], "TCPServer.protocol_send(Closed()) changed: check DirectSendTCPServer.protocol_send"
    close = inspect.getsource(TCPServer._initiate_server_close).strip().split("\n")[1:]
    assert [line.strip() for line in close] == [
        "await self.protocol.handle(Closed())",
        "await self.stream.aclose()",
    ], "TCPServer._initiate_server_close changed: check DirectSendTCPServer's"
    config = Config()
    assert isinstance(config.max_app_queue_size, int)
    assert isinstance(config.keep_alive_max_requests, int)
    assert isinstance(config.h11_max_incomplete_size, int)
    assert isinstance(config.root_path, str)
    assert config.accesslog is None  # the fast path is on only while no access log is written
    assert [name for name, _ in config.response_headers("h11")] == [b"date", b"server"]


async def test_hypercorn_hands_a_request_the_receive_of_a_trio_memory_channel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The dispatcher's read_body takes queued body messages with the channel's receive_nowait,
    # without a scheduler pass; on another kind of receive it would await every message.
    # (Requests on smgd's fast path get its inbox's, tests/test_fast_path.py.)
    monkeypatch.setattr(worker_loop.DirectSendTCPServer, "_fast_path", lambda server: None)
    seen: list[Any] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        seen.append(getattr(receive, "__self__", None))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(worker_loop.serve, app, config)
        port = int(binds[0].rsplit(":", 1)[1])
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            with trio.fail_after(5):
                assert (await stream.receive_some(1024)).startswith(b"HTTP/1.1 204")
        nursery.cancel_scope.cancel()
    [channel] = seen
    assert isinstance(channel, trio.MemoryReceiveChannel)
