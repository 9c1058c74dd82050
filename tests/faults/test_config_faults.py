"""Fault suite: configurations that must not start, and the defaults a new user runs.

A key source that is configured but yields no key, and a value no deployment could mean, stop
``smgd serve`` with exit 2 and the key path on stderr before anything is launched or listens.
From a directory without a config file, ``smgd serve`` runs the built-in default and answers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
import pytest
import trio

from smgd.api.http.app import PREFIX_ROUTES, ROUTES, admin_routes

from ..engine_harness import short_ipc_dir
from .harness import daemon_toml, kill_tree, mock_engine_toml, serve, stream

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

    from smgd.api.http.dispatch import Route
    from smgd.reload import ReloadResult

    # (method, path, JSON body or None)
    Request = tuple[str, str, dict[str, object] | None]

pytestmark = pytest.mark.slow

# An env var name no test environment sets: a key source pointing at it yields nothing.
UNSET = "SMGD_FAULT_TEST_UNSET_VAR"
# A refused config exits in well under a second (python start-up + load); the bound is for a
# loaded 2-core CI machine.
REFUSE_TIMEOUT_S = 30.0


async def refused(tmp_path: Path, config_text: str, *args: str) -> str:
    """Run ``smgd serve`` on ``config_text``; assert it exits 2 before starting anything."""
    path = tmp_path / "smgd.toml"
    path.write_text(config_text)
    env = {k: v for k, v in os.environ.items() if k != UNSET}
    with trio.fail_after(REFUSE_TIMEOUT_S):
        done = await trio.run_process(
            [sys.executable, "-m", "smgd", "serve", "--config", str(path), *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=env,
        )
    err = done.stderr.decode()
    assert done.returncode == 2, err
    # Nothing was launched or bound: no engine launch, no listener, no banner.
    assert "launching" not in err
    assert "Running on" not in err
    assert "listening" not in err
    assert "Traceback" not in err
    return err


# -------------------------------------------------------------------- auth fails closed


async def test_api_keys_env_unset_is_refused(tmp_path: Path) -> None:
    config = daemon_toml(mock_engine_toml("e0", "m"), extra_server=f'api_keys_env = "{UNSET}"\n')
    err = await refused(tmp_path, config)
    assert f"config error at $.server.api_keys_env: {UNSET} is unset or empty" in err


async def test_api_keys_env_flag_unset_is_refused(tmp_path: Path) -> None:
    err = await refused(
        tmp_path, daemon_toml(mock_engine_toml("e0", "m")), "--server-api-keys-env", UNSET
    )
    assert "$.server.api_keys_env" in err


async def test_refusal_is_a_json_line_in_json_mode(tmp_path: Path) -> None:
    config = daemon_toml(mock_engine_toml("e0", "m"), extra_server=f'api_keys_env = "{UNSET}"\n')
    err = await refused(tmp_path, config, "--logging-format", "json")
    (line,) = err.strip().splitlines()
    record = json.loads(line)
    assert record["level"] == "error"
    assert f"$.server.api_keys_env: {UNSET} is unset or empty" in record["msg"]


async def test_api_keys_file_with_only_a_comment_is_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# keys go here\n")
    config = daemon_toml(mock_engine_toml("e0", "m"), extra_server=f'api_keys_file = "{keys}"\n')
    err = await refused(tmp_path, config)
    assert "config error at $.server.api_keys_file" in err
    assert "holds no key" in err


async def test_admin_token_env_unset_on_tcp_is_refused(tmp_path: Path) -> None:
    admin = f'[admin]\nport = {_free_port()}\ntoken_env = "{UNSET}"\n'
    err = await refused(tmp_path, daemon_toml() + admin + mock_engine_toml("e0", "m"))
    assert f"config error at $.admin.token_env: {UNSET} is unset or empty" in err


# The public routes open without a key (docs/reference/http-api.md, Auth "no"): the probes,
# the metrics scrape and the load report, for load balancers and scrapers. Every other route of
# the app's table needs one, so a route added to the table is checked as guarded unless it is
# added here.
OPEN_ROUTES = frozenset(("/health", "/liveness", "/readiness", "/metrics", "/get_load"))


def _requests(routes: Mapping[str, Route], prefix_routes: Mapping[str, Route]) -> list[Request]:
    """A request for every route of a route table: GET where the route takes it, else POST
    with an empty JSON object (refused by the handler, after the key check); a prefix route's
    template with the model's id in place of its part in braces."""
    paths = [*routes.items()]
    paths += [(t[: t.index("{")] + "m", route) for t, route in prefix_routes.items()]
    return [
        ("GET", path, None) if "GET" in route.methods else ("POST", path, {})
        for path, route in paths
    ]


async def _no_reload() -> ReloadResult:
    raise AssertionError("only the admin route table is read")


def _no_drain() -> None:
    raise AssertionError("only the admin route table is read")


