"""The whole daemon: mock engines as child processes, HTTP, reload while streaming, drain."""

from __future__ import annotations

import os
import re
import signal
import socket
from pathlib import Path

import httpx
import pytest
import trio

from smgd.api.http.server import bind_public
from smgd.assets import TINY_MODEL_DIR
from smgd.config import Config, ServerConfig
from smgd.errors import TransportError
from smgd.gateway import Gateway
from smgd.workers import reuseport_sockets

from .daemon_harness import (
    config_text,
    engine_toml,
    running_daemon,
    serve_process,
    stream_completion,
    wait_url,
)

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog"


async def stream_many(
    client: httpx.AsyncClient, model: str, n: int, max_tokens: int, results: list[int]
) -> None:
    async def one() -> None:
        _, usage, finish = await stream_completion(client, model, PROMPT, max_tokens)
        assert finish == "length"
        assert usage is not None
        results.append(int(usage["completion_tokens"]))  # type: ignore[call-overload]

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)


@pytest.mark.parametrize("change", ["add", "remove", "invalid"])
async def test_reload_while_64_streams_run_loses_no_token(tmp_path: Path, change: str) -> None:
    path = tmp_path / "smgd.toml"
    keep = engine_toml("keep", "m-keep", step_ms=10)
    other = engine_toml("other", "m-other")
    path.write_text(config_text(keep, other))
    async with running_daemon(path) as (daemon, client):
        gateway = daemon.gateway
        results: list[int] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream_many, client, "m-keep", 64, 60, results)
            await trio.sleep(0.2)
            run_dir = gateway.config.run_dir
            if change == "add":
                new = config_text(keep, other, engine_toml("added", "m-added"))
            elif change == "remove":
                new = config_text(keep)
            else:
                new = config_text(keep, other.replace('wire = "mock"', 'wire = "tgi"'))
            # Keep the same run_dir so the untouched engines' sockets stay where they are.
            new = f'run_dir = "{run_dir}"\n' + new.split("\n", 1)[1]
            path.write_text(new)
            result = await daemon.reload()
        assert results == [60] * 64
        names = {e.name for e in gateway.router.engines()}
        if change == "add":
            assert result.ok and result.added == ["added"]
            assert names == {"keep", "other", "added"}
            with trio.fail_after(30):
                await gateway.router.get("added").wait_ready()  # type: ignore[union-attr]
            text, _, _ = await stream_completion(client, "m-added", PROMPT, 5)
            assert text
        elif change == "remove":
            assert result.ok and result.removed == ["other"]
            assert names == {"keep"}
            response = await client.post(
                "/v1/completions", json={"model": "m-other", "prompt": "x", "max_tokens": 2}
            )
            assert response.status_code == 404
        else:
            assert not result.ok
            assert "$.engines[1].wire" in (result.error or "")
            assert names == {"keep", "other"}


async def test_sighup_reloads(tmp_path: Path) -> None:
    path = tmp_path / "smgd.toml"
    path.write_text(config_text(engine_toml("a", "m-a")))
    async with running_daemon(path, install_signals=True) as (daemon, client):
        gateway = daemon.gateway
        before = gateway.reloads_total
        os.kill(os.getpid(), signal.SIGHUP)
        with trio.fail_after(10):
            while gateway.reloads_total == before:  # noqa: ASYNC110 - counter, no event
                await trio.sleep(0.02)
        assert gateway.reload_failures_total == 0
        text, _, _ = await stream_completion(client, "m-a", PROMPT, 3)
        assert text


async def test_sigterm_drains_in_flight_streams_and_exits_0(tmp_path: Path) -> None:
    path = tmp_path / "smgd.toml"
    path.write_text(config_text(engine_toml("a", "m-a", step_ms=20), drain_s=20))
    proc = serve_process(path)
    try:
        url = await wait_url(proc)
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            with trio.fail_after(30):
                while (await client.get("/readiness")).status_code != 200:  # noqa: ASYNC110
                    await trio.sleep(0.1)
            results: list[int] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream_many, client, "m-a", 8, 50, results)
                await trio.sleep(0.3)
                proc.send_signal(signal.SIGTERM)
                await trio.sleep(0.2)
                ready = await client.get("/readiness")
                assert ready.status_code == 503
                refused = await client.post(
                    "/v1/completions", json={"model": "m-a", "prompt": "x", "max_tokens": 2}
                )
                assert refused.status_code == 503
            assert results == [50] * 8  # 50 steps x 20 ms = 1 s, inside the 20 s drain
        code = await trio.to_thread.run_sync(proc.wait, 30)
        assert code == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.parametrize("listener", ["server", "admin"])
