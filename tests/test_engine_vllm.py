"""vLLM engine client against in-process mock engine cores over real ipc sockets (one trio loop)."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
import zmq

from smgd.config import EngineConfig, LimitsConfig, TimeoutsConfig, WireFamily
from smgd.engines.state import EngineState
from smgd.engines.vllm import VllmEngineClient, vllm_argv
from smgd.errors import EngineDead, EngineTimeout, InvalidRequest, WireError
from smgd.launch import mock_argv
from smgd.mock.engine import MockEngine
from smgd.mock.scheduler import MockScheduler
from smgd.mock.vllm import VllmMockWire
from smgd.wire.common import EngineInfo, FinishReason
from smgd.wire.vllm.structs import ReadyResponse

from .engine_harness import (
    VOCAB,
    collect,
    expected_echo,
    request,
    send_oversized,
    short_ipc_dir,
)

CONTEXT = 2048  # differs from the fallback's 4096, so readiness provably used the ready response
EOS = 2


@dataclass
class Rank:
    wire: VllmMockWire
    mock: MockEngine
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


@dataclass
class Setup:
    client: VllmEngineClient
    ranks: list[Rank]
    ipc_dir: Path


def make_client(
    ipc_dir: Path,
    *,
    ranks: int = 1,
    launch_argv: list[str] | None = None,
    timeouts: TimeoutsConfig | None = None,
    limits: LimitsConfig | None = None,
) -> VllmEngineClient:
    config = EngineConfig(
        name="v0",
        wire=WireFamily.VLLM,
        models=["m"],
        model_dir=".",
        timeouts=timeouts or TimeoutsConfig(),
        limits=limits or LimitsConfig(),
    )
    return VllmEngineClient(
        config,
        fallback_info=EngineInfo(max_model_len=4096, vocab_size=VOCAB),
        input_path=str(ipc_dir / "in.sock"),
        output_path=str(ipc_dir / "out.sock"),
        handshake=f"ipc://{ipc_dir}/hs.sock",
        launch_argv=launch_argv,
        ranks=ranks,
        eos_token_ids=(EOS,),
    )


def start_rank(nursery: trio.Nursery, handshake: str, index: int, *, step_s: float = 0.002) -> Rank:
    wire = VllmMockWire(handshake, engine_index=index, context_len=CONTEXT)
    rank = Rank(wire, MockEngine(wire, MockScheduler(max_batch=256), step_s=step_s))

    async def run() -> None:
        with rank.scope:
            await rank.mock.run()

    nursery.start_soon(run)
    return rank


@asynccontextmanager
async def vllm_setup(
    *,
    ranks: int = 1,
    launch_mock: bool = False,
    ipc_dir: Path | None = None,
    step_s: float = 0.002,
    limits: LimitsConfig | None = None,
    **timeouts: float,
) -> AsyncIterator[Setup]:
    ipc_dir = ipc_dir or short_ipc_dir()
    argv = None
    if launch_mock:
        argv = mock_argv(
            "vllm",
            f"ipc://{ipc_dir}/in.sock",
            f"ipc://{ipc_dir}/out.sock",
            ["--step-ms", str(step_s * 1000), "--context-len", str(CONTEXT),
             "--handshake", "{handshake}"],
        )  # fmt: skip
    client = make_client(
        ipc_dir, ranks=ranks, launch_argv=argv, timeouts=TimeoutsConfig(**timeouts), limits=limits
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        mocks = []
        if not launch_mock:
            mocks = [
                start_rank(nursery, client.handshake_endpoint, i, step_s=step_s)
                for i in range(ranks)
            ]
        with trio.fail_after(30):
            await client.wait_ready()
        yield Setup(client, mocks, ipc_dir)
        nursery.cancel_scope.cancel()


async def test_ready_response_sets_info_and_streams_count_tokens() -> None:
    async with vllm_setup() as s:
        info = s.client.info
        assert info is not None
        assert (info.max_model_len, info.max_num_seqs) == (CONTEXT, 256)
        assert info.kv_cache_tokens == CONTEXT * 256
        ids, last = await collect(s.client, request(uuid.uuid4().hex, [10, 11, 12], 7))
        assert ids == expected_echo([10, 11, 12], 7)
        assert last.finish is not None
        assert last.finish.reason is FinishReason.LENGTH
        assert (last.prompt_tokens, last.completion_tokens) == (3, 7)
        assert not s.client._meta, "per-request state is released at the finish"


async def test_eos_stops_only_because_smgd_sends_it() -> None:
    async with vllm_setup() as s:
        wire = s.ranks[0].wire
        rid = uuid.uuid4().hex
        ids, last = await collect(s.client, request(rid, [10, EOS, 12], 20))
        assert ids == [10, EOS]
        assert last.finish is not None
        # The engine's stop_reason is None on EOS; the client names the EOS token it hit.
        assert (last.finish.reason, last.finish.matched_token) == (FinishReason.STOP, EOS)
        assert wire.eos_seen[rid] == EOS, "no EOS ids on the request: the client added its own"
        rid = uuid.uuid4().hex
        ids, last = await collect(s.client, request(rid, [10, EOS, 12], 5, ignore_eos=True))
        assert ids == [10, EOS, 12, 10, EOS]
        assert last.finish is not None
        assert last.finish.reason is FinishReason.LENGTH
        assert wire.eos_seen[rid] is None


async def test_stop_token_id_reports_the_matched_token() -> None:
    async with vllm_setup() as s:
        req = request(uuid.uuid4().hex, [5, 6, 7, 8], 50, stop_token_ids=(7,))
        ids, last = await collect(s.client, req)
        assert ids == [5, 6, 7]
        assert last.finish is not None
        assert (last.finish.reason, last.finish.matched_token) == (FinishReason.STOP, 7)


async def test_logprobs_are_sliced_to_the_requests_top_k() -> None:
    async with vllm_setup() as s:
        ids: list[int] = []
        logprobs = []
        async with s.client.open_stream(request(uuid.uuid4().hex, [5, 6], 3, logprobs=2)) as st:
            async for delta in st:
                ids.extend(delta.token_ids)
                logprobs.extend(delta.logprobs or [])
        assert ids == [5, 6, 5]
        assert [lp.token_id for lp in logprobs] == ids
        assert all(lp.top is not None and len(lp.top) == 2 for lp in logprobs)


async def test_256_concurrent_streams_lose_and_duplicate_nothing() -> None:
    results: dict[str, list[int]] = {}
    async with vllm_setup(step_s=0.001) as s:

        async def one(i: int) -> None:
            prompt = [100 + i % 50, 200 + i % 7, 300 + i]
            ids, last = await collect(s.client, request(f"{i:032x}", prompt, 16 + i % 11))
            assert last.completion_tokens == 16 + i % 11
            results[f"{i:032x}"] = ids

        async with trio.open_nursery() as nursery:
            for i in range(256):
                nursery.start_soon(one, i)
        assert s.client.in_flight == 0
    assert len(results) == 256
    for i in range(256):
        prompt = [100 + i % 50, 200 + i % 7, 300 + i]
        assert results[f"{i:032x}"] == expected_echo(prompt, 16 + i % 11)


async def test_leaving_early_closes_locally_and_the_engine_sees_the_abort() -> None:
    async with vllm_setup(step_s=0.005) as s:
        rank = s.ranks[0]
        rid = uuid.uuid4().hex
        async with s.client.open_stream(request(rid, [5, 6], 1000)) as stream:
            assert (await stream.receive()).token_ids
        assert s.client.in_flight == 0
        assert not s.client._meta
        with trio.fail_after(5):
            while rid in rank.mock.sched.running or rank.mock.sched.waiting:  # noqa: ASYNC110
                await trio.sleep(0.005)
        assert rank.wire.aborts == [rid]
        ids, _ = await collect(s.client, request(uuid.uuid4().hex, [9, 10], 3))
        assert ids == [9, 10, 9]


async def test_what_would_kill_the_engine_is_refused_before_sending() -> None:
    async with vllm_setup() as s:
        cases = [
            (request("a" * 32, [5, VOCAB], 4), "outside the vocabulary"),
            (request("b" * 32, [5] * 10, CONTEXT), "maximum context length"),
            (request("c" * 32, [5], 0), "max_tokens"),
        ]
        for req, match in cases:
            with pytest.raises(InvalidRequest, match=match):
                async with s.client.open_stream(req):
                    pass
        ids, _ = await collect(s.client, request("d" * 32, [5, 6], 2))
        assert ids == [5, 6]
        assert s.ranks[0].wire.received == ["d" * 32]
        assert not s.client._meta


async def test_dead_sentinel_fails_every_stream_with_an_error_of_its_own() -> None:
    errors: list[EngineDead] = []
    with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
        async with vllm_setup(step_s=0.005) as s:
            started = trio.Event()

            async def one(i: int) -> None:
                try:
                    async with s.client.open_stream(request(f"{i:032x}", [7, 8], 2000)) as st:
                        async for _ in st:
                            started.set()
                except EngineDead as exc:
                    errors.append(exc)

            async with trio.open_nursery() as nursery:
                for i in range(16):
                    nursery.start_soon(one, i)
                await started.wait()
                s.ranks[0].wire.request_death()
            await trio.sleep_forever()
    assert len(errors) == 16
    # One object per stream: a shared one would collect every consumer's traceback.
    assert len({id(e) for e in errors}) == 16
    assert {str(e) for e in errors} == {"engine v0 failed: the engine sent ENGINE_CORE_DEAD"}


async def test_a_frame_over_the_limit_fails_the_streams_in_flight_and_the_ranks_serve_on() -> None:
    """As on the SGLang wire: a 2 MiB frame on the output socket shared by the ranks, over
    ``max_frame_mb = 1``, fails the streams in flight naming the limit; the engine stays
    ready and serves the next request."""
    async with vllm_setup(step_s=0.005, limits=LimitsConfig(max_frame_mb=1)) as s:
        async with s.client.open_stream(request(uuid.uuid4().hex, [10, 11], 2000)) as stream:
            await stream.receive()
            await trio.to_thread.run_sync(send_oversized, s.client.output_endpoint, 2 << 20)
            with trio.fail_after(5), pytest.raises(WireError, match=r"max_frame_mb \(1 MiB\)"):
                while True:
                    await stream.receive()
        assert s.client.state is EngineState.READY
        ids, _ = await collect(s.client, request(uuid.uuid4().hex, [10, 11], 7))
        assert ids == expected_echo([10, 11], 7)


async def test_kill_9_of_a_launched_mock_fails_all_streams_fast() -> None:
    errors: list[EngineDead] = []
    with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
        async with vllm_setup(launch_mock=True, step_s=0.005) as s:
            async with trio.open_nursery() as nursery:

                async def one(i: int) -> None:
                    try:
                        async with s.client.open_stream(request(f"{i:032x}", [7, 8], 2000)) as st:
                            async for _ in st:
                                pass
                    except EngineDead as exc:
                        errors.append(exc)

                for i in range(32):
                    nursery.start_soon(one, i)
                await trio.sleep(0.2)
                assert s.client.child is not None
                killed_at = trio.current_time()
                os.kill(s.client.child.pid, signal.SIGKILL)
            assert trio.current_time() - killed_at < 2.0
            await trio.sleep_forever()
    assert len(errors) == 32
    assert len({str(e) for e in errors}) == 1


async def test_two_ranks_least_load_selection() -> None:
    async with vllm_setup(ranks=2, step_s=0.005) as s:
        table = s.client.table
        assert table is not None
        assert [r.index for r in table.ranks] == [0, 1]
        opened = []
        for i in range(10):
            cm = s.client.open_stream(request(f"a{i:031x}", [3, 4], 2000))
            opened.append((cm, await cm.__aenter__()))
        assert sorted(len(r.in_flight) for r in table.ranks) == [5, 5], "ties alternate"
        for cm, stream in opened:  # the client leaves rank 1's requests early
            owner = table.owner(stream.rid)
            if owner is not None and owner.index == 1:
                await cm.__aexit__(None, None, None)
        with trio.fail_after(5):
            while not (s.ranks[1].mock.sched.idle and table.ranks[1].load is not None):  # noqa: ASYNC110
                await trio.sleep(0.01)
            while table.ranks[1].load is None or table.ranks[1].load.running:  # noqa: ASYNC110
                await trio.sleep(0.01)
        picks = [table.pick(f"b{i}").index for i in range(10)]
        # Least load fills the empty rank first (round-robin would split 5/5).
        assert picks[:5] == [1] * 5
        assert picks.count(1) >= 7
        for i in range(10):
            table.release(f"b{i}")
        for cm, stream in opened:
            if table.owner(stream.rid) is not None:
                await cm.__aexit__(None, None, None)
        received = s.ranks[0].wire.received + s.ranks[1].wire.received
        assert len(received) == len(set(received)) == 10


async def test_send_to_a_departed_rank_fails_fast_with_ehostunreach() -> None:
    with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
        async with vllm_setup(ranks=2, step_s=0.005) as s:
            # An extra peer keeps the connection count up, so only the send can notice.
            ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
            extra = ctx.socket(zmq.DEALER)
            extra.setsockopt(zmq.LINGER, 0)
            extra.connect(s.client.input_endpoint)
            try:
                await trio.sleep(0.1)
                async with s.client.open_stream(request("1" * 32, [5, 6], 2000)) as busy:
                    await busy.receive()
                    assert s.client.table is not None
                    owner = s.client.table.owner("1" * 32)
                    assert owner is not None
                    s.ranks[1 - owner.index].scope.cancel()  # the idle rank's process exits
                    await trio.sleep(0.1)
                    assert s.client.state is EngineState.READY
                    with pytest.raises(EngineDead, match="unreachable"):
                        async with s.client.open_stream(request("2" * 32, [5], 4)) as stream:
                            await stream.receive()
            finally:
                extra.close()
            await trio.sleep_forever()


async def test_a_restarted_client_reattaches_without_a_handshake() -> None:
    ipc_dir = short_ipc_dir()
    async with trio.open_nursery() as outer:
        first = make_client(ipc_dir)
        scope = trio.CancelScope()

        async def run_first(
            *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED
        ) -> None:
            with scope:
                await first.run(task_status=task_status)

        await outer.start(run_first)
        rank = start_rank(outer, first.handshake_endpoint, 0, step_s=0.005)
        with trio.fail_after(10):
            await first.wait_ready()
        # A request still running when the client goes: its late outputs must not confuse
        # the next client.
        async with first.open_stream(request(uuid.uuid4().hex, [3, 4], 500)) as stream:
            await stream.receive()
            scope.cancel()
        await trio.sleep(0.05)
        second = make_client(ipc_dir)
        await outer.start(second.run)
        with trio.fail_after(10):
            await second.wait_ready()
        assert rank.wire.handshakes == 1, "the engine kept running and did not handshake again"
        assert second.info is not None
        assert second.info.max_model_len == CONTEXT
        ids, last = await collect(second, request(uuid.uuid4().hex, [6, 7], 4))
        assert ids == [6, 7, 6, 7]
        assert last.finish is not None
        outer.cancel_scope.cancel()


def test_launcher_argv_dials_the_bound_handshake() -> None:
    argv = vllm_argv(
        python="/v/bin/python", launcher="/l.py", model="/m", args=["--dtype", "float32"]
    )
    client = make_client(Path("/tmp/x"), launch_argv=argv)
    client.handshake_endpoint = "ipc:///tmp/x/hs.sock"
    filled = [client._fill(a) for a in argv]
    assert filled == [
        "/v/bin/python", "/l.py", "--handshake-address", "ipc:///tmp/x/hs.sock",
        "--model", "/m", "--dtype", "float32",
    ]  # fmt: skip


def test_mock_answers_utility_calls_and_can_announce_remote() -> None:
    from smgd.mock.scheduler import MockScheduler
    from smgd.mock.vllm import VllmMockWire
    from smgd.wire.vllm.decode import decode_outputs
    from smgd.wire.vllm.encode import encode_utility

    wire = VllmMockWire("tcp://127.0.0.1:1", local=False)
    assert wire.local is False
    sched = MockScheduler(max_batch=1)
    replies = wire.on_request(encode_utility(7, "get_supported_tasks"), sched)
    assert len(replies) == 1
    reply = decode_outputs(replies[0]).utility
    assert reply is not None
    assert (reply.call_id, reply.ok, reply.result) == (7, True, ["generate"])
    other = decode_outputs(wire.on_request(encode_utility(8, "reset"), sched)[0])
    assert other.utility is not None
    assert (other.utility.call_id, other.utility.result) == (8, None)


async def test_a_rank_whose_identity_is_not_an_engine_index_is_refused_by_name() -> None:
    """A HELLO from a 3-byte identity (no engine core's: they are the 2-byte engine index) is
    refused, and the handshake runs out with that said; smgd's rank table, built from the
    index, raised OverflowError on it."""
    ipc_dir = short_ipc_dir()
    client = make_client(ipc_dir, timeouts=TimeoutsConfig(ready_s=2.0))
    wire = VllmMockWire(client.handshake_endpoint, context_len=CONTEXT)
    wire.identity = b"abc"
    with pytest.RaisesGroup(
        pytest.RaisesExc(EngineDead, match="not an engine index"), flatten_subgroups=True
    ):
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            nursery.start_soon(MockEngine(wire, MockScheduler(max_batch=8), step_s=0.002).run)
            with trio.fail_after(10):
                await client.wait_ready()


class _SkewedWire(VllmMockWire):
    """An engine core whose ready response says ``max_model_len`` is ``self.skew``."""

    skew: Any = "4096"  # another vLLM version's type: it does not decode

    def ready_response(self) -> ReadyResponse:
        return msgspec.structs.replace(super().ready_response(), max_model_len=self.skew)


@pytest.mark.parametrize(
    ("skew", "why"), [("4096", "cannot decode ready response"), (0, "0 is no context length")]
)
async def test_a_registration_smgd_cannot_take_is_named_not_blamed_on_an_identity(
    skew: Any, why: str
) -> None:
    """The ready response arrives but does not decode (version skew), or says a context of 0
    (every request would be refused as too long): the start fails naming that (it said another
    process held the rank's identity, which no one did; with 0 the engine was ready)."""
    client = make_client(short_ipc_dir(), timeouts=TimeoutsConfig(ready_s=30.0))
    client.registration_grace_s = 1.0
    wire = _SkewedWire(client.handshake_endpoint, context_len=CONTEXT)
    wire.skew = skew
    dead = pytest.RaisesExc(EngineDead, match=f"registration was refused: .*{why}")
    with pytest.RaisesGroup(dead, flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            nursery.start_soon(MockEngine(wire, MockScheduler(max_batch=8), step_s=0.002).run)
            with trio.fail_after(10):
                await client.wait_ready()
            raise AssertionError(f"ready, with {client.info}")
    assert "identity" not in (client.last_error or "")


# ------------------------------------------------------------------ the health probe


async def test_a_request_lost_by_an_engine_that_answers_its_probe_fails_alone(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    """The engine core loses a request (no output for it for silence_s) and answers the
    utility call the watchdog then sends: that request alone fails (504) with an abort, and
    the engine serves on (without a probe it was declared dead: a relaunch for one lost
    request)."""
    async with vllm_setup(step_s=0.01, silence_s=30.0, health_interval_s=0.0) as s:
        wire, mock = s.ranks[0].wire, s.ranks[0].mock
        mock.inject("lose")
        async with s.client.open_stream(request("a" * 32, [5, 6], 50)) as lost:
            sent = trio.current_time()
            with pytest.raises(EngineTimeout, match="answers but sent no output") as caught:
                while True:
                    await lost.receive()
            assert caught.value.status == 504 and caught.value.code == "request_timeout"
            assert 30.0 <= trio.current_time() - sent <= 30.0 * 1.25 + 1
        assert wire.received == ["a" * 32] and wire.utility_calls == ["is_sleeping"]
        assert s.client.state is EngineState.READY and s.client.in_flight == 0
        assert not s.client._calls, "the probe's call id left the table"
        with trio.fail_after(5):
            while wire.aborts != ["a" * 32]:  # noqa: ASYNC110 - the mock has no event for it
                await trio.sleep(0.01)
        mock.inject("ok")
        ids, _ = await collect(s.client, request("c" * 32, [9, 10], 4))
        assert ids == expected_echo([9, 10], 4)


async def test_a_silent_engine_that_leaves_the_probe_unanswered_is_dead(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    """Silent (it reads, and sends nothing: no token, no answer to the probe): wedged,
    detected after silence_s (checked every quarter of it) plus health_timeout_s."""
    with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
        async with vllm_setup(step_s=0.01, silence_s=30.0, health_timeout_s=5.0) as s:
            async with s.client.open_stream(request("f" * 32, [5, 6], 2000)) as stream:
                await stream.receive()
                s.ranks[0].mock.inject("silent")
                start = trio.current_time()
                with pytest.raises(EngineDead, match="no output"):
                    while True:
                        await stream.receive()
                assert 30.0 + 5.0 <= trio.current_time() - start <= 30.0 * 1.25 + 5.0 + 1
            assert s.ranks[0].wire.utility_calls == ["is_sleeping"]
            assert not s.client._calls
            await trio.sleep_forever()


async def test_one_rank_wedged_beside_a_streaming_one_is_the_engines_silence(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    """Two ranks, each with a request; rank 1 hangs while rank 0 streams on. The engine's
    frames keep coming (rank 0's), so only each rank's own silence shows rank 1's: after
    silence_s its requests' engine gets the probe, rank 1 leaves it unanswered, and the engine
    is dead (its requests hung for ever, and the least-load pick kept sending it more)."""
    with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
        async with vllm_setup(ranks=2, step_s=0.5, silence_s=4.0, health_timeout_s=1.0) as s:
            table = s.client.table
            assert table is not None
            async with (
                s.client.open_stream(request("a" * 32, [5, 6], 2000)) as first,
                s.client.open_stream(request("b" * 32, [5, 6], 2000)) as second,
            ):
                await first.receive()
                await second.receive()
                ranks = {table.owner(rid).index: stream for rid, stream in  # type: ignore[union-attr]
                         (("a" * 32, first), ("b" * 32, second))}  # fmt: skip
                assert set(ranks) == {0, 1}
                s.ranks[1].mock.inject("hang")
                start = trio.current_time()
                with pytest.raises(EngineDead, match="no output"):
                    while True:
                        await ranks[1].receive()
                # A step after the last frame at most, a quarter of silence_s after it at most.
                assert 4.0 + 1.0 - 0.5 <= trio.current_time() - start <= 4.0 * 1.25 + 1.0 + 0.5
            await trio.sleep_forever()


async def test_idle_probe_keeps_a_healthy_engine_ready(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    async with vllm_setup(step_s=0.01, health_interval_s=10.0, health_timeout_s=5.0) as s:
        await trio.sleep(35)  # three probes
        assert s.client.state is EngineState.READY
        assert s.ranks[0].wire.utility_calls == ["is_sleeping"] * 3
        assert not s.client._calls


async def test_idle_probe_detects_a_hung_engine(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
        async with vllm_setup(step_s=0.01, health_interval_s=10.0, health_timeout_s=5.0) as s:
            s.ranks[0].mock.inject("hang")
            start = trio.current_time()
            with trio.fail_after(60):
                await s.client._dead.wait()
            assert 15.0 <= trio.current_time() - start <= 15.5
            assert s.client.last_error == (
                "no answer to a health check (utility call is_sleeping) within 5 s from rank(s) 0"
            )
            assert not s.client._calls
            await trio.sleep_forever()


async def test_every_rank_must_answer_the_probe(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    """Two ranks, one hung: the engine does not answer (a wedged rank would be sent ever more
    requests), and the idle prober declares it dead naming that rank."""
    with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
        async with vllm_setup(ranks=2, health_interval_s=0.0) as s:
            assert await s.client.answers_probe(5.0)
            s.ranks[1].mock.inject("hang")
            start = trio.current_time()
            assert not await s.client.answers_probe(5.0)
            assert 5.0 <= trio.current_time() - start <= 5.1
            assert not s.client._calls
            await s.client.probe_health(5.0)
            assert s.client.state is EngineState.DEAD
            assert (s.client.last_error or "").endswith("within 5 s from rank(s) 1")
            assert s.ranks[0].wire.utility_calls == ["is_sleeping"] * 3
            await trio.sleep_forever()


async def test_a_probe_answered_late_leaves_nothing_and_is_not_taken_for_the_next(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    """A probe unanswered in time leaves no entry in the call table. Its answer, come late
    while the next probe waits for its own, is dropped: the next probe is not answered by it.
    The hung engine's real late answers, once it runs again, are dropped too."""
    from smgd.wire.vllm.engine_side import encode_outputs
    from smgd.wire.vllm.structs import EngineCoreOutputs, UtilityOutput, UtilityResult

    async with vllm_setup(health_interval_s=0.0) as s:
        client, wire, mock = s.client, s.ranks[0].wire, s.ranks[0].mock
        mock.inject("hang")
        outcomes: list[bool] = []

        async def probe() -> None:
            outcomes.append(await client.answers_probe(5.0))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe)
            await trio.testing.wait_all_tasks_blocked()
            (first_id,) = client._calls
        assert outcomes == [False] and not client._calls

        def late_answer() -> list[Any]:
            reply = UtilityOutput(first_id, None, UtilityResult(None, False))
            return list(encode_outputs(EngineCoreOutputs(utility_output=reply)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe)
            await trio.testing.wait_all_tasks_blocked()
            assert first_id not in client._calls and len(client._calls) == 1
            # The first probe's answer arrives as the reader hands it over.
            assert client._decode_frames(late_answer()) == []
        assert outcomes == [False, False] and not client._calls
        mock.inject("ok")  # the mock answers both probes now, late
        with trio.fail_after(5):
            while len(wire.utility_calls) < 2:  # noqa: ASYNC110 - the mock has no event for it
                await trio.sleep(0.01)
        assert await client.answers_probe(5.0)
        assert wire.utility_calls == ["is_sleeping"] * 3
        assert client.state is EngineState.READY and not client._calls
        ids, _ = await collect(client, request("c" * 32, [9, 10], 4))
        assert ids == expected_echo([9, 10], 4)


async def test_overlapping_probes_each_get_their_own_answer(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    """The idle prober's probe and the silence watchdog's may overlap: each is judged by its
    own call's answer, and neither waits out the other."""
    async with vllm_setup(ranks=2, health_interval_s=0.0) as s:
        results: list[bool] = []

        async def probe() -> None:
            results.append(await s.client.answers_probe(5.0))

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(probe)
        assert results == [True] * 3
        assert trio.current_time() - start < 1.0
        assert not s.client._calls
        assert [len(r.wire.utility_calls) for r in s.ranks] == [3, 3]


def test_the_mock_answers_the_probe_while_it_loses_requests() -> None:
    """Under ``lose`` the mock drops a request and answers utility calls (is_sleeping: False,
    as vLLM's awake engine core does)."""
    from smgd.wire.vllm.decode import decode_outputs
    from smgd.wire.vllm.encode import encode_utility

    wire = VllmMockWire("tcp://127.0.0.1:1")
    sched = MockScheduler(max_batch=8)
    sched.lose_requests = True
    frames = make_client(Path("/tmp/x"))._wire_add(request("l" * 32, [5, 6], 4))
    assert wire.on_request(frames, sched) == []
    assert wire.received == ["l" * 32] and sched.idle, "the request was dropped"
    reply = decode_outputs(wire.on_request(encode_utility(9, "is_sleeping"), sched)[0]).utility
    assert reply is not None
    assert (reply.call_id, reply.ok, reply.result) == (9, True, False)