async def test_keys_guard_every_route_with_any_case_of_bearer(tmp_path: Path) -> None:
    """Every route of the public app's table: the probes, metrics and load report (and only
    those) answer 200 without a key; every other route answers 401 (the envelope's
    ``authentication_error`` and ``WWW-Authenticate: Bearer``) without a key, with a wrong one
    and with a key but no scheme, and lets the request through to its handler with a right key
    whatever the case of ``Bearer`` (a GET is served, a POST of ``{}`` refused with a 400).
    Every route of the admin listener: 401 without its token or with a wrong one; served with
    it (the drain last: it ends the daemon)."""
    admin_port = _free_port()
    engine = mock_engine_toml("e0", "m")
    config = (
        daemon_toml(extra_server='api_keys_env = "SMGD_FAULT_KEYS"\n')
        + f'[admin]\nport = {admin_port}\ntoken_env = "SMGD_FAULT_ADMIN"\n'
        + engine
    )
    env = {"SMGD_FAULT_KEYS": "k1,k2", "SMGD_FAULT_ADMIN": "tok"}
    public = _requests(ROUTES, PREFIX_ROUTES)
    assert {path for _, path, _ in public} >= OPEN_ROUTES  # each names a route that exists
    async with serve(tmp_path, config, env=env) as daemon, daemon.client() as client:
        for method, path, json_body in public:
            bare = await client.request(method, path, json=json_body)
            if path in OPEN_ROUTES:
                assert bare.status_code == 200, (path, bare.text)
                continue
            for headers in ({}, {"Authorization": "Bearer k3"}, {"Authorization": "k2"}):
                refused = await client.request(method, path, json=json_body, headers=headers)
                assert refused.status_code == 401, (path, headers, refused.text)
                assert refused.json()["error"]["type"] == "authentication_error"
                assert refused.headers["www-authenticate"] == "Bearer"
            for scheme in ("Bearer", "bearer", "BEARER"):
                headers = {"Authorization": f"{scheme} k2"}
                let_in = await client.request(method, path, json=json_body, headers=headers)
                # The handler's own answer: a GET served, an empty body refused.
                expected = 200 if method == "GET" else 400
                assert let_in.status_code == expected, (path, scheme, let_in.text)
        # A whole request with each case of the scheme, streamed and not.
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        for scheme in ("Bearer", "bearer", "BEARER"):
            headers = {"Authorization": f"{scheme} k1"}
            assert (
                await client.post("/v1/completions", json=body, headers=headers)
            ).status_code == 200
            streamed = await client.post(
                "/v1/completions", json={**body, "stream": True}, headers=headers
            )
            assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        admin = f"http://127.0.0.1:{admin_port}"
        admin_table = admin_routes(_no_reload, _no_drain)
        async with httpx.AsyncClient(base_url=admin, timeout=30) as admin_client:
            for method, path, json_body in _requests(admin_table, {}):
                for headers in ({}, {"Authorization": "Bearer tik"}):
                    refused = await admin_client.request(
                        method, path, json=json_body, headers=headers
                    )
                    assert refused.status_code == 401, (path, headers, refused.text)
            ok = await admin_client.post("/admin/reload", headers={"Authorization": "bearer tok"})
            assert ok.status_code == 200, ok.text
            engines = await admin_client.get(
                "/admin/engines", headers={"Authorization": "BEARER tok"}
            )
            assert engines.status_code == 200, engines.text
            # Last: the drain ends the daemon.
            drained = await admin_client.post(
                "/admin/drain", headers={"Authorization": "Bearer tok"}
            )
            assert drained.status_code == 200 and drained.json() == {"draining": True}
        assert await daemon.wait_exit(30) == 0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -------------------------------------------------------------------- impossible values


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (("--server-max-body-bytes", "-5"), "$.server.max_body_bytes"),
        (("--server-drain-timeout-s", "nan"), "$.server.drain_timeout_s"),
        (("--server-drain-timeout-s", "-1"), "$.server.drain_timeout_s"),
        (("--server-keepalive-interval-s", "inf"), "$.server.keepalive_interval_s"),
        (("--set", "engines.0.mock.step_ms=-3"), "$.engines[0].mock.step_ms"),
        (("--set", "engines.0.max_queue=-1"), "$.engines[0].max_queue"),
        (("--set", "engines.0.mock.max_model_len=0"), "$.engines[0].mock.max_model_len"),
        (("--set", f'run_dir="/tmp/{"r" * 100}"'), "$.run_dir"),
        (("--logging-level", "verbose"), "$.logging.level"),
    ],
)
async def test_impossible_values_are_refused(
    tmp_path: Path, args: tuple[str, ...], key: str
) -> None:
    err = await refused(tmp_path, daemon_toml(mock_engine_toml("e0", "m")), *args)
    assert f"config error at {key}:" in err
    assert len(err.strip().splitlines()) == 1
    if key == "$.logging.level":
        assert "round_robin" not in err and "debug" in err