async def test_port_in_use_names_the_address_and_launches_no_engine(
    tmp_path: Path, listener: str
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        path = tmp_path / "smgd.toml"
        text = config_text(engine_toml("a", "m-a"))
        if listener == "server":
            text = text.replace("port = 0", f"port = {port}")
        else:
            text = text.replace("[logging]", f"[admin]\nport = {port}\n[logging]")
        path.write_text(text.replace('level = "warning"', 'level = "info"'))
        proc = serve_process(path)
        _, err = await trio.to_thread.run_sync(lambda: proc.communicate(timeout=60))
    assert proc.returncode == 1
    assert f"smgd: cannot listen on 127.0.0.1:{port}: Address already in use" in err
    assert f"choose another {listener}.port)" in err  # the key of the listener that failed
    assert "launching" not in err  # the port is bound before any engine is launched
    assert "Traceback" not in err


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_bind_error_names_host_and_port(host: str) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as busy:
        busy.bind((host, 0))
        busy.listen()
        port = busy.getsockname()[1]
        gateway = Gateway.from_config(Config(server=ServerConfig(host=host, port=port)))
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        with pytest.raises(TransportError, match=re.escape(f"cannot listen on {where}: ")):
            bind_public(gateway)
        with pytest.raises(TransportError, match=re.escape(f"cannot listen on {where}: ")):
            reuseport_sockets(host, port, 2)  # the supervisor's bind, with server.workers > 1


async def test_reload_applies_api_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "smgd.toml"
    text = config_text(engine_toml("a", "m-a"))
    path.write_text(text)
    body = {"model": "m-a", "prompt": "hi", "max_tokens": 2}
    async with running_daemon(path) as (daemon, client):
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        monkeypatch.setenv("SMGD_TEST_KEYS", "k1,k2")
        run_line, rest = text.split("\n", 1)
        path.write_text(
            run_line
            + "\n"
            + rest.replace("[server]\n", '[server]\napi_keys_env = "SMGD_TEST_KEYS"\n')
        )
        result = await daemon.reload()
        assert result.ok, result.error
        assert (await client.post("/v1/completions", json=body)).status_code == 401
        ok = await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer k2"})
        assert ok.status_code == 200


async def test_killed_engine_fails_only_its_streams_and_comes_back(tmp_path: Path) -> None:
    path = tmp_path / "smgd.toml"
    path.write_text(
        config_text(engine_toml("a", "m-a", step_ms=10), engine_toml("b", "m-b", step_ms=10))
    )
    async with running_daemon(path) as (daemon, client):
        gateway = daemon.gateway
        outcomes: dict[str, list[str]] = {"m-a": [], "m-b": []}

        async def one(model: str) -> None:
            try:
                _, usage, _ = await stream_completion(client, model, PROMPT, 300)
                outcomes[model].append(f"ok {usage['completion_tokens'] if usage else None}")
            except AssertionError as exc:
                outcomes[model].append(f"error {exc}")

        async with trio.open_nursery() as nursery:
            for model in ("m-a", "m-b"):
                for _ in range(8):
                    nursery.start_soon(one, model)
            await trio.sleep(0.5)
            engine_a = gateway.router.get("a")
            assert engine_a is not None and engine_a.child is not None  # type: ignore[attr-defined]
            os.kill(engine_a.child.pid, signal.SIGKILL)  # type: ignore[attr-defined]
            with trio.fail_after(5):
                while (ready := await client.get("/readiness")).status_code != 503:  # noqa: ASYNC110
                    await trio.sleep(0.05)
            assert ready.json()["engines"]["a"]["ready"] is False
            assert ready.json()["engines"]["b"]["ready"] is True
        assert outcomes["m-b"] == ["ok 300"] * 8  # the other engine's streams are untouched
        assert len(outcomes["m-a"]) == 8
        assert all(o.startswith("error") and "engine a" in o for o in outcomes["m-a"])
        with trio.fail_after(30):  # relaunched after a 1 s backoff
            while (await client.get("/readiness")).status_code != 200:  # noqa: ASYNC110
                await trio.sleep(0.1)
        _, usage, _ = await stream_completion(client, "m-a", PROMPT, 5)
        assert usage is not None and usage["completion_tokens"] == 5
        assert gateway.engine_restarts == {"a": 1}


async def test_admin_endpoints_are_not_on_the_public_listener(tmp_path: Path) -> None:
    path = tmp_path / "smgd.toml"
    path.write_text(config_text(engine_toml("a", "m-a")))
    async with running_daemon(path) as (daemon, client):
        gateway = daemon.gateway
        for route in ("/admin/reload", "/admin/drain"):
            assert (await client.post(route)).status_code == 404
        assert (await client.get("/admin/engines")).status_code == 404
        assert not gateway.draining
        sock = daemon.admin_binds[0]
        assert sock.startswith("http://unix:")
        transport = httpx.AsyncHTTPTransport(uds=sock[len("http://unix:") :])
        async with httpx.AsyncClient(transport=transport, base_url="http://admin") as admin:
            engines = (await admin.get("/admin/engines")).json()
        assert [e["name"] for e in engines["engines"]] == ["a"]


async def test_the_admin_listener_reloads_and_drains_through_the_daemon(tmp_path: Path) -> None:
    """The admin app writes no gateway field: its reload and drain are the daemon's."""
    path = tmp_path / "smgd.toml"
    path.write_text(config_text(engine_toml("a", "m-a")))
    async with running_daemon(path) as (daemon, client):
        gateway = daemon.gateway
        transport = httpx.AsyncHTTPTransport(uds=daemon.admin_binds[0][len("http://unix:") :])
        async with httpx.AsyncClient(transport=transport, base_url="http://admin") as admin:
            reloaded = await admin.post("/admin/reload")
            assert reloaded.status_code == 200 and reloaded.json()["ok"] is True
            assert (gateway.reloads_total, gateway.reload_failures_total) == (1, 0)
            path.write_text(path.read_text().replace('wire = "mock"', 'wire = "tgi"'))
            refused = await admin.post("/admin/reload")
            assert refused.status_code == 400 and "$.engines[0].wire" in refused.json()["error"]
            assert (gateway.reloads_total, gateway.reload_failures_total) == (2, 1)
            assert (await client.get("/readiness")).status_code == 200
            drained = await admin.post("/admin/drain")
            assert drained.json() == {"draining": True}
        assert gateway.draining and gateway.drain_event.is_set()
        assert (await client.get("/readiness")).status_code == 503  # within drain_settle_s


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            '[engines.launch]\nkind = "command"\ncommand = ["/nonexistent/engine"]\n',
            "cannot launch",
        ),
        ("", "cannot create ipc directory"),
    ],
)
async def test_startup_failures_exit_nonzero_with_a_clear_message(
    tmp_path: Path, extra: str, needle: str
) -> None:
    text = config_text(engine_toml("a", "m-a", extra=extra))
    if extra:  # a real-engine wire, so the launch command (not the built-in mock) is used
        text = text.replace('wire = "mock"', 'wire = "sglang"')
    else:  # an ipc directory that cannot be created
        text = 'run_dir = "/proc/smgd-cannot-exist"\n' + text.split("\n", 1)[1]
    path = tmp_path / "smgd.toml"
    path.write_text(text)
    proc = serve_process(path)
    try:
        _, err = await trio.to_thread.run_sync(lambda: proc.communicate(timeout=60))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1
    assert needle in err
    assert "Traceback" not in err


async def test_a_config_error_found_while_starting_exits_2_naming_the_key(tmp_path: Path) -> None:
    """Past load_config: a model directory without a tokenizer is found when the daemon loads
    it; that is still a config error (exit 2, one line with the key), not a crash (exit 1)."""
    empty = tmp_path / "no-model"
    empty.mkdir()
    path = tmp_path / "smgd.toml"
    path.write_text(config_text(engine_toml("a", "m-a")).replace(str(TINY_MODEL_DIR), str(empty)))
    proc = serve_process(path)
    try:
        _, err = await trio.to_thread.run_sync(lambda: proc.communicate(timeout=60))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("smgd: ")]
    assert line.startswith("smgd: config error at $.engines[0].model_dir: ")
    assert "Traceback" not in err
