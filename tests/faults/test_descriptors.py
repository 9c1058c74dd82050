"""Fault suite: descriptors. A daemon started at a low open-files soft limit raises it and
serves past it; a daemon whose hard limit is low runs out of descriptors, keeps serving the
connections it has, says so once, and takes the waiting ones when descriptors free up."""

from __future__ import annotations

import resource
from typing import TYPE_CHECKING

import pytest
import trio

from smgd.limits import open_files_target

from .harness import daemon_toml, mock_engine_toml, serve, until

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow

LOW = 256  # the daemon's soft (or hard) limit in these cases
HELD = 300  # idle connections the client holds open: more than LOW descriptors
BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}


def _open_files_limit(pid: int) -> int:
    """The process's soft RLIMIT_NOFILE, from /proc (the daemon's, not the test's)."""
    with open(f"/proc/{pid}/limits") as limits:
        for line in limits:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    raise AssertionError("no 'Max open files' in /proc/PID/limits")


async def _hold(url: str, n: int) -> list[trio.SocketStream]:
    """n idle connections to the daemon (the kernel completes them, whether smgd takes them
    or not)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return [await trio.open_tcp_stream(host, int(port)) for _ in range(n)]


def _config() -> str:
    return daemon_toml(mock_engine_toml("e1", "m"))


async def test_a_daemon_started_at_a_low_soft_limit_serves_past_it(tmp_path: Path) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2 * HELD:
        pytest.skip(f"the hard limit here is {hard}")
    prlimit = ("prlimit", f"--nofile={LOW}:")
    async with serve(tmp_path, _config(), prefix=prlimit) as daemon:
        assert _open_files_limit(daemon.proc.pid) == open_files_target(LOW, hard)
        held = await _hold(daemon.url, HELD)
        try:
            async with daemon.client() as client:
                with trio.fail_after(10):
                    answer = await client.post("/v1/completions", json=BODY)
        finally:
            for conn in held:
                await conn.aclose()
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4
        assert "accept failed" not in daemon.log()


async def test_out_of_descriptors_the_daemon_waits_then_serves_what_waited(
    tmp_path: Path,
) -> None:
    prlimit = ("prlimit", f"--nofile={LOW}:{LOW}")
    async with serve(tmp_path, _config(), prefix=prlimit) as daemon:
        async with daemon.client() as client:
            early = await client.post("/v1/completions", json=BODY)  # a kept connection
            assert early.status_code == 200
            held = await _hold(daemon.url, HELD)  # the daemon runs out taking these
            answers: list[int] = []
            answered = trio.Event()

            async def late() -> None:
                async with daemon.client() as other:
                    answers.append((await other.post("/v1/completions", json=BODY)).status_code)
                answered.set()

            async def refused() -> bool:
                return "accept failed" in daemon.log()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(late)  # queued in the kernel behind the held ones
                await until(refused, 10)
                # The connection the daemon already has is served all the while.
                again = await client.post("/v1/completions", json=BODY)
                assert again.status_code == 200
                assert answers == []  # the new one waits for a descriptor
                for conn in held:
                    await conn.aclose()  # the daemon sees them end and frees their descriptors
                with trio.fail_after(20):
                    await answered.wait()
            assert answers == [200]
        log = daemon.log()
        assert log.count("accept failed: EMFILE") == 1, log
        assert "accepting connections again: every waiting one taken" in log
        assert daemon.proc.returncode is None  # still running
