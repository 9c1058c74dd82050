"""SGLang engine client against the mock engine over real ipc sockets (one trio loop)."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest
import trio
import trio.testing
import zmq

from smgd.engines.state import EngineState
from smgd.engines.stream import RequestStream
from smgd.engines.validation import _check_vocabulary
from smgd.errors import EngineDead, EngineNotReady, EngineTimeout, InvalidRequest, WireError
from smgd.wire.common import Finish, FinishReason
from smgd.wire.sglang.decode import decode_request
from smgd.wire.sglang.engine_side import encode_batch_output
from smgd.wire.sglang.structs import TokenizedGenerateReqInput
from smgd.zmq_trio import TrioSocket

from .engine_harness import (
    Pair,
    VocabularyScans,
    collect,
    engine_config,
    expected_echo,
    request,
    send_oversized,
    sglang_pair,
)
from .trio_helpers import TaskSteps


@asynccontextmanager
async def losing_pair(
    *, silence_s: float, request_s: float = 0.0, health_interval_s: float = 30.0
) -> AsyncIterator[Pair]:
    """An engine pair (10 ms steps) whose mock loses every request sent from now on, while it
    answers health probes."""
    async with sglang_pair(
        step_s=0.01,
        silence_s=silence_s,
        request_s=request_s,
        health_interval_s=health_interval_s,
    ) as pair:
        assert pair.mock is not None
        pair.mock.inject("lose")
        yield pair


async def test_stream_tokens_usage_and_length_finish() -> None:
    async with sglang_pair() as pair:
        ids, last = await collect(pair.client, request(uuid.uuid4().hex, [10, 11, 12], 7))
        assert ids == expected_echo([10, 11, 12], 7)
        assert last.finish is not None and last.finish.reason is FinishReason.LENGTH
        assert last.completion_tokens == 7
        assert last.prompt_tokens == 3


async def test_stop_token_ids_end_with_stop_and_matched_id() -> None:
    async with sglang_pair() as pair:
        req = request(uuid.uuid4().hex, [10, 11, 12, 13], 50, stop_token_ids=(12,))
        ids, last = await collect(pair.client, req)
        assert ids == [10, 11, 12]
        assert last.finish is not None
        assert (last.finish.reason, last.finish.matched_token) == (FinishReason.STOP, 12)


async def test_512_concurrent_streams_lose_and_duplicate_nothing() -> None:
    results: dict[str, list[int]] = {}
    finishes: dict[str, FinishReason] = {}
    async with sglang_pair(step_s=0.001, max_batch=512) as pair:

        async def one(i: int) -> None:
            prompt = [100 + (i % 50), 200 + (i % 7), 300 + i % 300]
            ids, last = await collect(pair.client, request(f"{i:032x}", prompt, 20 + i % 13))
            results[f"{i:032x}"] = ids
            assert last.finish is not None
            finishes[f"{i:032x}"] = last.finish.reason

        async with trio.open_nursery() as nursery:
            for i in range(512):
                nursery.start_soon(one, i)
    assert len(results) == 512
    for i in range(512):
        prompt = [100 + (i % 50), 200 + (i % 7), 300 + i % 300]
        assert results[f"{i:032x}"] == expected_echo(prompt, 20 + i % 13)
        assert finishes[f"{i:032x}"] is FinishReason.LENGTH


async def test_leaving_a_stream_early_aborts_it_on_the_engine() -> None:
    async with sglang_pair(step_s=0.005) as pair:
        assert pair.mock is not None
        rid = uuid.uuid4().hex
        async with pair.client.open_stream(request(rid, [5, 6], 10_00)) as stream:
            await stream.receive()
        assert pair.client.in_flight == 0
        with trio.fail_after(5):
            # Polling the mock's scheduler state: it has no event to wait on.
            while rid in pair.mock.sched.running or pair.mock.sched.waiting:  # noqa: ASYNC110
                await trio.sleep(0.005)
        assert pair.mock.sched.idle


async def test_validation_rejects_before_sending() -> None:
    async with sglang_pair() as pair:
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            async with pair.client.open_stream(request("a" * 32, [5, 99999], 4)):
                pass
        with pytest.raises(InvalidRequest, match="maximum context length") as info:
            async with pair.client.open_stream(request("b" * 32, [5] * 10, 4090)):
                pass
        assert info.value.param == "max_tokens"
        with pytest.raises(InvalidRequest, match="empty"):
            async with pair.client.open_stream(request("c" * 32, [], 4)):
                pass


async def test_a_prompt_checked_when_planned_is_not_scanned_again_on_the_same_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scans = VocabularyScans(monkeypatch)
    async with sglang_pair() as pair:
        client = pair.client
        req = request("a" * 32, [5, 6, 7], 4)
        checked = client.validate(req)  # when the request is planned
        assert checked is client.info and scans.lengths == [3]
        ids: list[int] = []
        async with client.open_stream(req, checked=checked) as stream:
            async for delta in stream:
                ids.extend(delta.token_ids)
        assert ids == expected_echo([5, 6, 7], 4)
        assert scans.lengths == [3]  # the same engine info: the ids were not scanned at submit
        # Checked against an info the engine no longer runs with (it restarted since), or
        # never checked: the submit scans, and refuses an id outside the vocabulary.
        stale = msgspec.structs.replace(checked)
        bad = request("b" * 32, [5, 99999], 4)
        for vouched in (stale, None):
            with pytest.raises(InvalidRequest, match="outside the vocabulary"):
                async with client.open_stream(bad, checked=vouched):
                    pass
        assert scans.lengths == [3, 2, 2]


async def test_not_ready_before_the_scheduler_attaches(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    async with sglang_pair(with_mock=False, ready_s=5.0) as pair:
        assert pair.client.state is EngineState.STARTING
        with pytest.raises(EngineNotReady):
            async with pair.client.open_stream(request("d" * 32, [5], 4)):
                pass


async def test_a_garbled_frame_fails_the_streams_and_a_streak_kills_the_engine() -> None:
    dead = pytest.RaisesExc(EngineDead, match="undecodable frames in a row")
    with pytest.RaisesGroup(dead, flatten_subgroups=True):
        async with sglang_pair(step_s=0.002) as pair:
            assert pair.mock is not None
            async with pair.client.open_stream(request("e" * 32, [5, 6], 100_0)) as stream:
                await stream.receive()
                pair.mock.inject("garble")
                # The first garbled frame: its tokens are lost, so the stream fails.
                with pytest.raises(WireError, match="could not decode"):
                    while True:
                        await stream.receive()
            await trio.sleep_forever()  # until the streak kills the engine


async def test_a_frame_over_the_limit_fails_the_streams_in_flight_and_the_engine_serves_on() -> (
    None
):
    """A 2 MiB frame on the output socket, over ``max_frame_mb = 1``: libzmq drops it unread
    with its connection, and the streams in flight fail at once with an error naming the
    limit (they would have gone on past the lost message, or waited for the silence
    watchdog); the engine serves the next request."""
    async with sglang_pair(step_s=0.005, max_frame_mb=1) as pair:
        async with pair.client.open_stream(request("g" * 32, [5, 6], 4000)) as stream:
            await stream.receive()
            endpoint = pair.client.output_endpoint
            await trio.to_thread.run_sync(send_oversized, endpoint, 2 << 20)
            with trio.fail_after(5), pytest.raises(WireError, match=r"max_frame_mb \(1 MiB\)"):
                while True:
                    await stream.receive()
        assert pair.client.state is EngineState.READY
        assert pair.client.statistics().decode_errors == 1
        ids, _ = await collect(pair.client, request("h" * 32, [5, 6], 8))
        assert ids == expected_echo([5, 6], 8)


async def test_silence_with_requests_in_flight_kills_engine(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    """Silent, and no answer to the health probe the watchdog then sends: wedged. Detected
    after silence_s (checked every quarter of it), plus the probe's health_timeout_s."""
    with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
        async with sglang_pair(step_s=0.01, silence_s=30.0, health_timeout_s=5.0) as pair:
            assert pair.mock is not None
            async with pair.client.open_stream(request("f" * 32, [5, 6], 4000)) as stream:
                await stream.receive()
                pair.mock.inject("silent")
                start = trio.current_time()
                with pytest.raises(EngineDead, match="no output"):
                    while True:
                        await stream.receive()
                assert 30.0 + 5.0 <= trio.current_time() - start <= 30.0 * 1.25 + 5.0 + 1
            await trio.sleep_forever()


