"""A launched engine whose sockets a process smgd did not launch is connected to (an engine
left running by an earlier smgd): never a silent wait or a split of the requests, always an
error that says which process it is. The vLLM/TokenSpeed handshake, and SGLang's request
socket."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from smgd.engines.handshake import HandshakeTracker
from smgd.engines.sglang import SglangEngineClient
from smgd.engines.state import EngineState
from smgd.errors import EngineDead
from smgd.launch import mock_argv
from smgd.wire.common import EngineInfo

from .engine_harness import engine_config, short_ipc_dir
from .test_engine_vllm import CONTEXT, make_client, start_rank

R0, R1 = b"\x00\x00", b"\x01\x00"
INFO = EngineInfo(max_model_len=512)


def test_a_rank_ready_without_registration_becomes_overdue_after_the_grace() -> None:
    tracker = HandshakeTracker()
    assert tracker.next_deadline(10.0) == float("inf")
    tracker.on_hello(R0)
    tracker.on_hello(R1)
    assert tracker.on_ready(R0, now=100.0)
    assert tracker.next_deadline(10.0) == 110.0
    assert tracker.overdue(109.9, 10.0) == []
    assert [r.index for r in tracker.overdue(110.0, 10.0)] == [0]
    tracker.on_registration(R0, INFO)
    assert tracker.overdue(200.0, 10.0) == []  # registered: nothing is waiting
    assert tracker.next_deadline(10.0) == float("inf")


def test_a_registration_before_ready_is_never_overdue() -> None:
    tracker = HandshakeTracker()
    tracker.on_hello(R0)
    tracker.on_registration(R0, INFO)  # the two may come in either order
    tracker.on_ready(R0, now=5.0)
    assert tracker.overdue(1000.0, 10.0) == []
    assert tracker.registered()[0].index == 0


def test_a_repeated_hello_is_counted_and_starts_the_rank_over() -> None:
    tracker = HandshakeTracker()
    tracker.on_hello(R0)
    tracker.on_ready(R0, now=1.0)
    tracker.on_hello(R0)
    rank = tracker.ranks[R0]
    assert (rank.hellos, rank.ready, rank.ready_at) == (2, False, None)
    tracker.on_registration(R0, INFO)
    tracker.on_ready(R0, now=2.0)
    assert tracker.on_hello(R0).restarted  # registered, then HELLO: a restarted engine
    assert tracker.ranks[R0].hellos == 1


def test_describe_says_where_each_rank_stands() -> None:
    tracker = HandshakeTracker()
    assert tracker.describe() == "no engine rank said HELLO"
    tracker.on_hello(R0)
    tracker.on_hello(R1)
    tracker.on_ready(R1, now=0.0)
    assert tracker.describe() == (
        "rank 0: INIT sent, no READY and no registration yet; rank 1: READY, no registration"
    )
    tracker.on_registration(R0, INFO)
    tracker.on_registration(R1, INFO)
    tracker.on_ready(R0, now=0.0)
    assert tracker.describe() == "rank 0: registered; rank 1: registered"


def _after(flag: Path, argv: list[str]) -> list[str]:
    """``argv``, started only once ``flag`` exists."""
    code = (
        "import os, sys, time\n"
        f"while not os.path.exists({str(flag)!r}):\n"
        "    time.sleep(0.01)\n"
        "os.execv(sys.argv[1], sys.argv[1:])\n"
    )
    return [sys.executable, "-c", code, *argv]


async def test_a_launched_engine_whose_identity_a_leftover_engine_holds_fails_fast() -> None:
    # An engine core left running by an earlier smgd reconnects to the new input socket with
    # rank 0's identity; ZMQ then refuses the newly launched rank 0's connection, so its
    # registration never arrives. Before: `starting` with no last_error until ready_s (300 s).
    ipc_dir = short_ipc_dir()
    async with trio.open_nursery() as outer:
        earlier = make_client(ipc_dir)
        scope = trio.CancelScope()
        earlier_gone = trio.Event()

        async def run_earlier(
            *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED
        ) -> None:
            with scope:
                await earlier.run(task_status=task_status)
            earlier_gone.set()

        await outer.start(run_earlier)
        leftover = start_rank(outer, earlier.handshake_endpoint, 0)  # lives in this process
        with trio.fail_after(10):
            await earlier.wait_ready()
        scope.cancel()  # the earlier smgd is gone; its engine is not
        await earlier_gone.wait()

        # The launched engine dials in only once the leftover is back on the input socket
        # (ZMQ reconnects every ~100 ms; on a busy machine the launched engine can win).
        go = ipc_dir / "go"
        argv = _after(
            go,
            mock_argv(
                "vllm",
                f"ipc://{ipc_dir}/in.sock",
                f"ipc://{ipc_dir}/out.sock",
                ["--context-len", str(CONTEXT), "--handshake", "{handshake}"],
            ),
        )
        client = make_client(ipc_dir, launch_argv=argv)
        client.registration_grace_s = 1.0  # 10 s in production; the mechanism is the same

        async def leftover_is_back() -> None:
            while os.getpid() not in client._peer_pids.values():  # noqa: ASYNC110
                await trio.sleep(0.01)  # a socket monitor's state: nothing to wait on
            go.touch()

        outer.start_soon(leftover_is_back)
        started = trio.current_time()
        with trio.fail_after(30):
            try:
                await client.run()
            except* EngineDead:
                pass
        assert trio.current_time() - started < 15
        assert client.state is EngineState.DEAD
        assert client.last_error is not None
        assert client.last_error.startswith(
            f"engine rank 0 said READY but its registration did not reach ipc://{ipc_dir}/in.sock "
            "within 1 s: the socket refused its connection, because another process holds "
            "rank 0's identity there (an engine left running by an earlier smgd, or one "
            "configured with the same addresses); connected to it but not launched by smgd: "
            f"pid {os.getpid()} ("
        )
        assert client.last_error.endswith("; stop it")
        assert leftover.wire.handshakes == 1
        outer.cancel_scope.cancel()


async def test_a_handshake_timeout_says_where_the_ranks_stand() -> None:
    ipc_dir = short_ipc_dir()
    client = make_client(ipc_dir)
    client.config.timeouts.ready_s = 0.5
    with trio.fail_after(10):
        try:
            await client.run()
        except* EngineDead:
            pass
    assert client.last_error == (
        "the engine did not complete the handshake within 0.5 s (no engine rank said HELLO)"
    )


def _foreign_scheduler(ipc_dir: Path) -> subprocess.Popen[bytes]:
    """A mock SGLang scheduler smgd did not launch, dialling the engine's socket paths."""
    return subprocess.Popen(
        [sys.executable, "-m", "smgd", "mock-engine", "--wire", "sglang",
         "--input", f"ipc://{ipc_dir}/in.sock", "--output", f"ipc://{ipc_dir}/out.sock"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip


async def test_a_foreign_scheduler_on_a_launched_engines_request_socket_is_an_error() -> None:
    # Before: both schedulers attached and the PUSH socket split the requests between them.
    ipc_dir = short_ipc_dir()
    foreign = _foreign_scheduler(ipc_dir)
    try:
        argv = mock_argv("sglang", f"ipc://{ipc_dir}/in.sock", f"ipc://{ipc_dir}/out.sock", [])
        client = SglangEngineClient(
            engine_config(),
            fallback_info=EngineInfo(max_model_len=4096, vocab_size=1024),
            input_path=str(ipc_dir / "in.sock"),
            output_path=str(ipc_dir / "out.sock"),
            launch_argv=argv,
        )
        with trio.fail_after(30):
            try:
                await client.run()
            except* EngineDead:
                pass
        assert client.state is EngineState.DEAD
        assert client.last_error is not None
        assert client.last_error.startswith(f"a process smgd did not launch (pid {foreign.pid}: ")
        assert client.last_error.endswith(
            f"is connected to the request socket ipc://{ipc_dir}/in.sock and would take a share "
            "of the requests (an engine left running by an earlier smgd?); stop it"
        )
        assert foreign.poll() is None, (
            "smgd reports a process it did not launch; it does not kill it"
        )
    finally:
        foreign.kill()
        foreign.wait()


async def test_an_external_engine_may_be_any_process() -> None:
    # Without [engines.launch], whatever attaches is the engine.
    ipc_dir = short_ipc_dir()
    scheduler = _foreign_scheduler(ipc_dir)
    try:
        client = SglangEngineClient(
            engine_config(),
            fallback_info=EngineInfo(max_model_len=4096, vocab_size=1024),
            input_path=str(ipc_dir / "in.sock"),
            output_path=str(ipc_dir / "out.sock"),
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            with trio.fail_after(30):
                await client.wait_ready()
            nursery.cancel_scope.cancel()
    finally:
        scheduler.kill()
        scheduler.wait()