# -------------------------------------------------------------------- check-config as serve


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ('chat_template = "gone.jinja"\n', "$.engines[0].chat_template"),
        ('tokenizer_dir = "."\n', "$.engines[0].tokenizer_dir"),  # no tokenizer.json there
        (None, "$.engines"),  # no [[engines]] at all
    ],
)
async def test_check_config_refuses_what_serve_refuses(
    tmp_path: Path, extra: str | None, key: str
) -> None:
    engines = () if extra is None else (mock_engine_toml("e0", "m", extra=extra),)
    err = await refused(tmp_path, daemon_toml(*engines))
    with trio.fail_after(REFUSE_TIMEOUT_S):
        checked = await trio.run_process(
            [sys.executable, "-m", "smgd", "check-config", str(tmp_path / "smgd.toml")],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert checked.returncode == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"smgd: config error at {key}: ")
    assert checked.stderr.decode() == line + "\n"  # the same error, word for word


# -------------------------------------------------------------------- the defaults


@dataclass
class Running:
    proc: trio.Process
    url: str = ""
    lines: list[str] = field(default_factory=list)


@asynccontextmanager
async def serve_in(cwd: Path, *args: str) -> AsyncIterator[Running]:
    """``smgd serve ARGS`` with ``cwd`` as its working directory and no $SMGD_CONFIG; reads the
    URL from the banner, plain or JSON."""
    env = {k: v for k, v in os.environ.items() if k != "SMGD_CONFIG"}
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "smgd", "serve", *args],
        cwd=str(cwd),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    running = Running(proc)
    listening = trio.Event()

    async def pump() -> None:
        assert proc.stderr is not None
        pending = b""
        try:
            async for data in proc.stderr:
                pending += data
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace")
                    running.lines.append(line)
                    if line.startswith("smgd listening on "):
                        running.url = line.split()[-1]
                    elif line.startswith("{") and "url" in (record := json.loads(line)):
                        running.url = record["url"]
                    if running.url:
                        listening.set()
        finally:
            listening.set()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump)
            with trio.fail_after(30):
                await listening.wait()
            assert running.url, "\n".join(running.lines)
            yield running
            nursery.cancel_scope.cancel()
    finally:
        await kill_tree(proc)


async def wait_ready(client: httpx.AsyncClient) -> None:
    with trio.fail_after(30):
        while True:
            with suppress(httpx.TransportError):
                if (await client.get("/readiness")).status_code == 200:
                    return
            await trio.sleep(0.05)


async def test_serve_without_a_config_file_answers_from_any_directory(tmp_path: Path) -> None:
    # What a user gets after `pip install .` in a directory of their own: the built-in default
    # (mock engine + packaged tiny model), said so in the log, answering a completion.
    run_dir = short_ipc_dir()
    async with (
        serve_in(tmp_path, "--server-port", "0", "--set", f'run_dir="{run_dir}"') as running,
        httpx.AsyncClient(base_url=running.url, timeout=30) as client,
    ):
        await wait_ready(client)
        outcome = await stream(client, "tiny-mock", "Hello, smgd!", 8)
    assert outcome.status == 200 and outcome.done, outcome
    assert outcome.usage is not None and outcome.usage["completion_tokens"] == 8
    assert any("built-in default" in line for line in running.lines)


async def test_json_logging_writes_only_json_lines(tmp_path: Path) -> None:
    run_dir = short_ipc_dir()
    async with serve_in(
        tmp_path,
        "--server-port", "0",
        "--set", f'run_dir="{run_dir}"',
        "--logging-format", "json",
        "--server-drain-settle-s", "0",
    ) as running, httpx.AsyncClient(base_url=running.url, timeout=30) as client:  # fmt: skip
        await wait_ready(client)
        assert (await stream(client, "tiny-mock", "hi", 4)).done
        running.proc.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            assert await running.proc.wait() == 0
    assert len(running.lines) > 5
    for line in running.lines:
        record = json.loads(line)  # every line, the banner and the drain included
        assert {"ts", "level", "msg"} <= set(record)
    assert any(json.loads(line).get("url") == running.url for line in running.lines)


@pytest.mark.parametrize("interval", [None, 0.2])
async def test_keepalive_comments_only_when_configured(
    tmp_path: Path, interval: float | None
) -> None:
    # SGLang's bench_serving json-decodes every line after `data: `; a ": keep-alive" comment
    # broke it whenever a token took longer than the interval. By default there are none (that
    # the default is off, whatever the wait, is tested on the autojump clock in
    # tests/test_api_stream.py); set, they arrive while a 0.6 s step runs.
    extra = "" if interval is None else f"keepalive_interval_s = {interval}\n"
    config = daemon_toml(mock_engine_toml("e0", "m", step_ms=600.0), extra_server=extra)
    async with serve(tmp_path, config) as daemon, daemon.client() as client:
        body = {"model": "m", "prompt": "hello there", "max_tokens": 2, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    comments = [line for line in lines if line.startswith(":")]
    if interval is None:
        assert comments == []
        for line in lines[:-1]:  # what bench_serving does with every line
            json.loads(line.removeprefix("data: "))
    else:
        assert len(comments) >= 2 and set(comments) == {": keep-alive"}
