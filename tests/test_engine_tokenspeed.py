"""TokenSpeed engine client against in-process mock ranks over real sockets (one trio loop).

Also the sans-IO cores of the shared handshake machinery (tracker, rank table, port
derivation) and the ``ts serve --headless`` argv.
"""

from __future__ import annotations

import os
import signal
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
import zmq

from smgd.config import EngineConfig, TimeoutsConfig, WireFamily
from smgd.engines.handshake import (
    HandshakeTracker,
    RankTable,
    derive_handshake_port,
    identity_index,
)
from smgd.engines.state import EngineState
from smgd.engines.tokenspeed import TokenspeedEngineClient, tokenspeed_argv
from smgd.errors import ConfigError, EngineDead, EngineNotReady, InvalidRequest
from smgd.launch import mock_argv
from smgd.mock.engine import MockEngine
from smgd.mock.scheduler import MockScheduler
from smgd.mock.tokenspeed import TokenspeedMockWire
from smgd.wire.common import EngineInfo, EngineLoad, FinishReason

from .engine_harness import VOCAB, collect, expected_echo, request, short_ipc_dir

CONTEXT = 2048  # differs from the fallback's 4096, so readiness provably used the registration


@dataclass
class Rank:
    wire: TokenspeedMockWire
    mock: MockEngine
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)

    def stop(self) -> None:
        """Like the rank's process exiting: its sockets close."""
        self.scope.cancel()


@dataclass
class Setup:
    client: TokenspeedEngineClient
    ranks: list[Rank]
    ipc_dir: Path
    nursery: trio.Nursery


def make_client(
    ipc_dir: Path,
    *,
    ranks: int = 1,
    handshake: str = "tcp://127.0.0.1:*",
    launch_argv: list[str] | None = None,
    timeouts: TimeoutsConfig | None = None,
) -> TokenspeedEngineClient:
    config = EngineConfig(
        name="ts0",
        wire=WireFamily.TOKENSPEED,
        models=["m"],
        model_dir=".",
        timeouts=timeouts or TimeoutsConfig(),
    )
    return TokenspeedEngineClient(
        config,
        fallback_info=EngineInfo(max_model_len=4096, vocab_size=VOCAB),
        input_path=str(ipc_dir / "in.sock"),
        output_path=str(ipc_dir / "out.sock"),
        handshake=handshake,
        launch_argv=launch_argv,
        ranks=ranks,
    )


def start_rank(
    nursery: trio.Nursery,
    handshake: str,
    index: int,
    *,
    step_s: float = 0.002,
    max_batch: int = 256,
    dp_size: int = 1,
    **wire_kw: Any,
) -> Rank:
    wire = TokenspeedMockWire(
        handshake,
        engine_index=index,
        context_len=CONTEXT,
        max_batch=max_batch,
        dp_size=dp_size,
        **wire_kw,
    )
    rank = Rank(wire, MockEngine(wire, MockScheduler(max_batch=max_batch), step_s=step_s))

    async def run() -> None:
        with rank.scope:
            await rank.mock.run()

    nursery.start_soon(run)
    return rank


