"""Fault suite: ``server.workers = 2``, a worker that cannot start, or dies and cannot come back.

What a client (and an operator) sees: a worker that cannot start stops smgd as one process
would (exit 1, its error, no banner); a worker that dies while the file on disk no longer
loads (a reload of it was refused) leaves no connection waiting on its socket, and a stop
does not wait out its restart backoff.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

import httpx
import pytest
import trio

from .harness import (
    alive,
    cmdline,
    daemon_toml,
    descendants,
    mock_engine_toml,
    serve,
    stream,
    until,
)

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow

TWO_WORKERS = "workers = 2\n"


def _workers(root: int) -> list[int]:
    """The supervisor's worker processes (``smgd serve``, not the engines they launched)."""
    return [p for p in descendants(root) if b"\0serve\0" in cmdline(p)]


async def test_a_worker_that_cannot_start_stops_smgd_with_its_error(tmp_path: Path) -> None:
    # Engine b (worker 1's) cannot bind its socket: one process would exit 1 with that line.
    broken = mock_engine_toml(
        "b", "m", extra='[engines.addresses]\ninput = "ipc:///proc/1/nope/in.sock"\n'
    )
    text = daemon_toml(mock_engine_toml("a", "m"), broken, extra_server=TWO_WORKERS)
    path = tmp_path / "smgd.toml"
    path.write_text(text)
    with trio.fail_after(60):
        done = await trio.run_process(
            [sys.executable, "-m", "smgd", "serve", "--config", str(path)],
            stdin=subprocess.DEVNULL,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert "smgd: engine b failed to start: cannot create ipc directory '/proc/1/nope'" in err
    assert "smgd: worker 1 could not start (exit code 1; its error is above)" in err
    assert "listening" not in err and "Traceback" not in err


async def test_a_worker_that_dies_while_its_file_is_broken_leaves_no_connection_waiting(
    tmp_path: Path,
) -> None:
    text = daemon_toml(
        mock_engine_toml("a", "m"), mock_engine_toml("b", "m"), extra_server=TWO_WORKERS
    )
    async with serve(tmp_path, text) as daemon, daemon.client() as client:
        assert (await stream(client, "m", "hello", 4)).done
        # A typo saved and SIGHUPed: refused by both workers, the old config serves on.
        daemon.config_path.write_text(text + "[server\n")
        daemon.send_signal(signal.SIGHUP)

        async def refused_twice() -> bool:
            return daemon.log().count("reload rejected, nothing changed") == 2

        await until(refused_twice, 20)
        workers = _workers(daemon.proc.pid)
        assert len(workers) == 2
        victim = workers[1]
        os.kill(victim, signal.SIGKILL)

        async def gone() -> bool:
            return not alive(victim)

        await until(gone, 10)
        # Its restart reads the broken file and exits (config error), again and again. Fresh
        # connections meanwhile all go to the worker that serves: none waits on a socket
        # that nobody accepts from.
        for _ in range(16):
            async with httpx.AsyncClient(base_url=daemon.url, timeout=5) as fresh:
                body = {"model": "m", "prompt": "x", "max_tokens": 2}
                answer = await fresh.post("/v1/completions", json=body)
            assert answer.status_code == 200
        readiness = await client.get("/readiness")
        assert readiness.status_code == 503 and readiness.headers["retry-after"] == "5"
        ready = readiness.json()
        assert ready["status"] == "not_ready"
        assert sorted(ready["workers"].values()) == ["no_answer", "ready"]

        async def backing_off() -> bool:
            return "restarting in 8 s" in daemon.log()

        await until(backing_off, 40)
        assert "config error at $" in daemon.log()
        # A stop does not wait out the restart's backoff.
        started = trio.current_time()
        daemon.send_signal(signal.SIGTERM)
        assert await daemon.wait_exit(within=15) == 0
        assert trio.current_time() - started < 5.0  # the backoff was 8 s
        assert "Traceback" not in daemon.log()
