"""Fault suite: SIGTERM under load, with a drain that completes and one that runs out of time."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import httpx
import pytest
import trio

from smgd.assets import TINY_MODEL_DIR

from ..engine_harness import short_ipc_dir
from .harness import StreamOutcome, daemon_toml, mock_engine_toml, serve, stream, until

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow

STEP_MS = 20.0
STREAMS = 6


async def _under_way(outcomes: list[StreamOutcome]) -> None:
    async def under_way() -> bool:
        return all(len(o.chunks) >= 3 for o in outcomes)

    await until(under_way, 30)


def _start(
    client: httpx.AsyncClient, nursery: trio.Nursery, n: int, max_tokens: int
) -> list[StreamOutcome]:
    outcomes = [StreamOutcome(status=0) for _ in range(n)]
    for i, outcome in enumerate(outcomes):
        nursery.start_soon(_stream, client, f"stream number {i}", max_tokens, outcome)
    return outcomes


async def _stream(
    client: httpx.AsyncClient, prompt: str, max_tokens: int, outcome: StreamOutcome
) -> None:
    await stream(client, "m", prompt, max_tokens, into=outcome)


def _completed_then_exited(
    results: list[StreamOutcome], code: int, exit_s: float, log: str
) -> None:
    """Every 50-token stream ran to its end, and the daemon exited 0 once they had."""
    for outcome in results:
        assert outcome.error is None, outcome.error
        assert outcome.finish_reason == "length"
        assert outcome.usage is not None and outcome.usage["completion_tokens"] == 50
        assert outcome.done and outcome.body_complete
    assert code == 0
    # It exited once its streams were done, not at the end of the 20 s drain timeout.
    assert exit_s < 10
    assert "drain timeout" not in log


async def _idle_connection(url: str) -> trio.SocketStream:
    """A keep-alive connection that served one request and now waits for the next."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = await trio.open_tcp_stream(host, int(port))
    await conn.send_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):  # one JSON body
        data = await conn.receive_some(1 << 16)
        assert data, "closed before its answer"
        answer += data
    assert answer.startswith(b"HTTP/1.1 200")
    return conn


async def _closed_by_server(conn: trio.SocketStream) -> bool:
    try:
        return await conn.receive_some(1 << 16) == b""
    except trio.BrokenResourceError:
        return True


@pytest.mark.parametrize("idle_connections", [0, 4])
async def test_a_drain_that_completes_finishes_every_stream_and_exits_0(
    tmp_path: Path, idle_connections: int
) -> None:
    # 50 tokens x 20 ms: every stream ends about a second after the signal, well inside 20 s.
    # Idle keep-alive connections beside them close when the drain begins (not after the 75 s
    # keep-alive timeout, and not at the drain timeout).
    config = daemon_toml(mock_engine_toml("e0", "m", step_ms=STEP_MS), drain_s=20.0)
    async with serve(tmp_path, config) as daemon, daemon.client() as client:
        idle = [await _idle_connection(daemon.url) for _ in range(idle_connections)]
        closed: list[float] = []

        async def wait_closed(conn: trio.SocketStream) -> None:
            assert await _closed_by_server(conn)
            closed.append(trio.current_time())

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                results = _start(client, nursery, STREAMS, 50)
                await _under_way(results)
                daemon.send_signal(signal.SIGTERM)
                signalled_at = trio.current_time()
                for conn in idle:
                    nursery.start_soon(wait_closed, conn)
            code = await daemon.wait_exit(15)
        exited_at = trio.current_time()
        for conn in idle:
            await conn.aclose()
    assert len(closed) == idle_connections
    assert all(at - signalled_at < 10 for at in closed)
    _completed_then_exited(results, code, exited_at - signalled_at, daemon.log())


@asynccontextmanager
async def external_mock(tmp_path: Path) -> AsyncIterator[tuple[str, list[str]]]:
    """A mock SGLang scheduler smgd does not launch (it outlives smgd, as an attached engine
    does); yields its ``[[engines]]`` entry and its stderr lines as they come."""
    ipc = short_ipc_dir()
    entry = (
        f'[[engines]]\nname = "ext"\nwire = "sglang"\nmodels = ["m"]\n'
        f'model_dir = "{TINY_MODEL_DIR}"\nipc_dir = "{ipc}"\n'
    )
    argv = [
        *(sys.executable, "-m", "smgd", "mock-engine", "--wire", "sglang"),
        *("--input", f"ipc://{ipc}/in.sock", "--output", f"ipc://{ipc}/out.sock"),
        *("--step-ms", str(STEP_MS), "--eos-token-ids", "2,5", "--skip-ids", "0,1,2,3,4,5"),
    ]
    proc = await trio.lowlevel.open_process(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    lines: list[str] = []

    async def read() -> None:
        assert proc.stderr is not None
        pending = b""
        async for data in proc.stderr:
            pending += data
            *done, pending = pending.split(b"\n")
            lines.extend(line.decode(errors="replace") for line in done)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            yield entry, lines
            nursery.cancel_scope.cancel()
    finally:
        proc.kill()
        with trio.CancelScope(shield=True):
            await proc.wait()


async def test_a_drain_that_times_out_ends_every_request_properly_and_aborts_it(
    tmp_path: Path,
) -> None:
    drain_s = 1.0
    async with external_mock(tmp_path) as (engine, mock_log):
        config = daemon_toml(engine, drain_s=drain_s)
        async with serve(tmp_path, config) as daemon, daemon.client() as client:
            with trio.fail_after(30):
                whole: list[httpx.Response] = []

                async def non_streamed() -> None:
                    body = {"model": "m", "prompt": "not streamed", "max_tokens": 2000}
                    whole.append(await client.post("/v1/completions", json=body))

                async with trio.open_nursery() as nursery:
                    # 2,000 tokens x 20 ms = 40 s: all still running when the drain runs out.
                    results = _start(client, nursery, STREAMS, 2000)
                    nursery.start_soon(non_streamed)
                    await _under_way(results)
                    daemon.send_signal(signal.SIGTERM)
                    signalled_at = trio.current_time()
                code = await daemon.wait_exit(15)
        # Each stream: its tokens, then the error event, [DONE] and a well-formed end of the
        # chunked body (httpx read it to the end), at the deadline (the settle window is 0).
        for outcome in results:
            assert outcome.status == 200
            assert outcome.error is not None, outcome
            assert outcome.error["code"] == "drain_timeout"
            assert outcome.error["type"] == "service_unavailable"
            assert outcome.done and outcome.body_complete
            assert 3 <= len(outcome.chunks) < 2000
            assert outcome.ended_at is not None
            assert drain_s - 0.1 <= outcome.ended_at - signalled_at < drain_s + 1.5
        [response] = whole
        assert response.status_code == 503
        assert response.headers["retry-after"] == "5"
        assert response.json()["error"]["code"] == "drain_timeout"
        assert code == 0
        log = daemon.log()
        assert f"drain timeout: ending {STREAMS + 1} request(s)" in log
        assert "Traceback" not in log
        # The engine (still running: smgd did not launch it) got an abort for every request.

        async def all_aborted() -> bool:
            return sum(" abort " in line for line in mock_log) == STREAMS + 1

        await until(all_aborted, 5)
