"""server.workers > 1: engine partition, config check, one port, signals, restarts."""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

import httpx
import pytest
import trio

from smgd.config import load_config
from smgd.errors import ConfigError
from smgd.worker_id import Worker, current_worker, for_worker
from smgd.workers import reuseport_sockets

from .daemon_harness import (
    config_text,
    engine_toml,
    serve_process,
    stream_completion,
    wait_url,
)

PROMPT = "The quick brown fox jumps over the lazy dog"


def _two_workers(tmp_path: Path, *engines: str) -> Path:
    path = tmp_path / "smgd.toml"
    path.write_text(config_text(*engines).replace("[server]\n", "[server]\nworkers = 2\n"))
    return path


# --------------------------------------------------------------------------- sans-IO


def test_current_worker_reads_its_place_from_the_environment() -> None:
    assert current_worker({}) is None
    assert current_worker({"SMGD_WORKER": "1/3"}) == Worker(1, 3)
    with pytest.raises(ValueError, match="out of range"):
        current_worker({"SMGD_WORKER": "3/3"})


def test_worker_k_gets_engines_i_with_i_mod_n_equal_k(tmp_path: Path) -> None:
    engines = [engine_toml(f"e{i}", "m") for i in range(5)]
    config = load_config(_two_workers(tmp_path, *engines), environ={})
    assert [e.name for e in for_worker(config, Worker(0, 2)).engines] == ["e0", "e2", "e4"]
    assert [e.name for e in for_worker(config, Worker(1, 2)).engines] == ["e1", "e3"]


def test_a_model_missing_from_a_worker_is_a_config_error_on_server_workers(
    tmp_path: Path,
) -> None:
    # e0 -> worker 0, e1 -> worker 1: model "b" exists only in worker 1.
    path = _two_workers(tmp_path, engine_toml("e0", "a"), engine_toml("e1", "b"))
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert info.value.path == "$.server.workers"
    assert "'a' has no engine in worker 1" in info.value.message


def test_workers_out_of_range_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "smgd.toml"
    path.write_text(
        config_text(engine_toml("e0", "a")).replace("[server]\n", "[server]\nworkers = 0\n")
    )
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert info.value.path == "$.server.workers"


def test_reuseport_sockets_share_one_port() -> None:
    sockets = reuseport_sockets("127.0.0.1", 0, 3)
    try:
        ports = {s.getsockname()[1] for s in sockets}
        assert len(ports) == 1 and ports != {0}
        # Each one accepts: a connect succeeds whichever socket the kernel picks.
        with socket.create_connection(("127.0.0.1", ports.pop()), timeout=5):
            pass
    finally:
        for s in sockets:
            s.close()


# --------------------------------------------------------------------------- the processes


def _children(pid: int) -> list[int]:
    # trio spawns from a worker thread, so the children belong to whichever task did it.
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue  # that thread just ended
    return found


async def _ready_everywhere(url: str) -> None:
    """Wait until /readiness, over fresh connections (any worker), reports both workers ready."""
    with trio.fail_after(60):
        while True:
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                response = await client.get("/readiness")
            body = response.json()
            if response.status_code == 200:
                # Whichever worker answered, the report covers both and their engines.
                assert body["workers"] == {"0": "ready", "1": "ready"}
                assert set(body["engines"]) == {"e0", "e1"}
                return
            assert body["status"] == "not_ready"
            await trio.sleep(0.1)


async def _metrics_cover_both_workers(url: str) -> None:
    """Any connection's /metrics covers both workers, each sample labelled with its worker."""
    for _ in range(4):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            text = (await client.get("/metrics")).text
        assert "smgd_workers_scraped 2.0" in text
        assert 'smgd_engine_up{engine="e0",wire="sglang",worker="0"} 1.0' in text
        assert 'smgd_engine_up{engine="e1",wire="sglang",worker="1"} 1.0' in text


@pytest.mark.slow
async def test_two_workers_share_the_port_restart_on_death_and_drain_on_sigterm(
    tmp_path: Path,
) -> None:
    path = _two_workers(tmp_path, engine_toml("e0", "m", step_ms=20), engine_toml("e1", "m"))
    proc = serve_process(path)
    try:
        url = await wait_url(proc)
        await _ready_everywhere(url)
        workers = _children(proc.pid)
        assert len(workers) == 2

        await _metrics_cover_both_workers(url)
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            load = (await client.get("/get_load")).json()
        assert [(e["dp_rank"], e["engine"], e["worker"]) for e in load] == [
            (0, "e0", 0),
            (1, "e1", 1),
        ]

        # A worker that dies is replaced; the port keeps answering meanwhile.
        victim = workers[1]
        os.kill(victim, signal.SIGKILL)
        with trio.fail_after(30):
            while len(set(_children(proc.pid)) - {victim}) < 2:  # noqa: ASYNC110 - /proc only
                await trio.sleep(0.1)
        await _ready_everywhere(url)
        # The metrics sockets are the supervisor's: the new worker answers on its predecessor's.
        await _metrics_cover_both_workers(url)

        # SIGTERM to the supervisor drains every worker: streams in flight finish, exit 0.
        results: list[int] = []

        async def one(client: httpx.AsyncClient) -> None:
            _, usage, finish = await stream_completion(client, "m", PROMPT, 40)
            assert finish == "length" and usage is not None
            results.append(int(usage["completion_tokens"]))  # type: ignore[call-overload]

        clients = [httpx.AsyncClient(base_url=url, timeout=60) for _ in range(8)]
        try:
            async with trio.open_nursery() as nursery:
                for client in clients:
                    nursery.start_soon(one, client)
                await trio.sleep(0.3)
                proc.send_signal(signal.SIGTERM)
        finally:
            for client in clients:
                await client.aclose()
        assert results == [40] * 8
        code = await trio.to_thread.run_sync(proc.wait, 30)
        assert code == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.slow
async def test_an_admin_reload_reaches_every_worker(tmp_path: Path) -> None:
    """`smgd reload` talks to worker 0's admin listener; worker 0 applies the reload, then the
    supervisor has every other worker reload too (each counts one in /metrics)."""
    path = _two_workers(tmp_path, engine_toml("e0", "m"), engine_toml("e1", "m"))
    proc = serve_process(path)
    try:
        url = await wait_url(proc)
        await _ready_everywhere(url)
        path.write_text(path.read_text().replace("step_ms = 5.0", "step_ms = 5.0\nmax_batch = 8"))
        done = await trio.run_process(
            [sys.executable, "-m", "smgd", "reload", "--config", str(path)],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr.decode()
        assert "replaced e0" in done.stdout.decode()  # worker 0's share
        with trio.fail_after(30):
            while True:
                async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                    text = (await client.get("/metrics")).text
                if all(f'smgd_reloads_total{{worker="{k}"}} 1.0' in text for k in (0, 1)):
                    break
                await trio.sleep(0.1)
        assert 'smgd_reload_failures_total{worker="1"} 0.0' in text
    finally:
        proc.terminate()
        proc.communicate()