@asynccontextmanager
async def ts_setup(
    *,
    ranks: int = 1,
    with_mock: bool = True,
    launch_mock: bool = False,
    ipc_dir: Path | None = None,
    step_s: float = 0.002,
    max_batch: int = 256,
    wire_kw: dict[str, Any] | None = None,
    **timeouts: float,
) -> AsyncIterator[Setup]:
    ipc_dir = ipc_dir or short_ipc_dir()
    argv = None
    if launch_mock:
        argv = mock_argv(
            "tokenspeed", f"ipc://{ipc_dir}/in.sock", f"ipc://{ipc_dir}/out.sock",
            ["--step-ms", str(step_s * 1000), "--context-len", str(CONTEXT),
             "--handshake", "{handshake}"],
        )  # fmt: skip
    client = make_client(
        ipc_dir, ranks=ranks, launch_argv=argv, timeouts=TimeoutsConfig(**timeouts)
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        mocks = []
        if with_mock and not launch_mock:
            for i in range(ranks):
                mocks.append(
                    start_rank(nursery, client.handshake_endpoint, i, step_s=step_s,
                               max_batch=max_batch, dp_size=ranks, **(wire_kw or {}))
                )  # fmt: skip
        if with_mock:
            with trio.fail_after(30):
                await client.wait_ready()
        yield Setup(client, mocks, ipc_dir, nursery)
        nursery.cancel_scope.cancel()


def state_of(client: TokenspeedEngineClient) -> EngineState:
    return client.state  # a call, so mypy does not keep a narrowing from before an await


# --------------------------------------------------------------------------- over sockets


@pytest.mark.parametrize("key", ["prefix_granularity", "block_size"])
async def test_registration_with_either_key_makes_the_engine_ready(key: str) -> None:
    async with ts_setup(wire_kw={"registration_key": key}) as s:
        info = s.client.info
        assert info is not None
        assert info.max_model_len == CONTEXT
        assert info.max_num_seqs == 256
        assert info.kv_cache_tokens == CONTEXT * 256
        assert info.vocab_size == VOCAB  # not on the wire: from the model dir (fallback)
        assert s.client.state is EngineState.READY
        ids, last = await collect(s.client, request(uuid.uuid4().hex, [10, 11, 12], 7))
        assert ids == expected_echo([10, 11, 12], 7)
        assert last.finish is not None
        assert last.finish.reason is FinishReason.LENGTH
        assert (last.prompt_tokens, last.completion_tokens) == (3, 7)


async def test_256_concurrent_streams_lose_and_duplicate_nothing() -> None:
    results: dict[str, list[int]] = {}
    async with ts_setup(step_s=0.001) as s:

        async def one(i: int) -> None:
            prompt = [100 + i % 50, 200 + i % 7, 300 + i]
            ids, last = await collect(s.client, request(f"{i:032x}", prompt, 16 + i % 11))
            assert last.finish is not None
            assert last.finish.reason is FinishReason.LENGTH
            results[f"{i:032x}"] = ids

        async with trio.open_nursery() as nursery:
            for i in range(256):
                nursery.start_soon(one, i)
        assert s.client.in_flight == 0
        assert s.client.table is not None
        assert not s.client.table.ranks[0].in_flight
    assert len(results) == 256
    for i in range(256):
        assert results[f"{i:032x}"] == expected_echo(
            [100 + i % 50, 200 + i % 7, 300 + i], 16 + i % 11
        )


async def test_stop_token_ends_the_stream_with_stop() -> None:
    async with ts_setup() as s:
        ids, last = await collect(
            s.client, request(uuid.uuid4().hex, [5, 6, 7, 8], 50, stop_token_ids=(7,))
        )
        assert ids == [5, 6, 7]
        assert last.finish is not None
        assert last.finish.reason is FinishReason.STOP


async def test_leaving_early_closes_locally_and_the_engine_sees_the_abort() -> None:
    async with ts_setup(step_s=0.005) as s:
        rank = s.ranks[0]
        rid = uuid.uuid4().hex
        async with s.client.open_stream(request(rid, [5, 6], 1000)) as stream:
            first = await stream.receive()
            assert first.token_ids
        assert s.client.in_flight == 0
        assert s.client.table is not None
        assert not s.client.table.ranks[0].in_flight
        with trio.fail_after(5):
            while rid in rank.mock.sched.running or rank.mock.sched.waiting:  # noqa: ASYNC110
                await trio.sleep(0.005)
        assert rank.wire.aborts == [rid]
        # The engine keeps serving after an abort that got no reply.
        ids, _ = await collect(s.client, request(uuid.uuid4().hex, [9, 10], 3))
        assert ids == [9, 10, 9]


async def test_an_engine_rejection_is_a_400_finish_not_a_crash() -> None:
    async with ts_setup(wire_kw={"enable_logprobs": False}) as s:
        ids, last = await collect(s.client, request(uuid.uuid4().hex, [5, 6], 4, logprobs=0))
        assert ids == []
        assert last.finish is not None
        assert (last.finish.reason, last.finish.status_code) == (FinishReason.ABORT, 400)
        assert s.client.state is EngineState.READY
        ids, _ = await collect(s.client, request(uuid.uuid4().hex, [5, 6], 2))
        assert ids == [5, 6]


async def test_sampled_logprobs_come_through() -> None:
    async with ts_setup() as s:
        ids, last = await collect(s.client, request(uuid.uuid4().hex, [5, 6], 1, logprobs=0))
        assert ids == [5]
        assert last.logprobs is not None
        assert [lp.token_id for lp in last.logprobs] == [5]


async def test_what_the_engine_would_drop_or_reject_is_refused_before_sending() -> None:
    async with ts_setup() as s:
        rank = s.ranks[0]
        cases = [
            (request("a" * 32, [5, 6], 4, top_k=500), "top_k"),
            (request("b" * 32, [5, VOCAB], 4), "outside the vocabulary"),
            (request("c" * 32, [5] * 10, CONTEXT), "maximum context length"),
            (request("d" * 32, [5], 4, logprobs=3), "top_logprobs"),
        ]
        for req, match in cases:
            with pytest.raises(InvalidRequest, match=match):
                async with s.client.open_stream(req):
                    pass
        assert s.client.in_flight == 0
        assert s.client.table is not None
        assert not s.client.table.ranks[0].in_flight
        ids, _ = await collect(s.client, request("e" * 32, [5, 6], 2))
        assert ids == [5, 6]
        assert rank.wire.received == ["e" * 32]


async def test_not_ready_before_the_engine_dials_in(
    socket_autojump_clock: trio.testing.MockClock,
) -> None:
    with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
        async with ts_setup(with_mock=False, ready_s=20.0) as s:
            assert s.client.state is EngineState.STARTING
            with pytest.raises(EngineNotReady):
                async with s.client.open_stream(request("f" * 32, [5], 4)):
                    pass
            await trio.sleep(25)
            assert state_of(s.client) is EngineState.DEAD
            assert "handshake" in (s.client.last_error or "")


async def test_the_engine_may_dial_before_smgd_binds() -> None:
    with socket.socket() as probe:  # a free port: bound, read, released
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    ipc_dir = short_ipc_dir()
    async with trio.open_nursery() as nursery:
        rank = start_rank(nursery, endpoint, 0)
        await trio.sleep(0.2)  # the DEALER is retrying its connect by now
        client = make_client(ipc_dir, handshake=endpoint)
        await nursery.start(client.run)
        with trio.fail_after(10):
            await client.wait_ready()
        ids, _ = await collect(client, request(uuid.uuid4().hex, [3, 4], 3))
        assert ids == [3, 4, 3]
        assert rank.wire.init is not None
        nursery.cancel_scope.cancel()


async def test_dead_sentinel_fails_every_stream_with_an_error_of_its_own() -> None:
    errors: list[EngineDead] = []
    with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
        async with ts_setup(step_s=0.005) as s:
            started = trio.Event()

            async def one(i: int) -> None:
                try:
                    async with s.client.open_stream(request(f"{i:032x}", [7, 8], 2000)) as stream:
                        async for _ in stream:
                            if i == 0:
                                started.set()
                except EngineDead as exc:
                    errors.append(exc)

            async with trio.open_nursery() as nursery:
                for i in range(16):
                    nursery.start_soon(one, i)
                await started.wait()
                s.ranks[0].wire.request_death()
            assert s.client.state is EngineState.DEAD
            await trio.sleep_forever()
    assert len(errors) == 16
    assert len({id(e) for e in errors}) == 16, "one error object per stream"
    assert {str(e) for e in errors} == {"engine ts0 failed: the engine sent ENGINE_CORE_DEAD"}


async def test_kill_9_of_a_launched_mock_fails_all_streams_fast() -> None:
    errors: list[EngineDead] = []
    with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
        async with ts_setup(launch_mock=True, step_s=0.005) as s:
            assert s.client.info is not None
            assert s.client.info.max_model_len == CONTEXT
            killed_at = 0.0
            async with trio.open_nursery() as nursery:

                async def one(i: int) -> None:
                    try:
                        async with s.client.open_stream(
                            request(f"{i:032x}", [7, 8], 2000)
                        ) as stream:
                            async for _ in stream:
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
    assert "exited with code -9" in str(errors[0])  # not the disconnect before it


async def test_two_ranks_share_the_load() -> None:
    async with ts_setup(ranks=2, step_s=0.005) as s:
        assert s.client.table is not None
        assert [r.index for r in s.client.table.ranks] == [0, 1]
        async with trio.open_nursery() as nursery:
            for i in range(40):
                nursery.start_soon(collect, s.client, request(f"{i:032x}", [1, 2], 30))
            await trio.sleep(0.05)
            counts = [len(r.in_flight) for r in s.client.table.ranks]
            assert counts == [20, 20]
        assert sorted(s.ranks[0].wire.received + s.ranks[1].wire.received) == [
            f"{i:032x}" for i in range(40)
        ]
        assert s.client.load is not None  # the load tail of the outputs reached the client


async def test_a_rank_leaving_the_input_socket_kills_the_engine() -> None:
    with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
        async with ts_setup(ranks=2) as s:
            s.ranks[1].stop()
            with trio.fail_after(5):
                while s.client.state is EngineState.READY:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            assert "disconnected" in (s.client.last_error or "")
            await trio.sleep_forever()


async def test_send_to_a_departed_rank_fails_fast_with_ehostunreach() -> None:
    with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
        async with ts_setup(ranks=2, step_s=0.005) as s:
            # An extra peer keeps the connection count up, so only the send can notice.
            ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
            extra = ctx.socket(zmq.DEALER)
            extra.setsockopt(zmq.LINGER, 0)
            extra.connect(s.client.input_endpoint)
            try:
                await trio.sleep(0.1)
                async with s.client.open_stream(request("1" * 32, [5, 6], 2000)) as busy:
                    await busy.receive()  # rank 0 or 1 now holds one request
                    assert s.client.table is not None
                    owner = s.client.table.owner("1" * 32)
                    assert owner is not None
                    s.ranks[1 - owner.index].stop()  # the idle rank goes away
                    await trio.sleep(0.1)
                    assert s.client.state is EngineState.READY
                    with pytest.raises(EngineDead, match="unreachable"):
                        async with s.client.open_stream(request("2" * 32, [5], 4)) as stream:
                            await stream.receive()
            finally:
                extra.close()
            await trio.sleep_forever()


async def test_a_new_client_reattaches_to_a_running_engine_without_a_handshake() -> None:
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
        rank = start_rank(outer, first.handshake_endpoint, 0)
        with trio.fail_after(10):
            await first.wait_ready()
        ids, _ = await collect(first, request(uuid.uuid4().hex, [3, 4], 3))
        assert ids == [3, 4, 3]
        assert (ipc_dir / "engine-state.json").exists()
        scope.cancel()  # the daemon restarts; the engine keeps running
        await trio.sleep(0.05)
        second = make_client(ipc_dir)
        await outer.start(second.run)
        with trio.fail_after(10):
            await second.wait_ready()
        assert second.info is not None
        assert second.info.max_model_len == CONTEXT
        assert not second.tracker.ranks, "no handshake happened"
        ids, _ = await collect(second, request(uuid.uuid4().hex, [6, 7], 4))
        assert ids == [6, 7, 6, 7]
        assert rank.wire.init is not None
        outer.cancel_scope.cancel()


def test_tokenspeed_needs_a_tcp_handshake() -> None:
    with pytest.raises(ConfigError, match="tcp"):
        make_client(Path("/tmp/x"), handshake="ipc:///tmp/x/hs.sock")


# --------------------------------------------------------------------------- sans-IO cores


def test_tracker_needs_hello_ready_and_registration_in_either_order() -> None:
    info = EngineInfo(max_model_len=100)
    t = HandshakeTracker()
    a, b = (0).to_bytes(2, "little"), (1).to_bytes(2, "little")
    assert t.on_hello(a).send_init
    assert not t.on_ready(b), "READY before HELLO is refused"
    assert t.on_registration(a, info)
    assert t.complete(1) is None
    assert t.on_ready(a)
    assert [r.index for r in t.complete(1) or []] == [0]
    t.on_hello(b)
    t.on_ready(b)
    assert t.complete(2) is None
    t.on_registration(b, info)
    assert [r.index for r in t.complete(2) or []] == [0, 1]
    assert t.on_hello(a).restarted, "a registered rank saying HELLO again restarted"
    assert identity_index(b"\x02\x01") == 258
    assert identity_index(b"abc") == -1


def test_rank_table_picks_least_loaded_and_releases_by_id() -> None:
    table = RankTable([(0, b"\x00\x00"), (1, b"\x01\x00")])
    picks = [table.pick(f"r{i}").index for i in range(4)]
    assert sorted(picks) == [0, 0, 1, 1], "equal ranks alternate"
    table.update_load(1, EngineLoad(running=10, waiting=0, kv_usage=0.2))
    assert [table.pick(f"s{i}").index for i in range(3)] == [0, 0, 0]
    assert table.release("s0") is not None
    assert table.release("s0") is None, "idempotent"
    for rid in ("r0", "r1", "r2", "r3", "s1", "s2"):
        table.release(rid)
    assert all(not r.in_flight for r in table.ranks)
    # An idle rank's stale snapshot is zeroed, so it attracts work again.
    rank1 = table.ranks[1]
    assert rank1.load is not None
    assert (rank1.load.running, rank1.load.waiting) == (0, 0)


def test_kv_pressure_with_a_queue_repels_work() -> None:
    table = RankTable([(0, b"\x00\x00"), (1, b"\x01\x00")])
    table.update_load(0, EngineLoad(running=4, waiting=2, kv_usage=1.0))  # 6 + 2*6*0.5 = 12
    table.update_load(1, EngineLoad(running=8, waiting=2, kv_usage=0.4))  # 10, no pressure
    assert table.ranks[0].score() == pytest.approx(12.0)
    assert table.pick("x").index == 1


def test_handshake_port_matches_smg() -> None:
    assert derive_handshake_port("/tmp/smg-zmq/ts0.ipc") == 25152
    assert derive_handshake_port("/tmp/smg-zmq/engine-31000") == 22714


def test_ts_serve_argv() -> None:
    argv = tokenspeed_argv(python="/v/bin/python", model="/m", args=["--max-num-seqs", "8"])
    assert argv[:5] == ["/v/bin/python", "-m", "tokenspeed.cli", "serve", "--headless"]
    assert argv[argv.index("--model") + 1] == "/m"
    assert argv[argv.index("--data-parallel-address") + 1] == "{handshake_host}"
    assert argv[argv.index("--data-parallel-rpc-port") + 1] == "{handshake_port}"
    assert argv[argv.index("--zmq-engine-index") + 1] == "0"
    assert "--enable-output-logprobs" in argv
    assert argv[-2:] == ["--max-num-seqs", "8"]
    own = tokenspeed_argv(python="p", model="m", args=["--grammar-backend", "outlines"])
    assert own.count("--grammar-backend") == 1
    client = make_client(Path("/tmp/x"), launch_argv=argv)
    client.handshake_endpoint = "tcp://127.0.0.1:30999"
    filled = [client._fill(a) for a in argv]
    assert filled[filled.index("--data-parallel-address") + 1] == "127.0.0.1"
    assert filled[filled.index("--data-parallel-rpc-port") + 1] == "30999"
