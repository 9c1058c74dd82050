"""Fault suite: an engine dies or hangs under load; what the clients see, and the recovery."""

from __future__ import annotations

import json
import os
import signal
from functools import partial
from typing import TYPE_CHECKING

import httpx
import pytest
import trio
import zmq

from smgd.engines.reader import DELIVER_CHUNK

from ..engine_harness import short_ipc_dir
from .harness import (
    Daemon,
    StreamOutcome,
    daemon_toml,
    mock_engine_toml,
    serve,
    stream,
    stream_h11,
    until,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from pathlib import Path

pytestmark = pytest.mark.slow

STREAMS = 20
# 20 ms steps x 2,000 tokens: every stream is still running when the fault strikes, however
# slow the machine is at starting them.
STEP_MS = 20.0
LONG = 2000
# How long a token may take from smgd's receipt of its frame to the client's read of it.
DELIVERY_S = 0.1


def start_streams(client: httpx.AsyncClient, nursery: trio.Nursery, n: int) -> list[StreamOutcome]:
    """``n`` long streams in ``nursery``; their outcomes fill in as events arrive."""
    outcomes = [StreamOutcome(status=0) for _ in range(n)]
    for outcome in outcomes:
        nursery.start_soon(partial_stream, client, outcome)
    return outcomes


async def partial_stream(client: httpx.AsyncClient, outcome: StreamOutcome) -> None:
    await stream(client, "m", "the quick brown fox", LONG, into=outcome)


async def all_under_way(outcomes: list[StreamOutcome]) -> None:
    """Every stream has its first tokens: a fault now strikes mid-stream."""

    async def under_way() -> bool:
        return all(len(o.chunks) >= 3 for o in outcomes)

    await until(under_way, 30)


async def kill9_under_load(
    daemon: Daemon, read: Callable[[StreamOutcome], Awaitable[object]], n: int
) -> tuple[list[StreamOutcome], int, float]:
    """``n`` long streams, each run by ``read`` into its outcome; once all are under way,
    SIGKILL the engine. Returns when every stream has ended: their outcomes, the killed pid
    and when it was killed."""
    async with trio.open_nursery() as nursery:
        results = [StreamOutcome(status=0) for _ in range(n)]
        for outcome in results:
            nursery.start_soon(read, outcome)
        await all_under_way(results)
        (engine,) = daemon.engine_pids()
        os.kill(engine, signal.SIGKILL)
        killed_at = trio.current_time()
    return results, engine, killed_at


def ended_by_the_engine_error(outcome: StreamOutcome) -> None:
    """A stream cut short by its engine's death: a 200 whose body ends with an error event,
    [DONE] and the chunked terminator, after some but not all of its tokens."""
    assert outcome.status == 200
    assert outcome.error is not None, outcome
    assert outcome.error["type"] == "engine_error"
    assert outcome.done and outcome.body_complete
    assert 0 < len(outcome.chunks) < LONG


async def test_engine_kill9_under_load_ends_every_stream_then_recovers(tmp_path: Path) -> None:
    config = daemon_toml(mock_engine_toml("e0", "m", step_ms=STEP_MS))
    async with serve(tmp_path, config) as daemon, daemon.client() as client:
        with trio.fail_after(30):
            read = partial(partial_stream, client)
            results, engine, killed_at = await kill9_under_load(daemon, read, STREAMS)
        # Every stream ended within a second of the kill, each with an error event and [DONE].
        for outcome in results:
            assert outcome.ended_at is not None and outcome.ended_at - killed_at < 1.0
            ended_by_the_engine_error(outcome)
        # Not ready while the engine is down; ready again (a new process) after relaunch.
        assert (await client.get("/readiness")).status_code == 503
        await daemon.wait_ready()
        (relaunched,) = daemon.engine_pids()
        assert relaunched != engine
        after = await stream(client, "m", "hello again", 8)
        assert after.error is None and after.done and len(after.chunks) == 8


async def test_engine_kill9_while_its_messages_are_delivered_in_slices(tmp_path: Path) -> None:
    """More streams than one delivery slice, all running in one batch when the engine is
    killed: every message it sent then held a row for each of them, more than
    ``DELIVER_CHUNK``, so each was delivered in slices with passes of the loop between them.
    Every stream still ends within 1 s of the kill with the error, and a new engine process
    serves.

    What the client cannot see, and this does not prove: that the death was noticed in a pass
    between two slices of one message rather than between two messages (a step's slices take
    a few ms of its 20)."""
    n = DELIVER_CHUNK + 44
    engine_toml = mock_engine_toml("e0", "m", step_ms=STEP_MS) + f"max_batch = {2 * n}\n"
    async with serve(tmp_path, daemon_toml(engine_toml)) as daemon, daemon.client() as client:
        # Read with h11 on a socket each (stream_h11): through httpx, ending 300 streams at
        # once took this process seconds, which would count against the daemon's 1 s.
        read = partial(stream_h11, daemon.url, "m", "the quick brown fox", LONG)
        with trio.fail_after(60):
            results, engine, killed_at = await kill9_under_load(
                daemon, lambda outcome: read(into=outcome), n
            )
        # Each stream had its first tokens (all_under_way) and none had ended before the kill:
        # all n ran in the engine's one batch (max_batch = 2n), a row each in every message.
        # Each ended within a second of the kill, with an error event and [DONE].
        for outcome in results:
            assert outcome.ended_at is not None and 0 <= outcome.ended_at - killed_at < 1.0
            ended_by_the_engine_error(outcome)
        await daemon.wait_ready()
        (relaunched,) = daemon.engine_pids()
        assert relaunched != engine
        after = await stream(client, "m", "hello again", 8)
        assert after.error is None and after.done and len(after.chunks) == 8


async def sigstop_under_streams(daemon: Daemon, client: httpx.AsyncClient, detect_s: float) -> int:
    """Stop the daemon's one engine (``SIGSTOP``) under four streams and check each ends with
    an error ``detect_s`` (silence + the unanswered probe) after the engine went quiet, not
    before, and not much after; the stopped pid.

    The silence is counted from the engine's last frame, which can precede the SIGSTOP by a
    step or more on a loaded machine; the client got that frame's token a moment after smgd
    did (DELIVERY_S at most), so the error may not come sooner than ``detect_s`` after the
    stream's last token."""
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            results = start_streams(client, nursery, 4)
            await all_under_way(results)
            (stopped,) = daemon.engine_pids()
            os.kill(stopped, signal.SIGSTOP)
            stopped_at = trio.current_time()
    for outcome in results:
        assert outcome.ended_at is not None and outcome.last_chunk_at is not None
        assert outcome.ended_at - outcome.last_chunk_at >= detect_s - DELIVERY_S
        assert outcome.ended_at - stopped_at < detect_s + 3
        assert outcome.error is not None and outcome.done and outcome.body_complete
    return stopped


async def test_engine_sigstop_streams_fail_after_silence_and_engine_is_replaced(
    tmp_path: Path,
) -> None:
    silence_s = 1.5
    # Silent that long, the engine gets a health probe: unanswered for health_timeout_s, it is
    # wedged (answered, it lost the requests: test_rogue_engine.py).
    probe_s = 1.0
    engine = mock_engine_toml(
        "e0",
        "m",
        step_ms=STEP_MS,
        extra=f"[engines.timeouts]\nsilence_s = {silence_s}\nhealth_interval_s = 0\n"
        f"health_timeout_s = {probe_s}\n",
    )
    async with serve(tmp_path, daemon_toml(engine)) as daemon, daemon.client() as client:
        stopped = await sigstop_under_streams(daemon, client, silence_s + probe_s)
        await daemon.wait_ready()
        (replacement,) = daemon.engine_pids()
        assert replacement != stopped
        after = await stream(client, "m", "still there", 5)
        assert after.error is None and len(after.chunks) == 5


# --------------------------------------------------------------------------- vLLM's probe


def vllm_mock_toml(timeouts: str, *, control: str | None = None) -> str:
    """Engine ``e0`` (model ``m``): a mock on vLLM's wire smgd launches, with these
    ``[engines.timeouts]`` lines and, given ``control``, the mock's fault-command socket."""
    launch = ""
    if control is not None:
        launch = f'[engines.launch]\nkind = "mock"\nargs = ["--control", "{control}"]\n'
    extra = f"[engines.timeouts]\n{timeouts}{launch}"
    return mock_engine_toml("e0", "m", step_ms=STEP_MS, extra=extra).replace(
        "[engines.mock]\n", '[engines.mock]\nwire = "vllm"\n'
    )


async def inject(daemon: Daemon, control: str, fault: str) -> None:
    """Send the mock engine ``fault`` on its control socket; return once its log says it
    took it (the mock's stderr is the daemon's)."""
    before = daemon.log().count(f"mock: fault {fault}")
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
    try:
        sock.setsockopt(zmq.LINGER, 5000)  # the command goes out before close() gives up
        sock.connect(control)
        sock.send(json.dumps({"fault": fault}).encode())
    finally:
        sock.close()

    async def taken() -> bool:
        return daemon.log().count(f"mock: fault {fault}") > before

    await until(taken, 10)


async def test_a_request_lost_by_a_vllm_engine_that_answers_its_probe_fails_alone(
    tmp_path: Path,
) -> None:
    """A vLLM engine core loses a request and sends nothing more, but answers the utility
    call smgd probes it with after ``silence_s``: the request alone fails (504
    ``request_timeout``) and the engine serves on, the same process (it was declared dead
    and relaunched: vLLM's client had no probe)."""
    silence_s = 1.0
    control = f"ipc://{short_ipc_dir()}/control.sock"
    timeouts = f"silence_s = {silence_s}\nhealth_interval_s = 0\nhealth_timeout_s = 1\n"
    config = daemon_toml(vllm_mock_toml(timeouts, control=control))
    async with serve(tmp_path, config) as daemon, daemon.client() as client:
        served = await stream(client, "m", "hello there", 8)
        assert served.error is None and served.done and len(served.chunks) == 8, served
        pids = daemon.engine_pids()
        await inject(daemon, control, "lose")
        start = trio.current_time()
        with trio.fail_after(20):
            reply = await client.post(
                "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 13}
            )
        assert silence_s <= trio.current_time() - start < silence_s * 1.25 + 3
        assert reply.status_code == 504, reply.text
        error = reply.json()["error"]
        assert error["code"] == "request_timeout", error
        assert "answers but sent no output" in error["message"], error
        assert daemon.engine_pids() == pids, "the engine was relaunched"
        assert " dead: " not in daemon.log()
        await inject(daemon, control, "ok")
        after = await stream(client, "m", "hello again", 8)
        assert after.error is None and after.done and len(after.chunks) == 8, after
        assert daemon.engine_pids() == pids


async def test_a_sigstopped_vllm_engine_is_replaced_after_silence_and_an_unanswered_probe(
    tmp_path: Path,
) -> None:
    """A vLLM engine core stops (``SIGSTOP``) under streams: they fail once it has been silent
    for ``silence_s`` and left the utility-call probe unanswered for ``health_timeout_s``
    (not before: without a probe it was dead at ``silence_s``); a new process serves."""
    silence_s, probe_s = 1.5, 1.0
    timeouts = f"silence_s = {silence_s}\nhealth_interval_s = 0\nhealth_timeout_s = {probe_s}\n"
    async with (
        serve(tmp_path, daemon_toml(vllm_mock_toml(timeouts))) as daemon,
        daemon.client() as client,
    ):
        stopped = await sigstop_under_streams(daemon, client, silence_s + probe_s)
        await daemon.logged("no output for 1.5 s")
        await daemon.wait_ready()
        (replacement,) = daemon.engine_pids()
        assert replacement != stopped
        after = await stream(client, "m", "still there", 5)
        assert after.error is None and len(after.chunks) == 5


async def test_an_idle_sigstopped_vllm_engine_is_found_by_the_idle_probe_and_replaced(
    tmp_path: Path,
) -> None:
    """A vLLM engine core with nothing to do stops (``SIGSTOP``): the idle prober's utility
    call (every ``health_interval_s = 1``) goes unanswered for ``health_timeout_s = 1``, the
    engine is declared dead and a new process serves (without a probe, nothing noticed until
    a request came and then waited out ``silence_s``)."""
    interval_s, probe_s = 1.0, 1.0
    timeouts = f"health_interval_s = {interval_s}\nhealth_timeout_s = {probe_s}\n"
    async with (
        serve(tmp_path, daemon_toml(vllm_mock_toml(timeouts))) as daemon,
        daemon.client() as client,
    ):
        served = await stream(client, "m", "hello there", 8)
        assert served.error is None and served.done and len(served.chunks) == 8, served
        (stopped,) = daemon.engine_pids()
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = trio.current_time()
        dead = "engine e0 dead: no answer to a health check (utility call is_sleeping) within 1 s"

        async def found() -> bool:
            return dead in daemon.log()

        await until(found, interval_s + probe_s + 5, poll_s=0.05)
        assert probe_s <= trio.current_time() - stopped_at < interval_s + probe_s + 2
        await daemon.wait_ready()
        (replacement,) = daemon.engine_pids()
        assert replacement != stopped
        after = await stream(client, "m", "still there", 5)
        assert after.error is None and len(after.chunks) == 5