async def test_a_request_lost_by_an_engine_that_answers_its_probe_fails_alone(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    """No output at all for silence_s, but the engine answers the health probe the watchdog
    then sends: it is alive and lost the request. That request fails alone (504) with an
    abort; the engine is not declared dead (a relaunch would cost every other client its
    start-up), and a request sent meanwhile is not judged before its own silence_s."""
    async with losing_pair(silence_s=30.0, health_interval_s=0.0) as pair:
        client = pair.client
        young_alive_after_lost: list[bool] = []

        async def later() -> None:
            await trio.sleep(29.0)
            async with client.open_stream(request("b" * 32, [5, 6], 50)) as young:
                with trio.move_on_after(10.0):
                    await young.receive()
                young_alive_after_lost.append(not young.finished)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(later)
            async with client.open_stream(request("a" * 32, [5, 6], 50)) as lost:
                sent = trio.current_time()
                with pytest.raises(EngineTimeout, match=r"answers but sent no output") as caught:
                    while True:
                        await lost.receive()
                assert caught.value.status == 504 and caught.value.code == "request_timeout"
                assert 30.0 <= trio.current_time() - sent <= 30.0 * 1.25 + 1
        assert young_alive_after_lost == [True], "judged before its own silence_s"
        assert client.state is EngineState.READY and client.in_flight == 0
        assert pair.mock is not None
        pair.mock.inject("ok")
        ids, _ = await collect(client, request("c" * 32, [9, 10], 4))
        assert ids == expected_echo([9, 10], 4)


@pytest.mark.slow
async def test_kill_9_of_launched_engine_fails_all_streams_within_2s() -> None:
    errors: list[BaseException] = []
    with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
        async with sglang_pair(launch_mock=True, step_s=0.005) as pair:
            killed_at = 0.0
            async with trio.open_nursery() as nursery:

                async def one(i: int) -> None:
                    req = request(f"{i:032x}", [7, 8], 4000)
                    try:
                        async with pair.client.open_stream(req) as stream:
                            async for _ in stream:
                                pass
                    except EngineDead as exc:
                        errors.append(exc)

                for i in range(64):
                    nursery.start_soon(one, i)
                await trio.sleep(0.3)
                assert pair.client.child is not None
                killed_at = trio.current_time()
                os.kill(pair.client.child.pid, signal.SIGKILL)
            assert trio.current_time() - killed_at < 2.0
            assert len(errors) == 64
            reasons = {str(e) for e in errors}
            assert len(reasons) == 1, "every stream gets the same engine error"
            assert "exited with code -9" in reasons.pop()  # not the disconnect before it
            await trio.sleep_forever()


async def test_a_stale_socket_probe_is_not_mistaken_for_the_scheduler_leaving() -> None:
    from smgd.errors import TransportError
    from smgd.ipc import clear_stale_socket

    async with sglang_pair() as pair:
        with pytest.raises(TransportError, match="live process"):
            clear_stale_socket(pair.ipc_dir / "in.sock")
        await trio.sleep(0.1)
        assert pair.client.state is EngineState.READY
        ids, _ = await collect(pair.client, request(uuid.uuid4().hex, [9, 10], 3))
        assert ids == [9, 10, 9]


async def test_a_stale_socket_probe_of_the_output_socket_fails_no_stream() -> None:
    """A probe connects to the output socket and leaves without a ZMTP handshake: no frame was
    lost there, so the stream in flight goes on (the output watch took any connection that
    ended for one that lost a frame)."""
    from smgd.errors import TransportError
    from smgd.ipc import clear_stale_socket

    async with sglang_pair(step_s=0.005) as pair:
        req = request(uuid.uuid4().hex, [9, 10], 200)
        async with pair.client.open_stream(req) as stream:
            ids = list((await stream.receive()).token_ids)
            with pytest.raises(TransportError, match="live process"):
                clear_stale_socket(pair.ipc_dir / "out.sock")
            async for delta in stream:
                ids.extend(delta.token_ids)
        assert ids == expected_echo([9, 10], 200)
        assert pair.client.statistics().decode_errors == 0


async def test_idle_probe_keeps_a_healthy_engine_ready(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    async with sglang_pair(step_s=0.01, health_interval_s=10.0, health_timeout_s=5.0) as pair:
        assert pair.mock is not None
        steps_before = pair.mock.sched.steps
        await trio.sleep(35)  # three probes
        assert pair.client.state is EngineState.READY
        assert pair.mock.sched.steps - steps_before >= 3  # each probe ran one engine step


async def test_idle_probe_detects_a_hung_engine(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
        async with sglang_pair(step_s=0.01, health_interval_s=10.0, health_timeout_s=5.0) as pair:
            assert pair.mock is not None
            pair.mock.inject("hang")
            start = trio.current_time()
            with trio.fail_after(60):
                await pair.client._dead.wait()
            assert 15.0 <= trio.current_time() - start <= 15.5
            assert "health check" in (pair.client.last_error or "")
            await trio.sleep_forever()


@pytest.mark.slow
def test_a_launched_mock_engine_exits_when_its_daemon_is_killed(tmp_path: object) -> None:
    import subprocess
    import sys
    import time

    from .engine_harness import short_ipc_dir

    ipc = short_ipc_dir()
    # A parent that launches the mock through smgd's launcher, then gets SIGKILLed.
    code = (
        "import trio, sys\n"
        "from smgd import launch\n"
        "async def main():\n"
        "    async with trio.open_nursery() as n:\n"
        f"        argv = launch.mock_argv('sglang', 'ipc://{ipc}/i', 'ipc://{ipc}/o', [])\n"
        "        child = await launch.spawn(n, 'm', argv)\n"
        "        await child.ready_event.wait()  # it is up and idle: nothing would stop it\n"
        "        print(child.pid, flush=True)\n"
        "        await trio.sleep_forever()\n"
        "trio.run(main)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    parent.stdout.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(child_pid, signal.SIGKILL)
    raise AssertionError("the launched mock engine outlived its killed parent")


async def test_a_burst_of_submits_goes_to_the_engine_in_one_sender_pass() -> None:
    # 64 requests submitted in the same scheduler pass: the sender must not need a pass per
    # request (each pass waits for every other runnable task, which sets TTFT in a burst).
    burst = 64
    async with sglang_pair(step_s=0.01, max_batch=burst) as pair:
        steps = TaskSteps("._sender_task")
        first_tokens = 0
        all_started = trio.Event()

        async def one(i: int) -> None:
            nonlocal first_tokens
            async with pair.client.open_stream(request(f"b{i:031x}", [5, 6, 7], 2)) as rs:
                async for _ in rs:
                    first_tokens += 1
                    if first_tokens == burst:
                        all_started.set()
                    break

        trio.lowlevel.add_instrument(steps)
        try:
            async with trio.open_nursery() as nursery:
                for i in range(burst):
                    nursery.start_soon(one, i)
                with trio.fail_after(10):
                    await all_started.wait()
        finally:
            trio.lowlevel.remove_instrument(steps)
    # One pass for the burst, one or two more for the aborts of the streams left early.
    assert 1 <= steps.steps <= 4, steps.steps


@pytest.mark.parametrize(
    ("ids", "culprit"),
    [([0, 5, 999], None), ([], None), ([5, -1, 1000], -1), ([5, 1000, -1], 1000), ([-3], -3)],
)
def test_the_vocabulary_check_names_the_first_id_outside_it(
    ids: list[int], culprit: int | None
) -> None:
    if culprit is None:
        _check_vocabulary(ids, 1000, "prompt")
        return
    with pytest.raises(InvalidRequest, match=rf"token id {culprit} is outside") as info:
        _check_vocabulary(ids, 1000, "prompt")
    assert info.value.param == "prompt"


async def test_a_scheduler_that_attaches_but_never_answers_fails_within_ready_s(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    """``ready_s`` bounds the whole start, the readiness health check included: it waited
    its own 60 s whatever ``ready_s`` said."""
    with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
        async with sglang_pair(with_mock=False, ready_s=5.0) as pair:
            ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
            mute = ctx.socket(zmq.PULL)  # attaches to the request socket, never answers
            mute.setsockopt(zmq.LINGER, 0)
            mute.connect(f"ipc://{pair.ipc_dir}/in.sock")
            try:
                start = trio.current_time()
                with trio.fail_after(120):
                    await pair.client._dead.wait()
                assert trio.current_time() - start <= 5.5
                assert "health check" in (pair.client.last_error or "")
            finally:
                mute.close()
                ctx.term()
            await trio.sleep_forever()


class _Lingering:
    """A launched engine's process that lives on after its sockets closed (no exit code)."""

    def __init__(self) -> None:
        self.waited = trio.Event()

    async def exit_code_within(self, seconds: float) -> int | None:
        self.waited.set()
        await trio.sleep(seconds)
        return None

    async def stop(self) -> None:
        await trio.lowlevel.checkpoint()


async def test_an_engine_whose_peer_left_takes_no_request_while_its_exit_is_awaited(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    dead = pytest.RaisesExc(EngineDead, match="disconnected from the request socket")
    with pytest.RaisesGroup(dead, flatten_subgroups=True):
        async with sglang_pair(with_mock=False) as pair:
            ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
            pull, push = TrioSocket(ctx.socket(zmq.PULL)), TrioSocket(ctx.socket(zmq.PUSH))
            try:
                pull.socket.connect(f"ipc://{pair.ipc_dir}/in.sock")
                push.socket.connect(f"ipc://{pair.ipc_dir}/out.sock")
                check = decode_request((await pull.recv_multipart(copy=True))[0])
                assert isinstance(check, TokenizedGenerateReqInput) and check.rid is not None
                length = Finish(reason=FinishReason.LENGTH)
                await push.send_multipart(
                    [encode_batch_output([(check.rid, [1], length, 1, 1, 0)])]
                )
                with trio.fail_after(10):
                    await pair.client.wait_ready()
                lingering = _Lingering()
                pair.client.child = lingering  # type: ignore[assignment]
            finally:
                pull.close()
                push.close()
                ctx.term()
            with trio.fail_after(10):
                await lingering.waited.wait()
            assert not pair.client.ready  # the router sends it nothing meanwhile
            await trio.sleep_forever()


# ---------------------------------------------------------------- timeouts.request_s


async def _fails_with_timeout(stream: RequestStream) -> float:
    """Read ``stream`` to its EngineTimeout; the trio time it came."""
    with pytest.raises(EngineTimeout, match=r"did not finish the request within") as caught:
        while True:
            await stream.receive()
    assert caught.value.status == 504 and caught.value.code == "request_timeout"
    return trio.current_time()


async def test_a_request_the_engine_loses_fails_at_request_s_and_is_aborted(
    socket_autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    aborted: list[str] = []
    async with sglang_pair(step_s=0.01, request_s=5.0) as pair:
        assert pair.mock is not None
        client = pair.client
        encode_abort = client._encode_abort

        def recorded_abort(rid: str) -> list[bytes]:
            aborted.append(rid)
            return encode_abort(rid)

        monkeypatch.setattr(client, "_encode_abort", recorded_abort)
        async with client.open_stream(request("a" * 32, [5, 6], 30)) as served:
            await served.receive()
            pair.mock.inject("lose")
            async with client.open_stream(request("b" * 32, [7, 8], 50)) as lost:
                sent = trio.current_time()
                await trio.sleep(0.05)  # the mock has dropped it
                pair.mock.inject("ok")
                # The engine answers the other request all along: no silence, no death.
                tokens = 1
                async for delta in served:
                    tokens += len(delta.token_ids)
                assert tokens == 30 and served.finished
                failed_at = await _fails_with_timeout(lost)
        assert 5.0 <= failed_at - sent <= 5.0 + 0.1
        assert aborted == ["b" * 32]
        assert client.in_flight == 0 and client.state is EngineState.READY
        ids, _ = await collect(client, request("c" * 32, [9, 10], 4))
        assert ids == expected_echo([9, 10], 4)


async def test_requests_expire_in_the_order_they_were_sent_each_at_its_own_deadline(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    async with losing_pair(request_s=5.0, silence_s=600.0) as pair:
        ended: dict[str, float] = {}
        sent: dict[str, float] = {}

        async def lose(rid: str) -> None:
            async with pair.client.open_stream(request(rid, [5, 6], 50)) as stream:
                sent[rid] = trio.current_time()
                ended[rid] = await _fails_with_timeout(stream)

        async with trio.open_nursery() as nursery:
            for rid, delay in (("1" * 32, 0.0), ("2" * 32, 2.0), ("3" * 32, 2.0)):
                await trio.sleep(delay)
                nursery.start_soon(lose, rid)
        for rid, at in sent.items():
            assert 5.0 <= ended[rid] - at <= 5.0 + 0.1, rid
        assert ended["1" * 32] < ended["2" * 32] < ended["3" * 32]


async def test_without_request_s_a_lost_request_stays_in_flight(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    async with (
        losing_pair(silence_s=86400.0, health_interval_s=0.0) as pair,
        pair.client.open_stream(request("d" * 32, [5, 6], 50)) as stream,
    ):
        with trio.move_on_after(3600):
            await stream.receive()
            pytest.fail("a lost request had output")
        assert pair.client.in_flight == 1 and not stream.finished


async def test_a_reload_that_sets_request_s_ends_requests_already_past_it_at_once(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    async with (
        losing_pair(silence_s=86400.0) as pair,
        pair.client.open_stream(request("e" * 32, [5, 6], 50)) as old,
    ):
        await trio.sleep(100)
        pair.client.reconfigure(engine_config(request_s=30.0, silence_s=86400.0))
        async with pair.client.open_stream(request("f" * 32, [5, 6], 50)) as young:
            reloaded = trio.current_time()
            assert await _fails_with_timeout(old) - reloaded < 0.1
            assert 30.0 <= await _fails_with_timeout(young) - reloaded <= 30.1


async def test_output_and_prompt_top_logprobs_each_come_back_as_asked() -> None:
    """The wire has one top-k count for both sides (the larger); each side's top lists are
    cut back to its own count, whichever is larger."""
    async with sglang_pair() as pair:
        for out_k, prompt_k in ((1, 3), (4, 2), (2, 2)):
            req = request(
                uuid.uuid4().hex, [10, 11, 12, 13], 3, logprobs=out_k, prompt_logprobs=prompt_k
            )
            output: list[int] = []
            prompt: list[int] = []
            async with pair.client.open_stream(req) as stream:
                async for delta in stream:
                    output += [len(e.top or ()) for e in delta.logprobs or ()]
                    prompt += [len(e.top or ()) for e in delta.prompt_logprobs or ()]
            assert output == [out_k] * 3, (out_k, prompt_k)
            assert prompt and set(prompt) == {prompt_k}, (out_k, prompt_k)
        assert not pair.client._tops  # each finished request forgotten
        # One left early (its client gone) is forgotten at once, not when the engine's
        # answer to its abort comes (a request failed alone may get none).
        left = request(uuid.uuid4().hex, [10, 11], 500, logprobs=1, prompt_logprobs=3)
        async with pair.client.open_stream(left) as stream:
            await stream.receive()
            assert left.rid in pair.client._tops
        assert left.rid not in pair.client._tops
